"""Tensor codecs: torch.Tensor <-> fedpipe.v1.Tensor message.

Each codec is a pair of pure functions registered by name in :data:`CODECS`;
its sizes and costs (what the planner prices a link with) are its row of
:data:`fedpipe.wire.codecmodel.MODELS`, which also gives the exact output
lengths checked here.
A message names its own codec and parameters, so a receiver needs no
out-of-band knowledge. Decoders validate every header field against the
payload before they allocate.

Codec spec strings (``"int8:64+zstd"``) follow the grammar of
:class:`fedpipe.spec.CodecSpec`, parsed by :func:`fedpipe.spec.parse_codec`.

Wire layouts, little-endian, C order; ``encoded_bytes`` is the length of the
codec output before zstd, n = number of elements:

======  ==========================  =========================================  ====================
codec   header fields               payload (before zstd)                      encoded_bytes
======  ==========================  =========================================  ====================
raw     -                           n values of ``dtype``                      n·itemsize(dtype)
fp16    -                           n float16, saturated to ±65504             2n
bf16    -                           n bfloat16, saturated to its finite range  2n
int8    ``block_size`` = B          ⌈n/B⌉ float32 scales, then n int8          4⌈n/B⌉ + n
topk    ``k``, ``value_dtype``      k flat indices, strictly increasing, then  k·(w + itemsize(
                                    k values of ``value_dtype``; index width   value_dtype))
                                    w = 4 (int32) if n < 2**31 else 8 (int64)
had4    ``block_size`` = B, a       ⌈n/B⌉ float32 steps, then ⌈n/B⌉·B 4-bit    ⌈n/B⌉·(4 + B/2)
        power of two                codes of the rotated, zero-padded blocks,
                                    two per byte (see :mod:`.hadamard`)
had2    as had4                     as had4, 2-bit codes, four per byte        ⌈n/B⌉·(4 + B/4)
sparse- ``k`` = values kept per     per chunk of C = 4096 values (zero-padded  m·(4 + 3⌈k/2⌉ +
loco    chunk, 1..C                 to m = ⌈n/C⌉ chunks): m float32 scales,    ⌈k/4⌉)
                                    then m·3⌈k/2⌉ bytes of 12-bit indices,
                                    then m·⌈k/4⌉ bytes of 2-bit codes (see
                                    :mod:`.sparseloco`)
low-    ``k`` = R, ``basis``,       [if ``basis``: d·R float32, the basis P,   [4dR] + 4R·n/d
rank    ``basis_version``; d =      row-major], then per row of d values its
        ``shape[-1]``               R float32 coefficients (see :mod:`.lowrank`)
low-    as lowrank                  [P], then n/d float32 scales, then n/d·R   [4dR] + (4+R)·n/d
rank8                               int8 coefficients (per row absmax)
======  ==========================  =========================================  ====================

lowrank and lowrank8 are stateful: both ends of a link hold its basis
(:class:`.lowrank.Subspace`), so their encode and decode take the link's
:class:`.lowrank.End`.

The topk index width is not a header field: it follows from ``shape`` (n), so
the message still describes itself completely.

The lossy codecs (all but raw) apply to floating tensors only. A
tensor of another dtype (token ids, masks) sent with a lossy codec falls back
to ``raw`` (zstd still applies), so any tensor can be sent on any link.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
import zstandard

from ..proto import tensor_pb2 as pb
from ..spec import CODEC_PARAMS, CodecSpec, parse_codec
from .codecmodel import MODELS
from .feedback import ErrorFeedback as ErrorFeedback  # re-exported: codecs.ErrorFeedback
from .format import WireError
from . import codecfns as fn, lowrank
from .codecfns import DTYPES as DTYPES, TORCH_DTYPES as TORCH_DTYPES  # re-exported

__all__ = ["CODECS", "DTYPES", "MAX_TENSOR_BYTES", "Codec", "ErrorFeedback", "WireError",
           "check_header", "decode", "encode", "encode_payload"]


# torch.frombuffer warns, once per process, that a tensor over read-only memory can
# write to it: decode(in_place=True) means exactly that (see its docstring), so the
# one warning is taken here, where it would otherwise name a received frame
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

MAX_DIMS = 64
MAX_TENSOR_BYTES = 1 << 34
"""Default bound (16 GiB) on a decoded tensor and on its codec output; see :func:`decode`."""


# ---------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class Codec:
    """One registered codec: pure functions over flat (1-D, contiguous) tensors.

    Attributes:
        name: the name in spec strings (and in :data:`~fedpipe.wire.codecmodel.MODELS`).
        code: its ``fedpipe.v1.Codec`` enum value.
        encode: ``(flat, spec, context) -> (parts, fields)``: tensors whose bytes,
            concatenated, are the codec output, and the header fields to set
            (:class:`Context`: the rounding seed, the row width, a stateful
            codec's end of the link).
        size: ``(header) -> int``: the codec output's length in bytes implied
            by the header (its model's ``encoded_bytes``); validates the
            codec's header fields (WireError).
        decode: ``(buf, header) -> flat``: the 1-D tensor of ``header.dtype``
            from a buffer of exactly ``size(header)`` bytes (WireError on bad
            content).
        fields: header fields the codec uses (the others must be zero).
        stateful: encode and decode need the link's :class:`.lowrank.End`.
    """
    name: str
    code: pb.Codec
    encode: fn.EncodeFn
    size: Callable[[fn.Header], int]
    decode: Callable[[fn.Buffer, fn.Header], torch.Tensor]
    fields: tuple[str, ...] = ()
    stateful: bool = False
    unused: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """The codec parameter fields it does not use (a header must leave them zero)."""
    lossy: bool = field(init=False, repr=False, compare=False)
    """Floating tensors only; other dtypes fall back to raw (its model's ``lossy``)."""

    def __post_init__(self) -> None:  # derived once: a receiver checks them per tensor
        object.__setattr__(self, "unused", tuple(f for f in _PARAM_FIELDS
                                                 if f not in self.fields))
        object.__setattr__(self, "lossy", MODELS[self.name].lossy)


_PARAM_FIELDS = ("block_size", "k", "value_dtype", "basis", "basis_version")


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", pb.CODEC_RAW, fn.raw_encode, fn.raw_size, fn.raw_decode),
    Codec("fp16", pb.CODEC_FP16, *fn.cast_codec("fp16", torch.float16)),
    Codec("bf16", pb.CODEC_BF16, *fn.cast_codec("bf16", torch.bfloat16)),
    Codec("int8", pb.CODEC_INT8, fn.int8_encode, fn.int8_size, fn.int8_decode,
          fields=("block_size",)),
    Codec("topk", pb.CODEC_TOPK, fn.topk_encode, fn.topk_size, fn.topk_decode,
          fields=("k", "value_dtype")),
    Codec("had4", pb.CODEC_HAD4, *fn.had_codec("had4"), fields=("block_size",)),
    Codec("had2", pb.CODEC_HAD2, *fn.had_codec("had2"), fields=("block_size",)),
    Codec("sparseloco", pb.CODEC_SPARSELOCO, fn.sparseloco_encode, fn.sparseloco_size,
          fn.sparseloco_decode, fields=("k",)),
    *(Codec(name, code, *fn.lowrank_codec(name), fields=("k", "basis", "basis_version"),
            stateful=True)
      for name, code in (("lowrank", pb.CODEC_LOWRANK), ("lowrank8", pb.CODEC_LOWRANK8))),
)}
_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}

