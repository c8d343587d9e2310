"""Each codec's CPU cost on this machine, measured at a node's start-up, not assumed.

The planner used to price a codec's encode + decode with a constant per byte
(:data:`fedpipe.wire.codecmodel.MODELS`), measured once on large tensors, on
one machine. On the digits MLP's 8 KiB activations that missed most of the
cost: a message pays a fixed part (the codec's torch calls, a zstd context)
that a per-byte figure from a 1 MiB tensor does not see (issue 23), and a
slower machine pays more per byte.

:func:`measure` times each codec of :data:`CALIBRATED` on a ReLU-like float32
activation (half zeros, as after a ReLU) at two sizes, :data:`SMALL_BYTES` and
:data:`LARGE_BYTES`, and fits ``seconds = fixed + per_byte · bytes`` to the
median times of each, encode and decode apart, less raw's at the same size.
The five codecs "auto" chose from took 165 ms at load 18 on 2 cores; the figures
are then those of a loaded machine, as the training will be.

A lowrank codec is timed on a link's steady state: a basis is made by the
warm-up call (as a link's first message makes one) and the timed messages use
it without carrying it, so the figure leaves out the eigendecomposition and the
basis sent once per refresh period (the planner prices that basis' bytes,
:meth:`fedpipe.planner.codecs.CodecCost.wire_bytes`). A codec's parameter is
not part of its key (:func:`~fedpipe.wire.codecmodel.speed_key`): had4 and had2
are timed at their default 128-value blocks, topk at 1 %, lowrank at rank 16,
the settings "auto" and the benchmarks use.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..spec import LOWRANK_CODECS, parse_codec
from .codecmodel import CodecSpeed, speed_key
from .codecs import decode, encode
from .lowrank import End, Subspace

__all__ = ["CALIBRATED", "LARGE_BYTES", "SMALL_BYTES", "measure", "relu_like"]

CALIBRATED = ("fp16", "bf16", "int8", "int8+zstd", "bf16+zstd", "had4", "had2", "topk",
              "lowrank", "lowrank8")
"""The codecs a node measures: those "auto" may choose, their neighbours, and the codecs a
job may name for a link (had4, had2, topk, lowrank, lowrank8). sparseloco (DiLoCo's outer
sync, which the planner prices by its bytes only) is priced by the table."""
SMALL_BYTES = 16 * 1024
"""The small tensor's size, bytes: a small model's microbatch activation."""
LARGE_BYTES = 512 * 1024
"""The large tensor's size, bytes."""
WIDTH = 256
"""Row width of the measured tensors (float32 values per row)."""


def relu_like(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A float32 activation of ``nbytes`` bytes (a multiple of 4·:data:`WIDTH`), shape
    (nbytes / 1024, 256): N(0, 1) through a ReLU, from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // (4 * WIDTH), WIDTH, generator=g).relu_()


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _times(codec: str, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median ``(encode, decode)`` seconds of ``x`` under ``codec``; a lowrank codec's over
    a link whose ends hold the basis its first message carried (see the module's doc)."""
    if parse_codec(codec).name not in LOWRANK_CODECS:
        msg = encode(x, codec)
        return (_median_seconds(lambda: encode(x, codec), reps),
                _median_seconds(lambda: decode(msg), reps))
    sender, receiver = End(Subspace(), "calibration", 0), End(Subspace(), "calibration")
    decode(encode(x, codec, end=sender), end=receiver)  # both ends now hold the basis
    msg = encode(x, codec, end=sender)  # step 0 again: no refresh, no basis carried
    return (_median_seconds(lambda: encode(x, codec, end=sender), reps),
            _median_seconds(lambda: decode(msg, end=receiver), reps))


def _fit(small: float, large: float) -> tuple[float, float]:
    """``(fixed, per_byte)`` of the line through ``(SMALL_BYTES, small)`` and
    ``(LARGE_BYTES, large)``, seconds, neither below 0."""
    per_byte = max(0.0, (large - small) / (LARGE_BYTES - SMALL_BYTES))
    return max(0.0, small - per_byte * SMALL_BYTES), per_byte


def measure(codecs: tuple[str, ...] = CALIBRATED, reps: int = 3) -> list[CodecSpeed]:
    """This machine's encode and decode costs of ``codecs`` (on its CPU, one thread as
    the caller runs), beyond raw's: a :class:`~fedpipe.wire.codecmodel.CodecSpeed` per
    codec, in the order given.

    Args:
        codecs: codec specs (:func:`fedpipe.spec.parse_codec`'s grammar); each one's
            :func:`~fedpipe.wire.codecmodel.speed_key` names its result.
        reps: timed calls per codec, size and direction (the median is kept).

    Raises:
        SpecError: a codec that does not parse.
    """
    tensors = (relu_like(SMALL_BYTES), relu_like(LARGE_BYTES))
    raw = [_times("raw", x, reps) for x in tensors]
    out = []
    for codec in codecs:
        (es, ds), (el, dl) = (_times(codec, x, reps) for x in tensors)
        enc = _fit(max(0.0, es - raw[0][0]), max(0.0, el - raw[1][0]))
        dec = _fit(max(0.0, ds - raw[0][1]), max(0.0, dl - raw[1][1]))
        out.append(CodecSpeed(speed_key(parse_codec(codec)), *enc, *dec))
    return out
