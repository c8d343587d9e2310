"""A node's connections to its peers: shared channels, tensor senders, link probes.

One gRPC channel per peer address (:class:`ChannelPool`), shared by every
stage that talks to that peer and closed when the last of them lets go. Each
stage streams its tensors through senders of its own (:class:`StagePeers`):
a :class:`~fedpipe.node.sending.SocketSender` over the node's socket data plane to a
peer that offers a data port, a :class:`PeerSender` over gRPC to one that does not (chosen per
link), so one stage's failed stream or error feedback never touches another's.
:func:`measure_link` and :func:`measure_socket_link` time a link for the tracker.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from concurrent import futures
from typing import Callable, Iterable, Iterator, NamedTuple, TypeAlias

import grpc
import torch

from .. import net
from ..net import dataplane, timeouts, trackers
from ..net.dataplane import staging
from ..net.emulation import Pacer
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2
from ..runtime.stage import StageError
from ..security import TlsConfig
from ..wire import codecs, frames, lowrank, rpc
from .errors import InvalidRequest
from .sending import INLINE_BYTES, SocketSender, encode

log = logging.getLogger(__name__)

Shaper: TypeAlias = grpc.UnaryUnaryClientInterceptor
"""An emulated link (:class:`fedpipe.net.emulation.Shaper`) a channel's calls go through."""


class ChannelPool:
    """One cached gRPC channel per peer address, reference-counted.

    :meth:`acquire` opens the channel to an address on first use and counts
    its users; :meth:`release` closes it when the last user lets go. The first
    acquirer's ``shaper`` (an emulated link) stays with the channel: a node
    reaches one address over one link. Thread-safe.

    Args:
        tls: this node's certificate, for mutual TLS to peers (None: plaintext).
    """

    def __init__(self, tls: TlsConfig | None = None):
        self.tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, int]] = {}  # address -> (channel, users)

    def acquire(self, address: str, shaper: Shaper | None = None) -> grpc.Channel:
        """The channel to ``address``, with one more user.

        Raises:
            InvalidRequest: ``address`` is a list (``a:1,b:2``): a peer is one ``HOST:PORT``,
                and :func:`fedpipe.net.channel` would take a list for several trackers.
        """
        if trackers.several(address):
            raise InvalidRequest(f"peer address {address!r} is not one HOST:PORT")
        with self._lock:
            ch, users = (self._channels.get(address)
                         or (net.channel(address, shaper, tls=self.tls), 0))
            self._channels[address] = (ch, users + 1)
            return ch

    def release(self, address: str) -> None:
        """One user of ``address``'s channel is done; the last one closes it.

        Raises:
            KeyError: nobody holds a channel to ``address``.
        """
        with self._lock:
            ch, users = self._channels[address]
            if users > 1:
                self._channels[address] = (ch, users - 1)
                return
            del self._channels[address]
        ch.close()

    @contextlib.contextmanager
    def borrow(self, address: str, shaper: Shaper | None = None) -> Iterator[grpc.Channel]:
        """``with pool.borrow(address) as ch:`` acquire for the block, then release."""
        ch = self.acquire(address, shaper)
        try:
            yield ch
        finally:
            self.release(address)

    def users(self, address: str) -> int:
        """How many hold ``address``'s channel (0: it is closed)."""
        with self._lock:
            _, users = self._channels.get(address, (None, 0))
            return users

    def addresses(self) -> set[str]:
        """The addresses with an open channel."""
        with self._lock:
            return set(self._channels)


class _Stream(NamedTuple):
    """An open ``Send`` stream: the queue of its tensors' frames (an iterable of frames
    per tensor), and its call."""

    frames: queue.SimpleQueue
    call: grpc.Future


