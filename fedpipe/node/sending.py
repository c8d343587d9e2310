"""How a stage's tensors leave for one peer: the encoding both transports share
(:func:`encode`) and the sender over the node's socket data plane (:class:`SocketSender`;
:class:`fedpipe.node.peers.PeerSender` is the gRPC one, and
:class:`~fedpipe.node.peers.StagePeers` chooses per link)."""
from __future__ import annotations

import time
from concurrent import futures

import torch

from ..net import dataplane
from ..net.dataplane import staging
from ..net.emulation import Pacer
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2, tensor_pb2
from ..runtime.stage import StageError
from ..spec import Kind
from ..wire import codecs, lowrank
from ..wire.format import WireError

INLINE_BYTES = 4 * 2**20
"""A raw CPU tensor up to this size is framed on the sending stage's own thread: raw
framing is a view of the tensor's memory and a header, cheaper than waking the
encoder thread for it (issue 12: each hand-off between threads cost a stage about
as much as a small layer's pass)."""


_GRADIENT = int(Kind.GRADIENT)
"""As a plain int: an enum member's read costs a lookup in its metaclass, per tensor sent."""


def encode(envelope: node_pb2.Envelope, tensor: torch.Tensor, codec: str,
           feedback: codecs.ErrorFeedback, end: lowrank.End | None = None
           ) -> tuple[tensor_pb2.Tensor, memoryview]:
    """``tensor`` encoded with ``codec`` for a peer, whichever transport carries it: a
    gradient through the sender's error ``feedback``, one residual per (stage, microbatch,
    shape); an activation as it is (:func:`fedpipe.wire.codecs.encode_payload`). ``end``:
    the sending stage's end of the link, for a stateful (lowrank) codec."""
    if envelope.kind == _GRADIENT:
        key = (envelope.stage, envelope.microbatch, tuple(tensor.shape))
        return codecs.encode_payload(tensor, codec, feedback=feedback, key=key, end=end)
    return codecs.encode_payload(tensor, codec, end=end)


class SocketSender:
    """Sends tensors to one peer over its socket data-plane link (:mod:`fedpipe.net.dataplane`):
    :class:`PeerSender`'s interface, for a peer that offers a data port.

    A raw CPU tensor of at most :data:`INLINE_BYTES` is written on the caller's
    thread, from its own memory (a header and a ``memoryview``, no copy); others
    (a codec to run, a large or CUDA tensor) and every tensor on an emulated link
    go through one background thread, in order. With a ``copier``, a raw tensor on a
    device is staged to pinned host memory in chunks on the caller's thread (the copies
    are queued right after the kernels that made the tensor, and run while it computes
    on), and the background thread writes each chunk as soon as its copy is done
    (:mod:`fedpipe.net.dataplane.staging`); without one (or with a codec) it is encoded
    there as :func:`encode` does. The link keeps a tensor until the
    peer acknowledged it (to resend it after a break), so a tensor must not be
    changed in place until :meth:`flush`. The link is the node's, shared with its
    other stages that send to this peer: closing this sender leaves it open.
    Gradient error feedback is kept per sender, as :class:`PeerSender` keeps it.

    Args:
        link: the node's link to the peer.
        address: the peer's gRPC ``HOST:PORT`` (its key in :class:`StagePeers`).
        name: the peer's node name.
        metrics: counts each tensor's bytes (None: off).
        pacer: the emulated link to the peer (None: none).
        feedback: as :class:`PeerSender`'s.
        copier: stages a device tensor's bytes to host memory (a CUDA node's
            :class:`~fedpipe.net.dataplane.staging.CudaCopier`; None: a device tensor is
            copied as :func:`encode` copies it).
    """

    def __init__(self, link: dataplane.Link, address: str, name: str = "",
                 metrics: NodeMetrics | None = None, pacer: Pacer | None = None,
                 feedback: codecs.ErrorFeedback | None = None,
                 copier: staging.Copier | None = None):
        self.link, self.address, self.name = link, address, name or address
        self.metrics, self.pacer, self.copier = metrics, pacer, copier
        self.encoder = futures.ThreadPoolExecutor(1, thread_name_prefix=f"data-{self.name}")
        self.error: Exception | None = None
        self.feedback = feedback if feedback is not None else codecs.ErrorFeedback()
        self.job = ""  # whose refusals this sender raises (the link is shared by every job
        #                and epoch: :func:`~fedpipe.net.dataplane.owner_of`)
        self.last = -1  # the sequence number of the last tensor this sender wrote on the link

    def submit(self, envelope: node_pb2.Envelope, tensor: torch.Tensor, codec: str,
               end: lowrank.End | None = None) -> None:
        """As :meth:`PeerSender.submit`.

        Raises:
            StageError: an earlier send to this peer failed.
        """
        self.job = dataplane.owner_of(envelope)
        self.check()
        if self.pacer is None and codec == "raw" and tensor.is_cpu \
                and tensor.numel() * tensor.element_size() <= INLINE_BYTES:
            self._send(envelope, tensor, codec, 0.0)
        else:
            due = self.pacer.due() if self.pacer is not None else 0.0
            staged = None
            if self.copier is not None:
                try:  # here, so the copy is ordered right after the kernels that made it
                    if staging.stageable(tensor, codec):  # (a bad codec: a StageError too)
                        staged = staging.stage(tensor, self.copier)
                except Exception as e:  # noqa: BLE001 — raised as this sender's StageError
                    self.error = self.error or e
                    self.check()
            self.encoder.submit(self._send, envelope, tensor, codec, due, end, staged)

    def _send(self, envelope: node_pb2.Envelope, tensor: torch.Tensor, codec: str,
              due: float, end: lowrank.End | None = None,
              staged: tuple[tensor_pb2.Tensor, staging.Staged] | None = None) -> None:
        try:
            marks: tuple[staging.Mark, ...] = ()
            if staged is not None:
                msg, (payload, marks) = staged
            else:
                msg, payload = encode(envelope, tensor, codec, self.feedback, end)
            if self.metrics is not None:
                self.metrics.sent(self.name, envelope.kind, tensor.numel() * tensor.element_size(),
                                  payload.nbytes, transport="socket")
            if self.pacer is not None:
                time.sleep(max(0.0, due - time.monotonic()))
                self.pacer.take(payload.nbytes)
            self.last = max(self.last, self.link.send_encoded(msg, payload, envelope=envelope,
                                                              marks=marks))
        except Exception as e:  # noqa: BLE001 — kept for the stage thread, which reports it
            self.error = self.error or e

    def check(self) -> None:
        """Raise StageError if a send to this peer failed (or the peer refused a tensor)."""
        if self.error is None:
            try:
                self.link.check(self.job)
            except (dataplane.LinkFailed, WireError) as e:
                self.error = e
        if self.error is not None:
            raise StageError(f"sending to {self.name} ({self.address}) failed: {self.error}",
                             peer=self.address)

    def flush(self) -> None:
        """Wait until the peer acknowledged every tensor this sender sent (not those the
        link carries for others meanwhile: :meth:`~fedpipe.net.dataplane.Link.flush`).
        Raises StageError if a send failed."""
        self.encoder.submit(lambda: None).result()  # what is queued has been written
        self.check()
        try:
            self.link.flush(owner=self.job, through=self.last)
        except (dataplane.LinkFailed, WireError) as e:
            self.error = self.error or e
        if self.pacer is not None:
            self.pacer.back()
        self.check()

    def close(self) -> None:
        """Stop sending: queued tensors are dropped (the node's link stays open)."""
        self.encoder.shutdown(wait=True, cancel_futures=True)
