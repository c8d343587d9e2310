"""Recovery: a job moves to a new plan epoch and rewinds to a checkpoint.

A lost node (lease expired, left, or confirmed gone by a Ping after a peer
reported it) moves each active job using it to RECOVERING
(:meth:`Recovery.nodes_lost`): a new plan *epoch* begins (every message and
report carries its epoch; the nodes drop older ones), and the job rewinds to its
last complete checkpoint ``K`` (the step every stage has acknowledged a snapshot
of, kept on its node and a buddy). The scheduler then calls
:meth:`Recovery.resume`: the lost nodes' stages move to live nodes
(:func:`~.replan.substitute`: survivors keep theirs), the nodes that may hold the
snapshots learn the new plan's nodes (:meth:`~.deploy.Deployer.assign`: under TLS
they serve state only to nodes assigned to the job), every stage is loaded for
the new epoch at step ``K`` and restores its snapshot (its own or its buddy's),
and the job is RUNNING again. The client rewinds its feed to ``K``. A loss during
recovery starts it again; a job that no longer fits fails with the figures.

The same path serves the other causes of a new epoch: a hand-over at a step
boundary (:mod:`.rebalance`: a drain or a rebalance, nothing recomputed), the
client's absence (:meth:`Recovery.park`: WAITING) and its return or a restored
checkpoint (:meth:`Recovery.rewind_for_client`).

Elastic replica groups. A job with ``min_replicas`` > 0 and several replica
groups does not rewind for a lost node while enough groups are left: the node's
group is dropped and the others go on (:mod:`.replica_groups`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .. import planner
from ..planner.protoio import assignment_memory_bytes
from ..net import timeouts
from ..recovery_text import recovery_headline
from ..proto import node_pb2, tracker_pb2
from ..spec import JobSpec, PlanView, StageKey
from .deploy import Deployer
from .errors import InvalidArgument
from .jobs import Jobs, may_move
from .nodes import NodeCallError, NodeCalls
from .replan import moves, substitute
from .specs import JobSpecs
from .store import Store
from .tallies import Tallies

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

CLIENT_CAUSE = "the client's absence"
"""What a job parked or taken over for its client recovers from (its recovery record)."""
RESTORE_CAUSE = "a checkpoint the client restored"
"""What a job started from a saved checkpoint (``submit(resume_from=...)``) recovers from."""
HANDOVERS = ("drain", "rebalance")
"""Recovery causes that are hand-overs at a step boundary (:mod:`.rebalance`): nothing is lost."""


@dataclass
class Record:
    """A recovery in progress (in memory: a restarted tracker starts a fresh record)."""

    reported: float          # when the loss was first suspected (a failure report or expiry)
    declared: float          # when the node was declared lost
    lost: set[str]           # names of the lost nodes
    from_step: int           # the job's step at the loss
    old_plan: node_pb2.Plan  # the plan the snapshots were taken under
    cause: str = "loss"      # "loss", one of HANDOVERS, CLIENT_CAUSE or RESTORE_CAUSE


class Records:
    """The recoveries in progress and the suspected nodes; forgotten when a job ends.

    ``lock`` also serialises a recovery's beginning against its end (:class:`Recovery`).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.recovering: dict[str, Record] = {}
        self.suspected: dict[str, float] = {}  # address -> when a peer first reported it

    def forget(self, job_id: str) -> None:
        """The job ended: its recovery (if any) is over."""
        with self.lock:
            self.recovering.pop(job_id, None)


class Membership(Protocol):
    """The live nodes and how one is declared lost (the registry)."""

    def nodes(self) -> list[tracker_pb2.NodeInfo]: ...

    def declare_lost(self, node_id: str, why: str) -> bool: ...


class Drains(Protocol):
    """Which nodes take new work, and the plan a migration moves to (:mod:`.rebalance`)."""

    def usable(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]: ...

    def target_plan(self, job_id: str, plan: node_pb2.Plan
                    ) -> tuple[node_pb2.Plan, int] | None: ...


