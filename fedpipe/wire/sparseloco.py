"""SparseLoCo's message maths: top-k per chunk, 12-bit indices, 2-bit values.

Per chunk of C = :data:`~fedpipe.wire.codecmodel.SPARSELOCO_CHUNK` (4096) values (the
tensor zero-padded to whole chunks) keep the k largest magnitudes; send their positions
in the chunk as 12-bit indices, increasing, packed two per 3 bytes (``a & 255``,
``a >> 8 | (b & 15) << 4``, ``b >> 4``; k rounded up to even with index 0), and their
values with 2 bits each: per chunk a float32 scale ``s = max |v|`` and codes
``q = round(1.5·(v/s + 1))`` (to nearest, ties to even) in 0..3, decoded as
``s·(2q - 3)/3``, i.e. one of ``±s, ±s/3``; codes packed four per byte, low bits first
(:func:`fedpipe.wire.hadamard.pack`), k rounded up to a multiple of 4 with code 0.
Non-finite values make their whole chunk decode non-finite.

The rounding is deterministic: pair it with error feedback
(:class:`fedpipe.wire.feedback.ErrorFeedback`), which sends what it drops later. The
``sparseloco`` codec of :mod:`fedpipe.wire.codecs` frames these parts.

Source: Sarfi, Thérien, Lidin & Belilovsky, "Communication Efficient LLM
Pre-training with SparseLoCo" (2025): chunked top-k of the error-feedback
accumulator, 2-bit values, indices within 4096-chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import hadamard
from .codecmodel import SPARSELOCO_CHUNK, int8_blocks
from .format import WireError

CHUNK = SPARSELOCO_CHUNK


def chunks(numel: int) -> int:
    """m = ⌈numel / C⌉, the number of chunks of a tensor of ``numel`` values."""
    return int8_blocks(numel, CHUNK)


def index_bytes(k: int) -> int:
    """Bytes of one chunk's packed indices: 3 per pair of the ``k`` kept values."""
    return 3 * -(-k // 2)


def compress(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` (1..C) largest magnitudes of each chunk of ``flat`` (1-D, n values).

    Returns:
        ``(scales, index, codes)``: float32 (m,), uint8 (m·3⌈k/2⌉,) packed indices,
        uint8 (m·⌈k/4⌉,) packed 2-bit codes, m = :func:`chunks` (n).
    """
    x = F.pad(flat.float(), (0, -flat.numel() % CHUNK)).view(-1, CHUNK)
    index = x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    values = x.gather(1, index)
    scales = values.abs().amax(dim=1)
    inverse = torch.where(scales > 0, 1 / scales, 0)
    codes = (values * inverse[:, None]).add_(1).mul_(1.5).round_().clamp_(0, 3).to(torch.uint8)
    pairs = F.pad(index, (0, k % 2)).view(len(x), (k + 1) // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    packed_index = torch.stack((a & 255, (a >> 8) | ((b & 15) << 4), b >> 4), dim=-1)
    packed_codes = hadamard.pack(F.pad(codes, (0, -k % 4)), 2)
    return scales, packed_index.to(torch.uint8).view(-1), packed_codes


def decompress(scales: torch.Tensor, index: torch.Tensor, codes: torch.Tensor, k: int,
               numel: int) -> torch.Tensor:
    """The float32 (numel,) tensor that :func:`compress`'s parts describe (zeros where
    nothing was kept).

    Raises:
        WireError: a chunk's indices do not strictly increase.
    """
    m = len(scales)
    packed = index.view(m, (k + 1) // 2, 3).long()
    a = packed[..., 0] | ((packed[..., 1] & 15) << 8)
    b = (packed[..., 1] >> 4) | (packed[..., 2] << 4)
    where = torch.stack((a, b), dim=-1).view(m, -(-k // 2) * 2)[:, :k]  # (m, k)
    disorder = (where[:, 1:] <= where[:, :-1]).nonzero()
    if len(disorder):
        c, i = (int(v) for v in disorder[0])
        raise WireError(f"sparseloco indices must strictly increase within a chunk: chunk {c} "
                        f"has index[{i}]={int(where[c, i])}, index[{i + 1}]="
                        f"{int(where[c, i + 1])}")
    q = hadamard.unpack(codes, 2).view(m, -(-k // 4) * 4)[:, :k]
    values = (q.float() * 2 - 3).div_(3).mul_(scales[:, None])
    return torch.zeros(m, CHUNK).scatter_(1, where, values).view(-1)[:numel]
