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

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple

import torch
import torch.nn.functional as F
import zstandard

from ..proto import tensor_pb2 as pb
from ..spec import CODEC_PARAMS, CodecSpec, parse_codec
from .codecmodel import (HADAMARD_BITS, MODELS, SPARSELOCO_CHUNK, Layout,
                         hadamard_block_problem, index_bytes, int8_blocks)
from .feedback import ErrorFeedback as ErrorFeedback  # re-exported: codecs.ErrorFeedback
from .format import WireError
from . import hadamard, lowrank, sparseloco

__all__ = ["CODECS", "DTYPES", "MAX_TENSOR_BYTES", "Codec", "ErrorFeedback", "WireError",
           "check_header", "decode", "encode", "encode_payload"]


# torch.frombuffer warns, once per process, that a tensor over read-only memory can
# write to it: decode(in_place=True) means exactly that (see its docstring), so the
# one warning is taken here, where it would otherwise name a received frame
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

DTYPES: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16, torch.float64: pb.DTYPE_FLOAT64,
    torch.int64: pb.DTYPE_INT64, torch.int32: pb.DTYPE_INT32, torch.int16: pb.DTYPE_INT16,
    torch.int8: pb.DTYPE_INT8, torch.uint8: pb.DTYPE_UINT8, torch.bool: pb.DTYPE_BOOL,
}
TORCH_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPES.items()}

MAX_DIMS = 64
MAX_TENSOR_BYTES = 1 << 34
"""Default bound (16 GiB) on a decoded tensor and on its codec output; see :func:`decode`."""


# ---------------------------------------------------------------------------
# The codecs: pure functions over 1-D tensors and byte buffers


class _Header(NamedTuple):
    """A message's validated header: what a codec's size and decode functions see
    (``end``: a stateful codec's end of the link, None for the others)."""
    msg: pb.Tensor
    dtype: torch.dtype
    numel: int
    end: lowrank.End | None = None


class Context(NamedTuple):
    """What a codec's encode function may need besides the values.

    Attributes:
        seed: seeds stochastic rounding (None: round to nearest); codecs that do not
            round ignore it.
        width: the tensor's last dimension (1 for a 0-dim tensor): lowrank's row width.
        end: a stateful codec's end of the link (None: the codec is stateless).
    """
    seed: int | None = None
    width: int = 1
    end: lowrank.End | None = None


def _view(buf: bytearray | memoryview, dtype: torch.dtype, count: int,
          offset: int = 0) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``buf``, without a copy."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks and viewed as (⌈n/block⌉, block)."""
    return F.pad(flat, (0, -flat.numel() % block)).view(-1, block)


Buffer = bytearray | memoryview
Encoded = tuple[list[torch.Tensor], dict[str, Any]]
"""What a codec's encode function returns: the output's parts and the header fields to set."""
EncodeFn = Callable[[torch.Tensor, CodecSpec, Context], Encoded]
"""A codec's encode function: ``(flat, spec, context)`` (see :class:`Context`)."""


# raw ----------------------------------------------------------------------

def _raw_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    return [flat], {}


def _raw_size(h: _Header) -> int:
    return MODELS["raw"].encoded_bytes(Layout(h.numel, h.dtype.itemsize))


def _raw_decode(buf: Buffer, h: _Header) -> torch.Tensor:
    return _view(buf, h.dtype, h.numel)


# fp16, bf16: a cast to a 2-byte float, saturated ---------------------------

def _cast_codec(name: str, wire: torch.dtype) -> tuple[
        EncodeFn, Callable[[_Header], int],
        Callable[[Buffer, _Header], torch.Tensor]]:
    """Encode, size and decode functions of codec ``name``, which casts to ``wire``."""
    fmax = torch.finfo(wire).max
    layout = MODELS[name].encoded_bytes

    def encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
        # Out-of-range values become ±inf in the cast; clamping the result
        # saturates them to ±fmax (NaN stays NaN). Same as clamping first, and
        # exact even for sources (bf16) that cannot represent fmax.
        return [flat.to(wire, copy=True).clamp_(-fmax, fmax)], {}

    def size(h: _Header) -> int:
        return layout(Layout(h.numel, wire.itemsize))

    def decode(buf: Buffer, h: _Header) -> torch.Tensor:
        return _view(buf, wire, h.numel).to(h.dtype)

    return encode, size, decode


# int8: blockwise absmax quantisation --------------------------------------