class Groups(Protocol):
    """Elastic replica groups (:mod:`.replica_groups`): a loss that drops a group only."""

    def drop(self, job_id: str, lost_nodes: set[str], why: str) -> bool: ...

    def rewind_to(self, job: tracker_pb2.JobInfo) -> int | None: ...


def snapshot_pieces(old: node_pb2.Plan, new: node_pb2.Plan,
                    sources: Callable[[StageKey], list[str]]
                    ) -> Callable[[StageKey], list[node_pb2.SnapshotPiece]]:
    """For each stage of ``new`` whose layers differ from the same stage's in ``old``
    (the plan its snapshots were taken under), the pieces of the old stages of its
    replica group that held its layers, each with the places ``sources`` gives for
    that old stage's snapshot; ``[]`` where the stage keeps its layers (it restores
    its own snapshot whole)."""
    old_view, new_view = PlanView(old), PlanView(new)

    def pieces(key: StageKey) -> list[node_pb2.SnapshotPiece]:
        a, prev = new_view[key], old_view.get(key)
        if prev is not None and (prev.layer_start, prev.layer_end) == (a.layer_start,
                                                                      a.layer_end):
            return []
        chain = old_view.chain(key.replica) if key.replica in old_view.replicas else []
        return [node_pb2.SnapshotPiece(
            replica=o.replica, stage=o.stage, layer_start=max(o.layer_start, a.layer_start),
            layer_end=min(o.layer_end, a.layer_end), sources=sources(StageKey(o.replica,
                                                                              o.stage)))
            for o in chain if max(o.layer_start, a.layer_start) < min(o.layer_end, a.layer_end)]

    return pieces


