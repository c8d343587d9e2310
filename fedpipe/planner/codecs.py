"""What the planner knows of the wire codecs: names, wire sizes, encode costs.

Pure data: this module does not import ``fedpipe.wire``. Specs follow the
wire's grammar ``NAME[:PARAM][+zstd[:LEVEL]]`` (e.g. "int8", "int8+zstd",
"topk:0.01"). Sizes are fractions of the float32 tensor; costs are encode +
decode seconds per byte of the uncompressed tensor:

======================  ===========  ==================
codec                   wire / fp32  encode+decode
======================  ===========  ==================
raw                     1.0          free
fp16, bf16              0.5          ~1 GB/s
int8                    ~0.27        ~1 GB/s
int8+zstd               ~0.15        ~0.3 GB/s (ReLU activations)
topk:F (gradients)      2·F          ~1 GB/s
======================  ===========  ==================

Top-k is never used for activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..spec import SpecError, parse_codec
from .types import PlanError, TrainConfig

# name -> (wire bytes per float32 byte, encode+decode seconds per tensor byte)
_BASE = {"raw": (1.0, 0.0), "fp16": (0.5, 1e-9), "bf16": (0.5, 1e-9), "int8": (0.27, 1e-9)}
# zstd after a codec: wire-size factor on its output, and its extra seconds per tensor byte
_ZSTD_SHRINK = {"int8": 0.15 / 0.27, "topk": 0.9}
_ZSTD_DEFAULT_SHRINK = 0.9
_ZSTD_SECONDS_PER_BYTE = 1 / 0.3e9 - 1e-9

AUTO_ACTIVATION = ("raw", "bf16", "int8", "int8+zstd")
"""Codecs "auto" may give activations, weakest (most faithful) first."""
AUTO_GRADIENT = AUTO_ACTIVATION
"""Codecs "auto" may give gradients, weakest first. Top-k is not among them:
on activation gradients it slowed the digits demo's convergence several-fold
(its error feedback re-sends the residual with later microbatches' inputs),
so it is used only when a job asks for it by name."""


@dataclass(frozen=True)
class CodecCost:
    """A codec as the cost model sees it.

    Attributes:
        spec: the codec spec string.
        wire_factor: wire bytes per float32 tensor byte.
        seconds_per_byte: encode + decode seconds per tensor byte.
        gradients_only: True for codecs that must not carry activations (top-k).
    """

    spec: str
    wire_factor: float
    seconds_per_byte: float
    gradients_only: bool = False

    def wire_bytes(self, nbytes: float, element_bytes: int = 4) -> float:
        """Bytes on the wire for a tensor of ``nbytes`` bytes of ``element_bytes``-byte elements.

        Factors are relative to float32; a codec never makes a tensor bigger
        than it is (bf16 of a bf16 tensor stays the same size).
        """
        if self.spec == "raw":
            return nbytes
        return nbytes * min(1.0, self.wire_factor * 4 / element_bytes)

    def seconds(self, nbytes: float) -> float:
        """Encode + decode seconds for a tensor of ``nbytes`` bytes."""
        return nbytes * self.seconds_per_byte


def codec_cost(spec: str) -> CodecCost:
    """The cost of codec ``spec``.

    Raises:
        PlanError: the spec does not parse or names an unknown codec.
    """
    try:
        parsed = parse_codec(spec)
    except SpecError as e:
        raise PlanError(f"unknown codec: {e}") from None
    name = parsed.name
    if name == "topk":  # k values and k indices of 4 bytes each
        factor, seconds = min(1.0, 2 * parsed.fraction), 1e-9
    else:
        factor, seconds = _BASE[name]
    if parsed.zstd_level is not None:
        factor *= _ZSTD_SHRINK.get(name, _ZSTD_DEFAULT_SHRINK)
        seconds += _ZSTD_SECONDS_PER_BYTE
    return CodecCost(spec, factor, seconds, gradients_only=parsed.gradients_only)


def _resolve(policy: str, auto: tuple[str, ...], kind: str) -> tuple[str, ...]:
    if policy == "auto":
        return auto
    if policy in ("none", "raw", ""):
        return ("raw",)
    cost = codec_cost(policy)
    if kind == "activation" and cost.gradients_only:
        raise PlanError(f"codec {policy!r} is for gradients only; activations can use "
                        f"at most 'int8+zstd'")
    return (policy,)


def candidates(config: TrainConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The codecs the config allows: ``(for activations, for gradients)``, weakest first.

    ``compression`` applies to both unless ``activation_compression`` or
    ``gradient_compression`` overrides it: "auto" gives the ladders
    :data:`AUTO_ACTIVATION` / :data:`AUTO_GRADIENT`, "none" gives raw only, a
    codec spec gives that codec only.

    Raises:
        PlanError: an unknown codec, or a gradients-only codec for activations.
    """
    act = config.activation_compression or config.compression
    grad = config.gradient_compression or config.compression
    return _resolve(act, AUTO_ACTIVATION, "activation"), _resolve(grad, AUTO_GRADIENT, "gradient")


def fastest(specs: Sequence[str], busy_seconds: Callable[[str], float]) -> str:
    """The codec among ``specs`` with the least ``busy_seconds`` (ties: the first, weakest)."""
    return min(specs, key=busy_seconds)


def choose(specs: Sequence[str], busy_seconds: Callable[[str], float], budget: float) -> str:
    """The weakest codec whose link time fits the budget.

    Args:
        specs: allowed codecs, weakest first.
        busy_seconds: seconds a tensor keeps the link busy under a codec
            (encode + wire bytes / bandwidth + decode).
        budget: seconds the link may take per microbatch without slowing the
            pipeline (its bottleneck compute time), seconds.

    Returns:
        The first spec that fits, so "raw" when the raw tensor crosses within
        the budget; when none fits, the fastest.
    """
    for spec in specs:
        if busy_seconds(spec) <= budget * (1 + 1e-9):
            return spec
    return fastest(specs, busy_seconds)
