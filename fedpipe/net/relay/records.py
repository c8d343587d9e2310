"""The relay's envelope records: what a home connection carries, byte for byte. No torch.

A node that cannot be reached keeps one connection to its relay, its *home
connection* (TLS when the swarm is). Both directions carry *records*; each starts
with a 16-byte clear envelope (contract: ``protos/fedpipe/v1/FRAMES.md``, "Relays"):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       3     magic ``b"FPR"``
3       1     version, :data:`VERSION`
4       1     type, a :class:`RecordType`
5       3     zero
8       4     stream id, unsigned little-endian (0: the home connection itself)
12      4     ``arg``, unsigned little-endian: what it means depends on the type
======  ====  ==============================================================

* ``HELLO`` (node to relay, stream 0): ``arg`` is the length of a JSON body
  (:class:`Hello`): which node homes, and the ports it would like again.
* ``ALLOCATED`` (relay to node, stream 0): ``arg`` is the length of a JSON body
  (:class:`Allocation`): the addresses the relay listens on for the node.
* ``OPEN`` (relay to node): a peer connected to one of the node's addresses and
  spoke; ``arg`` is the length of a JSON body (:class:`Open`): the stream's source,
  destination, service and job.
* ``DATA`` (both ways): ``arg`` bytes of the stream follow, at most
  :data:`MAX_CHUNK`; the relay never decodes them (over TLS they are ciphertext).
* ``CREDIT`` (both ways): the receiver wrote ``arg`` more bytes of the stream onward;
  the sender may send that many more (the window is :attr:`Allocation.window`).
* ``FIN`` (both ways): the sender sends no more on the stream (a half-close); ``arg`` 0.
* ``RESET`` (both ways): the stream is over, both ways, at once; ``arg`` is the
  length of a UTF-8 reason.
* ``REFUSED`` (relay to node, stream 0): the relay does not home the node; ``arg``
  is the length of a UTF-8 reason; the relay closes the connection after it. Also the
  relay's answer to a refused ``TAG``, on the dialer's connection.

A peer's connection to a relayed port (not a home connection) may start with one
record of its own, in the clear, before the bytes it splices (its TLS, its preface):

* ``TAG`` (dialer to relay): ``arg`` is the length of a JSON body (:class:`Tag`): the
  stream's job, its source and its destination. The relay answers ``ACCEPTED`` (``arg``
  0; the stream is spliced, its OPEN names the job) or ``REFUSED`` (a reason naming the
  job or the destination; the relay closes the connection), and counts the stream, and
  the bytes it holds for it, against the job's share of the node's (:class:`Allocation`).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import struct

from ...wire import jsonbody

MAGIC = b"FPR"
VERSION = 1
"""The relay protocol's version; a HELLO of another version is refused, naming both."""
PREFIX = struct.Struct("<3sBB3xII")
"""A record's envelope: magic, version, type, three zero bytes, stream id, ``arg``."""
PREFIX_BYTES = PREFIX.size
MAX_BODY = 4096
"""Largest JSON body or reason text, bytes (a HELLO or an OPEN is a few hundred bytes)."""
MAX_CHUNK = 256 * 1024
"""Largest DATA record's payload, bytes: large enough that the 16-byte envelope costs
nothing, small enough that one stream's chunk does not hold the others back long."""


class RelayError(ConnectionError):
    """A malformed record, a protocol breach or a refusal on a home connection; the message
    says which and names the field."""


class RelayRefused(RelayError):
    """The relay refused to home this node (its REFUSED record's reason is the message)."""


class RecordType(enum.IntEnum):
    """What a record is (its envelope's byte 4)."""

    HELLO = 1
    ALLOCATED = 2
    OPEN = 3
    DATA = 4
    CREDIT = 5
    FIN = 6
    RESET = 7
    REFUSED = 8
    TAG = 9
    ACCEPTED = 10


def pack(kind: RecordType, stream: int = 0, arg: int = 0) -> bytes:
    """A record's 16-byte envelope."""
    return PREFIX.pack(MAGIC, VERSION, kind, stream, arg)


def unpack(prefix: bytes | bytearray | memoryview) -> tuple[RecordType, int, int]:
    """``(type, stream, arg)`` of an envelope.

    Raises:
        RelayError: not 16 bytes, not the magic, another version or an unknown type.
    """
    if len(prefix) != PREFIX_BYTES:
        raise RelayError(f"a relay envelope is {PREFIX_BYTES} bytes, got {len(prefix)}")
    magic, version, kind, stream, arg = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise RelayError(f"not a fedpipe relay record: it starts with {bytes(magic)!r}, "
                         f"not {MAGIC!r} (is this address a relay?)")
    if version != VERSION:
        raise RelayError(f"relay record version {version} is not supported; this side "
                         f"speaks version {VERSION}")
    try:
        return RecordType(kind), stream, arg
    except ValueError:
        raise RelayError(f"unknown relay record type {kind}") from None


def pack_text(kind: RecordType, stream: int, text: str) -> bytes:
    """A RESET or REFUSED record, whole (the text cut to :data:`MAX_BODY` bytes)."""
    body = text.encode()[:MAX_BODY]
    return pack(kind, stream, len(body)) + body


def _decode(cls, body: bytes, what: str):
    """A dataclass of JSON ``body``, every field present and of its declared type.

    Raises:
        RelayError: not JSON, not an object, unknown or missing fields, a wrong type or a
            negative number.
    """
    return jsonbody.dataclass_of(cls, jsonbody.json_object(body, what, RelayError), what,
                                 RelayError)


