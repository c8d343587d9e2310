"""The reading side of a peer link: what the peer sends, read one connection at a time.

A :class:`Reader` is the part of a :class:`~.link.Link` that takes the peer's records
off a connection, in order, until it breaks: each tensor goes to the link's
:class:`~.ends.Receiver`, or, if it answers one of this side's fetches, to that fetch
(:mod:`.fetch`); a tensor resent after a break that was delivered before is refused
as a duplicate by its sequence number. It keeps the inbound half of the link's state:
the peer's session and the sequence number it expects next (what this side's preface
says to resume from), and what it owes the peer (an acknowledgement, refusals). The
peer's other records are about this side's tensors or the link itself, and go to the
link (:class:`Outbound`): ACK and REFUSED, SYNC, GOAWAY, FETCH and FETCHED.

Acknowledgements are lazy: the reader owes one when a quarter of its window was
delivered since the last one, and at once when asked (``SYNC``: a sender out of
credit, or flushing) or when it refused a tensor. The link writes it
(:meth:`Outbound.drain`, :meth:`Reader.take_ack`) after the records queued before it.

Threads: one reader per connection, run by whoever attached it
(:meth:`.link.Link.attach`), and one at a time per link (:attr:`Reader.turn`). The
reader delivers received tensors to the receiver on its own thread, so a slow
receiver stops reading, and its sender runs out of credit. A receiver may leave
waking the thread that takes a tensor to the reader, which does it once it has read
what arrived with it (:meth:`.connection.Connection.later`).
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol

from ...proto import node_pb2
from ...wire import frames
from ...wire.format import WireError
from . import records
from .connection import Closed, Connection, read_head, read_tensor, skip_payload
from .ends import Peer, PeerRefused, Receiver, Refused
from .fetch import Fetches, take_answer
from .records import Code, Preface, RecordType

log = logging.getLogger(__name__)

_TENSOR, _SYNC, _ACK = RecordType.TENSOR, RecordType.SYNC, RecordType.ACK
"""The record types read most, as names of this module: reading an enum's member costs a
lookup in its metaclass, and these are read per record."""


class Outbound(Protocol):
    """What a :class:`Reader` needs of its link (:class:`.link.Link`): the peer, the
    sending side the peer's ACK and REFUSED records are about, the queue of control
    records this side writes, and the link's life.

    Attributes:
        peer_name: the peer's name (for logs).
        peer: the peer of the connection now attached (set before its reader runs).
    """

    peer_name: str
    peer: Peer | None

    def peer_acknowledged(self, seq: int) -> None:
        """The peer has every tensor below ``seq`` (its ACK)."""

    def peer_refused(self, seq: int, error: PeerRefused) -> None:
        """The peer refused tensor ``seq`` (its REFUSED); ``error`` is raised to its sender."""

    def enqueue(self, record: bytes) -> None:
        """Queue a control record after those queued before, for the next :meth:`drain`;
        writes nothing (the caller may hold the link's lock)."""

    def queued(self) -> bool:
        """Whether control records wait for a :meth:`drain`."""

    def drain(self) -> None:
        """Write the queued control records, and the acknowledgement owed
        (:meth:`Reader.take_ack`), unless another thread holds the write lock: it writes
        them when it lets go."""

    def goaway(self, conn: Connection, code: Code, why: str) -> None:
        """Tell the peer why the link ends (best effort)."""

    def broken(self, conn: Connection, why: str) -> None:
        """``conn`` broke: the link resumes on another one, or fails."""

    def fail(self, why: str) -> None:
        """Give the link up."""


class _GoAway(Exception):
    """The peer said GOAWAY: it will not take this link's tensors again."""


class Reader:
    """The reading side of one peer link, across the connections that carry it.

    Args:
        link: the link it reads for (:class:`Outbound`).
        receiver: where received tensors go.
        fetches: this side's fetches from the peer and its serving of the peer's.
        lock: the link's lock; it guards this reader's counters too (the link's
            :meth:`~Outbound.drain`, its preface and its attach read them under it).
        window_bytes, window_messages: the credit this side grants the peer: an
            acknowledgement is owed once a quarter of either was delivered since the last.

    Attributes:
        turn: held while a connection is read (and by the link while it attaches one):
            a replaced connection's reader may still be delivering a tensor; the next one
            waits for it, so a tensor is never delivered twice.
        peer_session: the peer's session whose tensors :attr:`expected` counts.
        expected: the sequence number of the next tensor to deliver.
        ack_due: whether an acknowledgement is owed (:meth:`take_ack`).
        duplicates: resent tensors refused by their sequence number.
        received: tensors delivered or refused.
    """

    def __init__(self, link: Outbound, receiver: Receiver, fetches: Fetches,
                 lock: threading.RLock, window_bytes: int, window_messages: int):
        self.link, self.receiver, self.fetches = link, receiver, fetches
        self.window_bytes, self.window_messages = window_bytes, window_messages
        self._lock = lock
        self.turn = threading.Lock()
        self.peer_session = ""
        self.expected = 0
        self._unacked = [0, 0]  # bytes, tensors delivered since the last ACK
        self.ack_due = False
        self.duplicates = 0
        self.received = 0

    def resume(self, theirs: Preface) -> None:
        """A connection with the peer's preface ``theirs`` is being attached (the caller
        holds the link's lock and :attr:`turn`): a new peer session, or a restarted one,
        counts from its base. The preface said what was delivered: no acknowledgement is
        owed (refusals still queued go out)."""
        if theirs.session != self.peer_session:  # a new peer, or one restarted
            self.peer_session, self.expected = theirs.session, theirs.base
        self._unacked, self.ack_due = [0, 0], False

    def take_ack(self) -> bytes | None:
        """The ACK record owed (of :attr:`expected`), then owed no more; None if none is.
        The caller holds the link's lock."""
        if not self.ack_due:
            return None
        self.ack_due, self._unacked = False, [0, 0]
        return records.pack(RecordType.ACK, self.expected)

    def read(self, conn: Connection) -> None:
        """Read ``conn`` until it breaks (the reader thread's loop); a protocol error or a
        GOAWAY fails the link. Returns when the connection is gone."""
        with self.turn:
            try:
                self._read_all(conn)
            finally:
                conn.run_later()  # wake-ups its last tensors put off

    def _read_all(self, conn: Connection) -> None:
        try:
            while not conn.closed:
                self._read_record(conn)
            raise Closed("the connection was replaced")
        except (Closed, OSError) as e:
            self.link.broken(conn, str(e) or type(e).__name__)
        except WireError as e:  # the peer broke the protocol: tell it why, give it up
            log.warning("data link from %s: %s", self.link.peer_name, e)
            self.link.goaway(conn, Code.INVALID_ARGUMENT, str(e))
            self.link.fail(f"protocol error: {e}")
        except _GoAway as e:
            self.link.fail(f"the peer ended the link: {e}")
        except Exception as e:  # noqa: BLE001 — a bug here must end the link, not hang it
            log.exception("data link from %s", self.link.peer_name)
            self.link.goaway(conn, Code.INTERNAL, f"the receiver failed: {e!r}")
            self.link.fail(f"the reader failed: {e!r}")

    def _read_record(self, conn: Connection) -> None:
        kind, arg = records.unpack(conn.read_exact(records.PREFIX_BYTES))
        conn.lift_deadline()  # the peer spoke (the deadline of a silent one after its preface)
        if kind is _TENSOR:
            self._on_tensor(conn, arg)
            return
        conn.run_later()  # what follows may write or wait: wake the stage threads first
        if kind is _ACK:
            self.link.peer_acknowledged(arg)
        elif kind is _SYNC:
            with self._lock:
                self.ack_due = True
            self.link.drain()
        elif kind is RecordType.REFUSED:
            code, text = _read_text(conn)
            self.link.peer_refused(arg, PeerRefused(records.code_of(code), text, arg))
        elif kind is RecordType.GOAWAY:
            code, text = _read_text(conn)
            raise _GoAway(f"{records.code_of(code).name}: {text}")
        elif kind is RecordType.FETCH:
            assert self.link.peer is not None  # set by attach, before the reader starts
            self.fetches.on_fetch(conn, arg, self.link.peer)
        elif kind is RecordType.FETCHED:
            code, text = _read_text(conn)
            self.fetches.ended(arg, code, text)
        else:
            raise WireError(f"a {kind.name} record in the middle of a connection")

    def _on_tensor(self, conn: Connection, seq: int) -> None:
        header = read_head(conn)
        nbytes = header.tensor.payload_bytes
        if seq != self.expected:
            if seq > self.expected:
                raise WireError(f"tensor sequence number {seq} skips {self.expected}")
            skip_payload(conn, header)  # resent, but delivered before: refused by its number
            self.duplicates += 1
            log.info("refused a duplicate tensor %d from %s (%s)", seq, self.link.peer_name,
                     _describe(header))
            return
        peer = self.link.peer
        assert peer is not None  # set by attach, before the reader starts
        if header.fetch:
            return self._on_answer(conn, seq, header)
        try:
            if peer.job:  # a link of one job alone (through a relay) takes no other's
                peer.check_job(header.envelope.job_id, "tensor")
            limit, end, pinned = frames.admitted(self.receiver.admit(peer, header))
        except Refused as e:
            skip_payload(conn, header)
            self._done(conn, seq, nbytes, e)
            return
        tensor = read_tensor(conn, header, limit, end, pinned)  # fields checked, then reserved
        try:
            wake = self.receiver.deliver(peer, header, tensor)
        except Refused as e:
            self._done(conn, seq, nbytes, e)
            return
        except Exception as e:  # noqa: BLE001 — a receiver's bug refuses one tensor, not the link
            log.exception("delivering a tensor from %s", self.link.peer_name)
            self._done(conn, seq, nbytes, Refused(Code.INTERNAL, f"the receiver failed: {e!r}"))
            return
        if wake is not None:  # woken once the reader has read what came with it
            conn.later(wake)
        self._done(conn, seq, nbytes)

    def _on_answer(self, conn: Connection, seq: int, header: node_pb2.Frame) -> None:
        """A tensor of the answer to one of this side's fetches: checked by the fetch's
        ``admit`` before its payload is read, then delivered to it. One the fetch refuses
        fails the fetch (never the link: the peer sent what it was asked for); one of a
        fetch not waited for any more is dropped."""
        conn.run_later()  # the fetch's delivery may wait: wake the stage threads first
        take_answer(conn, header, self.fetches.get(header.fetch))
        self._done(conn, seq, header.tensor.payload_bytes)

    def _done(self, conn: Connection, seq: int, nbytes: int,
              refused: Refused | None = None) -> None:
        """Tensor ``seq`` was delivered (or refused): count it; acknowledge when due (what
        ``conn``'s reader put off runs first: the write may wait)."""
        with self._lock:
            self.expected = seq + 1
            self.received += 1
            unacked = self._unacked
            unacked[0] += nbytes
            unacked[1] += 1
            if refused is not None:  # queued with the count: the ACK past it follows it
                self.link.enqueue(records.pack_text(RecordType.REFUSED, seq, refused.code,
                                                    str(refused)))
                self.ack_due = True
            if (4 * unacked[0] >= self.window_bytes
                    or 4 * unacked[1] >= self.window_messages):
                self.ack_due = True
        if self.ack_due or self.link.queued():
            conn.run_later()
            self.link.drain()


def _read_text(conn: Connection) -> tuple[int, str]:
    """A REFUSED, GOAWAY or FETCHED record's code and text."""
    code, size = records.TEXT.unpack(conn.read_exact(records.TEXT.size))
    if size > records.MAX_TEXT_BYTES:
        raise WireError(f"refusal text of {size} bytes exceeds {records.MAX_TEXT_BYTES}")
    return code, conn.read_exact(size).decode(errors="replace")


def _describe(header: node_pb2.Frame) -> str:
    e = header.envelope
    return (f"job {e.job_id!r} stage {e.stage} step {e.step} microbatch {e.microbatch} "
            f"kind {e.kind}" if header.HasField("envelope") else f"name {header.name!r}")
