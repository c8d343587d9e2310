"""One peer link: tensors both ways over one connection, credits, and resume after a break.

A :class:`Link` is this side's state for one peer: what it sent and the peer
has not acknowledged yet (kept for a resend), the sequence numbers both ways,
the credit the peer granted, and the connection now carrying it (none while
it is broken). The link outlives its connections: when one breaks, the
dialing side dials again, both sides exchange prefaces that say where each
resumes, the cut tensor and every later unacknowledged one are resent, and a
tensor the receiver already delivered is refused as a duplicate by its
sequence number.

The link keeps the sending side (sequence numbers, retained tensors, credit,
refusals to raise), the connection's life (attach, break, resume, fail) and the queue
of control records both sides write. What the peer sends is read by the link's
:class:`~.reading.Reader`: tensors delivered in order, duplicates refused, the
acknowledgements owed (lazy: :mod:`.reading`).

Threads: any number of senders (:meth:`Link.send`, :meth:`Link.flush`), and one
reader per connection (started by whoever attached it: :meth:`Link.read`), one at a
time (:mod:`.reading`). A reader never waits for the write lock (a sender may hold it
for the length of a large tensor, a staged one's copies after its first chunk
included, while its peer does the same): it queues its record and whoever holds the
lock writes it on release (:meth:`Link.drain`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from typing import Callable, NamedTuple, Sequence

import torch

from ...proto import node_pb2, tensor_pb2
from ...security.errors import SecurityError
from ...wire import codecs, format
from ...wire.format import WireError
from .. import timeouts as net_timeouts
from . import records
from .connection import Connection
from .staging import CopyFailed, Mark, check_marks, wait
from .credits import Credits, LinkFailed
from .ends import LinkEvents, Peer, PeerRefused, Receiver, owner_of
from .fetch import Admit, Deliver, Fetches, Server
from .reading import Reader
from .records import Code, Method, Preface, RecordType

log = logging.getLogger(__name__)

WINDOW_BYTES = 64 * 2**20
"""Credit a receiver grants by default, bytes of unacknowledged tensors."""
WINDOW_MESSAGES = 1024
"""Credit a receiver grants by default, unacknowledged tensors."""


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """A link's deadlines, seconds.

    Attributes:
        credit: a sender waits this long for credit (the receiver acknowledges
            nothing) before the link fails.
        resume: a broken connection must be replaced within this long (the
            dialer redials with backoff meanwhile), else the link fails.
        handshake: connect, TLS handshake and prefaces, each.
        backoff_min, backoff_max: the dialer's pause between redials, doubling.
        resync: a sender waiting for acknowledgements asks again this often.
        first_record: an accepted connection's TLS handshake and preface, in all
            (:data:`fedpipe.net.timeouts.DATA_FIRST_RECORD`).
        silent: an accepted connection of a link that carried nothing yet must send a
            record within this long of its preface, else it is closed
            (:data:`fedpipe.net.timeouts.DATA_SILENT_AFTER_PREFACE`).
    """

    credit: float = 600.0
    resume: float = 10.0
    handshake: float = 5.0
    backoff_min: float = 0.05
    backoff_max: float = 1.0
    resync: float = 1.0
    first_record: float = net_timeouts.DATA_FIRST_RECORD
    silent: float = net_timeouts.DATA_SILENT_AFTER_PREFACE


DEFAULT_TIMEOUTS = Timeouts()

_TENSOR, _SYNC = RecordType.TENSOR, RecordType.SYNC
"""The record types of every tensor sent, as names of this module: reading an enum's
member costs a lookup in its metaclass, and these are read per tensor."""


class _Quiet:
    def lost(self, peer: str, why: str) -> None:
        log.info("data connection to %s lost: %s", peer, why)

    def failed(self, peer: str, why: str) -> None:
        log.warning("data link to %s failed: %s", peer, why)


class _Out(NamedTuple):
    """A tensor sent and not acknowledged yet: what a resend writes again."""

    seq: int
    head: bytes          # record prefix and HEAD frame (prefix, header)
    payload: memoryview  # the tensor's own memory (or its codec output, or a staged copy)
    owner: str = ""      # its envelope's job and epoch (:func:`owner_of`): whose sender a
    #                      refusal of it is raised to
    marks: tuple[Mark, ...] = ()  # a staged payload's chunks (:mod:`.staging`): each
    #                               write, a resend too, waits for them


Dial = Callable[[], tuple[Connection, Preface, Peer]]
"""Open a new connection to the peer, prefaces exchanged (:meth:`Link.preface` sent)."""


class Link:
    """This side's state for one peer, across the connections that carry it.

    Args:
        name, role: this side's identity, for its prefaces.
        peer: the peer's name (its preface must say so).
        receiver: where received tensors go (by the link's :class:`~.reading.Reader`).
        events: where breaks and failures are reported.
        dial: opens a new connection (the dialing side), or None (the accepting
            side: the peer dials again).
        window_bytes, window_messages: the credit this side grants its peer.
        server: what answers the peer's fetches (:mod:`.fetch`; None: every FETCH is
            answered UNIMPLEMENTED).
    """

    def __init__(self, name: str, role: str, peer: str, receiver: Receiver, *,
                 events: LinkEvents | None = None, dial: Dial | None = None,
                 window_bytes: int = WINDOW_BYTES, window_messages: int = WINDOW_MESSAGES,
                 timeouts: Timeouts = DEFAULT_TIMEOUTS, server: Server | None = None):
        self.name, self.role, self.peer_name = name, role, peer
        self.events, self.server = events or _Quiet(), server
        self.fetches = Fetches(peer, name, server, self._queue,
                               lambda n, t, fetch: self.send(t, name=n, fetch=fetch))
        self.dial, self.timeouts = dial, timeouts
        self.window_bytes, self.window_messages = window_bytes, window_messages
        self.session = secrets.token_hex(8)
        self.peer: Peer | None = None
        self._wlock = threading.Lock()      # one record at a time on the stream
        # everything below, and the reader's counters; the hot paths take the condition's
        # own lock (``_lock``), whose ``with`` costs half a Condition's, where they neither
        # wait nor notify
        self._lock = threading.RLock()
        self._state = threading.Condition(self._lock)
        self.conn: Connection | None = None
        self.closed = False
        # outbound
        self.next_seq = 0
        self.retained: collections.deque[_Out] = collections.deque()
        self.credits = Credits(window_bytes, window_messages)  # the peer's, once it says
        # refusals not raised yet, by the refused tensor's job ("": not known); one link
        # carries every stage's tensors to the peer, so each job's sender sees only its own
        self.refused: dict[str, PeerRefused] = {}
        self._control: list[bytes] = []  # control records to write (:meth:`drain`)
        self.reader = Reader(self, receiver, self.fetches, self._lock, window_bytes,
                             window_messages)

    def __repr__(self) -> str:
        return f"Link({self.name} <-> {self.peer_name}, {'up' if self.conn else 'down'})"

    # -- sending -------------------------------------------------------------
    def check(self, owner: str | None = None) -> None:
        """Raise what the peer refused, or why the link failed.

        ``owner`` (:func:`owner_of`): raise only a refusal of that job epoch's tensors
        (or of a tensor whose job is not known); None: any refusal.

        Raises:
            PeerRefused: the peer refused a tensor sent earlier (raised once).
            LinkFailed: the link is gone.
        """
        if not self.refused and self.credits.failed is None:  # each send: no lock when clear
            return
        with self._state:
            keys = list(self.refused) if owner is None else [k for k in (owner, "")
                                                            if k in self.refused]
            error = self.refused.pop(keys[0]) if keys else None
        if error is not None:
            raise error
        self._check_up()

    def _check_up(self) -> None:
        """Raise LinkFailed if the link is gone."""
        if self.credits.failed is not None:
            raise LinkFailed(f"link to {self.peer_name}: {self.credits.failed}")

    def send(self, tensor: torch.Tensor, *, envelope: node_pb2.Envelope | None = None,
             name: str = "", codec: str = "raw", flush: bool = False, fetch: int = 0) -> int:
        """Send ``tensor`` (encoded with ``codec``) with its ``envelope`` or ``name``;
        ``fetch``: as a tensor of the answer to the peer's fetch of that id (:mod:`.fetch`).

        A raw CPU tensor is written from its own memory: it must not be changed
        in place until the peer acknowledged it (:meth:`flush`). Blocks while the
        peer's credit is used up. Returns the tensor's sequence number.
        ``flush``: then wait as :meth:`flush` through this tensor does, its SYNC
        written with the tensor (one write; what ``SendOne`` is on gRPC: one tensor,
        answered).

        Raises:
            PeerRefused: the peer refused a tensor sent earlier.
            LinkFailed: the link failed, or no credit came back in time.
            WireError: the tensor cannot be encoded.
        """
        raw = codecs.raw_payload(tensor) if codec == "raw" else None
        if raw is None:
            msg, payload = codecs.encode_payload(tensor, codec)
            return self.send_encoded(msg, payload, envelope=envelope, name=name, flush=flush,
                                     fetch=fetch)
        owner = self._sender_check(envelope, fetch)
        header, payload = raw  # the header serialized: framed as it is
        return self._send(format.pack_head_of(envelope, header, name, fetch), payload, owner,
                          flush)

    def send_encoded(self, msg: tensor_pb2.Tensor, payload: memoryview, *,
                     envelope: node_pb2.Envelope | None = None, name: str = "",
                     flush: bool = False, fetch: int = 0, marks: Sequence[Mark] = ()) -> int:
        """:meth:`send` of a tensor already encoded
        (:func:`~fedpipe.wire.codecs.encode_payload`), or staged from a device
        (:func:`.staging.stage`): then ``payload`` is the host buffer being filled and
        ``marks`` its chunks; each is written once its copy is done
        (:meth:`~.connection.Connection.write_staged`), and a resend writes the same buffer.
        The first chunk's copy, which waits for the kernels that made the tensor, is
        waited for before the write lock is taken: the link's other senders and its
        acknowledgements are not kept waiting by a device's computation.

        Raises:
            As :meth:`send`; ValueError: ``marks`` do not cover ``payload`` exactly.
            CopyFailed: the first chunk's copy failed (nothing was sent). LinkFailed: a
            later chunk's copy failed (the link fails: :meth:`_write_out`).
        """
        chunks: tuple[Mark, ...] = ()
        if marks:
            chunks = tuple(marks)
            check_marks(chunks, len(payload))
            wait(chunks[0], 0)
        owner = self._sender_check(envelope, fetch)
        if msg.payload_bytes != len(payload):  # the header says the payload's length
            fixed = tensor_pb2.Tensor()
            fixed.CopyFrom(msg)
            fixed.payload_bytes = len(payload)
            msg = fixed
        return self._send(format.pack_head_of(envelope, msg, name, fetch), payload, owner,
                          flush, chunks)

    def _sender_check(self, envelope: node_pb2.Envelope | None, fetch: int) -> str:
        """Raise what a send raises before it writes (:meth:`check`; for a fetch's answer,
        only a failed link); the tensor's owner (:func:`owner_of`)."""
        owner = owner_of(envelope)
        if fetch:  # an answer is never refused: others' refusals stay theirs
            self._check_up()
        else:
            self.check(owner)
        return owner

    def _send(self, frame_head: bytes, payload: memoryview, owner: str, flush: bool,
              chunks: tuple[Mark, ...] = ()) -> int:
        """The rest of :meth:`send_encoded`, the tensor framed (``frame_head``: its HEAD wire
        frame's prefix and header, :func:`~fedpipe.wire.format.pack_head_of`; ``chunks``: a
        staged payload's marks)."""
        if not self.credits.try_take(len(payload)):
            self._sync()  # ask for the acknowledgements that give credit back
            self.credits.take(len(payload), self.timeouts.credit, f" by {self.peer_name}")
        with self._wlock:
            with self._lock:
                seq = self.next_seq
                self.next_seq = seq + 1
                out = _Out(seq, records.pack(_TENSOR, seq) + frame_head, payload, owner,
                           chunks)
                self.retained.append(out)
                conn = self.conn
            if conn is not None:  # else the tensor goes when the link resumes
                if chunks:
                    sync = (records.pack(_SYNC, seq + 1),) if flush else ()
                    self._write_out(conn, out, *sync)
                elif flush:
                    self._write(conn, out.head, payload, records.pack(_SYNC, seq + 1))
                else:
                    self._write(conn, out.head, payload)
        if self._control or self.reader.ack_due:
            self.drain()
        if flush:
            self._wait_idle(None, owner, seq)
        return seq

    def flush(self, timeout: float | None = None, owner: str | None = None,
              through: int | None = None) -> None:
        """Wait until the peer acknowledged every tensor sent, or with ``through`` every
        one up to that number (:meth:`send`'s; what one sender waits for: the link is
        shared, and others' tensors may keep it busy for as long as they run); then raise
        a refusal of ``owner``'s tensors as :meth:`check` does.

        Raises:
            PeerRefused: the peer refused one of them.
            LinkFailed: the link failed, or ``timeout`` (default: the credit
                timeout) passed first.
        """
        self._sync()
        self._wait_idle(timeout, owner, through)

    def fetch(self, method: Method, request: bytes, admit: Admit, deliver: Deliver,
              timeout: float) -> int:
        """Ask the peer for what ``method`` answers ``request`` with: :meth:`.fetch.Fetches.ask`.

        Raises:
            LinkFailed: the link failed; and what :meth:`.fetch.Fetches.ask` raises.
        """
        self._check_up()
        return self.fetches.ask(method, request, admit, deliver, timeout)

    def _wait_idle(self, timeout: float | None, owner: str | None = None,
                   through: int | None = None) -> None:
        """Wait until the peer acknowledged everything (or every tensor up to ``through``),
        asking again (a SYNC) every :attr:`Timeouts.resync` seconds meanwhile: an
        acknowledgement is the one record a waiting sender depends on, and asking again
        costs a 16-byte record."""
        timeout = self.timeouts.credit if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self._acknowledged(through, min(self.timeouts.resync,
                                                  max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self.credits.fail(f"{self.credits.messages_out} tensors unacknowledged by "
                                  f"{self.peer_name} after {timeout} s")
                break
            self._sync()
        self.check(owner)

    def _acknowledged(self, through: int | None, timeout: float) -> bool:
        """Wait up to ``timeout`` s as :meth:`flush` does (or for the link to fail)."""
        if through is None:
            return self.credits.wait_idle(timeout)
        with self._state:
            return self._state.wait_for(
                lambda: self.credits.failed is not None or not self.retained
                or self.retained[0].seq > through, timeout)

    def _sync(self) -> None:
        with self._state:
            self._control.append(records.pack(RecordType.SYNC, self.next_seq))
        self.drain()

    def _queue(self, record: bytes) -> None:
        """Write a control record soon (:meth:`drain`), after the tensors written before."""
        self.enqueue(record)
        self.drain()

    def enqueue(self, record: bytes) -> None:
        """Queue a control record after those queued before, for the next :meth:`drain`;
        writes nothing (the caller may hold the link's lock: the reader queues a refusal
        with its count, so the ACK past it follows it)."""
        with self._state:
            self._control.append(record)

    def queued(self) -> bool:
        """Whether control records wait for a :meth:`drain`."""
        return bool(self._control)

    def _write(self, conn: Connection, *parts: bytes | memoryview) -> None:
        """Write on ``conn`` (the write lock held); a failure breaks it (the link resumes)."""
        try:
            conn.write(*parts)
        except OSError as e:
            self.broken(conn, f"write failed: {e}")

    def _write_out(self, conn: Connection, out: _Out, *tail: bytes) -> None:
        """Write tensor ``out`` (and ``tail``) on ``conn`` (the write lock held): a staged
        one chunk by chunk as its copies complete; a failure breaks ``conn``.

        Raises:
            LinkFailed: a staged chunk's copy failed (:class:`.staging.CopyFailed`): the
                link fails, as the record may be cut on the stream and can never be
                completed or resent (its sequence number would be missing).
        """
        try:
            if out.marks:
                conn.write_staged(out.head, out.payload, out.marks, *tail)
            else:
                conn.write(out.head, out.payload, *tail)
        except OSError as e:
            self.broken(conn, f"write failed: {e}")
        except CopyFailed as e:
            why = f"tensor {out.seq} cannot be sent: {e}"
            self.fail(why)
            raise LinkFailed(f"link to {self.peer_name}: {why}") from e

    def drain(self) -> None:
        """Write the queued control records, and the acknowledgement the reader owes
        (:meth:`.reading.Reader.take_ack`), unless another thread holds the write lock: it
        drains them after its own record (see the module docstring)."""
        reader = self.reader
        while (self._control or reader.ack_due) and self._wlock.acquire(blocking=False):
            try:
                with self._state:
                    conn = self.conn
                    if conn is None:
                        return  # the next connection's prefaces say it all
                    recs, self._control = self._control, []
                    ack = reader.take_ack()
                    if ack is not None:
                        recs.append(ack)
                self._write(conn, b"".join(recs))
            finally:
                self._wlock.release()

    # -- connections ----------------------------------------------------------
    def preface(self) -> Preface:
        """This side's preface for a new connection: where the peer should resume."""
        with self._state:
            base = self.retained[0].seq if self.retained else self.next_seq
            return Preface(name=self.name, role=self.role, session=self.session, base=base,
                           resume_session=self.reader.peer_session,
                           resume=self.reader.expected,
                           window_bytes=self.window_bytes,
                           window_messages=self.window_messages)

    def attach(self, conn: Connection, theirs: Preface, peer: Peer) -> None:
        """Carry the link over ``conn`` from now on (prefaces exchanged): forget what the
        peer says it has, resend the rest in order. The caller then runs :meth:`read`.

        Raises:
            LinkFailed: the link is closed or failed.
        """
        with self._state:
            old, self.conn = self.conn, None
        if old is not None:
            old.close()  # a writer or reader stuck on it returns, and lets go of its lock
        with self.reader.turn, self._wlock:
            with self._state:
                if self.closed or self.credits.failed is not None:
                    conn.close()
                    raise LinkFailed(f"link to {self.peer_name} is closed")
                self.peer = peer
                self.reader.resume(theirs)  # refusals still queued go out below
                if theirs.resume_session == self.session:
                    self._forget_below(theirs.resume)
                self.credits.regrant(theirs.window_bytes, theirs.window_messages)
                resend = list(self.retained)
                self.conn = conn
                self._state.notify_all()
            for out in resend:
                self._write_out(conn, out)
            if resend:
                self._control.append(records.pack(RecordType.SYNC, self.next_seq))
        self.drain()

    def _forget_below(self, seq: int) -> None:
        """The peer has every tensor below ``seq``: drop them, give their credit back."""
        nbytes = count = 0
        while self.retained and self.retained[0].seq < seq:
            nbytes += len(self.retained.popleft().payload)
            count += 1
        if count:
            self.credits.give_back(nbytes, count)
            self._state.notify_all()  # a flush through a sequence number looks again

    def broken(self, conn: Connection, why: str) -> None:
        """``conn`` broke (a write failed, or its reader's read did): let it go, and report
        the loss; the link resumes on another connection, or fails."""
        with self._state:
            if self.conn is not conn:
                return  # already replaced or reported
            self.conn = None
        conn.close()
        self.fetches.broken(why)
        if not self.closed:
            self.events.lost(self.peer_name, why)

    def fail(self, why: str) -> None:
        """Give the link up: senders raise LinkFailed, the connection closes."""
        with self._state:
            conn, self.conn = self.conn, None
            first = self.credits.failed is None and not self.closed
            self._state.notify_all()
        self.credits.fail(why)
        self.fetches.broken(why)
        with self._state:
            self.retained.clear()  # nothing will be resent: let the tensors go
            self._state.notify_all()
        if conn is not None:
            conn.close()
        if first:
            self.events.failed(self.peer_name, why)

    def close(self) -> None:
        """Close the link on purpose (no event is reported)."""
        with self._state:
            self.closed = True
        self.fail("closed by this side")

    # -- reading (:mod:`.reading`) --------------------------------------------
    def read(self, conn: Connection) -> None:
        """Read ``conn`` until it breaks (the reader thread's loop:
        :meth:`.reading.Reader.read`); a protocol error or a GOAWAY fails the link. Returns
        when the connection is gone."""
        self.reader.read(conn)

    def goaway(self, conn: Connection, code: Code, why: str) -> None:
        """Tell the peer why the link ends (the reader, on a protocol error or its own
        failure): best effort, and never behind a writer stuck on a peer that stopped
        reading."""
        if self._wlock.acquire(timeout=self.timeouts.handshake):
            try:
                conn.write(records.pack_text(RecordType.GOAWAY, 0, code, why))
            except OSError:
                pass
            finally:
                self._wlock.release()

    def peer_acknowledged(self, seq: int) -> None:
        """The peer has every tensor below ``seq`` (its ACK, read by the reader)."""
        with self._state:
            self._forget_below(seq)

    def peer_refused(self, seq: int, error: PeerRefused) -> None:
        """The peer refused tensor ``seq`` (its REFUSED, read by the reader): keep ``error``
        for the sender of that tensor's job (:meth:`check`)."""
        with self._state:  # the refused tensor is retained until its ACK, which follows
            owner = next((o.owner for o in self.retained if o.seq == seq), "")
            self.refused.setdefault(owner, error)

    @property
    def duplicates(self) -> int:
        """Resent tensors the reader refused by their sequence number."""
        return self.reader.duplicates

    @property
    def received(self) -> int:
        """Tensors the reader delivered or refused."""
        return self.reader.received

    @property
    def fresh(self) -> bool:
        """Whether the link has carried no tensor either way yet."""
        with self._state:
            return (self.next_seq == 0 and self.reader.expected == 0
                    and self.reader.received == 0)

    def wait_up(self, timeout: float) -> bool:
        """Wait until a connection carries the link (or it fails); whether it does."""
        with self._state:
            return self._state.wait_for(
                lambda: self.conn is not None or self.credits.failed is not None, timeout
            ) and self.conn is not None

    def await_resume(self) -> None:
        """The accepting side after a break: wait for the peer to dial again, else fail."""
        if not self.wait_up(self.timeouts.resume) and not self.closed:
            self.fail(f"{self.peer_name} did not reconnect within {self.timeouts.resume} s")

    def redial(self) -> None:
        """The dialing side after a break: dial with backoff until the link resumes (then
        read it, and so on), or fail it after ``timeouts.resume`` without a connection."""
        assert self.dial is not None
        pause, deadline = self.timeouts.backoff_min, time.monotonic() + self.timeouts.resume
        while not self.closed and self.credits.failed is None:
            try:
                conn, theirs, peer = self.dial()
            except (OSError, WireError, SecurityError) as e:  # SecurityError: e.g. revoked
                if time.monotonic() + pause > deadline:
                    self.fail(f"cannot reach {self.peer_name} again within "
                              f"{self.timeouts.resume} s: {e}")
                    return
                time.sleep(pause)
                pause = min(2 * pause, self.timeouts.backoff_max)
                continue
            try:
                self.attach(conn, theirs, peer)
            except LinkFailed:
                return
            self.read(conn)
            pause, deadline = self.timeouts.backoff_min, time.monotonic() + self.timeouts.resume