_missing = sorted((set(CODEC_PARAMS) | set(MODELS)) ^ set(CODECS))
_missing += [pb.Codec.Name(v) for v in pb.Codec.values() if v and v not in _BY_CODE]
_missing += [pb.DType.Name(v) for v in pb.DType.values() if v and v not in TORCH_DTYPES]
if _missing:
    raise ImportError(f"fedpipe.wire.codecs has no implementation for {_missing}")


# ---------------------------------------------------------------------------
# encode


def encode(t: torch.Tensor, codec: str | CodecSpec = "raw", *,
           feedback: ErrorFeedback | None = None, key: Hashable = None,
           seed: int | None = None, end: lowrank.End | None = None) -> pb.Tensor:
    """Encode a tensor (any shape, a dtype in :data:`DTYPES`, any device) as a message.

    Args:
        t: the tensor; 0-dim and 0-element tensors are fine.
        codec: a spec string (see :func:`parse_codec`) or a :class:`CodecSpec`.
            Lossy codecs on a non-floating tensor fall back to raw.
        feedback: error feedback memory; with a lossy codec on a floating
            tensor, the residual under ``key`` is added before encoding and the
            new residual stored (see :class:`ErrorFeedback`).
        key: the feedback slot; required with ``feedback``.
        seed: stochastic rounding for the codecs that round (had4, had2): the
            noise comes from a generator seeded with it, so the same tensor and
            seed give the same bytes (derive it from the step and microbatch to
            keep a replay exact). None rounds to nearest.
        end: lowrank and lowrank8: the sender's end of the link (its
            :class:`.lowrank.Subspace`, the link's key and the step that times the
            basis' refreshes); ignored by the other codecs.

    Returns:
        A message with the whole payload: ``payload_bytes == len(payload)``,
        ``encoded_bytes`` = length in bytes of the codec output before zstd.

    Raises:
        WireError: unsupported dtype, or a bad codec spec (had4/had2 with a
            block size that is not a power of two, a lowrank rank over the tensor's
            last dimension), or a lowrank gradient on a link without a basis.
        ValueError: ``feedback`` without a key, or a key reused for another shape;
            a lowrank codec without ``end``.
    """
    if t.dtype not in DTYPES:
        raise WireError(f"dtype {t.dtype} cannot be sent; supported: {sorted(map(str, DTYPES))}")
    spec = codec if isinstance(codec, CodecSpec) else parse_codec(codec)
    impl = CODECS[spec.name]
    if impl.lossy and not t.dtype.is_floating_point:
        impl = CODECS["raw"]
    flat = t.detach().contiguous().view(-1)
    if not impl.lossy:
        feedback = None  # a lossless codec leaves no residual to feed back
    if feedback is not None:
        if key is None:
            raise ValueError("encode with feedback needs a key (one per link and tensor slot)")
        acc = feedback._compensate(key, t.detach())
        flat = acc.to(t.dtype)
    end = end if impl.stateful else None
    parts, fields = impl.encode(flat, spec, fn.Context(seed, t.shape[-1] if t.dim() else 1, end))
    out = _join(parts)
    msg = pb.Tensor(dtype=DTYPES[t.dtype], shape=t.shape, codec=impl.code,
                    encoded_bytes=len(out), **fields)
    if feedback is not None:
        sent = impl.decode(bytearray(out), fn.Header(msg, t.dtype, t.numel(), end))
        feedback.remember(key, acc.sub_(sent.to(acc)).view(t.shape))
    if spec.zstd_level is not None:
        out = zstandard.ZstdCompressor(level=spec.zstd_level).compress(out)
        msg.zstd = True
    msg.payload = out
    msg.payload_bytes = len(out)
    return msg


