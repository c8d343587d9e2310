"""From candidate chains to a scored, simulated plan.

The search proposes replica groups as chains of node indices; this module
splits each chain's layers (:func:`~fedpipe.planner.partition.solve_chain`),
shares the job's microbatches among the groups, estimates the step time
analytically (groups' T(m) plus the all-reduce), and finally builds the
:class:`Plan` with a codec per link and the simulator's step time.
"""
from __future__ import annotations

import functools
import heapq
import math
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

from ..wire.codecmodel import CodecSpeed
from . import codecs
from .context import PlanContext
from .costs import (boundary_bytes, boundary_element_bytes, boundary_width, compute_seconds,
                    schedule_sync, sync_per_step, sync_segments, transfer_seconds)
from .partition import GroupSolution, all_solved, describe, proportional_split, solve_chain
from .simulate import simulate
from .steptime import in_flight, pipeline_estimate, step_estimate
from .types import Link, Plan, ReplicaGroup, StagePlan

Chain = tuple[int, ...]
Split = tuple[Sequence[int], Sequence[tuple[int, int]]]
"""One group's ``(node indices, layer range (start, end) per stage)``."""


def allocate_microbatches(solutions: Sequence[GroupSolution],
                          microbatches: int) -> list[int] | None:
    """Share ``microbatches`` among the groups so the slowest group is as fast as possible.

    Every group gets at least one; each further microbatch goes to the group
    whose step would then be shortest (greedy, optimal for a min-max of
    non-decreasing step times), never past a group's memory cap.

    Returns:
        Microbatches per group, or None when there are more groups than
        microbatches or the caps do not add up.
    """
    r = len(solutions)
    if r == 0 or r > microbatches or any(s.max_microbatches < 1 for s in solutions):
        return None
    m = [1] * r
    heap = [(s.seconds(2), g) for g, s in enumerate(solutions) if s.max_microbatches >= 2]
    heapq.heapify(heap)
    for _ in range(microbatches - r):
        if not heap:
            return None
        _, g = heapq.heappop(heap)
        m[g] += 1
        if m[g] + 1 <= solutions[g].max_microbatches:
            heapq.heappush(heap, (solutions[g].seconds(m[g] + 1), g))
    return m


@dataclass(frozen=True)
class Candidate:
    """A scored set of replica groups.

    Attributes:
        chains: each group's candidate chain (node indices; the split may skip some).
        solutions: each group's split.
        microbatches: each group's microbatches per step.
        seconds: analytic step-time estimate, seconds.
    """

    chains: tuple[Chain, ...]
    solutions: tuple[GroupSolution, ...]
    microbatches: tuple[int, ...]
    seconds: float


