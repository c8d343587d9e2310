"""The Python client: submit a model, feed its data, watch it, collect its weights."""
from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import grpc
import torch
from torch import nn

from .. import net
from ..proto import node_pb2, tracker_pb2, tracker_pb2_grpc
from ..net import timeouts
from ..observe.source import GrpcSource
from ..observe.views import StepRecord, recovery_headline, step_records
from ..runtime.optim import LRSchedulerSpec, OptimizerSpec
from ..security import TlsConfig
from ..security.explain import explained
from ..security.signing import sign_job
from ..security.tls import resolve as resolve_tls
from ..spec import CLIENT_TIMEOUT, REPLICA_SYNCS, DiLoCo, JobSpec, PlanView, StageKey, \
    state_name
from ..runtime import checkpoint
from ..wire import frames, rpc
from ..wire.codecs import MAX_TENSOR_BYTES
from . import checkpoints
from .feed import FEED_KEEP_CHECKPOINTS, ChannelNodes, Feed, GroupFeed, cycle, shard
from .packaging import dumps, pack_layers
from .profile import profile_model
from .watch import RETRYABLE, Halted, JobWatch

# kept for callers of the names these had before the feed moved to .feed
_shard, _cycle, _FeedHalted = shard, cycle, Halted
__all__ = ["Client", "Job", "JobFailed", "JobStatus", "TrackerBusy", "GroupFeed",
           "FEED_KEEP_CHECKPOINTS"]

log = logging.getLogger("fedpipe.client")
S = tracker_pb2


class JobFailed(RuntimeError):
    """The job ended FAILED or CANCELLED; the message is the tracker's reason."""


class TrackerBusy(RuntimeError):
    """The tracker refused a call with RESOURCE_EXHAUSTED; the message says which limit."""


@dataclass
class JobStatus:
    """A job's state and the reason for it, its progress and its plan.

    Attributes:
        checkpoint_step: the last complete checkpoint (0: none yet).
        recoveries: each recovery from a lost node: who was lost, the
            checkpoint step it rewound to, steps recomputed, and the seconds
            spent detecting, replanning and restoring.
    """

    state: str
    reason: str
    step: int
    steps: int
    loss: float
    plan: node_pb2.Plan
    checkpoint_step: int = 0
    recoveries: tuple[tracker_pb2.Recovery, ...] = ()

    def __str__(self) -> str:
        text = f"{self.state} ({self.reason}); step {self.step}/{self.steps}, loss {self.loss:.4f}"
        for r in self.recoveries:
            text += (f"\n  {recovery_headline(r)}: rewound to step "
                     f"{r.checkpoint_step}, {r.steps_recomputed} steps recomputed, "
                     f"{r.detect_seconds + r.replan_seconds + r.restore_seconds:.1f} s "
                     f"(detect {r.detect_seconds:.1f}, replan {r.replan_seconds:.1f}, "
                     f"restore {r.restore_seconds:.1f})")
        return text


