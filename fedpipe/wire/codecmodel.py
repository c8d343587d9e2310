"""Each codec's size and CPU cost: the one table the wire and the planner read. No torch.

A codec is described here once, by name, and implemented in
:mod:`fedpipe.wire.codecs` (torch). Adding a codec is a row of :data:`MODELS`,
its name in the grammar (:data:`fedpipe.spec.CODEC_PARAMS`) and its functions
in :data:`fedpipe.wire.codecs.CODECS`; an import-time check refuses a codec
missing from any of the three.

Two sizes per codec:

* ``encoded_bytes(layout)``: the exact length of the codec's output before
  zstd, from what its header says (:class:`Layout`). The wire checks every
  message's ``encoded_bytes`` against it.
* ``fp32_ratio(spec)``: the planner's estimate of wire bytes per byte of a
  float32 tensor, and ``zstd_ratio``, what zstd is expected to leave of the
  codec's output. The planner prices a link with these
  (:mod:`fedpipe.planner.codecs`), and ``seconds_per_byte``, the codec's encode
  + decode seconds per byte of the uncompressed tensor:

======================  ===========  ==================
codec                   wire / fp32  encode+decode
======================  ===========  ==================
raw                     1.0          free
fp16, bf16              0.5          ~1 GB/s
int8                    ~0.27        ~1 GB/s
int8+zstd               ~0.15        ~0.3 GB/s (ReLU activations)
topk:F (gradients)      2·F          ~1 GB/s
had4:B                  1/8 + 1/B    ~0.5 GB/s (a B-point rotation each way)
had2:B                  1/16 + 1/B   ~0.5 GB/s
sparseloco:F (grads)    ~1.75·F/4    ~0.5 GB/s (a top-k per 4096-chunk)
lowrank:R               R/d (+ P)    ~0.5 GB/s (two d×R matmuls; d = the last dimension)
lowrank8:R              (R+4)/4d     ~0.5 GB/s
======================  ===========  ==================

zstd after any codec adds :data:`ZSTD_SECONDS_PER_BYTE`.

These figures are the fallback. Each node measures its own encode and decode
costs at start-up (:mod:`fedpipe.wire.codecspeed`, a :class:`CodecSpeed` per
codec, a fixed part per message and a part per byte, beyond raw's) and
advertises them; the planner prices a link's codec with its sender's encode and
its receiver's decode (:func:`cpu_seconds`), and with this table where a node
measured none. On small tensors the fixed part dominates: int8+zstd on the
digits MLP's 8 KiB activations measured ~50 us to encode and ~25-40 us to decode
(load 20-30), ~3x the table's 27 us for both.

Each codec also carries ``steps_factor``, its convergence cost: steps to a target
loss against raw fp32, measured by ``benchmarks/wan.py`` (:data:`STEPS_MEASURED`);
the planner predicts T = step time × that factor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

from ..spec import CODEC_PARAMS, HADAMARD_CODECS, CodecSpec, hadamard_block_problem

__all__ = ["HADAMARD_BITS", "LOWRANK_COEFFICIENT_BYTES", "MODELS", "SPARSELOCO_CHUNK",
           "STEPS_FACTORS", "STEPS_LOWER_BOUND", "STEPS_MEASURED", "ZSTD_SECONDS_PER_BYTE",
           "CodecModel", "CodecSpeed", "Layout", "cpu_seconds", "hadamard_block_problem",
           "index_bytes", "int8_blocks", "lowrank_basis_bytes", "lowrank_bytes_per_row", "model",
           "sparseloco_chunk_bytes", "speed_key"]

_GB_PER_S = 1e-9
"""Seconds per byte of a pass at 1 GB/s: encode + decode of the cheap codecs."""
ZSTD_SECONDS_PER_BYTE = 1 / 0.3e9 - _GB_PER_S
"""What zstd (level 1) adds to a codec's encode + decode, seconds per tensor byte: int8+zstd
ran at ~0.3 GB/s on ReLU activations, int8 alone at ~1 GB/s."""
ZSTD_RATIO = 0.9
"""What zstd leaves of a codec's output by default: dense floats barely compress."""