def snapshot_sources(old: node_pb2.Plan, new: node_pb2.Plan, step: int, spec: JobSpec,
                     live: set[str] | None = None) -> Callable[[StageKey], list[str]]:
    """Where each stage's snapshot of ``step`` may be, best first: its node in the
    plan it was taken under, the buddy it went to, then every other node of either
    plan (buddies rotate, and a node may hold an older copy). With ``live`` (the
    addresses of the nodes alive now), the places of nodes not among them come last, in
    the same order: a restorer that tried a lost node first would wait out its data
    link's redial (``Timeouts.resume``, 10 s) before the buddy's copy."""
    old_view, new_view = PlanView(old), PlanView(new)
    every = sorted(old_view.addresses() | new_view.addresses())
    every_ck = max(1, spec.checkpoint_every)

    def sources(key: StageKey) -> list[str]:
        first = []
        if old_view.get(key) is not None:
            first.append(old_view[key].address)
            buddy = old_view.buddy(key, step // every_ck)
            if buddy is not None:
                first.append(buddy.address)
        places = list(dict.fromkeys(first + every))
        if live is None:
            return places
        return [a for a in places if a in live] + [a for a in places if a not in live]

    return sources


def _reason(cause: str, lost: set[str], why: str, step: int) -> str:
    names = ', '.join(sorted(lost))
    if cause in HANDOVERS:
        return f"{cause} of {names}: handing over at step {step}"
    who = f"node(s) {names} " if lost and cause == "loss" else ""
    return f"{who}{why}; rewinding to checkpoint step {step}"


class Recovery:
    """Begins and finishes recoveries (see the module docstring).

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (Ping a suspected node).
        jobs: the life cycle (moves the job).
        deployer: loads the new epoch's stages.
        specs: each job's decoded spec.
        tallies: each job's counts and complete checkpoints.
        records: the recoveries in progress.
        membership: the live nodes; declares a node lost.
        drains: draining nodes and migration targets.
        groups: elastic replica groups.
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, jobs: Jobs, deployer: Deployer,
                 specs: JobSpecs, tallies: Tallies, records: Records, membership: Membership,
                 drains: Drains, groups: Groups, clock: Callable[[], float] = time.time):
        self.store, self.nodes, self.jobs, self.deployer = store, nodes, jobs, deployer
        self.specs, self.tallies, self.records = specs, tallies, records
        self.membership, self.drains, self.groups, self.clock = membership, drains, groups, clock

    # -- beginning ---------------------------------------------------------------
    def nodes_lost(self, lost: set[str], why: str) -> None:
        """Each active job with a stage on any of the ``lost`` nodes starts recovering
        (a job still PLANNING is planned again by the scheduler once it fails to load).

        ``why`` completes "node(s) NAMES ...", e.g. "left the swarm".
        """
        if not lost:
            return
        names = {n.node_id: n.name for n in self.store.nodes(include_lost=True)}
        for job_id in self.store.jobs_in(S.JOB_STATE_DEPLOYING, S.JOB_STATE_RUNNING,
                                         S.JOB_STATE_RECOVERING):
            used = PlanView(self.store.job(job_id).plan).node_ids() & lost
            if used and not self.groups.drop(job_id, used, why):
                self.begin(job_id, {names.get(n, n) for n in used}, why,
                           rewind_to=self.groups.rewind_to(self.store.job(job_id)))
        self.jobs.notify()

    def begin_handover(self, job_id: str, names: set[str], cause: str) -> None:
        """Start a new plan epoch at the job's last complete checkpoint for a hand-over
        (``cause`` "drain" or "rebalance": the checkpoint is the cut the stages hold at,
        so nothing is recomputed); :meth:`resume` then moves the stages."""
        self.begin(job_id, names, cause, cause=cause)

    def old_nodes(self, job_id: str) -> set[str]:
        """Ids of the nodes of the plan a recovering job's snapshots were taken under."""
        with self.records.lock:
            rec = self.records.recovering.get(job_id)
        return PlanView(rec.old_plan).node_ids() if rec is not None else set()

    def begin(self, job_id: str, lost: set[str], why: str, rewind_to: int | None = None, *,
              state: int = S.JOB_STATE_RECOVERING, cause: str = "loss", restored: bool = False,
              only_from: set[int] | None = None) -> None:
        """Move the job to RECOVERING (or ``state``) in a new epoch, rewound to its last
        complete checkpoint (or ``rewind_to``); stop its stages of the old epoch.

        Args:
            cause: what the recovery record says the job recovers from: "loss" (of the
                ``lost`` nodes), a hand-over (:data:`HANDOVERS`: nothing is recomputed),
                :data:`CLIENT_CAUSE` or :data:`RESTORE_CAUSE`.
            restored: ``rewind_to`` is a checkpoint the client put on the nodes
                (:meth:`rewind_for_client`): it becomes the last complete one.
            only_from: begin only if the job is in one of these states.
        """
        with self.records.lock:
            job = self.store.job(job_id)
            if not may_move(job.state, state) or (only_from is not None
                                                  and job.state not in only_from):
                return
            rec = self.records.recovering.get(job_id)
            if rec is not None and lost and lost <= rec.lost and rewind_to is None \
                    and job.state == S.JOB_STATE_RECOVERING:
                return  # this loss already started this recovery
            self._record(job, rec, cause).lost |= lost
            step = job.checkpoint_step if rewind_to is None else rewind_to
            fields = tracker_pb2.JobInfo()
            fields.CopyFrom(job)
            fields.epoch, fields.resume_step = job.epoch + 1, step
            if restored:
                fields.checkpoint_step = step
                self.tallies.new_epoch(job_id, restored=step)
            elif rewind_to is not None:  # the checkpoints from rewind_to on are gone
                fields.checkpoint_step = min(job.checkpoint_step, rewind_to)
                self.tallies.new_epoch(job_id, rewound=rewind_to)
            else:
                self.tallies.new_epoch(job_id)
            self.store.set_recovery(job_id, fields, self.clock())
            reason = _reason(cause, lost, why, step)
            self.jobs.move(job_id, state, reason)
        # stop the old epoch's stages now so they free their threads; a LoadStage of the
        # new epoch would replace them anyway
        threading.Thread(target=self.jobs.stop_stages, args=(job_id, reason, False, job.plan,
                                                             job.epoch + 1),
                         name=f"stop-{job_id}", daemon=True).start()

    def _record(self, job: tracker_pb2.JobInfo, rec: Record | None, cause: str) -> Record:
        """The job's recovery record: a new one (from when a peer first suspected one of
        its nodes), or ``rec`` with its cause updated (a loss during a hand-over makes it
        a recovery). Under ``records.lock``."""
        if rec is None:
            now = self.clock()
            addresses = {a.address for a in job.plan.stages}
            reported = min([t for a, t in self.records.suspected.items() if a in addresses],
                           default=now)
            rec = self.records.recovering[job.job_id] = Record(reported, now, set(), job.step,
                                                               job.plan, cause)
        elif cause not in HANDOVERS:
            rec.cause = cause
        return rec

    # -- the client's presence (decided by .clients.Feeders) --------------------
    def park(self, job_id: str, why: str) -> None:
        """A RUNNING job whose client is gone moves to WAITING in a new epoch, rewound
        to its last complete checkpoint: its stages stop, so no node holds a thread
        for inputs that will not come (their snapshots and weights are kept, see
        :meth:`~.retention.Retention.reconcile`). ``why`` starts the reason ("waiting
        for the client ...")."""
        self.begin(job_id, {"the client"}, why, state=S.JOB_STATE_WAITING, cause=CLIENT_CAUSE,
                   only_from={S.JOB_STATE_RUNNING})
        self.jobs.notify()

    def rewind_for_client(self, job_id: str, why: str, rewind_to: int | None = None,
                          restored: bool = False) -> None:
        """A client takes the job over (:meth:`fedpipe.Job.resume`), comes back to a
        WAITING job, or restores a checkpoint it put on the nodes (``restored``, at
        ``rewind_to``): a DEPLOYING, RUNNING or WAITING job recovers in a new epoch
        from that checkpoint (default: its last complete one), which only the new
        feeder feeds. A RECOVERING job is left to its recovery, unless ``restored``."""
        states: set[int] = {S.JOB_STATE_DEPLOYING, S.JOB_STATE_RUNNING, S.JOB_STATE_WAITING}
        if restored:
            states.add(S.JOB_STATE_RECOVERING)
        with self.records.lock:
            rec = self.records.recovering.get(job_id)
            if rec is not None:  # the time spent waiting for the client is no recovery time
                rec.reported = rec.declared = self.clock()
        self.begin(job_id, set() if restored else {"the client"}, why, rewind_to,
                   cause=RESTORE_CAUSE if restored else CLIENT_CAUSE,
                   restored=restored, only_from=states)
        self.jobs.notify()

    def restore(self, job_id: str, step: int) -> tracker_pb2.JobInfo:
        """The client put its checkpoint of ``step`` on the job's nodes: resume there.

        Raises:
            NotFound: no such job.
            InvalidArgument: ``step`` is not inside the job (0 < step < steps).
        """
        job = self.jobs.get(job_id)
        if not 0 < step < job.steps:
            raise InvalidArgument(f"job {job.job_id} has {job.steps} steps: it cannot "
                                  f"resume at step {step}")
        self.rewind_for_client(job_id, f"restoring the client's checkpoint of step {step}",
                               rewind_to=step, restored=True)
        return self.jobs.get(job_id)

    # -- finishing ---------------------------------------------------------------
    def resume(self, job_id: str, nodes: list[tracker_pb2.NodeInfo]) -> None:
        """One attempt to finish a job's recovery over the live ``nodes``.

        Moves the lost nodes' stages (:func:`~.replan.substitute`), loads
        every stage for the new epoch at the rewind step with the places its
        snapshot may be, and moves the job to RUNNING. If a node of the new
        plan fails meanwhile, the job stays RECOVERING for the next attempt;
        if no snapshot of the rewind step survives, it rewinds to an older
        complete checkpoint (or the start); if the job no longer fits, it
        fails with the figures.
        """
        job = self.jobs.get(job_id)
        if job.state != S.JOB_STATE_RECOVERING:
            return
        with self.records.lock:
            rec = self.records.recovering.setdefault(job_id, Record(
                self.clock(), self.clock(), set(), job.step, job.plan))
        live = {n.address for n in nodes}  # a draining node still holds its snapshots
        nodes = self.drains.usable(nodes)  # a draining node takes no new work
        t_replan = self.clock()
        replanned = self._replan(job, rec, nodes)
        if replanned is None:
            return
        plan, bytes_moved = replanned
        self.deployer.predict(job_id, plan, nodes)
        self.store.set_plan(job_id, plan)
        t_restore = self.clock()
        step, spec = job.resume_step, self.specs.job(job_id)
        sources = snapshot_sources(rec.old_plan, plan, step, spec, live)
        failures = self.deployer.deploy(job_id, plan, spec, resume_step=step, sources=sources,
                                        pieces=snapshot_pieces(rec.old_plan, plan, sources),
                                        old=rec.old_plan)
        if failures:
            self._not_loaded(job, plan, failures)
            return
        now = self.clock()
        record = tracker_pb2.Recovery(
            time=rec.declared, lost="" if rec.cause == "rebalance" else ", ".join(sorted(rec.lost)),
            checkpoint_step=step, steps_recomputed=max(0, rec.from_step - step),
            detect_seconds=max(0.0, rec.declared - rec.reported),
            replan_seconds=t_restore - t_replan + (t_replan - rec.declared),
            restore_seconds=now - t_restore, epoch=job.epoch, cause=rec.cause,
            bytes_moved=bytes_moved)
        record.moved_from, record.moved_to = moves(rec.old_plan, plan)
        self._resumed(job, rec, plan, record, now)

    def _replan(self, job: tracker_pb2.JobInfo, rec: Record, nodes: list[tracker_pb2.NodeInfo]
                ) -> tuple[node_pb2.Plan, int] | None:
        """The new epoch's plan and the state bytes it moves: a rebalance's target, else
        the lost nodes' stages moved to live ``nodes``; None (the job failed) if a stage
        fits nowhere."""
        spec = self.specs.get(job.job_id)
        view = PlanView(job.plan)

        def need(a: node_pb2.StageAssignment) -> float:
            return assignment_memory_bytes(job.plan, a, spec.profile, spec.config)

        live = {n.node_id for n in nodes}
        target = self.drains.target_plan(job.job_id, job.plan) if rec.cause == "rebalance" \
            else None
        plan = node_pb2.Plan()
        try:
            plan.CopyFrom(target[0] if target is not None
                          else substitute(job.plan, view.node_ids() - live, nodes, need))
        except planner.PlanError as e:
            self.jobs.fail(job.job_id, f"cannot recover from the loss of "
                                       f"{', '.join(sorted(rec.lost))}: {e}")
            return None
        plan.epoch = job.epoch
        return plan, target[1] if target is not None else 0

    def _not_loaded(self, job: tracker_pb2.JobInfo, plan: node_pb2.Plan,
                    failures: dict[StageKey, str]) -> None:
        """Some stages of the new epoch could not be loaded: a node that cannot be
        reached is lost (the recovery restarts), a snapshot that did not survive rewinds
        further back, anything else fails the job."""
        job_id, step, new = job.job_id, job.resume_step, PlanView(plan)
        for key in failures:  # a node that cannot be reached is lost: recovery restarts
            if key in new.stages:
                self.suspect(self.jobs.get(job_id), tracker_pb2.StageReport(
                    peer=new[key].address))
        gone = new.node_ids() - {n.node_id for n in self.membership.nodes()}
        if gone or self.jobs.get(job_id).epoch != job.epoch:
            return  # a node of the new plan was lost meanwhile: the next attempt replans
        if step > 0 and all("no snapshot" in f for f in failures.values()):
            # the nodes keep the snapshots of the last two checkpoints; the one before
            # the last is known here, or (after a tracker restart) one interval back
            older = [k for k in self.tallies.complete(job_id) if k < step]
            every = self.specs.job(job_id).checkpoint_every
            back = older[-1] if older else max(0, step - max(1, every))
            log.warning("job %s: no snapshot of step %d survives (%s); rewinding to %d",
                        job_id, step, "; ".join(failures.values()), back)
            self.begin(job_id, set(), f"no snapshot of step {step} survives", rewind_to=back)
            return
        self.jobs.fail(job_id, "cannot recover: " + "; ".join(failures.values()),
                       only_from={S.JOB_STATE_RECOVERING})

    def _resumed(self, job: tracker_pb2.JobInfo, rec: Record, plan: node_pb2.Plan,
                 record: tracker_pb2.Recovery, now: float) -> None:
        """Every stage of the new epoch is loaded: store the recovery's record and move
        the job to RUNNING, unless a newer loss restarted the recovery meanwhile."""
        job_id, step = job.job_id, record.checkpoint_step
        fields = tracker_pb2.JobInfo()
        fields.CopyFrom(self.jobs.get(job_id))
        fields.recoveries.append(record)
        reason = (f"{recovery_headline(record)}: resumed at checkpoint step {step} "
                  f"({record.steps_recomputed} steps to recompute) on {plan.summary}")
        with self.records.lock:
            current = self.jobs.get(job_id)
            if current.epoch != job.epoch or current.state != S.JOB_STATE_RECOVERING:
                return
            fields.epoch, fields.checkpoint_step = current.epoch, current.checkpoint_step
            self.records.recovering.pop(job_id, None)
            for address in PlanView(rec.old_plan).addresses() | PlanView(plan).addresses():
                self.records.suspected.pop(address, None)
            self.store.set_recovery(job_id, fields, now, rewind_to=step)
            self.jobs.move(job_id, S.JOB_STATE_RUNNING, reason,
                           only_from={S.JOB_STATE_RECOVERING})
        self.jobs.notify()

    def suspect(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> bool:
        """A stage could not send to (or lost the stream from) ``report.peer``: Ping it
        with a short deadline and declare it lost if it does not answer (unless it is
        outbound-only, homed at a relay: then only its lease declares it lost). Returns
        whether it is gone (declared lost now, or already)."""
        target = next((a for a in job.plan.stages if a.address == report.peer), None)
        if target is None:
            return False
        with self.records.lock:
            self.records.suspected.setdefault(report.peer, self.clock())
        try:
            self.nodes.ping(report.peer, timeouts.PEER_PING_RPC)
            with self.records.lock:
                self.records.suspected.pop(report.peer, None)
            return False
        except NodeCallError as e:
            relay = next((n.relay for n in self.membership.nodes()
                          if n.node_id == target.node_id), "")
            if relay:
                # an outbound-only node is reached through its relay, which may be down while
                # the node lives (it heartbeats here directly): it re-homes and its peers'
                # links resume; its lease decides, as for a node that stopped heartbeating
                log.info("node %s (outbound-only via relay %s) did not answer a Ping (%s); "
                         "its lease decides whether it is lost", target.node_name, relay, e)
                return False
            # declared now, or already by another stage's report: gone either way
            self.membership.declare_lost(target.node_id, f"stopped answering (a peer's stream "
                                                         f"to it failed, then a Ping: {e})")
            return True