class PeerSender:
    """Streams tensors to one peer's ``Send`` RPC over a channel it is given.

    Tensors are encoded on a background thread (a raw CPU tensor of at most
    :data:`INLINE_BYTES` is framed at once on the caller's thread) and their
    frames written to one long-lived client stream per peer. The frames of a
    tensor encoded in the background are made one by one as gRPC sends them
    (each copied from the payload just before gRPC copies it on: hot in cache,
    and never a whole tensor's worth of frames waiting), so such a tensor must
    not be changed in place until :meth:`flush`. A tensor costs
    no call set-up and no round trip: over a link of one-way latency ``L``
    tensors follow each other as fast as the link carries them, each arriving
    ``L`` after it was sent, where a blocking call per tensor would pay ``2 L``
    each. The peer's ``Send`` reads any number of tensors from a stream.
    :meth:`flush` ends the stream and waits for the peer's reply (everything
    was received); the next tensor opens a new stream.

    Lossy codecs on gradients use error feedback: the residual is kept per
    link (this sender), per microbatch slot and shape, so what the codec drops
    is sent later instead of lost (:class:`fedpipe.wire.codecs.ErrorFeedback`).
    The first failed stream is kept and raised (as StageError) by the next
    :meth:`submit` or :meth:`flush`. The channel belongs to the caller.

    Args:
        address: the peer's ``HOST:PORT``.
        channel: a channel to it.
        name: the peer's node name (the ``dst`` of this node's link metrics).
        metrics: counts each tensor's bytes before and after its codec (None: off).
        feedback: the gradients' error feedback (None: a new one of its own); a stage's
            senders share the stage's (:attr:`StagePeers.feedback`).
    """

    END = None

    def __init__(self, address: str, channel: grpc.Channel, name: str = "",
                 metrics: NodeMetrics | None = None,
                 feedback: codecs.ErrorFeedback | None = None):
        self.address, self.name, self.metrics = address, name or address, metrics
        self.stub = rpc.NodeStub(channel)
        self.encoder = futures.ThreadPoolExecutor(1, thread_name_prefix=f"send-{address}")
        self.error: Exception | None = None
        self.stream: _Stream | None = None
        # a tensor's frames go into the stream together (the receiver reassembles
        # them in order), from the encoder thread or a caller framing inline
        self._stream_lock = threading.Lock()
        self.feedback = feedback if feedback is not None else codecs.ErrorFeedback()

    def submit(self, envelope: node_pb2.Envelope, tensor: torch.Tensor, codec: str,
               end: lowrank.End | None = None) -> None:
        """Queue ``tensor`` for the peer, encoded with ``codec`` (a stateful one with the
        stage's ``end`` of the link: :func:`encode`). Tensors may arrive in another order
        than submitted (the receiver keys them by their envelope); those encoded in the
        background (every codec but raw) are encoded in order.

        Raises:
            StageError: an earlier send to this peer failed.
        """
        self.check()
        if (codec == "raw" and tensor.is_cpu
                and tensor.numel() * tensor.element_size() <= INLINE_BYTES):
            self._send(envelope, tensor, codec, True)
        else:
            self.encoder.submit(self._send, envelope, tensor, codec, False, end)

    def _send(self, envelope, tensor, codec, inline, end=None):
        with self._stream_lock:
            self._send_locked(envelope, tensor, codec, inline, end)

    def _send_locked(self, envelope, tensor, codec, inline, end=None):
        try:
            msg, payload = encode(envelope, tensor, codec, self.feedback, end)
            if self.metrics is not None:
                self.metrics.sent(self.name, envelope.kind, tensor.numel() * tensor.element_size(),
                                  payload.nbytes)
            tensor_frames = frames.to_frames(msg, payload=payload, envelope=envelope)
            head = next(tensor_frames)  # the header is checked here, not in gRPC's thread
            if inline:  # the caller may reuse the tensor once this returns
                queued: Iterable[bytes] = [head, *tensor_frames]
            else:  # its other frames are copied as gRPC asks for them, just before it
                queued = itertools.chain([head], tensor_frames)  # copies them in turn
            if self.stream is None:
                tensors_out: queue.SimpleQueue = queue.SimpleQueue()
                # no deadline: the stream lives as long as the stage sends; the
                # channel's keepalive notices a peer that is gone
                call = self.stub.Send.future(
                    itertools.chain.from_iterable(iter(tensors_out.get, self.END)),
                    wait_for_ready=True)
                call.add_done_callback(self._ended)
                self.stream = _Stream(tensors_out, call)
            self.stream.frames.put(queued)
        except Exception as e:  # noqa: BLE001 — kept for the stage thread, which reports it
            self.error = self.error or e

    def _ended(self, call: grpc.Future) -> None:
        """The stream's end (its done callback; :meth:`flush` waits in it): keep its error.
        A stream :meth:`close` cancelled ended cleanly."""
        try:
            error = call.exception()
        except grpc.FutureCancelledError:
            return
        if error is not None:
            self.error = self.error or error

    def _close_stream(self) -> grpc.Future | None:
        """End the open stream (after every tensor queued on the encoder); return its call."""
        with self._stream_lock:
            if self.stream is None:
                return None
            frames_out, call = self.stream
            self.stream = None
        frames_out.put(self.END)
        return call

    def check(self) -> None:
        """Raise StageError if a send to this peer failed."""
        if self.error is not None:
            detail = self.error.details() if isinstance(self.error, grpc.RpcError) else self.error
            raise StageError(f"sending to {self.address} failed: {detail}", peer=self.address)

    def flush(self) -> None:
        """Wait until the peer has every queued tensor. Raises StageError if a send failed."""
        call = self.encoder.submit(self._close_stream).result()
        if call is not None:
            self._ended(call)  # waits for the peer's reply
        self.check()

    def close(self) -> None:
        """Stop sending: queued tensors are dropped and an open stream is cancelled."""
        # wait for a tensor being encoded: it may open a stream, which must be
        # cancelled here, as the shared channel outlives this sender
        self.encoder.shutdown(wait=True, cancel_futures=True)
        with self._stream_lock:
            stream = self.stream
        if stream is not None:
            stream.frames.put(self.END)
            stream.call.cancel()


