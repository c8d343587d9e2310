"""A job's life cycle: its states, the table of allowed moves, and the one function
that moves a job.

::

    PENDING ──> PLANNING ──> DEPLOYING ──> RUNNING ──> SUCCEEDED
       │           │             │   │        │  ▲ │
       │           │             │   └──> RECOVERING <── WAITING (the client left)
       │           │             │            │            │
       └───────────┴─────────────┴────────────┴────────────┴──> FAILED | CANCELLED

Every move goes through :meth:`Jobs.move`, which checks :data:`TRANSITIONS`
and records the reason (an event in the store); a move the table does not
allow from the job's state at that moment is refused, atomically in the store,
so two threads racing to move a job never both win. Each event that moves a
job lives in the module of its concern, each written once with its reason:

- submission, cancellation, a PENDING job's timeout, a tracker restart: here;
- planning and loading the stages (PLANNING, DEPLOYING, RUNNING): :mod:`.deploy`;
- a node's reports (steps, checkpoints, a stage done or failed): :mod:`.progress`,
  which also streams a job's events to its watchers;
- nodes lost, hand-overs, the client's absence (RECOVERING, WAITING): :mod:`.recovery`;
- what nodes keep of ended jobs: :mod:`.retention`.

Everything outside is passed in: the :class:`~.store.Store`, the
:class:`~.nodes.NodeCalls` that reach nodes, the clock and the live nodes, so
``tests/test_job_states.py`` and ``tests/test_jobs.py`` drive the life cycle
in-process with fakes. Errors a caller made are raised as :mod:`~.errors` classes.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping, Protocol

from ..net import timeouts
from ..planner import memfit
from ..planner.protoio import cluster_view, model_profile, train_config
from ..proto import node_pb2, tracker_pb2
from ..spec import TERMINAL, WAITING, JobSpec, JobSpecError, PlanView, StageKey, state_name
from .errors import InvalidArgument, NotFound, ResourceExhausted

from .nodes import NodeCallError, NodeCalls
from .specs import JobSpecs
from .store import Store

JOB_STATES = tuple(v for v in tracker_pb2.JobState.values()
                   if v != tracker_pb2.JOB_STATE_UNSPECIFIED)
"""Every state a job may be in (listing every job)."""
LIST_JOBS = 100
"""Jobs ``ListJobs`` gives by default, newest first."""
MAX_LIST_JOBS = 1000
"""The most jobs one ``ListJobs`` (or the dashboard's ``/api/jobs``) gives."""

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

RESTARTED = ("the tracker restarted while the job was being planned or deployed; "
             "submit it again")
"""Why a job found PLANNING or DEPLOYING at start-up failed: its deploy was cut short."""

_ENDS = frozenset({S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED})
CANCEL_WAIT = timeouts.CONTROL_RPC / 4
"""Seconds a CancelJob waits for its nodes' StopJob answers (asked all at once) before it
answers; the calls still out go on in the background. A node that does not answer (paused,
or busy loading the stage) would otherwise hold the cancel past the caller's deadline
(``CONTROL_RPC``), though the job is already CANCELLED."""
TRANSITIONS: Mapping[int, frozenset[int]] = {
    S.JOB_STATE_PENDING: frozenset({S.JOB_STATE_PLANNING}) | _ENDS,
    S.JOB_STATE_PLANNING: frozenset({S.JOB_STATE_DEPLOYING}) | _ENDS,
    S.JOB_STATE_DEPLOYING: frozenset({S.JOB_STATE_RUNNING, S.JOB_STATE_RECOVERING,
                                      S.JOB_STATE_SUCCEEDED}) | _ENDS,
    S.JOB_STATE_RUNNING: frozenset({S.JOB_STATE_RECOVERING, WAITING,
                                    S.JOB_STATE_SUCCEEDED}) | _ENDS,
    # a loss during a recovery (or a rewind further back) begins it again
    S.JOB_STATE_RECOVERING: frozenset({S.JOB_STATE_RECOVERING, S.JOB_STATE_RUNNING,
                                       S.JOB_STATE_SUCCEEDED}) | _ENDS,
    WAITING: frozenset({S.JOB_STATE_RECOVERING}) | _ENDS,
    S.JOB_STATE_SUCCEEDED: frozenset(),
    S.JOB_STATE_FAILED: frozenset(),
    S.JOB_STATE_CANCELLED: frozenset(),
}
"""State -> the states a job may move to from it. SUCCEEDED comes from any state in which
stages run (their last report may race a recovery's start); terminal states have none."""


class Listing(Protocol):
    """What :func:`newest_jobs` reads: the store, or the dashboard's source over it."""

    def jobs_in(self, *states: int) -> list[str]: ...

    def job(self, job_id: str) -> tracker_pb2.JobInfo: ...


def newest_jobs(source: Listing, owner: str | None = None) -> Iterator[tracker_pb2.JobInfo]:
    """Every job of ``source``, newest first (``owner``'s only, when given), read as it is
    reached, so a caller that takes the first N reads only as far as it must: ``ListJobs``
    (:meth:`Jobs.listed`) and the dashboard's ``/api/jobs``. A job gone between the
    listing and its reading (the store's retention) is left out."""
    for job_id in reversed(source.jobs_in(*JOB_STATES)):
        try:
            job = source.job(job_id)
        except KeyError:
            continue
        if owner is None or job.owner == owner:
            yield job


def may_move(current: int, to: int) -> bool:
    """Whether :data:`TRANSITIONS` allows a job in ``current`` to move to ``to``."""
    return to in TRANSITIONS.get(current, frozenset())


def sources(to: int) -> frozenset[int]:
    """The states from which a job may move to ``to``."""
    return frozenset(s for s, nexts in TRANSITIONS.items() if to in nexts)


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


class Forgets(Protocol):
    """Memory kept per job that an ended job no longer needs."""

    def forget(self, job_id: str) -> None: ...


class Jobs:
    """The job life cycle over a store: the one place a job's state changes.

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (StopJob, to stop an ended job's stages).
        specs: each job's decoded spec.
        live_nodes: the live nodes, oldest first (the registry's copy in memory).
        clock: seconds since the epoch.
        ended: told when a job reaches a terminal state, and when (:mod:`.retention`).
        forget: per-job memory dropped when a job ends.
    """

    def __init__(self, store: Store, nodes: NodeCalls, specs: JobSpecs,
                 live_nodes: Callable[[], list[tracker_pb2.NodeInfo]], *,
                 clock: Callable[[], float] = time.time,
                 ended: Callable[[str, float], None] = lambda job_id, when: None,
                 forget: Iterable[Forgets] = ()):
        self.store, self.nodes, self.specs, self.clock = store, nodes, specs, clock
        self.live_nodes = live_nodes
        self._ended, self._forget = ended, (specs, *forget)
        self.changed = threading.Condition()
        """Notified whenever a job or the swarm changes (scheduler and watchers wait on it)."""

    def notify(self) -> None:
        """Wake the scheduler and every watcher."""
        with self.changed:
            self.changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for :meth:`notify`."""
        with self.changed:
            self.changed.wait(timeout)

    # -- the one move ------------------------------------------------------------
    def move(self, job_id: str, state: int, reason: str, *, only_from: set[int] | None = None
             ) -> bool:
        """Move the job to ``state`` with ``reason`` if :data:`TRANSITIONS` allows it from
        its state now (and that state is in ``only_from``, when given); True if it moved.
        The check and the move are one step in the store."""
        allowed = set(sources(state))
        if only_from is not None:
            allowed &= only_from
        if not allowed:
            return False
        now = self.clock()
        moved = self.store.set_state(job_id, state, reason, now, only_from=allowed)
        if moved and state in TERMINAL:
            self._ended(job_id, now)
            for memory in self._forget:
                memory.forget(job_id)
        if moved and state != S.JOB_STATE_FAILED:  # fail() warns
            log.info("job %s %s: %s", job_id, state_name(state), reason)
        return moved

    def fail(self, job_id: str, reason: str, only_from: set[int] | None = None) -> None:
        """Fail the job with ``reason`` (see :meth:`move`) and stop its stages."""
        if self.move(job_id, S.JOB_STATE_FAILED, reason, only_from=only_from):
            log.warning("job %s failed: %s", job_id, reason)
            self.stop_stages(job_id, reason, release=False)
        self.notify()

    def stop_stages(self, job_id: str, reason: str, release: bool,
                    plan: node_pb2.Plan | None = None, before_epoch: int = 0,
                    wait: float | None = None) -> None:
        """Stop the job's stages on the nodes of ``plan`` (default: its current plan);
        with ``before_epoch``, only those of older epochs. The nodes are called one after
        another; with ``wait``, all at once, each on a thread of its own, and this returns
        once they all answered or after ``wait`` seconds, whichever is first."""
        plan = plan if plan is not None else self.store.job(job_id).plan
        request = node_pb2.StopJobRequest(job_id=job_id, reason=reason, release=release,
                                          before_epoch=before_epoch)

        def stop(address: str) -> None:
            try:
                self.nodes.stop_job(address, request)
            except NodeCallError as e:
                log.warning("could not stop job %s on %s: %s", job_id, address, e)

        addresses = sorted(PlanView(plan).addresses())
        if wait is None:
            for address in addresses:
                stop(address)
            return
        threads = [threading.Thread(target=stop, args=(a,), name=f"stop-{job_id}-{a}",
                                    daemon=True) for a in addresses]
        for t in threads:
            t.start()
        until = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, until - time.monotonic()))

    # -- events ---------------------------------------------------------------
    def recover(self) -> None:
        """The tracker (re)started: fail the jobs whose planning or deploy it cut short."""
        for job_id in self.store.jobs_in(S.JOB_STATE_PLANNING, S.JOB_STATE_DEPLOYING):
            self.fail(job_id, RESTARTED)

    def submit(self, request: tracker_pb2.SubmitJobRequest) -> str:
        """Store a new PENDING job; return its id.

        Raises:
            InvalidArgument: see :func:`validate`.
            ResourceExhausted: the job fits no plan over the live nodes' memory
                (:func:`fedpipe.planner.memfit.shortfall`); the message says how
                many more bytes it needs.
        """
        spec = validate(request)
        nodes = self.live_nodes()
        if nodes:
            short, why = memfit.shortfall(model_profile(request.profile), train_config(spec),
                                          cluster_view(nodes, []).nodes)
            if short > 0:
                raise ResourceExhausted(why)
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

    def listed(self, owner: str | None, limit: int = LIST_JOBS) -> list[tracker_pb2.JobInfo]:
        """The ``limit`` newest jobs of ``owner`` (None: everyone's), newest first, each
        without its plan and stage times (``ListJobs``).

        Raises:
            InvalidArgument: ``limit`` is not in 1..:data:`MAX_LIST_JOBS`.
        """
        if not 1 <= limit <= MAX_LIST_JOBS:
            raise InvalidArgument(f"limit must be 1..{MAX_LIST_JOBS}, got {limit}")
        out = list(itertools.islice(newest_jobs(self.store, owner), limit))
        for job in out:
            job.ClearField("plan")
            job.ClearField("stage_times")
        return out

    def cancel(self, job_id: str, reason: str = "", keep_weights: bool = False
               ) -> tracker_pb2.JobInfo:
        """Cancel a job that has not ended; return it. Its stages are stopped and
        released, or with ``keep_weights`` stopped and kept for the retention period
        (a job whose data ran out keeps its finished steps' weights).

        Raises:
            NotFound: no such job.
        """
        self.get(job_id)
        if self.move(job_id, S.JOB_STATE_CANCELLED, reason or "cancelled by the client"):
            self.stop_stages(job_id, "cancelled", release=not keep_weights, wait=CANCEL_WAIT)
            self.notify()
        return self.get(job_id)

    def pending(self) -> list[str]:
        """Ids of PENDING jobs, oldest first."""
        return self.store.jobs_in(S.JOB_STATE_PENDING)

    def recovering(self) -> list[str]:
        """Ids of RECOVERING jobs, oldest first."""
        return self.store.jobs_in(S.JOB_STATE_RECOVERING)

    def expire_pending(self, job_id: str) -> bool:
        """Fail a PENDING job that has waited past its ``pending_timeout``; True if it did."""
        timeout = self.specs.request(job_id).pending_timeout
        if timeout and self.clock() - self.store.job(job_id).created > timeout:
            self.fail(job_id, f"no node registered within {timeout:.0f} s")
            return True
        return False
