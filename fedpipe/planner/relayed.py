"""The planner's rule for relays: a bottleneck stage is not behind a relay when a direct
alternative exists (issue 25).

Pricing alone prefers direct links (an unmeasured relayed link costs two legs:
:meth:`~fedpipe.planner.types.ClusterView.link`), but a relayed link measured fast, or a
fast outbound-only node, can still win the slowest stage of a group. That stage sets the
group's pace, and a relay's capacity is shared with every job and node it serves and
can change without the tracker measuring it again, so the rule is a rule, not a price.

A stage is *behind a relay* (:func:`behind_relay`) when tensors it sends or receives
go through one, as the runtime routes them (:func:`fedpipe.node.peers.dials`): its node
is outbound-only (:attr:`~fedpipe.planner.types.NodeSpec.relay`) and a neighbouring
stage's node is too (two outbound-only nodes talk through the relay; an outbound-only
node dials a reachable one directly), or it is a group's first or last stage (the
client feeds inputs and targets to the node's relayed address).

After the search, a group whose *bottleneck stage* (its most costly stage per step,
compute plus sends, as :func:`~fedpipe.planner.simulate.stage_costs` prices it) is
behind a relay trades that stage's node for another (unused, or one of the plan's at
another stage): of the trades that leave fewer bottlenecks behind a relay and keep
every stage within its node's memory, the fastest, as long as it is at most
:data:`RELAY_MARGIN` times the search's plan's predicted step time (a "direct
alternative"; one far slower, such as a pipeline through a link much slower than the
relayed one, is none). Layer ranges and microbatches stay as they were. It repeats
until no bottleneck is behind a relay, or no trade qualifies.
"""
from __future__ import annotations

from typing import Sequence

from .context import PlanContext
from .evaluate import Split, build_plan, fits
from .simulate import stage_costs
from .types import Plan

DIRECT_TRIES = 16
"""Nodes (the fastest first) tried for one bottleneck stage behind a relay: the search's
plan is good already; this bounds the simulations the rule adds on a large cluster."""
RELAY_MARGIN = 1.25
"""How much longer (as a factor of the predicted step time) a plan with no bottleneck
stage behind a relay may be and still be preferred: the relayed path's measured speed is
shared with the relay's other nodes and jobs, and is not measured again while it serves
them. The benchmark measures a relayed hop at about 0.9x a direct one's throughput
(``benchmarks/relay.py``); 1.25 leaves room for a loaded relay."""


def behind_relay(ctx: PlanContext, stages: Sequence[str], i: int) -> bool:
    """Whether stage ``i`` of a group whose stages are on nodes ``stages`` (ids, in order)
    sends or receives tensors through a relay (module docstring)."""
    def relayed(k: int) -> bool:
        return bool(ctx.cluster.node(stages[k]).relay)

    if not relayed(i):
        return False
    if i == 0 or i == len(stages) - 1:
        return True  # the client's inputs or targets come to its relayed address
    return relayed(i - 1) or relayed(i + 1)


def relayed_bottlenecks(ctx: PlanContext, plan: Plan) -> list[tuple[int, int]]:
    """``(group, stage)`` of each group whose bottleneck stage (most compute plus send
    seconds per step; the first of equals) is behind a relay (:func:`behind_relay`)."""
    costs = stage_costs(plan, ctx.cluster, ctx.profile, ctx.config)
    out = []
    for g, group in enumerate(plan.groups):
        totals = [costs[k].compute + costs[k].send for k in sorted(costs) if k[0] == g]
        i = totals.index(max(totals))
        if behind_relay(ctx, [s.node_id for s in group.stages], i):
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
    """``plan``, its bottleneck stages behind a relay moved to nodes where they are not,
    where a direct alternative exists (module docstring); else ``plan`` itself.

    A rule, not a search: it runs even when the search spent all its time (each round
    tries at most :data:`DIRECT_TRIES` nodes per bottleneck behind a relay, and removes one
    at least)."""
    if not any(ctx.cluster.node(s.node_id).relay for g in plan.groups for s in g.stages):
        return plan
    bad = relayed_bottlenecks(ctx, plan)
    most = plan.predicted_step_seconds * RELAY_MARGIN
    nodes = sorted(range(ctx.n), key=lambda i: (-ctx.flops[i], i))
    splits, micro = splits_of(ctx, plan)
    while bad:
        best: tuple[tuple[int, float], Plan, list[Split]] | None = None
        for g, s in bad:
            node = splits[g][0][s]
            for other in [i for i in nodes if i != node][:DIRECT_TRIES]:
                cand, changed = _traded(splits, node, other)
                if not all(fits(ctx, *cand[h], micro[h]) for h in changed):
                    continue
                new = build_plan(ctx, cand, micro)
                if new.predicted_step_seconds > most:
                    continue
                key = (len(relayed_bottlenecks(ctx, new)), new.predicted_step_seconds)
                if key[0] < len(bad) and (best is None or key < best[0]):
                    best = (key, new, cand)
        if best is None:
            break
        _, plan, splits = best
        bad = relayed_bottlenecks(ctx, plan)
    return plan
