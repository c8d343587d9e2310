"""The stages a node holds: how one is wired, and its life cycle.

A stage is loaded from a ``LoadStage`` request (:func:`build_stage`: layers,
optimizer, runner, replica sync, transport), runs its steps in a thread of
its own, reports each step and its end to the tracker, and is stopped or
released by ``StopJob``. :class:`StageRegistry` holds them all and is what the
node's servicer calls; it raises the domain errors below, which the servicer
maps to status codes.

Life cycle of one stage::

    load ──> (restore) ──> running ──> done | failed | stopped ──> released
                 (a report per step, a snapshot     (StopJob with release,
                  every checkpoint_every steps)      or the tracker's drop)

Every stage belongs to a plan *epoch*; each recovery of the job starts a new
one. Tensors and reports carry the epoch, and a stage takes nothing from an
older epoch. A stage of a newer epoch replaces a stopped one of the same slot.

Checkpoints (see :mod:`fedpipe.runtime.checkpoint`): after every
``checkpoint_every``-th step the stage thread copies its state; another
thread keeps the copy here, sends it to the stage's buddy (a node of another
replica group if any, else a neighbour's, rotating;
:meth:`fedpipe.spec.PlanView.buddies`) and then reports the checkpoint to the
tracker, which marks the step complete once every stage has reported it.

Tensors that arrive for a stage wait in the node's :class:`Mailbox` until
the stage takes them; what it sends goes through its :class:`StagePeers`.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, NamedTuple, Sequence

import cloudpickle
import grpc
import torch
from torch import nn

from ..net import timeouts
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2, tracker_pb2
from ..runtime import checkpoint, layerstate
from ..runtime.checkpoint import LAYOUT
from ..runtime.allreduce import GradientSync, StageSpan
from ..runtime.async_stage import AsyncStageRunner
from ..runtime.clip import GlobalNormClip
from ..runtime.diloco import OuterSync
from ..runtime.elastic import AskQuorum, ElasticGradientSync, ElasticOuterSync
from ..runtime.stage import (StageError, StageRunnerBase, StepHook, StepResult,
                             SyncStageRunner, TimedTransport)
from ..spec import JobSpec, Kind, PlanView, Quorum, StageKey
from ..wire import WireError, codecs, rpc
from .mailbox import Mailbox, Stopped
from .peers import MAX_PROBE_BYTES, ChannelPool, StagePeers
from .snapshots import SnapshotStore

log = logging.getLogger(__name__)

STAGE_KINDS = frozenset(Kind) - {Kind.PROBE, Kind.SNAPSHOT}
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


class StaleEpoch(Exception):
    """A message of another plan epoch than the stage's: from before a recovery, never taken."""


MAX_SNAPSHOT_BYTES = 4 * 2**30
"""Largest snapshot a node accepts from a buddy or a restore source, bytes: a stage of
about 250 M float32 parameters with AdamW's two moments (16 bytes a parameter)."""
HOLD_RECHECK = 0.2
"""Seconds a stage holding at a hand-over cut waits before it looks at its stop event again."""
RELEASE_JOIN = timeouts.THREAD_JOIN
"""Seconds a release waits for the stage's thread to end before it frees the memory anyway."""


def microbatches(env: node_pb2.Envelope, tensor: torch.Tensor) -> Sequence[torch.Tensor]:
    """The microbatches an admitted tensor holds (:meth:`StageRegistry.admit` checked
    that it has the rows): itself, or with ``env.microbatches`` > 1 its
    ``torch.tensor_split`` into that many pieces along dimension 0 (views), which is
    how the client cut them (``fedpipe.v1.Envelope.microbatches``)."""
    if env.microbatches <= 1:
        return (tensor,)
    return torch.tensor_split(tensor, env.microbatches)


