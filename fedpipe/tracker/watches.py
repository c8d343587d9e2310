"""How many WatchJob streams one caller may hold on one job.

A WatchJob stream holds one of the tracker's data-plane threads for as long as
the job runs (:class:`fedpipe.net.DataCallLimit`). A client needs at most two
per job: its feeder's watch and one more for a caller of ``Job.wait`` or
``Job.events``; more are refused, so a client cannot spend its share of the
tracker's threads on one job's watches.
"""
from __future__ import annotations

import threading

WATCHES_PER_JOB = 2
"""The most WatchJob streams one caller may hold on one job at once."""


class WatchSlots:
    """Counts the open watches per (job, caller); thread-safe.

    Args:
        most: watches one caller may hold on one job, >= 1.
    """

    def __init__(self, most: int = WATCHES_PER_JOB):
        if most < 1:
            raise ValueError(f"watches per job must be >= 1, got {most}")
        self.most = most
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], int] = {}

    def take(self, job_id: str, caller: str) -> str | None:
        """Take a watch of ``job_id`` for ``caller``; None, or why it is refused."""
        key = (job_id, caller)
        with self._lock:
            n = self._open.get(key, 0)
            if n >= self.most:
                return (f"WatchJob refused: {caller} already watches job {job_id} with {n} "
                        f"streams, the most one caller may hold on one job "
                        f"(fedpipe.tracker.watches.WATCHES_PER_JOB); close one first")
            self._open[key] = n + 1
            return None

    def give(self, job_id: str, caller: str) -> None:
        """Give back a watch :meth:`take` granted."""
        key = (job_id, caller)
        with self._lock:
            n = self._open[key] - 1
            if n:
                self._open[key] = n
            else:
                del self._open[key]

    def held(self, job_id: str, caller: str) -> int:
        """Watches ``caller`` holds on ``job_id`` now."""
        with self._lock:
            return self._open.get((job_id, caller), 0)