class Evaluator:
    """Scores candidate groupings, caching each chain's split.

    Args:
        ctx: the planning context.
        window: nodes a split may skip in a row plus one (None: any, for
            chains of up to ``exact_up_to`` nodes).
    """

    def __init__(self, ctx: PlanContext, window: int = 3, exact_up_to: int = 10):
        self.ctx = ctx
        self.window, self.exact_up_to = window, exact_up_to
        self._cache: dict[tuple[Chain, int, bool], GroupSolution | None] = {}

    def solve(self, chain: Chain, microbatches: int, fast: bool = False) -> GroupSolution | None:
        """The chain's split for ``microbatches`` (cached); None if none fits.

        ``fast``: give every node a share of the work proportional to its speed
        (:func:`~fedpipe.planner.partition.proportional_split`) instead of
        running the dynamic program; for screening many groupings. With pinned cuts
        (:attr:`PlanContext.pinned`) a chain of the pinned depth gets their ranges,
        whatever ``fast`` says.
        """
        key = (chain, microbatches, fast)
        if key not in self._cache:
            pinned = self.ctx.config.stages
            if pinned and len(chain) != pinned:
                self._cache[key] = None
            elif self.ctx.pinned is not None:
                sol = describe(self.ctx, chain, [(i, k, j) for i, (k, j)
                                                 in enumerate(self.ctx.pinned)], microbatches)
                self._cache[key] = sol if sol.max_microbatches >= 1 else None
            elif fast and len(chain) <= self.ctx.L:
                sol = proportional_split(self.ctx, chain, microbatches)
                fits = sol.max_microbatches >= 1
                self._cache[key] = sol if fits else self.solve(chain, microbatches)
            else:
                window = 1 if pinned else (None if len(chain) <= self.exact_up_to else self.window)
                self._cache[key] = solve_chain(self.ctx, chain, microbatches, window)
        return self._cache[key]

    def estimate(self, chains: Sequence[Chain], refine: bool = True,
                 fast: bool = False) -> Candidate | None:
        """Score a grouping; None when it does not fit (memory, too many groups).

        Each chain is first split for a share of the microbatches proportional
        to its FLOP/s; with ``refine`` it is split again for the share the
        allocation then gave it, and the better of the two is kept. With
        ``fast`` splits are by speed alone (see :meth:`solve`) and not refined.
        With several groups the splits by speed are scored too and win when
        they are better: the dynamic program does not see the all-reduce, and
        its splits may pile many parameters on one node.
        """
        found = self._estimate(chains, refine, fast)
        if not fast and len(chains) > 1:
            even = self._estimate(chains, False, True)
            if even is not None and (found is None or even.seconds < found.seconds):
                found = even
        return found

    def _estimate(self, chains: Sequence[Chain], refine: bool, fast: bool) -> Candidate | None:
        ctx = self.ctx
        r = len(chains)
        if r == 0 or r > ctx.M or any(not c for c in chains) or ctx.config.replicas not in (0, r):
            return None
        speed = [float(sum(ctx.flops[i] for i in c)) for c in chains]
        hints = [max(1, round(ctx.M * f / sum(speed))) for f in speed]
        sols = all_solved([self.solve(tuple(c), h, fast) for c, h in zip(chains, hints)])
        if sols is None:
            return None
        micro = allocate_microbatches(sols, ctx.M)
        if micro is None:
            return None
        best = (self.step_seconds(sols, micro), sols, micro)
        if refine and not fast:
            again = all_solved([self.solve(tuple(c), m) for c, m in zip(chains, micro)])
            micro2 = allocate_microbatches(again, ctx.M) if again is not None else None
            if again is not None and micro2 is not None:
                best = min(best, (self.step_seconds(again, micro2), again, micro2),
                           key=lambda b: b[0])
        seconds, sols, micro = best
        return Candidate(tuple(tuple(c) for c in chains), tuple(sols), tuple(micro), seconds)

    def step_seconds(self, sols: Sequence[GroupSolution], micro: Sequence[int]) -> float:
        """Analytic step time: the slowest group's T(m), plus what the all-reduce
        adds after it (each stage joins it when its last backward ends),
        divided by the config's ``sync_every``."""
        ctx = self.ctx
        times = [s.seconds(m) for s, m in zip(sols, micro)]
        if len(sols) < 2:
            return times[0]
        ready: dict[Hashable, float] = {}
        groups = []
        for s, t in zip(sols, times):
            groups.append([(node, k, j) for node, (k, j) in zip(s.nodes, s.ranges)])
            ready.update((node, max(0.0, t - d)) for node, d in zip(s.nodes, s.drain))
        segs = sync_segments(groups, ctx.profile,
                             lambda a, b: (ctx.bw[a, b], ctx.lat[a, b]))
        slowest = max(times)
        return slowest + sync_per_step(slowest, schedule_sync(segs, ready), ctx.config)


def split_samples(batch_size: int, micro: Sequence[int]) -> list[int]:
    """Samples per group for microbatches ``micro``: proportional, largest remainder."""
    total = sum(micro)
    exact = [batch_size * m / total for m in micro]
    out = [int(x) for x in exact]
    for g in sorted(range(len(micro)), key=lambda g: out[g] - exact[g])[:batch_size - sum(out)]:
        out[g] += 1
    return out


