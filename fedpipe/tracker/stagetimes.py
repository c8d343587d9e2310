"""Each stage's recent step split (compute, wait, send seconds) and memory, in memory.

Every stage reports its split with each step; a report per stage per step is too
many for an SQLite write each, so the tracker keeps the last
:data:`STAGE_TIME_WINDOW` of each stage of the job's current plan epoch here, for
the dashboard and ``GetJob`` (:meth:`StageTimes.of`), the calibrated cost model
(:meth:`StageTimes.windows`) and the rebalancer's slow-node check.
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque
from typing import Callable

from ..planner.types import StageTime
from ..proto import tracker_pb2
from ..spec import StageKey

STAGE_TIME_WINDOW = 5
"""Steps over which :meth:`StageTimes.of` takes each stage's median split."""
STAGE_TIME_JOBS = 256
"""Jobs whose stage times are kept in memory (the least recently reported go first)."""

Split = tuple[float, float, float]


class StageTimes:
    """The recent step splits of each job's stages; thread-safe.

    Args:
        epoch_of: the job's current plan epoch (raises ``KeyError`` for an unknown job).
    """

    def __init__(self, epoch_of: Callable[[str], int]):
        self.epoch_of = epoch_of
        # job -> (epoch, stage -> its last STAGE_TIME_WINDOW splits)
        self._times: OrderedDict[str, tuple[int, dict[StageKey, deque[Split]]]] = OrderedDict()
        # job -> stage -> its last (peak, predicted) memory, bytes, of the epoch in _times
        self._memory: dict[str, dict[StageKey, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def record(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """Keep a stage's step split of the job's epoch (one that is not finite and
        non-negative is dropped: a broken clock must not poison the medians), and its
        last reported peak and predicted memory."""
        split = (report.compute_seconds, report.wait_seconds, report.send_seconds)
        if not all(math.isfinite(x) and x >= 0 for x in split):
            return
        with self._lock:
            epoch, stages = self._times.pop(job.job_id, (job.epoch, {}))
            if epoch != job.epoch:  # a recovery replanned: the old stages' times are moot
                epoch, stages = job.epoch, {}
                self._memory.pop(job.job_id, None)
            self._times[job.job_id] = (epoch, stages)  # most recent last
            while len(self._times) > STAGE_TIME_JOBS:
                self._memory.pop(self._times.popitem(last=False)[0], None)
            key = StageKey(report.replica, report.stage)
            stages.setdefault(key, deque(maxlen=STAGE_TIME_WINDOW)).append(split)
            if report.peak_memory_bytes or report.predicted_memory_bytes:
                self._memory.setdefault(job.job_id, {})[key] = (
                    report.peak_memory_bytes, report.predicted_memory_bytes)

    def windows(self, job_id: str, epoch: int) -> dict[StageKey, list[Split]]:
        """Each stage's recent splits in plan epoch ``epoch`` (``{}`` for another epoch)."""
        with self._lock:
            seen, stages = self._times.get(job_id, (epoch, {}))
            return {key: list(w) for key, w in stages.items()} if seen == epoch else {}

    def of(self, job_id: str) -> list[StageTime]:
        """Each stage's step split in the job's current plan epoch: per part, the median
        of its last :data:`STAGE_TIME_WINDOW` reported steps, seconds, with its last
        reported peak and predicted memory, bytes; ordered by replica
        and stage (``[]`` before any report of this epoch, or for a job not seen lately
        or unknown)."""
        try:
            current = self.epoch_of(job_id)
        except KeyError:
            return []
        splits = self.windows(job_id, current)
        with self._lock:
            memory = dict(self._memory.get(job_id, {})) if splits else {}
        out = []
        for key, window in sorted(splits.items()):
            compute, wait, send = (statistics.median(part) for part in zip(*window))
            peak, predicted = memory.get(key, (0, 0))
            out.append(StageTime(key.replica, key.stage, compute, wait, send, peak, predicted))
        return out