class Client:
    """Talks to a tracker at ``HOST:PORT``, and to the nodes of its jobs.

    The client owns its channels: one to the tracker and one per node address
    it has talked to (made on first use, then reused), all closed by
    :meth:`close`. Use it as a context manager::

        with fedpipe.Client("tracker:7070") as client:
            job = client.submit(...)
            job.wait()

    Closing a client whose job is still being fed ends the feed and detaches
    from the job: the job stops at its last complete checkpoint and waits, in
    state WAITING, up to its ``client_timeout`` for a client to resume it
    (``Client(addr).job(ID).resume(data)``); :meth:`Job.cancel` cancels it.

    A call refused for TLS reasons fails with a one-line reason instead of
    gRPC's bare "UNAVAILABLE: Socket closed": no certificate, another CA's, an
    expired one, or the wrong role for the method
    (:mod:`fedpipe.security.explain`); the status code stays gRPC's.

    Args:
        tracker: the tracker's ``HOST:PORT``.
        tls: mutual TLS: a :class:`fedpipe.security.TlsConfig` (a certificate
            with role client, or admin for the operator), or a TLS directory
            holding one certificate with its key. None: ``$FEDPIPE_TLS_DIR`` if
            set, else plaintext.

    Raises:
        fedpipe.security.CertError: an unusable TLS directory or certificate.
    """

    def __init__(self, tracker: str, tls: TlsConfig | str | os.PathLike | None = None):
        self.address = tracker
        self.tls = resolve_tls(tls)
        self.channel = explained(net.channel(tracker, tls=self.tls), tracker, self.tls)
        self.stub = tracker_pb2_grpc.TrackerStub(self.channel)
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[grpc.Channel, rpc.NodeStub]] = {}
        self._feeding: set[Job] = set()
        self._closed = False

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def node(self, address: str) -> rpc.NodeStub:
        """The stub of the node at ``address``, on this client's one channel to it.

        Raises:
            ValueError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError(f"client of tracker {self.address} is closed")
            if address not in self._nodes:
                ch = explained(net.channel(address, tls=self.tls), address, self.tls)
                self._nodes[address] = (ch, rpc.NodeStub(ch))
            return self._nodes[address][1]

    def close(self) -> None:
        """Stop feeding this client's jobs (they wait for a client, see above) and close
        every channel.

        Idempotent. Calls made after it raise ValueError.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            feeding, nodes = list(self._feeding), list(self._nodes.values())
        for job in feeding:
            job._halt_feed()
        for ch, _ in nodes:  # ends the feed's Sends in flight
            ch.close()
        for job in feeding:
            job._join_feed(timeouts.THREAD_JOIN)
        self.channel.close()

    def nodes(self) -> list[tracker_pb2.NodeInfo]:
        """The live nodes, in registration order."""
        return list(self.stub.ListNodes(S.ListNodesRequest(), timeout=timeouts.CONTROL_RPC).nodes)

    def drain(self, node: str) -> tracker_pb2.DrainNodeReply:
        """Drain ``node`` (its name or id): its stages move to other nodes at the next step
        boundary with their current state (no step is lost), it takes no new work, and it
        exits once nothing needs it (see ``fedpipe drain``). Under TLS only an admin may.

        Raises:
            grpc.RpcError: NOT_FOUND for an unknown node, PERMISSION_DENIED for a caller
                that is not an admin.
        """
        return self.stub.DrainNode(S.DrainNodeRequest(node=node), timeout=timeouts.CONTROL_RPC)

    def submit(self, model: nn.Sequential,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               optimizer: OptimizerSpec, data: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
               steps: int, microbatches: int = 1, schedule: str = "gpipe",
               stages: int = 0, replicas: int = 0, compression: str | dict[str, str] = "auto",
               max_staleness: int = 1, replica_sync: str | DiLoCo = "auto", name: str = "",
               pending_timeout: float | None = None, lr_scheduler: LRSchedulerSpec | None = None,
               clip_grad_norm: float = 0.0, checkpoint_every: int = 0,
               client_timeout: float = CLIENT_TIMEOUT,
               resume_from: str | os.PathLike | None = None,
               checkpoint_dir: str | os.PathLike | None = None,
               rebalance: str = "auto",
               min_replicas: int = 0) -> "Job":
        """Submit a training job and start feeding it.

        Args:
            model: an ``nn.Sequential``; each child is a unit a stage can hold and
                must map one tensor to one tensor.
            loss_fn: ``loss_fn(output, target)``, averaging over the batch.
            optimizer: from :func:`fedpipe.optimizer`; built per stage.
            data: (input, target) batches, inputs of shape (B, ...); re-iterated
                if it runs out before ``steps`` batches.
            steps: optimizer steps, one batch each.
            microbatches: each batch is split into this many along dim 0.
            schedule: "gpipe" or "1f1b" (synchronous), or "async" (PipeDream-style,
                no flush, weight stashing).
            max_staleness: async only: weight versions a stage may run ahead of
                the versions its gradients come back for (0 equals "1f1b").
            stages: pipeline depth (0: the planner chooses from the nodes' speeds and links).
            replicas: data-parallel replica groups (0: the planner chooses).
            compression: "auto" (the planner picks each link's codec from its
                bandwidth), "none", a codec spec such as "int8+zstd", or a dict
                ``{"activations": ..., "gradients": ...}`` to set them apart
                (top-k is for gradients only).
            replica_sync: how replica groups (if the plan has several) agree:
                "allreduce" (gradients summed every step), "diloco" or a
                :class:`fedpipe.DiLoCo` (outer steps every H inner steps), or
                "auto" (the plan picks from the links between groups).
            pending_timeout: fail the job if no node takes it within this many seconds.
            checkpoint_every: steps between checkpoints (each stage snapshots its
                state, kept on its node and a buddy node; a lost node makes the
                job rewind to the last complete one). 0: the tracker picks it so
                that a recovery recomputes about 30 s of training, from the
                predicted step time.
            lr_scheduler: from :func:`fedpipe.lr_scheduler`; built over each
                stage's optimizer and stepped after every optimizer step.
            clip_grad_norm: clip the gradients to this global L2 norm before each
                optimizer step, as :func:`torch.nn.utils.clip_grad_norm_` on the
                whole model would (:mod:`fedpipe.runtime.clip`); 0: no clipping.
            client_timeout: seconds the job waits for a client once this one is
                gone (closed, crashed, cut off), in state WAITING with the reason
                "waiting for the client"; then it fails.
            resume_from: a checkpoint folder written by :meth:`Job.save` (or a
                ``checkpoint_dir``: its newest): the job starts after that
                checkpoint's step with its weights, optimizer, LR schedule and
                DiLoCo state. ``data`` is still given from its start; the steps
                done are skipped. ``stages`` and ``replicas`` default to the
                checkpoint's; a plan that splits the layers otherwise restores
                each stage from the saved stages that held its layers
                (:mod:`fedpipe.runtime.layerstate`), exactly.
            checkpoint_dir: keep the newest complete checkpoints in this folder
                (pulled from the nodes as each completes), so the job can be
                resumed (``resume_from=checkpoint_dir``) even if every node and
                the tracker are lost.
            rebalance: "auto": the tracker may move stages to a better plan at a
                step boundary (a node joined, or one runs slower than it said) when the
                predicted gain pays for moving the state; "never": only drains and
                losses move stages.
            min_replicas: elastic replica groups (README, "Replica groups as the
                unit of failure"): while this many groups are live, a lost node
                drops only its group; below it the job rewinds. 0: every loss rewinds.

        Raises:
            TypeError: not an nn.Sequential, a layer not tensor-to-tensor, or a
                bad optimizer or lr_scheduler.
            fedpipe.spec.JobSpecError: a bad setting (a ValueError; ``field`` names it).
            ValueError: empty data, a batch too small for the microbatches, an
                lr_scheduler whose arguments do not fit it or the optimizer, or
                ``stages`` or ``replicas`` other than ``resume_from``'s checkpoint's.
            fedpipe.client.checkpoints.CheckpointError: ``resume_from`` holds no
                readable checkpoint, or one at or past ``steps``.
            grpc.RpcError: the tracker refused the job (e.g. RESOURCE_EXHAUSTED
                with the memory figures) or is unreachable.
        """
        layers = pack_layers(model)
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError("optimizer must come from fedpipe.optimizer(torch.optim.X, ...)")
        if lr_scheduler is not None:
            if not isinstance(lr_scheduler, LRSchedulerSpec):
                raise TypeError("lr_scheduler must come from "
                                "fedpipe.lr_scheduler(torch.optim.lr_scheduler.X, ...)")
            lr_scheduler.check(optimizer)
        act_codec, grad_codec = _compression(compression)
        if isinstance(replica_sync, str):
            if replica_sync not in REPLICA_SYNCS:
                raise ValueError(f"replica_sync must be one of {list(REPLICA_SYNCS)} or a "
                                 f"fedpipe.DiLoCo, got {replica_sync!r}")
            outer = DiLoCo()
        elif isinstance(replica_sync, DiLoCo):
            outer, replica_sync = replica_sync, "diloco"
        else:
            raise TypeError(f"replica_sync must be a string or fedpipe.DiLoCo, got "
                            f"{type(replica_sync).__name__}")
        restore = None
        if resume_from is not None:
            restore = checkpoints.read(resume_from)
            if restore.step >= steps:
                raise checkpoints.CheckpointError(
                    f"the checkpoint in {resume_from} is after step {restore.step}; the job "
                    f"has only {steps} steps")
            # the split it was saved in, unless asked otherwise: either way each new stage
            # is restored from the saved stages that held its layers
            stages, replicas = stages or restore.depth, replicas or restore.replicas
        job_spec = JobSpec(steps=steps, microbatches=microbatches, schedule=schedule,
                           optimizer=dumps(optimizer), loss_fn=dumps(loss_fn),
                           activation_compression=act_codec, gradient_compression=grad_codec,
                           stages=stages, replicas=replicas, max_staleness=max_staleness,
                           replica_sync=replica_sync, diloco=outer,
                           lr_scheduler=dumps(lr_scheduler) if lr_scheduler else b"",
                           clip_grad_norm=clip_grad_norm, checkpoint_every=checkpoint_every,
                           client_timeout=client_timeout, rebalance=rebalance,
                           min_replicas=min_replicas, batch_size=microbatches).validate(len(layers))
        batches = cycle(data)
        try:
            first = next(batches)
        except StopIteration:
            raise ValueError("data yielded no batch") from None
        x0, _ = first
        if x0.shape[0] < microbatches:
            raise ValueError(f"batch of {x0.shape[0]} samples cannot be split into "
                             f"{microbatches} microbatches")
        job_spec = job_spec.with_(batch_size=x0.shape[0])
        profile = profile_model(model, x0)
        config = job_spec.to_proto()
        req = S.SubmitJobRequest(name=name or type(model).__name__, layers=layers,
                                 config=config, profile=profile,
                                 pending_timeout=pending_timeout or 0.0)
        if self.tls is not None:  # the tracker and every node check it before unpickling
            signed = sign_job(self.tls, layers, config)
            req.owner, req.job_signature = signed.owner, signed.job_signature
            req.client_cert = signed.client_cert
            req.layer_digests.extend(signed.layer_digests)
        job_id = self.stub.SubmitJob(req, timeout=timeouts.SUBMIT_RPC).job_id
        job = Job(self, job_id, model, microbatches, spec=job_spec,
                  checkpoint_dir=checkpoint_dir)
        job._start_feed(itertools.chain([first], batches), restore=restore)
        return job

    def job(self, job_id: str) -> "Job":
        """Attach to an existing job: to watch it, fetch its weights, save it, cancel
        it, or feed it again (:meth:`Job.resume`)."""
        return Job(self, job_id)


