"""The tracker's domain assembled, and its two background loops.

:class:`Tracker` builds the :class:`~.registry.Registry` and the
:class:`~.jobs.Jobs` life cycle over one store, and runs:

- the scheduler: every ``min(TICK, lease/4)`` seconds, or sooner when something
  changes, it expires leases, fails PENDING jobs past their timeout, and
  plans and deploys PENDING jobs once the links of newly joined nodes are
  measured (or ``link_wait`` has passed);
- the link measurer: measures every link when nodes join and every
  ``link_refresh`` seconds.

:meth:`Tracker.tick` and :meth:`Tracker.measure_links` are one round of each,
so tests can drive them without threads.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..net import timeouts
from ..planner.protoio import unmeasured
from .jobs import Jobs
from .links import measure_links
from .nodes import NodeCalls
from .registry import Registry
from .store import Store

log = logging.getLogger("fedpipe.tracker")

TICK = 1.0
"""Longest pause between scheduler rounds, seconds (it also runs at once on every change,
and at least 4 times per lease so an expired lease is noticed within a quarter of it)."""


class Tracker:
    """The tracker's domain: registry, jobs, scheduler and link measurer over one store.

    Args:
        store: the tracker's state.
        nodes: how to reach nodes.
        lease: seconds a node may go without a heartbeat before it is lost.
        link_refresh: seconds between re-measurements of every link (0: only
            when nodes join).
        link_wait: seconds a job waits for the links of newly joined nodes to
            be measured before it is planned with default figures.
        clock: seconds since the epoch.
        background: start the scheduler and link-measurer threads (False:
            the caller drives :meth:`tick` and :meth:`measure_links`).
    """

    def __init__(self, store: Store, nodes: NodeCalls, *, lease: float = 10.0,
                 link_refresh: float = 300.0, link_wait: float = 30.0,
                 clock: Callable[[], float] = time.time, background: bool = True):
        self.store, self.nodes, self.clock = store, nodes, clock
        self.lease, self.link_refresh, self.link_wait = lease, link_refresh, link_wait
        self.jobs = Jobs(store, nodes, clock)
        self.registry = Registry(store, lease, self.jobs.nodes_lost, clock)
        self.jobs.declare_lost = self.registry.declare_lost
        self.stop_event = threading.Event()
        self.measure_now = threading.Event()
        # nodes that were live when the tracker stopped get a fresh lease, not a lost verdict
        store.renew_all(clock())
        self.jobs.recover()
        self.threads: list[threading.Thread] = []
        if background:
            self.threads = [threading.Thread(target=self._scheduler, name="scheduler",
                                             daemon=True),
                            threading.Thread(target=self._measurer, name="links", daemon=True)]
            for th in self.threads:
                th.start()

    def register(self, request) -> str:
        """Register a node (see :meth:`~.registry.Registry.register`, which says what it
        raises); measure links now, and let the scheduler look again. Returns its node id."""
        node_id = self.registry.register(request)
        self.measure_now.set()
        self.jobs.notify()
        return node_id

    def close(self) -> None:
        """Stop the background loops (waiting up to ``THREAD_JOIN`` seconds for each), then
        close ``nodes`` if it has a ``close()``. The store stays open: its opener closes it."""
        self.stop_event.set()
        self.measure_now.set()
        self.jobs.notify()
        for th in self.threads:
            th.join(timeout=timeouts.THREAD_JOIN)
        close = getattr(self.nodes, "close", None)
        if close is not None:
            close()

    # -- scheduler ------------------------------------------------------------
    def tick(self) -> None:
        """One scheduler round: expire leases, go on recovering each RECOVERING job, then
        time out, wait or start each PENDING job."""
        self.registry.expire()
        for job_id in self.jobs.recovering():
            self.jobs.resume(job_id, self.store.nodes())
        for job_id in self.jobs.pending():
            nodes = self.store.nodes()
            if not nodes:
                self.jobs.expire_pending(job_id)
                continue
            links = self.store.links()
            if unmeasured(nodes, links) and \
                    self.clock() - self.jobs.get(job_id).created < self.link_wait:
                continue  # the links of nodes that just joined are being measured
            self.jobs.start(job_id, nodes, links)

    def _scheduler(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 — keep scheduling whatever one job did
                log.exception("scheduler error")
            self.jobs.wait(min(TICK, self.lease / 4))

    # -- links ----------------------------------------------------------------
    def measure_links(self) -> None:
        """Measure every link between live nodes once (see :func:`~.links.measure_links`)."""
        measure_links(self.store, self.nodes)
        self.jobs.notify()

    def _measurer(self) -> None:
        self.measure_now.set()
        while not self.stop_event.is_set():
            self.measure_now.wait(self.link_refresh or None)
            self.measure_now.clear()
            if self.stop_event.is_set():
                return
            try:
                self.measure_links()
            except Exception:  # noqa: BLE001 — try again at the next trigger
                log.exception("link measurement failed")
