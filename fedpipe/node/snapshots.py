"""The checkpoint snapshots a node keeps: its own stages' and those it keeps as a buddy."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..runtime.checkpoint import Snapshot
from ..spec import SNAPSHOTS_KEPT, StageKey


class SnapshotStore:
    """Snapshots by ``(job_id, StageKey)`` and step: the newest
    :data:`~fedpipe.spec.SNAPSHOTS_KEPT` of each stage, and the job's last complete
    checkpoint as the tracker last said (:meth:`protect`). Without that one, a node
    that keeps taking checkpoints the tracker cannot complete (a peer cut off from
    the tracker, a revoked one) would evict the only step a recovery can rewind to.

    Thread-safe. Own snapshots and buddy copies live side by side: a stage
    restored on this node finds either.
    """

    def __init__(self, keep: int = SNAPSHOTS_KEPT):
        self.keep = keep
        self._snaps: dict[tuple[str, StageKey], OrderedDict[int, Snapshot]] = {}
        self._complete: dict[str, int] = {}  # job -> its last complete checkpoint
        self._lock = threading.Lock()

    def put(self, job_id: str, key: StageKey, snap: Snapshot) -> None:
        """Keep ``snap``; the oldest of the stage's snapshots beyond :attr:`keep` is dropped."""
        with self._lock:
            steps = self._snaps.setdefault((job_id, key), OrderedDict())
            steps[snap.step] = snap
            steps.move_to_end(snap.step)
            self._prune(job_id, steps)

    def protect(self, job_id: str, step: int) -> None:
        """``step`` is ``job_id``'s last complete checkpoint (the tracker's word): keep its
        snapshots beside the newest :attr:`keep`; an older protected step is let go."""
        with self._lock:
            if self._complete.get(job_id) == step:
                return
            self._complete[job_id] = step
            for (job, _), steps in self._snaps.items():
                if job == job_id:
                    self._prune(job_id, steps)

    def _prune(self, job_id: str, steps: OrderedDict[int, Snapshot]) -> None:
        kept = set(list(steps)[-self.keep:])
        kept.add(self._complete.get(job_id, -1))
        for step in [s for s in steps if s not in kept]:
            del steps[step]

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
            if len(steps) >= self.keep:  # the oldest but the protected one goes
                out = next((s for k, s in steps.items() if k != self._complete.get(job_id)),
                           None)
                held -= out.nbytes if out is not None else 0
        return max(0, budget - held)

    def drop_job(self, job_id: str) -> None:
        """Forget every snapshot of ``job_id``."""
        with self._lock:
            for k in [k for k in self._snaps if k[0] == job_id]:
                del self._snaps[k]
            self._complete.pop(job_id, None)

    def jobs(self) -> set[str]:
        """The jobs with snapshots here."""
        with self._lock:
            return {k[0] for k in self._snaps}

    @property
    def nbytes(self) -> int:
        """Bytes all kept snapshots take."""
        with self._lock:
            return sum(s.nbytes for steps in self._snaps.values() for s in steps.values())
