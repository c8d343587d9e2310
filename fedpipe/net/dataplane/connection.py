"""One socket of the data plane: records written from their own memory, tensors read into theirs.

A :class:`Connection` owns one connected TCP socket, plain or TLS
(:class:`ssl.SSLSocket`). Writing is one call per record: ``socket.sendmsg``
of the record's small head and the tensor's own memory, gathered by the
kernel, so no ``bytes`` copy of a payload is made in Python. An
``SSLSocket`` has no ``sendmsg``, and each of its ``sendall`` calls ends in
a TLS record of its own (a write and a TCP segment each): a record's parts
are regrouped into whole TLS records (:func:`_tls_pieces`), the small head
and trailer copied together with the ends of the payload (under 16 KiB
each), the payload's whole records written from its own memory (``ssl``
encrypts from the view; its own copy into TLS records is the only one).
A tensor staged from a device (:mod:`.staging`) is written a chunk at a time as its
copies complete (:meth:`Connection.write_staged`), so the copy overlaps the send.

Reading goes through a small read-ahead buffer (:data:`READ_AHEAD` bytes),
so a record's prefix and header, and a small tensor, cost one ``recv_into``
for several records; a payload is read with ``recv_into`` straight into the
tensor reserved for it (:func:`read_tensor`; in pinned memory where the receiver
moves it to a CUDA device), after copying in whatever part of it was already read
ahead. Every field of a tensor's header is checked before that memory is reserved
(:func:`read_head`).

A reader may put wake-ups off (:meth:`Connection.later`: a stage thread's, for a
tensor the node filed) until it would wait for the socket, so the tensors that arrived
together wake their consumer once.

Only the link's reader thread reads; writers hold the link's write lock.
"""
from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from typing import Callable, Sequence

import numpy
import torch

from ...proto import node_pb2, tensor_pb2
from ...wire import codecs, format, lowrank
from ...wire.format import WireError
from .staging import Mark, check_marks, pinned_empty, wait

READ_AHEAD = 256 * 1024
"""Bytes a connection reads ahead when it waits for a record: a few small records per
``recv_into``; a large payload's tail is read straight into its tensor."""
_SCRATCH = 1 << 20
"""Largest piece of a refused tensor's payload read at once while it is skipped, bytes."""
LATER_SECONDS = 1e-3
"""How long a reader may read on while wake-ups it put off wait (:meth:`Connection.later`),
if the socket keeps it busy that long (it runs them as soon as it would wait): a stage
learns of a tensor at most about this late, and a stream of 64 KiB tensors that keeps
a reader busy wakes the stage thread once per some 30 of them. A time, not bytes: over
a slow link a tensor's bytes trickle in and each read finds some, so a reader that
counted bytes would put its wake-ups off for as long as the link takes to bring them."""

_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
"""recv's flag to return at once when nothing is there (0 where the OS has none: then a
reader runs what it put off before every read, :meth:`Connection.later`)."""

TLS_RECORD = 16 * 1024
"""Bytes of data in a full TLS record (the protocol's largest, RFC 8446 section 5.1): one
``SSLSocket.sendall`` makes records of this size, and a last one of what is left."""

Buffer = bytes | bytearray | memoryview


class Closed(ConnectionError):
    """The peer closed the connection (end of stream) or it was closed on this side."""


def _tls_pieces(parts: Sequence[Buffer]) -> list[Buffer]:
    """``parts`` (their bytes, in order) regrouped so that every piece but the last is a
    multiple of :data:`TLS_RECORD` bytes: a TLS record is never cut short at a part's end.

    What falls between two record boundaries across parts (a head and the start of a
    payload, a payload's end and a trailer) is copied into one ``bytearray`` of at most
    :data:`TLS_RECORD` bytes; the whole records within a part stay views of its memory.
    """
    out: list[Buffer] = []
    pending = bytearray()  # under one record, copied
    for part in parts:
        view = memoryview(part).cast("B")
        if pending:  # fill the pending record from this part's front
            take = min(TLS_RECORD - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) < TLS_RECORD:
                continue
            out.append(pending)
            pending = bytearray()
        whole = len(view) - len(view) % TLS_RECORD
        if whole:
            out.append(view[:whole])
        pending = bytearray(view[whole:])
    if pending:
        out.append(pending)
    return out


