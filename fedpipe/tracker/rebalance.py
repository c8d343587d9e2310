"""Rebalancing: membership changes that do not rewind (drains, joins, slow nodes).

A *hand-over* moves some stages of a running job to other nodes from a cut at
a step boundary, with their current state, so no step is recomputed:

1. the tracker picks a cut ``c`` just ahead of the job (:meth:`Rebalancer.handover`)
   and asks every node of the plan to stop its stages there (``HoldAt``):
   after ``c`` steps each stage snapshots (a checkpoint of step ``c``, kept on
   its node and its buddy) and waits;
2. once every stage has acknowledged its snapshot of ``c`` (the job's
   checkpoint of ``c`` is complete, :meth:`Rebalancer.on_checkpoint`), the job
   starts a new plan epoch at ``c`` through the recovery path
   (:meth:`~.recovery.Recovery.begin_handover`), and
   :meth:`~.recovery.Recovery.resume` loads the stages of the new plan, each restoring
   the snapshot of ``c`` from the node that held it. The client rewinds its
   feed to ``c``, which is where the job stood: 0 steps are recomputed.

Three things start a hand-over:

- **a drain** (``fedpipe drain NODE``, a node's SIGTERM, ``systemctl stop``):
  the node takes no new work (:meth:`Drains.usable`) and its stages move as
  after a loss (:func:`~.replan.substitute`), but from the cut instead of the
  last checkpoint. Once no job needs it (:meth:`Rebalancer.drained`) its
  heartbeat reply tells it to exit.
- **a join**: at each complete checkpoint of a job with ``rebalance="auto"``
  (:meth:`Rebalancer.on_checkpoint`), two candidates are weighed: the stages
  re-assigned to the nodes that predict the shortest step (:func:`~.migration.reassign`:
  each stage keeps its layer range, so a stage's whole state moves with it),
  and, for a job of one replica group, the planner's own plan over the nodes
  (:func:`~.migration.resplit`: it may add a stage or move boundaries; each new stage is
  then assembled from the layers of the old stages' snapshots,
  :mod:`fedpipe.runtime.layerstate`). The faster one is taken only when the
  predicted step time falls by at least ``threshold`` (default 10 %) *and* the
  seconds saved over the ``horizon`` (the job's remaining steps, at most
  :data:`HORIZON_STEPS`) exceed the seconds of moving the state of the layers
  that change nodes over the measured links (:func:`~.migration.move_seconds`).
- **a slow node**: a stage whose median compute time
  (:mod:`.stagetimes`) is at least :data:`SLOW_FACTOR` times what
  its node's advertised FLOP/s predict re-measures that node: its speed is
  taken as the advertised one scaled down by the ratio (:attr:`Rebalancer.speed`)
  and the job is re-assigned around it, as for a join.

How a candidate is weighed lives in :mod:`.migration` (the planner's analytic
pipeline estimate; the decision rule of Varuna and Bamboo). Which nodes drain and
the plan a migration moves to are kept in :class:`Drains`, which the recovery
path reads (:mod:`.recovery`); the hand-overs themselves are :class:`Rebalancer`'s.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from .. import planner
from ..planner.costs import compute_seconds
from ..planner.protoio import assignment_memory_bytes, cluster_view
from ..proto import node_pb2, tracker_pb2
from ..spec import ACTIVE, PlanView, StageKey
from .errors import NotFound
from .jobs import Jobs
from .migration import move_seconds, predict_step_seconds, reassign, resplit
from .nodes import NodeCallError, NodeCalls
from .specs import JobSpecs, Spec
from .stagetimes import StageTimes
from .store import Store, StoreUnavailable

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

REBALANCE_THRESHOLD = 0.10
"""Least relative fall of the predicted step time that makes a migration worth it."""
HORIZON_STEPS = 200
"""Most steps a migration's gain is counted over (the job's remaining steps if fewer)."""
SLOW_FACTOR = 1.5
"""A stage whose measured compute time is this many times the predicted one marks its node slow."""
HANDOVER_TIMEOUT = 60.0
"""Seconds a hand-over's cut may take to become a complete checkpoint; past it the hold is
lifted and a drain falls back to a rewind (the node is then treated as lost)."""
STEP_OVERHEAD = 0.02
"""Seconds per microbatch a stage may exceed its calibrated compute time by before it
counts as slow (a step's fixed costs, which FLOP/s do not predict)."""
CONSIDER_EVERY = 5
"""Steps between looks for slow nodes and better assignments (also at every checkpoint)."""
WEIGHED_JOBS = 1024
"""Jobs whose last weighing of candidates the tracker remembers (the most recent)."""
CUT_ATTEMPTS = 5
"""Times the tracker moves a cut later when a stage had already passed it."""


@dataclass
class Handover:
    """A hand-over waiting for its cut to become a complete checkpoint."""

    cut: int                     # the step boundary every stage stops at
    epoch: int                   # the plan epoch it was asked of
    cause: str                   # "drain" or "rebalance"
    names: set[str]              # the nodes it is about (drained, or joined/slow), by name
    deadline: float              # when it is given up (clock seconds)
    target: node_pb2.Plan | None = None  # the plan to move to (None: substitute)
    bytes_moved: int = 0         # state bytes of the stages that change hands
    completing: bool = False     # its cut is complete and the new epoch is being begun


class Handovers(Protocol):
    """What a hand-over asks of the recovery path (:class:`~.recovery.Recovery`)."""

    def begin_handover(self, job_id: str, names: set[str], cause: str) -> None: ...

    def nodes_lost(self, lost: set[str], why: str) -> None: ...

    def old_nodes(self, job_id: str) -> set[str]: ...


class Drains:
    """The draining nodes and the plans migrations move to; thread-safe.

    Args:
        live_nodes: the live nodes (the registry's, in memory).
        clock: seconds since the epoch.
    """

    def __init__(self, live_nodes: Callable[[], list[tracker_pb2.NodeInfo]],
                 clock: Callable[[], float]):
        self.live_nodes, self.clock = live_nodes, clock
        self.lock = threading.RLock()
        self.draining: dict[str, float] = {}
        """Node id -> when its drain began (in memory: a draining node says so in each
        heartbeat, so a restarted tracker learns it again)."""
        self._targets: dict[str, tuple[node_pb2.Plan, int]] = {}  # job -> migration plan, bytes

    def start(self, node_id: str) -> bool:
        """The node drains from now on; True the first time."""
        with self.lock:
            first = node_id not in self.draining
            self.draining.setdefault(node_id, self.clock())
            return first

    def now_draining(self) -> set[str]:
        """Ids of the draining nodes."""
        with self.lock:
            return set(self.draining)

    def usable(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]:
        """The nodes that may take new work: ``nodes`` less the draining ones."""
        with self.lock:
            return [n for n in nodes if n.node_id not in self.draining]

    def annotate(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]:
        """``nodes`` with their ``draining`` flag set (for ListNodes)."""
        with self.lock:
            for n in nodes:
                n.draining = n.node_id in self.draining
        return nodes

    def set_target(self, job_id: str, plan: node_pb2.Plan, bytes_moved: int) -> None:
        """The job's hand-over moves it to ``plan``, moving ``bytes_moved`` of state."""
        with self.lock:
            self._targets[job_id] = (plan, bytes_moved)

    def target_plan(self, job_id: str, plan: node_pb2.Plan) -> tuple[node_pb2.Plan, int] | None:
        """The plan a migration of ``job_id`` moves to, with its bytes moved, if one waits
        (taken once) and still fits the live nodes."""
        with self.lock:
            found = self._targets.pop(job_id, None)
        if found is None:
            return None
        live = {n.node_id for n in self.usable(self.live_nodes())}
        return found if PlanView(found[0]).node_ids() <= live else None

    def forget(self, node_ids: set[str]) -> None:
        """Nodes that are gone (lost or left) are no longer draining."""
        with self.lock:
            for n in node_ids:
                self.draining.pop(n, None)


class Rebalancer:
    """Drains, joins and slow nodes for the jobs of a tracker (see the module docstring).

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (HoldAt).
        jobs: the life cycle (wakes the scheduler).
        specs: each job's decoded spec.
        handovers: the recovery path a complete cut begins.
        drains: the draining nodes and migration targets.
        stage_times: each stage's recent step splits (the slow-node check).
        live_nodes: the live nodes (the registry's, in memory).
        unmeasured: whether a node's links are still to be measured (it is not
            considered yet): the link measurer's.
        candidates: the nodes a job may be planned over, of those given (the scheduler's).
        threshold: least relative fall of the predicted step time for a migration.
        horizon: most steps a migration's gain is counted over.
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, jobs: Jobs, specs: JobSpecs,
                 handovers: Handovers, drains: Drains, stage_times: StageTimes,
                 live_nodes: Callable[[], list[tracker_pb2.NodeInfo]], *,
                 unmeasured: Callable[[str], bool] = lambda node_id: False,
                 candidates: Callable[[list[tracker_pb2.NodeInfo]],
                                      list[tracker_pb2.NodeInfo]] = lambda nodes: nodes,
                 threshold: float = REBALANCE_THRESHOLD, horizon: int = HORIZON_STEPS,
                 clock: Callable[[], float]):
        if not 0 <= threshold < 1:
            raise ValueError(f"the rebalance threshold must be in [0, 1), got {threshold}")
        self.store, self.nodes, self.jobs, self.specs = store, nodes, jobs, specs
        self.handovers, self.drains, self.stage_times = handovers, drains, stage_times
        self.live_nodes, self.unmeasured, self.candidates = live_nodes, unmeasured, candidates
        self.threshold, self.horizon, self.clock = threshold, horizon, clock
        self.speed: dict[str, float] = {}
        """Node id -> its FLOP/s as measured by its stages, where that is below what it
        advertised by :data:`SLOW_FACTOR` or more."""
        self.pending: dict[str, Handover] = {}
        self._considering: set[str] = set()
        self._weighed: OrderedDict[str, tuple] = OrderedDict()
        """Job id -> what its last weighing of candidates saw (:meth:`_changed`)."""
        self.background = True
        """Consider migrations on a thread of their own (False: only when :meth:`consider`
        is called, as in-process tests do)."""
        self._lock = drains.lock

    # -- drains ---------------------------------------------------------------
    def find(self, node: str) -> tracker_pb2.NodeInfo:
        """The live node whose name or id is ``node``.

        Raises:
            NotFound: none.
        """
        for n in self.live_nodes():  # shared messages: the caller gets a copy
            if node in (n.node_id, n.name):
                found = tracker_pb2.NodeInfo()
                found.CopyFrom(n)
                return found
        raise NotFound(f"no live node {node!r} (give its name or id)")

    def drain(self, node: str) -> tuple[tracker_pb2.NodeInfo, list[str]]:
        """Start draining the live node named (or with id) ``node``: it takes no new
        work, and every active job with a stage on it hands its stages over
        (:meth:`handover`). Draining twice is the same as once. Returns the node (its
        ``draining`` set) and the ids of the jobs that use it.

        Raises:
            NotFound: no live node of that name or id.
        """
        n = self.find(node)
        if self.drains.start(n.node_id):
            log.info("node %s (%s) drains", n.name, n.node_id)
        jobs = self._jobs_using(n.node_id)
        for job_id in jobs:
            self.handover(job_id, "drain", {n.name})
        self.jobs.notify()
        n.draining = True
        return n, jobs

    def _jobs_using(self, node_id: str) -> list[str]:
        return [j for j in self.store.jobs_in(*ACTIVE)
                if node_id in PlanView(self.store.job(j).plan).node_ids()]

    def drained(self, node_id: str) -> bool:
        """Whether a draining node is needed by no job any more: it is in no active
        job's plan, and no recovering job may still restore a snapshot from it."""
        if node_id not in self.drains.now_draining():
            return False
        for job_id in self.store.jobs_in(*ACTIVE):
            job = self.store.job(job_id)
            if node_id in PlanView(job.plan).node_ids():
                return False
            if job.state == S.JOB_STATE_RECOVERING and \
                    node_id in self.handovers.old_nodes(job_id):
                return False
        return True

    def forget(self, node_ids: set[str]) -> None:
        """Nodes that are gone (lost or left) are no longer draining, nor slow."""
        with self._lock:
            self.drains.forget(node_ids)
            for n in node_ids:
                self.speed.pop(n, None)

    # -- hand-overs -------------------------------------------------------------
    def handover(self, job_id: str, cause: str, names: set[str],
                 target: node_pb2.Plan | None = None, bytes_moved: int = 0) -> bool:
        """Ask the stages of a RUNNING job to stop at a cut just ahead of them
        (``HoldAt``); the hand-over completes in :meth:`on_checkpoint`. Returns whether
        a cut was set (False: the job is not RUNNING, already handing over, ends
        before any cut, or a node could not be reached: a recovery will move it).
        """
        job = self.store.job(job_id)
        with self._lock:
            if job.state != S.JOB_STATE_RUNNING or job_id in self.pending:
                if job_id in self.pending and cause == "drain" and \
                        not self.pending[job_id].completing:
                    h = self.pending[job_id]  # a drain joins a rebalance's cut, as a drain
                    h.cause, h.target, h.names = "drain", None, h.names | names
                return False
            self.pending[job_id] = Handover(0, job.epoch, cause, names,
                                            self.clock() + HANDOVER_TIMEOUT, target, bytes_moved)
        addresses = sorted(PlanView(job.plan).addresses())
        cut = self._cut(job, addresses)
        if cut is None:
            self._release(job_id, job, addresses)
            return False
        with self._lock:
            mine = self.pending.get(job_id)
            if mine is not None:
                mine.cut = cut
        log.info("job %s: %s of %s at the cut of step %d", job_id, cause,
                 ", ".join(sorted(names)), cut)
        return True

    def _cut(self, job: tracker_pb2.JobInfo, addresses: list[str]) -> int | None:
        """The step boundary every stage accepted to hold at (``HoldAt``), moved later up
        to :data:`CUT_ATTEMPTS` times when a stage had passed it; None if the job ends
        first or a node could not be reached."""
        cut = job.step + 1
        for _ in range(CUT_ATTEMPTS):
            if cut >= job.steps:
                return None  # the job ends first: nothing to move
            replies = []
            try:
                for address in addresses:
                    replies.append(self.nodes.hold_at(address, node_pb2.HoldAtRequest(
                        job_id=job.job_id, epoch=job.epoch, step=cut)))
            except NodeCallError as e:
                log.warning("job %s: a hand-over cut could not be set (%s)", job.job_id, e)
                return None
            if all(r.accepted for r in replies):
                return cut
            cut = max(r.done for r in replies) + 1
        return None

    def _release(self, job_id: str, job: tracker_pb2.JobInfo, addresses: list[str]) -> None:
        with self._lock:
            self.pending.pop(job_id, None)
        for address in addresses:
            try:
                self.nodes.hold_at(address, node_pb2.HoldAtRequest(
                    job_id=job_id, epoch=job.epoch, step=0))
            except NodeCallError:
                pass  # a node that does not answer is lost and recovered from

    def on_checkpoint(self, job_id: str, step: int) -> None:
        """A checkpoint of ``step`` is complete: finish the hand-over waiting for this cut,
        else (at a plain checkpoint) consider a migration in the background."""
        with self._lock:
            h = self.pending.get(job_id)
            ready = h is not None and h.cut == step and not h.completing
            if h is not None and ready:
                h.completing = True  # once; it stays pending until the job left RUNNING,
                if h.target is not None:  # or a tick would see the drained node still in use
                    self.drains.set_target(job_id, h.target, h.bytes_moved)
        if h is not None and ready:
            try:
                self.handovers.begin_handover(job_id, h.names, h.cause)
            finally:
                with self._lock:
                    if self.pending.get(job_id) is h:
                        del self.pending[job_id]
        elif h is None and self.background and job_id not in self._considering:
            threading.Thread(target=self.consider, args=(job_id,), name=f"rebalance-{job_id}",
                             daemon=True).start()

    def on_step(self, job_id: str, step: int) -> None:
        """Step ``step`` of a job is recorded: every :data:`CONSIDER_EVERY` steps look for
        slow nodes and a better assignment (in the background), so a node slower than
        it said is found even when checkpoints are far apart."""
        if self.background and step % CONSIDER_EVERY == 0:
            with self._lock:
                if job_id in self.pending or job_id in self._considering:
                    return
            threading.Thread(target=self.consider, args=(job_id,), name=f"rebalance-{job_id}",
                             daemon=True).start()

    def tick(self) -> None:
        """One scheduler round: give up hand-overs past their deadline (a drain then
        rewinds: its node counts as lost), and start hand-overs of RUNNING jobs that
        still use a draining node (a drain that came while the job was deploying)."""
        now = self.clock()
        with self._lock:
            late = [(j, h) for j, h in self.pending.items() if now > h.deadline]
        draining = self.drains.now_draining()
        for job_id, h in late:
            log.warning("job %s: the %s cut at step %d did not complete within %.0f s", job_id,
                        h.cause, h.cut, HANDOVER_TIMEOUT)
            job = self.store.job(job_id)
            self._release(job_id, job, sorted(PlanView(job.plan).addresses()))
            if h.cause == "drain":
                self.handovers.nodes_lost(draining & PlanView(job.plan).node_ids(),
                                          "did not hand over in time")
        for node_id in draining:
            for job_id in self._jobs_using(node_id):
                if self.store.job(job_id).state == S.JOB_STATE_RUNNING \
                        and job_id not in self.pending:
                    names = {n.name for n in self.live_nodes() if n.node_id == node_id}
                    self.handover(job_id, "drain", names)

    # -- joins and slow nodes ---------------------------------------------------
    def consider(self, job_id: str) -> bool:
        """At a complete checkpoint: re-measure slow nodes from the stages' step times,
        and migrate the job when a re-assignment pays (see the module docstring).
        Returns whether a migration was started."""
        with self._lock:
            if job_id in self._considering:
                return False
            self._considering.add(job_id)
        try:
            return self._consider(job_id)
        except StoreUnavailable as e:  # the scheduler logs the outage; one line here
            log.warning("job %s: a migration was not considered: %s", job_id, e)
            return False
        except Exception:  # noqa: BLE001 — a planner bug must not stop the job
            log.exception("job %s: considering a migration failed", job_id)
            return False
        finally:
            with self._lock:
                self._considering.discard(job_id)

    def _consider(self, job_id: str) -> bool:
        try:
            job = self.store.job(job_id)
            spec = self.specs.get(job_id)
        except KeyError:
            return False
        if spec.job.rebalance != "auto" or job.state != S.JOB_STATE_RUNNING:
            return False
        used = PlanView(job.plan).node_ids()
        live = self.live_nodes()  # read once (the registry's, in memory)
        usable = self.drains.usable(live)
        nodes = [n for n in usable if n.node_id in used] + self.candidates(
            [n for n in usable if n.node_id not in used and not self.unmeasured(n.node_id)])
        nodes.sort(key=lambda n: (n.registered, n.node_id))  # the store's order
        draining = self.drains.now_draining()
        among = nodes + [n for n in live if n.node_id in draining]
        cluster = cluster_view(among, self.store.links_among(n.node_id for n in among))
        flops = {n.node_id: n.resources.flops for n in live}
        self._remeasure(job, spec.profile, flops)

        def speed(node_id: str) -> float:
            return self.speed.get(node_id, flops.get(node_id, 1.0))

        if not self._changed(job, cluster, speed):
            return False
        cand = self._candidate(job, spec, cluster, nodes, speed, draining)
        if cand is None:
            return False
        plan, nbytes = cand
        view = PlanView(job.plan)
        held = {k: (a.node_id, a.layer_start, a.layer_end) for k, a in view.stages.items()}
        names = {a.node_name for k, a in PlanView(plan).stages.items()  # whose layers change:
                 if held.get(k) != (a.node_id, a.layer_start, a.layer_end)}  # a swap names both
        if self.handover(job_id, "rebalance", names, plan, nbytes):
            return True
        with self._lock:  # not started: weigh again at the next look
            self._weighed.pop(job_id, None)
        return False

    def _candidate(self, job: tracker_pb2.JobInfo, spec: Spec, cluster: planner.ClusterView,
                   nodes: list[tracker_pb2.NodeInfo], speed: Callable[[str], float],
                   draining: set[str]) -> tuple[node_pb2.Plan, int] | None:
        """The best re-assignment of ``job`` (stages moved whole, or a re-split) and the
        state bytes it moves, if it pays: the predicted step falls by ``threshold`` and
        the seconds saved over the horizon exceed those of moving the state."""

        def need(a: node_pb2.StageAssignment) -> float:
            return assignment_memory_bytes(job.plan, a, spec.profile, spec.config)

        def predict(p: node_pb2.Plan) -> float:
            return predict_step_seconds(p, cluster, spec.profile, spec.job.schedule, speed,
                                        spec.job.precision, spec.job.max_staleness)

        now_t = predict(job.plan)
        cand = reassign(job.plan, nodes, predict, need)
        split = resplit(job.plan, spec.job, replace(cluster, nodes=[
            replace(n, flops=speed(n.node_id)) for n in cluster.nodes
            if n.node_id not in draining]), spec.profile, nodes)
        if split is not None and predict(split) < predict(cand):
            cand = split
        new_t = predict(cand)
        if cand is job.plan or not math.isfinite(new_t) or now_t <= 0:
            return None
        gain = (now_t - new_t) / now_t
        left = max(0, job.steps - job.step)
        cost, nbytes = move_seconds(job.plan, cand, cluster, spec.profile, spec.config)
        saved = (now_t - new_t) * min(left, self.horizon)
        log.info("job %s: a re-assignment predicts %.4f s/step instead of %.4f (%.0f %%); moving "
                 "%d bytes takes %.3f s, saves %.3f s over %d steps", job.job_id, new_t, now_t,
                 100 * gain, nbytes, cost, saved, min(left, self.horizon))
        if gain < self.threshold or saved <= cost:
            return None
        return cand, nbytes

    def _changed(self, job: tracker_pb2.JobInfo, cluster: planner.ClusterView,
                 speed: Callable[[str], float]) -> bool:
        """Whether what a weighing of candidates for ``job`` depends on changed since its
        last one: the plan epoch, the candidate nodes and their speeds, their links, the
        draining nodes. Weighing plans the job anew (about 0.1 s of the tracker's CPU for
        a small one); with nothing changed it would find what it found before (the gain
        over the remaining steps only shrinks), so a look every few steps re-weighs only
        after a join, a drain, a link refresh or a slow node."""
        with self._lock:
            seen = (job.epoch, tuple((n.node_id, speed(n.node_id)) for n in cluster.nodes),
                    tuple(sorted(cluster.links.items())), frozenset(self.drains.draining))
            if self._weighed.get(job.job_id) == seen:
                return False
            self._weighed.pop(job.job_id, None)
            self._weighed[job.job_id] = seen
            while len(self._weighed) > WEIGHED_JOBS:
                self._weighed.popitem(last=False)
            return True

    def _remeasure(self, job: tracker_pb2.JobInfo, profile: planner.ModelProfile,
                   flops: dict[str, float]) -> None:
        """Mark the nodes whose stages compute :data:`SLOW_FACTOR` times slower than the
        calibrated cost model predicts, with the speed their stages show.

        The model is calibrated on the job's other stages: their median ratio of
        measured to predicted compute (1 for a job of one stage) absorbs what FLOP/s
        leave out (Python and launch overheads, a CPU's cache). A stage must also
        exceed the prediction by :data:`STEP_OVERHEAD` seconds per microbatch, so tiny
        models whose step is all overhead do not count as slow.
        """
        view = PlanView(job.plan)
        ratios: dict[StageKey, tuple[float, float, node_pb2.StageAssignment]] = {}
        for t in self.stage_times.of(job.job_id):
            key = StageKey(t.replica, t.stage)
            a = view.get(key)
            if a is None or t.compute <= 0:
                continue
            m = max(1, view.microbatches(a.replica))
            f, b = compute_seconds(profile, a.layer_start, a.layer_end,
                                   max(flops.get(a.node_id, 1.0), 1.0), view.share(a.replica) / m)
            if f + b > 0:
                ratios[key] = ((f + b) * m, t.compute, a)
        for key, (predicted, measured, a) in ratios.items():
            others = [c / p for k, (p, c, _) in ratios.items() if k != key]
            calibrated = predicted * (statistics.median(others) if others else 1.0)
            m = max(1, view.microbatches(a.replica))
            if measured < SLOW_FACTOR * calibrated + STEP_OVERHEAD * m:
                continue
            speed = flops.get(a.node_id, 1.0) * calibrated / measured
            with self._lock:
                if speed < self.speed.get(a.node_id, math.inf):
                    log.warning("node %s computes %.1fx slower than the calibrated model "
                                "predicts: taking %.2g FLOP/s", a.node_name,
                                measured / calibrated, speed)
                    self.speed[a.node_id] = speed
