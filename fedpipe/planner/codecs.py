"""How the planner prices and picks codecs: their costs, the "auto" ladders, the choice per link.

Specs follow the wire's grammar ``NAME[:PARAM][+zstd[:LEVEL]]`` (e.g. "int8",
"int8+zstd", "topk:0.01"). Each codec's sizes and encode + decode costs are
read from :data:`fedpipe.wire.codecmodel.MODELS` (their one home, torch-free,
with the table of figures); this module keeps none of its own.

Top-k is never used for activations.

A lowrank codec's size depends on the activation's row width d (its last
dimension: the rank R is out of d) and on how often its d×R basis is sent
(once per refresh period, with the first activation of that step): the profile
gives each layer's width (:attr:`~fedpipe.planner.types.LayerProfile.activation_width`)
and the pricing the microbatches per step (:meth:`CodecCost.wire_bytes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..spec import LOWRANK_CODECS, SpecError, parse_codec
from ..wire import codecmodel
from ..wire.codecmodel import CodecSpeed, cpu_seconds, lowrank_bytes_per_row, model
from .types import PlanError, TrainConfig

AUTO_ACTIVATION = ("raw", "bf16", "int8", "int8+zstd")
"""Codecs "auto" may always give activations, weakest (most faithful) first."""
AUTO_LOWRANK = ("lowrank8:16@50",)
"""Lowrank settings "auto" may give activations after :data:`AUTO_ACTIVATION` (strongest
last), under a synchronous schedule, only once their convergence is measured and reached
the target (:func:`converges`): ``benchmarks/wan.py`` measured ``lowrank8:16@50``, which
never reached it (:data:`fedpipe.wire.codecmodel.STEPS_LOWER_BOUND`), so "auto" offers no
lowrank codec today; a job that names one gets it."""
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
        row_bytes: lowrank codecs: ``row_bytes(width, rows_per_basis)``, wire bytes per
            row of ``width`` values with the basis sent once per ``rows_per_basis`` rows,
            zstd included (:func:`~fedpipe.wire.codecmodel.lowrank_bytes_per_row`);
            None for the others.
        refresh: lowrank codecs: steps between two bases (the spec's ``@N``); 0 otherwise.
    """

    spec: str
    wire_factor: float
    seconds_per_byte: float
    gradients_only: bool = False
    lossy: bool = False
    steps_factor: float = 1.0
    row_bytes: Callable[[int, float], float] | None = None
    refresh: int = 0

    def wire_bytes(self, nbytes: float, element_bytes: int = 4, width: int = 0,
                   messages_per_step: int = 0) -> float:
        """Bytes on the wire for a tensor of ``nbytes`` bytes of ``element_bytes``-byte elements.

        Factors are relative to float32; a codec never makes a tensor bigger
        than it is (bf16 of a bf16 tensor stays the same size). A lowrank codec with
        the tensor's row ``width`` known is priced by its size model: ``nbytes /
        (element_bytes · width)`` rows of R float32 coefficients (lowrank8: R int8
        and a float32 scale), plus its ``4·width·R``-byte basis once per ``refresh ×
        messages_per_step`` messages (``messages_per_step``: the microbatches per
        step, for activations, whose first message of a refresh step carries it; 0 for
        gradients, which go back in the basis the activations carried). Without the
        width (0) it is priced as no saving.
        """
        if self.spec == "raw":
            return nbytes
        if self.row_bytes is not None and width > 0 and nbytes > 0:
            rows = nbytes / (element_bytes * width)
            messages = self.refresh * messages_per_step if messages_per_step > 0 else math.inf
            return rows * self.row_bytes(width, rows * messages)
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
        PlanError: the spec does not parse, names an unknown codec, or gives a parameter
            out of its range (:func:`fedpipe.spec.parse_codec`'s reason).
    """
    try:
        parsed = parse_codec(spec)
    except SpecError as e:  # was "unknown codec: ..." for a level out of range too
        raise PlanError(str(e)) from None
    m = model(parsed)
    row_bytes = None
    if parsed.name in LOWRANK_CODECS:
        zstd = m.zstd_ratio if parsed.zstd_level is not None else 1.0

        def row_bytes(width: int, rows_per_basis: float) -> float:
            return zstd * lowrank_bytes_per_row(parsed.name, width, parsed.rank, rows_per_basis)
    return CodecCost(spec, m.wire_factor(parsed), m.cpu_seconds_per_byte(parsed),
                     gradients_only=parsed.gradients_only, lossy=m.lossy,
                     steps_factor=m.steps_factor, row_bytes=row_bytes,
                     refresh=parsed.refresh if parsed.name in LOWRANK_CODECS else 0)


def converges(spec: str) -> bool:
    """Whether codec ``spec``'s convergence factor is measured and its run reached the
    target (:data:`~fedpipe.wire.codecmodel.STEPS_MEASURED` has it and
    :data:`~fedpipe.wire.codecmodel.STEPS_LOWER_BOUND` does not): only then may "auto"
    choose a codec it offers on condition (:data:`AUTO_LOWRANK`)."""
    name = parse_codec(spec).name
    return name in codecmodel.STEPS_MEASURED and name not in codecmodel.STEPS_LOWER_BOUND


def auto_activation(schedule: str) -> tuple[str, ...]:
    """The codecs "auto" may give activations under ``schedule``, weakest first:
    :data:`AUTO_ACTIVATION`, then those of :data:`AUTO_LOWRANK` that :func:`converges`
    allows, but none under "async" (a lowrank basis needs a synchronous schedule,
    :func:`fedpipe.spec.lowrank_problem`)."""
    if schedule == "async":
        return AUTO_ACTIVATION
    return AUTO_ACTIVATION + tuple(c for c in AUTO_LOWRANK if converges(c))


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
    :func:`auto_activation` / :data:`AUTO_GRADIENT`, "none" gives raw only, a
    codec spec gives that codec only.

    Raises:
        PlanError: an unknown codec, or a gradients-only codec for activations.
    """
    act = config.activation_compression or config.compression
    grad = config.gradient_compression or config.compression
    return (_resolve(act, auto_activation(config.schedule), "activation"),
            _resolve(grad, AUTO_GRADIENT, "gradient"))


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