def inbox_job(inbox: tuple["StageSlot", int]) -> str:
    """The job of a stage's mailbox key (:attr:`Stage.inbox`), for the mailbox's per-job cap."""
    return inbox[0].job_id


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
    epoch: int = 0
    start: int = 0
    checkpoint_every: int = 0
    plan: PlanView | None = None
    parts: dict[str, checkpoint.Checkpointable | None] = field(default_factory=dict)
    """What a checkpoint snapshots: module, optimizer, LR schedule, DiLoCo outer state."""
    done: int = 0
    """Steps done (the stage's step boundary it last crossed)."""
    hold_at: int = 0
    """A hand-over cut (a drain or a migration): after this many steps the stage
    snapshots and waits there until stopped or moved to a later cut (0: none)."""

    @property
    def job_id(self) -> str:
        return self.slot.job_id

    @property
    def key(self) -> StageKey:
        return self.slot.key

    @property
    def inbox(self) -> tuple[StageSlot, int]:
        """The stage's key in the node's mailbox: its slot and plan epoch, so a tensor of
        an older epoch can never be taken by the stage that replaced it."""
        return (self.slot, self.epoch)

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
        self.foreign_failed: Callable[[str], None] | None = None
        """Elastic replica groups: called with the address of another group's stage a
        send failed to, instead of failing this stage (None: every failure fails it)."""

    def recv(self, kind: Kind, step: int, tag: int,
             timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """As :meth:`Transport.recv`; also raises Stopped when the stage is stopped."""
        t, batch = self.mailbox.get(self.stage.inbox, kind, step, tag, stopped=self._stopped,
                                    timeout=timeout)
        return t.to(self.device), batch

    def _stopped(self) -> bool:
        """Whether to give up waiting: the stage was stopped; StageError if a send failed
        (the peer will not answer what it never got)."""
        try:
            self.stage.peers.check()
        except StageError as e:
            own = {a.address for a in self.plan.chain(self.stage.key.replica)}
            if self.foreign_failed is None or not e.peer or e.peer in own:
                raise
            self.foreign_failed(e.peer)
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
                                batch_size=batch_size, epoch=self.stage.epoch)
        self.stage.peers.sender(peer).submit(env, tensor, codec)


class ElasticHooks:
    """A stage's link to the tracker's quorum (elastic replica groups,
    :mod:`fedpipe.tracker.replicas`): asks it, follows the plan it sends when the
    membership changed, and keeps its state for a joining group when told to.

    Args:
        stage: the stage.
        transport: the stage's transport (its plan is replaced with the tracker's).
        quorum: one ReplicaQuorum call to the tracker.
        node_id: returns this node's id.
        keep: keeps a snapshot on this node, under a stage key.
        suspect: reports a peer a send failed to (the tracker pings it).
    """

    def __init__(self, stage: Stage, transport: StageTransport,
                 quorum: Callable[[tracker_pb2.ReplicaQuorumRequest],
                                  tracker_pb2.ReplicaQuorumReply],
                 node_id: Callable[[], str],
                 keep: Callable[[str, StageKey, checkpoint.Snapshot], None],
                 suspect: Callable[[Stage, str], None]):
        self.stage, self.transport, self.quorum = stage, transport, quorum
        self.node_id, self.keep, self.suspect = node_id, keep, suspect
        self.donate: tuple[int, ...] = ()
        transport.foreign_failed = self.peer_failed

    def ask(self, step: int, version: int, reduced: bool, wait: float) -> Quorum:
        """As :class:`~fedpipe.runtime.elastic.AskQuorum`."""
        st = self.stage
        reply = self.quorum(tracker_pb2.ReplicaQuorumRequest(
            job_id=st.job_id, epoch=st.epoch, replica=st.key.replica, stage=st.key.stage,
            node_id=self.node_id(), step=step, version=version, reduced=reduced,
            wait_seconds=wait))
        if reply.plan.stages:  # the membership changed: a joining group's nodes are new
            st.plan = self.transport.plan = PlanView(reply.plan, self.transport.plan
                                                     .job_microbatches)
        q = Quorum(reply.step, reply.version, tuple(reply.members), reply.committed,
                   reply.dropped, tuple(reply.donate_to))
        if q.committed:
            self.donate = q.donate_to
        return q

    def peer_failed(self, address: str) -> None:
        """A send to another group's stage at ``address`` failed: report it, and forget
        the sender so the stage's other sends and receives go on."""
        self.stage.peers.forget(address)
        self.suspect(self.stage, address)

    def after_update(self, step: int) -> None:
        """``after_update`` hook: after the step before a group joins, keep this stage's
        state (weights, optimizer, LR schedule) under the joining group's stage key."""
        if self.donate:
            snap = checkpoint.take(self.stage.parts, step + 1)
            for group in self.donate:
                self.keep(self.stage.job_id, StageKey(group, self.stage.key.stage), snap)
            log.info("job %s stage %d: kept the state after step %d for joining group(s) %s",
                     self.stage.job_id, self.stage.key.stage, step, list(self.donate))
            self.donate = ()


ElasticFactory = Callable[[Stage, StageTransport], ElasticHooks]
"""Makes a stage's :class:`ElasticHooks` (a node that reaches a tracker has one)."""


def build_stage(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
                peers: StagePeers, elastic: ElasticFactory | None = None) -> Stage:
    """Wire a stage from its request: layers, optimizer, loss, replica sync, runner.

    The config is validated before anything is unpickled. ``elastic``: how a stage
    of an elastic job (``min_replicas`` > 0) reaches the tracker's quorum; without
    it such a stage syncs as a plain all-reduce.

    Raises:
        StageLoadError: the config or plan is invalid, or unpickling the layers,
            loss or optimizer, or building them, failed (the message names why).
    """
    try:
        return _build(request, device, mailbox, peers, elastic)
    except BaseException as e:  # noqa: BLE001 — user code (even sys.exit) is the caller's error
        raise StageLoadError(f"cannot load stage {request.stage}: {type(e).__name__}: {e}") \
            from e


