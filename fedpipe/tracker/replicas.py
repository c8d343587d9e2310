"""Replica groups as the unit of failure: which groups take part in each step's sync.

With two or more replica groups and ``min_replicas`` > 0, a lost node drops
only its group; the others go on without rewinding, and a rebuilt group joins
again later. What every surviving stage must agree on is the *membership* of
each sync: which groups' gradients a step's all-reduce sums (or whose
pseudo-gradients an outer step averages). Two survivors that summed over
different sets would part ways for good; a survivor that waited for a dead
group would wait for ever.

The tracker decides it, as torchft's lighthouse decides its quorum and its
``Manager.should_commit`` lets every replica commit a step only when all did
(torchft, ``torchft/manager.py``; no code taken). :class:`ReplicaSet` holds,
for one plan epoch of one job:

- the *replica epoch* ``version``: it grows by one at every membership change
  (a group dropped, a group scheduled to join);
- the live groups, each with the step from which it takes part (0, or its join
  step);
- for each step not yet committed, the stages that said they reduced it under
  the current version.

A stage syncs step ``s`` (:meth:`ReplicaSet.ask`): it sums over
``members(s)`` of the version it knows, then reports ``reduced``. Step ``s``
*commits* under version ``v`` when every stage of every member group reported
it under ``v`` while ``v`` was current; from then on every ask of ``s``
answers "committed, with ``v``'s members", so every stage applies the same
sum. A membership change before the commit makes every ask of ``s`` under an
older version answer "retry with the new members": the stages sum again over
the new set (their own gradients are untouched until the commit). So a step
commits under exactly one membership, and a dead group is waited for only
until the tracker drops it.

Loss scaling. A group's stage losses are scaled by its share of the step's
*global* batch (``n_g / B``), so a sum over a subset of the groups would be
too small. The sync therefore also sums the members' sample counts and
multiplies the summed gradient by ``B / Σ_members n_g``: the gradient of the
mean loss over the survivors' samples (:mod:`fedpipe.runtime.elastic`). The
client re-shards each later batch over the live groups, so then
``Σ n_g = B`` and the factor is exactly 1.

This module is pure (no I/O, no torch): ``tests/test_replicas.py`` drives it
with threads and a fake clock.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from .. import planner
from ..net import timeouts
from ..planner import PlanError
from ..planner.protoio import model_profile, train_config
from ..proto import node_pb2, tracker_pb2
from ..spec import TERMINAL, JobSpec, PlanView, Quorum, StageKey
from .errors import PermissionDenied
from .nodes import NodeCallError, NodeCalls
from .replan import substitute
from .store import Store

log = logging.getLogger("fedpipe.tracker")

COMMITTED_KEPT = 256
"""Committed steps whose decision is kept for late askers (older ones are forgotten:
every stage of a step asks within a step or two of the others)."""


class ReplicaError(ValueError):
    """A membership change that cannot be made (the message says why)."""


@dataclass
class _Group:
    stages: frozenset[StageKey]
    since: int = 0               # the first step the group takes part in
    donor: int | None = None     # where a joining group takes its state from


@dataclass
class _Decision:
    version: int
    members: tuple[int, ...]


@dataclass
class ReplicaSet:
    """The membership of one job's replica groups in one plan epoch (module docstring).

    Args:
        groups: each replica group's stages, by group.
        min_replicas: the fewest live groups with which the job goes on (>= 1).

    Raises:
        ReplicaError: fewer groups than ``min_replicas``, or ``min_replicas`` < 1.
    """

    groups: dict[int, frozenset[StageKey]]
    min_replicas: int
    version: int = 0
    _live: dict[int, _Group] = field(default_factory=dict)
    _reduced: dict[int, set[StageKey]] = field(default_factory=dict)
    _committed: dict[int, _Decision] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self):
        if self.min_replicas < 1:
            raise ReplicaError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if len(self.groups) < self.min_replicas:
            raise ReplicaError(f"{len(self.groups)} replica group(s) are fewer than "
                               f"min_replicas {self.min_replicas}")
        self._live = {g: _Group(frozenset(stages)) for g, stages in self.groups.items()}

    # -- questions -----------------------------------------------------------
    @property
    def live(self) -> tuple[int, ...]:
        """The live groups (taking part now or from their join step), in order."""
        with self._cond:
            return tuple(sorted(self._live))

    def members(self, step: int) -> tuple[int, ...]:
        """The groups that take part in ``step`` under the current version."""
        with self._cond:
            return self._members(step)

    def _members(self, step: int) -> tuple[int, ...]:
        return tuple(sorted(g for g, info in self._live.items() if info.since <= step))

    def since(self, group: int) -> int:
        """The first step live group ``group`` takes part in.

        Raises:
            KeyError: the group is not live.
        """
        with self._cond:
            return self._live[group].since

    def enough(self, lost: Iterable[int]) -> bool:
        """Whether the job can go on without rewinding if groups ``lost`` drop out."""
        with self._cond:
            return len(set(self._live) - set(lost)) >= self.min_replicas

    def dropped(self) -> tuple[int, ...]:
        """The groups of the plan that are not live (dropped and not rebuilt yet)."""
        with self._cond:
            return tuple(sorted(set(self.groups) - set(self._live)))

    # -- changes -------------------------------------------------------------
    def drop(self, lost: Iterable[int]) -> int:
        """Drop groups ``lost`` (a node of each is gone); return the new version.

        Steps not yet committed are summed again over the survivors. A group
        that was to join, or to donate to a joining group, is dealt with too:
        a joining group whose donor is lost is dropped with it.

        Raises:
            ReplicaError: fewer than ``min_replicas`` groups would be left (the
                caller rewinds the job instead), or no group given is live.
        """
        with self._cond:
            gone = set(lost) & set(self._live)
            if not gone:
                raise ReplicaError(f"none of the groups {sorted(set(lost))} is live")
            gone |= {g for g, info in self._live.items() if info.donor in gone
                     and info.since > 0 and g not in gone}
            left = set(self._live) - gone
            if len(left) < self.min_replicas:
                raise ReplicaError(f"{len(left)} replica group(s) would be left, fewer than "
                                   f"min_replicas {self.min_replicas}")
            for g in gone:
                del self._live[g]
            return self._bump()

    def join(self, group: int, at_step: int, donor: int, committed_floor: int) -> int:
        """Schedule dropped ``group`` to take part from ``at_step`` on, with the state of
        ``donor`` after step ``at_step - 1``; return the new version.

        Args:
            committed_floor: the step the caller knows every stage has reached;
                ``at_step - 1`` must not be committed yet, so the donor still
                learns (in the commit of that step) that it must keep its state.

        Raises:
            ReplicaError: ``group`` is live or not of the plan, ``donor`` is not a
                member before ``at_step``, or ``at_step - 1`` is already committed.
        """
        with self._cond:
            if group not in self.groups or group in self._live:
                what = "live" if group in self._live else "not of the plan"
                raise ReplicaError(f"replica group {group} is {what}; it cannot join")
            donor_info = self._live.get(donor)
            if donor_info is None or donor_info.since >= at_step:
                raise ReplicaError(f"replica group {donor} cannot give its state at step "
                                   f"{at_step}: it is not a member before then")
            done = max([committed_floor, *self._committed], default=committed_floor)
            if at_step - 1 <= done:
                raise ReplicaError(f"step {at_step - 1} may be committed already (step "
                                   f"{done} is); join at step {done + 2} or later")
            self._live[group] = _Group(self.groups[group], since=at_step, donor=donor)
            return self._bump()

    def _bump(self) -> int:
        self.version += 1
        self._reduced.clear()
        self._cond.notify_all()
        return self.version

    # -- a stage's sync ------------------------------------------------------
    def ask(self, key: StageKey, step: int, version: int, reduced: bool,
            wait: float = 0.0) -> Quorum:
        """Stage ``key`` about its sync of ``step`` under ``version``.

        Args:
            reduced: the stage summed ``step`` over ``version``'s members and
                waits for the commit.
            wait: with ``reduced``, block up to this many seconds for the
                step to commit or the membership to change.

        Returns:
            The :class:`Quorum`: committed (apply), retry with other members,
            or dropped (stop).
        """
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                answer = self._answer(key, step, version, reduced)
                left = deadline - time.monotonic()
                if answer.committed or answer.dropped or answer.version != version \
                        or not reduced or left <= 0:
                    return answer
                self._cond.wait(left)
                reduced = False  # counted once; later rounds only look

    def _answer(self, key: StageKey, step: int, version: int, reduced: bool) -> Quorum:
        done = self._committed.get(step)
        if done is not None and key.replica in done.members:
            return Quorum(step, done.version, done.members, committed=True,
                          donate_to=self._donees(key, step))
        if done is not None or key.replica not in self._live \
                or self._live[key.replica].since > step:
            return Quorum(step, self.version, self._members(step), dropped=True)
        members = self._members(step)
        if version == self.version and reduced:
            acks = self._reduced.setdefault(step, set())
            acks.add(key)
            if all(self._live[g].stages <= acks for g in members):
                self._committed[step] = _Decision(self.version, members)
                del self._reduced[step]
                for old in sorted(self._committed)[:-COMMITTED_KEPT]:
                    del self._committed[old]
                self._cond.notify_all()
                return Quorum(step, self.version, members, committed=True,
                              donate_to=self._donees(key, step))
        return Quorum(step, self.version, members)

    def _donees(self, key: StageKey, step: int) -> tuple[int, ...]:
        return tuple(sorted(g for g, info in self._live.items()
                            if info.donor == key.replica and info.since == step + 1))

    def committed(self, step: int) -> bool:
        """Whether ``step`` is committed (and still remembered)."""
        with self._cond:
            return step in self._committed

    def last_committed(self) -> int:
        """The newest committed step, or -1."""
        with self._cond:
            return max(self._committed, default=-1)


# ---------------------------------------------------------------------------
# The tracker's side: one ReplicaSet per elastic job and plan epoch


class JobsLike(Protocol):
    """What :class:`ElasticReplicas` uses of :class:`~fedpipe.tracker.jobs.Jobs`."""

    store: Store
    nodes: NodeCalls

    def get(self, job_id: str) -> tracker_pb2.JobInfo: ...

    def notify(self) -> None: ...

    def clock(self) -> float: ...

    def assign(self, job_id: str, plan: node_pb2.Plan, holders: set[str]) -> None: ...


@dataclass
class _Ready:
    """A dropped group rebuilt on live nodes, waiting for the client to pick its join step."""

    plan: node_pb2.Plan          # the job's plan with the group's stages on live nodes
    donor: int


class ElasticReplicas:
    """Elastic replica groups of every job (module docstring): drops, quorums, heals.

    In the tracker's memory: a restarted tracker starts each job's membership
    afresh from its plan (every group live), as the stages' next asks learn.

    Args:
        jobs: the job life cycle (its store, node calls, ``get`` and ``notify``).
    """

    def __init__(self, jobs: JobsLike):
        self.jobs = jobs
        self._sets: dict[str, tuple[int, ReplicaSet]] = {}  # job -> (epoch, its set)
        self._ready: dict[str, dict[int, _Ready]] = {}
        self._full: dict[str, int] = {}  # job -> its last checkpoint every group took part in
        self._min: dict[str, int] = {}  # job -> its min_replicas (read once from its spec)
        self._lock = threading.RLock()

    def _set(self, job: tracker_pb2.JobInfo) -> ReplicaSet | None:
        """The job's ReplicaSet for its epoch; None for a job that is not elastic."""
        if job.state in TERMINAL or len(job.plan.replicas) < 2:
            return None
        least = self._min.get(job.job_id)
        if least is None:
            least = self._min[job.job_id] = \
                JobSpec.from_proto(self.jobs.store.spec(job.job_id).config).min_replicas
        view = PlanView(job.plan)
        if not least or len(view.replicas) < 2:
            return None
        with self._lock:
            epoch, rs = self._sets.get(job.job_id, (-1, None))
            if rs is None or epoch != job.epoch:
                groups = {r: frozenset(StageKey(a.replica, a.stage) for a in view.chain(r))
                          for r in view.replicas}
                rs = ReplicaSet(groups, min(least, len(groups)))
                self._sets[job.job_id] = (job.epoch, rs)
                self._ready.pop(job.job_id, None)
            return rs

    # -- hooks of Jobs ---------------------------------------------------------
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
        self.jobs.store.set_recovery(job_id, job, self.jobs.clock(), event=tracker_pb2.JobEvent(
            state=job.state, reason=reason, epoch=job.epoch))
        for key in view.stages:
            if key.replica in live:  # nothing more is expected of them
                self.jobs.store.stage_done(job_id, key.replica, key.stage)
        threading.Thread(target=self._stop_groups, args=(job, live, reason),
                         name=f"drop-{job_id}", daemon=True).start()
        self.jobs.notify()
        return True

    def _stop_groups(self, job: tracker_pb2.JobInfo, groups: set[int], reason: str) -> None:
        view = PlanView(job.plan)
        for address in sorted({a.address for k, a in view.stages.items() if k.replica in groups}):
            try:
                self.jobs.nodes.stop_job(address, node_pb2.StopJobRequest(
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
        q = rs.ask(key, request.step, request.version, request.reduced, wait)
        reply = tracker_pb2.ReplicaQuorumReply(
            step=q.step, version=q.version, members=q.members, committed=q.committed,
            dropped=q.dropped, donate_to=q.donate_to)
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
        request = self.jobs.store.spec(job_id)
        spec = JobSpec.from_proto(request.config)
        profile, config = model_profile(request.profile), train_config(spec)

        def need(a: node_pb2.StageAssignment) -> float:
            return planner.stage_memory_bytes(profile, a.layer_start, a.layer_end, config,
                                              a.stage, view.depth(a.replica),
                                              view.microbatches(a.replica))

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
            every = JobSpec.from_proto(self.jobs.store.spec(job_id).config).sync_every
            step = -(-step // every) * every  # DiLoCo: at the next outer step's inner steps
            if step >= job.steps:
                return tracker_pb2.JoinReplicaReply(reason="past the job's last step", job=job)
            try:
                rs.join(replica, step, ready.donor, job.step - 1)
            except ReplicaError as e:
                return tracker_pb2.JoinReplicaReply(reason=str(e), job=job)
            del self._ready[job_id][replica]
            self.jobs.store.set_plan(job_id, ready.plan)
        reason = (f"replica group {replica} joins at step {step} with group {ready.donor}'s "
                  f"state (replica epoch {rs.version})")
        log.info("job %s: %s", job_id, reason)
        job = self.jobs.get(job_id)
        self.jobs.store.set_recovery(job_id, job, self.jobs.clock(), event=tracker_pb2.JobEvent(
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
        signed = self.jobs.store.spec(job.job_id)  # its config as the stages run it
        donors = {view[StageKey(donor, a.stage)].address for a in view.chain(replica)}
        self.jobs.assign(job.job_id, job.plan, donors)  # so they serve the joining nodes
        failed = []
        for a in view.chain(replica):
            source = view[StageKey(donor, a.stage)].address
            try:
                self.jobs.nodes.load_stage(a.address, node_pb2.LoadStageRequest(
                    job_id=job.job_id, replica=replica, stage=a.stage, plan=job.plan,
                    config=signed.config,
                    layers=self.jobs.store.layers(job.job_id, a.layer_start, a.layer_end),
                    resume_step=step, snapshot_sources=[source],
                    snapshot_wait_seconds=timeouts.HEAL_SNAPSHOT_WAIT,
                    owner=signed.owner, job_signature=signed.job_signature,
                    client_cert=signed.client_cert, layer_digests=signed.layer_digests))
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

