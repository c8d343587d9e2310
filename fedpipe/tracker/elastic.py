"""Membership changes that do not rewind: drains, joins and slow nodes.

A *hand-over* moves some stages of a running job to other nodes from a cut at
a step boundary, with their current state, so no step is recomputed:

1. the tracker picks a cut ``c`` just ahead of the job (:meth:`Elastic.handover`)
   and asks every node of the plan to stop its stages there (``HoldAt``):
   after ``c`` steps each stage snapshots (a checkpoint of step ``c``, kept on
   its node and its buddy) and waits;
2. once every stage has acknowledged its snapshot of ``c`` (the job's
   checkpoint of ``c`` is complete, :meth:`Elastic.on_checkpoint`), the job
   starts a new plan epoch at ``c`` through the recovery path
   (:meth:`~.jobs.Jobs.begin_recovery` with a cause), and
   :meth:`~.jobs.Jobs.resume` loads the stages of the new plan, each restoring
   the snapshot of ``c`` from the node that held it. The client rewinds its
   feed to ``c``, which is where the job stood: 0 steps are recomputed.

Three things start a hand-over:

- **a drain** (``fedpipe drain NODE``, a node's SIGTERM, ``systemctl stop``):
  the node takes no new work (:meth:`Elastic.usable`) and its stages move as
  after a loss (:func:`~.replan.substitute`), but from the cut instead of the
  last checkpoint. Once no job needs it (:meth:`Elastic.drained`) its
  heartbeat reply tells it to exit.
- **a join**: at each complete checkpoint of a job with ``rebalance="auto"``
  (:meth:`Elastic.on_checkpoint`), two candidates are weighed: the stages
  re-assigned to the nodes that predict the shortest step (:func:`reassign`:
  each stage keeps its layer range, so a stage's whole state moves with it),
  and, for a job of one replica group, the planner's own plan over the nodes
  (:func:`resplit`: it may add a stage or move boundaries; each new stage is
  then assembled from the layers of the old stages' snapshots,
  :mod:`fedpipe.runtime.layerstate`). The faster one is taken only when the
  predicted step time falls by at least ``threshold`` (default 10 %) *and* the
  seconds saved over the ``horizon`` (the job's remaining steps, at most
  :data:`HORIZON_STEPS`) exceed the seconds of moving the state of the layers
  that change nodes over the measured links (:func:`move_seconds`).
- **a slow node**: a stage whose median compute time
  (:meth:`~.jobs.Jobs.stage_times`) is at least :data:`SLOW_FACTOR` times what
  its node's advertised FLOP/s predict re-measures that node: its speed is
  taken as the advertised one scaled down by the ratio (:attr:`Elastic.speed`)
  and the job is re-assigned around it, as for a join.

The cost model is the planner's analytic pipeline estimate
(:func:`fedpipe.planner.costs.pipeline_estimate`, GPipe/1F1B max-plus bounds);
the decision rule (gain ≥ threshold, gain × horizon > move cost) follows the
amortised-migration rule of Varuna (Athlur et al., EuroSys 2022) and Bamboo.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

from .. import planner
from ..planner.costs import boundary_bytes, compute_seconds, pipeline_estimate, state_bytes, \
    transfer_seconds
from ..planner.protoio import cluster_view, model_profile, plan_message, train_config
from ..proto import node_pb2, tracker_pb2
from ..spec import ACTIVE, JobSpec, PlanView, StageKey
from .errors import NotFound
from .jobs import Jobs
from .nodes import NodeCallError, NodeCalls

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


def predict_step_seconds(plan: node_pb2.Plan, cluster: planner.ClusterView,
                         profile: planner.ModelProfile, schedule: str,
                         speed: Callable[[str], float]) -> float:
    """Predicted seconds of one step of ``plan``: the slowest replica group's
    ``sigma + (m - 1) · period`` (:func:`~fedpipe.planner.costs.pipeline_estimate`),
    with node ``n`` computing at ``speed(n)`` FLOP/s and the links of ``cluster``.
    """
    view = PlanView(plan)
    worst = 0.0
    for g, chain in enumerate(view.chains()):
        m = view.microbatches(g)
        samples = view.share(g) / max(1, m)
        fw, bw, ab, at, gb, gt = [], [], [], [], [], []
        for i, a in enumerate(chain):
            f, b = compute_seconds(profile, a.layer_start, a.layer_end,
                                   max(speed(a.node_id), 1.0), samples)
            fw.append(f)
            bw.append(b)
            if i + 1 < len(chain):
                nxt = chain[i + 1]
                nbytes = boundary_bytes(profile, a.layer_end, samples)
                busy, lat = transfer_seconds(cluster.link(a.node_id, nxt.node_id), nbytes,
                                             a.activation_codec or "raw")
                ab.append(busy)
                at.append(busy + lat)
                busy, lat = transfer_seconds(cluster.link(nxt.node_id, a.node_id), nbytes,
                                             nxt.gradient_codec or "raw")
                gb.append(busy)
                gt.append(busy + lat)
        sigma, period = pipeline_estimate(fw, bw, ab, at, gb, gt, m,
                                          "gpipe" if schedule == "gpipe" else "1f1b")
        worst = max(worst, sigma + (m - 1) * period)
    return worst


def _moved_state(before: node_pb2.Plan, after: node_pb2.Plan, profile: planner.ModelProfile,
                 config: planner.TrainConfig) -> list[tuple[str, str, float]]:
    """``(from node, to node, bytes)`` for each pair of nodes between which layers change
    hands: each layer of a stage of ``after`` that its replica group held on another node
    in ``before`` counts its state (weights and optimizer state), nothing else. A stage
    that moves whole counts all its layers; a re-split (a boundary that moves, a stage
    added) only the layers whose node changes (:mod:`fedpipe.runtime.layerstate`)."""
    old = PlanView(before)
    moved: dict[tuple[str, str], float] = {}
    for key, a in sorted(PlanView(after).stages.items()):
        for o in old.chain(key.replica) if key.replica in old.replicas else []:
            lo, hi = max(o.layer_start, a.layer_start), min(o.layer_end, a.layer_end)
            if lo < hi and o.node_id != a.node_id:
                pair = (o.node_id, a.node_id)
                moved[pair] = moved.get(pair, 0.0) + state_bytes(
                    profile, lo, hi, replace(config, snapshot_copies=0))
    return [(a, b, n) for (a, b), n in sorted(moved.items())]


def move_seconds(before: node_pb2.Plan, after: node_pb2.Plan, cluster: planner.ClusterView,
                 profile: planner.ModelProfile, config: planner.TrainConfig
                 ) -> tuple[float, int]:
    """Seconds and bytes of moving the state (weights and optimizer state) of the layers
    that change nodes between two plans (:func:`_moved_state`), each pair of nodes over
    its measured link, all at once (the slowest transfer counts): ``(seconds, bytes)``."""
    moves = _moved_state(before, after, profile, config)
    seconds = max((cluster.link(a, b).transfer_seconds(n) for a, b, n in moves), default=0.0)
    return seconds, int(sum(n for _, _, n in moves))


def resplit(plan: node_pb2.Plan, spec: JobSpec, cluster: planner.ClusterView,
            profile: planner.ModelProfile, nodes: list[tracker_pb2.NodeInfo]
            ) -> node_pb2.Plan | None:
    """A new plan from the planner over ``cluster`` (its nodes at their current speeds),
    free to split the layers otherwise than ``plan`` (more or fewer stages, moved
    boundaries): the candidate a join is weighed by when moving whole stages cannot use
    the new node. Only for a job of one replica group that is not elastic (replica
    groups re-form by :mod:`.replicas`); None otherwise, or when the planner finds no
    plan of one group."""
    if len(PlanView(plan).replicas) != 1 or spec.elastic:
        return None
    try:
        out = planner.make_plan(cluster, profile, replace(train_config(spec), replicas=1))
    except planner.PlanError as e:
        log.info("no re-split plan: %s", e)
        return None
    if len(out.groups) != 1:
        return None
    return plan_message(out, {n.node_id: n for n in nodes})


def _assign(plan: node_pb2.Plan, key: StageKey, node: tracker_pb2.NodeInfo) -> node_pb2.Plan:
    out = node_pb2.Plan()
    out.CopyFrom(plan)
    for a in out.stages:
        if (a.replica, a.stage) == key:
            a.node_id, a.node_name, a.address = node.node_id, node.name, node.address
    view = PlanView(out)
    out.summary = "; ".join(
        f"{'group %d ' % k.replica if len(view.replicas) > 1 else ''}{a.node_name}: layers "
        f"{a.layer_start}-{a.layer_end - 1}" for k, a in sorted(view.stages.items()))
    return out


def reassign(plan: node_pb2.Plan, nodes: list[tracker_pb2.NodeInfo],
             predict: Callable[[node_pb2.Plan], float],
             need: Callable[[node_pb2.StageAssignment], float]) -> node_pb2.Plan:
    """A better assignment of ``plan``'s stages to ``nodes``, each stage keeping its
    layer range: greedy steepest descent, each round moving the one stage to the
    unused node (one the plan does not use, with at least ``need(stage)`` bytes of
    memory) that lowers ``predict`` (seconds per step) most, until no move helps.
    Returns ``plan`` itself when nothing does. O(stages² · nodes) predictions."""
    best, best_t = plan, predict(plan)
    for _ in range(len(plan.stages)):
        used = PlanView(best).node_ids()
        spare = [n for n in nodes if n.node_id not in used]
        step_best = None
        for key, a in sorted(PlanView(best).stages.items()):
            for n in spare:
                if n.resources.memory_bytes < need(a):
                    continue
                cand = _assign(best, key, n)
                t = predict(cand)
                if t < best_t * (1 - 1e-9) and (step_best is None or t < step_best[1]):
                    step_best = (cand, t)
        if step_best is None:
            break
        best, best_t = step_best
    return best


class Elastic:
    """Drains, joins and slow nodes for the jobs of a tracker (see the module docstring).

    Args:
        jobs: the job life cycle (its store, node calls and clock are used).
        threshold: least relative fall of the predicted step time for a migration.
        horizon: most steps a migration's gain is counted over.
    """

    def __init__(self, jobs: Jobs, *, threshold: float = REBALANCE_THRESHOLD,
                 horizon: int = HORIZON_STEPS):
        if not 0 <= threshold < 1:
            raise ValueError(f"the rebalance threshold must be in [0, 1), got {threshold}")
        self.jobs = jobs
        self.store, self.nodes, self.clock = jobs.store, jobs.nodes, jobs.clock
        self.nodes_calls: NodeCalls = jobs.nodes
        self.threshold, self.horizon = threshold, horizon
        self.draining: dict[str, float] = {}
        """Node id -> when its drain began (in memory: a draining node says so in each
        heartbeat, so a restarted tracker learns it again)."""
        self.speed: dict[str, float] = {}
        """Node id -> its FLOP/s as measured by its stages, where that is below what it
        advertised by :data:`SLOW_FACTOR` or more."""
        self.pending: dict[str, Handover] = {}
        self._targets: dict[str, tuple[node_pb2.Plan, int]] = {}  # job -> migration plan, bytes
        self._considering: set[str] = set()
        self._weighed: OrderedDict[str, tuple] = OrderedDict()
        """Job id -> what its last weighing of candidates saw (:meth:`_consider`)."""
        self.background = True
        """Consider migrations on a thread of their own (False: only when :meth:`consider`
        is called, as in-process tests do)."""
        self.unmeasured: Callable[[str], bool] = lambda node_id: False
        """Whether a node's links are still to be measured (it is not considered yet); the
        tracker sets it from its link measurer."""
        self._lock = threading.RLock()
        jobs.on_checkpoint, jobs.on_step = self.on_checkpoint, self.on_step
        jobs.usable = self.usable
        jobs.target_plan = self.target_plan

    # -- drains ---------------------------------------------------------------
    def find(self, node: str) -> tracker_pb2.NodeInfo:
        """The live node whose name or id is ``node``.

        Raises:
            NotFound: none.
        """
        for n in self.jobs.live_nodes():  # shared messages: the caller gets a copy
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
        with self._lock:
            first = n.node_id not in self.draining
            self.draining.setdefault(n.node_id, self.clock())
        if first:
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

    def usable(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]:
        """The nodes that may take new work: ``nodes`` less the draining ones."""
        with self._lock:
            return [n for n in nodes if n.node_id not in self.draining]

    def annotate(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]:
        """``nodes`` with their ``draining`` flag set (for ListNodes)."""
        with self._lock:
            for n in nodes:
                n.draining = n.node_id in self.draining
        return nodes

    def drained(self, node_id: str) -> bool:
        """Whether a draining node is needed by no job any more: it is in no active
        job's plan, and no recovering job may still restore a snapshot from it."""
        if node_id not in self.draining:
            return False
        for job_id in self.store.jobs_in(*ACTIVE):
            job = self.store.job(job_id)
            if node_id in PlanView(job.plan).node_ids():
                return False
            if job.state == S.JOB_STATE_RECOVERING and node_id in self.jobs.old_nodes(job_id):
                return False
        return True

    def forget(self, node_ids: set[str]) -> None:
        """Nodes that are gone (lost or left) are no longer draining."""
        with self._lock:
            for n in node_ids:
                self.draining.pop(n, None)
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
        cut, addresses = job.step + 1, sorted(PlanView(job.plan).addresses())
        for _ in range(CUT_ATTEMPTS):
            if cut >= job.steps:
                break  # the job ends first: nothing to move
            replies = []
            try:
                for address in addresses:
                    replies.append(self.nodes_calls.hold_at(address, node_pb2.HoldAtRequest(
                        job_id=job_id, epoch=job.epoch, step=cut)))
            except NodeCallError as e:
                log.warning("job %s: a hand-over cut could not be set (%s)", job_id, e)
                break
            if all(r.accepted for r in replies):
                with self._lock:
                    mine = self.pending.get(job_id)
                    if mine is not None:
                        mine.cut = cut
                log.info("job %s: %s of %s at the cut of step %d", job_id, cause,
                         ", ".join(sorted(names)), cut)
                return True
            cut = max(r.done for r in replies) + 1
        self._release(job_id, job, addresses)
        return False

    def _release(self, job_id: str, job: tracker_pb2.JobInfo, addresses: list[str]) -> None:
        with self._lock:
            self.pending.pop(job_id, None)
        for address in addresses:
            try:
                self.nodes_calls.hold_at(address, node_pb2.HoldAtRequest(
                    job_id=job_id, epoch=job.epoch, step=0))
            except NodeCallError:
                pass  # a node that does not answer is lost and recovered from

    def on_checkpoint(self, job_id: str, step: int) -> None:
        """A checkpoint of ``step`` is complete: finish the hand-over waiting for this cut,
        else (at a plain checkpoint) consider a migration in the background."""
        with self._lock:
            h = self.pending.get(job_id)
            ready = h is not None and h.cut == step and not h.completing
            if ready:
                assert h is not None
                h.completing = True  # once; it stays pending until the job left RUNNING,
                if h.target is not None:  # or a tick would see the drained node still in use
                    self._targets[job_id] = (h.target, h.bytes_moved)
        if ready:
            assert h is not None
            try:
                self.jobs.begin_recovery(job_id, h.names, h.cause, cause=h.cause)
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

    def target_plan(self, job_id: str, plan: node_pb2.Plan) -> tuple[node_pb2.Plan, int] | None:
        """The plan a migration of ``job_id`` moves to, with its bytes moved, if one waits
        (taken once) and still fits the live nodes."""
        with self._lock:
            found = self._targets.pop(job_id, None)
        if found is None:
            return None
        live = {n.node_id for n in self.usable(self.jobs.live_nodes())}
        return found if PlanView(found[0]).node_ids() <= live else None

    def tick(self) -> None:
        """One scheduler round: give up hand-overs past their deadline (a drain then
        rewinds: its node counts as lost), and start hand-overs of RUNNING jobs that
        still use a draining node (a drain that came while the job was deploying)."""
        now = self.clock()
        with self._lock:
            late = [(j, h) for j, h in self.pending.items() if now > h.deadline]
            draining = set(self.draining)
        for job_id, h in late:
            log.warning("job %s: the %s cut at step %d did not complete within %.0f s", job_id,
                        h.cause, h.cut, HANDOVER_TIMEOUT)
            job = self.store.job(job_id)
            self._release(job_id, job, sorted(PlanView(job.plan).addresses()))
            if h.cause == "drain":
                self.jobs.nodes_lost(draining & PlanView(job.plan).node_ids(),
                                     "did not hand over in time")
        for node_id in draining:
            for job_id in self._jobs_using(node_id):
                if self.store.job(job_id).state == S.JOB_STATE_RUNNING \
                        and job_id not in self.pending:
                    names = {n.name for n in self.jobs.live_nodes() if n.node_id == node_id}
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
        except Exception:  # noqa: BLE001 — a planner bug must not stop the job
            log.exception("job %s: considering a migration failed", job_id)
            return False
        finally:
            with self._lock:
                self._considering.discard(job_id)

    def _consider(self, job_id: str) -> bool:
        try:
            job = self.store.job(job_id)
            request = self.store.spec(job_id)
        except KeyError:
            return False
        spec = JobSpec.from_proto(request.config)
        if spec.rebalance != "auto" or job.state != S.JOB_STATE_RUNNING:
            return False
        used = PlanView(job.plan).node_ids()
        live = self.jobs.live_nodes()  # read once (the registry's, in memory)
        usable = self.usable(live)
        nodes = [n for n in usable if n.node_id in used] + self.candidates(
            [n for n in usable if n.node_id not in used and not self.unmeasured(n.node_id)])
        nodes.sort(key=lambda n: (n.registered, n.node_id))  # the store's order
        profile, config = model_profile(request.profile), train_config(spec)
        with self._lock:
            draining = [n for n in live if n.node_id in self.draining]
        among = nodes + draining
        cluster = cluster_view(among, self.store.links_among(n.node_id for n in among))
        flops = {n.node_id: n.resources.flops for n in live}
        self._remeasure(job, profile, flops)

        def speed(node_id: str) -> float:
            return self.speed.get(node_id, flops.get(node_id, 1.0))

        view = PlanView(job.plan)
        if not self._changed(job, cluster, speed):
            return False

        def need(a: node_pb2.StageAssignment) -> float:
            return planner.stage_memory_bytes(profile, a.layer_start, a.layer_end, config,
                                              a.stage, view.depth(a.replica),
                                              view.microbatches(a.replica))

        def predict(p: node_pb2.Plan) -> float:
            return predict_step_seconds(p, cluster, profile, spec.schedule, speed)

        now_t = predict(job.plan)
        cand = reassign(job.plan, nodes, predict, need)
        split = resplit(job.plan, spec, replace(cluster, nodes=[
            replace(n, flops=speed(n.node_id)) for n in cluster.nodes
            if n.node_id not in self.draining]), profile, nodes)
        if split is not None and predict(split) < predict(cand):
            cand = split
        new_t = predict(cand)
        if cand is job.plan or not math.isfinite(new_t) or now_t <= 0:
            return False
        gain = (now_t - new_t) / now_t
        left = max(0, job.steps - job.step)
        cost, nbytes = move_seconds(job.plan, cand, cluster, profile, config)
        saved = (now_t - new_t) * min(left, self.horizon)
        log.info("job %s: a re-assignment predicts %.4f s/step instead of %.4f (%.0f %%); moving "
                 "%d bytes takes %.3f s, saves %.3f s over %d steps", job_id, new_t, now_t,
                 100 * gain, nbytes, cost, saved, min(left, self.horizon))
        if gain < self.threshold or saved <= cost:
            return False
        held = {k: (a.node_id, a.layer_start, a.layer_end) for k, a in view.stages.items()}
        names = {a.node_name for k, a in PlanView(cand).stages.items()  # whose layers change:
                 if held.get(k) != (a.node_id, a.layer_start, a.layer_end)}  # a swap names both
        if self.handover(job_id, "rebalance", names, cand, nbytes):
            return True
        with self._lock:  # not started: weigh again at the next look
            self._weighed.pop(job_id, None)
        return False

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
                    tuple(sorted(cluster.links.items())), frozenset(self.draining))
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
        for t in self.jobs.stage_times(job.job_id):
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