def encode_payload(t: torch.Tensor, codec: str | CodecSpec = "raw", *,
                   feedback: ErrorFeedback | None = None, key: Hashable = None,
                   seed: int | None = None, end: lowrank.End | None = None
                   ) -> tuple[pb.Tensor, memoryview]:
    """:func:`encode`, with the payload kept apart from the message.

    Returns:
        ``(header, payload)``: the message with ``payload`` empty (and
        ``payload_bytes`` set), and the payload. For the raw codec without zstd
        on a CPU tensor the payload is a view of the tensor's own memory, no
        copy: the tensor must not be modified while the payload is in use.
    """
    spec = codec if isinstance(codec, CodecSpec) else parse_codec(codec)
    if spec.name == "raw" and spec.zstd_level is None:
        raw = raw_payload(t)
        if raw is not None:
            return pb.Tensor.FromString(raw[0]), raw[1]
    msg = encode(t, spec, feedback=feedback, key=key, seed=seed, end=end)
    payload = msg.payload
    msg.ClearField("payload")
    return msg, memoryview(payload)


def raw_payload(t: torch.Tensor) -> tuple[bytes, memoryview] | None:
    """:func:`encode_payload` of ``t`` with codec ``raw``, its header serialized, where the
    payload is the tensor's own memory (a CPU tensor of a dtype in :data:`DTYPES`, with
    elements); else None. The bytes are what ``encode_payload(t)[0].SerializeToString()``
    gives (a sender that frames the header saves parsing them and serializing them again).
    """
    if t.dtype in DTYPES and t.is_cpu and t.numel():
        return _raw_header(t.dtype, t.shape), _own_bytes(t)
    return None


