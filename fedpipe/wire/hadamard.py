"""A randomized Hadamard rotation and low-bit blockwise quantisation: the ``had4``/``had2`` maths.

Per block of B values (B a power of two, the tensor zero-padded to whole
blocks):

1. rotate: ``y = H·(s ⊙ x) / √B``, with ``H`` the B×B Walsh-Hadamard matrix
   (as a dense or Kronecker-factored matmul, see :func:`fwht`) and ``s`` a
   fixed pattern of ±1 signs drawn from :data:`SIGN_SEED` (the same at both
   ends: nothing about it travels). The rotation is orthonormal, so errors
   keep their norm through it, and it spreads an outlier over the whole block,
   which leaves the block's values close to Gaussian;
2. quantise ``y`` to ``b`` bits (L = 2**b levels) with a midrise uniform
   quantiser: ``q = round(y / step + (L - 1)/2)`` clamped to [0, L - 1],
   decoded as ``(q - (L - 1)/2)·step``. Per block, ``step = min(absmax /
   ((L - 1)/2), κ_b·rms)``: the absmax step never clips; ``κ_b·rms`` is the
   mean-square-optimal uniform step for Gaussian values (Max 1960:
   κ_4 = 0.3352, κ_2 = 0.9957), which clips the few largest values and
   halves 2-bit's error against absmax scaling;
3. decode: the inverse rotation ``s ⊙ H·y / √B`` (H/√B is its own inverse).

Rounding is to nearest (deterministic), or stochastic (``floor(t + u)``,
u ~ U[0, 1)) when a seed is given, from a generator seeded with it, and then
with the absmax step, which clips nothing, so the decoded block is unbiased:
the same tensor and seed give the same codes, so a replayed step sends the same
bytes. Seed it from (step, microbatch, boundary), or leave it unseeded and use
error feedback (:class:`fedpipe.wire.codecs.ErrorFeedback`) for gradients.

Codes are packed little-end first: 8/b codes per byte, code i of a byte in bits
``[b·i, b·(i + 1))``.

Source: Ailon & Chazelle, "The Fast Johnson-Lindenstrauss Transform" (2009)
for the randomized Hadamard rotation; QuaRot (Ashkboos et al., 2024) and
TAH-Quant (2025) for rotation before low-bit activation quantisation; Max,
"Quantizing for Minimum Distortion" (1960) for the step sizes.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["KAPPA", "SIGN_SEED", "dequantize", "fwht", "pack", "quantize", "rotate",
           "signs", "unpack", "unrotate"]

SIGN_SEED = 0x5EED_4AD
"""Seed of the rotation's sign pattern (plus the block size): part of the wire format."""
KAPPA = {2: 0.9957, 4: 0.3352}
"""Optimal uniform quantiser step for unit Gaussian values, per bit width (Max 1960)."""


_DENSE = 256
"""Largest block rotated by one dense matmul; larger blocks use H_B = H_{B/256} ⊗ H_256."""


@functools.lru_cache(maxsize=32)
def _cpu_signs(block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED + block)
    return torch.randint(0, 2, (block,), generator=g, dtype=torch.int64).mul_(2).sub_(1).float()


@functools.lru_cache(maxsize=32)
def _cpu_matrix(block: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix H_B/√B, by Sylvester's doubling (exact ±1 entries)."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h.mul_(block ** -0.5)


def signs(block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's ±1 signs for blocks of ``block`` values: float32, shape (block,)."""
    return _cpu_signs(block).to(device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of ``x``: (n, B) -> (n, B).

    B must be a power of two, at most 65536. Its own inverse: ``fwht(fwht(x)) == x``
    up to float32 rounding. A dense matmul (2B flops per value) up to
    :data:`_DENSE`, which on a CPU beats the B·log2 B butterfly's log2 B passes
    over memory; above, the Kronecker factorisation ``H_a ⊗ H_256``.
    """
    n, b = x.shape
    if b <= _DENSE:
        out: torch.Tensor = x @ _cpu_matrix(b).to(x.device)
        return out
    a = b // _DENSE
    y = x.reshape(n, a, _DENSE) @ _cpu_matrix(_DENSE).to(x.device)
    return (_cpu_matrix(a).to(x.device) @ y).reshape(n, b)


def rotate(blocks: torch.Tensor) -> torch.Tensor:
    """``H·(s ⊙ x)/√B`` of each row: (n, B) float32 -> (n, B) float32."""
    return fwht(blocks * signs(blocks.shape[1], blocks.device))


def unrotate(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``s ⊙ H·y/√B`` of each row."""
    return fwht(blocks) * signs(blocks.shape[1], blocks.device)


def quantize(y: torch.Tensor, bits: int, seed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and steps of rotated blocks ``y`` (n, B) float32.

    Returns:
        ``(steps, codes)``: float32 (n,) and uint8 (n, B) in [0, 2**bits - 1].
        A block with a non-finite value gets a non-finite step (it decodes as
        NaN) and zero codes.
    """
    half = ((1 << bits) - 1) / 2
    absmax = y.abs().amax(dim=1)
    rms = y.square().mean(dim=1).sqrt()
    # stochastic rounding is unbiased only where nothing is clipped: absmax steps then
    steps = absmax / half if seed is not None else torch.minimum(absmax / half, KAPPA[bits] * rms)
    steps = torch.where(torch.isfinite(absmax), steps, absmax)  # NaN stays NaN, inf stays inf
    inverse = torch.where((steps > 0) & torch.isfinite(steps), 1 / steps, 0)
    t = y * inverse[:, None] + half
    if seed is None:
        t.round_()
    else:
        g = torch.Generator().manual_seed(seed)
        t.add_(torch.rand(t.shape, generator=g).to(t.device)).floor_()
    codes = t.clamp_(0, 2 * half).nan_to_num_(0).to(torch.uint8)
    return steps, codes


def dequantize(steps: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of ``codes`` (n, B) uint8 at ``steps`` (n,) float32: (n, B) float32."""
    half = ((1 << bits) - 1) / 2
    return (codes.float() - half) * steps[:, None]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (any shape, uint8 < 2**bits, numel a multiple of 8/bits) packed: flat uint8."""
    per = 8 // bits
    c = codes.reshape(-1, per)
    out = c[:, 0].clone()
    for i in range(1, per):
        out |= c[:, i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`pack` packed into ``packed`` (flat uint8): flat uint8, 8/bits per byte."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
