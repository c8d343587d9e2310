"""Whether a client reaches the tracker: said once when it goes, once when it is back.

While no tracker leads (a restart, a failover, a tracker stopped), every call a client
makes on it is retried: its job's watch, the feed's ``GetJob``, :meth:`fedpipe.Job.wait`.
A line per retry would bury the client's log in a long outage; a :class:`TrackerReach`
shared by one client's callers (:attr:`fedpipe.Client.reach`) turns them into two lines:
one when the first call fails, one when a call succeeds again (with how long the
tracker was unreachable). The job's data plane meanwhile trains on
(:mod:`fedpipe.client.feed`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

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
        log.warning("the tracker is unreachable (%s: %s); the job trains on, and this client "
                    "tries again until a tracker leads", error.code().name, error.details())

    def reached(self) -> None:
        """A call on the tracker succeeded: if it was unreachable, log one line saying
        that it is back and after how long."""
        with self._lock:
            if self._since is None:
                return
            gone, self._since = self.clock() - self._since, None
        log.warning("the tracker is back (unreachable for %.1f s)", gone)
