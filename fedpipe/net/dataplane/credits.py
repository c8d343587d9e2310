"""Credit-based flow control: a sender holds at most its peer's window of unacknowledged tensors.

The receiver grants a window in its preface: ``window_bytes`` of payload and
``window_messages`` tensors. A sender takes credit for a tensor before it
writes it and gets it back when the receiver acknowledges the tensor (it was
delivered, or refused). Out of credit, the sender blocks: a slow receiver slows
its sender, and what a sender keeps for a resend after a broken connection is
bounded by the window.

A tensor larger than the whole window is sent when nothing else is
outstanding (it takes the whole window), so a window never deadlocks a link.
"""
from __future__ import annotations

import threading
import time

from ...wire.format import WireError


class LinkFailed(WireError):
    """A link to a peer is gone for good (refused, timed out, or closed): the message says why."""


class Credits:
    """The sender's side of one link's window. Thread-safe.

    Args:
        window_bytes: bytes of payload that may be outstanding, >= 1.
        window_messages: tensors that may be outstanding, >= 1.
    """

    def __init__(self, window_bytes: int, window_messages: int):
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # waiters for credit back
        self.window_bytes, self.window_messages = window_bytes, window_messages
        self.bytes_out = self.messages_out = 0
        self._failed: str | None = None

    def regrant(self, window_bytes: int, window_messages: int) -> None:
        """The peer's new window (a new connection's preface); waiters look again."""
        with self._cond:
            self.window_bytes, self.window_messages = window_bytes, window_messages
            self._cond.notify_all()

    def _fits(self, nbytes: int) -> bool:
        if self.messages_out == 0:  # nothing outstanding: any one tensor may go
            return True
        return (self.messages_out < self.window_messages
                and self.bytes_out + nbytes <= self.window_bytes)

    def try_take(self, nbytes: int) -> bool:
        """Take credit for one tensor of ``nbytes`` if it fits now, without waiting; whether
        it was taken (not when the link failed: :meth:`take` raises why)."""
        with self._lock:  # the condition's lock (no wait, no notify): half its ``with``
            if self._failed is not None or not self._fits(nbytes):
                return False
            self.bytes_out += nbytes
            self.messages_out += 1
            return True

    def take(self, nbytes: int, timeout: float, why_waiting: str = "") -> None:
        """Take credit for one tensor of ``nbytes``, waiting up to ``timeout`` seconds.

        Raises:
            LinkFailed: the link failed (before or while waiting), or no credit came
                back within ``timeout`` (the receiver stopped acknowledging).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failed is None and not self._fits(nbytes):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkFailed(f"no credit for a {nbytes}-byte tensor within {timeout} s: "
                                     f"{self.bytes_out} bytes in {self.messages_out} tensors "
                                     f"unacknowledged{why_waiting}")
                self._cond.wait(left)
            if self._failed is not None:
                raise LinkFailed(self._failed)
            self.bytes_out += nbytes
            self.messages_out += 1

    def give_back(self, nbytes: int, messages: int) -> None:
        """The receiver acknowledged ``messages`` tensors of ``nbytes`` in all."""
        with self._cond:
            self.bytes_out -= nbytes
            self.messages_out -= messages
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is outstanding (or the link failed); whether it is idle."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.messages_out == 0 or self._failed is not None, timeout)

    def fail(self, why: str) -> None:
        """The link failed: every waiter, and every later :meth:`take`, raises LinkFailed."""
        with self._cond:
            if self._failed is None:
                self._failed = why
            self._cond.notify_all()

    @property
    def failed(self) -> str | None:
        """Why the link failed, or None."""
        return self._failed
