"""Planning a job, in a worker process so the tracker's GIL stays free for heartbeats.

The planner (:mod:`fedpipe.planner`) is pure Python: over 256 candidate nodes
one plan holds the GIL for about 90 ms. Run on the tracker's scheduler thread,
that is 90 ms in which the gRPC threads answer no heartbeat
(docs/tracker-scale.md). :class:`Planner` runs :func:`plan_job` in one worker
process, started once (``spawn``: the tracker has gRPC threads, which a
``fork`` would copy in an unknown state) and reused for every job; the
scheduler thread waits for the result without the GIL. The arguments and the
plan cross the process boundary pickled: a cluster of 256 nodes and their
links is a few hundred KiB.

Without a worker (``Planner(processes=0)``, the default of an in-process
:class:`~.scheduler.Tracker`, as tests build it) :func:`plan_job` runs on the
caller's thread. A worker that dies (killed, out of memory) fails no job: the
plan is made on the caller's thread and a new worker is started for the next.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool

from .. import planner
from ..planner.protoio import train_config
from ..spec import JobSpec

log = logging.getLogger("fedpipe.tracker")


def plan_job(cluster: planner.ClusterView, profile: planner.ModelProfile, job: JobSpec
             ) -> tuple[planner.Plan, JobSpec]:
    """The plan of ``job`` over ``cluster``, and the job with ``replica_sync="auto"``
    resolved (:func:`~fedpipe.planner.choose_replica_sync`; a job that syncs by DiLoCo is
    planned again, paying the sync once per outer step).

    Raises:
        PlanError: no plan fits (:func:`~fedpipe.planner.make_plan`).
    """
    plan = planner.make_plan(cluster, profile, train_config(job))
    if job.replica_sync == "auto":
        job = job.with_(replica_sync=planner.choose_replica_sync(plan))
        if job.replica_sync == "diloco":
            plan = planner.make_plan(cluster, profile, train_config(job))
    return plan, job


def _orphan_watch(parent: int) -> None:
    """In the worker: exit when the tracker that started it is gone (a tracker killed
    with SIGKILL never shuts its pool down, and the worker would wait forever)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class Planner:
    """Runs :func:`plan_job` in a worker process (or, with ``processes=0``, in-process).

    Args:
        processes: worker processes (0: plan on the caller's thread). One is enough:
            the scheduler plans one job at a time.

    Thread-safe.
    """

    def __init__(self, processes: int = 0):
        self.processes = processes
        self._pool: futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = futures.ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_orphan_watch, initargs=(os.getpid(),))
            return self._pool

    def start(self) -> None:
        """Start the worker now, so the first job does not wait for its start-up (about a
        second of imports); a no-op in-process."""
        if self.processes:
            self._executor().submit(int)

    def plan(self, cluster: planner.ClusterView, profile: planner.ModelProfile, job: JobSpec
             ) -> tuple[planner.Plan, JobSpec]:
        """:func:`plan_job` in the worker; waits for it without holding the GIL.

        Raises:
            PlanError: as :func:`plan_job` (raised in the worker, re-raised here).
        """
        if not self.processes:
            return plan_job(cluster, profile, job)
        pool = self._executor()
        try:
            return pool.submit(plan_job, cluster, profile, job).result()
        except BrokenProcessPool:
            log.warning("the planner's worker process died; planning this job in the tracker "
                        "and starting a new worker")
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False)
            return plan_job(cluster, profile, job)

    def close(self) -> None:
        """Stop the worker (a plan in progress is abandoned)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
