"""The planner's rule for relays: a bottleneck stage is never behind a relay when a direct
node can take it (issue 25).

Pricing alone prefers direct links (an unmeasured relayed link costs two legs:
:meth:`~fedpipe.planner.types.ClusterView.link`), but a relayed link measured fast, or a
fast relayed node, can still win the slowest stage of a group. That stage sets the
group's pace, and a relay's capacity is shared with every job and node it serves and
can change without the tracker measuring it again, so the rule is a rule, not a price:
after the search, each group's *bottleneck stage* (its most costly stage per step,
compute plus sends, as :func:`~fedpipe.planner.simulate.stage_costs` prices it) on a
relayed node (:attr:`~fedpipe.planner.types.NodeSpec.relay`) trades its node for a
direct one: an unused node, or one of the plan's own at another stage, whichever plan
is fastest among those with fewer relayed bottlenecks, and the stages still fit their
nodes' memory. Layer ranges and microbatches stay as they were. It repeats until no
group's bottleneck is relayed, or no trade removes one (no direct alternative: every
direct node is too small, or takes the bottleneck role to a relayed node in turn).
"""
from __future__ import annotations

from typing import Sequence

from .context import PlanContext
from .evaluate import Split, build_plan, fits
from .simulate import stage_costs
from .types import Plan

DIRECT_TRIES = 16
"""Direct nodes (the fastest first) tried for one relayed bottleneck stage: the search's
plan is good already; this bounds the simulations the rule adds on a large cluster."""


def relayed_bottlenecks(ctx: PlanContext, plan: Plan) -> list[tuple[int, int]]:
    """``(group, stage)`` of each group whose bottleneck stage (most compute plus send
    seconds per step; the first of equals) is on a relayed node."""
    costs = stage_costs(plan, ctx.cluster, ctx.profile, ctx.config)
    out = []
    for g, group in enumerate(plan.groups):
        totals = [costs[k].compute + costs[k].send for k in sorted(costs) if k[0] == g]
        i = totals.index(max(totals))
        if ctx.cluster.node(group.stages[i].node_id).relay:
            out.append((g, i))
    return out


def splits_of(ctx: PlanContext, plan: Plan) -> tuple[list[Split], list[int]]:
    """``plan``'s groups as the search's splits (node indices, layer ranges) and its
    microbatches per group."""
    index = {node_id: i for i, node_id in enumerate(ctx.ids)}
    splits: list[Split] = [([index[s.node_id] for s in g.stages],
                            [(s.layer_start, s.layer_end) for s in g.stages])
                           for g in plan.groups]
    return splits, [g.microbatches for g in plan.groups]


def _traded(splits: Sequence[Split], a: int, b: int) -> tuple[list[Split], list[int]]:
    """``splits`` with nodes ``a`` and ``b`` trading places (``b`` may be unused: ``a``
    then is), and the groups that changed."""
    out: list[Split] = []
    changed = []
    for g, (nodes, ranges) in enumerate(splits):
        new = [b if i == a else a if i == b else i for i in nodes]
        if new != list(nodes):
            changed.append(g)
        out.append((new, list(ranges)))
    return out, changed


def keep_bottlenecks_direct(ctx: PlanContext, plan: Plan) -> Plan:
    """``plan``, its relayed bottleneck stages moved to direct nodes where one can take
    them (module docstring); ``plan`` itself when none is relayed or none can.

    A rule, not a search: it runs even when the search spent all its time (each round tries at
    most :data:`DIRECT_TRIES` nodes per relayed bottleneck, and removes one at least)."""
    if not any(ctx.cluster.node(s.node_id).relay for g in plan.groups for s in g.stages):
        return plan
    bad = relayed_bottlenecks(ctx, plan)
    direct = sorted((i for i in range(ctx.n) if not ctx.cluster.nodes[i].relay),
                    key=lambda i: (-ctx.flops[i], i))[:DIRECT_TRIES]
    splits, micro = splits_of(ctx, plan)
    while bad:
        best: tuple[tuple[int, float], Plan, list[Split]] | None = None
        for g, s in bad:
            node = splits[g][0][s]
            for other in direct:
                cand, changed = _traded(splits, node, other)
                if not all(fits(ctx, *cand[h], micro[h]) for h in changed):
                    continue
                new = build_plan(ctx, cand, micro)
                key = (len(relayed_bottlenecks(ctx, new)), new.predicted_step_seconds)
                if key[0] < len(bad) and (best is None or key < best[0]):
                    best = (key, new, cand)
        if best is None:
            break
        _, plan, splits = best
        bad = relayed_bottlenecks(ctx, plan)
    return plan
