"""The cost model: compute, memory, link transfers and the cross-group all-reduce.

Units: FLOP/s for speeds, bytes for sizes, bytes/s for bandwidth, seconds for times.
Everything the search estimates and everything the simulator replays is priced
by these functions, so the two never disagree about a single cost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence, TypeVar

from ..wire.codecmodel import CodecSpeed
from .codecs import codec_cost
from .steptime import in_flight, pipeline_estimate, step_estimate, steps_in_flight
from .types import Link, ModelProfile, NodeSpec, Overheads, TrainConfig

FORWARD_FRACTION = 1 / 3
"""Share of a layer's forward + backward FLOP spent in the forward pass
(backward ≈ 2× forward)."""
RECOMPUTE_FACTOR = 1 + FORWARD_FRACTION
"""A recomputing stage's work over its work without: its backward re-runs its forward."""
BF16_SPEEDUP = {"cuda": 2.0}
"""Compute speed of "bf16-mixed" over float32, by device type: a GPU's bfloat16 tensor
cores run matmuls about twice as fast as its float32 ones (an assumption, not measured:
nodes probe float32 only); on a CPU autocast saves memory, not time."""


def compute_seconds(profile: ModelProfile, start: int, end: int, flops: float,
                    samples: float) -> tuple[float, float]:
    """``(forward, backward)`` seconds of layers ``[start, end)`` for ``samples`` samples
    on a node of ``flops`` FLOP/s."""
    total = sum(layer.flops for layer in profile.layers[start:end]) * samples / flops
    return total * FORWARD_FRACTION, total * (1 - FORWARD_FRACTION)


def host_factors(nodes: Sequence[NodeSpec],
                 busy: Mapping[str, float] | None = None) -> dict[str, float]:
    """Per node id, how many times slower its compute runs because ``nodes`` (those a
    plan uses) share their machines' cores.

    A host runs the threads of every node of it in ``nodes``, each busy
    computing ``busy[node]`` of the step (a fraction; 1 where not given); when
    together they demand more than its ``host_cores`` the OS time-slices them,
    so each node's passes take ``demand / host_cores`` times as long as probed
    alone (at least 1). Nodes without a host or with ``host_cores`` 0 get 1.
    """
    busy = busy or {}
    demand: dict[str, float] = {}
    for n in nodes:
        if n.host and n.host_cores > 0:
            demand[n.host] = demand.get(n.host, 0.0) + max(1, n.threads) * min(
                1.0, max(0.0, busy.get(n.node_id, 1.0)))
    return {n.node_id: (max(1.0, demand[n.host] / n.host_cores)
                        if n.host and n.host_cores > 0 else 1.0) for n in nodes}


def pass_seconds(profile: ModelProfile, start: int, end: int, flops: float, samples: float,
                 overheads: Overheads, host_factor: float = 1.0, *,
                 recompute: bool = False) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one microbatch of ``samples`` samples through
    layers ``[start, end)`` on a node of ``flops`` FLOP/s (:func:`precision_flops`) whose
    host slows it by ``host_factor`` (:func:`host_factors`), with the runtime's fixed cost
    per pass; a ``recompute`` stage's backward re-runs the forward first."""
    f, b = compute_seconds(profile, start, end, flops, samples)
    if recompute:
        b += f
    return f * host_factor + overheads.microbatch, b * host_factor + overheads.microbatch


def precision_flops(node: NodeSpec, precision: str) -> float:
    """The speed node ``node`` computes at under ``precision`` ("fp32" or "bf16-mixed"),
    FLOP/s: its probed float32 speed, times :data:`BF16_SPEEDUP` of its device type under
    "bf16-mixed"."""
    if precision != "bf16-mixed":
        return node.flops
    return node.flops * BF16_SPEEDUP.get(node.device.split(":")[0], 1.0)


def optimizer_seconds(profile: ModelProfile, start: int, end: int, overheads: Overheads,
                      host_factor: float = 1.0) -> float:
    """Seconds of the optimizer step of layers ``[start, end)`` (after the step's last
    backward), priced per parameter byte (:class:`~fedpipe.planner.types.Overheads`)."""
    params = sum(layer.parameter_bytes for layer in profile.layers[start:end])
    return params * overheads.optimizer_per_byte * host_factor


