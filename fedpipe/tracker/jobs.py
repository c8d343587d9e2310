"""A job's life cycle: every state transition, with its reason, happens here.

::

    PENDING ──> PLANNING ──> DEPLOYING ──> RUNNING ──> SUCCEEDED
       │           │             │   │        │  ▲
       │           │             │   └──> RECOVERING (a node lost: rewind to the
       │           │             │            │       last complete checkpoint)
       └───────────┴─────────────┴────────────┴──> FAILED | CANCELLED

Events drive it, each a method of :class:`Jobs`: a submission
(:meth:`~Jobs.submit`), the scheduler deciding to start a PENDING job
(:meth:`~Jobs.start`: plan ready, then each stage loaded or failed to load),
a node's report (:meth:`~Jobs.report`: step done, stage done, stage failed),
nodes lost (:meth:`~Jobs.nodes_lost`: lease expired, left, or replaced by a
new incarnation), the client's cancel (:meth:`~Jobs.cancel`), a PENDING job
waiting past its ``pending_timeout`` (:meth:`~Jobs.expire_pending`) and a
tracker restart (:meth:`~Jobs.recover`).

Recovery. A lost node (lease expired, left, or confirmed gone by a Ping after
a peer reported it) moves each active job using it to RECOVERING: a new plan
*epoch* begins (every message and report carries its epoch; the nodes drop
older ones), and the job rewinds to its last complete checkpoint ``K`` (the
step every stage has acknowledged a snapshot of, kept on its node and a buddy).
The scheduler then calls :meth:`~Jobs.resume`: the lost nodes' stages move to
live nodes (:func:`~.replan.substitute`: survivors keep theirs), the nodes that
may hold the snapshots learn the new plan's nodes (:meth:`~Jobs.assign`: under
TLS they serve state only to nodes assigned to the job), every stage is
loaded for the new epoch at step ``K`` and restores its snapshot (its own or
its buddy's), and the job is RUNNING again. The client rewinds its feed to
``K``. A loss during recovery starts it again; a job that no longer fits
fails with the figures.

Elastic replica groups. A job with ``min_replicas`` > 0 and several replica
groups does not rewind for a lost node while enough groups are left: the
node's group is dropped and the others go on (:mod:`.replicas`, which also
counts each step's reports and checkpoint acknowledgements over the groups
that take part, and heals dropped groups on spare nodes).

Everything outside is injected: the :class:`~.store.Store`, the
:class:`~.nodes.NodeCalls` that reach nodes and the clock, so
``tests/test_jobs.py`` runs the whole life cycle in-process with fakes.
Errors a caller made are raised as :mod:`~.errors` classes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .. import planner
from ..planner.protoio import cluster_view, model_profile, plan_from_message, plan_message, \
    train_config
from ..planner.types import StageTime
from ..proto import node_pb2, tracker_pb2
from ..spec import ACTIVE, TERMINAL, WAITING, JobSpec, JobSpecError, PlanView, StageKey, \
    state_name
from ..net import timeouts
from ..recovery_text import recovery_headline
from .calibration import Calibration
from .errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, \
    ResourceExhausted
from .nodes import NodeCallError, NodeCalls
from .planning import Planner
from .replan import moves, substitute
from .replicas import ElasticReplicas
from .store import Store

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2
R = tracker_pb2.StageReport

RESTARTED = ("the tracker restarted while the job was being planned or deployed; "
             "submit it again")
"""Why a job found PLANNING or DEPLOYING at start-up failed: its deploy was cut short."""
CLIENT_CAUSE = "the client's absence"
"""What a job parked or taken over for its client recovers from (its recovery record)."""
RESTORE_CAUSE = "a checkpoint the client restored"
"""What a job started from a saved checkpoint (``submit(resume_from=...)``) recovers from."""
HANDOVERS = ("drain", "rebalance")
"""Recovery causes that are hand-overs at a step boundary (:mod:`.elastic`): nothing is lost."""
CHECKPOINT_SECONDS = 30.0
"""Default checkpoint interval, as training time: a recovery recomputes at most about this."""
RETENTION = 600.0
"""Seconds an ended job's stages keep their weights on the nodes (for ``state_dict()``)
unless released sooner; then the nodes are told to free them."""
STAGE_TIME_WINDOW = 5
"""Steps over which :meth:`Jobs.stage_times` takes each stage's median split."""
STAGE_TIME_JOBS = 256
"""Jobs whose stage times are kept in memory (the least recently reported go first)."""
WATCH_RECHECK = 0.5
"""Seconds a watcher waits for a notification before it reads the job's events again
(every change notifies; this bounds the delay should one be missed)."""


def validate(request: tracker_pb2.SubmitJobRequest) -> JobSpec:
    """The job's spec, if the submission is well formed.

    Raises:
        InvalidArgument: no layers, a profile that does not match the layers,
            an invalid :class:`~fedpipe.spec.JobSpec` field (named), or a
            profile layer with FLOPs that are negative or not finite.
    """
    if not request.layers:
        raise InvalidArgument("the job has no layers")
    if len(request.profile.layers) != len(request.layers):
        raise InvalidArgument(f"the profile has {len(request.profile.layers)} layers but the job "
                              f"{len(request.layers)}")
    try:
        spec = JobSpec.from_proto(request.config).validate(len(request.layers))
    except JobSpecError as e:
        raise InvalidArgument(str(e)) from None
    for i, lp in enumerate(request.profile.layers):
        if not (math.isfinite(lp.flops) and lp.flops >= 0):
            raise InvalidArgument(f"profile layer {i} ({lp.name}): flops must be a finite "
                                  f"number >= 0")
    return spec


