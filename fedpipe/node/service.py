"""The Node gRPC service: loads stages, runs them, moves their tensors.

Each loaded stage runs its :class:`~fedpipe.runtime.stage.StageRunner` in a
thread of its own. Tensors that arrive (``Send``) wait in a :class:`Mailbox`
until the stage takes them; outgoing tensors go through one
:class:`PeerSender` per peer address, a stream that keeps compute and
communication overlapped and many tensors in flight on a slow link.
"""
from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import cloudpickle
import grpc
import torch
from torch import nn

from .. import net
from ..net.emulation import LinkProfile
from ..proto import node_pb2, node_pb2_grpc, tracker_pb2
from ..runtime.allreduce import GradientSync
from ..runtime.async_stage import AsyncStageRunner
from ..runtime.clip import NORM, GlobalNormClip
from ..runtime.diloco import OUTER, OuterSync
from ..runtime.stage import ACTIVATION, GRADIENT, INPUT, REDUCE, TARGET, StageError, StageRunner
from ..spec import JobSpec
from ..wire import WireError, codecs, frames
from .mailbox import Mailbox, Stopped

log = logging.getLogger(__name__)

KINDS = {node_pb2.KIND_INPUT: INPUT, node_pb2.KIND_TARGET: TARGET,
         node_pb2.KIND_ACTIVATION: ACTIVATION, node_pb2.KIND_GRADIENT: GRADIENT,
         node_pb2.KIND_REDUCE: REDUCE, node_pb2.KIND_OUTER: OUTER, node_pb2.KIND_NORM: NORM}
KIND_CODES = {v: k for k, v in KINDS.items()}
MAX_PROBE_BYTES = 64 * 2**20
"""Largest link-measurement probe a node sends or accepts, bytes."""


class PeerSender:
    """Streams tensors to one peer's ``Send`` RPC.

    Tensors are encoded in submission order on a background thread and their
    frames written to one long-lived client stream per peer, so a tensor costs
    no call set-up and no round trip: over a link of one-way latency ``L``
    tensors follow each other as fast as the link carries them, each arriving
    ``L`` after it was sent, where a blocking call per tensor would pay ``2 L``
    each. The peer's ``Send`` reads any number of tensors from a stream.
    :meth:`flush` ends the stream and waits for the peer's reply (everything
    was received); the next tensor opens a new stream.

    Lossy codecs on gradients use error feedback: the residual is kept per
    link (this sender), per microbatch slot and shape, so what the codec drops
    is sent later instead of lost (:class:`fedpipe.wire.codecs.ErrorFeedback`).
    The first failed stream is kept and raised (as StageError) by the next
    :meth:`submit` or :meth:`flush`.
    """

    END = None

    def __init__(self, address: str, shaper=None):
        self.address = address
        self.channel = net.channel(address, shaper)
        self.stub = node_pb2_grpc.NodeStub(self.channel)
        self.encoder = futures.ThreadPoolExecutor(1, thread_name_prefix=f"send-{address}")
        self.error: Exception | None = None
        self.stream: tuple[queue.SimpleQueue, grpc.Future] | None = None  # encoder thread only
        self.feedback = codecs.ErrorFeedback()

    def submit(self, envelope: node_pb2.Envelope, tensor: torch.Tensor, codec: str) -> None:
        """Queue ``tensor`` for the peer, encoded with ``codec``.

        Raises:
            StageError: an earlier send to this peer failed.
        """
        self.check()
        self.encoder.submit(self._send, envelope, tensor, codec)

    def _send(self, envelope, tensor, codec):
        try:
            if envelope.kind == node_pb2.KIND_GRADIENT:
                key = (envelope.stage, envelope.microbatch, tuple(tensor.shape))
                msg, payload = codecs.encode_payload(tensor, codec, feedback=self.feedback,
                                                     key=key)
            else:
                msg, payload = codecs.encode_payload(tensor, codec)
            if self.stream is None:
                frames_out = queue.SimpleQueue()
                # no deadline: the stream lives as long as the stage sends; the
                # channel's keepalive notices a peer that is gone
                call = self.stub.Send.future(iter(frames_out.get, self.END),
                                             wait_for_ready=True)
                call.add_done_callback(self._ended)
                self.stream = (frames_out, call)
            for frame in frames.to_frames(msg, payload=payload, envelope=envelope):
                self.stream[0].put(frame)
        except Exception as e:  # kept for the stage thread, which reports it
            self.error = self.error or e

    def _ended(self, call: grpc.Future) -> None:
        if call.exception() is not None:
            self.error = self.error or call.exception()

    def _close_stream(self) -> grpc.Future | None:
        """End the open stream (encoder thread); return its call."""
        if self.stream is None:
            return None
        frames_out, call = self.stream
        self.stream = None
        frames_out.put(self.END)
        return call

    def check(self) -> None:
        """Raise StageError if a send to this peer failed."""
        if self.error is not None:
            detail = self.error.details() if isinstance(self.error, grpc.RpcError) else self.error
            raise StageError(f"sending to {self.address} failed: {detail}")

    def flush(self) -> None:
        """Wait until the peer has every queued tensor. Raises StageError if a send failed."""
        call = self.encoder.submit(self._close_stream).result()
        if call is not None:
            self._ended(call)  # waits for the peer's reply
        self.check()

    def close(self) -> None:
        """Stop sending: queued tensors are dropped and an open stream is cancelled."""
        self.encoder.shutdown(wait=False, cancel_futures=True)
        stream = self.stream
        if stream is not None:
            stream[0].put(self.END)
            stream[1].cancel()
        self.channel.close()


