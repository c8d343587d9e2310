"""A feeding client's one source of its job's state: the feeder's watch.

While a client feeds a job it holds one ``WatchJob`` stream with ``feeder`` set:
the tracker's sign that the client is there (:mod:`fedpipe.tracker.clients`).
The same stream tells the client how the job moves: each event carries the
job's state, its plan epoch and any checkpoint that completed. The feed waits
on those events (:meth:`JobWatch.await_epoch`, :meth:`JobWatch.wait_event`);
it asks ``GetJob`` only for what an event does not carry (the plan, the resume
step, the feeder the tracker names) when an event says the job moved, and polls
``GetJob`` only while the stream is down (the fallback).

What is retried and what is raised (:data:`RETRYABLE`): a call that failed for a
reason that can pass (the tracker restarting, a dropped link) is made again;
any other refusal (PERMISSION_DENIED: another client's job; NOT_FOUND;
RESOURCE_EXHAUSTED: too many watches) ends the watch and is raised to the
caller: at once by :meth:`JobWatch.open`, which :meth:`fedpipe.Job.resume` calls
before any thread starts, and later from :meth:`fedpipe.Job.wait` (kept in
:attr:`JobWatch.error`). FAILED_PRECONDITION on a re-watch means another client
took the job over: the watch ends and marks itself :attr:`~JobWatch.superseded`.

While the tracker is unreachable the retries say so once and once when it is back
(:class:`~.reach.TrackerReach`), and the feed goes on from what the events last said
(:meth:`JobWatch.known`), asking the tracker nothing it can do without.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import grpc

from .. import net
from ..net import timeouts
from ..proto import tracker_pb2 as S
from ..spec import TERMINAL
from .reach import SilenceProbe, TrackerReach

log = logging.getLogger("fedpipe.client")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})
"""Tracker refusals that can pass (it restarts, a link drops, a race it resolves): the
watch and its ``GetJob`` fallback try again. Any other code is raised to the caller."""
LIVE_RECHECK = 1.0
"""Seconds a waiter on a live stream waits for an event before it asks ``GetJob`` anyway:
the feeder the tracker names changes with no event of its own (a re-watch attaching)."""


@dataclass(frozen=True)
class Known:
    """What the tracker last said of the job (its events, or a ``GetJob``), asking nothing.

    Attributes:
        state: the job's state (``JOB_STATE_*``; 0 before any word).
        epoch: its plan epoch.
        checkpoint_step: its newest complete checkpoint's step (0: none).
        heard: when the tracker last said anything of the job (an event of any kind,
            a step's included, or a ``GetJob`` answer), seconds (``time.monotonic``).
    """

    state: int = 0
    epoch: int = 0
    checkpoint_step: int = 0
    heard: float = 0.0


class NoLeader(RuntimeError):
    """No tracker led within :data:`~fedpipe.net.timeouts.LEADER_WAIT` while the feed
    waited for something only a leader does (its job's recovery); the message says what."""


class Halted(Exception):
    """The feed must stop: its client closed, the watch ended on a refusal, or another
    client took the job over (:attr:`JobWatch.superseded`)."""


class EventStream(Protocol):
    """A ``WatchJob`` call: the job's events, and a way to end the stream early."""

    def __iter__(self) -> Iterator[S.JobEvent]: ...

    def __next__(self) -> S.JobEvent: ...

    def cancel(self) -> bool: ...


class WatchTracker(Protocol):
    """The tracker calls the watch makes (a ``TrackerStub``, or a fake in tests)."""

    def WatchJob(self, request: S.WatchJobRequest) -> EventStream: ...

    def GetJob(self, request: S.GetJobRequest, timeout: float | None = None) -> S.JobInfo: ...


class JobWatch:
    """The feeder's watch of one job (module docstring), and the state the feed reads.

    Thread-safe: the watch thread (:meth:`run`) records events; the feed thread waits
    on them; :meth:`halt` may come from any thread.

    Args:
        tracker: the tracker's stub.
        job_id: the job.
        feeder_id: this feed's id (``WatchJobRequest.feeder``; the tracker names it
            in ``JobInfo.feeder`` once the watch is attached).
        take_over: take the job over from another feeder (:meth:`fedpipe.Job.resume`):
            only the first attach does; a re-watch after losing the tracker does not.
        on_event: called on the watch thread with each event (keeps checkpoints).
        halted: set when the feed must stop (shared with the feed and the client).
        reach: says once that the tracker is unreachable and once that it is back
            (the client's, shared by its callers; default: this watch's own).
    """

    def __init__(self, tracker: WatchTracker, job_id: str, feeder_id: str, *,
                 take_over: bool = False,
                 on_event: Callable[[S.JobEvent], None] | None = None,
                 halted: threading.Event | None = None,
                 reach: TrackerReach | None = None):
        self.tracker, self.job_id, self.feeder_id = tracker, job_id, feeder_id
        self.halted = halted if halted is not None else threading.Event()
        self.error: grpc.RpcError | None = None  # the refusal that ended the watch
        self.superseded = False  # another client took the job over
        self._take_over, self._on_event = take_over, on_event
        self.reach = reach if reach is not None else TrackerReach()
        self._known = Known(heard=time.monotonic())
        self._changed = threading.Condition()
        self._seq = 0  # the last event seen
        self._version = 0  # grows at every state or checkpoint event and stream change
        self._started = False  # the job ran (or ended): the feed may begin
        self._call: EventStream | None = None  # the open stream, None while it is down
        self._first: list[S.JobEvent] = []  # events read by open(), given to run()
        self._ended = False  # the stream open() read ended: the job is over

    # -- the stream ---------------------------------------------------------
    @property
    def live(self) -> bool:
        """Whether the stream is open (its events will wake the waiters)."""
        return self._call is not None

    def open(self) -> None:
        """Open the stream and read its first event, on the caller's thread, so that a
        refusal is raised before any thread starts. A failure that can pass
        (:data:`RETRYABLE`) is left to :meth:`run`, which watches again.

        Raises:
            grpc.RpcError: the tracker refused the watch (PERMISSION_DENIED, NOT_FOUND,
                RESOURCE_EXHAUSTED, FAILED_PRECONDITION: ...).
        """
        call = self._connect()
        try:
            self._first.append(next(call))
        except StopIteration:
            self._record_end()
            self._ended = True
        except grpc.RpcError as e:
            self._call = None
            if e.code() not in RETRYABLE:
                self._stop(e)
                raise

    def run(self) -> None:
        """Hold the stream until the job ends or the feed halts; watch again after a
        failure that can pass; end on any other (kept in :attr:`error`). The body of
        the watch thread. Meanwhile a :class:`~.reach.SilenceProbe` asks the tracker
        about the job when the stream goes quiet (a stopped tracker refuses nothing)."""
        done = threading.Event()
        probe = SilenceProbe(
            self.reach, lambda deadline: self.tracker.GetJob(
                S.GetJobRequest(job_id=self.job_id), timeout=deadline),
            lambda: self.known().heard, lambda: self.live, done)
        threading.Thread(target=probe.run, name="watch-probe", daemon=True).start()
        try:
            self._hold()
        finally:
            done.set()

    def _hold(self) -> None:
        while not self.halted.is_set() and not self._ended:
            call = self._call or self._connect()
            if self.halted.is_set():
                call.cancel()
                return
            try:
                for ev in self._events(call):
                    self._record(ev)
                self._record_end()
                return  # the job ended
            except grpc.RpcError as e:
                self._call = None
                if self.halted.is_set():
                    return
                if e.code() not in RETRYABLE:
                    self._stop(e)
                    return
                self.reach.lost(e)  # one line while it lasts, not one per try
                self._notify()  # the stream is down: waiters fall back to polling
                self.halted.wait(timeouts.WATCH_RESUME)

    def halt(self) -> None:
        """End the stream and wake every waiter (the client closes, or the feed ended)."""
        self.halted.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._notify()

    def _connect(self) -> EventStream:
        call = self.tracker.WatchJob(S.WatchJobRequest(
            job_id=self.job_id, after_seq=self._seq, feeder=self.feeder_id,
            take_over=self._take_over))
        self._call = call
        return call

    def _events(self, call: EventStream) -> Iterator[S.JobEvent]:
        while self._first:
            yield self._first.pop(0)
        yield from call

    def _record(self, ev: S.JobEvent) -> None:
        self.reach.reached()
        with self._changed:
            self._seq, self._take_over = ev.seq, False  # attached: a re-watch takes nothing over
            k = self._known
            self._known = Known(ev.state or k.state, max(ev.epoch, k.epoch),
                                max(ev.checkpoint_step, k.checkpoint_step), time.monotonic())
            if ev.state == S.JOB_STATE_RUNNING or ev.state in TERMINAL:
                self._started = True
            if not ev.step or ev.checkpoint_step:  # a step's own event changes no wait
                self._version += 1
                self._changed.notify_all()
        if self._on_event is not None:
            self._on_event(ev)

    def _record_end(self) -> None:
        with self._changed:
            self._call, self._started = None, True
            self._version += 1
            self._changed.notify_all()

    def _stop(self, error: grpc.RpcError) -> None:
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION:  # taken over
            log.warning("job %s: %s; this client stops feeding it", self.job_id,
                        error.details())
            self.superseded = True
        else:
            log.error("job %s: the tracker refused to watch it (%s: %s)", self.job_id,
                      error.code().name, error.details())
            self.error = error
        self.halt()

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    # -- what the feed waits for -------------------------------------------
    def wait_started(self) -> None:
        """Wait until the watch has seen the job run (or end).

        Raises:
            Halted: the feed must stop.
        """
        with self._changed:
            self._changed.wait_for(lambda: self._started or self.halted.is_set())
        if self.halted.is_set():
            raise Halted

    def wait_event(self, poll: float) -> None:
        """Wait for the next state change or complete checkpoint (not a mere step), at
        most :data:`LIVE_RECHECK` s, or ``poll`` s while the stream is down."""
        with self._changed:
            self._wait_change(self._version, poll)

    def info(self, deadline: float | None = None) -> S.JobInfo:
        """The job's info; while the tracker is unreachable (restarting), ask again until
        it answers, at most :data:`~fedpipe.net.timeouts.RECONNECT_BACKOFF_MAX` apart, so
        the feed goes on as soon as the tracker is back.

        With ``deadline`` (``time.monotonic()`` seconds), ask until then only.

        Raises:
            grpc.RpcError: a refusal that cannot pass (not :data:`RETRYABLE`), or any
                once the feed halted.
            NoLeader: ``deadline`` passed with no answer (no tracker leads).
        """
        def stop() -> bool:
            return self.halted.is_set() or (deadline is not None and
                                            time.monotonic() > deadline)
        try:
            info = net.retry(lambda: self.tracker.GetJob(S.GetJobRequest(job_id=self.job_id),
                                                         timeout=timeouts.CONTROL_RPC),
                             f"asking the tracker about job {self.job_id}", codes=RETRYABLE,
                             max_delay=timeouts.RECONNECT_BACKOFF_MAX, stop=stop,
                             on_retry=self.reach.lost)
        except grpc.RpcError as e:
            if self.halted.is_set() or e.code() not in RETRYABLE:
                raise
            raise NoLeader(f"no tracker led within LEADER_WAIT={timeouts.LEADER_WAIT:.0f} s "
                           f"while job {self.job_id} waited for its recovery "
                           f"({e.code().name}: {e.details()}); set FEDPIPE_LEADER_WAIT to "
                           f"wait longer") from None
        self.reach.reached()
        with self._changed:
            self._known = Known(info.state, info.epoch, info.checkpoint_step, time.monotonic())
        return info

    def known(self) -> Known:
        """What the tracker last said of the job (:class:`Known`), without asking it."""
        with self._changed:
            return self._known

    def await_epoch(self, after: int, poll: float, deadline: float | None = None
                    ) -> S.JobInfo | None:
        """Wait until the job RUNS in an epoch newer than ``after`` (a recovery ended) on
        that epoch's plan, with this feed as its feeder; None if it ends first. Wakes on
        each state or checkpoint event (steps' events change nothing it waits for);
        looks every ``poll`` seconds only while the stream is down. With ``deadline``
        (``time.monotonic()`` seconds), the tracker must answer by then.

        Raises:
            Halted: the feed must stop, or another client took the job over.
            NoLeader: the tracker did not answer by ``deadline``.
        """
        while not self.halted.is_set():
            with self._changed:
                seen = self._version
            info = self.info(deadline)
            if info.state in TERMINAL:
                return None
            if info.feeder and info.feeder != self.feeder_id:
                self.superseded = True  # another client took the job over
                raise Halted
            if info.feeder == self.feeder_id and info.state == S.JOB_STATE_RUNNING \
                    and info.epoch > after and info.plan.epoch == info.epoch:
                return info
            with self._changed:  # nothing new since that look: wait for the next
                self._wait_change(seen, poll)
        raise Halted

    def _wait_change(self, seen: int, poll: float) -> None:
        """Under the lock: wait until ``_version`` moves past ``seen`` or the feed halts,
        at most :data:`LIVE_RECHECK` s on a live stream, ``poll`` s on a dead one."""
        self._changed.wait_for(lambda: self._version != seen or self.halted.is_set(),
                               timeout=LIVE_RECHECK if self.live else poll)
