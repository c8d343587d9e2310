"""What a node keeps of a job: reconciling its holdings with the jobs' plans.

Each heartbeat carries what the node holds (a ``StageRef`` per stage, per job);
the reply says what to drop (:meth:`Retention.reconcile`) and which checkpoint of
each job it must keep (:meth:`Retention.checkpoints`). An ended job's stages keep
their weights for :data:`RETENTION` seconds (``Job.state_dict()`` reads them), then
the nodes are told to free them.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ..proto import tracker_pb2
from ..spec import TERMINAL, WAITING, PlanView, StageKey
from .store import Store

S = tracker_pb2

RETENTION = 600.0
"""Seconds an ended job's stages keep their weights on the nodes (for ``state_dict()``)
unless released sooner; then the nodes are told to free them."""


class Retention:
    """Reconciles nodes' holdings with the jobs (see the module docstring); thread-safe.

    Args:
        store: the tracker's state.
        clock: seconds since the epoch.
        seconds: see :data:`RETENTION` (``fedpipe tracker --retention``).
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time,
                 seconds: float = RETENTION):
        self.store, self.clock, self.seconds = store, clock, seconds
        self._ended: dict[str, float] = {}  # job -> when it reached a terminal state
        self._lock = threading.Lock()

    def ended(self, job_id: str, when: float) -> None:
        """The job reached a terminal state at ``when`` (:meth:`~.jobs.Jobs.move`)."""
        with self._lock:
            self._ended[job_id] = when

    def _ended_at(self, job_id: str, now: float) -> float:
        # a job that ended before a restart counts from the first time a node shows it
        with self._lock:
            return self._ended.setdefault(job_id, now)

    def reconcile(self, node_id: str, holds: list[tracker_pb2.StageRef]
                  ) -> tuple[list[tracker_pb2.StageRef], list[str]]:
        """What a node that holds ``holds`` must drop: ``(stages, jobs)``.

        A stage of an older epoch, or one the job's plan no longer puts on this
        node, is dropped, unless the job is RECOVERING or WAITING (its snapshots may
        be restored from these nodes). Everything of a job that is unknown, or ended
        more than :attr:`seconds` ago, is dropped (a released job's stages are gone
        already).
        """
        stages, jobs = [], set()
        now = self.clock()
        for ref in holds:
            try:
                job = self.store.job(ref.job_id)
            except KeyError:
                jobs.add(ref.job_id)
                continue
            if job.state in TERMINAL:
                if now - self._ended_at(ref.job_id, now) > self.seconds:
                    jobs.add(ref.job_id)
            elif job.state in (S.JOB_STATE_RECOVERING, WAITING) or ref.stage < 0:
                continue
            elif ref.epoch < job.epoch or not _runs(job, node_id, ref):
                stages.append(ref)
        return stages, sorted(jobs)

    def checkpoints(self, holds: list[tracker_pb2.StageRef]) -> dict[str, int]:
        """The last complete checkpoint of each active job in ``holds`` (a node's holdings):
        the node must keep that snapshot, however many newer ones it takes meanwhile."""
        steps = {}
        for job_id in {ref.job_id for ref in holds}:
            try:
                job = self.store.job(job_id)
            except KeyError:
                continue
            if job.state not in TERMINAL:
                steps[job_id] = job.checkpoint_step
        return steps


def _runs(job: tracker_pb2.JobInfo, node_id: str, ref: tracker_pb2.StageRef) -> bool:
    """Whether the job's plan puts stage ``ref`` on ``node_id``."""
    mine = PlanView(job.plan).get(StageKey(ref.replica, ref.stage))
    return mine is not None and mine.node_id == node_id