def stage_name(key: StageKey) -> str:
    """"stage 1 (replica 0)": how reasons name a stage."""
    return f"stage {key.stage} (replica {key.replica})"


def checkpoint_every(job: JobSpec, step_seconds: float) -> int:
    """Steps between checkpoints: the job's own setting, else as many steps as take
    :data:`CHECKPOINT_SECONDS` at ``step_seconds`` per step (at least 1)."""
    if job.checkpoint_every:
        return job.checkpoint_every
    return max(1, min(job.steps, int(CHECKPOINT_SECONDS / max(step_seconds, 1e-3))))


@dataclass
class _Recovery:
    """A recovery in progress (in memory: a restarted tracker starts a fresh record)."""

    reported: float          # when the loss was first suspected (a failure report or expiry)
    declared: float          # when the node was declared lost
    lost: set[str]           # names of the lost nodes
    from_step: int           # the job's step at the loss
    old_plan: node_pb2.Plan  # the plan the snapshots were taken under
    cause: str = "loss"      # "loss", one of HANDOVERS, CLIENT_CAUSE or RESTORE_CAUSE


@dataclass
class _StepParts:
    """The replica groups' reports of one step so far, by group."""

    reports: dict[int, tracker_pb2.StageReport] = field(default_factory=dict)


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


