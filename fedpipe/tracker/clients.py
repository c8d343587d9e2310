"""Whether a job's client is there: feeders attach by watching, and a job without one waits.

A client that feeds a job holds a ``WatchJob`` stream with ``feeder`` set (an id
it makes up) for as long as it feeds. The stream is the liveness signal: gRPC
ends it at once when the client closes it, and when the client's process dies
(its kernel closes the connection) or its machine goes silent (keepalive pings,
``net.KEEPALIVE_*``). A heartbeat would find a death only a period later and
would cost a call per period; the stream costs one tracker thread per feeding
client.

The rules (:meth:`Feeders.sweep`, run by the scheduler every tick):

- a job that has had a feeder and has none for :data:`~fedpipe.net.timeouts.CLIENT_GRACE`
  seconds while RUNNING is *parked*: WAITING in a new epoch at its last complete
  checkpoint, with the reason "waiting for the client", its stages stopped
  (:meth:`~.recovery.Recovery.park`);
- a job without a feeder for its ``client_timeout`` (measured from when the last
  feeder left) fails, whatever its state;
- a feeder that attaches to a WAITING job brings it back (RECOVERING, then RUNNING
  at the checkpoint); one that *takes over* (``take_over``, :meth:`fedpipe.Job.resume`)
  rewinds a running job to its last complete checkpoint in a new epoch, so no
  step is fed twice, and becomes the job's only feeder (``JobInfo.feeder``):
  an older client still alive sees that and stops feeding.

Which feeder a job has is kept in memory. After a tracker restart every
non-terminal job counts as having lost its feeder at start-up, with
:data:`~fedpipe.net.timeouts.CLIENT_REATTACH` seconds to watch again, and a
WAITING job waits a full ``client_timeout`` again. A job no feeder ever attached to
(its client died between SubmitJob and its first watch, or it was submitted by hand
over gRPC) is not parked, but it fails once ``client_timeout`` has passed since its
submission, so it cannot hold nodes and one of its owner's job slots for ever.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from ..net import timeouts
from ..proto import tracker_pb2
from ..spec import TERMINAL, WAITING, state_name
from .errors import FailedPrecondition
from .jobs import Jobs
from .specs import JobSpecs

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2


class Leases(Protocol):
    """What the client's absence and return do to a job (:class:`~.recovery.Recovery`)."""

    def park(self, job_id: str, why: str) -> None: ...

    def rewind_for_client(self, job_id: str, why: str, rewind_to: int | None = None,
                          restored: bool = False) -> None: ...