Sender: TypeAlias = PeerSender | SocketSender
"""How a stage sends to one peer: over gRPC, or over the socket data plane."""


def link(plane: dataplane.DataPlane, peer: node_pb2.StageAssignment,
         job: str) -> dataplane.Link:
    """``plane``'s link to ``peer``'s data port for ``job``'s frames: through its relay
    (``peer.relay``: it is outbound-only), the job's alone, which the relay bounds by the
    job's share; else the one link to the peer that every job shares.

    Raises:
        LinkFailed: as :meth:`~fedpipe.net.dataplane.DataPlane.link`.
    """
    return plane.link(peer.node_name, peer.data_address, job, relayed=bool(peer.relay))


def dials(me: node_pb2.StageAssignment, peer: node_pb2.StageAssignment) -> bool:
    """Whether ``me``'s node dials ``peer``'s data port itself when its stage loads: where
    one side is reachable it serves and the other dials, so an outbound-only node (behind
    NAT: ``relay`` set) dials every reachable one; of two outbound-only nodes (joined
    through a relay) the one whose name sorts first dials."""
    return bool(me.relay) and (not peer.relay or me.node_name < peer.node_name)


def waits_for(me: node_pb2.StageAssignment, peer: node_pb2.StageAssignment) -> bool:
    """Whether ``me``'s node lets outbound-only ``peer`` dial it (:func:`dials`) rather
    than dialing the peer's relayed address at once."""
    return bool(peer.relay) and dials(peer, me)