def _send_all(sock: socket.socket, parts: Sequence[Buffer]) -> None:
    """Write ``parts`` in order, whole: ``sendmsg`` (gathering, no copy) where the socket
    has it, else ``sendall`` of each of :func:`_tls_pieces` (TLS)."""
    if isinstance(sock, ssl.SSLSocket):
        for piece in _tls_pieces(parts):
            sock.sendall(piece)
        return
    sent = sock.sendmsg(parts)  # usually all of it: views are made only for a short write
    first = 0  # the first part not all sent
    for part in parts:
        size = part.nbytes if isinstance(part, memoryview) else len(part)
        if sent < size:
            break
        sent -= size
        first += 1
    else:
        return
    views = [memoryview(p).cast("B") for p in parts[first:] if len(p)]
    views[0] = views[0][sent:]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):  # a short write: go on after what went
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class Connection:
    """One connected socket: :meth:`write` for writers, the ``read_*`` methods for the reader.

    Args:
        sock: a connected, blocking socket (TLS already handshaken).
        dialed: whether this side dialed it.
    """

    def __init__(self, sock: socket.socket, dialed: bool):
        self.sock, self.dialed = sock, dialed
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the read-ahead bytes not consumed yet
        self.closed = False
        # threads in a call on the socket: its descriptor is closed only once none is, so
        # no call made before close() reaches a socket that reuses the number (an ssl
        # call holds the number for all its records: it would write or read another
        # connection's stream)
        self._calls = 0
        self._calls_lock = threading.Lock()
        self.received = 0
        """Bytes read from the socket through the read-ahead buffer (records' heads and
        small payloads; a payload's tail received straight into its tensor is not
        counted): non-zero once the peer sent anything."""
        self.until: float | None = None
        """A ``time.monotonic()`` by which every read must be done (the preface's
        deadline), or None: reads wait as long as the socket's timeout says."""
        self.late = "the read's deadline passed"
        """What a read past :attr:`until` raises TimeoutError with."""
        self._later: list[Callable[[], None]] = []  # run before the reader waits
        self._later_by = 0.0  # the time.monotonic() by which it runs them

    def __repr__(self) -> str:
        try:
            peer = self.sock.getpeername()
        except OSError:
            peer = "closed"
        return f"Connection({peer}, {'TLS' if self.tls else 'plain'})"

    def lift_deadline(self) -> None:
        """Reads wait as long as they must from now on (:attr:`until` lifted)."""
        if self.until is not None:
            self.until = None
            self.sock.settimeout(None)

    # -- writing: callers hold the link's write lock -----------------------------
    def write(self, *parts: Buffer) -> None:
        """Write ``parts`` as one piece of the stream.

        Raises:
            OSError: the connection broke (some of ``parts`` may have gone).
        """
        self._enter()
        try:
            _send_all(self.sock, parts)
        finally:
            self._leave()

    def write_staged(self, head: Buffer, payload: memoryview, marks: Sequence[Mark],
                     *tail: Buffer) -> None:
        """Write ``head``, ``payload`` and ``tail`` as one piece of the stream, the payload
        a chunk at a time as it reaches host memory (:mod:`.staging`): before writing up
        to each mark's ``end``, wait for its ``ready``; so chunk i is on the wire while
        chunk i+1 is still being copied, and no byte is written before its chunk is in.

        The waits hold no call on the socket (:meth:`close` is not kept waiting by a
        copy). Over TLS the tail of each chunk short of a whole TLS record is held back
        and written with the next chunk, so a chunk's end adds no short record.

        Args:
            head: the record's prefix and frame head, written with the first chunk.
            payload: the staged host buffer.
            marks: ends covering ``payload`` exactly, in order (:func:`.staging.check_marks`).
            tail: written with the last chunk (a SYNC).

        Raises:
            OSError: the connection broke (some of the record may have gone).
            CopyFailed: a chunk's copy failed (:func:`.staging.wait`; the record's head
                and the chunks before may have gone: nothing may follow them on this
                connection).
        """
        check_marks(marks, len(payload))  # (none would write nothing, not even the head)
        held: list[Buffer] = [head]
        start, last = 0, len(marks) - 1
        for i, mark in enumerate(marks):
            wait(mark, start)
            end = mark.end
            parts = [*held, payload[start:end]]
            start = end
            if i == last:
                self.write(*parts, *tail)
                return
            held = []
            if self.tls:
                parts = list(_tls_pieces(parts))
                if len(parts[-1]) % TLS_RECORD:
                    held = [parts.pop()]
            self.write(*parts)

    def _enter(self) -> None:
        """A call on the socket begins (raises OSError once it is closed)."""
        with self._calls_lock:
            if self.closed:
                raise OSError("the connection was closed on this side")
            self._calls += 1

    def _leave(self) -> None:
        """A call on the socket ended: the last one after :meth:`close` closes it."""
        with self._calls_lock:
            self._calls -= 1
            last = self.closed and self._calls == 0
        if last:
            self.sock.close()

    # -- reading: the reader thread only -----------------------------------------
    def later(self, wake: Callable[[], None]) -> None:
        """Run ``wake`` (the wake-up of a thread that waits for a tensor this reader
        filed) before the reader next waits for the socket, or once it has read on for
        :data:`LATER_SECONDS`, whichever comes first, or at :meth:`run_later`.

        Tensors that arrived together then wake the thread that takes them once, not
        once each: a wake-up costs both threads a few context switches and a hand-over
        of the GIL, more CPU than a 64 KiB tensor's own receive (``benchmarks/dataplane.py``,
        CPU per message through a node). While the socket has nothing more, nothing waits.
        """
        if not self._later:
            self._later_by = time.monotonic() + LATER_SECONDS
        elif self._later[-1] == wake:  # the same wake-up again (a mailbox's wakes them all)
            return
        self._later.append(wake)

    def run_later(self) -> None:
        """Run what :meth:`later` put off, now: before the reader does anything that may
        wait (a write, a fetch's answer) or stops reading."""
        while self._later:
            later, self._later = self._later, []
            for wake in later:
                wake()

    def _receive(self, view: memoryview) -> int:
        """``sock.recv_into(view)``, running what :meth:`later` put off first if the
        socket has nothing to read now (or the reader read on for its time). The caller
        holds a call on the socket (:meth:`_enter`)."""
        if self._later:
            if self.until is None and time.monotonic() < self._later_by:
                try:
                    if not self.tls and _DONTWAIT:
                        return self.sock.recv_into(view, 0, _DONTWAIT)
                    if self.tls and self.sock.pending():  # type: ignore[attr-defined]
                        return self.sock.recv_into(view)  # bytes decrypted, waiting in it
                except BlockingIOError:
                    pass  # nothing there: wake them before waiting
            self.run_later()
        return self.sock.recv_into(view)

    def _recv_into(self, view: memoryview) -> int:
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError(self.late)
            self.sock.settimeout(left)
        self._enter()
        try:
            n = self._receive(view)
        finally:
            self._leave()
        if n == 0:
            raise Closed("the peer closed the connection")
        self.received += n
        return n

    def read_exact(self, n: int) -> bytes:
        """The next ``n`` bytes (at most :data:`READ_AHEAD`), copied out.

        Raises:
            Closed: the stream ended first. OSError: the connection broke.
        """
        if self._end - self._start < n:
            if self._start:  # keep what is left at the front
                left = self._end - self._start
                self._buf[:left] = self._view[self._start:self._end]
                self._start, self._end = 0, left
            while self._end < n:
                self._end += self._recv_into(self._view[self._end:])
        out = bytes(self._view[self._start:self._start + n])
        self._start += n
        return out

    def read_into(self, target: memoryview) -> None:
        """Fill ``target`` (a writable byte view) with the next ``len(target)`` bytes:
        what was read ahead is copied in, the rest is received straight into it.

        Raises:
            Closed: the stream ended first. OSError: the connection broke.
        """
        size = len(target)
        got = min(self._end - self._start, size)
        if got:
            target[:got] = self._view[self._start:self._start + got]
            self._start += got
        if self.until is None and got < size:  # the payload loop, tight: over TLS a call
            recv = self._receive                 # per 16 KiB record
            self._enter()
            try:
                while got < size:
                    n = recv(target[got:])
                    if not n:
                        raise Closed("the peer closed the connection")
                    got += n
            finally:
                self._leave()
        while got < size:
            got += self._recv_into(target[got:])

    def skip(self, n: int) -> None:
        """Read and drop the next ``n`` bytes (a refused tensor's payload), in bounded pieces."""
        scratch = memoryview(bytearray(min(n, _SCRATCH)))
        while n:
            piece = scratch[:min(n, len(scratch))]
            self.read_into(piece)
            n -= len(piece)

    def close(self) -> None:
        """Close the socket; a thread blocked reading or writing it returns with an error
        (the descriptor itself is closed when the last such call returns)."""
        with self._calls_lock:
            self.closed = True
            now = self._calls == 0
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        if now:
            self.sock.close()