@functools.lru_cache(maxsize=256)
def _raw_header(dtype: torch.dtype, shape: torch.Size) -> bytes:
    """The serialized header of a raw tensor of ``dtype`` and ``shape`` (its payload, the
    tensor's own bytes, apart): parsing it costs a fifth of building the message, and a
    stage sends tensors of a few shapes, step after step."""
    size = math.prod(shape) * dtype.itemsize
    header: bytes = pb.Tensor(dtype=DTYPES[dtype], shape=shape, codec=pb.CODEC_RAW,
                              encoded_bytes=size, payload_bytes=size).SerializeToString()
    return header


def _own_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor with elements, as a flat byte view of its own memory (of a
    contiguous copy if it is not contiguous). Through numpy where it has the dtype: numpy's
    views cost half of torch's per call (``benchmarks/dataplane.py``, CPU per message)."""
    flat = t.detach() if t.requires_grad else t  # detach: 0.5 us a call, numpy() needs it
    if not flat.is_contiguous():
        flat = flat.contiguous()
    try:
        return flat.numpy().data.cast("B")  # C-contiguous: its bytes, flat
    except (TypeError, RuntimeError):  # bfloat16 (numpy has none); a conjugate or negative view
        return flat.view(-1).view(torch.uint8).numpy().data


def _join(parts: list[torch.Tensor]) -> bytes:
    """The bytes of 1-D tensors, concatenated: one copy (after any device-to-host copy)."""
    return b"".join(p.cpu().view(torch.uint8).numpy().data for p in parts)


# ---------------------------------------------------------------------------
# decode


def decode(msg: pb.Tensor, *, payload: bytes | bytearray | memoryview | None = None,
           max_bytes: int = MAX_TENSOR_BYTES, in_place: bool = False,
           end: lowrank.End | None = None) -> torch.Tensor:
    """Decode a message into a new, writable CPU tensor of its ``dtype`` and ``shape``.

    Every header field is checked before anything of the declared size is
    allocated; zstd output is bounded by ``encoded_bytes`` (a frame that
    declares or yields another size is rejected). Memory use is at most about
    ``max_bytes`` (bytes of the decoded tensor and of the codec output) plus
    the payload.

    ``payload``, if given, is used instead of ``msg.payload`` (a receiver that
    reassembled the pieces of a chunked tensor passes them here, which saves
    copying them into the message and out again). A ``bytearray`` or a
    writable ``memoryview`` is decoded in place: for raw payloads the returned
    tensor shares its memory. So is any ``payload`` with ``in_place``, read-only
    memory too: the caller hands it over (a gRPC message nothing else reads),
    and the tensor, writable as torch tensors are, may then write into it. A
    raw tensor whose data would not be aligned to its element size in that
    memory is copied out instead.

    ``end``: a lowrank message's link at the receiver (its
    :class:`.lowrank.Subspace` keeps a basis the message carries and gives the
    one it uses); ignored for the other codecs.

    Raises:
        WireError: for any malformed message, naming the field and numbers:
            unknown dtype or codec, bad shape (negative, over ``MAX_DIMS``
            dimensions or ``max_bytes``), a lossy codec on a non-floating
            dtype, codec fields out of range or set for a codec that does not
            use them, ``encoded_bytes`` or ``payload_bytes`` that do not match,
            a bad zstd frame, or bad content (topk indices out of range or
            not strictly increasing); a lowrank message without ``end``, or one
            whose basis this end does not hold (none, another version or shape).
    """
    h, impl, size = _checked(msg, max_bytes)
    h = h._replace(end=end)
    if payload is None:
        payload = msg.payload
    if len(payload) != msg.payload_bytes:
        raise WireError(f"payload is {len(payload)} bytes but payload_bytes says "
                        f"{msg.payload_bytes}")
    buf: bytearray | memoryview
    if msg.zstd:
        buf = _unzstd(payload, size)
    elif in_place or _writable(payload):
        buf = memoryview(payload)
    else:
        buf = bytearray(payload)
    if len(buf) != size:
        raise WireError(f"payload is {len(buf)} bytes but encoded_bytes is {size}")
    try:
        flat = impl.decode(buf, h)
    except (RuntimeError, IndexError, OverflowError, MemoryError) as e:  # defence in depth
        raise WireError(f"cannot decode {impl.name} payload: {e}") from e
    if flat.numel() and flat.data_ptr() % flat.element_size():
        flat = flat.clone()  # borrowed memory, misaligned for the dtype
    return flat.view(tuple(msg.shape))