def state_bytes(profile: ModelProfile, start: int, end: int, config: TrainConfig,
                snapshots_on_disk: bool = False) -> float:
    """Weights, gradients and optimizer state of layers ``[start, end)``, and the
    checkpoint snapshots of them a node keeps (``config.snapshot_copies``), bytes.

    A buddy keeps snapshots of another stage; counting the stage's own size
    for it assumes balanced stages, which the min-max partition aims for.

    A node that keeps its snapshots on disk (``snapshots_on_disk``, ``fedpipe node
    --snapshot-dir``) holds none of them in memory, only the one tensor it writes or
    reads at a time (:mod:`fedpipe.node.snapshots`): at most the stage's largest layer's
    weights and optimizer state (:func:`disk_snapshot_bytes`).
    """
    params = sum(layer.parameter_bytes for layer in profile.layers[start:end])
    if snapshots_on_disk:
        return params * config.state_factor + disk_snapshot_bytes(profile, start, end, config)
    return params * (config.state_factor
                     + config.snapshot_copies * max(0.0, config.state_factor - 1))


def disk_snapshot_bytes(profile: ModelProfile, start: int, end: int,
                        config: TrainConfig) -> float:
    """Memory a node that keeps snapshots on disk holds for them with a stage of layers
    ``[start, end)``, bytes: the largest layer's parameter bytes; 0 with checkpoints off
    (``config.snapshot_copies`` 0).

    Measured (2026-12-02, a stage of 176 MB of weights whose largest tensor is 11 MB):
    writing its own snapshot from the stage's tensors and reading one back grow the RSS by
    under 1 MB; shipping one to a buddy holds about one tensor on the sender (11 MB) and
    about four on the receiver (44 MB: its frames, their decoding, the tensor). A
    transformer block's largest tensor is about a quarter of its parameters, so one
    layer's parameter bytes cover both ends; a layer of one big tensor is priced under
    what a node shipping and receiving at once holds (the profile has no tensor sizes)."""
    if config.snapshot_copies <= 0:
        return 0.0
    return float(max((layer.parameter_bytes for layer in profile.layers[start:end]),
                     default=0))


def input_bytes(profile: ModelProfile, start: int, samples: float) -> float:
    """Bytes of the input of a stage starting at layer ``start``, for ``samples`` samples."""
    per_sample = profile.input_bytes if start == 0 else profile.layers[start - 1].activation_bytes
    return per_sample * samples


def stash_bytes(profile: ModelProfile, start: int, end: int, samples: float) -> float:
    """Activations one microbatch of ``samples`` samples keeps for backward in
    layers ``[start, end)``: the stage's input and every layer's output, bytes."""
    outputs = sum(layer.activation_bytes for layer in profile.layers[start:end])
    return input_bytes(profile, start, samples) + outputs * samples


Bytes = Any
"""A number of bytes, or a numpy array of them (the planner's matrices over layer ranges)."""


def kept_activation_bytes(stash: Bytes, inputs: Bytes, in_flight: Bytes,
                          recompute: bool, scale: float = 1.0) -> Bytes:
    """Activation bytes a stage keeps for backward at its peak (numbers or numpy arrays).

    Without recomputation: ``in_flight`` microbatches' whole ``stash``
    (:func:`stash_bytes`). With it: each in-flight microbatch's input only
    (:func:`input_bytes`), and while one microbatch recomputes its forward, its whole
    stash. ``scale``: :func:`activation_scale`.
    """
    if recompute:
        return scale * (inputs * (in_flight - 1) + stash)
    return scale * stash * in_flight


def activation_scale(profile: ModelProfile, precision: str) -> float:
    """Bytes of an activation under ``precision`` over bytes as profiled: "bf16-mixed"
    keeps 2-byte activations (half of float32's; the stage input of token ids and the
    few ops autocast keeps in float32 are priced as bfloat16 too), "fp32" as profiled."""
    return min(1.0, 2 / profile.element_bytes) if precision == "bf16-mixed" else 1.0


def activation_memory_bytes(profile: ModelProfile, start: int, end: int, config: TrainConfig,
                            samples: float, microbatches_in_flight: int,
                            recompute: bool) -> float:
    """Activations a stage holding layers ``[start, end)`` keeps at its peak, bytes, with
    ``microbatches_in_flight`` microbatches of ``samples`` samples in flight
    (:func:`kept_activation_bytes` at the config's precision)."""
    return float(kept_activation_bytes(stash_bytes(profile, start, end, samples),
                                       input_bytes(profile, start, samples),
                                       microbatches_in_flight, recompute,
                                       activation_scale(profile, config.precision)))


