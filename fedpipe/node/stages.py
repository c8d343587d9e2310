"""The stages a node holds: their lookup, and their life cycle from load to release.

A stage is loaded from a ``LoadStage`` request (wired by
:func:`~fedpipe.node.wiring.build_stage`, restored by
:class:`~fedpipe.node.restore.Restorer` when it resumes), runs its steps on a
thread of its own (:class:`~fedpipe.node.running.StageLoop`), and is stopped or
released by ``StopJob`` or the tracker's reconciliation. Its states and their
transitions are :mod:`~fedpipe.node.lifecycle`'s table. :class:`StageRegistry`
holds them all; it raises the node's domain errors (:mod:`~fedpipe.node.errors`).

Every stage belongs to a plan *epoch*; each recovery of the job starts a new
one. Tensors and reports carry the epoch, and a stage takes nothing from an
older epoch. A stage of a newer epoch replaces an ended one of the same slot.
"""
from __future__ import annotations

import gc
import logging
import threading
from typing import Callable, Collection, Sequence

from torch import nn

from ..net import timeouts
from ..proto import node_pb2, tracker_pb2
from .errors import MemoryTooSmall, NoSuchStage, StageExists, StageLoadError, Stopped
from .lifecycle import ENDED, Stage, StageSlot, StageState
from .mailbox import Mailbox
from .memory import StageMemory, held_bytes
from .peers import StagePeers
from .reports import StageReporter
from .restore import Restorer
from .running import StageLoop
from .snapshots import SnapshotStore

__all__ = ["StageBuilder", "StageRegistry", "StageSlot"]

log = logging.getLogger(__name__)

RELEASE_JOIN = timeouts.THREAD_JOIN
"""Seconds a release waits for the stage's thread to end before it frees the memory anyway."""

StageBuilder = Callable[[node_pb2.LoadStageRequest, StagePeers], Stage]
"""Wires a stage (state LOADING) from its request over the given peers
(:func:`~fedpipe.node.wiring.build_stage`); raises StageLoadError."""