class StagePeers:
    """One stage's senders, one per peer address, over channels borrowed from a pool.

    Its senders share one gradient error feedback (:attr:`feedback`), keyed by the
    receiving stage, microbatch and shape (:func:`encode`): a stage sends gradients to
    one stage, whichever node holds it, and the residuals are part of the stage's
    checkpoint (:mod:`fedpipe.runtime.gradfeedback`).

    Args:
        pool: the node's channels.
        shaper_for: the emulated link to a peer, by the peer's node name (None: none).
        metrics: where the senders count the bytes they send (None: off).
        plane: the node's socket data plane (None: every peer over gRPC).
        pacer_for: the emulated socket link to a peer, by its node name (None: none).
        copier: how the socket senders stage a device tensor to host memory
            (:class:`SocketSender`; None: as :func:`encode` does).
    """

    def __init__(self, pool: ChannelPool,
                 shaper_for: Callable[[str], Shaper | None] = lambda name: None,
                 metrics: NodeMetrics | None = None, plane: dataplane.DataPlane | None = None,
                 pacer_for: Callable[[str], Pacer | None] = lambda name: None,
                 copier: staging.Copier | None = None):
        self.pool, self.shaper_for, self.metrics = pool, shaper_for, metrics
        self.plane, self.pacer_for, self.copier = plane, pacer_for, copier
        self._senders: dict[str, Sender] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.me: node_pb2.StageAssignment | None = None
        """This stage's own assignment (:meth:`connect`); None until it loaded."""
        self.job = ""
        """This stage's job (:meth:`connect`): its links through a relay are the job's
        alone (:meth:`fedpipe.net.dataplane.DataPlane.link`)."""
        self.feedback = codecs.ErrorFeedback()
        """The residuals of the gradients this stage's senders encoded (see above)."""

    def connect(self, me: node_pb2.StageAssignment,
                plan: Iterable[node_pb2.StageAssignment], job: str = "") -> list[threading.Thread]:
        """The stage ``me`` of ``job`` loaded with ``plan``'s assignments: remember which is
        this node's (to tell whether it is outbound-only) and the job (a link to a peer's
        relayed address is the job's alone: :func:`link`), and if it is (``me.relay``: behind NAT,
        homed at a relay), dial the data port of every other node of the plan this node
        is to dial (:func:`dials`) now, in the background, so that those that cannot dial
        it directly find its link when they first send (a failed dial is logged; the first
        send dials again and fails the stage if it must). Returns the dialing threads.
        """
        self.me, self.job = me, job
        if self.plane is None or not me.relay:
            return []
        plane, seen, threads = self.plane, {me.node_id}, []
        for a in plan:
            if a.node_id in seen or not a.data_address or not dials(me, a):
                continue
            seen.add(a.node_id)

            def dial(peer: node_pb2.StageAssignment = a) -> None:
                name, address = peer.node_name, peer.data_address
                try:
                    link(plane, peer, job)
                except dataplane.LinkFailed as e:
                    log.warning("outbound-only: cannot dial %s's data port at %s yet: %s",
                                name, address, e)
            th = threading.Thread(target=dial, daemon=True, name=f"dial-{a.node_name}")
            th.start()
            threads.append(th)
        return threads

    def sender(self, peer: node_pb2.StageAssignment) -> Sender:
        """The sender to ``peer``'s node (one per address): over the socket data plane
        when this node has one and the peer offers a data port, else over gRPC.

        A link between a reachable node and an outbound-only one (behind NAT) is dialed by
        the outbound-only one (:meth:`connect`): the reachable side waits up to
        :data:`~fedpipe.net.timeouts.REVERSE_DIAL_WAIT` for it, then dials the peer's
        relayed data address. Outbound-only and relayed links use the socket data plane
        only.

        Raises:
            StageError: the stage's peers were closed, the peer's data port cannot be
                reached, or this node or the peer is outbound-only and one of them has no
                socket data plane.
        """
        with self._lock:
            if self._closed:
                raise StageError("the stage has stopped sending")
            sender = self._senders.get(peer.address)
            if sender is not None:
                return sender
            if self.plane is None or not peer.data_address:
                if peer.relay or (self.me is not None and self.me.relay):
                    raise StageError(
                        f"sending to {peer.node_name} ({peer.address}) failed: a link to or "
                        f"from an outbound-only node (behind NAT) needs the socket data plane "
                        f"on both nodes, and " + ("this node has none" if self.plane is None
                                                 else f"{peer.node_name} offers no data port"),
                        peer=peer.address)
                ch = self.pool.acquire(peer.address, self.shaper_for(peer.node_name))
                sender = self._senders[peer.address] = PeerSender(
                    peer.address, ch, peer.node_name, self.metrics, self.feedback)
                return sender
        plane = self.plane
        if self.me is not None and waits_for(self.me, peer):  # let the peer dial: direct
            if plane.wait_dialed_by(peer.node_name, timeouts.REVERSE_DIAL_WAIT, self.job):
                log.info("data link to %s: it dialed this node (it is outbound-only)",
                         peer.node_name)
            else:
                log.warning("outbound-only %s did not dial this node within %.0f s: sending "
                            "through its relay %s (at %s)", peer.node_name,
                            timeouts.REVERSE_DIAL_WAIT, peer.relay, peer.data_address)
        try:
            to = link(plane, peer, self.job)
        except dataplane.LinkFailed as e:
            raise StageError(f"sending to {peer.node_name} ({peer.address}) failed: "
                             f"{e}", peer=peer.address) from None
        new = SocketSender(to, peer.address, peer.node_name, self.metrics,
                           self.pacer_for(peer.node_name), self.feedback, self.copier)
        with self._lock:
            sender = None if self._closed else self._senders.setdefault(peer.address, new)
        if sender is not new:
            new.close()
        if sender is None:
            raise StageError("the stage has stopped sending")
        return sender

    def _release(self, address: str, sender: Sender) -> None:
        sender.close()
        if isinstance(sender, PeerSender):
            self.pool.release(address)

    def _all(self) -> list[Sender]:
        with self._lock:
            return list(self._senders.values())

    def check(self) -> None:
        """Raise StageError if a send to any peer failed."""
        for s in self._all():
            s.check()

    def flush(self) -> None:
        """Wait until every peer has what was queued. Raises StageError if a send failed."""
        for s in self._all():
            s.flush()

    def settle(self) -> None:
        """Wait until every tensor submitted so far has been encoded and handed to its
        link or stream (a sender's encoder does both, so this may wait for the peer's
        credit, as long as the link's own timeouts let it): then :attr:`feedback` holds
        the residuals of every gradient submitted. A sender that was closed meanwhile
        encodes nothing more."""
        for s in self._all():
            try:
                s.encoder.submit(lambda: None).result()
            except RuntimeError:  # shut down (closed): nothing more is encoded
                pass

    def forget(self, address: str) -> None:
        """Drop the sender to ``address`` (its failure is dealt with: a peer of a replica
        group that was dropped); a later send to it starts afresh."""
        with self._lock:
            s = self._senders.pop(address, None)
        if s is not None:
            self._release(address, s)

    def keep_only(self, addresses: set[str]) -> None:
        """Drop the senders to every address but ``addresses`` (a new plan's nodes): one to
        a node that left the plan is not flushed at the stage's end. Over gRPC its stream
        failed when the node died; a socket link waits for the node to come back, so a
        sender left to it would fail the stage's last flush after the resume window."""
        with self._lock:
            gone = [a for a in self._senders if a not in addresses]
        for address in gone:
            self.forget(address)

    def close(self) -> None:
        """Stop every sender and let go of their channels (idempotent)."""
        with self._lock:
            senders, self._senders, self._closed = self._senders, {}, True
        for address, s in senders.items():
            self._release(address, s)