@dataclass
class Stage:
    """A loaded stage: its layers, runner, peers and thread."""

    job_id: str
    replica: int
    index: int
    n_stages: int
    layer_start: int
    module: nn.Module
    steps: int = 0
    runner: StageRunner | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    senders: dict[str, PeerSender] = field(default_factory=dict)

    @property
    def slot(self) -> tuple[str, int, int]:
        return (self.job_id, self.replica, self.index)

    def sender(self, peer: node_pb2.StageAssignment, shaper=None) -> PeerSender:
        """The stage's sender to ``peer`` (one per address)."""
        if peer.address not in self.senders:
            self.senders[peer.address] = PeerSender(peer.address, shaper)
        return self.senders[peer.address]


def measure_link(address: str, shaper=None, *, pings: int = 5, max_bytes: int = 4 * 2**20,
                 seconds: float = 0.5) -> tuple[float, float]:
    """Latency (one way, s) and bandwidth (bytes/s) to the node at ``address``.

    Latency is half the median round trip of ``pings`` small Ping calls.
    Bandwidth is timed over the data path itself (Send of a probe tensor,
    chunked and decoded like an activation): a 256 KiB probe gives a first
    estimate, then a probe sized to take about ``seconds`` (at most
    ``max_bytes``) gives the figure, net of one round trip.

    Raises:
        grpc.RpcError: the peer is unreachable.
    """
    ch = net.channel(address, shaper)
    try:
        stub = node_pb2_grpc.NodeStub(ch)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            stub.Ping(node_pb2.PingRequest(), timeout=30)
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        env = node_pb2.Envelope(kind=node_pb2.KIND_PROBE)

        def probe(nbytes: int) -> float:
            probe_frames = list(frames.encode_frames(torch.zeros(nbytes, dtype=torch.uint8),
                                                     envelope=env))
            t0 = time.perf_counter()
            stub.Send(iter(probe_frames), timeout=120)
            return max(time.perf_counter() - t0 - rtt, 1e-6)

        first = 256 * 1024
        estimate = first / probe(first)
        size = int(min(max_bytes, max(first, estimate * seconds)))
        return rtt / 2, size / probe(size)
    finally:
        ch.close()


