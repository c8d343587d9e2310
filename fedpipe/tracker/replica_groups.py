"""Elastic replica groups of each job: drops, per-step quorums, heals.

With two or more replica groups and ``min_replicas`` > 0, a lost node drops only
its group (:meth:`ElasticReplicas.drop`); the others go on without rewinding. The
membership of each step's sync is a :class:`~.replicas.ReplicaSet` per job and
plan epoch, which the stages ask over ``ReplicaQuorum``
(:meth:`ElasticReplicas.ask`); the reports of a step and the acknowledgements of a
checkpoint count only the groups that take part (:meth:`ElasticReplicas.groups`,
:meth:`ElasticReplicas.stages`). A dropped group is rebuilt on spare nodes
(:meth:`ElasticReplicas.heal`) and joins again at a step the client picks
(:meth:`ElasticReplicas.join`).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ..planner.protoio import assignment_memory_bytes
from ..net import timeouts
from ..planner import PlanError
from ..proto import node_pb2, tracker_pb2
from ..spec import TERMINAL, PlanView, StageKey
from .errors import PermissionDenied
from .jobs import Jobs
from .nodes import NodeCallError, NodeCalls
from .replan import substitute
from .replicas import ReplicaError, ReplicaSet
from .specs import JobSpecs
from .store import Store

log = logging.getLogger("fedpipe.tracker")


class Assigns(Protocol):
    """Tells a job's state holders a plan's nodes (:meth:`~.deploy.Deployer.assign`)."""

    def assign(self, job_id: str, plan: node_pb2.Plan, holders: set[str]) -> None: ...


@dataclass
class _Ready:
    """A dropped group rebuilt on live nodes, waiting for the client to pick its join step."""

    plan: node_pb2.Plan          # the job's plan with the group's stages on live nodes
    donor: int


class ElasticReplicas:
    """Elastic replica groups of every job (module docstring): drops, quorums, heals.

    Each job's membership and committed steps are stored at every change
    (:meth:`~.store.base.Store.set_replicas`, before a stage hears of it), so a tracker
    that restarts or takes over answers as the one before did. Rebuilt groups waiting
    for the client's join step (``replica_ready``) are not kept: they are rebuilt again.

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (LoadStage, StopJob).
        jobs: the life cycle (``get`` and ``notify``).
        specs: each job's decoded spec.
        assigner: tells state holders a plan's nodes.
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, jobs: Jobs, specs: JobSpecs,
                 assigner: Assigns, clock: Callable[[], float] = time.time):
        self.store, self.nodes, self.jobs, self.specs = store, nodes, jobs, specs
        self.assigner, self.clock = assigner, clock
        self._sets: dict[str, tuple[int, ReplicaSet]] = {}  # job -> (epoch, its set)
        self._ready: dict[str, dict[int, _Ready]] = {}
        self._full: dict[str, int] = {}  # job -> its last checkpoint every group took part in
        self._lock = threading.RLock()

    def _set(self, job: tracker_pb2.JobInfo) -> ReplicaSet | None:
        """The job's ReplicaSet for its epoch; None for a job that is not elastic."""
        if job.state in TERMINAL or len(job.plan.replicas) < 2:
            return None
        least = self.specs.job(job.job_id).min_replicas
        view = PlanView(job.plan)
        if not least or len(view.replicas) < 2:
            return None
        with self._lock:
            epoch, rs = self._sets.get(job.job_id, (-1, None))
            if rs is None or epoch != job.epoch:
                groups = {r: frozenset(StageKey(a.replica, a.stage) for a in view.chain(r))
                          for r in view.replicas}
                rs = self._restored(job, groups, min(least, len(groups)))
                self._sets[job.job_id] = (job.epoch, rs)
                self._ready.pop(job.job_id, None)
            return rs

    def _restored(self, job: tracker_pb2.JobInfo, groups: dict[int, frozenset[StageKey]],
                  least: int) -> ReplicaSet:
        """The job's set for its epoch as last stored, else a fresh one (every group live)."""
        save = functools.partial(self._save, job.job_id, job.epoch)
        stored = self.store.replicas(job.job_id)
        if stored is not None and stored[0] == job.epoch:
            try:
                return ReplicaSet.restore(groups, least, json.loads(stored[1]), save)
            except (ReplicaError, ValueError, KeyError, TypeError) as e:
                log.warning("job %s: the stored replica membership is unusable (%s); starting "
                            "afresh from the plan", job.job_id, e)
        return ReplicaSet(groups, least, save)

    def _save(self, job_id: str, epoch: int, snapshot: dict) -> None:
        self.store.set_replicas(job_id, epoch, json.dumps(snapshot).encode())

    # -- hooks of recovery and progress ---------------------------------------------------------
    def drop(self, job_id: str, lost_nodes: set[str], why: str) -> bool:
        """Nodes ``lost_nodes`` of a running elastic job are gone: drop their groups and
        stop the groups' other stages; True if the job goes on without rewinding.

        False (the caller rewinds, :meth:`rewind_to`): the job is not elastic, not
        RUNNING, or fewer than ``min_replicas`` groups would be left.
        """
        job = self.jobs.get(job_id)
        if job.state != tracker_pb2.JOB_STATE_RUNNING:
            return False
        rs = self._set(job)
        if rs is None:
            return False
        view = PlanView(job.plan)
        hit = {a.replica for a in view.stages.values() if a.node_id in lost_nodes}
        with self._lock:
            ready = self._ready.get(job_id, {})
            for g in [g for g, r in ready.items() if r.donor in hit
                      or PlanView(r.plan).node_ids() & lost_nodes]:
                del ready[g]  # its rebuild lost a node or its donor: rebuild it later
        live = hit & set(rs.live)
        if not live:
            return True  # only dropped (or not yet joined) groups used those nodes
        try:
            version = rs.drop(live)
        except ReplicaError as e:
            log.warning("job %s: %s; rewinding", job_id, e)
            return False
        reason = (f"replica group(s) {', '.join(map(str, sorted(live)))} dropped ({why}); "
                  f"groups {', '.join(map(str, rs.live))} go on (replica epoch {version})")
        log.info("job %s: %s", job_id, reason)
        self.store.set_recovery(job_id, job, self.clock(), event=tracker_pb2.JobEvent(
            state=job.state, reason=reason, epoch=job.epoch))
        for key in view.stages:
            if key.replica in live:  # nothing more is expected of them
                self.store.stage_done(job_id, key.replica, key.stage)
        threading.Thread(target=self._stop_groups, args=(job, live, reason),
                         name=f"drop-{job_id}", daemon=True).start()
        self.jobs.notify()
        return True

    def _stop_groups(self, job: tracker_pb2.JobInfo, groups: set[int], reason: str) -> None:
        view = PlanView(job.plan)
        for address in sorted({a.address for k, a in view.stages.items() if k.replica in groups}):
            try:
                self.nodes.stop_job(address, node_pb2.StopJobRequest(
                    job_id=job.job_id, reason=reason, replicas=sorted(groups)))
            except NodeCallError as e:
                log.info("could not stop job %s's dropped groups on %s: %s", job.job_id,
                         address, e)

    def out(self, job: tracker_pb2.JobInfo, replica: int) -> bool:
        """Whether group ``replica`` of the job was dropped (its stages' reports are moot)."""
        rs = self._set(job)
        return rs is not None and replica not in rs.live

    def groups(self, job: tracker_pb2.JobInfo, step: int) -> int:
        """How many groups report step ``step`` (1-based, as reports count)."""
        rs = self._set(job)
        return len(rs.members(step - 1)) if rs is not None else max(1, len(job.plan.replicas))

    def stages(self, job: tracker_pb2.JobInfo, step: int) -> int:
        """How many stages acknowledge a checkpoint after ``step`` steps."""
        view = PlanView(job.plan)
        rs = self._set(job)
        if rs is None:
            return len(view.stages)
        return sum(view.depth(g) for g in rs.members(step - 1))

    def checkpointed(self, job: tracker_pb2.JobInfo, step: int) -> None:
        """A checkpoint of ``step`` completed: remember it if every group took part."""
        rs = self._set(job)
        if rs is not None and len(rs.members(step - 1)) == len(rs.groups):
            with self._lock:
                self._full[job.job_id] = step

    def rewind_to(self, job: tracker_pb2.JobInfo) -> int | None:
        """The step a rewind of an elastic job goes back to: its last checkpoint that every
        group took part in (the others lack the dropped groups' snapshots); None: the
        job's last complete checkpoint will do."""
        rs = self._set(job)
        if rs is None or not rs.dropped():
            return None
        with self._lock:
            return min(job.checkpoint_step, self._full.get(job.job_id, 0))

    def annotate(self, job: tracker_pb2.JobInfo) -> tracker_pb2.JobInfo:
        """The job with its replica fields (version, members, groups ready to join)."""
        rs = self._set(job)
        if rs is None:
            return job
        job.replica_version = rs.version
        for g in rs.live:
            job.replica_members.add(replica=g, since=rs.since(g))
        with self._lock:
            job.replica_ready.extend(sorted(self._ready.get(job.job_id, {})))
        return job

    # -- a stage's quorum ----------------------------------------------------
    def ask(self, request: tracker_pb2.ReplicaQuorumRequest) -> tracker_pb2.ReplicaQuorumReply:
        """A stage's :meth:`ReplicaSet.ask` over the wire; a stage of another epoch, or of a
        job that is not elastic or has ended, is told it is dropped (it stops).

        Raises:
            NotFound: no such job.
            PermissionDenied: the node does not run that stage.
        """
        job = self.jobs.get(request.job_id)
        key = StageKey(request.replica, request.stage)
        mine = PlanView(job.plan).get(key)
        if mine is None or mine.node_id != request.node_id:
            raise PermissionDenied(f"node {request.node_id!r} does not run stage {key.stage} "
                                   f"(replica {key.replica}) of job {job.job_id}")
        rs = self._set(job) if request.epoch == job.epoch else None
        if rs is None:
            return tracker_pb2.ReplicaQuorumReply(step=request.step, dropped=True)
        wait = min(max(0.0, request.wait_seconds), timeouts.QUORUM_COMMIT_WAIT)
        q = rs.ask(key, request.step, request.version, request.reduced, wait,
                   request.next_step)
        reply = tracker_pb2.ReplicaQuorumReply(
            step=q.step, version=q.version, members=q.members, committed=q.committed,
            dropped=q.dropped, donate_to=q.donate_to, next_members=q.next_members)
        if q.version != request.version:  # the live groups' stages: peers and buddies
            plan = self.jobs.get(request.job_id).plan
            reply.plan.CopyFrom(plan)
            del reply.plan.stages[:]
            reply.plan.stages.extend(a for a in plan.stages if a.replica in rs.live)
        return reply

    # -- healing -------------------------------------------------------------
    def heal_all(self, nodes: Callable[[], list[tracker_pb2.NodeInfo]]) -> None:
        """:meth:`heal` every elastic job that runs without some of its groups (the
        scheduler calls it every round). ``nodes`` reads the live nodes, O(n): it is called
        only when a job has a group to rebuild, so a round with none stays O(jobs)."""
        with self._lock:
            jobs = [j for j, (_, rs) in self._sets.items() if rs.dropped()]
        if jobs:
            live = nodes()
            for job_id in jobs:
                self.heal(job_id, live)

    def heal(self, job_id: str, nodes: list[tracker_pb2.NodeInfo]) -> None:
        """Rebuild the job's dropped groups on spare live nodes (nodes no live group uses):
        each group keeps its layer ranges and gets a donor, a live group with the same
        ranges; then the client is told (``replica_ready``) and picks the join step."""
        job = self.jobs.get(job_id)
        if job.state != tracker_pb2.JOB_STATE_RUNNING:
            return
        rs = self._set(job)
        if rs is None or not rs.dropped():
            return
        view = PlanView(job.plan)
        spec = self.specs.get(job_id)
        profile, config = spec.profile, spec.config

        def need(a: node_pb2.StageAssignment) -> float:
            return assignment_memory_bytes(job.plan, a, profile, config)

        def ranges(g: int) -> list[tuple[int, int]]:
            return [(a.layer_start, a.layer_end) for a in view.chain(g)]

        with self._lock:
            ready = self._ready.setdefault(job_id, {})
            for g in rs.dropped():
                if g in ready:
                    continue
                donor = next((d for d in rs.members(job.step + 1) if ranges(d) == ranges(g)),
                             None)
                if donor is None:
                    continue  # no live group holds the same layers: it stays out
                busy = {a.node_id for k, a in view.stages.items() if k.replica in rs.live}
                spare = [n for n in nodes if n.node_id not in busy]
                gone = {a.node_id for a in view.chain(g)} - {n.node_id for n in spare}
                try:
                    plan = substitute(_only(job.plan, g), gone, spare, need)
                except PlanError:
                    continue  # not enough spare nodes yet
                ready[g] = _Ready(_merge(job.plan, plan, g), donor)
                log.info("job %s: replica group %d rebuilt on %s; it joins when the client "
                         "feeds it", job_id, g, plan.summary)
        self.jobs.notify()

    def join(self, job_id: str, replica: int, step: int) -> tracker_pb2.JoinReplicaReply:
        """The client feeds rebuilt group ``replica`` from ``step`` on: schedule the join
        (:meth:`ReplicaSet.join`), store the plan with the group's new nodes, and load
        its stages to restore the donor's state after ``step - 1``.

        Raises:
            NotFound: no such job.
        """
        job = self.jobs.get(job_id)
        rs = self._set(job)
        with self._lock:
            ready = self._ready.get(job_id, {}).get(replica)
            if rs is None or ready is None:
                return tracker_pb2.JoinReplicaReply(
                    reason=f"replica group {replica} is not ready to join", job=job)
            every = self.specs.job(job_id).sync_every
            step = -(-step // every) * every  # DiLoCo: at the next outer step's inner steps
            if step >= job.steps:
                return tracker_pb2.JoinReplicaReply(reason="past the job's last step", job=job)
            try:
                rs.join(replica, step, ready.donor, job.step - 1)
            except ReplicaError as e:
                return tracker_pb2.JoinReplicaReply(reason=str(e), job=job)
            del self._ready[job_id][replica]
            self.store.set_plan(job_id, ready.plan)
        reason = (f"replica group {replica} joins at step {step} with group {ready.donor}'s "
                  f"state (replica epoch {rs.version})")
        log.info("job %s: %s", job_id, reason)
        job = self.jobs.get(job_id)
        self.store.set_recovery(job_id, job, self.clock(), event=tracker_pb2.JobEvent(
            state=job.state, reason=reason, epoch=job.epoch))
        # loaded before the reply: the client feeds the group as soon as it has it
        failed = self._load_group(job, replica, step, ready.donor)
        self.jobs.notify()
        if failed:
            return tracker_pb2.JoinReplicaReply(reason=failed,
                                                job=self.annotate(self.jobs.get(job_id)))
        return tracker_pb2.JoinReplicaReply(accepted=True, reason=reason,
                                            job=self.annotate(self.jobs.get(job_id)))

    def _load_group(self, job: tracker_pb2.JobInfo, replica: int, step: int, donor: int
                    ) -> str:
        """Load the joining group's stages; each restores its donor stage's state after
        ``step - 1`` (kept by the donor under the joiner's key) on its own thread. Returns
        why a stage could not be loaded ("": all were); then the group is dropped again."""
        view = PlanView(job.plan)
        signed = self.specs.request(job.job_id)  # its config as the stages run it
        spec = self.specs.get(job.job_id)
        donors = {view[StageKey(donor, a.stage)].address for a in view.chain(replica)}
        self.assigner.assign(job.job_id, job.plan, donors)  # so they serve the joining nodes
        failed = []
        for a in view.chain(replica):
            source = view[StageKey(donor, a.stage)].address
            try:
                self.nodes.load_stage(a.address, node_pb2.LoadStageRequest(
                    job_id=job.job_id, replica=replica, stage=a.stage, plan=job.plan,
                    config=signed.config,
                    layers=self.store.layers(job.job_id, a.layer_start, a.layer_end),
                    resume_step=step, snapshot_sources=[source],
                    snapshot_wait_seconds=timeouts.HEAL_SNAPSHOT_WAIT,
                    owner=signed.owner, job_signature=signed.job_signature,
                    client_cert=signed.client_cert, layer_digests=signed.layer_digests,
                    predicted_memory_bytes=int(assignment_memory_bytes(
                        job.plan, a, spec.profile, spec.config))))
            except NodeCallError as e:
                failed.append(f"stage {a.stage} on {a.node_name}: {e}")
        if not failed:
            return ""
        why = f"replica group {replica} could not be loaded ({'; '.join(failed)})"
        log.warning("job %s: %s; dropping it again", job.job_id, why)
        self.drop(job.job_id, {a.node_id for a in view.chain(replica)},
                  "its rebuild failed to load")
        return why


def _only(plan: node_pb2.Plan, replica: int) -> node_pb2.Plan:
    """A copy of ``plan`` with the stages of group ``replica`` only."""
    out = node_pb2.Plan()
    out.CopyFrom(plan)
    del out.stages[:]
    out.stages.extend(a for a in plan.stages if a.replica == replica)
    return out


def _merge(plan: node_pb2.Plan, group: node_pb2.Plan, replica: int) -> node_pb2.Plan:
    """``plan`` with group ``replica``'s stages as ``group`` has them."""
    out = node_pb2.Plan()
    out.CopyFrom(plan)
    del out.stages[:]
    out.stages.extend([a for a in plan.stages if a.replica != replica] + list(group.stages))
    return out

