"""The socket data plane's records: what one connection carries, byte for byte. No torch.

A connection is a byte stream of *records*. Each starts with a 16-byte prefix;
what follows depends on its type (contract: ``protos/fedpipe/v1/FRAMES.md``,
"Connections"):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       3     magic ``b"FPC"``
3       1     version, :data:`VERSION`
4       1     type, a :class:`RecordType`
5       3     zero
8       8     ``arg``, unsigned little-endian: what it means depends on the type
======  ====  ==============================================================

* ``PREFACE``: ``arg`` is the length of a JSON body (at most
  :data:`MAX_PREFACE_BYTES`), a :class:`Preface`.
* ``TENSOR``: ``arg`` is the tensor's sequence number; a HEAD wire frame
  (:mod:`fedpipe.wire.format`) follows whose payload is the whole tensor,
  ``payload_bytes`` long: the frames are the same as over gRPC, only never
  cut into MORE frames (the stream has no message cap).
* ``ACK``: ``arg``: every tensor below this sequence number was delivered
  (or refused); it returns their bytes and messages to the sender's credit.
* ``SYNC``: ``arg`` is the sender's next sequence number; the receiver answers
  with an ``ACK`` as soon as it has delivered everything before it.
* ``REFUSED``: ``arg`` is the refused tensor's sequence number; a 4-byte status
  code (gRPC's numbering) and a 4-byte text length, then the UTF-8 text.
* ``GOAWAY``: ``arg`` is zero; a code, a text length and the text follow as in
  ``REFUSED``. The sender closes the connection after it, and the link fails:
  it is not resumed.
* ``FETCH``: ``arg`` is the fetch's id (the asking side's); a 4-byte :class:`Method`
  and a 4-byte request length (at most :data:`MAX_REQUEST_BYTES`), then the
  serialized request (``FetchStateRequest`` or ``FetchSnapshotRequest``). The
  peer answers with ``TENSOR`` records whose header's ``fetch`` is that id, then
  a ``FETCHED``.
* ``FETCHED``: ``arg`` is the fetch's id; a code and text as in ``REFUSED``: ``OK``,
  every tensor of the answer came before it; another code, the fetch failed
  (what gRPC's call would have ended with).
"""
from __future__ import annotations

import dataclasses
import enum
import struct

from ...wire import jsonbody
from ...wire.format import WireError

MAGIC = b"FPC"
VERSION = 1
"""The connection protocol's version; a preface of another version is refused, naming both."""
PREFIX = struct.Struct("<3sBB3xQ")
"""A record's prefix: magic, version, type, three zero bytes, ``arg``."""
PREFIX_BYTES = PREFIX.size
MAX_ARG = 2**64 - 1
"""Largest ``arg`` of a record: a sequence number, an acknowledgement, a length."""
MAX_SEQ = 2**63 - 1
"""Largest sequence number a preface may start or resume from: far from :data:`MAX_ARG`, so
the numbers after it (and their acknowledgement, one past the last) still fit a record."""
TEXT = struct.Struct("<II")
"""A REFUSED or GOAWAY record's status code and text length, after its prefix."""
MAX_PREFACE_BYTES = 4096
"""Largest preface body, bytes (names are short; a preface is a few hundred bytes)."""
MAX_TEXT_BYTES = 4096
"""Longest refusal or goaway text a receiver reads, bytes; longer text is cut to this."""
FETCH_BODY = struct.Struct("<II")
"""A FETCH record's method and request length, after its prefix."""
MAX_REQUEST_BYTES = 4096
"""Largest request a FETCH record carries, bytes (a few ids and numbers: tens of bytes)."""


class RecordType(enum.IntEnum):
    """What a record is (its prefix's byte 4)."""

    PREFACE = 1
    TENSOR = 2
    ACK = 3
    SYNC = 4
    REFUSED = 5
    GOAWAY = 6
    FETCH = 7
    FETCHED = 8


class Method(enum.IntEnum):
    """What a FETCH asks for: the gRPC method whose answer it is."""

    FETCH_STATE = 1
    FETCH_SNAPSHOT = 2


class Code(enum.IntEnum):
    """Status codes a REFUSED or GOAWAY record carries: gRPC's numbers, so a node's error
    table maps a domain error to the same code on either data plane."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


def code_of(value: int) -> Code:
    """The :class:`Code` a REFUSED or GOAWAY record carries; one this side does not know
    (a peer of another version, or garbage) is ``UNKNOWN``, never an error."""
    try:
        return Code(value)
    except ValueError:
        return Code.UNKNOWN


def pack(kind: RecordType, arg: int = 0) -> bytes:
    """A record's 16-byte prefix."""
    return PREFIX.pack(MAGIC, VERSION, kind, arg)