def build_plan(ctx: PlanContext, groups: Sequence[Split], micro: Sequence[int],
               compression: bool = True) -> Plan:
    """The plan for given chains, splits and microbatches, with its simulated step time.

    Each link's codecs come from :func:`choose_codecs`; with
    ``compression=False`` every link is raw whatever the config says.

    Args:
        groups: per group, ``(node indices, layer ranges)``.
        micro: microbatches per group.
    """
    samples = split_samples(ctx.config.batch_size, micro)
    out = []
    for (nodes, ranges), m, n_samples in zip(groups, micro, samples):
        act, grad = choose_codecs(ctx, nodes, ranges, n_samples / m, m) if compression else (
            ["raw"] * len(nodes), ["raw"] * len(nodes))
        sched, n = ctx.config.schedule, len(nodes)
        stages = [StagePlan(ctx.ids[node], k, j, a, g,
                            ctx.recomputes(node, k, j, in_flight(sched, i, n, m, ctx.overlap)))
                  for i, (node, (k, j), a, g) in enumerate(zip(nodes, ranges, act, grad))]
        out.append(ReplicaGroup(stages, microbatches=m, samples=n_samples))
    used = {s.node_id for g in out for s in g.stages}
    plan = Plan(out, 0.0, unused=[i for i in ctx.ids if i not in used],
                schedule=ctx.config.schedule)
    res = simulate(plan, ctx.cluster, ctx.profile, ctx.config)
    for g, t in zip(plan.groups, res.group_seconds):
        g.predicted_seconds = t
    plan.predicted_step_seconds = res.step_seconds
    plan.sync_seconds = res.sync_seconds
    plan.predicted_samples_per_second = (ctx.config.batch_size / res.step_seconds
                                         if res.step_seconds > 0 else math.inf)
    return plan


CODEC_SLACK = 0.02
"""How much (as a fraction) weaker, more faithful codecs may lengthen a group's estimated step."""


def choose_codecs(ctx: PlanContext, nodes: Sequence[int], ranges: Sequence[tuple[int, int]],
                  samples: float, microbatches: int) -> tuple[list[str], list[str]]:
    """Codecs for one pipeline: ``(activation codec per stage, gradient codec per stage)``.

    A link gets the weakest allowed codec whose send fits within the group's
    bottleneck (its slowest stage's compute, or its slowest link under the
    fastest codecs, per microbatch): "raw" when the raw tensor crosses within
    the compute time, stronger codecs as the link gets slower (see
    :func:`fedpipe.planner.codecs.choose`; under GPipe the forward and backward
    phases have their own bottlenecks). If that lengthens the group's estimated
    step (:func:`~fedpipe.planner.steptime.pipeline_estimate`, which sees 1F1B's
    round-trip bound) by more than :data:`CODEC_SLACK`, the link that lost the
    most moves to the next stronger codec that is faster, until it does not.

    That is done once per cap on the codecs' convergence factors (steps to a
    target against raw, :attr:`~fedpipe.planner.codecs.CodecCost.steps_factor`):
    with only the codecs at or under the cap allowed. The choice kept is the one
    of least predicted T = estimated step × :func:`~fedpipe.planner.codecs.
    steps_factor` of its codecs (ties: the lower cap), so a codec that halves a
    step but needs twice the steps is not taken.

    Args:
        samples: samples per microbatch.
        microbatches: microbatches the group runs per step.
    """
    links = _Links(ctx, nodes, ranges, samples, microbatches)
    allowed = (ctx.act_codecs, ctx.grad_codecs)
    best: tuple[float, list[list[str]]] | None = None
    for cap in sorted({codecs.codec_cost(c).steps_factor for d in (0, 1) for c in allowed[d]}):
        ladders = [tuple(c for c in allowed[d] if codecs.codec_cost(c).steps_factor <= cap)
                   for d in (0, 1)]
        if not all(ladders):
            continue
        chosen = links.choose(ladders)
        t = links.step(chosen) * codecs.steps_factor([*chosen[0], *chosen[1]])
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, chosen)
    assert best is not None  # the largest cap allows every codec
    return best[1][0] + ["raw"], ["raw"] + best[1][1]