class Jobs:
    """The job life cycle over a store (see the module docstring).

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (LoadStage, StopJob).
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, clock: Callable[[], float] = time.time):
        self.store, self.nodes, self.clock = store, nodes, clock
        self.changed = threading.Condition()
        """Notified whenever a job or the swarm changes (scheduler and watchers wait on it)."""
        self._steps: dict[tuple[str, int], _StepParts] = {}
        self._acks: dict[tuple[str, int, int], set[StageKey]] = {}  # (job, epoch, step)
        self._complete: dict[str, list[int]] = {}  # job -> its complete checkpoints, newest last
        self._recovering: dict[str, _Recovery] = {}
        self._suspected: dict[str, float] = {}  # address -> when a peer first reported it
        self._ended: dict[str, float] = {}  # job -> when it reached a terminal state
        self._lock = threading.RLock()  # recovery bookkeeping
        self.declare_lost: Callable[[str, str], bool] | None = None
        self.live_nodes: Callable[[], list[tracker_pb2.NodeInfo]] = store.nodes
        """The live nodes, oldest first; the tracker sets it to the registry's copy in memory
        (:meth:`~.registry.Registry.nodes`: shared messages, read only)."""
        """Marks a node lost now with a reason (the registry's); set by the tracker."""
        self.retention = RETENTION
        # job -> (epoch, stage -> its last STAGE_TIME_WINDOW (compute, wait, send) splits);
        # in memory only: a report per stage per step is too many for an SQLite write each
        self._stage_times: OrderedDict[str, tuple[int, dict[StageKey, deque]]] = OrderedDict()
        self._times_lock = threading.Lock()
        # hooks of :class:`~.elastic.Elastic` (drains, joins, slow nodes); inert without it
        self.on_checkpoint: Callable[[str, int], None] = lambda job_id, step: None
        self.on_step: Callable[[str, int], None] = lambda job_id, step: None
        self.usable: Callable[[list[tracker_pb2.NodeInfo]], list[tracker_pb2.NodeInfo]] = \
            lambda nodes: nodes
        self.target_plan: Callable[[str, node_pb2.Plan], tuple[node_pb2.Plan, int] | None] = \
            lambda job_id, plan: None
        self.replicas = ElasticReplicas(self)
        """Elastic replica groups: drops, per-step quorums, heals (:mod:`.replicas`)."""
        self.calibration = Calibration()
        """The cost model fitted from the stages' step times: plans and replans use it."""
        self.planner = Planner()
        """Makes plans (:mod:`.planning`): in-process here; the tracker's server gives it a
        worker process, so planning does not hold the GIL its heartbeats need."""

    def notify(self) -> None:
        """Wake the scheduler and every watcher."""
        with self.changed:
            self.changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for :meth:`notify`."""
        with self.changed:
            self.changed.wait(timeout)

    # -- transitions ----------------------------------------------------------
    def _move(self, job_id: str, state: int, reason: str, *, only_from: set[int] | None = None
              ) -> bool:
        moved = self.store.set_state(job_id, state, reason, self.clock(), only_from=only_from)
        if moved and state in TERMINAL:
            self._ended[job_id] = self.clock()
            with self._lock:
                self._recovering.pop(job_id, None)
        if moved and state != S.JOB_STATE_FAILED:  # _fail warns
            log.info("job %s %s: %s", job_id, state_name(state), reason)
        return moved

    def _fail(self, job_id: str, reason: str, only_from: set[int] | None = None) -> None:
        if self._move(job_id, S.JOB_STATE_FAILED, reason, only_from=only_from):
            log.warning("job %s failed: %s", job_id, reason)
            self._stop_stages(job_id, reason, release=False)
        self.notify()

    def _stop_stages(self, job_id: str, reason: str, release: bool,
                     plan: node_pb2.Plan | None = None, before_epoch: int = 0) -> None:
        """Stop the job's stages on the nodes of ``plan`` (default: its current plan);
        with ``before_epoch``, only those of older epochs."""
        plan = plan if plan is not None else self.store.job(job_id).plan
        for address in sorted(PlanView(plan).addresses()):
            try:
                self.nodes.stop_job(address, node_pb2.StopJobRequest(
                    job_id=job_id, reason=reason, release=release, before_epoch=before_epoch))
            except NodeCallError as e:
                log.warning("could not stop job %s on %s: %s", job_id, address, e)

    # -- events ---------------------------------------------------------------
    def recover(self) -> None:
        """The tracker (re)started: fail the jobs whose planning or deploy it cut short."""
        for job_id in self.store.jobs_in(S.JOB_STATE_PLANNING, S.JOB_STATE_DEPLOYING):
            self._fail(job_id, RESTARTED)

    def submit(self, request: tracker_pb2.SubmitJobRequest) -> str:
        """Store a new PENDING job; return its id.

        Raises:
            InvalidArgument: see :func:`validate`.
            ResourceExhausted: the live nodes' memory in all is less than the
                job needs on one device (weights, gradients, optimizer state,
                activations).
        """
        spec = validate(request)
        nodes = self.live_nodes()
        if nodes:
            need = planner.stage_memory_bytes(model_profile(request.profile), 0,
                                              len(request.layers), train_config(spec), 0, 1)
            have = sum(n.resources.memory_bytes for n in nodes)
            if need > have:
                raise ResourceExhausted(
                    f"the job needs about {need / 2**20:.1f} MiB (weights, gradients, optimizer "
                    f"state, activations) but the swarm's {len(nodes)} node(s) have "
                    f"{have / 2**20:.1f} MiB in all")
        reason = "queued for planning" if nodes else "waiting for a node to register"
        job_id = self.store.add_job(request, reason, self.clock())
        log.info("job %s submitted: %d layers, %d steps", job_id, len(request.layers),
                 request.config.steps)
        self.notify()
        return job_id

    def get(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job's state, plan and last step.

        Raises:
            NotFound: no such job.
        """
        try:
            return self.store.job(job_id)
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    def info(self, job_id: str) -> tracker_pb2.JobInfo:
        """:meth:`get` with each stage's recent step split and its predicted compute
        (``JobInfo.stage_times``), for ``GetJob``.

        Raises:
            NotFound: no such job.
        """
        job = self.get(job_id)
        predicted = self.calibration.predicted(job_id, job.epoch)
        for t in self.stage_times(job_id):
            job.stage_times.add(replica=t.replica, stage=t.stage, compute_seconds=t.compute,
                                wait_seconds=t.wait, send_seconds=t.send,
                                predicted_compute_seconds=predicted.get(
                                    StageKey(t.replica, t.stage), 0.0))
        return job

    def cancel(self, job_id: str, reason: str = "", keep_weights: bool = False
               ) -> tracker_pb2.JobInfo:
        """Cancel a job that has not ended; return it. Its stages are stopped and
        released, or with ``keep_weights`` stopped and kept for the retention period
        (a job whose data ran out keeps its finished steps' weights).

        Raises:
            NotFound: no such job.
        """
        self.get(job_id)
        if self._move(job_id, S.JOB_STATE_CANCELLED, reason or "cancelled by the client"):
            self._stop_stages(job_id, "cancelled", release=not keep_weights)
            self.notify()
        return self.get(job_id)

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
            if used and not self.replicas.drop(job_id, used, why):
                self._begin_recovery(job_id, {names.get(n, n) for n in used}, why,
                                     rewind_to=self.replicas.rewind_to(self.store.job(job_id)))
        self.notify()

    # -- recovery -------------------------------------------------------------
    def begin_recovery(self, job_id: str, names: set[str], why: str, cause: str) -> None:
        """Start a new plan epoch at the job's last complete checkpoint for a hand-over
        (``cause`` "drain" or "rebalance": the checkpoint is the cut the stages hold at,
        so nothing is recomputed); :meth:`resume` then moves the stages."""
        self._begin_recovery(job_id, names, why, cause=cause)

    def old_nodes(self, job_id: str) -> set[str]:
        """Ids of the nodes of the plan a recovering job's snapshots were taken under."""
        with self._lock:
            rec = self._recovering.get(job_id)
        return PlanView(rec.old_plan).node_ids() if rec is not None else set()

    def _begin_recovery(self, job_id: str, lost: set[str], why: str,
                        rewind_to: int | None = None, *, state: int = S.JOB_STATE_RECOVERING,
                        cause: str = "loss", restored: bool = False,
                        only_from: set[int] | None = None) -> None:
        """Move the job to RECOVERING (or ``state``) in a new epoch, rewound to its last
        complete checkpoint (or ``rewind_to``); stop its stages of the old epoch.

        Args:
            cause: what the recovery record says the job recovers from: "loss" (of the
                ``lost`` nodes), a hand-over (:data:`HANDOVERS`: nothing is recomputed),
                :data:`CLIENT_CAUSE` or :data:`RESTORE_CAUSE`.
            restored: ``rewind_to`` is a checkpoint the client put on the nodes
                (:meth:`restore`): it becomes the last complete one.
            only_from: begin only if the job is in one of these states.
        """
        now = self.clock()
        with self._lock:
            job = self.store.job(job_id)
            if job.state in TERMINAL or (only_from is not None and job.state not in only_from):
                return
            step = job.checkpoint_step if rewind_to is None else rewind_to
            rec = self._recovering.get(job_id)
            if rec is not None and lost and lost <= rec.lost and rewind_to is None \
                    and job.state == S.JOB_STATE_RECOVERING:
                return  # this loss already started this recovery
            if rec is None:
                addresses = {a.address for a in job.plan.stages}
                reported = min([t for a, t in self._suspected.items() if a in addresses],
                               default=now)
                rec = self._recovering[job_id] = _Recovery(reported, now, set(), job.step,
                                                           job.plan, cause)
            elif cause not in HANDOVERS:
                rec.cause = cause  # a loss during a hand-over makes it a recovery
            rec.lost |= lost
            fields = tracker_pb2.JobInfo()
            fields.CopyFrom(job)
            fields.epoch, fields.resume_step = job.epoch + 1, step
            if restored:
                fields.checkpoint_step = step
                self._complete[job_id] = [step]
            elif rewind_to is not None:  # the checkpoints from rewind_to on are gone
                fields.checkpoint_step = min(job.checkpoint_step, rewind_to)
                self._complete[job_id] = [k for k in self._complete.get(job_id, [])
                                          if k < rewind_to]
            self.store.set_recovery(job_id, fields, now)
            self._steps = {k: v for k, v in self._steps.items() if k[0] != job_id}
            self._acks = {k: v for k, v in self._acks.items() if k[0] != job_id}
            names = ', '.join(sorted(lost))
            if cause in HANDOVERS:
                reason = f"{cause} of {names}: handing over at step {step}"
            else:
                who = f"node(s) {names} " if lost and cause == "loss" else ""
                reason = f"{who}{why}; rewinding to checkpoint step {step}"
            self._move(job_id, state, reason)
        # stop the old epoch's stages now so they free their threads; a LoadStage of the
        # new epoch would replace them anyway
        threading.Thread(target=self._stop_stages, args=(job_id, reason, False, job.plan,
                                                         job.epoch + 1),
                         name=f"stop-{job_id}", daemon=True).start()

    # -- the client's presence (decided by .clients.Feeders) --------------------
    def park(self, job_id: str, why: str) -> None:
        """A RUNNING job whose client is gone moves to WAITING in a new epoch, rewound
        to its last complete checkpoint: its stages stop, so no node holds a thread
        for inputs that will not come (their snapshots and weights are kept, see
        :meth:`reconcile`). ``why`` starts the reason ("waiting for the client ...")."""
        self._begin_recovery(job_id, {"the client"}, why, state=WAITING, cause=CLIENT_CAUSE,
                             only_from={S.JOB_STATE_RUNNING})
        self.notify()

    def rewind_for_client(self, job_id: str, why: str, rewind_to: int | None = None,
                          restored: bool = False) -> None:
        """A client takes the job over (:meth:`fedpipe.Job.resume`), comes back to a
        WAITING job, or restores a checkpoint it put on the nodes (``restored``, at
        ``rewind_to``): a DEPLOYING, RUNNING or WAITING job recovers in a new epoch
        from that checkpoint (default: its last complete one), which only the new
        feeder feeds. A RECOVERING job is left to its recovery, unless ``restored``."""
        states = {S.JOB_STATE_DEPLOYING, S.JOB_STATE_RUNNING, WAITING}
        if restored:
            states.add(S.JOB_STATE_RECOVERING)
        with self._lock:
            rec = self._recovering.get(job_id)
            if rec is not None:  # the time spent waiting for the client is no recovery time
                rec.reported = rec.declared = self.clock()
        self._begin_recovery(job_id, set() if restored else {"the client"}, why, rewind_to,
                             cause=RESTORE_CAUSE if restored else CLIENT_CAUSE,
                             restored=restored, only_from=states)
        self.notify()

    def fail_for_client(self, job_id: str, reason: str, only_from: set[int]) -> None:
        """Fail a job whose client stayed away past its ``client_timeout``."""
        self._fail(job_id, reason, only_from=only_from)

    def recovering(self) -> list[str]:
        """Ids of RECOVERING jobs, oldest first."""
        return self.store.jobs_in(S.JOB_STATE_RECOVERING)

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
        job = self.get(job_id)
        if job.state != S.JOB_STATE_RECOVERING:
            return
        request = self.store.spec(job_id)
        spec = JobSpec.from_proto(request.config)
        profile, config = model_profile(request.profile), train_config(spec)
        view = PlanView(job.plan)
        with self._lock:
            rec = self._recovering.setdefault(job_id, _Recovery(
                self.clock(), self.clock(), set(), job.step, job.plan))

        def need(a: node_pb2.StageAssignment) -> float:
            return planner.stage_memory_bytes(profile, a.layer_start, a.layer_end, config,
                                              a.stage, view.depth(a.replica),
                                              view.microbatches(a.replica))

        nodes = self.usable(nodes)  # a draining node takes no new work
        live = {n.node_id for n in nodes}
        t_replan = self.clock()
        target = self.target_plan(job_id, job.plan) if rec.cause == "rebalance" else None
        bytes_moved = target[1] if target is not None else 0
        try:
            plan = node_pb2.Plan()
            plan.CopyFrom(target[0] if target is not None
                          else substitute(job.plan, view.node_ids() - live, nodes, need))
        except planner.PlanError as e:
            self._fail(job_id, f"cannot recover from the loss of {', '.join(sorted(rec.lost))}: "
                               f"{e}")
            return
        plan.epoch = job.epoch
        self._predict(job_id, plan, nodes, profile, config)
        self.store.set_plan(job_id, plan)
        t_restore = self.clock()
        step = job.resume_step
        sources = self._snapshot_sources(rec.old_plan, plan, step, spec)
        failures = self._deploy(job_id, plan, spec, resume_step=step, sources=sources,
                                pieces=snapshot_pieces(rec.old_plan, plan, sources))
        if failures:
            new = PlanView(plan)
            for key in failures:  # a node that cannot be reached is lost: recovery restarts
                if key in new.stages:
                    self._suspect(self.get(job_id), tracker_pb2.StageReport(
                        peer=new[key].address))
            gone = new.node_ids() - {n.node_id for n in self.live_nodes()}
            if gone or self.get(job_id).epoch != job.epoch:
                return  # a node of the new plan was lost meanwhile: the next attempt replans
            if step > 0 and all("no snapshot" in f for f in failures.values()):
                # the nodes keep the snapshots of the last two checkpoints; the one before
                # the last is known here, or (after a tracker restart) one interval back
                older = [k for k in self._complete.get(job_id, []) if k < step]
                back = older[-1] if older else max(0, step - max(1, spec.checkpoint_every))
                log.warning("job %s: no snapshot of step %d survives (%s); rewinding to %d",
                            job_id, step, "; ".join(failures.values()), back)
                self._begin_recovery(job_id, set(), f"no snapshot of step {step} survives",
                                     rewind_to=back)
                return
            self._fail(job_id, "cannot recover: " + "; ".join(failures.values()),
                       only_from={S.JOB_STATE_RECOVERING})
            return
        now = self.clock()
        fields = tracker_pb2.JobInfo()
        fields.CopyFrom(self.get(job_id))
        moved_from, moved_to = moves(rec.old_plan, plan)
        record = tracker_pb2.Recovery(
            time=rec.declared, lost="" if rec.cause == "rebalance" else ", ".join(sorted(rec.lost)),
            checkpoint_step=step, steps_recomputed=max(0, rec.from_step - step),
            detect_seconds=max(0.0, rec.declared - rec.reported),
            replan_seconds=t_restore - t_replan + (t_replan - rec.declared),
            restore_seconds=now - t_restore, epoch=job.epoch, cause=rec.cause,
            bytes_moved=bytes_moved, moved_from=moved_from, moved_to=moved_to)
        fields.recoveries.append(record)
        what = recovery_headline(record)
        reason = (f"{what}: resumed at "
                  f"checkpoint step {step} ({max(0, rec.from_step - step)} steps to recompute) "
                  f"on {plan.summary}")
        with self._lock:  # unless a newer loss restarted the recovery meanwhile
            current = self.get(job_id)
            if current.epoch != job.epoch or current.state != S.JOB_STATE_RECOVERING:
                return
            fields.epoch, fields.checkpoint_step = current.epoch, current.checkpoint_step
            self._recovering.pop(job_id, None)
            for address in PlanView(rec.old_plan).addresses() | PlanView(plan).addresses():
                self._suspected.pop(address, None)
            self.store.set_recovery(job_id, fields, now, rewind_to=step)
            self._move(job_id, S.JOB_STATE_RUNNING, reason, only_from={S.JOB_STATE_RECOVERING})
        self.notify()

    @staticmethod
    def _snapshot_sources(old: node_pb2.Plan, new: node_pb2.Plan, step: int, spec: JobSpec
                          ) -> Callable[[StageKey], list[str]]:
        """Where each stage's snapshot of ``step`` may be, best first: its node in the
        plan it was taken under, the buddy it went to, then every other node of either
        plan (buddies rotate, and a node may hold an older copy)."""
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
            return list(dict.fromkeys(first + every))

        return sources

    def _checkpointed(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """A stage's snapshot of ``report.step`` is kept on its node and its buddy; once
        every stage of the plan says so, the step is a complete checkpoint (a consistent
        cut), recorded in the store."""
        with self._lock:  # read now: a recovery may have begun since the report was read
            job = self.get(job.job_id)
            if report.epoch != job.epoch:
                return
            acks = self._acks.setdefault((job.job_id, job.epoch, report.step), set())
            acks.add(StageKey(report.replica, report.stage))
            if len(acks) < self.replicas.stages(job, report.step) \
                    or report.step <= job.checkpoint_step:
                return
            self.replicas.checkpointed(job, report.step)
            del self._acks[(job.job_id, job.epoch, report.step)]
            done = self._complete.setdefault(job.job_id, [])
            done[:] = (done + [report.step])[-4:]
            fields = tracker_pb2.JobInfo()
            fields.CopyFrom(job)
            fields.checkpoint_step = report.step
            self.store.set_recovery(job.job_id, fields, self.clock(), event=tracker_pb2.JobEvent(
                state=job.state, reason=f"checkpoint of step {report.step} complete",
                checkpoint_step=report.step, epoch=job.epoch))
        self.on_checkpoint(job.job_id, report.step)

    def _suspect(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> bool:
        """A stage could not send to (or lost the stream from) ``report.peer``: Ping it
        with a short deadline and declare it lost if it does not answer. Returns
        whether it is gone (declared lost now, or already)."""
        target = next((a for a in job.plan.stages if a.address == report.peer), None)
        if target is None or self.declare_lost is None:
            return False
        with self._lock:
            self._suspected.setdefault(report.peer, self.clock())
        try:
            self.nodes.ping(report.peer, timeouts.PEER_PING_RPC)
            with self._lock:
                self._suspected.pop(report.peer, None)
            return False
        except NodeCallError as e:
            # declared now, or already by another stage's report: gone either way
            self.declare_lost(target.node_id, f"stopped answering (a peer's stream to it "
                                              f"failed, then a Ping: {e})")
            return True

    def reconcile(self, node_id: str, holds: list[tracker_pb2.StageRef]
                  ) -> tuple[list[tracker_pb2.StageRef], list[str]]:
        """What a node that holds ``holds`` must drop: ``(stages, jobs)``.

        A stage of an older epoch, or one the job's plan no longer puts on this
        node, is dropped, unless the job is RECOVERING (its snapshots may be
        restored from these nodes). Everything of a job that is unknown, or ended
        more than :attr:`retention` seconds ago, is dropped (a released job's
        stages are gone already).
        """
        stages, jobs = [], set()
        now = self.clock()
        for ref in holds:
            try:
                job = self.store.job(ref.job_id)
            except KeyError:
                jobs.add(ref.job_id)
                continue
            if job.state in TERMINAL:
                if now - self._ended.setdefault(ref.job_id, now) > self.retention:
                    jobs.add(ref.job_id)
            elif job.state in (S.JOB_STATE_RECOVERING, WAITING) or ref.stage < 0:
                continue
            elif ref.epoch < job.epoch:
                stages.append(ref)
            else:
                mine = PlanView(job.plan).get(StageKey(ref.replica, ref.stage))
                if mine is None or mine.node_id != node_id:
                    stages.append(ref)
        return stages, sorted(jobs)

    def checkpoints(self, holds: list[tracker_pb2.StageRef]) -> dict[str, int]:
        """The last complete checkpoint of each active job in ``holds`` (a node's holdings):
        the node must keep that snapshot, however many newer ones it takes meanwhile."""
        steps = {}
        for job_id in {ref.job_id for ref in holds}:
            try:
                job = self.store.job(job_id)
            except KeyError:
                continue
            if job.state not in TERMINAL:
                steps[job_id] = job.checkpoint_step
        return steps

    def pending(self) -> list[str]:
        """Ids of PENDING jobs, oldest first."""
        return self.store.jobs_in(S.JOB_STATE_PENDING)

    def expire_pending(self, job_id: str) -> bool:
        """Fail a PENDING job that has waited past its ``pending_timeout``; True if it did."""
        timeout = self.store.spec(job_id).pending_timeout
        if timeout and self.clock() - self.store.job(job_id).created > timeout:
            self._fail(job_id, f"no node registered within {timeout:.0f} s")
            return True
        return False

    def start(self, job_id: str, nodes: list[tracker_pb2.NodeInfo],
              links: list[node_pb2.LinkMeasurement]) -> None:
        """Plan a PENDING job over ``nodes`` and deploy it: PLANNING, DEPLOYING, then RUNNING.

        A planner error, a planner bug or a stage that cannot be loaded fails
        the job with the reason; nothing is raised.
        """
        if not self._move(job_id, S.JOB_STATE_PLANNING, f"planning over {len(nodes)} node(s)",
                          only_from={S.JOB_STATE_PENDING}):
            return
        self.notify()
        request = self.store.spec(job_id)
        try:
            probed, profile = cluster_view(nodes, links), model_profile(request.profile)
            cluster = self.calibration.cluster(probed)
            plan, job = self.planner.plan(cluster, profile, JobSpec.from_proto(request.config))
            plan = dataclasses.replace(plan, calibrated=self.calibration.covers(plan, probed))
            self.calibration.planned(job_id, self.store.job(job_id).epoch, plan, probed, profile,
                                     train_config(job))
        except planner.PlanError as e:
            self._fail(job_id, f"no plan: {e}")
            return
        except Exception as e:  # noqa: BLE001 — a planner bug must not leave the job PLANNING
            log.exception("planning job %s failed", job_id)
            self._fail(job_id, f"planning failed: {type(e).__name__}: {e}")
            return
        msg = plan_message(plan, {n.node_id: n for n in nodes})
        sync = f" (replica groups sync by {job.replica_sync})" if len(plan.groups) > 1 else ""
        self.plan_ready(job_id, msg, job, sync)

    def plan_ready(self, job_id: str, plan: node_pb2.Plan, job: JobSpec, note: str = "") -> None:
        """A plan is ready: store it, move to DEPLOYING, load every stage, then RUNNING.

        Args:
            plan: the plan message (see :func:`~fedpipe.planner.protoio.plan_message`).
            job: the job's spec with "auto" settings resolved; it is what the
                stages run by.
            note: appended to the DEPLOYING reason.
        """
        job = job.with_(checkpoint_every=checkpoint_every(job, plan.predicted_step_seconds))
        self.store.set_plan(job_id, plan)
        self.store.set_config(job_id, job.to_proto())  # what the stages run by, resolved
        if not self._move(job_id, S.JOB_STATE_DEPLOYING, "loading stages: " + plan.summary + note,
                          only_from={S.JOB_STATE_PLANNING}):
            return
        self.notify()
        failures = self._deploy(job_id, plan, job)
        if failures:  # unless a lost node already moved it to RECOVERING
            self._fail(job_id, "; ".join(failures.values()), only_from={S.JOB_STATE_DEPLOYING})
        else:
            self._move(job_id, S.JOB_STATE_RUNNING, "all stages loaded",
                       only_from={S.JOB_STATE_DEPLOYING})
        self.notify()

    def _deploy(self, job_id: str, plan: node_pb2.Plan, job: JobSpec, resume_step: int = 0,
                sources: Callable[[StageKey], list[str]] = lambda key: [],
                pieces: Callable[[StageKey], list[node_pb2.SnapshotPiece]] = lambda key: []
                ) -> dict[StageKey, str]:
        """Load every stage at once (at ``resume_step``, restoring from a snapshot
        ``sources(key)`` may hold, or from the old stages' ``pieces(key)`` where the
        plan splits the layers otherwise); return why each stage that failed to load
        failed.

        Results are kept by :class:`~fedpipe.spec.StageKey`, so stage ``s``
        of one replica group never hides stage ``s`` of another.
        """
        view = PlanView(plan)
        if len(view.stages) != len(plan.stages):
            return {StageKey(-1, -1): f"the plan names a stage twice: {plan.summary}"}
        config = job.to_proto()
        # the owner and the client's signature travel with the code: nodes check them
        signed = self.store.spec(job_id)
        if resume_step:  # state moves: its holders must serve the new plan's nodes
            self.assign(job_id, plan, {s for key in view.stages for s in sources(key)})

        def load(a: node_pb2.StageAssignment) -> None:
            key = StageKey(a.replica, a.stage)
            self.nodes.load_stage(a.address, node_pb2.LoadStageRequest(
                job_id=job_id, replica=a.replica, stage=a.stage, plan=plan, config=config,
                layers=self.store.layers(job_id, a.layer_start, a.layer_end),
                resume_step=resume_step,
                snapshot_sources=sources(key) if resume_step else [],
                snapshot_pieces=pieces(key) if resume_step else [],
                owner=signed.owner, job_signature=signed.job_signature,
                client_cert=signed.client_cert, layer_digests=signed.layer_digests))

        with futures.ThreadPoolExecutor(max(1, len(view.stages))) as pool:
            results = {key: pool.submit(load, a) for key, a in view.stages.items()}
        failures = {}
        for key, fut in sorted(results.items()):
            err = fut.exception()
            if err is not None:
                detail = str(err) if isinstance(err, NodeCallError) \
                    else f"{type(err).__name__}: {err}"
                failures[key] = f"{stage_name(key)} on {view[key].node_name} could not be " \
                                f"loaded: {detail}"
        return failures

    def assign(self, job_id: str, plan: node_pb2.Plan, holders: set[str]) -> None:
        """Tell the nodes at ``holders`` (addresses of nodes that may hold the job's
        snapshots or state) which nodes ``plan`` assigns, before its LoadStage calls.

        Under TLS a node serves a job's state only to nodes a plan it was told of
        assigned (:func:`fedpipe.security.policy.require_owner_or_assigned`); a
        recovery's spare, a drain's or rebalance's new node and a healed replica
        group's nodes were in no plan the holders saw. The word comes from the
        tracker (AssignJob admits no other role), never from the fetching node.
        All at once, each within ``CONTROL_RPC`` seconds; a lost holder is not asked
        (a paused one would hold the loads up for that long) and one that cannot be
        reached is skipped: the stages' fetches go elsewhere.
        """
        holders = holders & {n.address for n in self.live_nodes()}
        if not holders:
            return
        request = node_pb2.AssignJobRequest(
            job_id=job_id, epoch=plan.epoch, owner=self.store.spec(job_id).owner,
            node_names=sorted({a.node_name for a in plan.stages}))

        def tell(address: str) -> None:
            try:
                self.nodes.assign_job(address, request)
            except NodeCallError as e:
                log.info("job %s: could not tell %s of plan epoch %d's nodes: %s", job_id,
                         address, plan.epoch, e)

        with futures.ThreadPoolExecutor(len(holders)) as pool:
            list(pool.map(tell, sorted(holders)))

    def report(self, report: tracker_pb2.StageReport) -> None:
        """A node's word on one of its stages: a step done, all steps done, or failed.

        Reports about a job that has ended are ignored. A step is recorded
        once every replica group has reported it; the job SUCCEEDS once every
        stage of its plan is done; a failed stage fails the job.

        Raises:
            NotFound: no such job.
            PermissionDenied: the node does not run that stage of the job.
            FailedPrecondition: the job is not active, or the step is out of range.
            InvalidArgument: an unknown status.
        """
        job = self.get(report.job_id)
        if job.state in TERMINAL or report.epoch != job.epoch:
            return  # an ended job, or a stage of an epoch before a recovery
        key = StageKey(report.replica, report.stage)
        mine = PlanView(job.plan).get(key)
        if mine is None or mine.node_id != report.node_id:
            raise PermissionDenied(f"node {report.node_id!r} does not run stage {report.stage} "
                                   f"(replica {report.replica}) of job {job.job_id}")
        if job.state not in ACTIVE or not 0 <= report.step <= job.steps:
            raise FailedPrecondition(f"job {job.job_id} is {state_name(job.state)} with "
                                     f"{job.steps} steps; report of step {report.step} refused")
        if self.replicas.out(job, report.replica):
            return  # a stage of a dropped replica group: the others go on without it
        if report.status == R.STATUS_STEP:
            self._step(job, report)
        elif report.status == R.STATUS_DONE:
            if self.store.stage_done(job.job_id, report.replica, report.stage):
                self._move(job.job_id, S.JOB_STATE_SUCCEEDED, f"all {job.steps} steps done")
        elif report.status == R.STATUS_CHECKPOINT:
            self._checkpointed(job, report)
        elif report.status == R.STATUS_SUSPECT:
            self._suspect(job, report)
        elif report.status == R.STATUS_FAILED:
            if job.state == S.JOB_STATE_RECOVERING:
                return  # a stage of the epoch being replaced gave up: expected
            if report.peer and self._suspect(job, report):
                return  # its peer is gone: the job recovers
            # only from where this report was read: a recovery may have begun meanwhile
            self._fail(job.job_id, f"{stage_name(key)} on node {report.node_id} failed: "
                                   f"{report.error}", only_from={job.state})
        else:
            raise InvalidArgument(f"unknown report status {report.status}")
        self.notify()

    def _step(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """Add one replica group's share of a step; record the step when all groups reported.

        Each group's loss is its part of the batch-mean loss, so the step's
        loss is their sum, and its samples/s the total samples over the
        slowest group's time. A group's report sent twice counts once.
        """
        self._stage_time(job, report)
        view = PlanView(job.plan)
        if report.stage != view.depth(report.replica) - 1:
            return  # every stage reports its step time; the group's last one carries the loss
        groups = self.replicas.groups(job, report.step)
        with self.changed:
            parts = self._steps.setdefault((job.job_id, report.step), _StepParts())
            parts.reports[report.replica] = report
            if len(parts.reports) < groups:
                return
            self._steps.pop((job.job_id, report.step), None)
        reports = parts.reports.values()
        loss = sum(r.loss for r in reports)
        samples, seconds = sum(r.samples for r in reports), max(r.seconds for r in reports)
        self.store.record_step(job.job_id, report.step, loss,
                               samples / seconds if seconds > 0 else 0.0, self.clock())
        self.on_step(job.job_id, report.step)
        if report.step % STAGE_TIME_WINDOW == 0 and report.step >= 2 * STAGE_TIME_WINDOW:
            self._calibrate(job)  # once per window of steps, past the first (warm-up)

    def _predict(self, job_id: str, plan: node_pb2.Plan, nodes: list[tracker_pb2.NodeInfo],
                 profile: planner.ModelProfile, config: planner.TrainConfig) -> None:
        """Set a replanned ``plan``'s predicted step time from the calibrated cost model,
        and remember it for the next fit (a failure keeps the old prediction)."""
        try:
            probed = cluster_view(nodes, self.store.links_among(n.node_id for n in nodes))
            new = self.calibration.predict(plan_from_message(plan), probed, profile, config)
            plan.predicted_step_seconds, plan.sync_seconds = (new.predicted_step_seconds,
                                                              new.sync_seconds)
            plan.calibrated = new.calibrated
            self.calibration.planned(job_id, plan.epoch, new, probed, profile, config)
        except (planner.PlanError, KeyError) as e:
            log.warning("job %s: cannot predict the replanned step time: %s", job_id, e)

    def _calibrate(self, job: tracker_pb2.JobInfo) -> None:
        """Fit the cost model to the job's recent stage splits (all its stages reported)."""
        with self._times_lock:
            epoch, stages = self._stage_times.get(job.job_id, (job.epoch, {}))
            windows = {key: list(w) for key, w in stages.items()} if epoch == job.epoch else {}
        if not windows or len(windows) < len(job.plan.stages):
            return
        compute = {key: statistics.median(c for c, _, _ in w) for key, w in windows.items()}
        step = statistics.median(statistics.median(sum(x) for x in w) for w in windows.values())
        try:
            self.calibration.observe(job.job_id, job.epoch, compute, step)
        except (planner.PlanError, KeyError) as e:  # an async plan, a node gone meanwhile
            log.debug("job %s: no calibration from this plan: %s", job.job_id, e)

    def _stage_time(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """Keep a stage's step split (compute, wait, send seconds) of the job's epoch."""
        split = (report.compute_seconds, report.wait_seconds, report.send_seconds)
        if not all(math.isfinite(x) and x >= 0 for x in split):
            return  # a broken clock must not poison the medians
        with self._times_lock:
            epoch, stages = self._stage_times.pop(job.job_id, (job.epoch, {}))
            if epoch != job.epoch:  # a recovery replanned: the old stages' times are moot
                epoch, stages = job.epoch, {}
            self._stage_times[job.job_id] = (epoch, stages)  # most recent last
            while len(self._stage_times) > STAGE_TIME_JOBS:
                self._stage_times.popitem(last=False)
            key = StageKey(report.replica, report.stage)
            stages.setdefault(key, deque(maxlen=STAGE_TIME_WINDOW)).append(split)

    def stage_times(self, job_id: str) -> list[StageTime]:
        """Each stage's step split in the job's current plan epoch: per part, the median
        of its last :data:`STAGE_TIME_WINDOW` reported steps, seconds; ordered by replica
        and stage (``[]`` before any report of this epoch, or for a job not seen lately
        or unknown)."""
        try:
            current = self.store.job(job_id).epoch
        except KeyError:
            return []
        with self._times_lock:
            epoch, stages = self._stage_times.get(job_id, (current, {}))
            splits = {key: list(window) for key, window in stages.items()} \
                if epoch == current else {}
        return [StageTime(key.replica, key.stage,
                          *(statistics.median(part) for part in zip(*window)))
                for key, window in sorted(splits.items())]

    def watch(self, job_id: str, after_seq: int, active: Callable[[], bool]
              ) -> Iterator[tracker_pb2.JobEvent]:
        """The job's events after ``after_seq``, then each new one, until it ends.

        Stops when the job is terminal and its events are all given, or when
        ``active()`` turns false (the watcher left, the tracker stops).

        Raises:
            NotFound: no such job (at the first ``next``).
        """
        self.get(job_id)
        seq = after_seq
        while active():
            events = self.store.events(job_id, seq)
            for ev in events:
                yield ev
                seq = ev.seq
            if not events:
                if self.store.job(job_id).state in TERMINAL:
                    return
                self.wait(WATCH_RECHECK)