def unpack(prefix: bytes | bytearray | memoryview) -> tuple[RecordType, int]:
    """``(type, arg)`` of a record prefix.

    Raises:
        WireError: not 16 bytes, not the magic, another version or an unknown type.
    """
    if len(prefix) != PREFIX_BYTES:
        raise WireError(f"a record prefix is {PREFIX_BYTES} bytes, got {len(prefix)}")
    magic, version, kind, arg = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"not a fedpipe connection record: it starts with {bytes(magic)!r}, "
                        f"not {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"connection record version {version} is not supported; this side "
                        f"speaks version {VERSION}")
    record = _TYPES.get(kind)
    if record is None:
        raise WireError(f"unknown connection record type {kind}")
    return record, arg


_TYPES = {t.value: t for t in RecordType}
"""Record type byte -> :class:`RecordType` (a lookup, not the enum's call: a few us a record)."""


def pack_text(kind: RecordType, arg: int, code: int, text: str) -> bytes:
    """A REFUSED (``arg``: the sequence number) or GOAWAY (``arg``: 0) record, whole."""
    body = text.encode()[:MAX_TEXT_BYTES]
    return pack(kind, arg) + TEXT.pack(code, len(body)) + body


def pack_fetch(fetch: int, method: Method, request: bytes) -> bytes:
    """A FETCH record, whole.

    Raises:
        WireError: the request is longer than :data:`MAX_REQUEST_BYTES`.
    """
    if len(request) > MAX_REQUEST_BYTES:
        raise WireError(f"fetch request of {len(request)} bytes exceeds {MAX_REQUEST_BYTES}")
    return pack(RecordType.FETCH, fetch) + FETCH_BODY.pack(method, len(request)) + request


@dataclasses.dataclass(frozen=True)
class Preface:
    """What each side says first on a connection (the dialer, then the acceptor).

    Attributes:
        name: the sender's node name (with TLS it must be its certificate's).
        role: ``node`` or ``client``.
        session: this side's link state's random id (hex): a peer that sees another
            session than before knows this side lost its state (a restart).
        base: the sequence number of the first tensor this side will send or resend.
        resume_session: the peer's session this side holds inbound state for ("" none).
        resume: the next sequence number this side expects from ``resume_session``:
            the peer resends its tensors from there and forgets those below.
        window_bytes: the credit this side grants, bytes of tensors not yet acknowledged.
        window_messages: the credit this side grants, tensors not yet acknowledged.
    """

    name: str
    role: str
    session: str
    base: int = 0
    resume_session: str = ""
    resume: int = 0
    window_bytes: int = 0
    window_messages: int = 0
    version: int = VERSION

    def encode(self) -> bytes:
        """The whole PREFACE record: prefix and JSON body."""
        body = jsonbody.dump(self)
        if len(body) > MAX_PREFACE_BYTES:
            raise WireError(f"preface of {len(body)} bytes exceeds {MAX_PREFACE_BYTES}")
        return pack(RecordType.PREFACE, len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> "Preface":
        """A preface from its JSON body, every field checked.

        Raises:
            WireError: not JSON, unknown or missing fields, a field of the wrong type,
                a number that is negative or past 2**64 - 1 (sequence numbers travel as a
                record's 8-byte ``arg``), a base or resume past :data:`MAX_SEQ`, no window,
                or another protocol version.
        """
        fields = jsonbody.json_object(body, "preface", WireError)
        version = fields.get("version")
        if version != VERSION:
            raise WireError(f"peer speaks connection version {version!r}; this side speaks "
                            f"{VERSION}")
        preface = jsonbody.dataclass_of(cls, fields, "preface", WireError, max_int=MAX_ARG)
        if max(preface.base, preface.resume) > MAX_SEQ:
            raise WireError(f"preface base {preface.base} or resume {preface.resume} is past "
                            f"the largest first sequence number, 2**63 - 1")
        if preface.window_bytes < 1 or preface.window_messages < 1:
            raise WireError("preface grants no credit (window_bytes and window_messages "
                            "must be >= 1)")
        if not preface.name:
            raise WireError("preface names no peer")
        return preface
