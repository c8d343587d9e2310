"""Where tensors that arrived for a node's stages wait until the stage takes them."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch

from ..spec import MAX_MICROBATCHES, Kind
from .errors import Duplicate, Full, Stopped

__all__ = ["Duplicate", "Full", "Mailbox", "Stopped"]

JOB_TENSORS = 4 * MAX_MICROBATCHES
"""The most tensors one job may have waiting in a node's mailbox, all its stages and kinds
together. A synchronous stage holds at most a step's microbatches of activations and of
gradients (and the bounded inputs and targets); this leaves room for several stages of a
job with the most microbatches on one node, and stops a sender that runs ahead without end."""
POLL_SECONDS = 0.1
"""How often a waiting put or get checks whether its stage is still alive: the
longest a stopped stage's waiters take to notice."""


class _Key(NamedTuple):
    slot: Hashable
    kind: Kind
    step: int
    tag: int


class Mailbox:
    """Tensors keyed by ``(slot, kind, step, tag)``; ``slot`` names a stage.

    Inputs and targets, which a client may send far ahead, are bounded: a put
    of a ``bounded`` kind waits while ``capacity`` of them are queued for the
    slot (backpressure on the sender; it is woken when the slot is half empty, or
    finds room at its next look, :data:`POLL_SECONDS`). Activations and gradients are bounded by
    the schedule itself for an honest sender; against any other, every job may
    have at most ``job_cap`` tensors waiting, of all its slots and kinds, and a
    put past that is refused (:class:`Full`) instead of buffered.

    Args:
        capacity: tensors of one bounded kind one slot may have waiting.
        bounded: the kinds whose puts wait for room.
        job_cap: tensors one job may have waiting, >= 1.
        job_of: the job a slot belongs to (default: the slot is its own job).
    """

    def __init__(self, capacity: int, bounded: tuple[Kind, ...], *, job_cap: int = JOB_TENSORS,
                 job_of: Callable[[Any], Hashable] = lambda slot: slot):
        if job_cap < 1:
            raise ValueError(f"a mailbox's job_cap must be >= 1, got {job_cap}")
        self.capacity, self.bounded, self.job_cap, self.job_of = capacity, bounded, job_cap, job_of
        self._items: dict[_Key, tuple[torch.Tensor, int]] = {}  # -> (tensor, batch size)
        self._counts: dict[tuple[Hashable, Kind], int] = defaultdict(int)  # bounded kinds
        self._jobs: dict[Hashable, int] = defaultdict(int)  # every kind, by job
        # bounded kinds: the last step taken, by (slot, kind, microbatch)
        self._taken: dict[tuple[Hashable, Kind, int], int] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # puts waiting for room
        # the gets waiting, each on a lock of its own that the put of its key releases: a
        # put wakes the one stage thread that waits for that tensor, no other waiter
        self._wanted: dict[_Key, list[Any]] = {}
        # the locks of gets whose tensor came in a put with ``defer``, to release soon
        self._deferred: list[Any] = []

    def waiting(self, job: Hashable) -> int:
        """Tensors of ``job`` waiting now."""
        with self._cond:
            return self._jobs.get(job, 0)

    def put(self, slot: Hashable, kind: Kind, step: int, mb: int, tensor: torch.Tensor,
            batch: int, alive: Callable[[], bool] = lambda: True, *,
            defer: bool = False) -> Callable[[], None] | None:
        """Store a tensor; for bounded kinds wait for room while ``alive()``.

        A get waiting for the tensor is woken, unless ``defer``: then its wake-up is
        returned (None if nothing waits), for the caller to run soon, and until then the
        get sleeps on (for at most :data:`POLL_SECONDS`, when it looks again). A
        socket link's reader defers so, while more tensors arrived behind this one, and
        wakes the stage thread once for all of them (:meth:`wake_deferred`). A put that
        must wait for room first wakes every get deferred so.

        Raises:
            Stopped: ``alive()`` turned false while waiting for room.
            Duplicate: a tensor with the same key is already waiting.
            Full: the slot's job already has :attr:`job_cap` tensors waiting.
        """
        key = _Key(slot, kind, step, mb)
        job = self.job_of(slot)
        bounded = kind in self.bounded
        with self._lock:  # the condition's own lock: a Condition's ``with`` costs twice
            self._check_new(key)  # a duplicate is refused at once, not after a wait for room
            if bounded and self._counts[(slot, kind)] >= self.capacity:
                self._release_deferred()  # the stage thread to make room may be one
                while self._counts[(slot, kind)] >= self.capacity:
                    if not alive():
                        raise Stopped(f"{_name(kind)} for {slot} was not taken")
                    self._cond.wait(POLL_SECONDS)
                self._check_new(key)  # another put of it may have come meanwhile
            jobs = self._jobs
            if jobs[job] >= self.job_cap:
                raise Full(self._refusal(job, kind, step, mb))
            if bounded:
                self._counts[(slot, kind)] += 1
            jobs[job] += 1
            self._items[key] = (tensor, batch)
            waiters = self._wanted.pop(key, None)
            if waiters is None:
                return None
            if defer:
                self._deferred += waiters
                return self.wake_deferred
            for waiter in waiters:
                waiter.release()
            return None

    def wake_deferred(self) -> None:
        """Wake the gets whose tensors came in puts with ``defer`` (any caller's)."""
        with self._lock:
            self._release_deferred()

    def _release_deferred(self) -> None:
        """:meth:`wake_deferred`, the lock held."""
        deferred, self._deferred = self._deferred, []
        for waiter in deferred:
            waiter.release()

    def put_all(self, slot: Hashable, kind: Kind, step: int, first: int,
                tensors: Sequence[torch.Tensor], batch: int,
                alive: Callable[[], bool] = lambda: True, *,
                defer: bool = False) -> Callable[[], None] | None:
        """Store ``tensors`` as microbatches ``first``, ``first + 1``, ... of ``step``, each
        as :meth:`put` does; none is stored when one of them would be a duplicate or
        past the job's cap (so a refused message leaves nothing behind, and the sender
        may send it again). ``defer``: as :meth:`put`'s (the wake-up returned is for all).

        Raises:
            Stopped, Duplicate, Full: as :meth:`put`.
        """
        if len(tensors) == 1:  # one tensor: put's own checks are all-or-none
            return self.put(slot, kind, step, first, tensors[0], batch, alive, defer=defer)
        job = self.job_of(slot)
        with self._cond:
            for i in range(len(tensors)):
                self._check_new(_Key(slot, kind, step, first + i))
            if self._jobs[job] + len(tensors) > self.job_cap:
                raise Full(self._refusal(job, kind, step, first))
        wake = None
        for i, t in enumerate(tensors):
            wake = self.put(slot, kind, step, first + i, t, batch, alive, defer=defer) or wake
        return wake

    def get(self, slot: Hashable, kind: Kind, step: int, mb: int,
            stopped: Callable[[], bool], timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """Take the tensor with that key, waiting for it.

        Raises:
            Stopped: ``stopped()`` turned true first.
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        key = _Key(slot, kind, step, mb)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            item = self._items.pop(key, None)
            while item is None:
                if stopped():
                    raise Stopped(f"stage {slot} stopped")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no {_name(kind)} for step {step} microbatch {mb} "
                                       f"within {timeout:.0f} s")
                self._wait_for(key)
                item = self._items.pop(key, None)
            self._forget(self.job_of(slot))
            if kind in self.bounded:  # room for a waiting put; no one else waits on a get
                self._taken[(slot, kind, mb)] = max(step, self._taken.get((slot, kind, mb), -1))
                self._counts[(slot, kind)] -= 1
                if self._counts[(slot, kind)] <= self.capacity // 2:
                    # half empty: a sender far ahead (a client's feed) is woken once per
                    # half a mailbox, not once per tensor (each wake-up costs the stage
                    # thread the GIL)
                    self._cond.notify_all()
            return item

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Forget every tensor of the slots ``match`` selects."""
        with self._cond:
            for item in [k for k in self._items if match(k.slot)]:
                del self._items[item]
                self._forget(self.job_of(item.slot))
            for key in [k for k in self._counts if match(k[0])]:  # k: (slot, kind)
                del self._counts[key]
            for taken in [k for k in self._taken if match(k[0])]:  # (slot, kind, mb)
                del self._taken[taken]
            self._cond.notify_all()
            for waiters in self._wanted.values():  # they look whether to stop
                for waiter in waiters:
                    waiter.release()
            self._wanted.clear()
            self._release_deferred()

    def _wait_for(self, key: _Key) -> None:
        """Wait (the lock held, released meanwhile) until a put of ``key``, a drop, or
        :data:`POLL_SECONDS` passed."""
        waiter = threading.Lock()
        waiter.acquire()
        self._wanted.setdefault(key, []).append(waiter)
        self._lock.release()
        try:
            waiter.acquire(True, POLL_SECONDS)
        finally:
            self._lock.acquire()
            waiters = self._wanted.get(key)
            if waiters is not None and waiter in waiters:  # not woken: no longer waiting
                waiters.remove(waiter)
                if not waiters:
                    del self._wanted[key]

    def _check_new(self, key: _Key) -> None:
        """Refuse ``key`` if it waits already, or (a bounded kind) if its slot already
        took that microbatch of its step: a client's input sent again after a link broke,
        which had come before the break, must not wait for ever for a get that will not
        come. A slot takes each microbatch of a bounded kind in step order (an epoch's
        stage consumes its inputs and targets once each, in order; a rewind is a new
        epoch, so a new slot) (under the lock).

        Raises:
            Duplicate: either case.
        """
        if key in self._items:
            raise Duplicate(f"duplicate {_name(key.kind)} for step {key.step} "
                            f"microbatch {key.tag}")
        if key.kind in self.bounded and \
                key.step <= self._taken.get((key.slot, key.kind, key.tag), -1):
            raise Duplicate(f"duplicate {_name(key.kind)} for step {key.step} microbatch "
                            f"{key.tag}: the stage already took step {key.step}")

    def _refusal(self, job: Hashable, kind: Kind, step: int, mb: int) -> str:
        """Why a tensor of ``job`` is refused at the job's cap (under the lock)."""
        return (f"refused a {_name(kind)} for step {step} microbatch {mb}: job {job} already "
                f"has {self._jobs[job]} tensors waiting on this node, the most one job may "
                f"({self.job_cap}, fedpipe.node.mailbox.JOB_TENSORS)")

    def _forget(self, job: Hashable) -> None:
        """One tensor of ``job`` left (under the lock)."""
        left = self._jobs[job] - 1
        if left:
            self._jobs[job] = left
        else:
            del self._jobs[job]


def _name(kind: Kind) -> str:
    """"activation" for Kind.ACTIVATION, for messages."""
    return Kind(kind).name.lower()
