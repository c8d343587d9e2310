"""What the tracker counts in memory as a job's reports arrive.

- each step's reports, by replica group, until every group that takes part has
  reported it (:meth:`Tallies.add_step`);
- each checkpoint's acknowledgements, by stage, until every stage has one
  (:meth:`Tallies.ack`);
- the job's last few complete checkpoints (:meth:`Tallies.completed`), which a
  recovery falls back on when the newest snapshot did not survive.

A new plan epoch (:mod:`.recovery`) clears the counts of the old one; a job that
ends is forgotten. A restarted tracker, or one that took over from a leader, starts
afresh: the store keeps the job's last complete checkpoint, which is what a recovery
rewinds to, and the nodes' heartbeats say again which snapshots newer than that they
acknowledged (``StageRef.acked``, :meth:`.progress.Progress.held`), so a checkpoint
half acknowledged to the tracker before completes under the next.
"""
from __future__ import annotations

import threading

from ..proto import tracker_pb2
from ..spec import StageKey

KEPT_CHECKPOINTS = 4
"""Complete checkpoints remembered per job (the nodes keep the snapshots of two)."""


class Tallies:
    """Per-job counts of step reports and checkpoint acknowledgements; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, int], dict[int, tracker_pb2.StageReport]] = {}
        self._acks: dict[tuple[str, int, int], set[StageKey]] = {}  # (job, epoch, step)
        self._complete: dict[str, list[int]] = {}  # job -> complete checkpoints, newest last

    def add_step(self, job_id: str, report: tracker_pb2.StageReport, groups: int
                 ) -> list[tracker_pb2.StageReport] | None:
        """Add one replica group's report of ``report.step`` (a group's report sent twice
        counts once); the step's reports, one per group, once ``groups`` have reported,
        else None."""
        with self._lock:
            parts = self._steps.setdefault((job_id, report.step), {})
            parts[report.replica] = report
            if len(parts) < groups:
                return None
            del self._steps[(job_id, report.step)]
        return list(parts.values())

    def ack(self, job_id: str, epoch: int, step: int, key: StageKey, needed: int) -> bool:
        """Stage ``key`` acknowledged its snapshot of ``step``; True (once, and the count is
        dropped) when ``needed`` stages have."""
        with self._lock:
            acks = self._acks.setdefault((job_id, epoch, step), set())
            acks.add(key)
            if len(acks) < needed:
                return False
            del self._acks[(job_id, epoch, step)]
            return True

    def completed(self, job_id: str, step: int) -> None:
        """``step`` is a complete checkpoint of the job."""
        with self._lock:
            done = self._complete.setdefault(job_id, [])
            done[:] = (done + [step])[-KEPT_CHECKPOINTS:]

    def complete(self, job_id: str) -> list[int]:
        """The job's complete checkpoints remembered, oldest first."""
        with self._lock:
            return list(self._complete.get(job_id, []))

    def new_epoch(self, job_id: str, *, restored: int | None = None,
                  rewound: int | None = None) -> None:
        """The job begins a new plan epoch: its step reports and acknowledgements are moot.
        With ``restored``, that step (a checkpoint the client put on the nodes) is its only
        complete checkpoint; with ``rewound``, the checkpoints from that step on are gone."""
        with self._lock:
            self._steps = {k: v for k, v in self._steps.items() if k[0] != job_id}
            self._acks = {k: v for k, v in self._acks.items() if k[0] != job_id}
            if restored is not None:
                self._complete[job_id] = [restored]
            elif rewound is not None:
                self._complete[job_id] = [k for k in self._complete.get(job_id, [])
                                          if k < rewound]

    def forget(self, job_id: str) -> None:
        """The job ended."""
        with self._lock:
            self._steps = {k: v for k, v in self._steps.items() if k[0] != job_id}
            self._acks = {k: v for k, v in self._acks.items() if k[0] != job_id}
            self._complete.pop(job_id, None)
