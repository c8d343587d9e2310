"""The data plane's frame format: one gRPC message <-> (header, payload piece). No torch.

The data-plane methods (``Send``, ``PutSnapshot`` requests; ``FetchState``,
``FetchSnapshot`` replies; :data:`fedpipe.wire.rpc.FRAME_METHODS`) carry raw
bytes, not protobuf messages: protobuf would copy a tensor's payload on every
serialization and parse. Each gRPC message is one *frame*, a fixed prefix and
then either a header and the first payload piece (HEAD) or only payload bytes
(MORE). The contract, with byte offsets, is ``protos/fedpipe/v1/FRAMES.md``:

======  ====  =======================================================================
offset  size  field
======  ====  =======================================================================
0       3     magic ``b"FPW"``
3       1     version, :data:`VERSION`
4       1     kind: :data:`HEAD` (1) or :data:`MORE` (2)
5       4     HEAD only: header length ``h``, unsigned little-endian, <= :data:`MAX_HEADER_BYTES`
9       h     HEAD only: a serialized ``fedpipe.v1.Frame`` (envelope, name, and ``tensor``
              with ``payload`` empty and ``payload_bytes`` the whole payload's length;
              ``pad`` makes 9 + h a multiple of :data:`PAYLOAD_ALIGN`)
9+h     rest  HEAD: the payload's first piece; MORE (from offset 5): its next piece
======  ====  =======================================================================

:func:`unpack` checks every prefix field and the header before it returns
anything, and copies nothing but the (small) header; the piece it returns is
a view of the message. This module imports no torch, so the security layer
(which reads a client's envelope) and the tracker may use it.
"""
from __future__ import annotations

import struct

from google.protobuf.message import DecodeError

from ..proto import node_pb2, tensor_pb2
from ..spec import SpecError


class WireError(SpecError):
    """A tensor message or frame is malformed: the message says which field and why.

    A subclass of :class:`fedpipe.spec.SpecError` (a ValueError), which bad codec
    spec strings raise.
    """


MAGIC = b"FPW"
VERSION = 1
"""The frame format's version; a frame of another version is refused, naming both."""
HEAD, MORE = 1, 2
"""Frame kinds: a tensor's header and first payload piece; a further payload piece."""
MAX_HEADER_BYTES = 1 << 16
"""Largest serialized header a frame may carry, bytes (an envelope, a name and a
64-dimension shape take well under 1 KiB)."""

_PREFIX = struct.Struct("<3sBB")   # magic, version, kind
_HEAD_LEN = struct.Struct("<I")    # header length, after the prefix
HEAD_PREFIX_BYTES = _PREFIX.size + _HEAD_LEN.size
"""Bytes before a HEAD frame's header: 9."""
MORE_PREFIX = _PREFIX.pack(MAGIC, VERSION, MORE)
"""The whole prefix of a MORE frame: 5 bytes."""
_HEAD_PREFIX = _PREFIX.pack(MAGIC, VERSION, HEAD)

Buffer = bytes | bytearray | memoryview

PAYLOAD_ALIGN = 16
"""A HEAD frame's payload starts at a multiple of this many bytes into the frame: its
header is padded with ``pad`` (a receiver may then decode the payload in place)."""
# serialized Frames holding only ``pad``, one of each length modulo PAYLOAD_ALIGN (its tag
# and length take 3 bytes; an empty ``pad`` would not be serialized at all)
_PADS = {n: node_pb2.Frame(pad=bytes((n - 3) % PAYLOAD_ALIGN or PAYLOAD_ALIGN))
         .SerializeToString() for n in range(1, PAYLOAD_ALIGN)}
assert all(len(p) % PAYLOAD_ALIGN == n for n, p in _PADS.items())


def pack_head(header: node_pb2.Frame, piece: Buffer = b"") -> bytes:
    """A HEAD frame: ``header`` (tensor header with ``payload`` empty) and the first ``piece``.

    One copy of ``piece`` (into the returned message). The header gets a
    ``pad`` field that makes ``piece`` start at a multiple of
    :data:`PAYLOAD_ALIGN` bytes into the frame (serialized messages
    concatenate: the pad is appended to the header's serialization).

    Raises:
        WireError: the header is over :data:`MAX_HEADER_BYTES` or carries payload bytes.
    """
    if header.tensor.payload or header.chunk:
        raise WireError("a frame header must not carry payload bytes: they follow it")
    return _framed(header.SerializeToString(), piece)


def pack_head_of(envelope: node_pb2.Envelope | None, tensor: tensor_pb2.Tensor | bytes,
                 name: str = "", fetch: int = 0) -> bytes:
    """:func:`pack_head` of ``Frame(envelope=envelope, tensor=tensor, name=name,
    fetch=fetch)`` and no piece: the same bytes, without building the Frame (its fields'
    serializations joined in field-number order, as protobuf writes them). Building a
    Frame and copying the tensor header into it cost 3.5 us a tensor, this 1 us (the
    socket data plane's sender, ``benchmarks/dataplane.py``'s CPU per message).
    ``tensor`` may be given serialized (a header without payload bytes).

    Raises:
        WireError: as :func:`pack_head`.
    """
    if isinstance(tensor, bytes):
        body = tensor
    elif tensor.payload:
        raise WireError("a frame header must not carry payload bytes: they follow it")
    else:
        body = tensor.SerializeToString()
    if envelope is None:
        head = b"".join((_TENSOR_TAG, _varint(len(body)), body))
    else:
        env = envelope.SerializeToString()
        head = b"".join((_ENVELOPE_TAG, _varint(len(env)), env,
                         _TENSOR_TAG, _varint(len(body)), body))
    if name or fetch:  # fields 4 and 5, after the tensor's 2
        head += node_pb2.Frame(name=name, fetch=fetch).SerializeToString()
    return _framed(head)