class Layout(NamedTuple):
    """What the length of a codec's output depends on, as its header says.

    Attributes:
        numel: elements of the tensor.
        itemsize: bytes per value the codec carries: the tensor's dtype for raw,
            topk's ``value_dtype``; unused by the other codecs.
        block_size: int8's values per scale; had4's and had2's values per
            rotation block and step.
        k: topk's entries kept; sparseloco's entries kept per chunk; lowrank's rank R.
        width: lowrank's row width d (the tensor's last dimension).
        basis: lowrank: the message carries its d×R float32 basis.
    """

    numel: int
    itemsize: int = 4
    block_size: int = 0
    k: int = 0
    width: int = 0
    basis: bool = False


def index_bytes(numel: int) -> int:
    """Bytes of one topk index in a tensor of ``numel`` elements: int32 below 2**31, else int64."""
    return 4 if numel < 2**31 else 8


def int8_blocks(numel: int, block_size: int) -> int:
    """int8's scale blocks over ``numel`` values: ⌈numel / block_size⌉."""
    return -(-numel // block_size)


def _raw_bytes(lay: Layout) -> int:
    return lay.numel * lay.itemsize


def _two_byte_bytes(lay: Layout) -> int:
    return 2 * lay.numel


def _int8_bytes(lay: Layout) -> int:  # float32 scales, then one int8 per value
    return 4 * int8_blocks(lay.numel, lay.block_size) + lay.numel


HADAMARD_BITS = {"had4": 4, "had2": 2}
"""Bits per value of each randomized-Hadamard codec."""
_HAD_SECONDS_PER_BYTE = 2 * _GB_PER_S
"""had4/had2 encode + decode, seconds per float32 byte: measured side by side on one
core at B=128, 0.55x int8's speed (the rotation is a B-point matmul each way)."""


def _had_bytes(bits: int) -> Callable[[Layout], int]:
    def size(lay: Layout) -> int:  # per padded block: a float32 step, then B codes of `bits`
        return int8_blocks(lay.numel, lay.block_size) * (4 + lay.block_size * bits // 8)
    return size


def _had_ratio(bits: int) -> Callable[[CodecSpec], float]:
    return lambda spec: bits / 32 + 1 / spec.block_size


def _topk_bytes(lay: Layout) -> int:  # k indices, then k values
    return lay.k * (index_bytes(lay.numel) + lay.itemsize)


SPARSELOCO_CHUNK = 4096
"""Values per sparseloco chunk: each chunk keeps its own top k, so an index fits in 12 bits
(Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", 2025, use 4096)."""


def sparseloco_chunk_bytes(k: int) -> int:
    """Bytes of one sparseloco chunk that keeps ``k`` values: a float32 scale, ``k`` 12-bit
    indices (two per 3 bytes, ``k`` rounded up to even) and ``k`` 2-bit codes (four per byte)."""
    return 4 + 3 * -(-k // 2) + -(-k // 4)


def _sparseloco_bytes(lay: Layout) -> int:  # per zero-padded chunk of SPARSELOCO_CHUNK values
    return int8_blocks(lay.numel, SPARSELOCO_CHUNK) * sparseloco_chunk_bytes(lay.k)


def _sparseloco_ratio(spec: CodecSpec) -> float:
    return sparseloco_chunk_bytes(spec.k(SPARSELOCO_CHUNK)) / (4 * SPARSELOCO_CHUNK)


_SPARSELOCO_SECONDS_PER_BYTE = 2 * _GB_PER_S
"""sparseloco encode + decode, seconds per float32 byte: a top-k over each chunk, ~ had2's."""


LOWRANK_COEFFICIENT_BYTES: dict[str, Callable[[int], int]] = {
    "lowrank": lambda rank: 4 * rank, "lowrank8": lambda rank: 4 + rank}
"""Bytes per row of d values of each lowrank codec's coefficients, by rank: R float32, or a
float32 scale and R int8."""


def lowrank_basis_bytes(width: int, rank: int) -> int:
    """Bytes of a lowrank basis P: ``width`` × ``rank`` float32 (row-major)."""
    return 4 * width * rank


def _lowrank_bytes(name: str) -> Callable[[Layout], int]:
    per_row = LOWRANK_COEFFICIENT_BYTES[name]

    def size(lay: Layout) -> int:  # [the basis], then per row of `width` values its coefficients
        rows = lay.numel // lay.width if lay.width else 0
        return lay.basis * lowrank_basis_bytes(lay.width, lay.k) + rows * per_row(lay.k)
    return size


def lowrank_bytes_per_row(name: str, width: int, rank: int, rows_per_basis: float) -> float:
    """Average wire bytes per row of ``width`` values under lowrank codec ``name``, the basis
    amortised: its ``4·width·rank`` bytes are sent once per ``rows_per_basis`` rows (the rows
    a boundary carries between two refreshes: refresh period × rows per step)."""
    return LOWRANK_COEFFICIENT_BYTES[name](rank) + lowrank_basis_bytes(width, rank) / rows_per_basis


_LOWRANK_SECONDS_PER_BYTE = 2 * _GB_PER_S
"""lowrank encode + decode, seconds per float32 byte: a d×R matmul each way (and a d×d
eigendecomposition per refresh), about had4's cost at R = 16."""


def _lowrank_ratio(spec: CodecSpec) -> float:
    """Not known from the spec: the ratio is about R/d (lowrank8: (R+4)/(4d)), and d, the
    activation's width, is the model's. The planner prices lowrank by
    :func:`lowrank_bytes_per_row` with the width the model's profile gives
    (:attr:`fedpipe.planner.types.LayerProfile.activation_width`,
    :meth:`fedpipe.planner.codecs.CodecCost.wire_bytes`); this ratio, no saving (1.0),
    is what it falls back to where a profile gives no width."""
    return 1.0


def _ratio(r: float) -> Callable[[CodecSpec], float]:
    return lambda spec: r


def _topk_ratio(spec: CodecSpec) -> float:
    return min(1.0, 2 * spec.fraction)  # a 4-byte value and a 4-byte index per kept entry


@dataclass(frozen=True)
class CodecModel:
    """One codec's sizes and costs (see the module's table).

    Attributes:
        name: the codec's name in spec strings.
        lossy: it changes values, so it applies to floating tensors only (a
            tensor of another dtype is sent raw).
        encoded_bytes: the exact length in bytes of its output before zstd.
        fp32_ratio: the planner's estimate of its output's bytes per float32
            tensor byte, before zstd.
        seconds_per_byte: encode + decode seconds per byte of the tensor.
        zstd_ratio: what zstd is expected to leave of its output.
        steps_factor: steps to a target loss against raw fp32 with this codec on
            every stage boundary (activations and their gradients), as
            ``benchmarks/wan.py`` measures it (:data:`STEPS_FACTORS`, from
            :data:`STEPS_MEASURED`); 1 where not measured. zstd is lossless and
            does not change it.
    """

    name: str
    lossy: bool
    encoded_bytes: Callable[[Layout], int]
    fp32_ratio: Callable[[CodecSpec], float]
    seconds_per_byte: float
    zstd_ratio: float = ZSTD_RATIO
    steps_factor: float = 1.0

    def wire_factor(self, spec: CodecSpec) -> float:
        """Estimated wire bytes per float32 tensor byte under ``spec``, zstd included."""
        factor = self.fp32_ratio(spec)
        return factor * self.zstd_ratio if spec.zstd_level is not None else factor

    def cpu_seconds_per_byte(self, spec: CodecSpec) -> float:
        """Encode + decode seconds per tensor byte under ``spec``, zstd included."""
        extra = ZSTD_SECONDS_PER_BYTE if spec.zstd_level is not None else 0.0
        return self.seconds_per_byte + extra


MODELS: dict[str, CodecModel] = {m.name: m for m in (
    CodecModel("raw", False, _raw_bytes, _ratio(1.0), 0.0),
    CodecModel("fp16", True, _two_byte_bytes, _ratio(0.5), _GB_PER_S),
    CodecModel("bf16", True, _two_byte_bytes, _ratio(0.5), _GB_PER_S),
    # exact: 1/4 + 1/block_size (0.258 at the default 128); zstd takes ReLU
    # activations' int8 codes to ~0.15 of float32
    CodecModel("int8", True, _int8_bytes, _ratio(0.27), _GB_PER_S, zstd_ratio=0.15 / 0.27),
    CodecModel("topk", True, _topk_bytes, _topk_ratio, _GB_PER_S),
    # near-Gaussian codes after the rotation: zstd finds little to take
    *(CodecModel(name, True, _had_bytes(bits), _had_ratio(bits), _HAD_SECONDS_PER_BYTE,
                 zstd_ratio=0.97) for name, bits in HADAMARD_BITS.items()),
    CodecModel("sparseloco", True, _sparseloco_bytes, _sparseloco_ratio,
               _SPARSELOCO_SECONDS_PER_BYTE, zstd_ratio=0.97),
    *(CodecModel(name, True, _lowrank_bytes(name), _lowrank_ratio, _LOWRANK_SECONDS_PER_BYTE,
                 zstd_ratio=0.97) for name in LOWRANK_COEFFICIENT_BYTES),
)}
"""Every codec's model, by name."""

STEPS_MEASURED: dict[str, float] = {"raw": 776 / 776, "bf16": 785 / 776, "int8": 787 / 776,
                                    "had4": 820 / 776, "had2": 620 / 776,
                                    "lowrank8": 1000 / 556}
"""Steps to the target loss against raw fp32's, with the codec on every stage boundary
(activations and gradients), measured by ``benchmarks/wan.py`` on the 4-stage character
transformer at the issue's full budget: 1,000 steps, the target (1.4495) raw's median
held-out loss at 800 steps; medians of 3 seeds. The in-process part ran split over
processes on 2026-12-02 (17:25-18:18 UTC, and seeds 1 and 2 of int8 and had4 20:30-20:55;
bf16 and int8+zstd 20:53-21:25; load 4-36: a shared 2-core machine; steps do not depend
on it)::

    python benchmarks/wan.py --no-swarm --configs C --save-curves wan-full-C.json
    # C = raw, int8, had4, had2, lowrank8, one process each; int8 and had4's seeds 1, 2:
    python benchmarks/wan.py --configs int8,had4 --seed-list 1,2 --no-swarm \
        --save-curves wan-full-int8-had4-s12.json
    python benchmarks/wan.py --configs bf16,int8+zstd,had4/had2,int8/topk,lowrank8:32 \
        --no-swarm --save-curves wan-full-rest.json
    python benchmarks/wan.py --load-curves wan-full-raw.json,...,wan-full-rest.json \
        --load-times wan-full-times5.json

Seeds 0, 1, 2: raw 776, 775, 812 steps (median 776); bf16 785, 784, 813 (785); int8 787,
771, 816 (787; int8+zstd the same, as zstd is lossless); had4 809,
820 and never (seed 2 diverged between steps 525 and 675, ending at loss 3.11; median 820,
final loss +1.5 %); had2 694, 620, 617 (620; final loss -4.7 %). lowrank8
(``lowrank8:16@50``, rank 16 of d = 64, 20 B/token) never reached the target in 1,000 steps
(final loss +10.1 %): its row is a lower bound, 1,000 over the 556 steps raw took to reach
lowrank8's final loss (median of 3 seeds). fp16, topk, sparseloco and lowrank were not
measured. The codecs sat at wan's split (embedding + block 0 | block 1 | block 2 | block 3 +
head); the swarm's planner split the same model otherwise ((1, 4, 5) and (3, 4, 5): the
embedding or the head alone), where had2 trained in process reached only 1.64-1.74 at 625
steps (``benchmarks/results/wan-e2e-split.txt``): a lossy codec's factor depends on where
the cuts fall."""
STEPS_LOWER_BOUND = frozenset({"lowrank8"})
"""Codecs of :data:`STEPS_MEASURED` whose runs never reached the target in the budget: their
factor is a lower bound, and "auto" does not choose them
(:func:`fedpipe.planner.codecs.converges`)."""
STEPS_FACTORS: dict[str, float] = {name: max(1.0, f) for name, f in STEPS_MEASURED.items()}
"""The convergence factor the planner uses: the measured one, but never under 1 (a lossy
codec is not credited with converging faster than raw: had2's 0.80 over 3 seeds, with a
final loss 4.7 % under raw's, is this small model's, whose held-out loss the 2-bit noise
may regularise, not a property to plan larger ones by); 1 where not measured."""
MODELS = {name: replace(m, steps_factor=STEPS_FACTORS.get(name, 1.0))
          for name, m in MODELS.items()}

if set(HADAMARD_BITS) != HADAMARD_CODECS:
    raise ImportError(f"Hadamard codecs {sorted(HADAMARD_CODECS)} and their bits "
                      f"{sorted(HADAMARD_BITS)} differ")
if set(MODELS) != set(CODEC_PARAMS):
    raise ImportError(f"fedpipe.wire.codecmodel and fedpipe.spec.CODEC_PARAMS disagree on the "
                      f"codecs: {sorted(set(MODELS) ^ set(CODEC_PARAMS))}")


def model(spec: CodecSpec) -> CodecModel:
    """The model of the codec ``spec`` names (a parsed spec names a known codec)."""
    return MODELS[spec.name]


MAX_CODEC_SECONDS = 10.0
"""Largest fixed cost per message, and per MiB, a codec cost may give, seconds: beyond it a
figure is a broken clock, not a speed."""


@dataclass(frozen=True)
class CodecSpeed:
    """One codec's CPU cost on one node, as the node measured it
    (:func:`fedpipe.wire.codecspeed.measure`), beyond raw's (raw's payload is a view of
    the tensor, so raw costs 0 here and a message's own cost is
    :attr:`fedpipe.planner.types.Overheads.message`).

    Encoding a tensor of ``n`` bytes takes ``encode_fixed + encode_per_byte · n`` seconds,
    decoding it ``decode_fixed + decode_per_byte · n``.

    Attributes:
        codec: the codec it prices, as :func:`speed_key` writes it ("int8+zstd").
        encode_fixed, decode_fixed: seconds per message.
        encode_per_byte, decode_per_byte: seconds per byte of the tensor.
    """

    codec: str
    encode_fixed: float
    encode_per_byte: float
    decode_fixed: float
    decode_per_byte: float

    def check(self) -> None:
        """Refuse a cost no clock measures: a codec named in 1-64 characters, every figure
        finite, in [0, :data:`MAX_CODEC_SECONDS`] s per message and per MiB.

        Raises:
            ValueError: naming the codec and its figures.
        """
        figures = (self.encode_fixed, self.decode_fixed, self.encode_per_byte * 2**20,
                   self.decode_per_byte * 2**20)
        if not 0 < len(self.codec) <= 64 or not all(
                math.isfinite(f) and 0 <= f <= MAX_CODEC_SECONDS for f in figures):
            raise ValueError(f"codec speed {self.codec[:64]!r} must name a codec in 1-64 "
                             f"characters and give costs in [0, {MAX_CODEC_SECONDS}] s per "
                             f"message and per MiB, got {list(figures)}")


def speed_key(spec: CodecSpec) -> str:
    """The :attr:`CodecSpeed.codec` that prices ``spec``: its name, then "+zstd" when zstd
    follows (a block size or a level changes the cost little)."""
    return spec.name + ("+zstd" if spec.zstd_level is not None else "")


def cpu_seconds(spec: CodecSpec, nbytes: float, encoder: tuple[CodecSpeed, ...] = (),
                decoder: tuple[CodecSpeed, ...] = ()) -> float:
    """Encode + decode seconds of an ``nbytes``-byte tensor under ``spec``: the encode as
    the sending node measured it (``encoder``, its :class:`CodecSpeed` list), the decode
    as the receiving node did (``decoder``); a side without a measure of this codec is
    half of the table's :meth:`CodecModel.cpu_seconds_per_byte` (0 for raw)."""
    if spec.name == "raw" and spec.zstd_level is None:
        return 0.0
    key = speed_key(spec)
    half = model(spec).cpu_seconds_per_byte(spec) * nbytes / 2
    enc = next((s for s in encoder if s.codec == key), None)
    dec = next((s for s in decoder if s.codec == key), None)
    return ((enc.encode_fixed + enc.encode_per_byte * nbytes if enc else half)
            + (dec.decode_fixed + dec.decode_per_byte * nbytes if dec else half))
