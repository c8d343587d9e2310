"""Where tensors that arrived for a node's stages wait until the stage takes them."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Hashable, NamedTuple

import torch

from ..spec import Kind

POLL_SECONDS = 0.1
"""How often a waiting put or get checks whether its stage is still alive: the
longest a stopped stage's waiters take to notice."""


class Stopped(Exception):
    """The stage waiting on the mailbox was stopped."""


class _Key(NamedTuple):
    slot: Hashable
    kind: Kind
    step: int
    tag: int


class Mailbox:
    """Tensors keyed by ``(slot, kind, step, tag)``; ``slot`` names a stage.

    Inputs and targets, which a client may send far ahead, are bounded: a put
    of a ``bounded`` kind waits while ``capacity`` of them are queued for the
    slot (backpressure on the sender). Activations and gradients are bounded by
    the schedule itself.
    """

    def __init__(self, capacity: int, bounded: tuple[Kind, ...]):
        self.capacity, self.bounded = capacity, bounded
        self._items: dict[_Key, tuple[torch.Tensor, int]] = {}  # -> (tensor, batch size)
        self._counts: dict[tuple[Hashable, Kind], int] = defaultdict(int)  # bounded kinds
        self._cond = threading.Condition()

    def put(self, slot: Hashable, kind: Kind, step: int, mb: int, tensor: torch.Tensor,
            batch: int, alive: Callable[[], bool] = lambda: True) -> None:
        """Store a tensor; for bounded kinds wait for room while ``alive()``.

        Raises:
            Stopped: ``alive()`` turned false while waiting for room.
            KeyError: a tensor with the same key is already waiting.
        """
        key = _Key(slot, kind, step, mb)
        with self._cond:
            if kind in self.bounded:
                while self._counts[(slot, kind)] >= self.capacity:
                    if not alive():
                        raise Stopped(f"{_name(kind)} for {slot} was not taken")
                    self._cond.wait(POLL_SECONDS)
                self._counts[(slot, kind)] += 1
            if key in self._items:
                raise KeyError(f"duplicate {_name(kind)} for step {step} microbatch {mb}")
            self._items[key] = (tensor, batch)
            self._cond.notify_all()

    def get(self, slot: Hashable, kind: Kind, step: int, mb: int,
            stopped: Callable[[], bool], timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """Take the tensor with that key, waiting for it.

        Raises:
            Stopped: ``stopped()`` turned true first.
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        key = _Key(slot, kind, step, mb)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if stopped():
                    raise Stopped(f"stage {slot} stopped")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no {_name(kind)} for step {step} microbatch {mb} "
                                       f"within {timeout:.0f} s")
                self._cond.wait(POLL_SECONDS)
            item = self._items.pop(key)
            if kind in self.bounded:  # room for a waiting put; no one else waits on a get
                self._counts[(slot, kind)] -= 1
                self._cond.notify_all()
            return item

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Forget every tensor of the slots ``match`` selects."""
        with self._cond:
            for key in [k for k in self._items if match(k.slot)]:
                del self._items[key]
            for key in [k for k in self._counts if match(k[0])]:  # k: (slot, kind)
                del self._counts[key]
            self._cond.notify_all()


def _name(kind: Kind) -> str:
    """"activation" for Kind.ACTIVATION, for messages."""
    return Kind(kind).name.lower()
