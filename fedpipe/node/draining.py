"""When a draining node may exit: its drain's clock counts only while a tracker leads.

A node drains (SIGTERM, ``fedpipe drain``) by asking the tracker to move its stages to
other nodes; it exits once the tracker says no job needs it, or after its
``--drain-timeout``. Only a leading tracker can move stages, so while none leads (a
failover, a restart, a tracker SIGSTOPped) the node waits for one, as training does: its
stages train on, and the time without a leader is not counted against the drain's
timeout. If no tracker leads for :data:`~fedpipe.net.timeouts.LEADER_WAIT` s the node
exits anyway, saying so (its stages then recover as lost, once a tracker leads).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ..net import timeouts


class DrainClock:
    """A draining node's clock: seconds counted while a tracker leads, and the leaderless
    window measured apart; thread-safe.

    Args:
        timeout: the drain's ``--drain-timeout``, seconds counted while a tracker leads.
        leader_wait: the longest leaderless window the drain waits out, seconds
            (default :data:`~fedpipe.net.timeouts.LEADER_WAIT`, read at construction).
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, timeout: float, leader_wait: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.leader_wait = timeouts.LEADER_WAIT if leader_wait is None else leader_wait
        self.clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._leaderless_since: float | None = None  # None: a tracker was reached last
        self._leaderless_total = 0.0  # seconds of the drain's closed leaderless windows

    def start(self) -> None:
        """The drain begins now (a second start is ignored)."""
        with self._lock:
            if self._started is None:
                self._started = self.clock()

    def unreachable(self) -> None:
        """A call on the tracker found none leading (UNAVAILABLE, DEADLINE_EXCEEDED): a
        leaderless window opens, unless one is open already."""
        with self._lock:
            if self._leaderless_since is None:
                self._leaderless_since = self.clock()

    def reached(self) -> None:
        """A call on the tracker was answered: the leaderless window (if any) closes."""
        with self._lock:
            if self._leaderless_since is not None:
                if self._started is not None:
                    self._leaderless_total += self.clock() - max(self._leaderless_since,
                                                                 self._started)
                self._leaderless_since = None

    def over(self) -> str | None:
        """Why the draining node must exit now, or None while it waits on.

        It must once ``timeout`` s have passed while a tracker led since the drain began,
        or once the window without a leader has lasted ``leader_wait`` s."""
        with self._lock:
            if self._started is None:
                return None
            now = self.clock()
            open_window = 0.0
            if self._leaderless_since is not None:
                open_window = now - max(self._leaderless_since, self._started)
                if now - self._leaderless_since >= self.leader_wait:
                    return (f"no tracker led within LEADER_WAIT={self.leader_wait:.0f} s to "
                            f"move this node's stages; exiting anyway (its stages recover "
                            f"from their checkpoints once a tracker leads; set "
                            f"FEDPIPE_LEADER_WAIT to wait longer)")
            counted = now - self._started - self._leaderless_total - open_window
            if counted > self.timeout:
                return f"the drain timed out after {self.timeout:.0f} s; exiting anyway"
            return None