def _int8_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    """Blockwise absmax: per block of B values, scale = max|x|/127, q = round(x/scale).

    Source: Dettmers et al., "8-bit Optimizers via Block-wise Quantization"
    (ICLR 2022) and "LLM.int8()" (NeurIPS 2022). Non-finite values make their
    block decode to NaN.
    """
    blocks = _blocks(flat.float(), spec.block_size)
    scales = blocks.abs().amax(dim=1) / 127
    inverse = torch.where(scales > 0, 1 / scales, 0)
    q = (blocks * inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return [scales, q.view(-1)[:flat.numel()]], {"block_size": spec.block_size}


def _int8_blocks(h: _Header) -> int:
    if not 16 <= h.msg.block_size <= 65536:
        raise WireError(f"int8 block_size must be in [16, 65536], got {h.msg.block_size}")
    return int8_blocks(h.numel, h.msg.block_size)


def _int8_size(h: _Header) -> int:
    _int8_blocks(h)
    return MODELS["int8"].encoded_bytes(Layout(h.numel, block_size=h.msg.block_size))


def _int8_decode(buf: Buffer, h: _Header) -> torch.Tensor:
    nblocks = _int8_blocks(h)
    scales = _view(buf, torch.float32, nblocks)
    q = _view(buf, torch.int8, h.numel, offset=4 * nblocks)
    values = _blocks(q.float(), h.msg.block_size) * scales[:, None]
    return values.view(-1)[:h.numel].to(h.dtype)


# topk: sparsification ------------------------------------------------------

_INDEX_DTYPES = {4: torch.int32, 8: torch.int64}


def _index_dtype(numel: int) -> torch.dtype:
    return _INDEX_DTYPES[index_bytes(numel)]


def _topk_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    """Keep the k largest-magnitude entries (flat indices ascending, exact values).

    Source: Stich et al., "Sparsified SGD with Memory" (2018); Lin et al.,
    "Deep Gradient Compression" (2018). Pair it with :class:`ErrorFeedback`.
    """
    k = spec.k(flat.numel())
    index = flat.abs().topk(k, sorted=False).indices.sort().values
    return ([index.to(_index_dtype(flat.numel())), flat[index]],
            {"k": k, "value_dtype": DTYPES[flat.dtype]})


def _topk_value_dtype(h: _Header) -> torch.dtype:
    dtype = TORCH_DTYPES.get(h.msg.value_dtype)
    if dtype is None or not dtype.is_floating_point:
        raise WireError(f"topk value_dtype code {h.msg.value_dtype} is not a floating dtype")
    return dtype


def _topk_size(h: _Header) -> int:
    if h.msg.k > h.numel:
        raise WireError(f"topk k={h.msg.k} exceeds the tensor's {h.numel} elements")
    return MODELS["topk"].encoded_bytes(Layout(h.numel, _topk_value_dtype(h).itemsize,
                                               k=h.msg.k))


def _topk_decode(buf: Buffer, h: _Header) -> torch.Tensor:
    k, index_dtype = h.msg.k, _index_dtype(h.numel)
    index = _view(buf, index_dtype, k).long()
    if k and not (0 <= index[0] and index[-1] < h.numel):
        raise WireError(f"topk indices run from {int(index[0])} to {int(index[-1])}, outside "
                        f"[0, {h.numel})")
    disorder = (index[1:] <= index[:-1]).nonzero()
    if len(disorder):
        i = int(disorder[0])
        raise WireError(f"topk indices must strictly increase: index[{i}]={int(index[i])}, "
                        f"index[{i + 1}]={int(index[i + 1])}")
    values = _view(buf, _topk_value_dtype(h), k, offset=k * index_dtype.itemsize)
    out = torch.zeros(h.numel, dtype=h.dtype)
    out[index] = values.to(h.dtype)
    return out


# had4, had2: randomized Hadamard rotation, then 4 or 2 bits per value ------

def _had_block(name: str, block: int) -> int:
    """``block``, checked: a power of two in [16, 65536] (WireError otherwise)."""
    problem = hadamard_block_problem(name, block)
    if problem:
        raise WireError(problem)
    return block


def _had_codec(name: str) -> tuple[EncodeFn, Callable[[_Header], int],
                                   Callable[[Buffer, _Header], torch.Tensor]]:
    """Encode, size and decode functions of codec ``name`` (see :mod:`.hadamard`)."""
    bits, layout = HADAMARD_BITS[name], MODELS[name].encoded_bytes

    def encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
        block = _had_block(name, spec.block_size)
        steps, codes = hadamard.quantize(hadamard.rotate(_blocks(flat.float(), block)), bits,
                                         ctx.seed)
        return [steps, hadamard.pack(codes, bits)], {"block_size": block}

    def size(h: _Header) -> int:
        block = _had_block(name, h.msg.block_size)
        return layout(Layout(h.numel, block_size=block))

    def decode(buf: Buffer, h: _Header) -> torch.Tensor:
        block = h.msg.block_size
        nblocks = int8_blocks(h.numel, block)
        steps = _view(buf, torch.float32, nblocks)
        packed = _view(buf, torch.uint8, nblocks * block * bits // 8, offset=4 * nblocks)
        codes = hadamard.unpack(packed, bits).view(nblocks, block)
        values = hadamard.unrotate(hadamard.dequantize(steps, codes, bits))
        return values.view(-1)[:h.numel].to(h.dtype)

    return encode, size, decode


# sparseloco: top-k per chunk, 12-bit indices, 2-bit values (see :mod:`.sparseloco`) --

def _sparseloco_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    """:func:`.sparseloco.compress` with k = ⌈F·C⌉ (the seed is ignored: the rounding is
    deterministic; pair it with :class:`ErrorFeedback`)."""
    k = spec.k(SPARSELOCO_CHUNK)
    return list(sparseloco.compress(flat, k)), {"k": k}


def _sparseloco_size(h: _Header) -> int:
    if not 1 <= h.msg.k <= SPARSELOCO_CHUNK:
        raise WireError(f"sparseloco k must be in [1, {SPARSELOCO_CHUNK}] (values kept per "
                        f"chunk), got {h.msg.k}")
    return MODELS["sparseloco"].encoded_bytes(Layout(h.numel, k=h.msg.k))


def _sparseloco_decode(buf: Buffer, h: _Header) -> torch.Tensor:
    k, m = h.msg.k, sparseloco.chunks(h.numel)
    index_bytes_ = m * sparseloco.index_bytes(k)
    scales = _view(buf, torch.float32, m)
    index = _view(buf, torch.uint8, index_bytes_, offset=4 * m)
    codes = _view(buf, torch.uint8, m * -(-k // 4), offset=4 * m + index_bytes_)
    return sparseloco.decompress(scales, index, codes, k, h.numel).to(h.dtype)


# lowrank, lowrank8: coefficients in a basis both ends hold (see :mod:`.lowrank`) --

def _lowrank_width(rank: int, shape: Any) -> int:
    """The row width d of a lowrank tensor of ``shape``, checked against ``rank``."""
    width = shape[-1] if len(shape) else 1
    if not 1 <= rank <= min(width, 4096):
        raise WireError(f"lowrank rank must be in [1, min(4096, the last dimension)], got "
                        f"{rank} for shape {list(shape)}")
    return width


def _lowrank_codec(name: str) -> tuple[EncodeFn, Callable[[_Header], int],
                                       Callable[[Buffer, _Header], torch.Tensor]]:
    """Encode, size and decode functions of lowrank codec ``name``: float32 coefficients
    (lowrank) or per-row absmax int8 ones (lowrank8, as :func:`_int8_encode` per row)."""
    layout, quantised = MODELS[name].encoded_bytes, name == "lowrank8"

    def encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
        if ctx.end is None:
            raise ValueError(f"codec {name} keeps a basis per link: encode(..., end=) needs "
                             "the link's lowrank.End")
        rows = flat.view(-1, _lowrank_width(spec.rank, [ctx.width]))
        basis, carry = ctx.end.subspace.outgoing(ctx.end, rows, spec)
        coeffs = lowrank.coefficients(rows, basis.matrix)
        parts = [basis.matrix.view(-1)] if carry else []
        if quantised:
            scales = coeffs.abs().amax(dim=1) / 127
            inverse = torch.where(scales > 0, 1 / scales, 0)
            parts += [scales, (coeffs * inverse[:, None]).round_().clamp_(-127, 127)
                      .to(torch.int8).view(-1)]
        else:
            parts.append(coeffs.view(-1))
        return parts, {"k": spec.rank, "basis": carry, "basis_version": basis.version}

    def size(h: _Header) -> int:
        width = _lowrank_width(h.msg.k, h.msg.shape)
        if h.msg.basis_version < 1:
            raise WireError(f"lowrank basis_version must be at least 1, got "
                            f"{h.msg.basis_version}")
        return layout(Layout(h.numel, k=h.msg.k, width=width, basis=h.msg.basis))

    def decode(buf: Buffer, h: _Header) -> torch.Tensor:
        if h.end is None:
            raise WireError(f"a {name} message needs the receiving stage's basis of its link: "
                            "decode(..., end=lowrank.End(...))")
        rank, width = h.msg.k, _lowrank_width(h.msg.k, h.msg.shape)
        offset = 4 * width * rank if h.msg.basis else 0
        carried = _view(buf, torch.float32, width * rank).view(width, rank) \
            if h.msg.basis else None
        basis = h.end.subspace.incoming(h.end.key, carried, h.msg.basis_version, width, rank)
        rows = h.numel // width
        if quantised:
            scales = _view(buf, torch.float32, rows, offset)
            q = _view(buf, torch.int8, rows * rank, offset + 4 * rows).view(rows, rank)
            coeffs = q.float() * scales[:, None]
        else:
            coeffs = _view(buf, torch.float32, rows * rank, offset).view(rows, rank)
        return lowrank.rebuild(coeffs, basis.matrix).view(-1).to(h.dtype)

    return encode, size, decode


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
    encode: EncodeFn
    size: Callable[[_Header], int]
    decode: Callable[[Buffer, _Header], torch.Tensor]
    fields: tuple[str, ...] = ()
    stateful: bool = False

    @property
    def lossy(self) -> bool:
        """Floating tensors only; other dtypes fall back to raw (its model's ``lossy``)."""
        return MODELS[self.name].lossy


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", pb.CODEC_RAW, _raw_encode, _raw_size, _raw_decode),
    Codec("fp16", pb.CODEC_FP16, *_cast_codec("fp16", torch.float16)),
    Codec("bf16", pb.CODEC_BF16, *_cast_codec("bf16", torch.bfloat16)),
    Codec("int8", pb.CODEC_INT8, _int8_encode, _int8_size, _int8_decode,
          fields=("block_size",)),
    Codec("topk", pb.CODEC_TOPK, _topk_encode, _topk_size, _topk_decode,
          fields=("k", "value_dtype")),
    Codec("had4", pb.CODEC_HAD4, *_had_codec("had4"), fields=("block_size",)),
    Codec("had2", pb.CODEC_HAD2, *_had_codec("had2"), fields=("block_size",)),
    Codec("sparseloco", pb.CODEC_SPARSELOCO, _sparseloco_encode, _sparseloco_size,
          _sparseloco_decode, fields=("k",)),
    *(Codec(name, code, *_lowrank_codec(name), fields=("k", "basis", "basis_version"),
            stateful=True)
      for name, code in (("lowrank", pb.CODEC_LOWRANK), ("lowrank8", pb.CODEC_LOWRANK8))),
)}
_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}
_PARAM_FIELDS = ("block_size", "k", "value_dtype", "basis", "basis_version")

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
    parts, fields = impl.encode(flat, spec, Context(seed, t.shape[-1] if t.dim() else 1, end))
    out = _join(parts)
    msg = pb.Tensor(dtype=DTYPES[t.dtype], shape=t.shape, codec=impl.code,
                    encoded_bytes=len(out), **fields)
    if feedback is not None:
        sent = impl.decode(bytearray(out), _Header(msg, t.dtype, t.numel(), end))
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
    if (spec.name == "raw" and spec.zstd_level is None and t.dtype in DTYPES
            and t.device.type == "cpu" and t.numel()):
        view = t.detach().contiguous().view(-1).view(torch.uint8).numpy().data
        return pb.Tensor(dtype=DTYPES[t.dtype], shape=t.shape, codec=pb.CODEC_RAW,
                         encoded_bytes=len(view), payload_bytes=len(view)), view
    msg = encode(t, spec, feedback=feedback, key=key, seed=seed, end=end)
    payload = msg.payload
    msg.ClearField("payload")
    return msg, memoryview(payload)


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


def _checked(msg: pb.Tensor, max_bytes: int) -> tuple[_Header, Codec, int]:
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


def _header(msg: pb.Tensor) -> tuple[_Header, Codec]:
    """Validate dtype, shape, codec and unused fields; return the header and codec."""
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unknown tensor dtype code {msg.dtype}")
    impl = _BY_CODE.get(msg.codec)
    if impl is None:
        raise WireError(f"unknown codec code {msg.codec}")
    if impl.lossy and not dtype.is_floating_point:
        raise WireError(f"codec {impl.name} needs a floating dtype, message has {dtype}")
    for field in _PARAM_FIELDS:
        if field not in impl.fields and getattr(msg, field):
            raise WireError(f"field {field}={getattr(msg, field)} is set but codec "
                            f"{impl.name} does not use it")
    if len(msg.shape) > MAX_DIMS:
        raise WireError(f"tensor shape has {len(msg.shape)} dimensions, more than {MAX_DIMS}")
    if any(d < 0 for d in msg.shape):
        raise WireError(f"tensor shape {list(msg.shape)} has a negative dimension")
    if any(d > 2**40 for d in msg.shape):  # a 0 elsewhere would hide it from the product
        raise WireError(f"tensor shape {list(msg.shape)} has a dimension over 2**40")
    return _Header(msg, dtype, math.prod(msg.shape)), impl


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
