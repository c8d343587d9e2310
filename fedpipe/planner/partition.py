"""Layer partition for heterogeneous nodes: PipeDream's min-max dynamic program.

Source: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training" (SOSP 2019), section 3.1. Here each node has its own speed and memory
cap, so the cost of a stage depends on which node holds it; the program may
skip nodes of the chain (a node that would slow the pipeline gets no stage);
and it aims at the pipeline's step time rather than only its bottleneck:

    T(m) = sigma + (m - 1) · period

with ``sigma`` the fill-and-drain path (every stage's compute plus every
transfer, latency included, of one microbatch) and ``period`` the steady-state
seconds per microbatch (:func:`~fedpipe.planner.steptime.pipeline_estimate`).

A first pass (suffix dynamic program, one numpy row per chain position) finds
the least bottleneck τ*: the smallest possible largest per-stage cost
(:func:`stage_costs`). A second pass, for several thresholds τ ≥ τ* taken
from the achievable stage costs and several rewards λ per stage, finds the
split with every stage under τ that minimises ``sigma - λ·τ·stages``; each
split is priced by :func:`describe` and the least T(m) wins. With every
achievable τ and λ = 0 (``exact=True``) the second pass is exact for
``sigma + (m - 1) · bottleneck``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .context import PlanContext
from .costs import FORWARD_FRACTION, RECOMPUTE_FACTOR, stage_memory_bytes  # noqa: F401 (re-export)
from .steptime import in_flight, pipeline_estimate, step_estimate

THRESHOLDS = (10, 5)
"""How many thresholds the second pass tries (for chains of up to 10 nodes, and
longer ones): achievable stage costs between the least bottleneck τ* and
:data:`THRESHOLD_SPAN` × τ*, evenly spread by rank."""
THRESHOLD_SPAN = 3.0
STAGE_REWARDS = (0.0, 0.5, 1.0)
"""The second pass also minimises ``sigma - λ·τ·stages`` for these λ: splits over
more nodes, which shorten 1F1B's round-trip bound (see
:func:`~fedpipe.planner.steptime.pipeline_estimate`) at some cost in ``sigma``."""


@dataclass(frozen=True)
class GroupSolution:
    """One pipeline's split.

    Attributes:
        nodes: indices of the nodes that got a stage, in pipeline order.
        ranges: each stage's layers ``(start, end)``.
        sigma: fill-and-drain seconds of one microbatch (see module doc).
        bottleneck: the costliest stage's seconds per microbatch (what the
            min-max program minimises).
        period: steady-state seconds per microbatch
            (:func:`~fedpipe.planner.steptime.pipeline_estimate`).
        drain: per stage, seconds from its last backward pass to the end of the
            group's last one (the backward passes and gradient sends below it).
        max_microbatches: the most microbatches the split fits in memory (inf: any).
        positions: where the stages' nodes sit in the chain that was split.
        overlap: steps the schedule runs in the pipeline at once
            (:func:`~fedpipe.planner.steptime.steps_in_flight`).
    """

    nodes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    sigma: float
    bottleneck: float
    period: float
    drain: tuple[float, ...]
    max_microbatches: float
    positions: tuple[int, ...] = ()
    overlap: int = 1

    def seconds(self, microbatches: int) -> float:
        """Estimated seconds of one step of ``microbatches`` microbatches
        (:func:`~fedpipe.planner.steptime.step_estimate`)."""
        return step_estimate(self.sigma, self.period, microbatches, len(self.nodes),
                             self.overlap)


def all_solved(solutions: Sequence[GroupSolution | None]) -> list[GroupSolution] | None:
    """``solutions`` as a list when every group has a split, None when one has none."""
    found = [s for s in solutions if s is not None]
    return found if len(found) == len(solutions) else None


def _in_flight_bound(ctx: PlanContext, m: int, i: int, n: int) -> np.ndarray | int:
    """Microbatches stashed by a stage at chain position i that ends at layer j (vector over j).

    Exact when no node is skipped; otherwise an upper bound (later stages ≤
    later nodes and ≤ later layers)."""
    if ctx.config.schedule == "gpipe":
        return m
    later = np.minimum(n - 1 - i, ctx.L - np.arange(ctx.L + 1))
    bound: np.ndarray = np.minimum(ctx.overlap * m, 1 + np.maximum(later, 0))
    return bound


def stage_costs(ctx: PlanContext, node: int, nxt: int | None, memok: np.ndarray,
                factor: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(cost, sigma)`` of a stage holding layers ``[k, j)`` on ``node``, followed
    by a stage on ``nxt``, as matrices over ``[k, j]`` (vectors over k when
    ``nxt`` is None: the last stage ends at L), seconds per microbatch.

    ``cost`` is what the min-max pass bounds (inf where ``memok`` is False):
    under 1F1B the largest of the stage's compute and its two links' busy
    times, under GPipe max(forward, activation send) + max(backward, gradient
    send); ``sigma`` is the stage's share of the fill-and-drain path. Links use
    their fastest allowed codec. ``factor``: the stage's work over its work without
    recomputation (:meth:`PlanContext.memory_fit`)."""
    w = ctx.work * factor / ctx.flops[node]
    if nxt is None:
        c = np.where(memok[:, ctx.L], w[:, ctx.L], math.inf)
        return c, w[:, ctx.L]
    lc = ctx.link_costs(node, nxt)
    if ctx.config.schedule == "gpipe":
        c = (np.maximum(w * FORWARD_FRACTION, lc.act_busy[None, :])
             + np.maximum(w * (1 - FORWARD_FRACTION), lc.grad_busy[None, :]))
    else:
        c = np.maximum(np.maximum(w, lc.act_busy[None, :]), lc.grad_busy[None, :])
    c = np.where(memok, c, math.inf)
    return c, w + lc.act_total[None, :] + lc.grad_total[None, :]


