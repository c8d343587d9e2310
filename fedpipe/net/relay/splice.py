"""Many byte streams over one home connection: both ends of a relay's splice. No torch.

A :class:`Home` runs on each end of a home connection (the relay's and the
node's). Each *stream* pairs one ordinary socket on this side (on the relay, a
peer's connection to one of the node's relayed ports; on the node, a loopback
connection to its own gRPC or data port) with the same stream on the other side.
Each stream has two threads: one reads its socket and sends DATA records, one
writes the DATA it receives to its socket. Bytes pass through untouched (with
TLS they are the two endpoints' ciphertext).

Flow control is per stream and per direction (as HTTP/2's and QUIC's): a side
sends at most ``window`` bytes the other has not yet written onward, and the
other returns them with CREDIT records as its socket takes them. So one slow
socket never stalls the other streams, and a side holds at most ``window`` bytes
per stream and direction: ``max_streams * window`` per homed node and direction.

A stream whose dialer says which job it serves (a ``TAG`` record, in the clear, before
its bytes: :class:`~.records.Tag`) counts against that job's share of the node: at
most ``job_streams`` streams, and ``job_window`` bytes in flight per direction for all
of them together (both ends wait for the job's CREDIT, as for a stream's). So one job
flooding a relay takes its share, and the other jobs' streams still flow; a job past
its streams is refused, with a REFUSED record naming the job (nodes' and clients'
data-plane links through a relay are tagged: one per peer and job). Untagged streams
(gRPC channels: shared by jobs) have the stream bounds only.

Closing is TCP's: a socket's end of stream becomes FIN (the other side then
shuts its socket's writing half down: a half-close); an error on either side
becomes RESET (both ways, at once). A stream ends when both directions finished
or on RESET. A home connection that breaks ends every stream on it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import select
import socket
import threading
import time
from typing import Callable

from .. import timeouts
from . import records
from .records import RecordType, RelayError, RelayRefused

log = logging.getLogger(__name__)

WINDOW = 4 << 20
"""Default bytes one direction of one stream may have in flight (sent, not yet credited):
enough for 100 Mbit/s at 300 ms round trip, and what a relay buffers at most per stream
and direction."""
MAX_STREAMS = 256
"""Default streams spliced at once for one homed node (a node has a few per peer: gRPC
channels and one data-plane link)."""
SOURCE_SHARE = 2
"""One source address (a dialer's host) may hold at most ``max_streams // SOURCE_SHARE``
(at least 1) of a node's streams at the relay."""
JOB_SHARE = 4
"""One job's tagged streams may be at most ``max_streams // JOB_SHARE`` (at least 1) of a
node's streams at the relay (the default of ``job_streams``)."""
JOB_WINDOW = 2 * WINDOW
"""Default bytes one direction of one job's tagged streams may have in flight, all
together: a job holds at most this much at the relay per node and direction, whatever
its streams."""

PEEK_AGAIN = 0.005
"""Seconds the relay waits before it looks again at a dialer's first bytes that are a part
of a TAG's magic (the rest is on its way; select would say "readable" at once)."""

Connect = Callable[[records.Open], socket.socket]
"""The node side's way to a new stream's socket (a loopback connection to its own port)."""


def tune(sock: socket.socket) -> None:
    """Options every relay connection gets (home connections and spliced ones)."""
    # records and small gRPC frames are written whole; Nagle would hold one back for an ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux: the kernel probes an idle peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE,
                        max(1, round(timeouts.KEEPALIVE_TIME)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                        max(1, round(timeouts.KEEPALIVE_TIMEOUT / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes of ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
        OSError: it broke, or a timeout set on it passed.
    """
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class _Stream:
    """One spliced stream: this side's socket and its two pumps."""

    def __init__(self, home: "Home", sid: int, sock: socket.socket | None,
                 opened: records.Open, connect: Connect | None):
        self.home, self.sid, self.sock, self.opened = home, sid, sock, opened
        self._connect = connect
        self._cond = threading.Condition()
        self.credit = home.window          # bytes this side may still send
        self.inbound: collections.deque[bytes | None] = collections.deque()  # None: FIN
        self.unacked = 0                   # bytes received, not yet credited back
        self.reset = ""                    # why the stream was reset ("": it was not)
        self._done = 0                     # pumps that ended (the stream ends at 2)
        self.heard = False                 # this side's socket has sent a byte
        self.job = opened.job              # the job its TAG named ("": untagged)
        self.job_sent = 0                  # bytes counted in the job's in-flight bytes

    def start(self) -> None:
        threading.Thread(target=self._write_loop, name=f"relay-w{self.sid}",
                         daemon=True).start()

    # -- from the home connection -------------------------------------------
    def on_data(self, data: bytes) -> None:
        if self.job:
            held = self.home.held(self.job) + len(data)
            if held > self.home.job_window:
                raise RelayError(f"job {self.job!r} has {held} bytes in flight on stream "
                                 f"{self.sid} and its others, beyond its window of "
                                 f"{self.home.job_window}: the other side ignores its credit")
        with self._cond:
            self.unacked += len(data)
            if self.unacked > self.home.window:
                raise RelayError(f"stream {self.sid} received {self.unacked} bytes beyond "
                                 f"its window of {self.home.window}: the other side ignores "
                                 "credit")
            self.inbound.append(data)
            self._cond.notify_all()

    def on_credit(self, n: int) -> None:
        with self._cond:
            self.credit += n
            self._cond.notify_all()
        self.home.unreserve(self, n)

    def on_fin(self) -> None:
        with self._cond:
            self.inbound.append(None)
            self._cond.notify_all()

    def on_reset(self, why: str) -> None:
        with self._cond:
            self.reset = why or "reset"
            self._cond.notify_all()
        self.home.wake()
        self._shut(socket.SHUT_RDWR)

    # -- pumps ----------------------------------------------------------------
    def _shut(self, how: int) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(how)
            except OSError:
                pass

    def _write_loop(self) -> None:
        """Home connection -> socket; on the node side it first connects the socket."""
        if self.sock is None and self._connect is not None:
            try:
                self.sock = self._connect(self.opened)
            except OSError as e:
                self._fail(f"{self.home.side} could not connect stream {self.sid} to its "
                           f"{self.opened.service} port: {e}")
                self._end()
                self._end()
                return
        threading.Thread(target=self._read_loop, name=f"relay-r{self.sid}",
                         daemon=True).start()
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self.inbound or self.reset)
                    if self.reset:
                        return
                    data = self.inbound.popleft()
                if data is None:
                    self._shut(socket.SHUT_WR)
                    return
                assert self.sock is not None
                self.sock.sendall(data)
                with self._cond:
                    self.unacked -= len(data)
                self.home.send(records.pack(RecordType.CREDIT, self.sid, len(data)))
        except OSError as e:
            self._fail(f"stream {self.sid}: writing to its socket failed: {e}")
        finally:
            self._end()

    def _read_loop(self) -> None:
        """Socket -> home connection, within the other side's credit for the stream and for
        its job; on the relay, first the dialer's first byte within the home's
        ``first_byte`` seconds, its TAG if it starts with one, and the stream's OPEN."""
        assert self.sock is not None
        try:
            if self._connect is None:
                self._announce()
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self.credit > 0 or self.reset)
                    if self.reset:
                        return
                    n = min(self.credit, records.MAX_CHUNK)
                n = self.home.reserve(self, n)
                if not n:  # reset while it waited for its job's credit
                    return
                data = self.sock.recv(n)
                self.heard = True
                self.home.unreserve(self, n - len(data))
                if not data:
                    with self._cond:
                        if self.reset:
                            return
                    self.home.send(records.pack(RecordType.FIN, self.sid))
                    return
                with self._cond:
                    self.credit -= len(data)
                self.home.send(records.pack(RecordType.DATA, self.sid, len(data)) + data)
        except OSError as e:
            self._fail(f"stream {self.sid}: reading its socket failed: {e}")
        finally:
            self._end()

    def _announce(self) -> None:
        """The relay side: wait for the dialer's first bytes (within the home's
        ``first_byte`` seconds), take its TAG if it starts with one, then OPEN the stream
        at the node (so a dialer that never speaks costs the node nothing).

        Raises:
            OSError: nothing came in time (:class:`TimeoutError`), the socket broke, or a
                malformed or refused TAG (:class:`RelayError`; the dialer was told why).
        """
        assert self.sock is not None
        wait = self.home.first_byte
        deadline = None if wait is None else time.monotonic() + wait
        while True:  # enough of the first bytes to tell a TAG (its magic) from the rest
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                raise TimeoutError(f"the dialer {self.opened.source} sent nothing within "
                                   f"{wait:g} s")
            head = self.sock.recv(len(records.MAGIC), socket.MSG_PEEK)
            if not head or len(head) == len(records.MAGIC) \
                    or not records.MAGIC.startswith(head):
                break  # (none: the dialer closed, or the stream was reset meanwhile)
            # a part of the magic: the rest is on its way, within the same deadline (the
            # part stays readable, so select alone would never time out)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the dialer {self.opened.source} sent {len(head)} "
                                   f"bytes of a TAG, then nothing within {wait:g} s")
            time.sleep(PEEK_AGAIN)
        self.heard = True
        with self._cond:
            if self.reset:
                return
        if head == records.MAGIC:  # no protocol a relay splices starts so (TLS, FPC, HTTP/2)
            self._tagged(deadline)
        self.home.send(self.opened.encode(self.sid))

    def _tagged(self, deadline: float | None) -> None:
        """Read the dialer's TAG, have the home admit it, answer ACCEPTED (or REFUSED).

        Raises:
            RelayError: a malformed TAG, or the home refused it (RelayRefused, naming the
                job); the dialer was told why.
            OSError: the socket broke or the TAG did not come whole before ``deadline``.
        """
        assert self.sock is not None
        self.sock.settimeout(None if deadline is None
                             else max(0.001, deadline - time.monotonic()))
        try:
            kind, _, arg = records.unpack(read_exact(self.sock, records.PREFIX_BYTES))
            if kind is not RecordType.TAG or arg > records.MAX_BODY:
                raise RelayError(f"a relayed connection may start with a TAG record of at "
                                 f"most {records.MAX_BODY} bytes, not {kind.name} ({arg})")
            self.home.admit(self, records.Tag.decode(read_exact(self.sock, arg)))
            self.sock.sendall(records.pack(RecordType.ACCEPTED))
        except RelayError as e:
            try:
                self.sock.sendall(records.pack_text(RecordType.REFUSED, 0, str(e)))
            except OSError:
                pass
            raise
        finally:
            self.sock.settimeout(None)

    def _fail(self, why: str) -> None:
        """Reset the stream both ways, telling the other side why."""
        with self._cond:
            if self.reset:
                return
            self.reset = why
            self._cond.notify_all()
        self.home.wake()
        log.debug("%s", why)
        self._shut(socket.SHUT_RDWR)
        try:
            self.home.send(records.pack_text(RecordType.RESET, self.sid, why))
        except OSError:
            pass  # the home connection is gone: the other side ends the stream anyway

    def _end(self) -> None:
        with self._cond:
            self._done += 1
            over = self._done == 2
        if over:
            if self.sock is not None:
                self.sock.close()
            self.home.unreserve(self, self.job_sent)
            self.home.forget(self.sid)


class Home:
    """One end of a home connection: the streams spliced over it.

    Args:
        sock: the connected home connection (an ``ssl.SSLSocket`` under TLS), after the
            HELLO and ALLOCATED records.
        side: "relay R for node N" or "node N at relay R", for messages.
        window: bytes per stream and direction in flight (the ALLOCATED record's).
        max_streams: streams at once, at most ``max_streams // SOURCE_SHARE`` (at least 1)
            from one source host; past either bound :meth:`splice` makes room by closing
            the oldest stream (of that source, for its bound) whose dialer has sent nothing
            yet, else it refuses the new one.
        job_streams: tagged streams of one job at once (default ``max_streams //
            JOB_SHARE``, at least 1); the relay side refuses the job's next TAG.
        job_window: bytes in flight per direction on one job's tagged streams together
            (the ALLOCATED record's; default :data:`JOB_WINDOW`).
        connect: the node side's way to open a stream's local socket (OPEN records are a
            protocol error on the relay side, which passes None).
        first_byte: the relay side: a spliced dialer that sends nothing for this many
            seconds is closed (None: no bound; the node side's streams connect to its own
            ports, which may wait).
    """

    def __init__(self, sock: socket.socket, side: str, *, window: int = WINDOW,
                 max_streams: int = MAX_STREAMS, connect: Connect | None = None,
                 first_byte: float | None = None, job_streams: int | None = None,
                 job_window: int = JOB_WINDOW):
        self.sock, self.side, self.window = sock, side, window
        self.job_streams = job_streams or max(1, max_streams // JOB_SHARE)
        self.job_window = job_window
        self._budget = threading.Condition()  # guards _inflight
        self._inflight: collections.Counter[str] = collections.Counter()
        self.max_streams, self._connect = max_streams, connect
        self.first_byte = first_byte
        self.per_source = max(1, max_streams // SOURCE_SHARE)
        self.displaced = ""
        """Why the relay displaced this node (the node side: another process homed under
        its name); "" if it did not."""
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._next = 1
        self.closed = threading.Event()
        self.error = ""
        """Why the home connection ended ("" while it runs, or on a clean close)."""
        self._rfile = sock.makefile("rb", buffering=records.MAX_CHUNK + records.PREFIX_BYTES)

    @property
    def streams(self) -> int:
        """Streams spliced now."""
        with self._lock:
            return len(self._streams)

    def send(self, record: bytes) -> None:
        """Write one whole record to the home connection (records never interleave).

        Raises:
            OSError: the home connection is broken.
        """
        with self._wlock:
            self.sock.sendall(record)

    def splice(self, sock: socket.socket, opened: records.Open) -> int:
        """Relay side: splice a peer's new connection ``sock`` to the node; return its stream id.

        Raises:
            RelayError: ``max_streams`` streams already run, or ``per_source`` from
                ``opened.source``'s host, none of them idle (the caller closes ``sock``).
        """
        host = opened.source.rpartition(":")[0]
        with self._lock:
            evict: list[_Stream] = []
            for held, most, bound in (
                    ([s for s in self._streams.values()
                      if s.opened.source.rpartition(":")[0] == host], self.per_source,
                     f"{self.per_source} streams from {host}"),
                    (list(self._streams.values()), self.max_streams,
                     f"{self.max_streams} streams")):
                if len(held) - sum(s in held for s in evict) < most:
                    continue
                idle = next((s for s in held if not s.heard and s not in evict), None)
                if idle is None:
                    raise RelayError(f"{self.side}: {bound} already spliced, its limit")
                evict.append(idle)
            for s in evict:
                self._streams.pop(s.sid, None)
            sid = self._next
            self._next += 1
            stream = _Stream(self, sid, sock, opened, None)
            self._streams[sid] = stream
        for s in evict:
            s._fail(f"{self.side}: the stream sent nothing yet, and a new connection needs "
                    "its place")
        stream.start()  # its OPEN goes to the node once the dialer spoke (_announce)
        return sid

    def admit(self, stream: _Stream, tag: records.Tag) -> None:
        """Relay side: take a stream's TAG: it carries ``tag.job`` from now on.

        Raises:
            RelayRefused: the TAG names another node than this home's, or the job has
                ``job_streams`` streams here already (the message names the job).
        """
        who = f"a stream of job {tag.job!r} from {tag.source or stream.opened.source}"
        with self._lock:
            if tag.destination != stream.opened.destination:
                raise RelayRefused(f"{self.side}: {who} is for node {tag.destination!r}, but "
                                   f"this port is for node {stream.opened.destination!r}")
            held = sum(1 for s in self._streams.values() if s.job == tag.job)
            if held >= self.job_streams:
                raise RelayRefused(f"{self.side}: {who} is refused: job {tag.job!r} has "
                                   f"{held} streams spliced, its share of the node's "
                                   f"{self.max_streams} (at most {self.job_streams} a job)")
            stream.job = tag.job
            stream.opened = dataclasses.replace(stream.opened, job=tag.job)

    def tagged(self) -> dict[str, int]:
        """Tagged streams spliced now, by job (at most ``job_streams`` a job)."""
        with self._lock:
            return dict(collections.Counter(s.job for s in self._streams.values() if s.job))

    def jobs(self) -> dict[str, int]:
        """Bytes each job's tagged streams have in flight from this side now (sent, not
        yet credited), by job."""
        with self._budget:
            return dict(self._inflight)

    def held(self, job: str) -> int:
        """Bytes of ``job``'s tagged streams this side received and has not written
        onward yet (what it holds for the job)."""
        with self._lock:
            return sum(s.unacked for s in self._streams.values() if s.job == job)

    def reserve(self, stream: _Stream, n: int) -> int:
        """Up to ``n`` bytes ``stream`` may send now within its job's window (all of ``n``
        for an untagged stream), counted in flight; waits while the job has none left.
        0: the stream was reset meanwhile."""
        if not stream.job:
            return n
        with self._budget:
            self._budget.wait_for(lambda: bool(stream.reset)
                                  or self._inflight[stream.job] < self.job_window)
            if stream.reset:
                return 0
            n = min(n, self.job_window - self._inflight[stream.job])
            self._inflight[stream.job] += n
            stream.job_sent += n
            return n

    def unreserve(self, stream: _Stream, n: int) -> None:
        """``n`` bytes of ``stream``'s are in flight no more (credited, not sent after all,
        or the stream ended): its job may send them again."""
        if not stream.job or n <= 0:
            return
        with self._budget:
            n = min(n, stream.job_sent)
            stream.job_sent -= n
            self._inflight[stream.job] -= n
            if self._inflight[stream.job] <= 0:
                del self._inflight[stream.job]
            self._budget.notify_all()

    def wake(self) -> None:
        """Wake the streams waiting for their job's window (one of them was reset)."""
        with self._budget:
            self._budget.notify_all()

    def forget(self, sid: int) -> None:
        with self._lock:
            self._streams.pop(sid, None)

    def _read(self, n: int) -> bytes:
        data = self._rfile.read(n)
        if data is None or len(data) < n:
            raise EOFError
        return data

    def run(self) -> None:
        """Read the home connection until it closes or breaks; then end every stream.

        Never raises: :attr:`error` says why it ended.
        """
        try:
            while True:
                kind, sid, arg = records.unpack(self._read(records.PREFIX_BYTES))
                self._dispatch(kind, sid, arg)
        except EOFError:
            self.error = self.error or "the home connection was closed"
        except (OSError, ValueError) as e:  # RelayError is an OSError
            self.error = self.error or f"the home connection broke: {e}"
        finally:
            self._end_all()

    def _body(self, n: int, most: int, what: str) -> bytes:
        """The ``n`` bytes following an envelope; over ``most`` is a protocol breach (read
        nothing of it: what follows cannot be trusted to be records).

        Raises:
            RelayError: ``n > most``. EOFError: the connection ended first.
        """
        if n > most:
            raise RelayError(f"{what} of {n} bytes exceeds {most}")
        return self._read(n)

    def _dispatch(self, kind: RecordType, sid: int, arg: int) -> None:
        if kind is RecordType.DATA:
            data = self._body(arg, records.MAX_CHUNK, "DATA record")
            stream = self._stream(sid)
            if stream is not None:  # else reset here while the data was on its way
                stream.on_data(data)
        elif kind is RecordType.CREDIT:
            if (stream := self._stream(sid)) is not None:
                stream.on_credit(arg)
        elif kind is RecordType.FIN:
            if (stream := self._stream(sid)) is not None:
                stream.on_fin()
        elif kind is RecordType.RESET:
            why = self._body(arg, records.MAX_BODY, "RESET reason").decode(errors="replace")
            if (stream := self._stream(sid)) is not None:
                stream.on_reset(f"reset by the other side: {why}")
        elif kind is RecordType.REFUSED and self._connect is not None:
            self.displaced = self._body(arg, records.MAX_BODY, "REFUSED reason").decode(
                errors="replace")
            raise RelayError(f"the relay displaced this node: {self.displaced}")
        elif kind is RecordType.OPEN and self._connect is not None:
            opened = records.Open.decode(self._body(arg, records.MAX_BODY, "OPEN body"))
            self._open(sid, opened)
        else:
            raise RelayError(f"{self.side} got an unexpected {kind.name} record")

    def _open(self, sid: int, opened: records.Open) -> None:
        with self._lock:
            if sid in self._streams:
                raise RelayError(f"OPEN of stream {sid}, which is open")
            stream = _Stream(self, sid, None, opened, self._connect)
            self._streams[sid] = stream
        stream.start()

    def _stream(self, sid: int) -> _Stream | None:
        with self._lock:
            return self._streams.get(sid)

    def _end_all(self) -> None:
        self.closed.set()
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.on_reset(self.error or "the home connection ended")
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self, why: str = "") -> None:
        """End the home connection and every stream on it (:meth:`run` returns)."""
        if why and not self.error:
            self.error = why
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