class Feeders:
    """Who feeds each job, and what happens to a job whose feeder left.

    Thread-safe: servicer threads attach and detach, the scheduler sweeps.

    Args:
        jobs: the job life cycle (fails jobs).
        leases: parks and rewinds jobs for their client (:mod:`.recovery`).
        specs: each job's decoded spec (its ``client_timeout``).
        clock: seconds since the epoch (the same clock as ``jobs``).
        grace: seconds a running job may lack a feeder before it is parked.
        reattach: after start-up, seconds before jobs without a feeder are parked.
    """

    def __init__(self, jobs: Jobs, leases: Leases, specs: JobSpecs,
                 clock: Callable[[], float] = time.time, *,
                 grace: float = timeouts.CLIENT_GRACE,
                 reattach: float = timeouts.CLIENT_REATTACH):
        self.jobs, self.leases, self.specs = jobs, leases, specs
        self.clock, self.grace = clock, grace
        self._lock = threading.Lock()
        self._feeder: dict[str, str] = {}   # job -> the feeder attached now
        self._gone: dict[str, float] = {}   # job -> when its last feeder left (armed jobs)
        self._unfed: dict[str, float] = {}  # job -> when it was submitted, until a feeder comes
        now = clock()
        for job_id in jobs.store.jobs_in(S.JOB_STATE_PENDING, S.JOB_STATE_PLANNING,
                                         S.JOB_STATE_DEPLOYING, S.JOB_STATE_RUNNING,
                                         S.JOB_STATE_RECOVERING, WAITING):
            # counted as gone at start-up, with ``reattach`` seconds instead of ``grace``
            self._gone[job_id] = now + max(0.0, reattach - grace)

    def feeder(self, job_id: str) -> str:
        """The id of the feeder attached to ``job_id`` now ("" if none)."""
        with self._lock:
            return self._feeder.get(job_id, "")

    def attach(self, job_id: str, feeder: str, take_over: bool) -> None:
        """``feeder`` watches ``job_id`` to feed it (its stream just opened).

        Raises:
            NotFound: no such job.
            FailedPrecondition: another feeder is attached and this one does not
                take over (a client the job was taken from keeps trying); or this one
                takes over a job that has ended (nothing is left to feed).
        """
        job = self.jobs.get(job_id)
        if take_over and job.state in TERMINAL:
            because = f" ({job.reason})" if job.reason else ""
            raise FailedPrecondition(f"job {job_id} has ended {state_name(job.state)}"
                                     f"{because}; an ended job cannot be resumed")
        with self._lock:
            current = self._feeder.get(job_id, "")
            if current and current != feeder and not take_over:
                raise FailedPrecondition(f"job {job_id} is fed by another client now "
                                         f"(it took the job over)")
        # rewind first, then name the feeder: a feeder feeds only once JobInfo.feeder
        # names it, so it never feeds the epoch it took the job from
        if take_over:
            log.info("job %s taken over by a client at step %d", job_id, job.step)
            self.leases.rewind_for_client(job_id, "a client took the job over (Job.resume)")
        elif job.state == WAITING:
            log.info("job %s: its client is back", job_id)
            self.leases.rewind_for_client(job_id, "the client is back")
        with self._lock:
            self._feeder[job_id] = feeder
            self._gone.pop(job_id, None)
            self._unfed.pop(job_id, None)

    def submitted(self, job_id: str) -> None:
        """``job_id`` was just submitted: it fails unless a feeder attaches within its
        ``client_timeout``."""
        with self._lock:
            if job_id not in self._feeder:
                self._unfed[job_id] = self.clock()

    def detach(self, job_id: str, feeder: str) -> None:
        """``feeder``'s stream ended (closed, the client died, or its link did)."""
        with self._lock:
            if self._feeder.get(job_id) != feeder:
                return  # replaced by a feeder that took over
            del self._feeder[job_id]
            self._gone[job_id] = self.clock()
        self.jobs.notify()

    def renew_gone(self) -> None:
        """Count every feeder gone as gone from now: the tracker did not run for a while
        (:meth:`~.scheduler.Tracker.pardon_pause`), and a client may have tried to come
        back meanwhile."""
        now = self.clock()
        with self._lock:
            for job_id in self._gone:
                self._gone[job_id] = max(self._gone[job_id], now)

    def sweep(self) -> None:
        """Park the running jobs whose feeder is gone past the grace, and fail those
        whose feeder is gone past their ``client_timeout``."""
        now = self.clock()
        with self._lock:
            gone, unfed = dict(self._gone), dict(self._unfed)
        for job_id, since in unfed.items():
            try:
                job = self.jobs.get(job_id)
                timeout = self.specs.job(job_id).client_timeout
            except Exception:  # noqa: BLE001 — a job deleted under us: forget it
                job = None
            if job is None or job.state in TERMINAL:
                with self._lock:
                    self._unfed.pop(job_id, None)
            elif now - since > timeout:
                self.jobs.fail(
                    job_id, f"no client watched the job to feed it within its client_timeout "
                            f"of {timeout:.0f} s after its submission", only_from={job.state})
        for job_id, since in gone.items():
            try:
                job = self.jobs.get(job_id)
            except Exception:  # noqa: BLE001 — a job deleted under us: forget it
                job = None
            if job is None or job.state in TERMINAL:
                with self._lock:
                    self._gone.pop(job_id, None)
                continue
            timeout = self.specs.job(job_id).client_timeout
            if now - since > timeout:
                waited = now - since
                self.jobs.fail(
                    job_id, f"the client did not come back within its client_timeout of "
                            f"{timeout:.0f} s (gone for {waited:.0f} s, the job was "
                            f"{state_name(job.state)})", only_from={job.state})
            elif job.state == S.JOB_STATE_RUNNING and now - since > self.grace:
                # the time left is shown when the job is read (shown()), not frozen here
                self.leases.park(job_id, f"waiting for the client (gone since step {job.step}; "
                                       f"client_timeout {timeout:.0f} s)")

    def left(self, job_id: str) -> float | None:
        """Seconds before ``job_id`` fails for want of a client (its ``client_timeout`` from
        when its last feeder left, or from its submission if none came); None while a
        feeder is attached."""
        with self._lock:
            since = self._gone.get(job_id, self._unfed.get(job_id))
        if since is None:
            return None
        timeout = self.specs.job(job_id).client_timeout
        return max(0.0, since + timeout - self.clock())

    def shown(self, job: tracker_pb2.JobInfo) -> tracker_pb2.JobInfo:
        """``job`` as GetJob and the dashboard show it: a WAITING job's reason ends with the
        seconds it has left, counted now (:meth:`left`)."""
        if job.state == WAITING:
            left = self.left(job.job_id)
            if left is not None:
                job.reason += f"; the job fails in {left:.0f} s unless a client resumes it"
        return job
