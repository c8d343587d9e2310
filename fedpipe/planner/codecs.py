"""How the planner prices and picks codecs: their costs, the "auto" ladders, the choice per link.

Specs follow the wire's grammar ``NAME[:PARAM][+zstd[:LEVEL]]`` (e.g. "int8",
"int8+zstd", "topk:0.01"). Each codec's sizes and encode + decode costs are
read from :data:`fedpipe.wire.codecmodel.MODELS` (their one home, torch-free,
with the table of figures); this module keeps none of its own.

Top-k is never used for activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..spec import SpecError, parse_codec
from ..wire.codecmodel import CodecSpeed, cpu_seconds, hadamard_block_problem, model
from .types import PlanError, TrainConfig

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
        lossy: it changes values: on gradients the sender keeps an error-feedback
            residual per microbatch (:class:`fedpipe.wire.feedback.ErrorFeedback`).
        steps_factor: steps to a target loss against raw fp32 (its model's
            :attr:`~fedpipe.wire.codecmodel.CodecModel.steps_factor`, measured).
    """

    spec: str
    wire_factor: float
    seconds_per_byte: float
    gradients_only: bool = False
    lossy: bool = False
    steps_factor: float = 1.0

    def wire_bytes(self, nbytes: float, element_bytes: int = 4) -> float:
        """Bytes on the wire for a tensor of ``nbytes`` bytes of ``element_bytes``-byte elements.

        Factors are relative to float32; a codec never makes a tensor bigger
        than it is (bf16 of a bf16 tensor stays the same size).
        """
        if self.spec == "raw":
            return nbytes
        return nbytes * min(1.0, self.wire_factor * 4 / element_bytes)

    def buffer_bytes(self, nbytes: float, element_bytes: int = 4) -> float:
        """Bytes of the encoded (or received) copy of an ``nbytes``-byte tensor that a
        stage holds while it is sent or decoded: its wire bytes, but none for plain
        raw, whose payload is a view of the tensor itself
        (:func:`fedpipe.wire.codecs.encode_payload`)."""
        return 0.0 if self.spec == "raw" else self.wire_bytes(nbytes, element_bytes)

    def seconds(self, nbytes: float, encoder: tuple[CodecSpeed, ...] = (),
                decoder: tuple[CodecSpeed, ...] = ()) -> float:
        """Encode + decode seconds for a tensor of ``nbytes`` bytes: with the sending node's
        measured costs ``encoder`` and the receiving node's ``decoder`` where they price
        this codec (:func:`fedpipe.wire.codecmodel.cpu_seconds`), else the table's."""
        if not encoder and not decoder:
            return nbytes * self.seconds_per_byte
        return cpu_seconds(parse_codec(self.spec), nbytes, encoder, decoder)


def codec_cost(spec: str) -> CodecCost:
    """The cost of codec ``spec``.

    Raises:
        PlanError: the spec does not parse, names an unknown codec, or gives
            a Hadamard codec a block size that is not a power of two.
    """
    try:
        parsed = parse_codec(spec)
    except SpecError as e:
        raise PlanError(f"unknown codec: {e}") from None
    problem = hadamard_block_problem(parsed.name, parsed.block_size)
    if problem:
        raise PlanError(f"bad codec {spec!r}: {problem}")
    m = model(parsed)
    return CodecCost(spec, m.wire_factor(parsed), m.cpu_seconds_per_byte(parsed),
                     gradients_only=parsed.gradients_only, lossy=m.lossy,
                     steps_factor=m.steps_factor)


def steps_factor(specs: Sequence[str]) -> float:
    """The convergence factor of a pipeline whose links use codecs ``specs``: the largest of
    theirs (measured with one codec at every boundary; a mix is priced by its worst), 1 for
    none. Predicted T = step time × this."""
    return max((codec_cost(s).steps_factor for s in specs), default=1.0)


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
