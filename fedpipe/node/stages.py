"""The stages a node holds: how one is wired, and its life cycle.

A stage is loaded from a ``LoadStage`` request (:func:`build_stage`: layers,
optimizer, runner, replica sync, transport), runs its steps in a thread of
its own, reports each step and its end to the tracker, and is stopped or
released by ``StopJob``. :class:`StageRegistry` holds them all and is what the
node's servicer calls; it raises the domain errors below, which the servicer
maps to status codes.

Life cycle of one stage::

    load ──> running ──> done | failed | stopped ──> released
                 (a report per step)   (a report)    (StopJob with release)

Tensors that arrive for a stage wait in the node's :class:`Mailbox` until
the stage takes them; what it sends goes through its :class:`StagePeers`.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import cloudpickle
import torch
from torch import nn

from ..proto import node_pb2, tracker_pb2
from ..runtime.allreduce import GradientSync, StageSpan
from ..runtime.async_stage import AsyncStageRunner
from ..runtime.clip import GlobalNormClip
from ..runtime.diloco import OuterSync
from ..runtime.stage import (StageRunnerBase, StepHook, StepResult, SyncStageRunner,
                             TimedTransport)
from ..spec import JobSpec, Kind, PlanView, StageKey
from ..wire import codecs
from .mailbox import Mailbox, Stopped
from .peers import MAX_PROBE_BYTES, StagePeers

log = logging.getLogger(__name__)

STAGE_KINDS = frozenset(Kind) - {Kind.PROBE}
"""Kinds of tensor a stage takes from its mailbox."""
BOUNDED_KINDS = (Kind.INPUT, Kind.TARGET)
"""Kinds a client may send far ahead: their inbox is bounded (backpressure)."""


class StageExists(Exception):
    """That stage of that job is already loaded on this node."""


class StageLoadError(Exception):
    """A stage cannot be built from its request: bad config, plan, layers or optimizer."""


class NoSuchStage(LookupError):
    """No (running) stage of that job on this node."""


class BadEnvelope(ValueError):
    """A tensor's envelope names a kind, batch size, step or microbatch the stage cannot take."""


class StageSlot(NamedTuple):
    """A stage of a job on this node: the key of the registry and the mailbox."""

    job_id: str
    replica: int
    stage: int

    @property
    def key(self) -> StageKey:
        return StageKey(self.replica, self.stage)


@dataclass
class Stage:
    """A loaded stage: its layers, runner, peers and thread."""

    slot: StageSlot
    n_stages: int
    layer_start: int
    module: nn.Module
    steps: int
    peers: StagePeers
    runner: StageRunnerBase | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def job_id(self) -> str:
        return self.slot.job_id

    @property
    def key(self) -> StageKey:
        return self.slot.key

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stage's state, named as in the whole model (``"<global layer>.<name>"``)."""
        for name, t in self.module.state_dict().items():
            idx, _, rest = name.partition(".")
            yield f"{self.layer_start + int(idx)}.{rest}", t


