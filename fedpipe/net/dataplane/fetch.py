"""Fetches over a link: a request (``FETCH``) answered by a stream of tensors and a ``FETCHED``.

What ``FetchState`` and ``FetchSnapshot`` are on gRPC, between two ends of a link
(contract: ``protos/fedpipe/v1/FRAMES.md``, "Fetches"). The asking side numbers its
fetches on the link (:class:`Fetches`), sends the request as a control record, and
takes the answer's tensors on its reader thread: each is ``TENSOR`` record like any
other (sequence number, credit, resume), whose header's ``fetch`` names the fetch,
checked by the fetch's own ``admit`` (its size limit, before a payload byte is
read) and handed to its ``deliver``. The serving side runs the request on a
thread of its own (:meth:`Server.serve` makes the checks gRPC's handler makes, and
yields the tensors), sends the tensors, and ends with ``FETCHED``: ``OK``, or the
status code and message the gRPC call would have ended with.

A fetch whose connection breaks fails (``LinkFailed``; its caller asks again, or
another source): its request or its end may have been lost with the connection,
while its tensors resume; those of a fetch no longer waited for are read and
dropped.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Protocol

import torch

from ...proto import node_pb2
from ...wire.format import WireError
from . import records
from .connection import Connection, read_tensor, skip_payload
from .credits import LinkFailed
from .ends import Peer, PeerRefused, Refused
from .records import Code, Method, code_of

log = logging.getLogger(__name__)

MAX_SERVED = 4
"""Fetches one link's peer may have this side serve at once; a FETCH past it is answered
``RESOURCE_EXHAUSTED`` (a node restores a stage from one source at a time)."""

Admit = Callable[[node_pb2.Frame], int]
"""A fetch's check of an answer's tensor header: its size limit, bytes; raises to refuse."""
Deliver = Callable[[node_pb2.Frame, torch.Tensor], None]
"""Where a fetch's answer's tensors go (on the link's reader thread)."""


class Server(Protocol):
    """What serves the fetches a link's peer asks for (the node: its state and snapshots)."""

    def serve(self, peer: Peer, method: Method, request: bytes
              ) -> Iterable[tuple[str, torch.Tensor]]:
        """The answer to a FETCH of ``method`` with the serialized ``request``: named
        tensors, in order. Runs on a thread of its own; may block.

        Raises:
            Refused: with the code the gRPC method would end with (also while iterating).
        """


class Pending:
    """One fetch this side asked for, waiting for its answer.

    Attributes:
        id: its number on the link (the FETCH record's ``arg``), >= 1.
        admit, deliver: the fetch's checks and sink for the answer's tensors.
        error: why it failed (None: not failed).
        tensors: the answer's tensors delivered so far.
    """

    def __init__(self, fetch: int, admit: Admit, deliver: Deliver):
        self.id, self.admit, self.deliver = fetch, admit, deliver
        self.error: BaseException | None = None
        self.tensors = 0
        self._done = threading.Event()
        self._lock = threading.Lock()  # the reader and a break may end it at once

    def end(self, error: BaseException | None = None) -> None:
        """The answer ended (``error``: it failed); the first end counts."""
        with self._lock:
            if not self._done.is_set():
                self.error = error
                self._done.set()

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self.error is not None

    def wait(self, timeout: float) -> None:
        """Wait for the answer's end.

        Raises:
            PeerRefused: the peer answered with an error (its code and message).
            LinkFailed: the connection broke, the link failed, or ``timeout`` passed.
            WireError, and what ``admit``/``deliver`` raised: a tensor of the answer
                was refused here.
        """
        if not self._done.wait(timeout):
            raise LinkFailed(f"fetch {self.id}: no answer within {timeout} s")
        if self.error is not None:
            raise self.error


Send = Callable[[str, torch.Tensor, int], object]
"""Send a named tensor on the link as part of the answer to the fetch of that id."""


class Fetches:
    """A link's fetches: those this side asks and waits for, and those it serves.
    Thread-safe.

    Args:
        peer, name: the link's peer and this side, by name (for messages).
        server: what answers the peer's fetches (None: none are served).
        control: queue a control record on the link (written after the tensors before).
        send: send a tensor of an answer on the link.
    """

    def __init__(self, peer: str, name: str, server: Server | None,
                 control: Callable[[bytes], None], send: Send | None = None):
        self.peer, self.name, self.server = peer, name, server
        self._control, self._send = control, send
        self._lock = threading.Lock()
        self._next = 1
        self._pending: dict[int, Pending] = {}
        self._serving = 0
        self.answered = 0
        """Fetches of this side's that the peer answered OK."""

    def ask(self, method: Method, request: bytes, admit: Admit, deliver: Deliver,
            timeout: float) -> int:
        """Ask the peer for what ``method`` answers ``request`` with (a serialized
        ``FetchStateRequest`` or ``FetchSnapshotRequest``); each tensor of the answer is
        checked by ``admit`` (its size limit, before its payload is read) and handed to
        ``deliver``, on the link's reader thread. Returns when the answer is complete:
        how many tensors it had.

        Raises:
            PeerRefused: the peer refused the fetch (the code gRPC would end with).
            LinkFailed: the link failed, its connection broke meanwhile (ask again), or
                ``timeout`` passed.
            WireError, or what ``admit``/``deliver`` raised: a tensor was refused here.
        """
        pending = self.open(admit, deliver)
        try:
            self._control(records.pack_fetch(pending.id, method, request))
            pending.wait(timeout)
            return pending.tensors
        finally:
            self.close(pending)

    def on_fetch(self, conn: Connection, fetch: int, peer: Peer) -> None:
        """The peer's FETCH record (its prefix read): its request read, its length checked
        first; then served on a thread of its own, so the link's reader goes on (the
        answer waits for credit that the reader brings back).

        Raises:
            WireError: a request past :data:`~.records.MAX_REQUEST_BYTES`.
        """
        method, request = read_request(conn)
        refused = self._refusal(method)
        if refused is not None:
            self._answer(fetch, *refused)
        else:
            threading.Thread(target=self._serve, args=(fetch, Method(method), request, peer),
                             daemon=True, name=f"fetch-{self.peer}").start()

    def _serve(self, fetch: int, method: Method, request: bytes, peer: Peer) -> None:
        """Answer the peer's fetch: the server's tensors, then FETCHED."""
        try:
            assert self.server is not None and self._send is not None
            send = self._send
            end = answer(self.server, peer, method, request,
                         lambda name, t: send(name, t, fetch))
        finally:
            self.stop_serving()
        if end is not None:
            self._answer(fetch, *end)

    def _answer(self, fetch: int, code: Code, text: str) -> None:
        """End the peer's fetch: a FETCHED, after every tensor of its answer."""
        self._control(records.pack_text(records.RecordType.FETCHED, fetch, code, text))

    def open(self, admit: Admit, deliver: Deliver) -> Pending:
        """A new fetch, waiting for its answer until :meth:`close`."""
        with self._lock:
            pending = Pending(self._next, admit, deliver)
            self._next += 1
            self._pending[pending.id] = pending
            return pending

    def close(self, pending: Pending) -> None:
        """Stop waiting for ``pending``: later tensors of its answer are dropped."""
        with self._lock:
            self._pending.pop(pending.id, None)

    def get(self, fetch: int) -> Pending | None:
        """The fetch an answer's tensor names, if it is still waited for and has not
        failed (else the tensor is dropped)."""
        with self._lock:
            pending = self._pending.get(fetch)
        return None if pending is None or pending.failed else pending

    def ended(self, fetch: int, code: int, text: str) -> None:
        """The peer's FETCHED for ``fetch`` (one not waited for is ignored)."""
        with self._lock:
            pending = self._pending.get(fetch)
            if pending is not None and code == Code.OK:
                self.answered += 1
        if pending is not None:
            pending.end(None if code == Code.OK else PeerRefused(code_of(code), text, 0))

    def broken(self, why: str) -> None:
        """The connection broke or the link failed: every fetch waited for fails."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.end(LinkFailed(f"fetch {p.id} from {self.peer}: the connection broke ({why})"))

    def start_serving(self) -> bool:
        """Whether this side may serve one more of the peer's fetches now (then
        :meth:`stop_serving` when done)."""
        with self._lock:
            if self._serving >= MAX_SERVED:
                return False
            self._serving += 1
            return True

    def _refusal(self, method: int) -> tuple[Code, str] | None:
        """Why this side does not serve a FETCH of ``method`` now, or None: it does (then
        :meth:`stop_serving` when done)."""
        if method not in set(Method) or self.server is None:
            return Code.UNIMPLEMENTED, f"{self.name} serves no fetch of method {method} here"
        if not self.start_serving():
            return Code.RESOURCE_EXHAUSTED, (f"{self.name} serves at most {MAX_SERVED} "
                                             f"fetches of {self.peer} at once")
        return None

    def stop_serving(self) -> None:
        with self._lock:
            self._serving -= 1


def read_request(conn: Connection) -> tuple[int, bytes]:
    """A FETCH record's method and request (after its prefix), the length checked before
    the request is read.

    Raises:
        WireError: a request longer than :data:`~.records.MAX_REQUEST_BYTES`.
    """
    method, size = records.FETCH_BODY.unpack(conn.read_exact(records.FETCH_BODY.size))
    if size > records.MAX_REQUEST_BYTES:
        raise WireError(f"fetch request of {size} bytes exceeds {records.MAX_REQUEST_BYTES}")
    return method, conn.read_exact(size)


def take_answer(conn: Connection, header: node_pb2.Frame, pending: Pending | None) -> None:
    """Read a tensor of the answer to one of this side's fetches (its header read): checked
    by the fetch's ``admit`` before its payload is read, then delivered to it. One the fetch
    refuses fails the fetch, not the link (the peer sent what it was asked for); one of a
    fetch not waited for any more (``pending`` None) is read and dropped.

    Raises:
        WireError: a malformed tensor (a protocol error, as on any TENSOR).
        Closed, OSError: the connection broke.
    """
    limit = None
    if pending is not None:
        try:
            limit = pending.admit(header)
        except Exception as e:  # noqa: BLE001 — what the fetch's checks raise fails it
            pending.end(e)
    if pending is None or limit is None:
        skip_payload(conn, header)
        return
    tensor = read_tensor(conn, header, limit)
    try:
        pending.deliver(header, tensor)
        pending.tensors += 1
    except Exception as e:  # noqa: BLE001 — as above
        pending.end(e)


def answer(server: Server, peer: Peer, method: Method, request: bytes,
           send: Callable[[str, torch.Tensor], object]) -> tuple[Code, str] | None:
    """Serve a peer's fetch: ``server``'s tensors, each ``send`` on the link; how the
    answer ends (its FETCHED's code and text), or None: the link failed, nobody to tell."""
    try:
        for name, tensor in server.serve(peer, method, request):
            send(name, tensor)
    except Refused as e:
        return e.code, str(e)
    except LinkFailed:
        return None
    except Exception as e:  # noqa: BLE001 — a server's bug fails one fetch, not the link
        log.exception("serving a fetch of %s", peer.name)
        return Code.INTERNAL, f"the server failed: {e!r}"
    return Code.OK, ""