def read_head(conn: Connection) -> node_pb2.Frame:
    """Read a TENSOR record's HEAD wire frame (its payload not yet) and check the frame as
    a receiver on gRPC does (``protos/fedpipe/v1/FRAMES.md``, checks 1-4); the tensor
    header's fields are checked by :func:`read_tensor` or :func:`skip_payload`, once the
    receiver's limit is known. Nothing is reserved.

    Raises:
        WireError: a malformed frame, naming the field.
    """
    prefix = conn.read_exact(format.HEAD_PREFIX_BYTES)
    magic, version, kind, size = _HEAD_PREFIX.unpack(prefix)
    if magic != format.MAGIC or version != format.VERSION or kind != format.HEAD:
        format.unpack(prefix[:5])  # names what is wrong: the magic, version or kind
        raise WireError(f"a TENSOR record carries wire frame kind {kind}, not HEAD "
                        f"({format.HEAD}): a connection never cuts a tensor into frames")
    if size > format.MAX_HEADER_BYTES:
        raise WireError(f"frame header length {size} exceeds the limit of "
                        f"{format.MAX_HEADER_BYTES}")
    return format.parse_header(conn.read_exact(size))


_HEAD_PREFIX = struct.Struct("<3sBBI")
"""A HEAD frame's prefix: magic, version, kind, header length (``format.HEAD_PREFIX_BYTES``)."""
assert _HEAD_PREFIX.size == format.HEAD_PREFIX_BYTES


