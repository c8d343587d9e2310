"""An in-memory wire for DiLoCo's outer messages, for in-process tests and benchmarks.

:class:`OuterWire` carries what the holders' :class:`~fedpipe.runtime.diloco.OuterSync`
send each other (``Kind.OUTER`` only), encoded and decoded with the wire codec as a
node's sender and receiver do, and counts each replica group's payload bytes.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from ..spec import Kind, StageKey
from ..wire import codecs

Hold = Callable[[int, int], "threading.Event | None"]
"""``hold(replica, outer_step)``: an Event that delays delivery of what that replica
sends at that step until set (None: delivered at once)."""


class OuterWire:
    """Messages between holders ``StageKey(replica, stage)``.

    Attributes:
        sent_bytes: payload bytes sent, by the sender's replica group.
    """

    def __init__(self, hold: Hold = lambda replica, k: None):
        self.boxes: dict[tuple, torch.Tensor] = {}
        self.cond = threading.Condition()
        self.hold = hold
        self.sent_bytes: collections.Counter[int] = collections.Counter()
        self.failed: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """A holder failed with ``error``: every holder's waiting and later ``recv`` raises
        RuntimeError naming it (its peers would wait for its messages for ever)."""
        with self.cond:
            self.failed = error
            self.cond.notify_all()

    def transport(self, me: StageKey) -> "OuterTransport":
        """The :class:`~fedpipe.runtime.stage.Transport` of holder ``me``."""
        return OuterTransport(self, me)

    def _deliver(self, key: tuple, tensor: torch.Tensor) -> None:
        with self.cond:
            self.boxes[key] = tensor
            self.cond.notify_all()


class OuterTransport:
    """The :class:`~fedpipe.runtime.stage.Transport` of holder ``me`` on an
    :class:`OuterWire` (outer messages only; AssertionError for any other)."""

    def __init__(self, wire: OuterWire, me: StageKey):
        self.wire, self.me = wire, me

    def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
        assert kind == Kind.OUTER and peer != self.me
        msg = codecs.encode(tensor, codec)  # as PeerSender and Send do
        with self.wire.cond:
            self.wire.sent_bytes[self.me.replica] += len(msg.payload)
        gate = self.wire.hold(self.me.replica, step)  # taken when sent, not when delivered
        key = (peer, step, tag)
        if gate is None:
            self.wire._deliver(key, codecs.decode(msg))
            return

        def deliver() -> None:
            gate.wait(10)
            self.wire._deliver(key, codecs.decode(msg))
        threading.Thread(target=deliver, daemon=True).start()

    def recv(self, kind, step, tag, timeout=None):
        assert kind == Kind.OUTER
        key = (self.me, step, tag)
        with self.wire.cond:
            if not self.wire.cond.wait_for(
                    lambda: key in self.wire.boxes or self.wire.failed is not None, timeout):
                raise TimeoutError(key)
            if key not in self.wire.boxes:
                raise RuntimeError(f"a peer of {self.me} failed: {self.wire.failed!r}")
            return self.wire.boxes.pop(key), 1

    def send(self, kind, step, microbatch, tensor, batch_size):
        raise AssertionError("an outer sync sends to holders only")