class StageTransport:
    """:class:`~fedpipe.runtime.stage.Transport` over the node's mailbox and peer senders."""

    def __init__(self, stage: Stage, mailbox: Mailbox, device: torch.device,
                 prev: node_pb2.StageAssignment | None, mine: node_pb2.StageAssignment,
                 nxt: node_pb2.StageAssignment | None,
                 sender: Callable[[node_pb2.StageAssignment], PeerSender]):
        self.stage, self.mailbox, self.device = stage, mailbox, device
        # the plan gives each stage the codecs of what it sends
        self.routes = {ACTIVATION: (nxt, mine.activation_codec or "raw"),
                       GRADIENT: (prev, mine.gradient_codec or "raw")}
        self.sender = sender

    def recv(self, kind, step, microbatch, timeout: float | None = None):
        """As :meth:`Transport.recv`; TimeoutError if nothing came within ``timeout`` s."""
        t, batch = self.mailbox.get(self.stage.slot, kind, step, microbatch,
                                    stopped=self._stopped, timeout=timeout)
        return t.to(self.device), batch

    def _stopped(self) -> bool:
        """Whether to give up waiting: the stage was stopped; StageError if a send failed
        (the peer will not answer what it never got)."""
        for s in list(self.stage.senders.values()):
            s.check()
        return self.stage.stop.is_set()

    def send(self, kind, step, microbatch, tensor, batch_size):
        peer, codec = self.routes[kind]
        self.send_to(peer, kind, step, microbatch, tensor, batch_size, codec)

    def send_to(self, peer: node_pb2.StageAssignment, kind: str, step: int, tag: int,
                tensor: torch.Tensor, batch_size: int = 1, codec: str = "raw") -> None:
        """Queue ``tensor`` for stage ``peer`` (any replica group)."""
        env = node_pb2.Envelope(job_id=self.stage.job_id, replica=peer.replica,
                                stage=peer.stage, kind=KIND_CODES[kind], step=step,
                                microbatch=tag, batch_size=batch_size)
        self.sender(peer).submit(env, tensor, codec)