def _compression(compression: str | dict[str, str]) -> tuple[str, str]:
    """(activation, gradient) compression from the ``compression`` argument.

    Raises:
        ValueError: unknown keys (codec specs are checked by :meth:`JobSpec.validate`).
    """
    if isinstance(compression, str):
        act = grad = compression
    else:
        unknown = set(compression) - {"activations", "gradients"}
        if unknown:
            raise ValueError(f"compression keys must be 'activations' and 'gradients', "
                             f"got {sorted(unknown)}")
        act = compression.get("activations", "auto")
        grad = compression.get("gradients", "auto")
    return act, grad



class Job:
    """A submitted job: its status, progress, and trained weights.

    It talks to the tracker and the nodes over its client's channels.

    Feeding survives recoveries: the feed keeps each batch it sent since the
    second-newest complete checkpoint, so when a lost node makes the job
    rewind to its last complete checkpoint (or the one before, if no snapshot
    of the last survived) the same batches are sent again, in the same
    order, and a synchronous job ends as if nothing happened. The bound:
    ``FEED_KEEP_CHECKPOINTS * checkpoint_every`` batches (3 checkpoint
    intervals: the one being taken, and the two complete ones a rewind may
    go back to). At the bound the feed pauses until the next checkpoint
    completes; it never drops a batch it may need.

    While it feeds, the job holds a *feeder's watch* of the job on the tracker
    (:mod:`fedpipe.tracker.clients`): when that stream ends (the client closed,
    crashed or was cut off) the job stops at its last complete checkpoint and
    waits for a client (WAITING). :meth:`resume` feeds it again from another
    process; only the latest feeder's data is used.
    """

    def __init__(self, client: Client, job_id: str, model: nn.Sequential | None = None,
                 microbatches: int = 1, *, spec: JobSpec | None = None,
                 checkpoint_dir: str | os.PathLike | None = None):
        self.client, self.id, self._model = client, job_id, model
        self.microbatches = microbatches
        self.feed_error: BaseException | None = None
        self._spec = spec
        self._checkpoint_dir = checkpoint_dir
        self._saved_step = 0  # the newest checkpoint kept in checkpoint_dir
        self._feeder: threading.Thread | None = None
        self._follower: threading.Thread | None = None
        self._feeder_id = os.urandom(8).hex()
        self._halted = threading.Event()
        self._watch: JobWatch | None = None  # the feeder's watch, while this Job feeds

    def _start_feed(self, batches: Iterator, *, take_over: bool = False,
                    restore: checkpoints.SavedCheckpoint | None = None) -> None:
        """Open the feeder's watch (a refusal is raised here, before any thread starts),
        then start its thread and the feed of ``batches`` (from the job's first step).

        Raises:
            RuntimeError: this Job feeds the job already.
            ValueError: the client is closed.
            grpc.RpcError: the tracker refused the watch (:meth:`.JobWatch.open`).
        """
        if self._feeder is not None:
            raise RuntimeError(f"job {self.id} is being fed by this Job already")
        self._check_open()
        self._halted.clear()  # a resume refused earlier left it set
        watch = JobWatch(self.client.stub, self.id, self._feeder_id, take_over=take_over,
                         on_event=self._on_event, halted=self._halted)
        watch.open()
        feed = Feed(self.id, self.client.stub, ChannelNodes(self.client), watch, batches,
                    microbatches=self.microbatches, restore=restore)
        self._watch = watch
        self._follower = threading.Thread(target=watch.run, name=f"watch-{self.id}",
                                          daemon=True)
        self._feeder = threading.Thread(target=self._run_feed, args=(feed,),
                                        name=f"feed-{self.id}", daemon=True)
        try:
            self._check_open(add=True)
        except ValueError:
            watch.halt()
            raise
        self._follower.start()
        self._feeder.start()

    def _check_open(self, add: bool = False) -> None:
        """Raise ValueError if the client is closed; else, with ``add``, count this Job
        among the jobs it feeds (closing it halts their feeds)."""
        with self.client._lock:
            if self.client._closed:
                raise ValueError(f"client of tracker {self.client.address} is closed")
            if add:
                self.client._feeding.add(self)

    def resume(self, data: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
               checkpoint_dir: str | os.PathLike | None = None) -> "Job":
        """Feed this job again, from this client: take it over from a client that is
        gone (or still there: it stops feeding), rewind it to its last complete
        checkpoint (a WAITING job's is where it stopped) and feed it from there.

        Args:
            data: the job's data *from its start*, the same batches in the same
                order as the first client gave; the steps before the job's
                resume step are drawn and skipped (a DataLoader re-iterates as
                ``for epoch: for batch in loader`` would).
            checkpoint_dir: keep the job's complete checkpoints in this folder from
                now on, as ``submit(checkpoint_dir=...)`` does (give the first
                client's folder to go on filling it); None: keep none here.

        Returns:
            self, being fed (:meth:`wait` for it).

        Raises:
            RuntimeError: this Job feeds the job already.
            ValueError: the client is closed.
        """
        if checkpoint_dir is not None:
            self._checkpoint_dir = checkpoint_dir
        self._start_feed(cycle(data), take_over=True)
        return self

    def save(self, path: str | os.PathLike) -> str:
        """Write the job's last complete checkpoint (its final state, once it has
        SUCCEEDED) to folder ``path``: every tensor of every stage (weights,
        optimizer, LR schedule, DiLoCo state) in ``tensors.safetensors`` and the
        metadata (step, plan, config) in ``checkpoint.json``
        (:mod:`fedpipe.client.checkpoints`). ``submit(..., resume_from=path)``
        continues from it. Returns the folder.

        Raises:
            RuntimeError: no checkpoint has completed yet.
            grpc.RpcError: no node holds a stage's snapshot of that step any more.
            OSError: the folder cannot be written.
        """
        info = self._info()
        step = info.steps if info.state == S.JOB_STATE_SUCCEEDED else info.checkpoint_step
        if step <= 0:
            raise RuntimeError(f"job {self.id} has no complete checkpoint yet "
                               f"({state_name(info.state)} at step {info.step})")
        snaps = self._pull_snapshots(info.plan, step)
        return str(checkpoints.write(path, step, snaps, info.plan, steps=info.steps,
                                     config=self._config()))

    def _config(self) -> dict:
        return self._spec.summary() if self._spec is not None else {}

    def _pull_snapshots(self, plan: node_pb2.Plan, step: int
                        ) -> dict[StageKey, "checkpoint.Snapshot"]:
        """Every stage's snapshot of ``step``, from its node, else any node of the plan
        (its buddy holds a copy).

        Raises:
            grpc.RpcError: no node has one stage's snapshot (the last node's error).
        """
        view = PlanView(plan)
        out = {}
        for key, a in sorted(view.stages.items()):
            others = sorted(view.addresses() - {a.address})
            for i, address in enumerate([a.address] + others):
                try:
                    stream = self.client.node(address).FetchSnapshot(
                        node_pb2.FetchSnapshotRequest(job_id=self.id, replica=key.replica,
                                                      stage=key.stage, step=step),
                        timeout=timeouts.FETCH_STATE_RPC)
                    _, out[key] = checkpoint.from_frames(stream, MAX_TENSOR_BYTES)
                    break
                except grpc.RpcError:
                    if i == len(others):
                        raise
        return out

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobStatus:
        """The job's current state, reason, progress and plan."""
        info = self.client.stub.GetJob(S.GetJobRequest(job_id=self.id),
                                       timeout=timeouts.CONTROL_RPC)
        return JobStatus(state_name(info.state), info.reason, info.step, info.steps, info.loss,
                         info.plan, info.checkpoint_step, tuple(info.recoveries))

    @property
    def plan(self) -> node_pb2.Plan:
        """The plan (empty before PLANNING is over)."""
        return self.status().plan

    def events(self) -> Iterator[tracker_pb2.JobEvent]:
        """The job's events from the start, until it ends."""
        yield from self.client.stub.WatchJob(S.WatchJobRequest(job_id=self.id))

    def history(self) -> list[StepRecord]:
        """The job's completed steps so far, in the order the tracker recorded them (a step
        replayed after a recovery appears again, with the new epoch): each a
        :class:`~fedpipe.observe.views.StepRecord` with step, time (seconds since the
        epoch), loss, samples/s and per-stage times (``stages``: empty, since the
        tracker's gRPC API does not carry them; its dashboard's ``/api/jobs/ID`` does).

        Raises:
            KeyError: the tracker does not know the job.
        """
        return step_records(GrpcSource(self.client.stub).events(self.id, 0))

    def plot(self, path: str):
        """Draw the job's loss and throughput curves (recoveries marked) to ``path``
        (.png, .svg or .pdf), with matplotlib; return the ``matplotlib.figure.Figure``.

        Raises:
            ValueError: no step is recorded yet.
            KeyError: the tracker does not know the job.
        """
        from ..observe.plots import plot_job  # matplotlib loads only when a picture is drawn

        return plot_job(GrpcSource(self.client.stub), self.id, path)

    def wait(self, timeout: float | None = None, progress: bool = True) -> JobStatus:
        """Block until the job ends, showing a progress bar (step, loss, samples/s) and
        state changes unless ``progress`` is False. With a ``checkpoint_dir``, also until
        the job's last checkpoint (its final state) is kept there.

        Raises:
            JobFailed: the job ended FAILED or CANCELLED.
            TimeoutError: it did not end within ``timeout`` seconds.
            TrackerBusy: the tracker refused the watch (this client holds too many
                watches of the job, or the tracker all it takes).
            grpc.RpcError: the tracker refused this client's watch of the job
                (PERMISSION_DENIED: another client's job; :mod:`.watch`).
        """
        from tqdm.auto import tqdm

        if self._watch is not None and self._watch.error is not None:
            raise self._watch.error  # the tracker refused this client's feeder's watch
        status = self.status()
        bar = tqdm(total=status.steps, desc=f"job {self.id}", unit="step", disable=not progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        seq, last_state = 0, None
        try:
            while True:  # a dropped stream (tracker restart) is resumed after the last event
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    for ev in self.client.stub.WatchJob(
                            S.WatchJobRequest(job_id=self.id, after_seq=seq), timeout=left):
                        seq = ev.seq
                        if ev.step:
                            bar.update(ev.step - bar.n)
                            bar.set_postfix(loss=f"{ev.loss:.4f}",
                                            samples_s=f"{ev.samples_per_second:.0f}")
                        elif ev.state != last_state and progress:
                            bar.write(f"job {self.id}: {state_name(ev.state)} — {ev.reason}")
                        last_state = ev.state
                    break
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise TimeoutError(f"job {self.id} did not finish within {timeout} s"
                                           ) from None
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise TrackerBusy(f"the tracker refused to watch job {self.id}: "
                                          f"{e.details()}") from None
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    log.warning("lost the tracker (%s); watching job %s again", e.details(),
                                self.id)
                    time.sleep(timeouts.WATCH_RESUME)
        finally:
            bar.close()
        if self._follower is not None and self._checkpoint_dir is not None:
            # the watch keeps the job's last checkpoints in checkpoint_dir: let it finish
            self._follower.join(timeouts.FETCH_STATE_RPC)
        status = self.status()
        if status.state != "SUCCEEDED":
            detail = f"; feeding data failed: {self.feed_error}" if self.feed_error else ""
            raise JobFailed(f"job {self.id} {status.state}: {status.reason}{detail}")
        return status

    def cancel(self, reason: str = "cancelled by the client") -> JobStatus:
        """Cancel the job; its stages stop and drop their weights."""
        self.client.stub.CancelJob(S.CancelJobRequest(job_id=self.id, reason=reason),
                                   timeout=timeouts.CONTROL_RPC)
        return self.status()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the stages, keyed as the model's own state_dict.

        Raises:
            grpc.RpcError: a stage's node is unreachable or no longer holds the stage.
        """
        out: dict[str, torch.Tensor] = {}
        for a in PlanView(self.plan).chain(0):
            stream = self.client.node(a.address).FetchState(
                node_pb2.FetchStateRequest(job_id=self.id, replica=a.replica, stage=a.stage),
                timeout=timeouts.FETCH_STATE_RPC)
            for head, t in frames.read_tensors(stream, in_place=True):  # gRPC's messages
                out[head.name] = t
        return out

    def model(self) -> nn.Sequential:
        """A copy of the submitted model carrying the trained weights.

        Raises:
            RuntimeError: the job was attached by id, so the model is not known here.
        """
        if self._model is None:
            raise RuntimeError("this Job was attached by id; use state_dict() instead")
        model = copy.deepcopy(self._model)
        model.load_state_dict(self.state_dict())
        return model

    def release(self) -> None:
        """Ask the stages' nodes to drop the job's weights (after :meth:`state_dict`).

        Best effort: a node that cannot be reached (it left, its weights with
        it) is logged and skipped.
        """
        for address in sorted(PlanView(self.plan).addresses()):
            try:
                self.client.node(address).StopJob(
                    node_pb2.StopJobRequest(job_id=self.id, reason="released", release=True),
                    timeout=timeouts.CONTROL_RPC)
            except grpc.RpcError as e:
                log.warning("could not release job %s on %s: %s", self.id, address, e.details())

    # -- data feeding -------------------------------------------------------
    # -- data feeding -------------------------------------------------------
    def _halt_feed(self) -> None:
        """Make the feeder stop at once (its client is closing): its watch ends, so the
        job waits for a client."""
        if self._watch is not None:
            self._watch.halt()
        self._halted.set()

    def _join_feed(self, timeout: float) -> None:
        for thread in (self._feeder, self._follower):
            if thread is not None:
                thread.join(timeout)

    def _on_event(self, ev: tracker_pb2.JobEvent) -> None:
        """On the watch thread: keep each complete checkpoint in ``checkpoint_dir``."""
        if self._checkpoint_dir is not None and (
                ev.checkpoint_step or ev.state == S.JOB_STATE_SUCCEEDED):
            self._keep_checkpoint()

    def _keep_checkpoint(self) -> None:
        """Pull the job's newest complete checkpoint into ``checkpoint_dir`` if it is
        newer than the one kept there (best effort: a failure is logged)."""
        assert self._checkpoint_dir is not None
        try:
            info = self._info()
            step = info.steps if info.state == S.JOB_STATE_SUCCEEDED else info.checkpoint_step
            if step <= self._saved_step:
                return
            folder = checkpoints.keep(self._checkpoint_dir, step,
                                      self._pull_snapshots(info.plan, step), info.plan,
                                      steps=info.steps, config=self._config())
            self._saved_step = step
            log.info("job %s: checkpoint of step %d kept in %s", self.id, step, folder)
        except (grpc.RpcError, OSError, ValueError) as e:
            log.warning("job %s: could not keep its checkpoint in %s: %s", self.id,
                        self._checkpoint_dir, e)

    def _info(self) -> tracker_pb2.JobInfo:
        """The job's info, asked again while the tracker is unreachable (restarting), at
        most :data:`~fedpipe.net.timeouts.RECONNECT_BACKOFF_MAX` apart.

        Raises:
            grpc.RpcError: a refusal that cannot pass (:data:`.watch.RETRYABLE`).
        """
        return net.retry(lambda: self.client.stub.GetJob(S.GetJobRequest(job_id=self.id),
                                                         timeout=timeouts.CONTROL_RPC),
                         f"asking the tracker about job {self.id}", codes=RETRYABLE,
                         max_delay=timeouts.RECONNECT_BACKOFF_MAX, stop=self._halted.is_set)

    def _run_feed(self, feed: Feed) -> None:
        """The feed thread's body: feed, then turn what ended the feed into the job's fate
        (:attr:`feed_error`)."""
        try:
            feed.run()
        except BaseException as e:  # noqa: BLE001 — kept in feed_error, surfaced by wait()
            self._feed_ended(feed, e)
        finally:
            with self.client._lock:
                self.client._feeding.discard(self)

    def _feed_ended(self, feed: Feed, e: BaseException) -> None:
        """Keep why the feed ended in :attr:`feed_error`; cancel the job if nobody else
        can feed it."""
        watch = feed.watch
        if watch.superseded:
            self.feed_error = Halted("another client took the job over")
        elif watch.error is not None:  # the tracker refused the watch: raised by wait()
            self.feed_error = watch.error
        elif self._halted.is_set():  # the client closed: the job waits for a client
            self.feed_error = Halted(
                "the client was closed before it fed every step; the job waits for a "
                "client to resume it (Client(addr).job(id).resume(data))")
        elif isinstance(e, StopIteration):
            self.feed_error = ValueError("data ran out before the last step")
            try:  # the finished steps' weights stay on the nodes: state_dict() works
                self.client.stub.CancelJob(S.CancelJobRequest(
                    job_id=self.id, keep_weights=True,
                    reason=f"the client's data ran out after step {feed.fed} of "
                           f"{feed.steps}; the weights of the finished steps are kept "
                           f"(state_dict())"), timeout=timeouts.CONTROL_RPC)
            except grpc.RpcError as err:
                log.error("could not end job %s: %s", self.id, err.details())
        elif isinstance(e, grpc.RpcError):
            log.error("feeding job %s failed: %s", self.id, e.details())
            self._give_up(e, f"the client could not feed data: {e.code().name}: "
                             f"{e.details()}")
        else:
            log.error("feeding job %s failed", self.id, exc_info=e)
            self._give_up(e, f"the client could not feed data: {e}")

    def _give_up(self, error: BaseException, reason: str) -> None:
        """Keep the feed's ``error`` and cancel the job with ``reason``: a job nobody feeds
        would wait for ever."""
        self.feed_error = error
        try:
            self.cancel(reason)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel is closed
            log.error("could not cancel job %s either: %s", self.id, e)
