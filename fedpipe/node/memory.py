"""The memory a node's stages are predicted to use, what they use, and its admission.

A ``LoadStage`` carries the planner's prediction of the stage's peak memory
(``LoadStageRequest.predicted_memory_bytes``, :func:`fedpipe.planner.stage_memory_bytes`).
:class:`StageMemory` refuses a stage whose prediction, with what the node's other
stages are predicted to hold, is more than the node's memory limit (``--memory-limit``,
the memory it advertises), and measures each stage's peak:

- on a GPU, ``torch.cuda.max_memory_allocated`` of the stage's device;
- on a CPU, the node's peak resident set (``VmHWM`` of ``/proc/self/status``, the
  high-water mark reset at the load where the kernel lets it, else
  ``getrusage``'s ``ru_maxrss``) over its resident set just before the load's weights
  are made: after its code is unpickled (:meth:`StageMemory.rebase`), so what that code
  imports (the first job's ``transformers``) is not counted; before the load for layers
  that carry their weights in their pickles.

Both are process-wide: with one stage per node, the stage's.

A stage that has ended (DONE, FAILED, STOPPED: kept for ``state_dict``, snapshots or
a recovery until released) runs no step: it holds its weights and optimizer state, not
its activations, so it counts what its tensors take (:func:`held_bytes`), at most its
prediction, as the tracker's planner (which counts none of an ended job) would have it.
"""
from __future__ import annotations

import resource
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..planner.memfit import MEMORY_REMEDIES
from ..proto import node_pb2
from ..units import binary_bytes
from .errors import MemoryTooSmall
from .lifecycle import StageSlot



def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (e.g. "VmRSS"), KiB; None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """The process's resident set now, bytes (its peak where the current is unknown)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set since it started (or since the last
    :func:`reset_peak_rss`), bytes."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current one (Linux: "5" to
    ``/proc/self/clear_refs``); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for v in list(state.values()):
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


def held_bytes(parts: Mapping[str, Any]) -> int | None:
    """The bytes the tensors of a stage's ``parts`` take (its module's weights, its
    optimizer's state, ...: each part's ``state_dict()``), each storage once; None when
    they cannot be read now (a part that changed while it was read)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    try:
        for part in list(parts.values()):
            if part is None:
                continue
            for t in _tensors(part.state_dict()):
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    except RuntimeError:  # "dictionary changed size during iteration" and the like
        return None
    return total


class StageMemory:
    """Each loaded stage's predicted memory and the baseline its peak is measured from;
    thread-safe.

    Args:
        device: the device stages run on.
        limit: the node's memory limit, bytes (what it advertises); 0: no check.
    """

    def __init__(self, device: torch.device, limit: int):
        self.device, self.limit = device, limit
        self._lock = threading.Lock()
        self._stages: dict[StageSlot, tuple[int, int]] = {}  # slot -> (predicted, baseline)

    def admit(self, request: node_pb2.LoadStageRequest, others: list[StageSlot],
              ended: Mapping[StageSlot, int | None] | None = None) -> None:
        """Take the stage ``request`` loads, whose node holds the stages ``others``
        besides it: note its prediction and the baseline of its peak (the node's
        resident set now, or the device's allocated memory).

        ``ended``: the bytes each of ``others`` that has ended still holds
        (:func:`held_bytes`; None: unknown), counted instead of its prediction where less.

        Raises:
            MemoryTooSmall: its predicted bytes, with what ``others`` are predicted to
                hold, are more than the node's limit; the message gives both figures.
        """
        slot = StageSlot(request.job_id, request.replica, request.stage)
        want = int(request.predicted_memory_bytes)
        kept = ended or {}

        def counted(s: StageSlot) -> int:
            predicted, have = self._stages[s][0], kept.get(s)
            return predicted if have is None else min(predicted, have)
        with self._lock:
            held = sum(counted(s) for s in others if s in self._stages and s != slot)
            if self.limit and want and want + held > self.limit:
                raise MemoryTooSmall(
                    f"stage {request.stage} (replica {request.replica}) of job "
                    f"{request.job_id!r} is predicted to need {binary_bytes(want)}, but this "
                    f"node's memory limit is {binary_bytes(self.limit)} and its other stages "
                    f"are predicted to hold {binary_bytes(held)} of it: "
                    f"{binary_bytes(want + held - self.limit)} "
                    f"({want + held - self.limit} bytes) too many{MEMORY_REMEDIES}")
            self._stages[slot] = (want, self._baseline())

    def rebase(self, slot: StageSlot) -> None:
        """Measure an admitted stage's peak from now: its code is unpickled (the modules it
        imports, the first job's ``torch`` submodules or ``transformers``, are loaded for
        the node, not for the stage) and none of its weights is made yet."""
        with self._lock:
            if slot in self._stages:
                self._stages[slot] = (self._stages[slot][0], self._baseline())

    def _baseline(self) -> int:
        """Reset the peak and return what is in use now (bytes)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        reset_peak_rss()
        return rss_bytes()

    def forget(self, slot: StageSlot) -> None:
        """The stage is released: its prediction no longer holds memory here."""
        with self._lock:
            self._stages.pop(slot, None)

    def figures(self, slot: StageSlot) -> tuple[int, int]:
        """``(peak, predicted)`` bytes of a loaded stage: its measured peak so far over
        its load's baseline (0 for one not admitted here), and its prediction (0: none)."""
        with self._lock:
            found = self._stages.get(slot)
        if found is None:
            return 0, 0
        want, base = found
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = peak_rss_bytes()
        return max(0, peak - base), want
