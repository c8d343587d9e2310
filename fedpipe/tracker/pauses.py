"""Whether this process itself stopped running: a thread that wakes often and notes the gaps.

A tracker that did not run for a while (SIGSTOPped, starved of CPU) heard no heartbeat
and no client meanwhile, so it must not judge them by that time
(:meth:`~.scheduler.Tracker.pardon_pause`). Timing the scheduler's own rounds would take a
round that merely waited (a recovery's LoadStage while its restorer fetches a large
snapshot) for such a pause, and pardon every node, a lost one among them, its lease: the
rest of the tracker ran all along and heard whatever came. So a thread of its own, which
does nothing but wake every :data:`EVERY` seconds, tells the two apart: it stops only when
the whole process does.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

EVERY = 0.25
"""How often the watch wakes, seconds."""
LEAST = 4 * EVERY
"""The shortest gap a pause may be, seconds, whatever ``FEDPIPE_TRACKER_PAUSED`` says: the
watch's own wakes are that far apart."""


class PauseWatch:
    """The longest this process went without running since it was last asked, seconds.

    Args:
        stop: set to end :meth:`run`.
        clock: ``time.monotonic`` or a test's.
    """

    def __init__(self, stop: threading.Event, clock: Callable[[], float] = time.monotonic):
        self._stop, self._clock = stop, clock
        self._lock = threading.Lock()
        self._last = clock()
        self._longest = 0.0

    def note(self) -> None:
        """The watch woke now: the time since its last wake is a gap in its run."""
        with self._lock:  # the clock read inside: two notes never count one gap twice
            now = self._clock()
            self._longest = max(self._longest, now - self._last)
            self._last = now

    def take(self) -> float:
        """The longest gap since the last :meth:`take` (the one running now included),
        seconds; it starts counting again."""
        self.note()
        with self._lock:
            longest, self._longest = self._longest, 0.0
        return longest

    def run(self) -> None:
        """The watch's thread: wake every :data:`EVERY` seconds until ``stop`` is set."""
        while not self._stop.wait(EVERY):
            self.note()