def stashed_weight_copies(config: TrainConfig, microbatches_in_flight: int) -> int:
    """Copies of a stage's parameters that weight stashing keeps under "async"
    (:class:`fedpipe.runtime.async_stage.AsyncStageRunner`'s snapshots): one per weight
    version in use, ``min(max_staleness + 1, microbatches_in_flight)``, at least one;
    none under a schedule that flushes."""
    if config.schedule != "async":
        return 0
    return max(1, min(config.max_staleness + 1, microbatches_in_flight))


@dataclass(frozen=True)
class StageCodecs:
    """The codecs of the tensors a stage sends and receives ("raw" where none crosses):
    its output activation and its input's gradient it sends (the plan's
    ``activation_codec`` and ``gradient_codec`` of the stage), its input activation and
    its output's gradient it receives (the previous stage's ``activation_codec`` and
    the next stage's ``gradient_codec``)."""

    sent_activation: str = "raw"
    sent_gradient: str = "raw"
    received_activation: str = "raw"
    received_gradient: str = "raw"


RAW_CODECS = StageCodecs()


def codec_buffer_bytes(profile: ModelProfile, start: int, end: int, samples: float,
                       microbatches: int, codecs: StageCodecs, precision: str = "fp32") -> float:
    """Bytes a stage holding layers ``[start, end)`` keeps for its boundary tensors'
    codecs, microbatches of ``samples`` samples, under ``precision`` (:func:`boundary_bytes`):

    - one encoded copy of each tensor it sends and one of each it receives
      (:meth:`~fedpipe.planner.codecs.CodecCost.buffer_bytes`: 0 under plain raw);
    - under a lossy gradient codec, the error-feedback residual the sender keeps
      per microbatch, the size of the gradient in float32 (``microbatches`` of them;
      :class:`~fedpipe.wire.feedback.ErrorFeedback` keeps them at least float32,
      a bf16-mixed stage's too).

    Raises:
        PlanError: an unknown codec.
    """
    eb = boundary_element_bytes(profile, precision)
    total = 0.0
    if end < len(profile.layers):       # the output goes on, its gradient comes back
        out = boundary_bytes(profile, end, samples, precision)
        total += codec_cost(codecs.sent_activation).buffer_bytes(out, eb)
        total += codec_cost(codecs.received_gradient).buffer_bytes(out, eb)
    if start > 0:                       # the input came in, its gradient goes back
        inp = boundary_bytes(profile, start, samples, precision)
        grad = codec_cost(codecs.sent_gradient)
        total += codec_cost(codecs.received_activation).buffer_bytes(inp, eb)
        total += grad.buffer_bytes(inp, eb)
        if grad.lossy:  # the error-feedback residuals are float32 whatever the precision
            residual = boundary_bytes(profile, start, samples) * max(4, profile.element_bytes)
            total += microbatches * residual / profile.element_bytes
    return total


def stage_memory_bytes(profile: ModelProfile, start: int, end: int, config: TrainConfig,
                       stage: int, n_stages: int, microbatches: int | None = None,
                       codecs: StageCodecs = RAW_CODECS, recompute: bool | None = None,
                       snapshots_on_disk: bool = False) -> float:
    """Peak memory of a stage holding layers ``[start, end)``, bytes: the one model of
    it (the planner's memory checks, the tracker's fits and a node's admission use it).

    The sum of
    - weights, gradients and optimizer state, ``config.state_factor`` × parameter
      bytes (the optimizer's, :func:`fedpipe.spec.optimizers.state_factor`), and the
      checkpoint snapshots a node keeps (:func:`state_bytes`; none in memory but the
      tensor in flight when it keeps them on disk, ``snapshots_on_disk``);
    - the activations kept for backward: :func:`~.steptime.in_flight` microbatches of
      ``batch_size / microbatches`` samples (GPipe: all of them; 1F1B: up to the
      stage's depth), at the config's precision, each its whole :func:`stash_bytes`
      or, recomputing, its input only (:func:`activation_memory_bytes`); or, when
      more, the optimizer's scratch during its step (``config.step_scratch`` ×
      parameter bytes), which a synchronous schedule runs once the stash is freed
      (under "async", both);
    - under "async", the stashed copies of its weights (:func:`stashed_weight_copies`);
    - the codecs' buffers of its boundary tensors (:func:`codec_buffer_bytes`).

    Args:
        stage, n_stages: the stage's index in its chain and the chain's length.
        microbatches: microbatches the stage's group runs per step (default:
            ``config.microbatches``).
        codecs: the codecs of the tensors it sends and receives (default: raw).
        recompute: whether the stage recomputes; None: as ``config.recompute`` allows
            ("on" or "auto": yes, the least the stage can need).

    Raises:
        PlanError: an unknown codec.
    """
    m = config.microbatches if microbatches is None else microbatches
    samples = math.ceil(config.batch_size / config.microbatches)
    rc = config.recompute != "off" if recompute is None else recompute
    flight = in_flight(config.schedule, stage, n_stages, m,
                       steps_in_flight(config.schedule, config.max_staleness))
    stash = activation_memory_bytes(profile, start, end, config, samples, flight, rc)
    params = sum(layer.parameter_bytes for layer in profile.layers[start:end])
    scratch = config.step_scratch * params
    # a synchronous step's optimizer runs once its backward passes have freed the stash
    live = stash + scratch if config.schedule == "async" else max(stash, scratch)
    return (state_bytes(profile, start, end, config, snapshots_on_disk) + live
            + stashed_weight_copies(config, flight) * params
            + codec_buffer_bytes(profile, start, end, samples, m, codecs, config.precision))