def _encode(kind: RecordType, obj) -> bytes:
    body = jsonbody.dump(obj)
    if len(body) > MAX_BODY:
        raise RelayError(f"{kind.name} body of {len(body)} bytes exceeds {MAX_BODY}")
    return pack(kind, 0, len(body)) + body


@dataclasses.dataclass(frozen=True)
class Hello:
    """What a node says first on its home connection.

    Attributes:
        node: the node's name (under TLS, its certificate's: the relay refuses another).
        grpc_port, data_port: the relay ports the node had before (a re-homing node asks
            for them again, so its advertised addresses stay the same); 0: any free one.
        data: 1 if the node has a socket data plane to splice, 0 if only gRPC.
        version: :data:`VERSION`.
    """

    node: str
    grpc_port: int = 0
    data_port: int = 0
    data: int = 1
    version: int = VERSION

    def encode(self) -> bytes:
        """The whole HELLO record."""
        return _encode(RecordType.HELLO, self)

    @classmethod
    def decode(cls, body: bytes) -> "Hello":
        """Raises: RelayError: a malformed body, another version, or no node name."""
        hello = _decode(cls, body, "relay HELLO")
        if hello.version != VERSION:
            raise RelayError(f"node speaks relay protocol version {hello.version}; this relay "
                             f"speaks {VERSION}")
        if not hello.node:
            raise RelayError("relay HELLO names no node")
        if hello.grpc_port > 65535 or hello.data_port > 65535:
            raise RelayError(f"relay HELLO asks for port {max(hello.grpc_port, hello.data_port)}"
                             ", above 65535")
        return hello


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The relay's answer to a HELLO.

    Attributes:
        relay: the relay's own ``HOST:PORT``, as the node dialed it.
        grpc_address: ``HOST:PORT`` the relay listens on for the node's gRPC service.
        data_address: ``HOST:PORT`` for its socket data plane ("" if the node has none).
        window: bytes each side may send on one stream before the other's CREDIT.
        max_streams: streams the relay splices for this node at once; it refuses more
            connections (closes them at once).
        job_streams: streams of one job (``TAG``-ged) the relay splices for this node at
            once; it refuses the job's next TAG, naming the job.
        job_window: bytes each side may send on the streams of one job, all together,
            before the other's CREDIT (at most ``window`` per stream still).
    """

    relay: str
    grpc_address: str
    data_address: str
    window: int
    max_streams: int
    job_streams: int
    job_window: int

    def encode(self) -> bytes:
        """The whole ALLOCATED record."""
        return _encode(RecordType.ALLOCATED, self)

    @classmethod
    def decode(cls, body: bytes) -> "Allocation":
        """Raises: RelayError: a malformed body or a zero window."""
        alloc = _decode(cls, body, "relay ALLOCATED")
        if min(alloc.window, alloc.max_streams, alloc.job_streams, alloc.job_window) < 1:
            raise RelayError("relay ALLOCATED grants no window or no streams (per stream, "
                             "node or job)")
        return alloc


@dataclasses.dataclass(frozen=True)
class Open:
    """A new stream: a peer connected to one of the node's relayed addresses.

    Attributes:
        service: ``grpc`` or ``data``: which of the node's local ports to connect.
        source: the dialer's address as the relay sees it (``HOST:PORT``); the dialer's name
            is inside the TLS it runs with the node, which the relay does not read.
        destination: the node's name.
        job: the job the dialer's TAG named (:class:`Tag`); "": it sent none (the relay
            does not decode a stream to learn its job).
    """

    service: str
    source: str
    destination: str
    job: str = ""

    def encode(self, stream: int) -> bytes:
        """The whole OPEN record of ``stream``."""
        body = json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()
        if len(body) > MAX_BODY:
            raise RelayError(f"OPEN body of {len(body)} bytes exceeds {MAX_BODY}")
        return pack(RecordType.OPEN, stream, len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> "Open":
        """Raises: RelayError: a malformed body or an unknown service."""
        opened = _decode(cls, body, "relay OPEN")
        if opened.service not in SERVICES:
            raise RelayError(f"relay OPEN names service {opened.service!r}, not one of "
                             f"{sorted(SERVICES)}")
        return opened


SERVICES = frozenset({"grpc", "data"})
"""The node's ports a relay splices: its gRPC service and its socket data plane."""


@dataclasses.dataclass(frozen=True)
class Tag:
    """What a dialer may say first, in the clear, on its connection to a relayed port: the
    envelope of one job's stream (the relay reads nothing after it: under TLS the rest is
    ciphertext).

    Attributes:
        job: the job whose tensors the stream carries (only them: the relay bounds the
            streams and bytes each job holds by it).
        source: the dialer's name, as it says (the relay cannot check it; the identity
            that counts is the one TLS shows the destination, end to end).
        destination: the node the dialer means: the relayed port's node, or the relay
            refuses the stream (the port was reallocated to another node).
    """

    job: str
    source: str
    destination: str

    def encode(self) -> bytes:
        """The whole TAG record."""
        return _encode(RecordType.TAG, self)

    @classmethod
    def decode(cls, body: bytes) -> "Tag":
        """Raises: RelayError: a malformed body, or no job or destination."""
        tag = _decode(cls, body, "relay TAG")
        if not tag.job or not tag.destination:
            raise RelayError("relay TAG names no job or no destination")
        return tag