class StageTransport:
    """:class:`~fedpipe.runtime.stage.Transport` over the node's mailbox and a stage's peers.

    Args:
        stage: the stage (its slot, stop event and peers).
        mailbox: where the node puts what arrives for its stages.
        device: where received tensors go.
        plan: the job's plan, to find peers and the codecs of this stage's links.
    """

    def __init__(self, stage: Stage, mailbox: Mailbox, device: torch.device, plan: PlanView):
        self.stage, self.mailbox, self.device, self.plan = stage, mailbox, device, plan
        mine = plan[stage.key]
        prev, nxt = plan.neighbours(stage.key)
        # the plan gives each stage the codecs of what it sends
        self.routes = {Kind.ACTIVATION: (nxt, mine.activation_codec or "raw"),
                       Kind.GRADIENT: (prev, mine.gradient_codec or "raw")}

    def recv(self, kind: Kind, step: int, tag: int,
             timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """As :meth:`Transport.recv`; also raises Stopped when the stage is stopped."""
        t, batch = self.mailbox.get(self.stage.slot, kind, step, tag, stopped=self._stopped,
                                    timeout=timeout)
        return t.to(self.device), batch

    def _stopped(self) -> bool:
        """Whether to give up waiting: the stage was stopped; StageError if a send failed
        (the peer will not answer what it never got)."""
        self.stage.peers.check()
        return self.stage.stop.is_set()

    def send(self, kind: Kind, step: int, microbatch: int, tensor: torch.Tensor,
             batch_size: int) -> None:
        peer, codec = self.routes[kind]
        self._submit(peer, kind, step, microbatch, tensor, batch_size, codec)

    def send_to(self, peer: StageKey, kind: Kind, step: int, tag: int, tensor: torch.Tensor,
                batch_size: int = 1, codec: str = "raw") -> None:
        self._submit(self.plan[peer], kind, step, tag, tensor, batch_size, codec)

    def _submit(self, peer: node_pb2.StageAssignment, kind: Kind, step: int, tag: int,
                tensor: torch.Tensor, batch_size: int, codec: str) -> None:
        env = node_pb2.Envelope(job_id=self.stage.job_id, replica=peer.replica,
                                stage=peer.stage, kind=kind, step=step, microbatch=tag,
                                batch_size=batch_size)
        self.stage.peers.sender(peer).submit(env, tensor, codec)


def build_stage(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
                peers: StagePeers) -> Stage:
    """Wire a stage from its request: layers, optimizer, loss, replica sync, runner.

    The config is validated before anything is unpickled.

    Raises:
        StageLoadError: the config or plan is invalid, or unpickling the layers,
            loss or optimizer, or building them, failed (the message names why).
    """
    try:
        return _build(request, device, mailbox, peers)
    except BaseException as e:  # noqa: BLE001 — user code (even sys.exit) is the caller's error
        raise StageLoadError(f"cannot load stage {request.stage}: {type(e).__name__}: {e}") \
            from e


def _build(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
           peers: StagePeers) -> Stage:
    cfg = JobSpec.from_proto(request.config).validate()  # before unpickling anything
    plan = PlanView(request.plan, cfg.microbatches)
    key = StageKey(request.replica, request.stage)
    mine = plan.get(key)
    if mine is None:
        raise ValueError(f"the plan has no stage {key.stage} in replica group {key.replica}")
    n_stages = plan.depth(key.replica)
    layers = [cloudpickle.loads(blob) for blob in request.layers]
    module = nn.Sequential(*layers).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = cloudpickle.loads(cfg.optimizer).build(params) if params else None
    last = key.stage == n_stages - 1
    loss_fn = cloudpickle.loads(cfg.loss_fn) if last else None
    stage = Stage(StageSlot(request.job_id, *key), n_stages, mine.layer_start, module,
                  cfg.steps, peers)
    # one timed transport for the runner and the syncs, so their waiting counts too
    transport = TimedTransport(StageTransport(stage, mailbox, device, plan))
    before: list[StepHook] = []
    after: list[StepHook] = []
    spans = [StageSpan(k, a.layer_start, a.layer_end) for k, a in plan.stages.items()]
    if cfg.replica_sync == "diloco":  # "auto" is resolved by the tracker; else all-reduce
        outer = OuterSync(module, key, spans, cfg.diloco,
                          [plan.share(g) for g in range(len(plan.replicas))], transport,
                          last_step=cfg.steps - 1)
        before.append(outer.rescale_gradients)
        after.append(outer)
    elif len(plan.replicas) > 1:
        before.append(GradientSync(module, key, spans, transport))
    if cfg.clip_grad_norm:  # after the gradient sync; every stage of the group takes part
        before.append(GlobalNormClip(params, cfg.clip_grad_norm, key.stage,
                                     {s: StageKey(key.replica, s) for s in range(n_stages)
                                      if s != key.stage}, transport))
    if opt is not None and cfg.lr_scheduler:  # stepped after each optimizer step, first
        schedule = cloudpickle.loads(cfg.lr_scheduler).build(opt)
        after.insert(0, lambda step: schedule.step())
    common = dict(before_update=before, after_update=after)
    microbatches = plan.microbatches(key.replica)
    if cfg.schedule == "async":
        stage.runner = AsyncStageRunner(module, opt, loss_fn, key.stage, n_stages, microbatches,
                                        transport, max_staleness=cfg.max_staleness, **common)
    else:
        stage.runner = SyncStageRunner(module, opt, loss_fn, cfg.schedule, key.stage, n_stages,
                                       microbatches, transport, **common)
    return stage


class StageRegistry:
    """The stages a node holds and their life cycle. Thread-safe.

    Args:
        node_id: returns the tracker-assigned id (known after registration).
        device: where stages run.
        mailbox: where tensors for the stages wait.
        make_peers: a fresh :class:`StagePeers` for a new stage.
        report: sends a StageReport to the tracker (may block briefly).
    """

    def __init__(self, node_id: Callable[[], str], device: torch.device, mailbox: Mailbox,
                 make_peers: Callable[[], StagePeers],
                 report: Callable[[tracker_pb2.StageReport], None]):
        self.node_id, self.device, self.mailbox = node_id, device, mailbox
        self.make_peers, self.report = make_peers, report
        self.stages: dict[StageSlot, Stage] = {}
        self.lock = threading.Lock()

    # -- life cycle ----------------------------------------------------------
    def load(self, request: node_pb2.LoadStageRequest) -> Stage:
        """Build the stage ``request`` asks for and start running it.

        Raises:
            StageExists: that stage of that job is already loaded.
            StageLoadError: as :func:`build_stage`.
        """
        slot = StageSlot(request.job_id, request.replica, request.stage)
        with self.lock:
            if slot in self.stages:
                raise StageExists(f"stage {tuple(slot)} is already loaded")
        peers = self.make_peers()
        try:
            stage = build_stage(request, self.device, self.mailbox, peers)
        except StageLoadError:
            peers.close()
            raise
        with self.lock:
            if slot in self.stages:  # a concurrent load of the same stage won
                peers.close()
                raise StageExists(f"stage {tuple(slot)} is already loaded")
            self.stages[slot] = stage
        stage.thread = threading.Thread(target=self._run, args=(stage,),
                                        name=f"stage-{slot.replica}.{slot.stage}", daemon=True)
        stage.thread.start()
        log.info("loaded job %s stage %d/%d of group %d (layers %d..%d)", slot.job_id,
                 slot.stage, stage.n_stages, slot.replica, stage.layer_start,
                 stage.layer_start + len(stage.module) - 1)
        return stage

    def _report(self, stage: Stage, status: int, **kw) -> None:
        self.report(tracker_pb2.StageReport(job_id=stage.job_id, replica=stage.slot.replica,
                                            stage=stage.slot.stage, node_id=self.node_id(),
                                            status=status, **kw))

    def _report_step(self, stage: Stage, result: StepResult) -> None:
        """One report per step, from every stage: its time split, and the loss
        and samples (the last stage's count towards the job's step)."""
        self._report(stage, tracker_pb2.StageReport.STATUS_STEP, step=result.step + 1,
                     loss=result.loss or 0.0, samples=result.samples, seconds=result.seconds,
                     compute_seconds=result.compute_seconds, wait_seconds=result.wait_seconds,
                     send_seconds=result.send_seconds)

    def _run(self, stage: Stage) -> None:
        R = tracker_pb2.StageReport
        try:
            for result in stage.runner.run(stage.steps):
                self._report_step(stage, result)
            stage.peers.flush()
            self._report(stage, R.STATUS_DONE, step=stage.steps)
            log.info("job %s stage %d done", stage.job_id, stage.slot.stage)
        except Stopped:
            log.info("job %s stage %d stopped", stage.job_id, stage.slot.stage)
        except Exception as e:  # noqa: BLE001 — reported to the tracker, which fails the job
            log.exception("job %s stage %d failed", stage.job_id, stage.slot.stage)
            self._report(stage, R.STATUS_FAILED, error=f"{type(e).__name__}: {e}")
        finally:
            stage.peers.close()
            self.mailbox.drop(lambda slot: slot == stage.slot)

    def stop_job(self, job_id: str, release: bool) -> list[Stage]:
        """Stop every stage of ``job_id`` (and forget them if ``release``); return them."""
        with self.lock:
            mine = [s for s in self.stages.values() if s.job_id == job_id]
            if release:
                for s in mine:
                    del self.stages[s.slot]
        for s in mine:
            s.stop.set()
        self.mailbox.drop(lambda slot: slot.job_id == job_id)
        return mine

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        with self.lock:
            for s in self.stages.values():
                s.stop.set()

    def get(self, slot: StageSlot) -> Stage:
        """The loaded stage (running or not).

        Raises:
            NoSuchStage: not loaded here, or released.
        """
        with self.lock:
            stage = self.stages.get(slot)
        if stage is None:
            raise NoSuchStage(f"no stage {slot.stage} of job {slot.job_id!r} "
                              f"(replica {slot.replica}) on this node")
        return stage

    # -- data plane ----------------------------------------------------------
    def admit(self, env: node_pb2.Envelope) -> int:
        """Check a tensor's envelope before its payload is buffered; return its size
        limit in bytes.

        A probe may be at most :data:`~fedpipe.node.peers.MAX_PROBE_BYTES`; a
        stage's tensor needs a running stage, a known kind, a positive batch
        size, and a step and microbatch index the stage will ask for (others
        would sit in its bounded inbox for ever).

        Raises:
            NoSuchStage: no running stage of the envelope's job, group and position.
            BadEnvelope: an unknown kind, a batch size below 1, a step or
                microbatch out of range.
        """
        if env.kind == Kind.PROBE:
            return MAX_PROBE_BYTES
        stage = self.get(StageSlot(env.job_id, env.replica, env.stage))
        if stage.stop.is_set():
            raise NoSuchStage(f"stage {env.stage} of job {env.job_id!r} (replica "
                              f"{env.replica}) is stopped")
        if env.kind not in STAGE_KINDS:
            raise BadEnvelope(f"unknown envelope kind {env.kind}")
        if env.batch_size <= 0:
            raise BadEnvelope(f"envelope batch_size must be positive, got {env.batch_size}")
        if not 0 <= env.step < stage.steps or env.microbatch < 0:
            raise BadEnvelope(f"step {env.step} / microbatch {env.microbatch} out of range for "
                              f"a job of {stage.steps} steps")
        return codecs.MAX_TENSOR_BYTES

    def deliver(self, env: node_pb2.Envelope, tensor: torch.Tensor,
                active: Callable[[], bool]) -> None:
        """Hand an admitted tensor to its stage's mailbox (probes are dropped);
        for inputs and targets wait for room while ``active()`` and the stage runs.

        Raises:
            NoSuchStage: the stage was released meanwhile.
            KeyError: the stage already has that tensor.
            Stopped: the stage stopped or ``active()`` turned false while waiting.
        """
        if env.kind == Kind.PROBE:
            return  # a link measurement: it only had to arrive
        slot = StageSlot(env.job_id, env.replica, env.stage)
        stage = self.get(slot)
        self.mailbox.put(slot, Kind(env.kind), env.step, env.microbatch, tensor, env.batch_size,
                         alive=lambda: active() and not stage.stop.is_set())