def solve_chain(ctx: PlanContext, chain: Sequence[int], microbatches: int,
                window: int | None = None, exact: bool = False) -> GroupSolution | None:
    """The best split of all layers over a subsequence of ``chain``.

    Args:
        ctx: the planning context.
        chain: node indices in pipeline order.
        microbatches: microbatches the group runs per step (weights the
            bottleneck against the fill-and-drain path, and sets GPipe's stash).
        window: at most ``window - 1`` consecutive nodes of the chain may be
            skipped (1: every node gets a stage; None: any subsequence).
        exact: try every achievable bottleneck as a threshold and return the
            split minimising ``sigma + (microbatches - 1) · bottleneck``
            exactly (slow; for tests). Default: the thresholds
            of :data:`THRESHOLDS`, and of their splits the one with the least
            estimated step time ``sigma + (microbatches - 1) · period``.

    Returns:
        The split, or None when no split fits the nodes' memory (or there are
        fewer layers than nodes with ``window=1``). When nodes may be skipped,
        1F1B's stash is bounded by the nodes and layers left rather than the
        stages actually used, so a split that would just fit may be missed.

    Cost: O(n · window · L²) numpy work for n nodes and L layers.
    """
    n, L = len(chain), ctx.L
    if n == 0:
        return None
    W = n if window is None else max(1, min(window, n))
    mats: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    mm: list[np.ndarray] = [np.full(L + 1, math.inf)] * n
    for i in range(n - 1, -1, -1):
        node = chain[i]
        infl = _in_flight_bound(ctx, microbatches, i, n)
        memok, factor = ctx.memory_fit(node, infl)
        best = np.full(L + 1, math.inf)
        if i >= n - W:
            c, s = stage_costs(ctx, node, None, memok, factor)
            mats[(i, -1)] = (c, s)
            best = np.minimum(best, c)
        for q in range(i + 1, min(n, i + W + 1)):
            if not np.isfinite(mm[q]).any():
                continue
            c, s = stage_costs(ctx, node, chain[q], memok, factor)
            mats[(i, q)] = (c, s)
            best = np.minimum(best, np.maximum(c, mm[q][None, :]).min(axis=1))
        mm[i] = best
    tau = min(mm[i][0] for i in range(W))
    if not math.isfinite(tau):
        return None
    vals = np.unique(np.concatenate([c[np.isfinite(c)].ravel() for c, _ in mats.values()]))
    if exact:
        taus, rewards = vals[vals >= tau], np.zeros(1)
    else:
        vals = vals[(vals >= tau) & (vals <= THRESHOLD_SPAN * tau)]
        count = THRESHOLDS[0] if n <= 10 else THRESHOLDS[1]
        taus = vals[np.unique(np.linspace(0, len(vals) - 1, count).round().astype(int))]
        rewards = np.array(STAGE_REWARDS)
    taus, rewards = np.repeat(taus, len(rewards)), np.tile(rewards, len(taus))
    return _min_sigma(ctx, chain, microbatches, W, mats, taus, rewards * taus, exact)


def _min_sigma(ctx: PlanContext, chain: Sequence[int], m: int, W: int,
               mats: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]], taus: np.ndarray,
               rewards: np.ndarray, exact: bool) -> GroupSolution | None:
    """Second pass: for each threshold ``taus[t]``, the split with the least
    ``sigma - rewards[t] · stages`` whose stages all cost at most the threshold;
    returns the best (see :func:`solve_chain`)."""
    n, L = len(chain), ctx.L
    K = len(taus)
    T, R = taus[:, None, None], rewards[:, None, None]
    ss: list[np.ndarray] = [np.full((K, L + 1), math.inf)] * n
    args: list[tuple[np.ndarray, np.ndarray]] = [None] * n  # type: ignore[list-item]
    rows = np.arange(K)[:, None]
    cols = np.arange(L + 1)[None, :]
    for i in range(n - 1, -1, -1):
        best = np.full((K, L + 1), math.inf)
        bq = np.full((K, L + 1), -2)
        bj = np.zeros((K, L + 1), dtype=int)
        end = mats.get((i, -1))
        if end is not None:
            c, s = end
            val = np.where(c[None, :] <= taus[:, None], s[None, :] - rewards[:, None], math.inf)
            better = val < best
            best[better], bq[better], bj[better] = val[better], -1, L
        for q in range(i + 1, min(n, i + W + 1)):
            if (i, q) not in mats:
                continue
            c, s = mats[(i, q)]
            tot = np.where(c[None] <= T, s[None] - R, math.inf) + ss[q][:, None, :]
            jj = tot.argmin(axis=2)
            val = tot[rows, cols, jj]
            better = val < best
            best[better], bq[better], bj[better] = val[better], q, jj[better]
        ss[i], args[i] = best, (bq, bj)

    def key(sol: GroupSolution) -> tuple[float, float]:
        if exact:
            return sol.sigma + (m - 1) * sol.bottleneck, sol.bottleneck
        return sol.seconds(m), sol.bottleneck

    found: GroupSolution | None = None
    seen = set()
    for t in range(K):
        i0 = min(range(W), key=lambda i: ss[i][t, 0])
        if not math.isfinite(ss[i0][t, 0]):
            continue
        stages = _trace(args, t, i0)
        if stages in seen:
            continue
        seen.add(stages)
        sol = describe(ctx, chain, stages, m)
        if found is None or key(sol) < key(found):
            found = sol
    return found


