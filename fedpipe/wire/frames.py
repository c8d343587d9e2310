"""Chunking: one encoded tensor <-> a sequence of wire frames (raw bytes) of at most ~1 MiB each.

A large tensor never hits a gRPC message cap: its payload is cut into pieces
of ``CHUNK_BYTES``; the first frame (HEAD) carries the tensor header and the
routing envelope or name, the rest (MORE) carry only bytes. The frame layout
is :mod:`fedpipe.wire.format` (contract: ``protos/fedpipe/v1/FRAMES.md``).
The receiver checks the header before it buffers a byte of the payload and
that the pieces add up to the declared ``payload_bytes`` before it decodes.

Frames are raw bytes, so no protobuf runtime copies the payload: the sender
copies each piece once (into its frame, from the tensor's own memory for raw
CPU tensors) and the receiver once (each piece, as it arrives, into the
tensor's buffer, which is decoded in place). gRPC itself copies each message
once each way, as it does for raw-bytes calls.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch

from ..proto import node_pb2, tensor_pb2
from . import codecs, format, lowrank
from .format import WireError

CHUNK_BYTES = 1 << 20
"""Payload bytes per frame (the first frame's header comes on top)."""

Frame = bytes
"""One wire frame: one gRPC message of a data-plane stream (:mod:`fedpipe.wire.format`)."""

_PAYLOAD_FIELDS = ("payload", "payload_bytes")
_HEADER_FIELDS = tuple(f for f in tensor_pb2.Tensor.DESCRIPTOR.fields
                       if f.name not in _PAYLOAD_FIELDS)


def _copy_header(msg: tensor_pb2.Tensor, head: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """Copy the fields of ``msg`` except ``payload`` and ``payload_bytes`` into ``head``
    (``CopyFrom`` would copy the payload too)."""
    head.SetInParent()
    for f in _HEADER_FIELDS:
        if f.is_repeated:
            getattr(head, f.name).extend(getattr(msg, f.name))
        elif f.message_type is not None:
            if msg.HasField(f.name):
                getattr(head, f.name).CopyFrom(getattr(msg, f.name))
        else:
            setattr(head, f.name, getattr(msg, f.name))
    return head


def to_frames(msg: tensor_pb2.Tensor, *, envelope: node_pb2.Envelope | None = None,
              name: str = "", chunk_bytes: int = CHUNK_BYTES,
              payload: bytes | memoryview | None = None) -> Iterator[Frame]:
    """Split an encoded tensor into wire frames; the first carries ``envelope`` and ``name``.

    Args:
        msg: the encoded tensor (:func:`fedpipe.wire.codecs.encode`); its
            ``payload`` is used unless ``payload`` is given.
        payload: the payload when it travels apart from ``msg`` (see
            :func:`fedpipe.wire.codecs.encode_payload`).
        chunk_bytes: payload bytes per frame, >= 1.

    Each payload byte is copied once, into its frame; frames are made as they
    are asked for, so a stream's pieces are copied while earlier ones travel.
    """
    view = memoryview(msg.payload if payload is None else payload).cast("B")
    header = node_pb2.Frame(envelope=envelope, name=name)
    if msg.payload:
        _copy_header(msg, header.tensor)
    else:  # the payload travels apart (encode_payload): nothing to leave out
        header.tensor.CopyFrom(msg)
    header.tensor.payload_bytes = len(view)
    yield format.pack_head(header, view[:chunk_bytes])
    for off in range(chunk_bytes, len(view), chunk_bytes):
        yield format.pack_more(view[off:off + chunk_bytes])


def _reserve(nbytes: int) -> memoryview:
    """A writable, uninitialized buffer of ``nbytes`` (a checked ``payload_bytes``).

    Memory the pieces are copied into as they arrive. It is not touched here:
    the operating system maps its pages as they are first written, so a
    tensor declared large but sent short holds about what arrived (a buffer
    above glibc's mmap threshold is a fresh mapping; below it, heap the
    process already holds or extends).

    Raises:
        WireError: the memory cannot be reserved.
    """
    try:
        return torch.empty(nbytes, dtype=torch.uint8).numpy().data
    except RuntimeError as e:  # the allocator's "can't allocate memory"
        raise WireError(f"cannot reserve {nbytes} bytes for a tensor's payload: {e}") from None


class Admitted(NamedTuple):
    """What a receiver's admission of a tensor header may say besides its size limit: the
    receiving end of its link for a stateful codec (:class:`.lowrank.End`: the stage's
    basis of the boundary the tensor crosses), which its decode needs; and whether the
    tensor goes on to a CUDA device.

    Attributes:
        limit: the most bytes the tensor may take, encoded or decoded.
        end: the link's end at the receiver (None: a stateless codec's tensor).
        pinned: the receiver moves the tensor to a CUDA device: the socket data plane
            receives a raw payload into pinned host memory, from which that copy is
            asynchronous (:func:`fedpipe.net.dataplane.connection.read_tensor`). gRPC's
            receive path ignores it (its payloads arrive in gRPC's own messages).
    """

    limit: int
    end: lowrank.End | None = None
    pinned: bool = False


def admitted(answer: "int | Admitted") -> Admitted:
    """An admission's answer (a size limit, or an :class:`Admitted`) as an :class:`Admitted`."""
    return answer if isinstance(answer, Admitted) else Admitted(answer)


def encode_frames(t: torch.Tensor, codec: str = "raw", **kw: Any) -> Iterator[Frame]:
    """Encode ``t`` with ``codec`` (:func:`fedpipe.wire.codecs.encode_payload`) and
    split it; ``kw`` (``envelope``, ``name``, ``chunk_bytes``) goes to :func:`to_frames`."""
    msg, payload = codecs.encode_payload(t, codec)
    return to_frames(msg, payload=payload, **kw)


def read_tensors(frames: Iterable[Frame],
                 admit: Callable[[node_pb2.Frame], "int | Admitted"] | None = None, *,
                 in_place: bool = False) -> Iterator[tuple[node_pb2.Frame, torch.Tensor]]:
    """Reassemble and decode the tensors of a wire-frame stream.

    Yields ``(header, tensor)`` for each tensor as soon as its last payload
    byte is in (a stream may stay open between tensors); ``header`` (a
    ``fedpipe.v1.Frame`` without payload) carries the envelope and name.
    ``admit(header)``, called before any of a tensor's payload is buffered,
    may raise to refuse it and returns the most bytes the tensor may take,
    encoded or decoded (default :data:`fedpipe.wire.codecs.MAX_TENSOR_BYTES`), or an
    :class:`Admitted` with that limit and the link's end a stateful codec decodes with.
    Every field of the frame (:func:`fedpipe.wire.format.unpack`) and of the
    tensor header (:func:`fedpipe.wire.codecs.check_header`) is checked before
    the payload is buffered. Then the tensor's ``payload_bytes`` are reserved
    uninitialized (:func:`_reserve`) and each piece is copied in as it
    arrives: resident memory grows with the bytes received, never with a size
    only declared.

    ``in_place``: the frames are the caller's to give away, read by nothing
    else (gRPC's received messages are): a raw tensor that arrives in one frame
    is then decoded in place over that frame's memory, not copied
    (:func:`fedpipe.wire.codecs.decode`; senders pad the header so that its
    payload is aligned, see :func:`fedpipe.wire.format.pack_head`).

    Raises:
        WireError: a malformed frame or tensor header, a continuation frame
            without a header, pieces that do not add up to ``payload_bytes``,
            a tensor over its limit, or a malformed payload (see
            :func:`fedpipe.wire.codecs.decode`).
    """
    head: node_pb2.Frame | None = None
    buf = memoryview(b"")  # the current tensor's payload, filled in as its pieces arrive
    size = want = 0
    limit, end = codecs.MAX_TENSOR_BYTES, None

    def finish(first: node_pb2.Frame) -> tuple[node_pb2.Frame, torch.Tensor]:
        nonlocal buf
        if size != want:
            raise WireError(f"tensor stream ended after {size} payload bytes, header declared "
                            f"{want}")
        payload, buf = buf, memoryview(b"")
        return first, codecs.decode(first.tensor, payload=payload, max_bytes=limit, end=end)

    for frame in frames:
        header, piece = format.unpack(frame)
        if header is not None:
            if head is not None:
                yield finish(head)  # raises: the previous tensor is incomplete
            limit, end, _ = admitted(admit(header)) if admit is not None \
                else (codecs.MAX_TENSOR_BYTES, None, False)
            codecs.check_header(header.tensor, limit)
            head, want, size = header, header.tensor.payload_bytes, 0
            if in_place and len(piece) == want:  # the whole tensor, in memory handed over
                head = None
                yield header, codecs.decode(header.tensor, payload=piece, max_bytes=limit,
                                            in_place=True, end=end)
                continue
            buf = _reserve(want)
        elif head is None:
            raise WireError("a continuation frame without a tensor header before it")
        if size + len(piece) > want:
            raise WireError(f"tensor stream carries more than the declared {want} payload bytes")
        # the one copy on this side, while the next pieces travel: into the buffer
        # the tensor is decoded in place from
        buf[size:size + len(piece)] = piece
        size += len(piece)
        if size == want:      # complete: hand it over now, the
            yield finish(head)  # stream may stay open for the next
            head = None
    if head is not None:
        yield finish(head)
