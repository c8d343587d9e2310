"""Brute force over fedpipe's plan space, for small clusters (benchmarks and tests).

The plan space: any set of disjoint replica groups, each an ordered chain of
nodes (any subset, any order, unused nodes allowed), each chain's layers split
by the dynamic program (:func:`~fedpipe.planner.partition.solve_chain`, every
node of the chain used), microbatches shared by
:func:`~fedpipe.planner.evaluate.allocate_microbatches`, codecs by
:func:`~fedpipe.planner.evaluate.choose_codecs`, step time by the simulator.

Enumerating every chain of every group of every grouping and simulating each
is too slow even for 8 nodes (≈ 840,000 groupings), so:

1. every ordered chain (109,600 for 8 nodes; fewer when nodes are twins,
   :func:`twins`) gets its least bottleneck from one min-max dynamic program
   whose rows are shared by chains with the same suffix;
2. per node subset, among its ``described`` orders with the least
   bottleneck, those whose min-max split gives the subset its least estimated
   group time for some microbatch count, and the ``orders_per_subset`` with
   the least bottleneck, are split again by the full program; every split
   that is best for some microbatch count is kept;
3. every set partition of every node subset into groups (Bell(N+1) = 21,147
   for 8 nodes), with every combination of the kept chains and, for up to
   :data:`MAX_RING_ORDERS` groups whose all-reduce shows, every ring order,
   is scored by the analytic estimate (groups and all-reduce), skipping those
   whose slowest group alone cannot make the ``top_k``;
4. the ``top_k`` best are split again for their microbatch shares, planned and
   simulated; the ``polished`` fastest are polished on the simulator
   (:func:`~fedpipe.planner.evaluate.polish`, as fedpipe's plan is) and the
   fastest is returned.

So the answer is exhaustive over groupings and node subsets, and over orders
up to step 2's pruning and step 4's analytic ranking.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Iterator, Sequence

import numpy as np

from .context import PlanContext
from .evaluate import Evaluator, Split, allocate_microbatches, build_plan, polish
from .partition import GroupSolution, stage_costs, describe
from .types import ClusterView, ModelProfile, Plan, PlanError, TrainConfig

ChainSplit = tuple[float, tuple[int, ...], list[tuple[int, int, int]]]
"""A chain's least bottleneck (seconds per microbatch), its nodes in order, and its
stages as ``(position, layer_start, layer_end)``."""

MAX_NODES = 8
MAX_RING_ORDERS = 4
"""Groupings of up to this many groups are scored in every ring order."""


def _chains_minmax(ctx: PlanContext
                   ) -> dict[frozenset[int], list[ChainSplit]]:
    """Every ordered chain's least bottleneck (seconds per microbatch) and the
    split that gives it (``(position, layer_start, layer_end)`` per stage),
    grouped by node set.

    Depth-first over suffixes: the row of a suffix (least bottleneck of
    layers [k, L) on it) is computed once from the row of the suffix without
    its first node. Memory uses the job's full microbatch count.
    """
    n, L, M = ctx.n, ctx.L, ctx.M
    gpipe = ctx.config.schedule == "gpipe"
    mats: dict[tuple[int, int, int], np.ndarray] = {}

    def matrix(v: int, u: int, length: int) -> np.ndarray:
        key = (v, u, length)
        if key not in mats:
            infl = M if gpipe else min(M, length)
            memok, factor = ctx.memory_fit(v, infl)
            mats[key] = stage_costs(ctx, v, None if u < 0 else u, memok, factor)[0]
        return mats[key]

    twin = twins(ctx)
    out: dict[frozenset[int], list[ChainSplit]] = {}
    max_len = min(n, L) if not ctx.config.stages else ctx.config.stages
    rows = np.arange(L + 1)

    def visit(suffix: tuple[int, ...], row: np.ndarray, arg: list[np.ndarray]) -> None:
        if math.isfinite(row[0]) and (not ctx.config.stages or len(suffix) == ctx.config.stages):
            stages: list[tuple[int, int, int]] = []
            k = 0
            for pos in range(len(suffix)):
                j = int(arg[pos][k]) if pos < len(suffix) - 1 else L
                stages.append((pos, k, j))
                k = j
            out.setdefault(frozenset(suffix), []).append((float(row[0]), suffix, stages))
        if len(suffix) == max_len:
            return
        for v in range(n):
            # twins are interchangeable: keep a class's members in increasing order
            if v in suffix or any(twin[u] == twin[v] and u < v for u in suffix):
                continue
            tot = np.maximum(matrix(v, suffix[0], len(suffix) + 1), row[None, :])
            j = tot.argmin(axis=1)
            new_row = tot[rows, j]
            if np.isfinite(new_row).any():
                visit((v, *suffix), new_row, [j, *arg])

    for v in range(n):
        visit((v,), matrix(v, -1, 1), [])
    return out


def twins(ctx: PlanContext) -> list[int]:
    """Per node, a class id: nodes of one class have the same speed and memory
    and the same links to every other node and to each other, so swapping them
    changes no cost."""
    bw, lat = ctx.bw, ctx.lat
    cls = list(range(ctx.n))
    for j in range(ctx.n):
        for i in range(j):
            if cls[i] != i:
                continue
            others = [x for x in range(ctx.n) if x not in (i, j)]
            if (ctx.flops[i] == ctx.flops[j] and ctx.mem[i] == ctx.mem[j]
                    and ctx.disk[i] == ctx.disk[j]
                    and bw[i, j] == bw[j, i] and lat[i, j] == lat[j, i]
                    and np.array_equal(bw[i, others], bw[j, others])
                    and np.array_equal(bw[others, i], bw[others, j])
                    and np.array_equal(lat[i, others], lat[j, others])
                    and np.array_equal(lat[others, i], lat[others, j])):
                cls[j] = i
                break
    return cls


def _set_partitions(items: Sequence[int]) -> Iterator[tuple[list[list[int]], list[int]]]:
    """Every way to put each item into one of several unordered blocks or leave
    it out: yields ``(blocks, left_out)``."""
    def rec(i: int, blocks: list[list[int]], out: list[int]
            ) -> Iterator[tuple[list[list[int]], list[int]]]:
        if i == len(items):
            if blocks:
                yield [list(b) for b in blocks], list(out)
            return
        x = items[i]
        for b in blocks:
            b.append(x)
            yield from rec(i + 1, blocks, out)
            b.pop()
        blocks.append([x])
        yield from rec(i + 1, blocks, out)
        blocks.pop()
        out.append(x)
        yield from rec(i + 1, blocks, out)
        out.pop()
    yield from rec(0, [], [])


def exhaustive_plan(cluster: ClusterView, profile: ModelProfile, config: TrainConfig,
                    top_k: int = 40, orders_per_subset: int = 4, described: int = 60,
                    polished: int = 3) -> Plan:
    """The best plan by brute force (see the module doc); for at most
    :data:`MAX_NODES` nodes.

    Raises:
        ValueError: more than :data:`MAX_NODES` nodes.
        PlanError: bad inputs, or nothing fits in memory.
    """
    if len(cluster.nodes) > MAX_NODES:
        raise ValueError(f"brute force takes at most {MAX_NODES} nodes, got {len(cluster.nodes)}")
    ctx = PlanContext(cluster, profile, config)
    ev = Evaluator(ctx, window=1, exact_up_to=0)
    kept = _kept_splits(ctx, ev, orders_per_subset, described)
    scored = _top_groupings(ctx, ev, kept, top_k)
    # 4: the best few, split again and simulated
    # (simulated step seconds, rank as a tie-break, splits, microbatches per group)
    plans: list[tuple[float, int, list[Split], tuple[int, ...]]] = []
    for _, grouping in scored[:top_k]:
        cand = ev.estimate(grouping, refine=True)
        if cand is not None:
            groups: list[Split] = [(s.nodes, s.ranges) for s in cand.solutions]
            plans.append((build_plan(ctx, groups, cand.microbatches).predicted_step_seconds,
                          len(plans), groups, cand.microbatches))
    plans.sort()
    return min((polish(ctx, groups, micro) for _, _, groups, micro in plans[:polished]),
               key=lambda p: p.predicted_step_seconds)


def _kept_splits(ctx: PlanContext, ev: Evaluator, orders_per_subset: int, described: int
                 ) -> dict[frozenset[int], list[GroupSolution]]:
    """Steps 1-2: per node subset, the orders whose min-max split is best for some
    microbatch count or whose bottleneck is among the least, split again by the
    full program; kept: every split that is best for some count. With pinned cuts
    (:attr:`PlanContext.pinned`) every order of the pinned depth, at the cuts."""
    M = ctx.M
    kept: dict[frozenset[int], list[GroupSolution]] = {}
    if ctx.pinned is not None:  # pinned cuts fix every split: each ordered chain, priced
        found: dict[frozenset[int], list[GroupSolution]] = {}
        for chain in itertools.permutations(range(ctx.n), len(ctx.pinned)):
            sol = ev.solve(chain, M)
            if sol is not None:
                found.setdefault(frozenset(chain), []).append(sol)
        for key, sols in found.items():
            best = {id(min(sols, key=lambda s: s.seconds(m))) for m in range(1, M + 1)}
            kept[key] = [s for s in sols if id(s) in best]
        return kept
    for key, chains in _chains_minmax(ctx).items():
        first = [describe(ctx, chain, stages, M) for _, chain, stages in sorted(chains)[:described]]
        picks = {min(first, key=lambda s: s.seconds(m)).nodes for m in range(1, M + 1)}
        picks |= {chain for _, chain, _ in sorted(chains)[:orders_per_subset]}
        sols = first + [s for s in (ev.solve(c, M) for c in sorted(picks)) if s is not None]
        best = {id(min(sols, key=lambda s: s.seconds(m))) for m in range(1, M + 1)}
        kept[key] = [s for s in sols if id(s) in best]
    return kept


Grouping = tuple[tuple[int, ...], ...]
"""Replica groups as their chains of node indices."""


def _top_groupings(ctx: PlanContext, ev: Evaluator, kept: dict[frozenset[int], list[GroupSolution]],
                   top_k: int) -> list[tuple[float, Grouping]]:
    """Step 3: every grouping, scored analytically; the ``top_k`` best as ``(score,
    grouping)``, best first. A grouping whose slowest group alone cannot make the
    top_k is skipped, and ring orders are tried only when the all-reduce shows.

    Raises:
        PlanError: no grouping fits the nodes' memory.
    """
    M = ctx.M
    top: list[tuple[float, int, Grouping]] = []  # a max-heap of the negated scores
    counter = itertools.count()

    def offer(score: float, chains: Grouping) -> None:
        item = (-score, next(counter), chains)
        if len(top) < top_k:
            heapq.heappush(top, item)
        elif score < -top[0][0]:
            heapq.heapreplace(top, item)

    for blocks, _ in _set_partitions(list(range(ctx.n))):
        if len(blocks) > M or ctx.config.replicas not in (0, len(blocks)) \
                or any(not kept.get(frozenset(b)) for b in blocks):
            continue
        for combo in itertools.product(*(kept[frozenset(b)] for b in blocks)):
            micro = allocate_microbatches(combo, M)
            if micro is None:
                continue
            floor = max(s.seconds(m) for s, m in zip(combo, micro))
            if len(top) == top_k and floor >= -top[0][0]:
                continue
            score = ev.step_seconds(combo, micro)
            offer(score, tuple(s.nodes for s in combo))
            if (3 <= len(combo) <= MAX_RING_ORDERS and score > floor * (1 + 1e-9)
                    and (len(top) < top_k or score < 2 * -top[0][0])):
                # the group order is the all-reduce ring's: try every ring (first group fixed)
                for ring in list(itertools.permutations(range(1, len(combo))))[1:]:
                    sols = [combo[0]] + [combo[g] for g in ring]
                    offer(ev.step_seconds(sols, [micro[0]] + [micro[g] for g in ring]),
                          tuple(s.nodes for s in sols))
    if not top:
        raise PlanError("brute force: no grouping fits the nodes' memory")
    return sorted((-neg, chains) for neg, _, chains in top)