def skip_payload(conn: Connection, header: node_pb2.Frame) -> None:
    """Read and drop the payload of a tensor that is not taken (refused, or a duplicate),
    after checking its header (so ``payload_bytes`` is within bounds).

    Raises:
        WireError: a malformed tensor header. Closed, OSError: the connection broke.
    """
    codecs.check_header(header.tensor)
    conn.skip(header.tensor.payload_bytes)


def reserve(nbytes: int) -> numpy.ndarray:
    """``nbytes`` of writable, uninitialized memory as a 1-D uint8 numpy array (a tensor
    is made of it once it is filled: :func:`read_tensor`).

    From malloc (numpy's allocator), not ``torch.empty``: torch's CPU allocator
    hands out freshly mapped pages for large tensors (1229 page faults for each
    16 MiB ``torch.empty`` measured here, against none from malloc with
    :func:`fedpipe.net.tune_malloc`'s settings, which keep freed buffers for
    reuse), and faulting a tensor's pages in costs about as much as receiving it.
    A numpy array, not a tensor: numpy's views cost a fraction of torch's per call
    (``benchmarks/dataplane.py``, CPU per 64 KiB message).

    Raises:
        WireError: the memory cannot be reserved.
    """
    return _empty(nbytes, numpy.uint8)


def _empty(shape: int | list[int], dtype: type | numpy.dtype) -> numpy.ndarray:
    """:func:`reserve`'s memory as an array of ``shape`` and ``dtype``.

    Raises:
        WireError: the memory cannot be reserved.
    """
    try:
        return numpy.empty(shape, dtype=dtype)
    except MemoryError as e:
        raise WireError(f"cannot reserve {shape} of {dtype} for a tensor: {e}") from None