class _Links:
    """One pipeline's stage compute and links, for :func:`choose_codecs`."""

    def __init__(self, ctx: PlanContext, nodes: Sequence[int],
                 ranges: Sequence[tuple[int, int]], samples: float, microbatches: int):
        prof, cl = ctx.profile, ctx.cluster
        precision = ctx.config.precision
        self.sched, self.microbatches, self.element_bytes = (
            ctx.config.schedule, microbatches, boundary_element_bytes(prof, precision))
        self.overlap = ctx.overlap
        self.fwd, self.bwd = zip(*(compute_seconds(prof, k, j, ctx.flops[node], samples)
                                   for node, (k, j) in zip(nodes, ranges)))
        # sends[d][i]: (link, bytes, the sender's and the receiver's codec costs) of link i
        # in direction d (0: activations, 1: gradients)
        self.sends: list[list[tuple[Link, float, tuple[CodecSpeed, ...],
                                    tuple[CodecSpeed, ...]]]] = [[], []]
        self.widths: list[int] = []  # link i's row width (lowrank's size model)
        for i in range(len(nodes) - 1):
            x = boundary_bytes(prof, ranges[i][1], samples, precision)
            self.widths.append(boundary_width(prof, ranges[i][1]))
            a, b = ctx.ids[nodes[i]], ctx.ids[nodes[i + 1]]
            sa, sb = ctx.speeds[nodes[i]], ctx.speeds[nodes[i + 1]]
            self.sends[0].append((cl.link(a, b), x, sa, sb))
            self.sends[1].append((cl.link(b, a), x, sb, sa))

    def busy(self, d: int, i: int, codec: str) -> float:
        link, x, enc, dec = self.sends[d][i]
        return transfer_seconds(link, x, codec, self.element_bytes, 0.0, enc, dec,
                                self.widths[i], self.microbatches if d == 0 else 0)[0]

    def step(self, choice: Sequence[Sequence[str]]) -> float:
        """The group's estimated step, seconds, with codecs ``choice[d][i]``."""
        times = [[self.busy(d, i, c) for i, c in enumerate(choice[d])] for d in (0, 1)]
        totals = [[t + self.sends[d][i][0].latency for i, t in enumerate(times[d])]
                  for d in (0, 1)]
        sigma, period = pipeline_estimate(self.fwd, self.bwd, times[0], totals[0], times[1],
                                          totals[1], self.microbatches, self.sched,
                                          self.overlap)
        return step_estimate(sigma, period, self.microbatches, len(self.fwd), self.overlap)

    def choose(self, allowed: Sequence[Sequence[str]]) -> list[list[str]]:
        """Each link's codec among ``allowed[d]`` (weakest first), as
        :func:`choose_codecs` describes, before its convergence factors."""
        n = [len(self.sends[d]) for d in (0, 1)]
        fast = [[codecs.fastest(allowed[d], functools.partial(self.busy, d, i))
                 for i in range(n[d])] for d in (0, 1)]
        fast_busy = [[self.busy(d, i, c) for i, c in enumerate(fast[d])] for d in (0, 1)]
        if self.sched == "gpipe":
            budgets = (max([*self.fwd, *fast_busy[0]]), max([*self.bwd, *fast_busy[1]]))
        else:
            top = max([f + b for f, b in zip(self.fwd, self.bwd)] + fast_busy[0] + fast_busy[1])
            budgets = (top, top)
        chosen = [[codecs.choose(allowed[d], functools.partial(self.busy, d, i), budgets[d])
                   for i in range(n[d])] for d in (0, 1)]
        target = self.step(fast) * (1 + CODEC_SLACK)
        while self.step(chosen) > target:
            loss = [(self.busy(d, i, chosen[d][i]) - fast_busy[d][i], d, i)
                    for d in (0, 1) for i in range(n[d]) if chosen[d][i] != fast[d][i]]
            _, d, i = max(loss)
            now = self.busy(d, i, chosen[d][i])
            ladder = allowed[d][list(allowed[d]).index(chosen[d][i]) + 1:]
            chosen[d][i] = next(c for c in ladder if self.busy(d, i, c) < now)  # next that helps
        return chosen


