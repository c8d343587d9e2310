"""Reference planners the benchmark compares fedpipe's plan with.

- :func:`naive_plan`: one pipeline over every node in registration order,
  equal layer counts, raw codecs.
- :func:`dtfm_plan`: DTFM-style, communication only (Yuan et al.,
  "Decentralized Training of Foundation Models in Heterogeneous
  Environments", NeurIPS 2022): every node used, groups of equal size from the
  same bandwidth-aware layouts fedpipe starts from, stages ordered along the
  bottleneck path, equal layer counts, equal microbatch shares; the group
  count and layout are chosen by communication cost alone (compute taken as
  free), as DTFM's scheduler does. Links get codecs by the same rule as fedpipe.

"Equal layer counts" respects memory: when the equal split does not fit, the
split with the smallest largest stage (in layers) that fits is used.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from .context import PlanContext
from .evaluate import Evaluator, Split, build_plan
from .grouping import contiguous_groups, strided_groups
from .ordering import bottleneck_path, locality_order
from .partition import GroupSolution, all_solved, describe, solve_chain
from .types import ClusterView, Link, ModelProfile, Plan, PlanError, TrainConfig


def equal_split(ctx: PlanContext, chain: Sequence[int], microbatches: int) -> GroupSolution | None:
    """Every node of ``chain`` gets ``L / len(chain)`` layers (the first ones one
    more when it does not divide); if that does not fit the nodes' memory, the
    memory-feasible split whose largest stage has the fewest layers. None when
    nothing fits."""
    n, L = len(chain), ctx.L
    if n == 0 or n > L:
        return None
    q, r = divmod(L, n)
    bounds = [0]
    for s in range(n):
        bounds.append(bounds[-1] + q + (s < r))
    sol = describe(ctx, chain, [(s, bounds[s], bounds[s + 1]) for s in range(n)], microbatches)
    if sol.max_microbatches >= microbatches:
        return sol
    blind = _layer_count_context(ctx, chain)
    counted = solve_chain(blind, range(n), microbatches, window=1)
    if counted is None:
        return None
    stages = [(s, k, j) for s, (k, j) in enumerate(counted.ranges)]
    return describe(ctx, chain, stages, microbatches)


def _layer_count_context(ctx: PlanContext, chain: Sequence[int]) -> PlanContext:
    """A context for ``chain`` in which every layer costs 1 FLOP, every node does
    1 FLOP/s and links are free: its split minimises the largest layer count."""
    nodes = [dataclasses.replace(ctx.cluster.nodes[i], flops=1.0) for i in chain]
    profile = ModelProfile([dataclasses.replace(la, flops=1.0) for la in ctx.profile.layers],
                           ctx.profile.input_bytes, ctx.profile.element_bytes)
    mb = ctx.config.batch_size / ctx.config.microbatches
    config = dataclasses.replace(ctx.config, compression="none", activation_compression=None,
                                 gradient_compression=None, stages=0, cuts=())
    blind = PlanContext(ClusterView(nodes, {}, Link(math.inf, 0.0)), profile, config)
    blind.work = blind.work / mb     # one unit per layer, whatever the microbatch size
    return blind


def naive_plan(cluster: ClusterView, profile: ModelProfile, config: TrainConfig) -> Plan:
    """One pipeline over the nodes in registration order (the first L if there
    are more nodes than layers), equal layer counts, raw codecs.

    Raises:
        PlanError: bad inputs, or the split does not fit the nodes' memory.
    """
    ctx = PlanContext(cluster, profile, config)
    chain = list(range(min(ctx.n, ctx.L)))
    sol = equal_split(ctx, chain, ctx.M)
    if sol is None:
        raise PlanError("naive plan: no equal-layer split of the model fits the nodes' memory")
    return build_plan(ctx, [(sol.nodes, sol.ranges)], [ctx.M], compression=False)


def dtfm_plan(cluster: ClusterView, profile: ModelProfile, config: TrainConfig) -> Plan:
    """The DTFM-style communication-only plan (see the module doc).

    Raises:
        PlanError: bad inputs, or no layout whose equal split fits in memory.
    """
    ctx = PlanContext(cluster, profile, config)
    comm = PlanContext(ClusterView([dataclasses.replace(n, flops=1e30) for n in cluster.nodes],
                                   cluster.links, cluster.default_link, cluster.site_links),
                       profile, config)
    hop = ctx.hop_cost()
    line = locality_order(hop, range(ctx.n), np.ones(ctx.n))
    best: tuple[float, list[Split], list[int]] | None = None
    for r in range(1, min(ctx.M, ctx.n) + 1):
        if ctx.n % r or ctx.n // r > ctx.L or config.replicas not in (0, r):
            continue
        micro = [ctx.M // r + (g < ctx.M % r) for g in range(r)]
        layouts = [contiguous_groups(line, np.ones(ctx.n), r)]
        if r > 1:
            layouts.append(strided_groups(line, r))
        for groups in layouts:
            chains = [bottleneck_path(hop, g) for g in groups]
            sols = all_solved([equal_split(ctx, c, m) for c, m in zip(chains, micro)])
            if sols is None:
                continue
            priced = [describe(comm, c, [(s, k, j) for s, (k, j) in enumerate(sol.ranges)], m)
                      for c, sol, m in zip(chains, sols, micro)]
            cost = Evaluator(comm).step_seconds(priced, micro)
            if best is None or cost < best[0]:
                best = (cost, [(s.nodes, s.ranges) for s in sols], micro)
    if best is None:
        raise PlanError(f"DTFM-style plan: no grouping of all {ctx.n} nodes into equal groups "
                        f"of at most {ctx.L} nodes (one per layer), at most {ctx.M} groups "
                        f"(one per microbatch), whose equal-layer split fits the nodes' memory")
    _, splits, micro = best
    return build_plan(ctx, splits, micro)


__all__ = ["dtfm_plan", "equal_split", "naive_plan"]