def reserve_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of writable, uninitialized page-locked host memory as a 1-D uint8 tensor
    (:func:`.staging.pinned_empty`), for a raw tensor its receiver moves to a CUDA
    device: from pinned memory that copy is asynchronous (``non_blocking=True``), from
    pageable memory it is not. Where pinning is unavailable the memory is pageable, from
    :func:`reserve` (a warning is logged once, naming why). Pinned memory is not given
    back to the system: torch's caching host allocator rounds each block up to a power
    of two and keeps it for reuse, so a CUDA node holds about twice its largest
    in-flight tensors' bytes locked for its life.

    Raises:
        WireError: the memory cannot be reserved.
    """
    host = pinned_empty(nbytes)
    return host if host is not None else torch.from_numpy(reserve(nbytes))


def _numpy_dtypes() -> dict[int, numpy.dtype]:
    """The numpy dtype of each wire dtype code numpy has (bfloat16 has none)."""
    out = {}
    for code, dtype in codecs.TORCH_DTYPES.items():
        try:
            out[code] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            pass
    return out


_NUMPY_DTYPES = _numpy_dtypes()
"""Wire dtype code -> numpy dtype: a received raw tensor is viewed and shaped in numpy, then
made a tensor with one ``torch.from_numpy`` (two torch views cost about 10 us a tensor)."""


_CHECKED: dict[tuple[bytes, int], bool] = {}
"""Tensor headers (serialized, no payload of their own) and limits that passed
:func:`fedpipe.wire.codecs.check_header`, at most :data:`_CHECKED_MAX`."""
_CHECKED_MAX = 1024


def _check_header(msg: tensor_pb2.Tensor, limit: int) -> None:
    """:func:`fedpipe.wire.codecs.check_header` of a frame's tensor header (its payload
    follows it, so it has none) against ``limit``, remembered for the header's exact bytes.

    The check is a function of the header's fields and the limit alone, and equal
    fields serialize to equal bytes: a header met before passes as it did then, and any
    other (one field apart) is checked field by field. A stream's tensors share a few
    headers; checking one costs 2-3 us, serializing it to look it up a tenth of that
    (``benchmarks/dataplane.py``, CPU per 64 KiB message).

    Raises:
        WireError: as :func:`~fedpipe.wire.codecs.check_header`.
    """
    key = (msg.SerializeToString(), limit)
    if key in _CHECKED:
        return
    codecs.check_header(msg, limit)
    if len(_CHECKED) >= _CHECKED_MAX:  # many shapes: start again rather than grow
        _CHECKED.clear()
    _CHECKED[key] = True


def read_tensor(conn: Connection, header: node_pb2.Frame, limit: int,
                end: lowrank.End | None = None, pinned: bool = False) -> torch.Tensor:
    """The payload of a checked header, read into a tensor reserved from the header.

    A raw tensor without zstd is received straight into a tensor of its dtype
    and shape (:func:`reserve`; with ``pinned``, :func:`reserve_pinned`: the receiver
    moves it to a CUDA device); others into a buffer of ``payload_bytes``, decoded in
    place (:func:`fedpipe.wire.codecs.decode`; ``pinned`` does not apply: decoding makes
    a new tensor). The header is checked against ``limit`` (the receiver's admission)
    before anything is reserved. ``end``: a stateful codec's end of the link at the
    receiver (:func:`fedpipe.wire.codecs.decode`).

    Raises:
        WireError: over ``limit``, memory that cannot be reserved, or a malformed
            payload. Closed, OSError: the connection broke mid-payload.
    """
    msg = header.tensor
    _check_header(msg, limit)
    nbytes = msg.payload_bytes
    if not nbytes:  # no elements (a raw empty tensor): nothing to receive
        return codecs.decode(msg, payload=b"", max_bytes=limit, end=end)
    if pinned and msg.codec == tensor_pb2.CODEC_RAW and not msg.zstd:
        host = reserve_pinned(nbytes)
        conn.read_into(host.numpy().data)
        # torch views, not numpy's: the tensor keeps the pinned block's allocation context
        return host.view(codecs.TORCH_DTYPES[msg.dtype]).view(tuple(msg.shape))
    if msg.codec == tensor_pb2.CODEC_RAW and not msg.zstd:  # the tensor is the buffer
        dtype = _NUMPY_DTYPES.get(msg.dtype)
        if dtype is not None:  # checked: payload_bytes is the shape's bytes in dtype
            array = _empty(msg.shape[:], dtype)
            conn.read_into(array.data.cast("B"))
            return torch.from_numpy(array)
        buf = reserve(nbytes)
        conn.read_into(buf.data)
        return torch.from_numpy(buf).view(codecs.TORCH_DTYPES[msg.dtype]).view(tuple(msg.shape))
    buf = reserve(nbytes)
    conn.read_into(buf.data)
    return codecs.decode(msg, payload=buf.data, max_bytes=limit, end=end)
