"""Whether a client reaches the tracker: said once when it goes, once when it is back.

While no tracker leads (a restart, a failover, a tracker stopped), every call a client
makes on it is retried: its job's watch, the feed's ``GetJob``, :meth:`fedpipe.Job.wait`.
A line per retry would bury the client's log in a long outage; a :class:`TrackerReach`
shared by one client's callers (:attr:`fedpipe.Client.reach`) turns them into two lines:
one when the first call fails, one when a call succeeds again (with how long the
tracker was unreachable). The job's data plane meanwhile trains on
(:mod:`fedpipe.client.feed`).

A tracker that is stopped (SIGSTOP) or cut off refuses nothing: its connection stays
open and a job's watch stream just goes quiet. :class:`SilenceProbe` then asks the
tracker one small question with a short deadline
(:data:`~fedpipe.net.timeouts.TRACKER_PROBE_RPC`); a question that hangs past it says
the same one line as a refused connection, and an answer says it is back.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from ..net import timeouts

log = logging.getLogger("fedpipe.client")


class TrackerReach:
    """One client's word on whether it reaches the tracker. Thread-safe.

    Args:
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the tracker became unreachable (None: it is not)

    @property
    def unreachable(self) -> bool:
        """Whether the last call on the tracker failed and none has succeeded since."""
        return self._since is not None

    def lost(self, error: grpc.RpcError) -> None:
        """A call on the tracker failed with ``error``, which can pass (it is retried):
        the first since the tracker was last reached logs one line; later ones none."""
        with self._lock:
            if self._since is not None:
                return
            self._since = self.clock()
        log.warning("no tracker leads now (%s: %s); the job trains on, and this client waits "
                    "up to LEADER_WAIT=%.0f s for one to lead", error.code().name,
                    error.details(), timeouts.LEADER_WAIT)

    def reached(self) -> None:
        """A call on the tracker succeeded: if it was unreachable, log one line saying
        that it is back and after how long."""
        with self._lock:
            if self._since is None:
                return
            gone, self._since = self.clock() - self._since, None
        log.warning("the tracker is back (unreachable for %.1f s)", gone)


UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""The codes of a tracker that refused a connection, or did not answer within a deadline."""


class SilenceProbe:
    """While a stream from the tracker is open but has said nothing for ``silent`` s, ask
    the tracker a small question (``ask``) with a ``deadline``: one that hangs past it (or
    is refused) is :meth:`TrackerReach.lost`; an answer is :meth:`TrackerReach.reached`.
    Asks at most once per ``silent`` s. :meth:`run` is the body of a daemon thread.

    Args:
        reach: the client's word on reaching the tracker.
        ask: sends the question with a deadline in seconds (``GetJob(..., timeout=)``).
        heard: when the stream last brought something (``time.monotonic()`` seconds).
        live: whether the stream is open (while it is down, its own retries speak).
        stop: set when probing must end.
        silent: seconds of silence before asking (default
            :data:`~fedpipe.net.timeouts.TRACKER_SILENT`).
        deadline: the question's deadline, seconds (default
            :data:`~fedpipe.net.timeouts.TRACKER_PROBE_RPC`).
        clock: seconds, monotonic.
    """

    def __init__(self, reach: TrackerReach, ask: Callable[[float], object],
                 heard: Callable[[], float], live: Callable[[], bool], stop: threading.Event,
                 *, silent: float | None = None, deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.reach, self.ask, self.heard, self.live, self.stop = reach, ask, heard, live, stop
        self.silent = timeouts.TRACKER_SILENT if silent is None else silent
        self.deadline = timeouts.TRACKER_PROBE_RPC if deadline is None else deadline
        self.clock = clock
        self.asked = 0  # questions sent, for tests and logs

    def run(self) -> None:
        answered = self.clock()
        while not self.stop.wait(self.silent / 2):
            if not self.live() or self.clock() - max(self.heard(), answered) < self.silent:
                continue
            self.asked += 1
            try:
                self.ask(self.deadline)
            except grpc.RpcError as e:
                if e.code() in UNREACHABLE and not self.stop.is_set():
                    self.reach.lost(e)
                continue
            answered = self.clock()
            self.reach.reached()