def _trace(args: Sequence[tuple[np.ndarray, np.ndarray]], t: int, i0: int
           ) -> tuple[tuple[int, int, int], ...]:
    """Follow the second pass's choices for threshold ``t`` from chain position
    ``i0``, layer 0: the stages as ``(position, layer_start, layer_end)``."""
    stages = []
    i, k = i0, 0
    while True:
        q, j = int(args[i][0][t, k]), int(args[i][1][t, k])
        stages.append((i, k, j))
        if q == -1:
            break
        i, k = q, j
    return tuple(stages)


def describe(ctx: PlanContext, chain: Sequence[int], stages: Sequence[tuple[int, int, int]],
             microbatches: int) -> GroupSolution:
    """Price a given split: ``stages[s] = (position in chain, layer_start, layer_end)``.

    Links use their fastest allowed codec. ``max_microbatches`` is 0 when a
    stage does not fit its node's memory even with one microbatch.
    """
    n_st = len(stages)
    sched = ctx.config.schedule
    fwd, bwd, ab, at, gb, gt = [], [], [], [], [], []
    bottleneck, cap = 0.0, math.inf
    for s, (i, k, j) in enumerate(stages):
        node = chain[i]
        w = ctx.work[k, j] / ctx.flops[node]
        if ctx.recomputes(node, k, j, in_flight(sched, s, n_st, microbatches, ctx.overlap)):
            w *= RECOMPUTE_FACTOR
        fwd.append(w * FORWARD_FRACTION)
        bwd.append(w * (1 - FORWARD_FRACTION))
        cost = w
        if s + 1 < n_st:
            lc = ctx.link_costs(node, chain[stages[s + 1][0]])
            ab.append(lc.act_busy[j])
            at.append(lc.act_total[j])
            gb.append(lc.grad_busy[j])
            gt.append(lc.grad_total[j])
            cost = (max(fwd[-1], ab[-1]) + max(bwd[-1], gb[-1]) if sched == "gpipe"
                    else max(w, ab[-1], gb[-1]))
        bottleneck = max(bottleneck, cost)
        room = ctx.room(node, k, j)
        if room > 0 and sched != "gpipe":
            # 1F1B never stashes more than n_stages - s, of ``overlap`` steps at once
            room = math.inf if room >= n_st - s else room // ctx.overlap
        cap = min(cap, room)
    sigma, period = pipeline_estimate(fwd, bwd, ab, at, gb, gt, microbatches, sched, ctx.overlap)
    drain, acc = [], 0.0
    for s in range(n_st):
        drain.append(acc)
        acc += bwd[s] + (gt[s] if s < n_st - 1 else 0.0)
    return GroupSolution(tuple(chain[i] for i, _, _ in stages), tuple((k, j) for _, k, j in stages),
                         float(sigma), float(bottleneck), float(period), tuple(drain), cap,
                         tuple(i for i, _, _ in stages), ctx.overlap)


def proportional_split(ctx: PlanContext, chain: Sequence[int], microbatches: int) -> GroupSolution:
    """Every node of the chain gets a stage whose share of the work matches its
    share of the chain's FLOP/s (rounded to layer boundaries, one layer at
    least). A cheap stand-in for :func:`solve_chain` when screening many
    groupings; ignores links and memory (check ``max_microbatches``).

    Requires ``len(chain) <= L``.
    """
    n, L = len(chain), ctx.L
    speed = np.cumsum([ctx.flops[i] for i in chain])
    work = ctx.work[0, 1:]                     # work of layers [0, j) for j = 1..L
    bounds, prev = [0], 0
    for s in range(n - 1):
        target = work[-1] * speed[s] / speed[-1]
        j = int(np.searchsorted(work, target)) + 1
        if j > 1 and abs(work[j - 2] - target) < abs(work[min(j, L) - 1] - target):
            j -= 1
        j = min(max(j, prev + 1), L - (n - 1 - s))
        bounds.append(j)
        prev = j
    bounds.append(L)
    return describe(ctx, chain, [(s, bounds[s], bounds[s + 1]) for s in range(n)], microbatches)
