"""Precomputed arrays for planning one job on one cluster (numpy, no I/O).

Indices, not ids: node ``i`` is ``cluster.nodes[i]``; ``bw[i, j]`` and
``lat[i, j]`` describe the link from node i to node j (bytes/s, seconds).
Layer matrices are indexed ``[k, j]`` for a stage holding layers ``[k, j)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from ..spec.cuts import cuts_problem, stage_ranges
from ..wire.codecmodel import CodecSpeed
from . import codecs
from .costs import (RECOMPUTE_FACTOR, StageCodecs, activation_scale, boundary_bytes,
                    boundary_element_bytes, boundary_width, codec_buffer_bytes,
                    host_memory_shares, input_bytes, kept_activation_bytes, precision_flops,
                    state_bytes, stash_bytes, stashed_weight_copies, transfer_seconds)
from .steptime import steps_in_flight
from .types import ClusterView, Link, ModelProfile, PlanError, TrainConfig


def link_arrays(cluster: ClusterView) -> tuple[np.ndarray, np.ndarray]:
    """``(bandwidth, latency)`` matrices of the cluster's directed links, bytes/s and seconds.

    Resolves each pair as :meth:`ClusterView.link` does (explicit link, else
    the sites' link, else the default; twice in series, so twice the latency, through
    an outbound-only end's relay) without calling it n² times.
    """
    n = len(cluster.nodes)
    bw = np.full((n, n), float(cluster.default_link.bandwidth))
    lat = np.full((n, n), float(cluster.default_link.latency))
    if cluster.site_links:
        sites = np.array([node.site for node in cluster.nodes], dtype=object)
        rows = {s: np.flatnonzero(sites == s) for s in set(sites.tolist()) if s}
        for (sa, sb), lk in cluster.site_links.items():
            if sa in rows and sb in rows:
                idx = np.ix_(rows[sa], rows[sb])
                bw[idx], lat[idx] = lk.bandwidth, lk.latency
    relayed = np.array([bool(node.relay) for node in cluster.nodes])
    lat[relayed[:, None] | relayed[None, :]] *= 2  # Link.then of a leg with itself
    index = {node.node_id: i for i, node in enumerate(cluster.nodes)}
    for (a, b), lk in cluster.links.items():
        if a in index and b in index:
            bw[index[a], index[b]], lat[index[a], index[b]] = lk.bandwidth, lk.latency
    return bw, lat


@dataclass(frozen=True)
class LinkCosts:
    """Per-microbatch link costs of a stage boundary, indexed by the boundary layer ``j``
    (the tensor leaving layer ``j - 1``); ``inf`` where no tensor crosses (j = 0, j = L).

    Each uses the codec that keeps the link busy the shortest time.

    Attributes:
        act_busy, act_total: activation p -> q: seconds the link is busy, and
            busy + latency.
        grad_busy, grad_total: the gradient q -> p, likewise.
    """

    act_busy: np.ndarray
    act_total: np.ndarray
    grad_busy: np.ndarray
    grad_total: np.ndarray


SPEED_STEP = 0.5
"""Codec costs within a factor of 2**SPEED_STEP (1.41) of each other are one kind: links
between nodes of one kind share their costs (:meth:`PlanContext.link_costs`), as they did
before each node measured its own, so a swarm of like machines does not price every pair
apart."""


def speed_kind(speeds: tuple[CodecSpeed, ...]) -> tuple[Hashable, ...]:
    """``speeds`` as a kind: each figure's log2 in steps of :data:`SPEED_STEP` (None for 0)."""
    return tuple((s.codec, *(round(math.log2(f) / SPEED_STEP) if f > 0 else None
                             for f in (s.encode_fixed, s.encode_per_byte, s.decode_fixed,
                                       s.decode_per_byte))) for s in speeds)


class PlanContext:
    """Everything the search needs about one (cluster, profile, config), precomputed.

    Raises:
        PlanError: no node, no layer, a bad batch size / microbatch count /
            schedule / codec, ``config.stages`` larger than the layers, or bad
            ``config.cuts``.
    """

    def __init__(self, cluster: ClusterView, profile: ModelProfile, config: TrainConfig):
        validate(cluster, profile, config)
        self.cluster, self.profile, self.config = cluster, profile, config
        self.ids = [node.node_id for node in cluster.nodes]
        self.n = len(self.ids)
        self.flops = np.array([float(precision_flops(node, config.precision))
                               for node in cluster.nodes])
        shares = host_memory_shares(cluster.nodes)   # nodes of one host share its memory
        self.mem = np.array([float(shares[node.node_id]) for node in cluster.nodes])
        self.bw, self.lat = link_arrays(cluster)
        self.L = L = len(profile.layers)
        self.M = config.microbatches
        self.overlap = steps_in_flight(config.schedule, config.max_staleness)
        self.mb = config.batch_size / config.microbatches
        # every group's layer ranges when the config pins its cuts, else None (the search
        # splits each chain)
        self.pinned = stage_ranges(config.cuts, L) if config.cuts else None
        self.act_codecs, self.grad_codecs = codecs.candidates(config)
        stash_samples = math.ceil(self.mb)
        # the codecs whose buffers cost a stage most, of those its links may get: the
        # memory checks hold whichever the search picks
        self.buffer_codecs = worst = StageCodecs(*(costliest_buffer(c) for c in (
            self.act_codecs, self.grad_codecs, self.act_codecs, self.grad_codecs)))
        inf = math.inf
        self.work = np.full((L + 1, L + 1), inf)    # FLOP per microbatch of layers [k, j)
        # bytes held whatever the microbatches in flight: weights, grads, optimizer state,
        # snapshots, and the codecs' buffers under the costliest codecs allowed
        self.state = np.full((L + 1, L + 1), inf)
        # the same on a node that keeps its snapshots on disk (none in memory)
        self.disk_state = np.full((L + 1, L + 1), inf)
        self.disk = np.array([bool(node.snapshots_on_disk) for node in cluster.nodes])
        self.stash = np.full((L + 1, L + 1), inf)   # activations stashed per microbatch, bytes
        # the optimizer's scratch during its step, bytes: once the stash is freed, so a
        # stage fits when state + max(stash × in flight, scratch) does (under "async" the
        # step overlaps the stash: the scratch is in ``state``)
        self.scratch = np.zeros((L + 1, L + 1))
        copies = stashed_weight_copies(config, self.overlap * self.M)
        prefix = np.concatenate([[0.0], np.cumsum([layer.flops for layer in profile.layers])])
        for k in range(L):
            for j in range(k + 1, L + 1):
                self.work[k, j] = (prefix[j] - prefix[k]) * self.mb
                buffers = codec_buffer_bytes(profile, k, j, stash_samples,
                                             config.microbatches, worst, config.precision)
                self.state[k, j] = state_bytes(profile, k, j, config) + buffers
                self.disk_state[k, j] = state_bytes(profile, k, j, config, True) + buffers
                self.stash[k, j] = stash_bytes(profile, k, j, stash_samples)
                params = sum(layer.parameter_bytes for layer in profile.layers[k:j])
                scratch = config.step_scratch * params
                if config.schedule == "async":
                    # the scratch, and the stashed weights: as many as any stage may keep
                    kept = scratch + copies * params
                    self.state[k, j] += kept
                    self.disk_state[k, j] += kept
                else:
                    self.scratch[k, j] = scratch
        # a stage's input per microbatch, bytes (by its first layer k); activations' bytes
        # under the config's precision over as profiled
        self.inputs = np.array([input_bytes(profile, k, stash_samples) if k < L else 0.0
                                for k in range(L + 1)])
        self.scale = activation_scale(profile, config.precision)
        self.boundary = np.zeros(L + 1)             # bytes crossing after layer j - 1
        for j in range(1, L):
            self.boundary[j] = boundary_bytes(profile, j, self.mb, config.precision)
        self.speeds = [node.codec_speeds for node in cluster.nodes]
        kinds: dict[tuple[Hashable, ...], int] = {}
        self.speed_kind = [kinds.setdefault(speed_kind(sp), len(kinds)) for sp in self.speeds]
        self._links: dict[tuple[float, float, float, float, int, int], LinkCosts] = {}

    def state_on(self, node: int) -> np.ndarray:
        """:attr:`state` as held on ``node``: without snapshots in memory on a node that
        keeps them on disk."""
        state: np.ndarray = self.disk_state if self.disk[node] else self.state
        return state

    def link_costs(self, p: int, q: int) -> LinkCosts:
        """Costs of the boundary between node ``p`` (earlier stage) and node ``q`` (next stage)."""
        key = (self.bw[p, q], self.lat[p, q], self.bw[q, p], self.lat[q, p],
               self.speed_kind[p], self.speed_kind[q])
        found = self._links.get(key)
        if found is None:
            fwd, bwd = Link(self.bw[p, q], self.lat[p, q]), Link(self.bw[q, p], self.lat[q, p])
            arrays = [np.full(self.L + 1, math.inf) for _ in range(4)]
            eb = boundary_element_bytes(self.profile, self.config.precision)
            for j in range(1, self.L):
                x = self.boundary[j]
                sends = ((fwd, self.act_codecs, self.speeds[p], self.speeds[q]),
                         (bwd, self.grad_codecs, self.speeds[q], self.speeds[p]))
                for out, (lk, specs, enc, dec) in zip((0, 2), sends):
                    busy, lat = min(transfer_seconds(lk, x, c, eb, 0.0, enc, dec,
                                                     boundary_width(self.profile, j),
                                                     self.M if out == 0 else 0)
                                    for c in specs)
                    arrays[out][j], arrays[out + 1][j] = busy, busy + lat
            found = self._links[key] = LinkCosts(*arrays)
        return found

    def kept(self, in_flight: np.ndarray | int, recompute: bool) -> np.ndarray:
        """Activation bytes a stage of layers ``[k, j)`` keeps at its peak with ``in_flight``
        microbatches in flight (a number, or a vector over j), as a matrix over ``[k, j]``
        (:func:`~fedpipe.planner.costs.kept_activation_bytes`)."""
        kept: np.ndarray = kept_activation_bytes(self.stash, self.inputs[:, None], in_flight,
                                                 recompute, self.scale)
        return kept

    def memory_fit(self, node: int, in_flight: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """``(fits, work factor)`` of a stage of layers ``[k, j)`` on ``node`` with
        ``in_flight`` microbatches in flight, as matrices over ``[k, j]``: whether its
        memory fits, recomputing where the config's ``recompute`` allows it, and its work
        over its work without recomputation (:data:`~fedpipe.planner.costs.RECOMPUTE_FACTOR`
        where it recomputes: always under "on", under "auto" where it would not fit
        otherwise)."""
        mode, mem, state = self.config.recompute, self.mem[node], self.state_on(node)
        plain = state + np.maximum(self.kept(in_flight, False), self.scratch) <= mem
        if mode == "off":
            return plain, np.ones_like(self.work)
        recomputing = state + np.maximum(self.kept(in_flight, True), self.scratch) <= mem
        if mode == "on":
            return recomputing, np.full_like(self.work, RECOMPUTE_FACTOR)
        return plain | recomputing, np.where(plain, 1.0, RECOMPUTE_FACTOR)

    def recomputes(self, node: int, k: int, j: int, in_flight: int) -> bool:
        """Whether the stage of layers ``[k, j)`` on ``node`` recomputes with ``in_flight``
        microbatches in flight: under "auto", when it would not fit otherwise."""
        mode = self.config.recompute
        if mode != "auto":
            return mode == "on"
        need = self.state_on(node)[k, j] + max(self.scale * self.stash[k, j] * in_flight,
                                      self.scratch[k, j])
        return bool(need > self.mem[node])

    def room(self, node: int, k: int, j: int) -> float:
        """The most microbatches the stage of layers ``[k, j)`` on ``node`` can keep in
        flight (recomputing if the config allows it); 0 when even one does not fit,
        ``inf`` when a microbatch keeps nothing."""
        free = self.mem[node] - self.state_on(node)[k, j]
        stash, inputs = self.scale * self.stash[k, j], self.scale * self.inputs[k]
        if free < self.scratch[k, j] or (stash > free and self.config.recompute == "off"):
            return 0.0
        plain = free // stash if stash > 0 else math.inf
        if self.config.recompute == "off":
            return float(plain)
        if stash > free:
            return 0.0
        recomputing = (free - stash) // inputs + 1 if inputs > 0 else math.inf
        return float(recomputing if self.config.recompute == "on"
                     else max(plain, recomputing))

    def hop_cost(self) -> np.ndarray:
        """Symmetric matrix of raw round-trip seconds of a typical boundary tensor
        between two nodes (there and back, latency included): the weight the
        stage-ordering and grouping heuristics minimise."""
        inner = self.boundary[1:self.L]
        x = float(np.median(inner)) if inner.size else float(self.profile.input_bytes * self.mb)
        one_way = x / self.bw + self.lat
        both: np.ndarray = one_way + one_way.T
        return both


def costliest_buffer(specs: tuple[str, ...]) -> str:
    """Of the codecs ``specs`` a link may get, the one whose buffers a stage pays most
    for (:func:`~fedpipe.planner.costs.codec_buffer_bytes`: wire bytes, and a residual
    per microbatch when lossy): the memory checks hold whichever the search picks."""
    return max(specs, key=lambda c: (codecs.codec_cost(c).lossy,
                                     codecs.codec_cost(c).buffer_bytes(1.0)))


def validate(cluster: ClusterView, profile: ModelProfile, config: TrainConfig) -> None:
    """Check the inputs make a planning problem.

    Raises:
        PlanError: the first problem found, with the numbers.
    """
    if not cluster.nodes:
        raise PlanError("no node is available")
    if not profile.layers:
        raise PlanError("the model has no layers")
    if config.batch_size < 1 or config.microbatches < 1:
        raise PlanError(f"batch size and microbatches must be >= 1, got "
                        f"{config.batch_size} and {config.microbatches}")
    if config.microbatches > config.batch_size:
        raise PlanError(f"{config.microbatches} microbatches do not fit a batch of "
                        f"{config.batch_size} samples")
    if config.recompute not in ("off", "on", "auto"):
        raise PlanError(f"recompute must be 'off', 'on' or 'auto', got {config.recompute!r}")
    if config.precision not in ("fp32", "bf16-mixed"):
        raise PlanError(f"precision must be 'fp32' or 'bf16-mixed', got {config.precision!r}")
    if config.schedule not in ("gpipe", "1f1b", "async"):
        raise PlanError(f"unknown schedule {config.schedule!r}; "
                        f"the planner knows 'gpipe', '1f1b' and 'async'")
    if not isinstance(config.max_staleness, int) or config.max_staleness < 0:
        raise PlanError(f"max_staleness must be an integer >= 0, got {config.max_staleness!r}")
    _check_depth(cluster, profile, config)
    if config.replicas < 0 or config.replicas > min(config.microbatches, len(cluster.nodes)):
        raise PlanError(f"{config.replicas} replica groups asked for, but there are "
                        f"{len(cluster.nodes)} node(s) and {config.microbatches} microbatches")
    for node in cluster.nodes:
        if not node.flops > 0:
            raise PlanError(f"node {node.node_id!r} has speed {node.flops} FLOP/s; it must be > 0")
    codecs.candidates(config)


def _check_depth(cluster: ClusterView, profile: ModelProfile, config: TrainConfig) -> None:
    """Check ``config.stages`` against the nodes and layers, and ``config.cuts``
    (:func:`~fedpipe.spec.cuts.cuts_problem`).

    Raises:
        PlanError: the first problem, with the numbers.
    """
    if config.stages < 0 or config.stages > min(len(cluster.nodes), len(profile.layers)):
        raise PlanError(f"{config.stages} stages asked for, but there are {len(cluster.nodes)} "
                        f"node(s) and {len(profile.layers)} layer(s)")
    cuts = cuts_problem(config.cuts, config.stages, len(profile.layers))
    if cuts is not None:
        raise PlanError(f"cuts: {cuts}")
