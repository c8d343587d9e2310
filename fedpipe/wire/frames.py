"""Chunking: one tensor message <-> a sequence of Frames of at most ~1 MiB each.

A large tensor never hits a gRPC message cap: its payload is cut into pieces
of ``CHUNK_BYTES``; the first frame carries the header (and routing envelope or
name), the rest carry only bytes. The receiver checks the pieces add up to the
declared ``payload_bytes`` before it decodes.

Every copy of a payload costs (a 16 MiB tensor is 4096 pages, and glibc's
defaults hand large buffers out as freshly mapped memory), so both directions
copy the payload as few times as the protobuf runtime allows: reading a bytes
field and setting one each copy, so the header is never copied with its
payload, and pieces are cut from one ``bytes`` object.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from ..proto import node_pb2, tensor_pb2
from . import codecs
from .codecs import WireError

CHUNK_BYTES = 1 << 20

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
              payload: bytes | memoryview | None = None) -> Iterator[node_pb2.Frame]:
    """Split an encoded tensor into frames; the first carries ``envelope`` and ``name``.

    ``payload``: the payload when it travels apart from ``msg`` (see
    :func:`fedpipe.wire.codecs.encode_payload`); each piece is then copied once.
    """
    if payload is None:
        payload = msg.payload  # one copy out of the message; each piece below is one more
    else:
        payload = memoryview(payload)
    first = node_pb2.Frame(envelope=envelope, name=name)
    head = _copy_header(msg, first.tensor)  # filled in place: Frame(tensor=...) would copy it
    head.payload = bytes(payload[:chunk_bytes])  # no copy for bytes that fit
    head.payload_bytes = len(payload)
    yield first
    for off in range(chunk_bytes, len(payload), chunk_bytes):
        yield node_pb2.Frame(chunk=bytes(payload[off:off + chunk_bytes]))


def encode_frames(t: torch.Tensor, codec: str = "raw", **kw) -> Iterator[node_pb2.Frame]:
    """Encode ``t`` with ``codec`` (:func:`fedpipe.wire.codecs.encode_payload`) and
    split it; ``kw`` (``envelope``, ``name``) goes to :func:`to_frames`."""
    msg, payload = codecs.encode_payload(t, codec)
    return to_frames(msg, payload=payload, **kw)


def read_tensors(frames: Iterable[node_pb2.Frame],
                 admit: Callable[[node_pb2.Frame], int] | None = None
                 ) -> Iterator[tuple[node_pb2.Frame, torch.Tensor]]:
    """Reassemble and decode the tensors of a frame stream.

    Yields ``(first_frame, tensor)`` for each tensor as soon as its last
    payload byte is in (a stream may stay open between tensors);
    ``first_frame`` carries the envelope and name. ``admit(first_frame)``,
    called before any of a tensor's payload is buffered, may raise to refuse
    it and returns the most bytes the tensor may take, encoded or decoded
    (default :data:`fedpipe.wire.codecs.MAX_TENSOR_BYTES`).

    Raises:
        WireError: a continuation frame without a header, pieces that do not
            add up to ``payload_bytes``, a tensor over its limit, or a
            malformed tensor (see :func:`fedpipe.wire.codecs.decode`).
    """
    head: node_pb2.Frame | None = None
    parts: list[bytes] = []
    size = 0
    limit = codecs.MAX_TENSOR_BYTES

    def finish(first: node_pb2.Frame) -> tuple[node_pb2.Frame, torch.Tensor]:
        nonlocal parts
        if size != first.tensor.payload_bytes:
            raise WireError(f"tensor stream ended after {size} payload bytes, header declared "
                            f"{first.tensor.payload_bytes}")
        payload = bytearray().join(parts)  # the one copy: decoded in place
        parts = []
        return first, codecs.decode(first.tensor, payload=payload, max_bytes=limit)

    for frame in frames:
        if frame.HasField("tensor"):
            if head is not None:
                yield finish(head)  # raises: the previous tensor is incomplete
            head, parts, size = frame, [frame.tensor.payload], len(frame.tensor.payload)
            limit = admit(head) if admit is not None else codecs.MAX_TENSOR_BYTES
            if head.tensor.payload_bytes > limit:
                raise WireError(f"tensor payload of {head.tensor.payload_bytes} bytes exceeds "
                                f"the limit of {limit}")
        elif head is None:
            raise WireError("a continuation chunk without a tensor header before it")
        else:
            chunk = frame.chunk
            parts.append(chunk)
            size += len(chunk)
        if size > head.tensor.payload_bytes:
            raise WireError(f"tensor stream carries more than the declared "
                            f"{head.tensor.payload_bytes} payload bytes")
        if size == head.tensor.payload_bytes:  # complete: hand it over now, the
            yield finish(head)                  # stream may stay open for the next
            head = None
    if head is not None:
        yield finish(head)
