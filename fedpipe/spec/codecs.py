"""The codec grammar and policy: which codecs exist, their spec strings, and where each
may be used (the size models and CPU costs live in :mod:`fedpipe.wire` and the planner)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from .errors import SpecError


CODEC_PARAMS: dict[str, str | None] = {"raw": None, "fp16": None, "bf16": None,
                                       "int8": "block_size", "topk": "fraction",
                                       "had4": "block_size", "had2": "block_size",
                                       "sparseloco": "fraction", "lowrank": "rank",
                                       "lowrank8": "rank"}
"""Every codec name and the :class:`CodecSpec` field its parameter sets (None: no parameter)."""
GRADIENT_ONLY_CODECS = frozenset({"topk", "sparseloco"})
"""Codecs that drop most of a tensor: usable for gradients (with error feedback) only."""
LOWRANK_CODECS = frozenset({"lowrank", "lowrank8"})
HADAMARD_CODECS = frozenset({"had4", "had2"})
"""Codecs that rotate blocks with a Hadamard transform: their block size is a power of two."""
"""Codecs with state at both ends of a link: a basis per stage boundary (see
:mod:`fedpipe.wire.lowrank`); their spec's parameter is ``R[@N]``, the rank and refresh period."""
CODEC_POLICIES = ("auto", "none")
"""Compression settings that are not a codec: "auto" (the planner picks per link), "none" (raw)."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec string::

        spec  := name [":" param] ["+zstd" [":" level]]
        raw | fp16 | bf16          no parameter
        int8[:B]                   B = values per scale block, 16..65536 (default 128)
        topk[:F]                   F = fraction of entries kept, 1e-6..1 (default 0.01)
        sparseloco[:F]             top-k per chunk of 4096 values (k = ⌈F·4096⌉), 2-bit
                                   values; F as topk's (SparseLoCo's 1.56 %: F = 0.015625)
        lowrank[:R[@N]]            projection onto a rank-R basis (1..4096, default 16) of
                                   the activations' principal components, refreshed every N
                                   steps (1..10**6, default 100); float32 coefficients
        lowrank8[:R[@N]]           as lowrank, int8 coefficients (a float32 scale per row)
        +zstd[:L]                  zstandard level L, 1..22 (default 1)

    e.g. ``"int8:64+zstd"``, ``"topk:0.05+zstd:3"``, ``"lowrank8:8@50"``.

    Attributes:
        name: a key of :data:`CODEC_PARAMS`.
        block_size: int8 only: values per float32 scale, 16..65536.
        fraction: topk and sparseloco: fraction of the entries kept, 1e-6..1; at
            least one entry of a non-empty tensor (sparseloco: of a chunk) is kept.
        rank: lowrank and lowrank8: the basis' rank R, 1..4096 (at most the tensor's last
            dimension, checked when encoding).
        refresh: lowrank and lowrank8: steps between refreshes of the basis, 1..10**6.
        zstd_level: zstandard level 1..22, or None for no zstd.

    Raises:
        SpecError: unknown name or a parameter out of range.
    """

    name: str
    block_size: int = 128
    fraction: float = 0.01
    zstd_level: int | None = None
    rank: int = 16
    refresh: int = 100

    def __post_init__(self) -> None:
        if self.name not in CODEC_PARAMS:
            raise SpecError(f"unknown codec {self.name!r}; known: {sorted(CODEC_PARAMS)}")
        problem = hadamard_block_problem(self.name, self.block_size)
        if problem:
            raise SpecError(problem)
        _check_range(f"{self.name} block_size", self.block_size, 16, 65536)
        _check_range(f"{self.name} fraction", self.fraction, 1e-6, 1.0)
        _check_range(f"{self.name} rank", self.rank, 1, 4096)
        _check_range(f"{self.name} refresh", self.refresh, 1, 10**6)
        if self.zstd_level is not None:
            _check_range("zstd level", self.zstd_level, 1, 22)

    @property
    def gradients_only(self) -> bool:
        """Whether this codec may carry gradients only (see :data:`GRADIENT_ONLY_CODECS`)."""
        return self.name in GRADIENT_ONLY_CODECS

    def k(self, numel: int) -> int:
        """topk: number of entries kept out of ``numel``: ⌈fraction·numel⌉, at least 1."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def __str__(self) -> str:
        param = CODEC_PARAMS[self.name]
        text = self.name if param is None else f"{self.name}:{getattr(self, param)}"
        if self.name in LOWRANK_CODECS and self.refresh != CodecSpec.refresh:
            text += f"@{self.refresh}"
        return text if self.zstd_level is None else f"{text}+zstd:{self.zstd_level}"


def hadamard_block_problem(name: str, block: int) -> str | None:
    """Why ``block`` cannot be codec ``name``'s block size, or None if it can (or ``name``
    is not a Hadamard codec): the rotation needs a power of two in [16, 65536]."""
    if name in HADAMARD_CODECS and not (16 <= block <= 65536 and block & (block - 1) == 0):
        return f"{name} block_size must be a power of two in [16, 65536], got {block}"
    return None


def _check_range(what: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise SpecError(f"{what} must be in [{lo}, {hi}], got {value}")


_SPEC_RE = re.compile(r"(?P<name>\w+)(?::(?P<param>[^+]+))?(?P<zstd>\+zstd(?::(?P<level>[^+]+))?)?")


@lru_cache(maxsize=256)
def parse_codec(spec: str) -> CodecSpec:
    """Parse a codec spec string such as ``"int8:64+zstd"`` or ``"topk:0.05+zstd:3"``.

    Raises:
        SpecError: the string does not follow the grammar, names an unknown
            codec, gives a parameter to a codec that takes none, or a value
            out of range.
    """
    m = _SPEC_RE.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        raise SpecError(f"bad codec spec {spec!r}: expected NAME[:PARAM][+zstd[:LEVEL]], "
                        f"e.g. 'int8:64+zstd'")
    name, param, level = m["name"], m["param"], m["level"]
    if name not in CODEC_PARAMS:
        raise SpecError(_unknown_codec(spec, name, sorted(CODEC_PARAMS)))
    kwargs: dict[str, Any] = {
        "zstd_level": (1 if level is None else _number(spec, "zstd level", level, int))
        if m["zstd"] else None}
    if param is not None:
        param_field = CODEC_PARAMS[name]
        if param_field is None:
            raise SpecError(f"bad codec spec {spec!r}: codec {name!r} takes no parameter")
        if name in LOWRANK_CODECS and "@" in param:
            param, refresh = param.split("@", 1)
            kwargs["refresh"] = _number(spec, f"{name} refresh", refresh, int)
        kwargs[param_field] = _number(spec, f"{name} {param_field}", param,
                                      type(getattr(CodecSpec, param_field)))
    try:
        return CodecSpec(name, **kwargs)
    except SpecError as e:
        raise SpecError(f"bad codec spec {spec!r}: {e}") from None


def _unknown_codec(spec: str, name: str, valid: list[str]) -> str:
    """The error for codec spec ``spec`` whose codec ``name`` is not one: what is valid
    there (``valid``), or, for ``zstd``, that it is a suffix to a codec."""
    if name == "zstd":
        return (f"bad codec spec {spec!r}: zstd is a suffix to a codec, not a codec: e.g. "
                f"'raw+zstd' or 'int8+zstd' (NAME[:PARAM]+zstd[:LEVEL])")
    return f"bad codec spec {spec!r}: unknown codec {name!r}; valid: {valid}"


def valid_settings(carries: Literal["activations", "gradients", "outer"]) -> list[str]:
    """The compression settings :func:`check_compression` takes for tensors of kind
    ``carries``, each codec by name: "auto", "none", then the codecs allowed there, sorted
    (each takes its parameter and ``+zstd`` as :class:`CodecSpec`'s grammar says)."""
    refused = {"activations": GRADIENT_ONLY_CODECS, "gradients": frozenset(),
               "outer": LOWRANK_CODECS}[carries]
    return [*CODEC_POLICIES, *sorted(set(CODEC_PARAMS) - refused)]


def _number(spec: str, what: str, text: str, kind: type[int] | type[float]) -> int | float:
    """``text``, codec ``spec``'s ``what`` ("zstd level"), as a ``kind``.

    Raises:
        SpecError: ``text`` is not one, naming ``what``.
    """
    try:
        return kind(text)
    except ValueError:
        raise SpecError(f"bad codec spec {spec!r}: {what} {text!r} is not "
                        f"{'a whole number' if kind is int else 'a number'}") from None


def check_compression(setting: str, carries: Literal["activations", "gradients", "outer"]
                      ) -> str:
    """``setting`` if it is a valid compression setting for tensors of kind ``carries``.

    ``setting`` is "auto", "none" or a codec spec; a gradients-only codec
    (top-k) is refused for activations, which it would mostly zero, and a lowrank
    codec (:data:`LOWRANK_CODECS`) for DiLoCo's outer sync, which has no stage boundary
    to keep a basis on (a job's pair of settings: :func:`lowrank_problem`).

    Raises:
        SpecError: a bad codec spec (an unknown codec's lists :func:`valid_settings`), a
            gradients-only codec for activations, or a lowrank codec for the outer sync.
    """
    if setting in CODEC_POLICIES:
        return setting
    m = _SPEC_RE.fullmatch(setting) if isinstance(setting, str) else None
    if m is not None and m["name"] not in CODEC_PARAMS:
        raise SpecError(_unknown_codec(setting, m["name"], valid_settings(carries)))
    if parse_codec(setting).name in LOWRANK_CODECS and carries == "outer":
        raise SpecError(f"{setting!r} keeps a basis per stage boundary: it compresses "
                        "activations and their gradients, not DiLoCo's outer sync")
    if parse_codec(setting).gradients_only and carries == "activations":
        raise SpecError(f"{setting!r} drops most of each tensor: use it for gradients only, "
                        f"e.g. compression={{'activations': 'int8', 'gradients': 'topk:0.01'}}")
    return setting


def lowrank_problem(activations: str, gradients: str, schedule: str) -> str | None:
    """Why a job's valid compression settings cannot carry its lowrank codec, or None.

    A lowrank codec's basis is made from the activations that cross a boundary and
    their gradients go back in it (:mod:`fedpipe.wire.lowrank`), so lowrank gradients
    need lowrank activations of the same rank; and both ends must agree on the basis
    a step uses, which a synchronous schedule guarantees (under "async" the gradients
    of one step cross while the next step's activations refresh the basis).
    """
    act = None if activations in CODEC_POLICIES else parse_codec(activations)
    grad = None if gradients in CODEC_POLICIES else parse_codec(gradients)
    lowrank = [c for c in (act, grad) if c is not None and c.name in LOWRANK_CODECS]
    if not lowrank:
        return None
    if schedule == "async":
        return (f"{lowrank[0]} needs a synchronous schedule: under \"async\" a step's "
                "gradients would cross in a basis the next step's activations replaced")
    if grad is not None and grad.name in LOWRANK_CODECS and (
            act is None or act.name not in LOWRANK_CODECS or act.rank != grad.rank):
        return (f"lowrank gradients {gradients!r} go back in the basis the activations "
                f"make: the activations need a lowrank codec of rank {grad.rank} too, "
                f"not {activations!r}")
    return None