class NodeService(node_pb2_grpc.NodeServicer):
    """The Node service of one node process.

    Args:
        node_id: returns the tracker-assigned id (known after registration).
        name: this node's name (what link profiles and peers call it).
        resources: what :func:`fedpipe.node.probe.probe` measured.
        report: sends a StageReport to the tracker (may block briefly).
        trust_code: load pickled layers from any peer, not only loopback ones.
        input_capacity: inputs/targets a stage may have queued before Send blocks.
        links: an emulated link profile for this node's outgoing traffic.
    """

    def __init__(self, node_id: Callable[[], str], name: str, resources: node_pb2.Resources,
                 report: Callable[[tracker_pb2.StageReport], None], *, trust_code: bool = False,
                 input_capacity: int = 64, links: LinkProfile | None = None):
        self.node_id, self.name, self.resources, self.report = node_id, name, resources, report
        self.links = links
        self.trust_code = trust_code
        self.device = torch.device(resources.device or "cpu")
        self.mailbox = Mailbox(input_capacity, bounded=(INPUT, TARGET))
        self.stages: dict[tuple[str, int, int], Stage] = {}
        self.lock = threading.Lock()

    # -- control plane ------------------------------------------------------
    def Probe(self, request, context):
        return self.resources

    def LoadStage(self, request, context):
        if not (self.trust_code or net.is_loopback_peer(context.peer())):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"refusing pickled model code from {context.peer()}: start the node "
                          "with --trust-code to accept code from non-loopback peers")
        slot = (request.job_id, request.replica, request.stage)
        with self.lock:
            if slot in self.stages:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"stage {slot} is already loaded")
        try:
            stage = self._build(request)
        except BaseException as e:  # noqa: BLE001 — user code (even sys.exit) is the caller's error
            log.exception("cannot load stage %s", slot)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"cannot load stage {request.stage}: {type(e).__name__}: {e}")
        with self.lock:
            self.stages[slot] = stage
        stage.thread = threading.Thread(target=self._run, args=(stage, request.config.steps),
                                        name=f"stage-{request.stage}", daemon=True)
        stage.thread.start()
        log.info("loaded job %s stage %d/%d (layers %d..%d)", request.job_id, request.stage,
                 stage.n_stages, stage.layer_start, stage.layer_start + len(stage.module) - 1)
        return node_pb2.LoadStageReply()

    def _build(self, request) -> Stage:
        cfg = JobSpec.from_proto(request.config).validate()  # before unpickling anything
        plan, r = request.plan, request.replica
        peers = {(a.replica, a.stage): a for a in plan.stages}
        mine = peers[(r, request.stage)]
        n_stages = sum(1 for a in plan.stages if a.replica == r)
        layers = [cloudpickle.loads(blob) for blob in request.layers]
        module = nn.Sequential(*layers).to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = cloudpickle.loads(cfg.optimizer).build(params) if params else None
        schedule = (cloudpickle.loads(cfg.lr_scheduler).build(opt)
                    if opt is not None and cfg.lr_scheduler else None)
        last = request.stage == n_stages - 1
        loss_fn = cloudpickle.loads(cfg.loss_fn) if last else None
        stage = Stage(request.job_id, r, request.stage, n_stages, mine.layer_start, module,
                      cfg.steps)
        transport = StageTransport(stage, self.mailbox, self.device,
                                   peers.get((r, request.stage - 1)), mine,
                                   peers.get((r, request.stage + 1)),
                                   lambda peer: stage.sender(peer, self._shaper(peer.node_name)))
        sync = after = None
        all_stages = [(a.replica, a.stage, a.layer_start, a.layer_end) for a in plan.stages]
        groups = len({a.replica for a in plan.stages})
        if cfg.replica_sync == "diloco":  # "auto" is resolved by the tracker; else all-reduce
            shares = [plan.replicas[g].samples if g < len(plan.replicas)
                      and plan.replicas[g].samples else 1 for g in range(groups)]
            after = OuterSync(
                module, mine.layer_start, r, request.stage, all_stages,
                cfg.diloco, shares,
                send=lambda rr, ss, k, tag, t, codec: transport.send_to(
                    peers[(rr, ss)], OUTER, k, tag, t, codec=codec),
                recv=lambda k, tag, timeout: transport.recv(OUTER, k, tag, timeout)[0],
                last_step=cfg.steps - 1)
            sync = after.rescale_gradients
        elif groups > 1:
            sync = GradientSync(
                module, mine.layer_start, r, request.stage, all_stages,
                send=lambda rr, ss, step, tag, t: transport.send_to(peers[(rr, ss)], REDUCE,
                                                                    step, tag, t),
                recv=lambda step, tag: transport.recv(REDUCE, step, tag)[0])
        microbatches = cfg.microbatches
        if r < len(plan.replicas) and plan.replicas[r].microbatches:
            microbatches = plan.replicas[r].microbatches
        runner, extra = StageRunner, {"lr_scheduler": schedule}
        if cfg.clip_grad_norm:  # every stage of the group, with or without parameters
            extra["clip"] = GlobalNormClip(params, cfg.clip_grad_norm, request.stage,
                                           {s: peers[(r, s)] for s in range(n_stages)
                                            if s != request.stage}, transport)
        if cfg.schedule == "async":
            runner, extra = AsyncStageRunner, {**extra, "max_staleness": cfg.max_staleness}
        stage.runner = runner(module, opt, loss_fn, cfg.schedule, request.stage, n_stages,
                              microbatches, transport, grad_sync=sync, after_step=after,
                              **extra)
        return stage

    def _shaper(self, peer_name: str):
        return self.links.shaper(self.name, peer_name) if self.links else None

    def _report(self, stage: Stage, status, **kw) -> None:
        self.report(tracker_pb2.StageReport(job_id=stage.job_id, replica=stage.replica,
                                            stage=stage.index, node_id=self.node_id(),
                                            status=status, **kw))

    def _run(self, stage: Stage, steps: int) -> None:
        R = tracker_pb2.StageReport
        try:
            for result in stage.runner.run(steps):
                if result.loss is not None:
                    self._report(stage, R.STATUS_STEP, step=result.step + 1, loss=result.loss,
                                 samples=result.samples, seconds=result.seconds)
            for s in stage.senders.values():
                s.flush()
            self._report(stage, R.STATUS_DONE, step=steps)
            log.info("job %s stage %d done", stage.job_id, stage.index)
        except Stopped:
            log.info("job %s stage %d stopped", stage.job_id, stage.index)
        except Exception as e:  # noqa: BLE001 — reported to the tracker, which fails the job
            log.exception("job %s stage %d failed", stage.job_id, stage.index)
            self._report(stage, R.STATUS_FAILED, error=f"{type(e).__name__}: {e}")
        finally:
            for s in stage.senders.values():
                s.close()
            self.mailbox.drop(lambda slot: slot == stage.slot)

    def StopJob(self, request, context):
        with self.lock:
            mine = [s for s in self.stages.values() if s.job_id == request.job_id]
            if request.release:
                for s in mine:
                    del self.stages[s.slot]
        for s in mine:
            s.stop.set()
        self.mailbox.drop(lambda slot: slot[0] == request.job_id)
        return node_pb2.StopJobReply()

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        with self.lock:
            for s in self.stages.values():
                s.stop.set()

    # -- data plane ---------------------------------------------------------
    def _admit(self, head: node_pb2.Frame, context) -> int:
        """Check a tensor's envelope before its payload is buffered; return its size limit.

        A probe may be at most :data:`MAX_PROBE_BYTES`; a stage's tensor needs a
        running stage, a known kind, a positive batch size, and a step and
        microbatch index the stage will ask for (others would sit in its
        bounded inbox for ever).
        """
        env = head.envelope
        if env.kind == node_pb2.KIND_PROBE:
            return MAX_PROBE_BYTES
        with self.lock:
            stage = self.stages.get((env.job_id, env.replica, env.stage))
        if stage is None or stage.stop.is_set():
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no running stage {env.stage} of job {env.job_id!r} "
                          f"(replica {env.replica}) on this node")
        if env.kind not in KINDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown envelope kind {env.kind}")
        if env.batch_size <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"envelope batch_size must be positive, got {env.batch_size}")
        if not 0 <= env.step < stage.steps or env.microbatch < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"step {env.step} / microbatch {env.microbatch} out of range for a "
                          f"job of {stage.steps} steps")
        return codecs.MAX_TENSOR_BYTES

    def Send(self, request_iterator, context):
        try:
            for head, tensor in frames.read_tensors(request_iterator,
                                                    lambda h: self._admit(h, context)):
                env = head.envelope
                if env.kind == node_pb2.KIND_PROBE:
                    continue  # a link measurement: it only had to arrive
                slot = (env.job_id, env.replica, env.stage)
                with self.lock:
                    stage = self.stages.get(slot)
                if stage is None:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"stage {slot} was released")
                self.mailbox.put(slot, KINDS[env.kind], env.step, env.microbatch, tensor,
                                 env.batch_size,
                                 alive=lambda: context.is_active() and not stage.stop.is_set())
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {e}")
        except KeyError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except Stopped as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        return node_pb2.SendReply()

    # -- link measurement ---------------------------------------------------
    def Ping(self, request, context):
        return node_pb2.PingReply()

    def MeasureLinks(self, request, context):
        out = node_pb2.MeasureLinksReply()
        for peer in request.peers:
            m = node_pb2.LinkMeasurement(src_id=self.node_id(), dst_id=peer.node_id,
                                         measured_at=time.time())
            try:
                m.latency, m.bandwidth = measure_link(
                    peer.address, self._shaper(peer.name),
                    pings=min(max(request.pings, 1), 100) if request.pings else 5,
                    max_bytes=min(request.max_probe_bytes or 4 * 2**20, MAX_PROBE_BYTES),
                    seconds=min(request.probe_seconds or 0.5, 10.0))
            except grpc.RpcError as e:
                m.error = f"{e.code().name}: {e.details()}"
            out.links.append(m)
        return out

    def FetchState(self, request, context):
        with self.lock:
            stage = self.stages.get((request.job_id, request.replica, request.stage))
        if stage is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no stage {request.stage} of job {request.job_id!r} on this node")
        for name, t in stage.module.state_dict().items():
            idx, _, rest = name.partition(".")
            full = f"{stage.layer_start + int(idx)}.{rest}"
            yield from frames.encode_frames(t, name=full)