def host_memory_shares(nodes: Sequence[NodeSpec]) -> dict[str, int]:
    """Per node id, the memory its stages may use, bytes: its own ``memory_bytes``, but
    no more than an equal share of its host's ``host_memory`` among the nodes of that
    host in ``nodes``, so that nodes on one machine never together plan more than
    it has (as they share its cores, :func:`host_factors`). Nodes without a host or
    with ``host_memory`` 0 keep their ``memory_bytes``. Nodes of one host that probed
    it at different times may advertise different figures: the largest is taken."""
    count: dict[str, int] = {}
    most: dict[str, int] = {}
    for n in nodes:
        if n.host and n.host_memory > 0:
            count[n.host] = count.get(n.host, 0) + 1
            most[n.host] = max(most.get(n.host, 0), n.host_memory)
    return {n.node_id: (min(n.memory_bytes, most[n.host] // count[n.host])
                        if n.host and n.host_memory > 0 else n.memory_bytes) for n in nodes}


def boundary_bytes(profile: ModelProfile, end: int, samples: float,
                   precision: str = "fp32") -> float:
    """Bytes of the tensor that crosses from layer ``end - 1`` to layer ``end``
    for ``samples`` samples under ``precision`` (the gradient going back has the same
    size): a "bf16-mixed" stage sends its autocast output as it is, bfloat16
    (:func:`activation_scale`, as its memory is priced)."""
    return profile.layers[end - 1].activation_bytes * samples * activation_scale(profile,
                                                                                 precision)


def boundary_element_bytes(profile: ModelProfile, precision: str) -> int:
    """Bytes of one element of a boundary tensor under ``precision`` (a codec's size model
    counts in elements: int8 halves a bfloat16 tensor, not quarters it): 2 under
    "bf16-mixed", else as profiled."""
    return min(profile.element_bytes, 2) if precision == "bf16-mixed" else profile.element_bytes


def boundary_width(profile: ModelProfile, end: int) -> int:
    """The row width (last dimension) of the tensor that crosses from layer ``end - 1`` to
    layer ``end``; 0 when the profile does not say."""
    return profile.layers[end - 1].activation_width


def transfer_seconds(link: Link, nbytes: float, codec: str,
                     element_bytes: int = 4, message: float = 0.0,
                     encoder: tuple[CodecSpeed, ...] = (),
                     decoder: tuple[CodecSpeed, ...] = (), width: int = 0,
                     messages_per_step: int = 0) -> tuple[float, float]:
    """``(busy, latency)`` of sending an ``nbytes``-byte tensor over ``link``.

    ``width`` (the tensor's row width, :func:`boundary_width`) and ``messages_per_step``
    (the microbatches per step, for activations; 0 for gradients) price a lowrank
    codec's coefficients and the basis it sends once per refresh period
    (:meth:`~fedpipe.planner.codecs.CodecCost.wire_bytes`).

    ``busy`` is how long the link is occupied: encode + wire bytes / bandwidth
    + decode, plus ``message``, the runtime's fixed cost per message
    (:attr:`~fedpipe.planner.types.Overheads.message`), seconds; the tensor
    arrives ``latency`` seconds after that. The encode and decode are priced by
    the sending node's measured costs ``encoder`` and the receiving node's
    ``decoder`` (:attr:`~fedpipe.planner.types.NodeSpec.codec_speeds`) where they
    price ``codec``, else by the table (:meth:`~fedpipe.planner.codecs.CodecCost.seconds`).

    Raises:
        PlanError: unknown codec.
    """
    c = codec_cost(codec)
    return (c.seconds(nbytes, encoder, decoder)
            + c.wire_bytes(nbytes, element_bytes, width, messages_per_step) / link.bandwidth
            + message, link.latency)


class ChainStage(Protocol):
    """One stage of a replica group's chain, as a plan (or a plan message) gives it."""

    @property
    def node_id(self) -> str: ...

    @property
    def layer_start(self) -> int: ...

    @property
    def layer_end(self) -> int: ...

    @property
    def activation_codec(self) -> str: ...

    @property
    def gradient_codec(self) -> str: ...

    @property
    def recompute(self) -> bool: ...


@dataclass(frozen=True)
class ChainCosts:
    """One replica group's pipeline priced per microbatch, seconds: per stage its forward
    and backward pass; per link ``i -> i+1`` the activation's busy time and latency, and
    the same for the gradient sent back from ``i+1`` to ``i``."""

    forward: list[float]
    backward: list[float]
    act_busy: list[float]
    act_latency: list[float]
    grad_busy: list[float]
    grad_latency: list[float]

    def step_seconds(self, microbatches: int, schedule: str, max_staleness: int = 0) -> float:
        """The analytic step (:func:`~.steptime.step_estimate` of
        :func:`~.steptime.pipeline_estimate`; under "async" with its steps overlapped as
        ``max_staleness`` allows)."""
        act_total = [b + lat for b, lat in zip(self.act_busy, self.act_latency)]
        grad_total = [b + lat for b, lat in zip(self.grad_busy, self.grad_latency)]
        overlap = steps_in_flight(schedule, max_staleness)
        sigma, period = pipeline_estimate(self.forward, self.backward, self.act_busy, act_total,
                                          self.grad_busy, grad_total, microbatches, schedule,
                                          overlap)
        return step_estimate(sigma, period, microbatches, len(self.forward), overlap)


def chain_costs(profile: ModelProfile, chain: Sequence[ChainStage], samples: float,
                passes: Callable[[ChainStage], tuple[float, float]],
                link: Callable[[str, str], Link], message: float = 0.0,
                speeds: Mapping[str, tuple[CodecSpeed, ...]] | None = None,
                microbatches: int = 1, precision: str = "fp32") -> ChainCosts:
    """Price one replica group's chain of stages for microbatches of ``samples`` samples:
    the one place a step time's parts are predicted (the simulator replays them, the
    analytic estimate and the tracker's rebalancing bound them).

    Args:
        passes: ``(forward, backward)`` seconds of one microbatch through a stage (e.g.
            :func:`pass_seconds` at the node's speed).
        link: the link from one node id to another.
        message: the runtime's fixed cost per message, seconds (:func:`transfer_seconds`).
        speeds: per node id, its measured codec costs
            (:attr:`~fedpipe.planner.types.NodeSpec.codec_speeds`; None or a node absent:
            the table's).
        microbatches: the group's microbatches per step (the activations' messages a
            lowrank basis is amortised over, :func:`transfer_seconds`).
        precision: the job's (:func:`boundary_bytes`: the bytes each boundary sends).

    Raises:
        PlanError: a stage names an unknown codec.
    """
    speeds = speeds or {}
    eb = boundary_element_bytes(profile, precision)
    out = ChainCosts([], [], [], [], [], [])
    for i, s in enumerate(chain):
        f, b = passes(s)
        out.forward.append(f)
        out.backward.append(b)
        if i + 1 < len(chain):
            nxt = chain[i + 1]
            nbytes = boundary_bytes(profile, s.layer_end, samples, precision)
            width = boundary_width(profile, s.layer_end)
            ends = speeds.get(s.node_id, ()), speeds.get(nxt.node_id, ())
            busy, lat = transfer_seconds(link(s.node_id, nxt.node_id), nbytes,
                                         s.activation_codec or "raw", eb,
                                         message, *ends, width=width,
                                         messages_per_step=microbatches)
            out.act_busy.append(busy)
            out.act_latency.append(lat)
            busy, lat = transfer_seconds(link(nxt.node_id, s.node_id), nbytes,
                                         nxt.gradient_codec or "raw", eb,
                                         message, ends[1], ends[0], width=width)
            out.grad_busy.append(busy)
            out.grad_latency.append(lat)
    return out


def ring_allreduce_seconds(nbytes: float, bandwidths: Sequence[float],
                           latencies: Sequence[float]) -> float:
    """Ring all-reduce of ``nbytes`` bytes among ``R = len(bandwidths)`` replicas, seconds.

    ``2 (R-1)/R × nbytes / min(bandwidths) + 2 (R-1) × max(latencies)``: the
    reduce-scatter and all-gather phases each take ``R - 1`` steps that move
    ``nbytes / R`` over every ring link at once (Patarasuk and Yuan, "Bandwidth
    optimal all-reduce algorithms for clusters of workstations", JPDC 2009).
    ``bandwidths[r]`` and ``latencies[r]`` are those of the ring's r-th link
    (bytes/s, seconds). Zero for one replica.
    """
    r = len(bandwidths)
    if r <= 1:
        return 0.0
    return 2 * (r - 1) / r * nbytes / min(bandwidths) + 2 * (r - 1) * max(latencies)


@dataclass(frozen=True)
class SyncSegment:
    """Layers ``[start, end)`` held by the same node in every replica group.

    Attributes:
        holders: the node holding the segment in each group, in group order
            (the all-reduce ring's order).
        nbytes: gradient bytes to all-reduce (the segment's parameter bytes).
        seconds: ring all-reduce time, seconds.
    """

    holders: tuple[Hashable, ...]
    start: int
    end: int
    nbytes: float
    seconds: float


NodeT = TypeVar("NodeT", bound=Hashable)
"""How a caller names nodes (an id, an index): ``link`` takes what ``groups`` holds."""


def sync_segments(groups: Sequence[Sequence[tuple[NodeT, int, int]]], profile: ModelProfile,
                  link: Callable[[NodeT, NodeT], tuple[float, float]]) -> list[SyncSegment]:
    """The all-reduces that synchronise the replica groups after each step.

    Groups may split the layers differently, so the layers are cut at every
    group's stage boundaries; each piece is all-reduced over a ring of its
    holders (:func:`ring_allreduce_seconds`).

    Args:
        groups: per group, its stages as ``(node, layer_start, layer_end)``.
        link: ``link(a, b)`` gives ``(bandwidth bytes/s, latency s)`` from a to b.

    Returns:
        The segments in layer order; empty for fewer than two groups.
    """
    if len(groups) < 2:
        return []
    cuts = sorted({s for g in groups for _, s, _ in g} | {e for g in groups for _, _, e in g})
    out = []
    pos = [0] * len(groups)
    for start, end in zip(cuts, cuts[1:]):
        holders = []
        for gi, g in enumerate(groups):
            while g[pos[gi]][2] <= start:
                pos[gi] += 1
            holders.append(g[pos[gi]][0])
        nbytes = float(sum(layer.parameter_bytes for layer in profile.layers[start:end]))
        ring = [link(a, b) for a, b in zip(holders, holders[1:] + holders[:1])]
        seconds = ring_allreduce_seconds(nbytes, [bw for bw, _ in ring], [lat for _, lat in ring])
        out.append(SyncSegment(tuple(holders), start, end, nbytes, seconds))
    return out


def schedule_sync(segments: Sequence[SyncSegment], ready: dict[Hashable, float]) -> float:
    """When the last all-reduce ends, seconds from the start of the step.

    A segment's all-reduce starts once every holder has finished its last
    backward pass (``ready[node]``, seconds) and is done with its earlier
    all-reduces: a node takes part in one ring at a time. Segments are served in
    the order they become ready (list scheduling). 0 when there is none.
    """
    free: dict[Hashable, float] = {}
    end_all = 0.0
    order = sorted(segments, key=lambda s: (max(ready[h] for h in s.holders), s.start))
    for seg in order:
        start = max(max(ready[h] for h in seg.holders),
                    max(free.get(h, 0.0) for h in seg.holders))
        end = start + seg.seconds
        for h in seg.holders:
            free[h] = end
        end_all = max(end_all, end)
    return end_all


def sync_per_step(slowest: float, sync_end: float, config: TrainConfig) -> float:
    """What syncing the groups adds to a step, seconds: the sync's end
    (:func:`schedule_sync`) past the slowest group's ``slowest``, paid once
    every ``config.sync_every`` steps (H under DiLoCo)."""
    return max(0.0, sync_end - slowest) / config.sync_every