def fits(ctx: PlanContext, nodes: Sequence[int], ranges: Sequence[tuple[int, int]],
         microbatches: int) -> bool:
    """Whether every stage of one group (``nodes`` and their layer ``ranges``) fits its
    node's memory with ``microbatches`` microbatches."""
    sol = describe(ctx, nodes, [(i, k, j) for i, (k, j) in enumerate(ranges)], microbatches)
    return sol.max_microbatches >= microbatches


POLISH_MAX_STAGES = 24
"""Plans with more stages than this (all groups together) are not polished."""


def _polish_moves(splits: Sequence[Split], micro: Sequence[int], best: Plan,
                  shift: bool = True) -> list[tuple[list[int], list[Split], list[int]]]:
    """:func:`polish`'s tries from ``splits``: each (the groups it changes, every group's
    split, microbatches per group). First every stage boundary shifted by one layer
    (unless not ``shift``: the cuts are pinned), then one microbatch moved from the
    slowest group of ``best`` to its fastest."""
    tries: list[tuple[list[int], list[Split], list[int]]] = []
    for g, (nodes, ranges) in enumerate(splits if shift else ()):
        for b in range(len(ranges) - 1):
            for delta in (-1, 1):
                cut = ranges[b][1] + delta
                if ranges[b][0] < cut < ranges[b + 1][1]:
                    cand = list(splits)
                    cand[g] = (nodes, [*ranges[:b], (ranges[b][0], cut),
                                       (cut, ranges[b + 1][1]), *ranges[b + 2:]])
                    tries.append(([g], cand, list(micro)))
    if len(splits) > 1:
        times = [grp.predicted_seconds for grp in best.groups]
        slow, fast = times.index(max(times)), times.index(min(times))
        if micro[slow] > 1:
            moved = list(micro)
            moved[slow] -= 1
            moved[fast] += 1
            tries.append((list(range(len(splits))), list(splits), moved))
    return tries


def polish(ctx: PlanContext, groups: Sequence[Split], micro: Sequence[int], rounds: int = 10,
           deadline: float = math.inf) -> Plan:
    """:func:`build_plan`, then hill climbing on the simulator's step time.

    Moves: shift one stage boundary by one layer (when both stages still fit
    in memory, and the config pins no cuts), or move one microbatch from the slowest
    group to the fastest.
    The analytic estimate often ties splits the simulator tells apart; this
    settles them. Skipped for plans of more than :data:`POLISH_MAX_STAGES`
    stages; stops at ``deadline`` (a ``time.perf_counter()`` value).
    """
    splits: list[Split] = [(list(n), list(r)) for n, r in groups]
    micro = list(micro)
    best = build_plan(ctx, splits, micro)
    if sum(len(n) for n, _ in splits) > POLISH_MAX_STAGES:
        return best

    for _ in range(rounds):
        improved = False
        tries = _polish_moves(splits, micro, best, shift=ctx.pinned is None)
        for changed, cand, m in tries:
            if time.perf_counter() > deadline:
                return best
            if not all(fits(ctx, *cand[g], m[g]) for g in changed):
                continue
            plan = build_plan(ctx, cand, m)
            if plan.predicted_step_seconds < best.predicted_step_seconds * (1 - 1e-9):
                best, splits, micro, improved = plan, cand, list(m), True
                break
        if not improved:
            break
    return best