class StageRegistry:
    """The stages a node holds, by slot, and their life cycle. Thread-safe.

    Args:
        build: wires a stage from its request.
        make_peers: a fresh :class:`StagePeers` for a new stage.
        restorer: restores a resumed stage before it starts.
        loop: runs a stage's thread, and its hand-over cuts.
        mailbox: where tensors for the stages wait.
        snapshots: the snapshots kept on this node (a released job's are dropped).
        reporter: forgets a released job's metrics.
        memory: admits a stage by its predicted memory and measures its peak (None:
            no check).
        job_over: told a job's name once no stage of it is held here any more after a
            release (the socket data plane closes the job's links through relays:
            :meth:`~fedpipe.net.dataplane.DataPlane.end_job`); None: nothing is told.
    """

    def __init__(self, build: StageBuilder, make_peers: Callable[[], StagePeers],
                 restorer: Restorer, loop: StageLoop, mailbox: Mailbox,
                 snapshots: SnapshotStore, reporter: StageReporter,
                 memory: StageMemory | None = None,
                 job_over: Callable[[str], object] | None = None):
        self.build, self.make_peers, self.restorer, self.loop = build, make_peers, restorer, loop
        self.memory, self.job_over = memory, job_over
        self.mailbox, self.snapshots, self.reporter = mailbox, snapshots, reporter
        self.stages: dict[StageSlot, Stage] = {}
        self.lock = threading.Lock()
        # the loads being built (outside the lock), each [slot, epoch, why a StopJob stopped
        # it or None]: a StopJob that arrives meanwhile marks them, as it cannot reach a
        # stage that is not in ``stages`` yet, and the load releases its stage when built
        self._loading: list[list] = []

    # -- lookup --------------------------------------------------------------
    def get(self, slot: StageSlot) -> Stage:
        """The loaded stage (live or ended, not released).

        Raises:
            NoSuchStage: not loaded here, or released.
        """
        with self.lock:
            stage = self.stages.get(slot)
        if stage is None:
            raise NoSuchStage(f"no stage {slot.stage} of job {slot.job_id!r} "
                              f"(replica {slot.replica}) on this node")
        return stage

    def select(self, match: Callable[[Stage], bool]) -> list[Stage]:
        """The stages held here that ``match``."""
        with self.lock:
            return [s for s in self.stages.values() if match(s)]

    def runs(self, job_id: str) -> bool:
        """Whether a stage of ``job_id`` runs here (loaded and live)."""
        return bool(self.select(lambda s: s.job_id == job_id and s.live))

    def holds(self, job_id: str) -> bool:
        """Whether any stage of ``job_id`` is held here, live or ended."""
        return bool(self.select(lambda s: s.job_id == job_id))

    def holdings(self) -> list[tracker_pb2.StageRef]:
        """Every stage held here (running, or ended and kept for its weights), with the
        checkpoint steps it acknowledged that may not be complete yet
        (:meth:`~.snapshots.SnapshotStore.acked_steps`), and for each job of which only
        snapshots are kept, one ref with stage -1."""
        refs = [tracker_pb2.StageRef(job_id=s.job_id, replica=s.key.replica,
                                     stage=s.key.stage, epoch=s.epoch,
                                     acked=self.snapshots.acked_steps(s.job_id, s.key, s.epoch))
                for s in self.select(lambda s: True)]
        held = {r.job_id for r in refs}
        return refs + [tracker_pb2.StageRef(job_id=j, replica=-1, stage=-1, epoch=-1)
                       for j in sorted(self.snapshots.jobs() - held)]

    # -- life cycle ----------------------------------------------------------
    def load(self, request: node_pb2.LoadStageRequest) -> Stage:
        """Build the stage ``request`` asks for, restore it from its snapshot of
        ``request.resume_step`` (if > 0; a joining group's stage restores on its
        thread), and start running it.

        An ended stage of the same slot, or one of an older plan epoch, is
        replaced (it is stopped and released first). The same load again (a live stage
        of the same plan, epoch and resume step: a tracker that took over redoes the
        recovery its predecessor began) returns the live stage. A :meth:`stop_job` that comes
        while the stage is being built (before it is held here) stops it: once built
        it is released, not started.

        Raises:
            StageExists: that stage of that job and epoch is already loaded and live.
            MemoryTooSmall: its predicted memory, with what the node's other stages are
                predicted to hold (but the job's stages of older plan epochs, which it
                replaces), is more than the node's limit (nothing is built).
            StageLoadError: as :func:`~fedpipe.node.wiring.build_stage`, or no snapshot
                of the resume step could be found or restored.
            Stopped: a StopJob of the job came while the stage was being built.
        """
        slot = StageSlot(request.job_id, request.replica, request.stage)
        with self.lock:
            old = self.stages.get(slot)
            if old is not None and old.live and old.epoch >= request.plan.epoch:
                if _same_load(old, request):  # asked again: a takeover redoes a recovery
                    log.info("job %s stage %d of plan epoch %d is loaded already, as asked "
                             "again (a tracker that took over redoes the recovery it found "
                             "in progress)", slot.job_id, slot.stage, old.epoch)
                    return old
                raise StageExists(f"stage {tuple(slot)} is already loaded (epoch {old.epoch})")
            loading: list = [slot, request.plan.epoch, None]
            self._loading.append(loading)
        try:
            if old is not None:
                self._release([old], f"replaced by a load of plan epoch {request.plan.epoch}")
            if self.memory is not None:  # the job's stages of older epochs give way to it
                others = self.select(lambda s: s.job_id != request.job_id
                                     or s.epoch >= request.plan.epoch)
                self.memory.admit(request, [s.slot for s in others], {
                    s.slot: held_bytes(s.parts) for s in others if s.state in ENDED})
            stage = self._build(request)
        except BaseException as e:
            with self.lock:
                self._loading.remove(loading)
            if self.memory is not None and not isinstance(e, MemoryTooSmall):
                self.memory.forget(slot)
            raise
        with self.lock:  # one critical section with stop_job: a stop lands before or after
            self._loading.remove(loading)
            stopped, current = loading[2], self.stages.get(slot)
            won = current is not None and current is not old  # a concurrent load won
            if stopped is None and not won:
                self.stages[slot] = stage
        if stopped is not None:  # a StopJob came while it was built: it is not kept
            if self.memory is not None:
                self.memory.forget(slot)
            stage.peers.close()
            self._release([stage], stopped)  # LOADING or RESTORING -> STOPPED -> RELEASED
            raise Stopped(f"stage {tuple(slot)} of plan epoch {request.plan.epoch} was "
                          f"stopped while it loaded ({stopped}); it is not kept")
        if won:
            stage.peers.close()
            stage.move(StageState.STOPPED, "a concurrent load of its slot won")
            raise StageExists(f"stage {tuple(slot)} is already loaded")
        self.loop.start(stage, list(request.snapshot_sources), request.snapshot_wait_seconds)
        log.info("loaded job %s stage %d/%d of group %d (layers %d..%d), epoch %d, from step %d",
                 slot.job_id, slot.stage, stage.n_stages, slot.replica, stage.layer_start,
                 stage.layer_start + len(stage.module) - 1, stage.epoch, stage.start)
        return stage

    def _build(self, request: node_pb2.LoadStageRequest) -> Stage:
        """Wire the stage and, unless it is a joining group's, restore it now.

        Raises:
            StageLoadError: as :meth:`load`.
        """
        self.restorer.learn(request)  # where its snapshot's sources' data ports are
        peers = self.make_peers()
        try:
            stage = self.build(request, peers)
        except StageLoadError as e:
            self._refused(e, peers)
            raise
        if stage.start > 0 and request.snapshot_wait_seconds <= 0:
            stage.move(StageState.RESTORING, f"resumes at step {stage.start}")
            try:
                self.restorer.restore(stage, list(request.snapshot_sources),
                                      list(request.snapshot_pieces))
            except StageLoadError as e:
                self._refused(e, peers)
                stage.move(StageState.FAILED, str(e))
                raise
        return stage

    @staticmethod
    def _refused(error: StageLoadError, peers: StagePeers) -> None:
        log.error("%s", error, exc_info=error.__cause__)
        peers.close()

    def hold(self, job_id: str, epoch: int, step: int) -> tuple[bool, int]:
        """Make every live stage of ``job_id``'s plan ``epoch`` here stop at the step
        boundary ``step`` (:meth:`~fedpipe.node.running.StageLoop.hold`); ``step`` 0
        lifts a hold (of none: a no-op).

        Raises:
            NoSuchStage: a cut (``step`` > 0) for a job with no live stage of that epoch
                here: no stage would hold, and the hand-over would wait for it in vain.
        """
        stages = self.select(lambda s: s.job_id == job_id and s.epoch == epoch and s.live)
        if step and not stages:
            raise NoSuchStage(f"no live stage of job {job_id!r} at plan epoch {epoch} on this "
                              f"node to hold at step {step}")
        return self.loop.hold(stages, step)

    def stop_job(self, job_id: str, release: bool, before_epoch: int = 0,
                 replicas: Collection[int] = ()) -> list[Stage]:
        """Stop every stage of ``job_id`` (with ``before_epoch``, only those of older
        epochs; with ``replicas``, only those of these replica groups); if ``release``,
        also forget them and the job's snapshots and free their memory. Returns the
        stages."""
        def matches(slot: StageSlot, epoch: int) -> bool:
            return (slot.job_id == job_id and (not before_epoch or epoch < before_epoch)
                    and (not replicas or slot.replica in replicas))

        with self.lock:
            mine = [s for s in self.stages.values() if matches(s.slot, s.epoch)]
            for loading in self._loading:  # not built yet: its load releases it when built
                if matches(loading[0], loading[1]):
                    loading[2] = "StopJob"
        self._stop(mine, "StopJob")
        if release:
            self._release(mine, "StopJob with release")
            self.snapshots.drop_job(job_id)
            self.reporter.forget_job(job_id)
            self._over(job_id)
        return mine

    def drop(self, refs: Sequence[tracker_pb2.StageRef], jobs: Sequence[str] = ()) -> None:
        """The tracker's reconciliation: stop and free the stages ``refs`` name (of a
        stale epoch, or moved away), and everything of ``jobs`` (ended and past their
        retention, or unknown), their snapshots included."""
        wanted = {(r.job_id, r.replica, r.stage, r.epoch) for r in refs}
        gone = set(jobs)
        doomed = self.select(lambda s: (s.job_id, *s.key, s.epoch) in wanted
                             or s.job_id in gone)
        if doomed:
            log.info("dropping %d stage(s) the tracker no longer plans here: %s", len(doomed),
                     ", ".join(f"{s.job_id}/{s.key.replica}.{s.key.stage}@{s.epoch}"
                               for s in doomed))
            self._release(doomed, "the tracker no longer plans it here")
        for job_id in gone:
            self.snapshots.drop_job(job_id)
            self.reporter.forget_job(job_id)
            self._over(job_id)

    def _over(self, job_id: str) -> None:
        """Tell :attr:`job_over` that ``job_id`` is over here, unless a stage of it is
        still held or being loaded (its senders may hold the job's links)."""
        with self.lock:
            loading = any(slot.job_id == job_id for slot, *_ in self._loading)
        if self.job_over is not None and not loading and not self.holds(job_id):
            self.job_over(job_id)

    def stop_live(self, reason: str) -> list[Stage]:
        """Stop every stage, keeping them and their snapshots for the tracker's recovery
        (this node's incarnation ended: it moved to another relay). Returns them."""
        stages = self.select(lambda s: True)
        self._stop(stages, reason)
        return stages

    def readdress(self, job_id: str, epoch: int, now: Sequence[node_pb2.StageAssignment]
                  ) -> dict[str, tuple[str, str]]:
        """A node of ``job_id``'s plan ``epoch`` moved to another relay: point this node's
        stages of that epoch at the assignments ``now`` gives (in place: their senders,
        snapshots and reports use the new addresses). Returns, for each node whose data
        address changed, ``name -> (old, new)``."""
        moved: dict[str, tuple[str, str]] = {}
        by_key = {(a.replica, a.stage): a for a in now}
        for s in self.select(lambda s: s.job_id == job_id and s.epoch == epoch):
            for a in s.plan.stages.values() if s.plan is not None else ():
                new = by_key.get((a.replica, a.stage))
                if new is None or new.node_id != a.node_id or \
                        (new.address, new.data_address) == (a.address, a.data_address):
                    continue
                if new.data_address != a.data_address:
                    moved[a.node_name] = (a.data_address, new.data_address)
                a.address, a.data_address, a.relay = new.address, new.data_address, new.relay
        return moved

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        for s in self.select(lambda s: True):
            s.move(StageState.STOPPED, "the node shuts down", strict=False)
        self.loop.close()

    def _stop(self, stages: Sequence[Stage], reason: str) -> None:
        """Stop ``stages`` (those still live) and drop what waits for them."""
        for s in stages:
            s.move(StageState.STOPPED, reason, strict=False)
        inboxes = {s.inbox for s in stages}
        self.mailbox.drop(lambda inbox: inbox in inboxes)

    def _release(self, stages: list[Stage], reason: str) -> None:
        """Stop, forget and free ``stages``: their threads are joined (up to
        :data:`RELEASE_JOIN` s each) and the reference cycles between a stage,
        its transport, runner and hooks are collected now, not at the next
        full garbage collection."""
        with self.lock:
            for s in stages:
                if self.stages.get(s.slot) is s:
                    del self.stages[s.slot]
                    if self.memory is not None:
                        self.memory.forget(s.slot)
        for s in stages:
            s.move(StageState.STOPPED, reason, strict=False)
        for s in stages:
            if s.thread is not None and s.thread is not threading.current_thread():
                s.thread.join(RELEASE_JOIN)
            s.move(StageState.RELEASED, reason, strict=False)  # released once, by one caller
            s.runner, s.parts, s.plan = None, {}, None
            s.module = nn.Sequential()
        del stages
        gc.collect()


def _same_load(stage: Stage, request: node_pb2.LoadStageRequest) -> bool:
    """Whether ``request`` asks for ``stage`` as it is: same plan epoch, resume step and
    plan (a stage whose plan a replica groups' quorum changed since is not)."""
    return stage.epoch == request.plan.epoch and stage.start == request.resume_step and \
        stage.plan is not None and stage.plan.plan == request.plan
