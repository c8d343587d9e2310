"""Tensor codecs: torch.Tensor <-> fedpipe.v1.Tensor message.

Each codec is a pair of pure functions registered by name. A message names its
own codec and parameters, so a receiver needs no out-of-band knowledge.
Decoders validate every header field against the payload before they allocate.
"""
from __future__ import annotations

import torch

from ..proto import tensor_pb2 as pb


class WireError(ValueError):
    """A tensor message is malformed: the message says which field and why."""


DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16, torch.float64: pb.DTYPE_FLOAT64,
    torch.int64: pb.DTYPE_INT64, torch.int32: pb.DTYPE_INT32, torch.int16: pb.DTYPE_INT16,
    torch.int8: pb.DTYPE_INT8, torch.uint8: pb.DTYPE_UINT8, torch.bool: pb.DTYPE_BOOL,
}
TORCH_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPES.items()}
MAX_ELEMENTS = 2**40


def _shape_numel(msg: pb.Tensor) -> int:
    numel = 1
    for d in msg.shape:
        if d < 0:
            raise WireError(f"tensor shape {list(msg.shape)} has a negative dimension")
        numel *= d
        if numel > MAX_ELEMENTS:
            raise WireError(f"tensor shape {list(msg.shape)} has more than 2**40 elements")
    return numel


def _torch_dtype(code: int) -> torch.dtype:
    try:
        return TORCH_DTYPES[code]
    except KeyError:
        raise WireError(f"unknown tensor dtype code {code}") from None


def encode(t: torch.Tensor, codec: str = "raw") -> pb.Tensor:
    """Encode a tensor (any shape, a dtype in :data:`DTYPES`) as a message.

    Raises:
        WireError: unsupported dtype or unknown codec name.
    """
    if t.dtype not in DTYPES:
        raise WireError(f"dtype {t.dtype} cannot be sent; supported: {sorted(map(str, DTYPES))}")
    if codec != "raw":
        raise WireError(f"unknown codec {codec!r}")
    t = t.detach().to("cpu").contiguous()
    payload = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return pb.Tensor(dtype=DTYPES[t.dtype], shape=list(t.shape), codec=pb.CODEC_RAW,
                     encoded_bytes=len(payload), payload=payload, payload_bytes=len(payload))


def decode(msg: pb.Tensor) -> torch.Tensor:
    """Decode a message into a new CPU tensor.

    Raises:
        WireError: unknown dtype or codec, or a payload whose size does not
            match dtype × shape.
    """
    dtype = _torch_dtype(msg.dtype)
    numel = _shape_numel(msg)
    if msg.codec != pb.CODEC_RAW:
        raise WireError(f"unknown codec code {msg.codec}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.payload) != numel * itemsize:
        raise WireError(f"payload is {len(msg.payload)} bytes but dtype {dtype} and shape "
                        f"{list(msg.shape)} need {numel * itemsize}")
    if numel == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8).view(dtype)
    return flat.reshape(tuple(msg.shape))