def _framed(head: bytes, piece: Buffer = b"") -> bytes:
    """A serialized header, padded (:data:`PAYLOAD_ALIGN`) and framed, then ``piece``.

    Raises:
        WireError: the header is over :data:`MAX_HEADER_BYTES`.
    """
    misaligned = (HEAD_PREFIX_BYTES + len(head)) % PAYLOAD_ALIGN
    if misaligned:
        head += _PADS[PAYLOAD_ALIGN - misaligned]
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {len(head)} bytes exceeds the limit of "
                        f"{MAX_HEADER_BYTES}")
    return b"".join((_HEAD_PREFIX, _HEAD_LEN.pack(len(head)), head, piece))


_ENVELOPE_TAG = bytes([1 << 3 | 2])
"""The key of ``Frame.envelope`` (field 1, length-delimited): what precedes its length."""
_TENSOR_TAG = bytes([2 << 3 | 2])
"""The key of ``Frame.tensor`` (field 2, length-delimited)."""


def _varint(n: int) -> bytes:
    """``n`` >= 0 as a protobuf varint (a length-delimited field's length)."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pack_more(piece: Buffer) -> bytes:
    """A MORE frame: the next ``piece`` of the current tensor's payload (one copy)."""
    return b"".join((MORE_PREFIX, piece))


def unpack(message: Buffer) -> tuple[node_pb2.Frame | None, memoryview]:
    """Split one frame into its header (None for a MORE frame) and its payload piece.

    Checks, in order and before anything is allocated: the length, the magic,
    the version, the kind, the header length (at most :data:`MAX_HEADER_BYTES`
    and within the message), that the header parses, that it has a ``tensor``
    and that it carries no payload bytes of its own. The tensor header's fields
    are the codec's to check (:func:`fedpipe.wire.codecs.check_header`).

    Returns:
        ``(header, piece)``: ``piece`` is a view of ``message``, no copy.

    Raises:
        WireError: naming the field that is wrong and its value.
    """
    view = memoryview(message)
    if len(view) < _PREFIX.size:
        raise WireError(f"a wire frame of {len(view)} bytes is shorter than its "
                        f"{_PREFIX.size}-byte prefix")
    magic, version, kind = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a fedpipe wire frame: it starts with {bytes(view[:3])!r}, not "
                        f"{MAGIC!r} (a sender that predates protos/fedpipe/v1/FRAMES.md?)")
    if version != VERSION:
        raise WireError(f"wire frame version {version} is not supported; this side speaks "
                        f"version {VERSION}")
    if kind == MORE:
        return None, view[_PREFIX.size:]
    if kind != HEAD:
        raise WireError(f"unknown wire frame kind {kind} (HEAD is {HEAD}, MORE is {MORE})")
    if len(view) < HEAD_PREFIX_BYTES:
        raise WireError(f"a HEAD frame of {len(view)} bytes is shorter than its "
                        f"{HEAD_PREFIX_BYTES}-byte prefix")
    (size,) = _HEAD_LEN.unpack_from(view, _PREFIX.size)
    if size > MAX_HEADER_BYTES:
        raise WireError(f"frame header length {size} exceeds the limit of {MAX_HEADER_BYTES}")
    end = HEAD_PREFIX_BYTES + size
    if end > len(view):
        raise WireError(f"frame header length {size} runs past the end of the "
                        f"{len(view)}-byte frame")
    header = parse_header(view[HEAD_PREFIX_BYTES:end])
    return header, view[end:]


def parse_header(body: Buffer) -> node_pb2.Frame:
    """A HEAD frame's header from its serialized bytes (those after the prefix and
    length), checked as :func:`unpack` checks it: it parses, it has a ``tensor``, and it
    carries no payload bytes of its own.

    Raises:
        WireError: naming what is wrong.
    """
    try:
        header: node_pb2.Frame = node_pb2.Frame.FromString(bytes(body))
    except DecodeError as e:
        raise WireError(f"frame header does not parse as fedpipe.v1.Frame: {e}") from None
    if not header.HasField("tensor"):
        raise WireError("frame header has no tensor")
    if header.tensor.payload or header.chunk:
        raise WireError("frame header carries payload bytes of its own; they must follow it")
    return header


def peek_header(message: Buffer) -> node_pb2.Frame | None:
    """The header of a HEAD frame, None for a MORE frame (see :func:`unpack`).

    Raises:
        WireError: a malformed frame.
    """
    return unpack(message)[0]
