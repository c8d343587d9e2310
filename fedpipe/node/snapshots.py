"""The checkpoint snapshots a node keeps: its own stages' and those it keeps as a buddy."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..runtime.checkpoint import Snapshot
from ..spec import SNAPSHOTS_KEPT, StageKey


class SnapshotStore:
    """Snapshots by ``(job_id, StageKey)`` and step, the newest
    :data:`~fedpipe.spec.SNAPSHOTS_KEPT` of each stage.

    Thread-safe. Own snapshots and buddy copies live side by side: a stage
    restored on this node finds either.
    """

    def __init__(self, keep: int = SNAPSHOTS_KEPT):
        self.keep = keep
        self._snaps: dict[tuple[str, StageKey], OrderedDict[int, Snapshot]] = {}
        self._lock = threading.Lock()

    def put(self, job_id: str, key: StageKey, snap: Snapshot) -> None:
        """Keep ``snap``; the oldest of the stage's snapshots beyond :attr:`keep` is dropped."""
        with self._lock:
            steps = self._snaps.setdefault((job_id, key), OrderedDict())
            steps[snap.step] = snap
            steps.move_to_end(snap.step)
            while len(steps) > self.keep:
                steps.popitem(last=False)

    def get(self, job_id: str, key: StageKey, step: int) -> Snapshot | None:
        """The snapshot of stage ``key`` at ``step``, or None."""
        with self._lock:
            return self._snaps.get((job_id, key), {}).get(step)

    def steps(self, job_id: str, key: StageKey) -> list[int]:
        """The steps held for stage ``key``, oldest first."""
        with self._lock:
            return list(self._snaps.get((job_id, key), ()))

    def room(self, job_id: str, key: StageKey, budget: int) -> int:
        """Bytes one more snapshot of stage ``key`` may take while ``job_id``'s kept
        snapshots stay within ``budget`` bytes (the one that snapshot would push out,
        the stage's oldest when :attr:`keep` are kept, does not count); 0 at or past it."""
        with self._lock:
            held = sum(s.nbytes for (job, _), steps in self._snaps.items() if job == job_id
                       for s in steps.values())
            steps = self._snaps.get((job_id, key), OrderedDict())
            if len(steps) >= self.keep:
                held -= next(iter(steps.values())).nbytes
        return max(0, budget - held)

    def drop_job(self, job_id: str) -> None:
        """Forget every snapshot of ``job_id``."""
        with self._lock:
            for k in [k for k in self._snaps if k[0] == job_id]:
                del self._snaps[k]

    def jobs(self) -> set[str]:
        """The jobs with snapshots here."""
        with self._lock:
            return {k[0] for k in self._snaps}

    @property
    def nbytes(self) -> int:
        """Bytes all kept snapshots take."""
        with self._lock:
            return sum(s.nbytes for steps in self._snaps.values() for s in steps.values())