def _writable(payload: bytes | bytearray | memoryview) -> bool:
    """Whether ``payload`` may be decoded in place (a bytearray or a writable memoryview)."""
    return type(payload) is bytearray or (type(payload) is memoryview and not payload.readonly)


def check_header(msg: pb.Tensor, max_bytes: int = MAX_TENSOR_BYTES) -> int:
    """Check every header field of ``msg`` as :func:`decode` does, without its payload.

    A receiver calls it on a tensor's header before it buffers any of the
    payload, so a bad or oversized tensor is refused before anything of its
    declared size is allocated or read.

    Returns:
        The codec output's length in bytes (``encoded_bytes``).

    Raises:
        WireError: as :func:`decode` for every field but the payload itself;
            also a ``payload_bytes`` over ``max_bytes``, or one that differs
            from ``encoded_bytes`` without zstd.
    """
    _, _, size = _checked(msg, max_bytes)
    if msg.payload_bytes > max_bytes:
        raise WireError(f"tensor payload of {msg.payload_bytes} bytes exceeds the limit of "
                        f"{max_bytes}")
    if not msg.zstd and msg.payload_bytes != size:
        raise WireError(f"payload_bytes is {msg.payload_bytes} but the payload without zstd "
                        f"is encoded_bytes = {size}")
    return size


def _checked(msg: pb.Tensor, max_bytes: int) -> tuple[fn.Header, Codec, int]:
    """The header, codec and encoded size of ``msg``, every field checked (see :func:`decode`)."""
    h, impl = _header(msg)
    size = impl.size(h)
    if max(size, h.numel * h.dtype.itemsize) > max_bytes:
        raise WireError(f"tensor of shape {list(msg.shape)} ({h.numel * h.dtype.itemsize} "
                        f"bytes, {size} encoded) exceeds the limit of {max_bytes} bytes")
    if msg.encoded_bytes != size:
        raise WireError(f"encoded_bytes is {msg.encoded_bytes} but codec "
                        f"{impl.name} and shape {list(msg.shape)} need {size}")
    return h, impl, size


def _header(msg: pb.Tensor) -> tuple[fn.Header, Codec]:
    """Validate dtype, shape, codec and unused fields; return the header and codec."""
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unknown tensor dtype code {msg.dtype}")
    impl = _BY_CODE.get(msg.codec)
    if impl is None:
        raise WireError(f"unknown codec code {msg.codec}")
    if impl.lossy and not dtype.is_floating_point:
        raise WireError(f"codec {impl.name} needs a floating dtype, message has {dtype}")
    for name in impl.unused:
        if getattr(msg, name):
            raise WireError(f"field {name}={getattr(msg, name)} is set but codec "
                            f"{impl.name} does not use it")
    shape = msg.shape[:]  # read once, as a list (a tuple() of the field costs twice as much)
    if len(shape) > MAX_DIMS:
        raise WireError(f"tensor shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    if shape and min(shape) < 0:
        raise WireError(f"tensor shape {list(shape)} has a negative dimension")
    if shape and max(shape) > 2**40:  # a 0 elsewhere would hide it from the product
        raise WireError(f"tensor shape {list(shape)} has a dimension over 2**40")
    return fn.Header(msg, dtype, math.prod(shape)), impl


def _unzstd(payload: bytes | bytearray | memoryview, size: int) -> bytearray:
    """Decompress one zstd frame that must yield exactly ``size`` bytes, allocating at most that."""
    # zstandard's decompress() allocates the content size a frame header
    # declares, whatever max_output_size says: so check that size first.
    try:
        declared = zstandard.frame_content_size(payload)
        if declared not in (-1, size):
            raise WireError(f"zstd frame declares {declared} bytes but encoded_bytes is {size}")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size,
                                                      allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise WireError(f"bad zstd payload ({len(payload)} bytes, encoded_bytes {size}): "
                        f"{e}") from None
    return bytearray(out)