def _build(request: node_pb2.LoadStageRequest, device: torch.device, mailbox: Mailbox,
           peers: StagePeers, elastic: ElasticFactory | None) -> Stage:
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
    if not 0 <= request.resume_step < cfg.steps:
        raise ValueError(f"resume_step must be in [0, {cfg.steps}), got {request.resume_step}")
    stage = Stage(StageSlot(request.job_id, *key), n_stages, mine.layer_start, module,
                  cfg.steps, peers, epoch=request.plan.epoch, start=request.resume_step,
                  checkpoint_every=cfg.checkpoint_every, plan=plan)
    # one timed transport for the runner and the syncs, so their waiting counts too
    inner = StageTransport(stage, mailbox, device, plan)
    transport = TimedTransport(inner)
    before: list[StepHook] = []
    after: list[StepHook] = []
    spans = [StageSpan(k, a.layer_start, a.layer_end) for k, a in plan.stages.items()]
    outer: OuterSync | None = None
    schedule = None
    shares = [plan.share(g) for g in range(len(plan.replicas))]
    hooks = elastic(stage, inner) if len(plan.replicas) > 1 and cfg.elastic and elastic \
        else None

    def samples() -> tuple[int, int]:
        return stage.runner.step_samples if stage.runner is not None else (0, 1)

    if cfg.replica_sync == "diloco":  # "auto" is resolved by the tracker; else all-reduce
        outer = OuterSync(module, key, spans, cfg.diloco, shares, transport,
                          last_step=cfg.steps - 1) if hooks is None else \
            ElasticOuterSync(module, key, spans, cfg.diloco, shares, transport, hooks.ask,
                             samples, hooks.peer_failed, last_step=cfg.steps - 1)
        before.append(outer.rescale_gradients)
        after.append(outer)
        if hooks is not None:
            after.append(hooks.after_update)
    elif hooks is not None:
        ask: AskQuorum = hooks.ask
        before.append(ElasticGradientSync(module, key, spans, transport, ask, samples,
                                          hooks.peer_failed))
        after.append(hooks.after_update)
    elif len(plan.replicas) > 1:
        before.append(GradientSync(module, key, spans, transport))
    if cfg.clip_grad_norm:  # after the gradient sync; every stage of the group takes part
        before.append(GlobalNormClip(params, cfg.clip_grad_norm, key.stage,
                                     {s: StageKey(key.replica, s) for s in range(n_stages)
                                      if s != key.stage}, transport))
    if opt is not None and cfg.lr_scheduler:  # stepped after each optimizer step, first
        schedule = cloudpickle.loads(cfg.lr_scheduler).build(opt)
        after.insert(0, lambda step: schedule.step())
    stage.parts = {LAYOUT: layerstate.Layout(module, mine.layer_start), "module": module,
                   "optimizer": opt, "lr_scheduler": schedule, "outer": outer}
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
    """The stages a node holds and their life cycle; the snapshots it keeps. Thread-safe.

    Args:
        node_id: returns the tracker-assigned id (known after registration).
        device: where stages run.
        mailbox: where tensors for the stages wait.
        make_peers: a fresh :class:`StagePeers` for a new stage.
        report: sends a StageReport to the tracker (may block briefly).
        channels: the node's channels (to buddies and restore sources).
        metrics: where each step's time split goes (None: no metrics).
    """

    def __init__(self, node_id: Callable[[], str], device: torch.device, mailbox: Mailbox,
                 make_peers: Callable[[], StagePeers],
                 report: Callable[[tracker_pb2.StageReport], None],
                 channels: ChannelPool | None = None, *, metrics: NodeMetrics | None = None,
                 quorum: Callable[[tracker_pb2.ReplicaQuorumRequest],
                                  tracker_pb2.ReplicaQuorumReply] | None = None):
        self.node_id, self.device, self.mailbox = node_id, device, mailbox
        self.quorum = quorum
        self.metrics = metrics
        self.make_peers, self.report = make_peers, report
        self.channels = channels if channels is not None else ChannelPool()
        self.stages: dict[StageSlot, Stage] = {}
        self.snapshots = SnapshotStore()
        self.lock = threading.Lock()
        self.held = threading.Condition()  # hand-over cuts: Stage.done and Stage.hold_at
        # encodes and ships snapshots, so the stage thread only pays for the copy
        self.shipper = futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")

    # -- life cycle ----------------------------------------------------------
    def load(self, request: node_pb2.LoadStageRequest) -> Stage:
        """Build the stage ``request`` asks for, restore it from its snapshot of
        ``request.resume_step`` (if > 0), and start running it.

        A stopped stage of the same slot, or one of an older plan epoch, is
        replaced (it is stopped and released first).

        Raises:
            StageExists: that stage of that job and epoch is already loaded and running.
            StageLoadError: as :func:`build_stage`, or no snapshot of the resume step
                could be found or restored.
        """
        slot = StageSlot(request.job_id, request.replica, request.stage)
        with self.lock:
            old = self.stages.get(slot)
            if old is not None and not old.stop.is_set() and old.epoch >= request.plan.epoch:
                raise StageExists(f"stage {tuple(slot)} is already loaded (epoch {old.epoch})")
        if old is not None:
            self._release([old])
        peers = self.make_peers()
        later = request.snapshot_wait_seconds > 0  # a joining group's: restored on its thread
        try:
            stage = build_stage(request, self.device, self.mailbox, peers, self._elastic)
            if stage.start > 0 and not later:
                self._restore(stage, list(request.snapshot_sources),
                              list(request.snapshot_pieces))
        except StageLoadError:
            peers.close()
            raise
        with self.lock:
            current = self.stages.get(slot)
            if current is not None and current is not old:  # a concurrent load won
                peers.close()
                raise StageExists(f"stage {tuple(slot)} is already loaded")
            self.stages[slot] = stage
        if later:
            stage.thread = threading.Thread(
                target=self._restore_then_run, name=f"stage-{slot.replica}.{slot.stage}",
                args=(stage, list(request.snapshot_sources), request.snapshot_wait_seconds),
                daemon=True)
        else:
            stage.thread = threading.Thread(target=self._run, args=(stage,),
                                            name=f"stage-{slot.replica}.{slot.stage}",
                                            daemon=True)
        stage.thread.start()
        log.info("loaded job %s stage %d/%d of group %d (layers %d..%d), epoch %d, from step %d",
                 slot.job_id, slot.stage, stage.n_stages, slot.replica, stage.layer_start,
                 stage.layer_start + len(stage.module) - 1, stage.epoch, stage.start)
        return stage

    def _elastic(self, stage: Stage, transport: StageTransport) -> ElasticHooks:
        if self.quorum is None:
            raise ValueError("an elastic job's stage needs a node that reaches a tracker")
        return ElasticHooks(stage, transport, self.quorum, self.node_id, self.snapshots.put,
                            lambda st, address: self._report(
                                st, tracker_pb2.StageReport.STATUS_SUSPECT, peer=address,
                                error=f"a replica sync send to {address} failed"))

    def _restore_then_run(self, stage: Stage, sources: list[str], wait: float) -> None:
        """A joining group's stage: restore the state its donor keeps after the step
        before ``stage.start`` (asking ``sources`` again until it is there, up to
        ``wait`` seconds), then run; report a failure to restore."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self._restore(stage, sources)
                break
            except StageLoadError as e:
                if stage.stop.is_set() or time.monotonic() > deadline:
                    if not stage.stop.is_set():
                        self._report(stage, tracker_pb2.StageReport.STATUS_FAILED,
                                     error=str(e))
                    stage.peers.close()
                    stage.stop.set()
                    return
                stage.stop.wait(timeouts.QUORUM_POLL)
        self._run(stage)

    def _restore(self, stage: Stage, sources: list[str],
                 pieces: Collection[node_pb2.SnapshotPiece] = ()) -> None:
        """Load the stage's snapshot of ``stage.start``: kept here, else from ``sources``;
        or, given ``pieces`` (a plan that splits the layers otherwise), assemble it
        from those layers of the old stages' snapshots
        (:mod:`~fedpipe.runtime.layerstate`): each from the copy kept here if there is
        one, else fetched from its sources, only the layers that change hands.

        A corrupt or truncated snapshot is refused by the decoder and the next
        source is tried.

        Raises:
            StageLoadError: no source had a good snapshot (or piece) of that step, or
                the pieces do not make the stage (the message names what is missing).
        """
        try:
            if pieces:
                snap = layerstate.merge([self._piece(stage, p) for p in pieces])
            else:
                snap = self.snapshots.get(stage.job_id, stage.key, stage.start) or \
                    self._fetch(stage, stage.key, sources)
            layerstate.restore(stage.parts, snap)  # a resplit's pieces come in layer form
        except (WireError, RuntimeError, ValueError, KeyError) as e:
            raise StageLoadError(f"cannot restore stage {stage.key.stage} from its step "
                                 f"{stage.start} snapshot: {e}") from e

    def _piece(self, stage: Stage, piece: node_pb2.SnapshotPiece) -> checkpoint.Snapshot:
        """Layers ``[piece.layer_start, piece.layer_end)`` of old stage ``piece``'s
        snapshot of ``stage.start``, in layer form: from the copy kept here, else fetched."""
        key = StageKey(piece.replica, piece.stage)
        kept = self.snapshots.get(stage.job_id, key, stage.start)
        if kept is not None:
            return layerstate.split(kept, piece.layer_start, piece.layer_end)
        return self._fetch(stage, key, list(piece.sources), piece.layer_start, piece.layer_end)

    def _fetch(self, stage: Stage, key: StageKey, sources: list[str], layer_start: int = 0,
               layer_end: int = 0) -> checkpoint.Snapshot:
        """Stage ``key``'s snapshot of ``stage.start`` from the first of ``sources`` that
        has a good one (``layer_end`` > 0: only those layers, in layer form); a whole
        one of the stage's own key is kept here.

        Raises:
            StageLoadError: no source had it.
        """
        tried = []
        what = f"layers {layer_start}-{layer_end - 1} of " if layer_end > 0 else ""
        for address in sources:
            try:
                with self.channels.borrow(address) as ch:
                    stream = rpc.NodeStub(ch).FetchSnapshot(
                        node_pb2.FetchSnapshotRequest(
                            job_id=stage.job_id, replica=key.replica, stage=key.stage,
                            step=stage.start, layer_start=layer_start, layer_end=layer_end),
                        timeout=timeouts.FETCH_STATE_RPC)
                    _, snap = checkpoint.from_frames(stream, MAX_SNAPSHOT_BYTES)
            except (grpc.RpcError, WireError) as e:
                detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
                log.info("could not fetch %sthe step %d snapshot of job %s stage %d (replica %d) "
                         "from %s: %s", what, stage.start, stage.job_id, key.stage,
                         key.replica, address, detail)
                tried.append(f"{address}: {detail}")
                continue
            if not layer_end:
                self.snapshots.put(stage.job_id, key, snap)
            # the state that changed hands (tests and benchmarks count it from this line)
            log.info("fetched %sthe step %d snapshot of job %s stage %d (replica %d) from %s: "
                     "%d tensors, %d bytes", what, snap.step, stage.job_id, key.stage,
                     key.replica, address, len(snap.tensors), snap.nbytes)
            return snap
        raise StageLoadError(f"no snapshot of step {stage.start} for stage {key.stage} "
                             f"(replica {key.replica}) of job {stage.job_id}: tried "
                             f"{'; '.join(tried) or 'no source'}")

    def _report(self, stage: Stage, status: int, **kw) -> None:
        self.report(tracker_pb2.StageReport(job_id=stage.job_id, replica=stage.slot.replica,
                                            stage=stage.slot.stage, node_id=self.node_id(),
                                            status=status, epoch=stage.epoch, **kw))

    def _report_step(self, stage: Stage, result: StepResult) -> None:
        """One report per step, from every stage: its time split, and the loss
        and samples (the last stage's count towards the job's step)."""
        self._report(stage, tracker_pb2.StageReport.STATUS_STEP, step=result.step + 1,
                     loss=result.loss or 0.0, samples=result.samples, seconds=result.seconds,
                     compute_seconds=result.compute_seconds, wait_seconds=result.wait_seconds,
                     send_seconds=result.send_seconds)
        if self.metrics is not None:
            self.metrics.stage_step(stage.job_id, *stage.key, compute=result.compute_seconds,
                                    wait=result.wait_seconds, send=result.send_seconds)
            self.metrics.in_flight(stage.job_id, *stage.key, result.in_flight)
            self.metrics.staleness(stage.job_id, *stage.key, result.staleness)

    def _run(self, stage: Stage) -> None:
        R = tracker_pb2.StageReport
        try:
            for result in stage.runner.run(stage.steps, stage.start):
                done = result.step + 1
                with self.held:
                    stage.done = done
                    cut = stage.hold_at == done
                if (cut or stage.checkpoint_every and done % stage.checkpoint_every == 0) \
                        and done < stage.steps and not stage.stop.is_set():
                    self._checkpoint(stage, done)
                elif done == stage.steps and not stage.stop.is_set():
                    # the final state, kept here only: what Job.save() of an ended job pulls
                    self.snapshots.put(stage.job_id, stage.key, checkpoint.take(stage.parts, done))
                self._report_step(stage, result)
                if cut:
                    self._hold(stage)
            stage.peers.flush()
            self._report(stage, R.STATUS_DONE, step=stage.steps)
            log.info("job %s stage %d done", stage.job_id, stage.slot.stage)
        except Stopped:
            log.info("job %s stage %d stopped", stage.job_id, stage.slot.stage)
        except Exception as e:  # noqa: BLE001 — reported to the tracker, which fails the job
            if stage.stop.is_set():
                log.info("job %s stage %d stopped (%s)", stage.job_id, stage.slot.stage, e)
            else:
                log.exception("job %s stage %d failed", stage.job_id, stage.slot.stage)
                self._report(stage, R.STATUS_FAILED, error=f"{type(e).__name__}: {e}",
                             peer=e.peer if isinstance(e, StageError) else "")
        finally:
            stage.peers.close()
            stage.stop.set()  # an ended stage takes no more tensors
            self.mailbox.drop(lambda inbox: inbox == stage.inbox)

    # -- hand-over cuts (drains, migrations) ----------------------------------
    def hold(self, job_id: str, epoch: int, step: int) -> tuple[bool, int]:
        """Make every stage of ``job_id``'s plan ``epoch`` here stop at the step boundary
        ``step``: snapshot there (reported as a checkpoint) and wait until stopped or
        given a later cut. ``step`` 0 lifts a hold.

        Returns:
            ``(accepted, done)``: whether every such stage can still stop at ``step``
            (none has gone past it), and the most steps any of them has done.
            A stage that cannot keeps running; the caller picks a later cut.
        """
        with self.lock:
            mine = [s for s in self.stages.values() if s.job_id == job_id and s.epoch == epoch
                    and not s.stop.is_set()]
        with self.held:
            done = max((s.done for s in mine), default=0)
            # a stage holding at its cut may move on to a later one; others must not be past it
            ok = step == 0 or all(s.done < step or s.done == step == s.hold_at for s in mine)
            if ok:
                for s in mine:
                    s.hold_at = step
                self.held.notify_all()
        return ok, done

    def _hold(self, stage: Stage) -> None:
        """Wait at a hand-over cut until the stage is stopped or its cut moves on."""
        log.info("job %s stage %d holds at step %d for a hand-over", stage.job_id,
                 stage.key.stage, stage.done)
        with self.held:
            while stage.hold_at == stage.done and not stage.stop.is_set():
                self.held.wait(HOLD_RECHECK)
        if stage.stop.is_set():
            raise Stopped()

    # -- checkpoints ---------------------------------------------------------
    def _checkpoint(self, stage: Stage, step: int) -> None:
        """Snapshot ``stage`` after ``step`` steps (on its thread: a copy), then keep it,
        ship it to its buddy and report it (on the shipper thread)."""
        snap = checkpoint.take(stage.parts, step)
        self.snapshots.put(stage.job_id, stage.key, snap)
        self.shipper.submit(self._ship, stage, snap)

    def _ship(self, stage: Stage, snap: checkpoint.Snapshot) -> None:
        buddy = stage.plan.buddy(stage.key, snap.step // stage.checkpoint_every) \
            if stage.plan is not None else None
        if buddy is not None:
            env = node_pb2.Envelope(job_id=stage.job_id, replica=stage.key.replica,
                                    stage=stage.key.stage, kind=Kind.SNAPSHOT, step=snap.step,
                                    epoch=stage.epoch, batch_size=1)
            try:
                with self.channels.borrow(buddy.address) as ch:
                    rpc.NodeStub(ch).PutSnapshot(checkpoint.to_frames(snap, env),
                                                           timeout=timeouts.FETCH_STATE_RPC)
            except grpc.RpcError as e:  # the checkpoint stays incomplete; the last one holds
                log.warning("job %s stage %d: could not keep the step %d snapshot on buddy %s: "
                            "%s", stage.job_id, stage.key.stage, snap.step, buddy.node_name,
                            e.details())
                return
        if not stage.stop.is_set():
            self._report(stage, tracker_pb2.StageReport.STATUS_CHECKPOINT, step=snap.step)

    def keep_snapshot(self, stream: Iterator[bytes], max_bytes: int = MAX_SNAPSHOT_BYTES
                      ) -> None:
        """Keep a buddy's snapshot sent by ``PutSnapshot`` (or the job's client's, restoring
        a saved checkpoint), of at most ``max_bytes``.

        Raises:
            SnapshotTooLarge: the snapshot's tensors would take more than ``max_bytes``.
            WireError: a malformed or truncated snapshot, or one whose envelope is not a
                snapshot's.
            NoSuchStage: this node holds no stage of that job (it is no buddy of it).
        """
        first, snap = checkpoint.from_frames(stream, max_bytes)
        env = first.envelope
        if env.kind != Kind.SNAPSHOT or env.step != snap.step:
            raise WireError(f"a snapshot stream needs a KIND_SNAPSHOT envelope of its step "
                            f"{snap.step}, got kind {env.kind} step {env.step}")
        with self.lock:
            known = any(s.job_id == env.job_id for s in self.stages)
        if not known:
            raise NoSuchStage(f"this node runs no stage of job {env.job_id!r}; it keeps no "
                              f"snapshot of it")
        self.snapshots.put(env.job_id, StageKey(env.replica, env.stage), snap)

    def snapshot(self, job_id: str, key: StageKey, step: int) -> checkpoint.Snapshot:
        """The snapshot of stage ``key`` of ``job_id`` at ``step`` kept here.

        Raises:
            NoSuchStage: none kept.
        """
        snap = self.snapshots.get(job_id, key, step)
        if snap is None:
            raise NoSuchStage(f"no step {step} snapshot of stage {key.stage} (replica "
                              f"{key.replica}) of job {job_id!r} here; kept: "
                              f"{self.snapshots.steps(job_id, key)}")
        return snap

    # -- stopping and freeing ------------------------------------------------
    def stop_job(self, job_id: str, release: bool, before_epoch: int = 0,
                 replicas: Collection[int] = ()) -> list[Stage]:
        """Stop every stage of ``job_id`` (with ``before_epoch``, only those of older
        epochs; with ``replicas``, only those of these replica groups); if ``release``,
        also forget them and the job's snapshots and free their memory. Returns the
        stages."""
        with self.lock:
            mine = [s for s in self.stages.values() if s.job_id == job_id
                    and (not before_epoch or s.epoch < before_epoch)
                    and (not replicas or s.key.replica in replicas)]
        for s in mine:
            s.stop.set()
        inboxes = {s.inbox for s in mine}
        self.mailbox.drop(lambda inbox: inbox in inboxes)
        if release:
            self._release(mine)
            self.snapshots.drop_job(job_id)
            if self.metrics is not None:
                self.metrics.forget_job(job_id)
        return mine

    def _release(self, stages: list[Stage]) -> None:
        """Stop, forget and free ``stages``: their threads are joined (up to
        :data:`RELEASE_JOIN` s each) and the reference cycles between a stage,
        its transport, runner and hooks are collected now, not at the next
        full garbage collection."""
        with self.lock:
            for s in stages:
                if self.stages.get(s.slot) is s:
                    del self.stages[s.slot]
        for s in stages:
            s.stop.set()
        for s in stages:
            if s.thread is not None and s.thread is not threading.current_thread():
                s.thread.join(RELEASE_JOIN)
            s.runner, s.parts, s.plan = None, {}, None
            s.module = nn.Sequential()
        del stages
        gc.collect()

    def holdings(self) -> list[tracker_pb2.StageRef]:
        """Every stage held here (running, or ended and kept for its weights), and
        for each job of which only snapshots are kept, one ref with stage -1."""
        with self.lock:
            refs = [tracker_pb2.StageRef(job_id=s.job_id, replica=s.key.replica,
                                         stage=s.key.stage, epoch=s.epoch)
                    for s in self.stages.values()]
        held = {r.job_id for r in refs}
        return refs + [tracker_pb2.StageRef(job_id=j, replica=-1, stage=-1, epoch=-1)
                       for j in sorted(self.snapshots.jobs() - held)]

    def suspect(self, env: node_pb2.Envelope) -> None:
        """A stream that brought ``env``'s stage its pipeline tensors broke: report the
        sending neighbour to the tracker, which pings it (the stage itself goes on; a
        neighbour that died would otherwise leave it waiting until the lease ends)."""
        try:
            stage = self.get(StageSlot(env.job_id, env.replica, env.stage))
        except NoSuchStage:
            return
        if stage.stop.is_set() or stage.plan is None or env.epoch != stage.epoch:
            return
        prev, nxt = stage.plan.neighbours(stage.key)
        sender = {Kind.ACTIVATION: prev, Kind.GRADIENT: nxt}.get(Kind(env.kind))
        if sender is not None:
            self._report(stage, tracker_pb2.StageReport.STATUS_SUSPECT, peer=sender.address,
                         error=f"the stream from {sender.node_name} broke")

    def drop(self, refs: list[tracker_pb2.StageRef], jobs: list[str] = ()) -> None:
        """The tracker's reconciliation: stop and free the stages ``refs`` name (of a
        stale epoch, or moved away), and everything of ``jobs`` (ended and past their
        retention, or unknown), their snapshots included."""
        wanted = {(r.job_id, r.replica, r.stage, r.epoch) for r in refs}
        gone = set(jobs)
        with self.lock:
            doomed = [s for s in self.stages.values()
                      if (s.job_id, *s.key, s.epoch) in wanted or s.job_id in gone]
        if doomed:
            log.info("dropping %d stage(s) the tracker no longer plans here: %s", len(doomed),
                     ", ".join(f"{s.job_id}/{s.key.replica}.{s.key.stage}@{s.epoch}"
                               for s in doomed))
            self._release(doomed)
        for job_id in gone:
            self.snapshots.drop_job(job_id)
            if self.metrics is not None:
                self.metrics.forget_job(job_id)

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        with self.lock:
            for s in self.stages.values():
                s.stop.set()
        self.shipper.shutdown(wait=False, cancel_futures=True)

    def runs(self, job_id: str) -> bool:
        """Whether a stage of ``job_id`` runs here (loaded and not stopped)."""
        with self.lock:
            return any(s.job_id == job_id and not s.stop.is_set() for s in self.stages.values())

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
    def admit(self, env: node_pb2.Envelope, shape: Sequence[int] = ()) -> int:
        """Check a tensor's envelope, and its ``shape`` as its header gives it, before its
        payload is buffered; return its size limit in bytes.

        A probe may be at most :data:`~fedpipe.node.peers.MAX_PROBE_BYTES`; a
        stage's tensor needs a running stage, a known kind, a positive batch
        size, and a step and microbatch index the stage will ask for (others
        would sit in its bounded inbox for ever): inputs only for a first stage,
        targets only for a last, their microbatches within the stage's per step,
        and a tensor of several of them (``env.microbatches``) a row for each.

        Raises:
            NoSuchStage: no running stage of the envelope's job, group and position.
            BadEnvelope: an unknown kind, a batch size below 1, a step or
                microbatch out of range, inputs or targets for the wrong stage.
        """
        if env.kind == Kind.PROBE:
            return MAX_PROBE_BYTES
        stage = self.get(StageSlot(env.job_id, env.replica, env.stage))
        if env.epoch != stage.epoch:
            raise StaleEpoch(f"a tensor of plan epoch {env.epoch} for stage {env.stage} of job "
                             f"{env.job_id!r}, which runs epoch {stage.epoch}")
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
        if env.microbatches < 0:
            raise BadEnvelope(f"envelope microbatches must be >= 0, got {env.microbatches}")
        if env.kind not in BOUNDED_KINDS:
            if env.microbatches > 1:
                raise BadEnvelope(f"microbatches={env.microbatches} on a tensor of kind "
                                  f"{Kind(env.kind).name.lower()}: only a client's inputs "
                                  "and targets hold several microbatches")
            return codecs.MAX_TENSOR_BYTES
        end = stage.n_stages - 1 if env.kind == Kind.TARGET else 0
        if env.stage != end:
            raise BadEnvelope(f"{Kind(env.kind).name.lower()}s go to stage {end} of job "
                              f"{env.job_id!r}, not stage {env.stage}")
        count = max(1, env.microbatches)
        held = stage.runner.microbatches if stage.runner is not None else 0
        last = env.microbatch + count - 1
        if last >= held:
            raise BadEnvelope(f"microbatches {env.microbatch}..{last} out of range: stage "
                              f"{env.stage} runs {held} per step")
        if count > 1 and (not shape or shape[0] < count):
            raise BadEnvelope(f"a tensor of shape {tuple(shape)} cannot hold {count} "
                              "microbatches (one row each at least)")
        return codecs.MAX_TENSOR_BYTES

    def deliver(self, env: node_pb2.Envelope, tensor: torch.Tensor,
                active: Callable[[], bool]) -> None:
        """Hand an admitted tensor to its stage's mailbox (probes are dropped);
        for inputs and targets wait for room while ``active()`` and the stage runs.

        A tensor of several microbatches (``env.microbatches`` > 1, a client's
        inputs or targets) is filed as its pieces (:func:`microbatches`), all or none.

        Raises:
            NoSuchStage: the stage was released meanwhile.
            KeyError: the stage already has that tensor (or one of its pieces).
            Stopped: the stage stopped or ``active()`` turned false while waiting.
            Full: the job has as many tensors waiting on this node as one job may
                (:class:`~fedpipe.node.mailbox.Mailbox`).
        """
        if env.kind == Kind.PROBE:
            return  # a link measurement: it only had to arrive
        slot = StageSlot(env.job_id, env.replica, env.stage)
        stage = self.get(slot)
        if stage.epoch != env.epoch:  # replaced since the tensor was admitted
            raise StaleEpoch(f"stage {env.stage} of job {env.job_id!r} now runs epoch "
                             f"{stage.epoch}, not {env.epoch}")
        self.mailbox.put_all((slot, env.epoch), Kind(env.kind), env.step, env.microbatch,
                             microbatches(env, tensor), env.batch_size,
                             alive=lambda: active() and not stage.stop.is_set())
