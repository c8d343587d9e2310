"""Replica groups: how many, and which nodes go together.

Two initial layouts per group count R, both cut from the cluster's locality
order (:func:`~fedpipe.planner.ordering.locality_order`), in the spirit of
DTFM's balanced partition (Yuan et al., NeurIPS 2022):

- *contiguous*: R consecutive runs of the line with equal total FLOP/s, so a
  pipeline stays inside a site and only the once-per-step all-reduce crosses
  slow links;
- *strided*: node p of the line joins group p mod R, so each pipeline spans the
  sites, stage i of every group sits in one site, and the all-reduce stays
  local while activations cross the slow links.

The search then scores both for every R and refines the best.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .ordering import PerNode, bottleneck_path


def group_counts(n_nodes: int, microbatches: int, n_layers: int, stages: int = 0,
                 replicas: int = 0) -> list[int]:
    """Group counts worth trying: all up to 16, then a geometric ladder plus
    counts around ``n_nodes / n_layers`` (the fewest groups that use every
    node); only ``replicas`` when the job pins it."""
    top = min(microbatches, n_nodes if not stages else n_nodes // stages)
    if replicas:
        return [replicas] if replicas <= top else []
    if top <= 16:
        return list(range(1, top + 1))
    ladder = {1, 2, 3, 4, 6, 8, 12, 16, top}
    r = 16
    while r < top:
        ladder |= {r, int(r * 1.5)}
        r *= 2
    need = math.ceil(n_nodes / (stages or n_layers))
    ladder |= {need, math.ceil(need * 1.25), math.ceil(need * 1.5), 2 * need}
    return sorted(x for x in ladder if 1 <= x <= top)


def contiguous_groups(order: Sequence[int], flops: PerNode, r: int) -> list[list[int]]:
    """Cut ``order`` into ``r`` consecutive runs of about equal total FLOP/s (none empty)."""
    r = min(r, len(order))
    total = float(sum(flops[i] for i in order))
    groups: list[list[int]] = [[] for _ in range(r)]
    acc, prev = 0.0, -1
    for pos, node in enumerate(order):
        want = min(r - 1, int((acc + flops[node] / 2) / total * r))
        # never skip a group, and leave a node for every later one
        g = max(min(max(want, prev), prev + 1), r - (len(order) - pos))
        groups[g].append(node)
        acc += flops[node]
        prev = g
    return groups


def strided_groups(order: Sequence[int], r: int) -> list[list[int]]:
    """Deal ``order`` round robin into ``r`` groups."""
    return [list(order[g::r]) for g in range(r)]


def trim(group: Sequence[int], flops: PerNode, keep: int) -> tuple[list[int], list[int]]:
    """Keep the ``keep`` fastest nodes (in their order); returns ``(kept, dropped)``."""
    if len(group) <= keep:
        return list(group), []
    fastest = set(sorted(group, key=lambda i: (-flops[i], i))[:keep])
    return [i for i in group if i in fastest], [i for i in group if i not in fastest]


def site_subsets(line: Sequence[int], runs: Sequence[Sequence[int]],
                 flops: PerNode) -> list[list[int]]:
    """The locality ``line`` restricted to its 1, 2, 4, ... strongest sites (by
    total FLOP/s) and to all of them: a whole site may be better left out than
    joined by slow links."""
    ranked = sorted(runs, key=lambda r: -sum(flops[i] for i in r))
    ks = sorted({k for k in (1, 2, 4, 8, 16) if k < len(runs)} | {len(runs)})
    out = []
    for k in ks:
        keep = {i for r in ranked[:k] for i in r}
        out.append([i for i in line if i in keep])
    return out


def initial_groupings(lines: Sequence[Sequence[int]], flops: np.ndarray, hop: np.ndarray,
                      microbatches: int, n_layers: int, stages: int = 0, replicas: int = 0
                      ) -> list[tuple[tuple[int, ...], ...]]:
    """Starting points for the search: the chains of both layouts, for every
    line (a locality order or a part of one) and every count of
    :func:`group_counts`.

    Each group keeps at most ``n_layers`` nodes (exactly ``stages`` when the
    job pins the depth; a group with fewer is dropped), fastest first, and is
    ordered along its bottleneck path. With ``replicas`` pinned, only
    groupings with that many groups are returned.
    """
    out, seen = [], set()
    for line in lines:
        for r in group_counts(len(line), microbatches, n_layers, stages, replicas):
            layouts = [contiguous_groups(line, flops, r)]
            if r > 1:
                layouts.append(strided_groups(line, r))
            for groups in layouts:
                chains = []
                for g in groups:
                    kept, _ = trim(g, flops, stages or n_layers)
                    if not stages or len(kept) == stages:
                        chains.append(tuple(bottleneck_path(hop, kept)))
                key = tuple(sorted(chains))
                if chains and key not in seen and (not replicas or len(chains) == replicas):
                    seen.add(key)
                    out.append(tuple(chains))
    return out
