"""The codecs' functions: pure encode, size and decode functions over 1-D tensors and
byte buffers, one set per codec, which :data:`fedpipe.wire.codecs.CODECS` registers by
name (its docstring has the wire layout of each).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..proto import tensor_pb2 as pb
from ..spec import CodecSpec
from .codecmodel import (HADAMARD_BITS, MODELS, SPARSELOCO_CHUNK, Layout,
                         hadamard_block_problem, index_bytes, int8_blocks)
from .format import WireError
from . import hadamard, lowrank, sparseloco

DTYPES: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16, torch.float64: pb.DTYPE_FLOAT64,
    torch.int64: pb.DTYPE_INT64, torch.int32: pb.DTYPE_INT32, torch.int16: pb.DTYPE_INT16,
    torch.int8: pb.DTYPE_INT8, torch.uint8: pb.DTYPE_UINT8, torch.bool: pb.DTYPE_BOOL,
}
TORCH_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPES.items()}




class Header(NamedTuple):
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

def raw_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    return [flat], {}


def raw_size(h: Header) -> int:
    return MODELS["raw"].encoded_bytes(Layout(h.numel, h.dtype.itemsize))


def raw_decode(buf: Buffer, h: Header) -> torch.Tensor:
    return _view(buf, h.dtype, h.numel)


# fp16, bf16: a cast to a 2-byte float, saturated ---------------------------

def cast_codec(name: str, wire: torch.dtype) -> tuple[
        EncodeFn, Callable[[Header], int],
        Callable[[Buffer, Header], torch.Tensor]]:
    """Encode, size and decode functions of codec ``name``, which casts to ``wire``."""
    fmax = torch.finfo(wire).max
    layout = MODELS[name].encoded_bytes

    def encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
        # Out-of-range values become ±inf in the cast; clamping the result
        # saturates them to ±fmax (NaN stays NaN). Same as clamping first, and
        # exact even for sources (bf16) that cannot represent fmax.
        return [flat.to(wire, copy=True).clamp_(-fmax, fmax)], {}

    def size(h: Header) -> int:
        return layout(Layout(h.numel, wire.itemsize))

    def decode(buf: Buffer, h: Header) -> torch.Tensor:
        return _view(buf, wire, h.numel).to(h.dtype)

    return encode, size, decode


# int8: blockwise absmax quantisation --------------------------------------

def int8_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
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


def _int8_blocks(h: Header) -> int:
    if not 16 <= h.msg.block_size <= 65536:
        raise WireError(f"int8 block_size must be in [16, 65536], got {h.msg.block_size}")
    return int8_blocks(h.numel, h.msg.block_size)


def int8_size(h: Header) -> int:
    _int8_blocks(h)
    return MODELS["int8"].encoded_bytes(Layout(h.numel, block_size=h.msg.block_size))


def int8_decode(buf: Buffer, h: Header) -> torch.Tensor:
    nblocks = _int8_blocks(h)
    scales = _view(buf, torch.float32, nblocks)
    q = _view(buf, torch.int8, h.numel, offset=4 * nblocks)
    values = _blocks(q.float(), h.msg.block_size) * scales[:, None]
    return values.view(-1)[:h.numel].to(h.dtype)


# topk: sparsification ------------------------------------------------------

_INDEX_DTYPES = {4: torch.int32, 8: torch.int64}


def _index_dtype(numel: int) -> torch.dtype:
    return _INDEX_DTYPES[index_bytes(numel)]


def topk_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    """Keep the k largest-magnitude entries (flat indices ascending, exact values).

    Source: Stich et al., "Sparsified SGD with Memory" (2018); Lin et al.,
    "Deep Gradient Compression" (2018). Pair it with :class:`ErrorFeedback`.
    """
    k = spec.k(flat.numel())
    index = flat.abs().topk(k, sorted=False).indices.sort().values
    return ([index.to(_index_dtype(flat.numel())), flat[index]],
            {"k": k, "value_dtype": DTYPES[flat.dtype]})


def _topk_value_dtype(h: Header) -> torch.dtype:
    dtype = TORCH_DTYPES.get(h.msg.value_dtype)
    if dtype is None or not dtype.is_floating_point:
        raise WireError(f"topk value_dtype code {h.msg.value_dtype} is not a floating dtype")
    return dtype


def topk_size(h: Header) -> int:
    if h.msg.k > h.numel:
        raise WireError(f"topk k={h.msg.k} exceeds the tensor's {h.numel} elements")
    return MODELS["topk"].encoded_bytes(Layout(h.numel, _topk_value_dtype(h).itemsize,
                                               k=h.msg.k))


def topk_decode(buf: Buffer, h: Header) -> torch.Tensor:
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


def had_codec(name: str) -> tuple[EncodeFn, Callable[[Header], int],
                                   Callable[[Buffer, Header], torch.Tensor]]:
    """Encode, size and decode functions of codec ``name`` (see :mod:`.hadamard`)."""
    bits, layout = HADAMARD_BITS[name], MODELS[name].encoded_bytes

    def encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
        block = _had_block(name, spec.block_size)
        steps, codes = hadamard.quantize(hadamard.rotate(_blocks(flat.float(), block)), bits,
                                         ctx.seed)
        return [steps, hadamard.pack(codes, bits)], {"block_size": block}

    def size(h: Header) -> int:
        block = _had_block(name, h.msg.block_size)
        return layout(Layout(h.numel, block_size=block))

    def decode(buf: Buffer, h: Header) -> torch.Tensor:
        block = h.msg.block_size
        nblocks = int8_blocks(h.numel, block)
        steps = _view(buf, torch.float32, nblocks)
        packed = _view(buf, torch.uint8, nblocks * block * bits // 8, offset=4 * nblocks)
        codes = hadamard.unpack(packed, bits).view(nblocks, block)
        values = hadamard.unrotate(hadamard.dequantize(steps, codes, bits))
        return values.view(-1)[:h.numel].to(h.dtype)

    return encode, size, decode


# sparseloco: top-k per chunk, 12-bit indices, 2-bit values (see :mod:`.sparseloco`) --

def sparseloco_encode(flat: torch.Tensor, spec: CodecSpec, ctx: Context) -> Encoded:
    """:func:`.sparseloco.compress` with k = ⌈F·C⌉ (the seed is ignored: the rounding is
    deterministic; pair it with :class:`ErrorFeedback`)."""
    k = spec.k(SPARSELOCO_CHUNK)
    return list(sparseloco.compress(flat, k)), {"k": k}


def sparseloco_size(h: Header) -> int:
    if not 1 <= h.msg.k <= SPARSELOCO_CHUNK:
        raise WireError(f"sparseloco k must be in [1, {SPARSELOCO_CHUNK}] (values kept per "
                        f"chunk), got {h.msg.k}")
    return MODELS["sparseloco"].encoded_bytes(Layout(h.numel, k=h.msg.k))


def sparseloco_decode(buf: Buffer, h: Header) -> torch.Tensor:
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


def lowrank_codec(name: str) -> tuple[EncodeFn, Callable[[Header], int],
                                       Callable[[Buffer, Header], torch.Tensor]]:
    """Encode, size and decode functions of lowrank codec ``name``: float32 coefficients
    (lowrank) or per-row absmax int8 ones (lowrank8, as :func:`int8_encode` per row)."""
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

    def size(h: Header) -> int:
        width = _lowrank_width(h.msg.k, h.msg.shape)
        if h.msg.basis_version < 1:
            raise WireError(f"lowrank basis_version must be at least 1, got "
                            f"{h.msg.basis_version}")
        return layout(Layout(h.numel, k=h.msg.k, width=width, basis=h.msg.basis))

    def decode(buf: Buffer, h: Header) -> torch.Tensor:
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
