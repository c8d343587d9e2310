"""Weighing a migration: predicted step times, candidate assignments, the cost of moving.

Pure functions over plan messages (no I/O): :mod:`.rebalance` calls them at a job's
checkpoints to decide whether moving its stages pays.

- :func:`predict_step_seconds`: a plan's step time at the nodes' current speeds
  (:func:`fedpipe.planner.costs.chain_costs`: priced as the planner prices a chain);
- :func:`reassign`: the stages moved whole to the nodes that predict the shortest step;
- :func:`resplit`: the planner's own plan over the nodes (a job of one replica group);
- :func:`move_seconds`: the seconds and bytes of moving the layers that change nodes.

The decision rule (gain ≥ threshold, gain × horizon > move cost) follows the
amortised-migration rule of Varuna (Athlur et al., EuroSys 2022) and Bamboo.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from .. import planner
from ..planner.costs import chain_costs, compute_seconds, state_bytes
from ..planner.protoio import memory_shares, move_to, plan_message, plan_summary, train_config
from ..proto import node_pb2, tracker_pb2
from ..spec import JobSpec, PlanView, StageKey

log = logging.getLogger("fedpipe.tracker")


def predict_step_seconds(plan: node_pb2.Plan, cluster: planner.ClusterView,
                         profile: planner.ModelProfile, schedule: str,
                         speed: Callable[[str], float], precision: str = "fp32",
                         max_staleness: int = 0) -> float:
    """Predicted seconds of one step of ``plan``: the slowest replica group's analytic
    step (:meth:`~fedpipe.planner.costs.ChainCosts.step_seconds` of the planner's own
    :func:`~fedpipe.planner.costs.chain_costs`), with node ``n`` computing at
    ``speed(n)`` FLOP/s, the links of ``cluster`` and the job's ``precision`` (the
    bytes its boundaries send) and, under "async", its ``max_staleness``.
    """
    view = PlanView(plan)
    worst = 0.0
    for g, chain in enumerate(view.chains()):
        m = view.microbatches(g)
        samples = view.share(g) / max(1, m)

        def passes(a, samples=samples):
            return compute_seconds(profile, a.layer_start, a.layer_end,
                                   max(speed(a.node_id), 1.0), samples)

        costs = chain_costs(profile, chain, samples, passes, cluster.link, microbatches=m,
                            precision=precision)
        worst = max(worst, costs.step_seconds(m, schedule, max_staleness))
    return worst


def _moved_state(before: node_pb2.Plan, after: node_pb2.Plan, profile: planner.ModelProfile,
                 config: planner.TrainConfig) -> list[tuple[str, str, float]]:
    """``(from node, to node, bytes)`` for each pair of nodes between which layers change
    hands: each layer of a stage of ``after`` that its replica group held on another node
    in ``before`` counts its state (weights and optimizer state), nothing else. A stage
    that moves whole counts all its layers; a re-split (a boundary that moves, a stage
    added) only the layers whose node changes (:mod:`fedpipe.runtime.layerstate`)."""
    old = PlanView(before)
    moved: dict[tuple[str, str], float] = {}
    for key, a in sorted(PlanView(after).stages.items()):
        for o in old.chain(key.replica) if key.replica in old.replicas else []:
            lo, hi = max(o.layer_start, a.layer_start), min(o.layer_end, a.layer_end)
            if lo < hi and o.node_id != a.node_id:
                pair = (o.node_id, a.node_id)
                moved[pair] = moved.get(pair, 0.0) + state_bytes(
                    profile, lo, hi, replace(config, snapshot_copies=0))
    return [(a, b, n) for (a, b), n in sorted(moved.items())]


def move_seconds(before: node_pb2.Plan, after: node_pb2.Plan, cluster: planner.ClusterView,
                 profile: planner.ModelProfile, config: planner.TrainConfig
                 ) -> tuple[float, int]:
    """Seconds and bytes of moving the state (weights and optimizer state) of the layers
    that change nodes between two plans (:func:`_moved_state`), each pair of nodes over
    its measured link, all at once (the slowest transfer counts): ``(seconds, bytes)``."""
    moves = _moved_state(before, after, profile, config)
    seconds = max((cluster.link(a, b).transfer_seconds(n) for a, b, n in moves), default=0.0)
    return seconds, int(sum(n for _, _, n in moves))


def resplit(plan: node_pb2.Plan, spec: JobSpec, cluster: planner.ClusterView,
            profile: planner.ModelProfile, nodes: list[tracker_pb2.NodeInfo]
            ) -> node_pb2.Plan | None:
    """A new plan from the planner over ``cluster`` (its nodes at their current speeds),
    free to split the layers otherwise than ``plan`` (more or fewer stages, moved
    boundaries): the candidate a join is weighed by when moving whole stages cannot use
    the new node. Only for a job of one replica group that is not elastic (replica
    groups re-form by :mod:`.replicas`); None otherwise, or when the planner finds no
    plan of one group."""
    if len(PlanView(plan).replicas) != 1 or spec.elastic:
        return None
    try:
        out = planner.make_plan(cluster, profile, replace(train_config(spec), replicas=1))
    except planner.PlanError as e:
        log.info("no re-split plan: %s", e)
        return None
    if len(out.groups) != 1:
        return None
    return plan_message(out, {n.node_id: n for n in nodes})


def _assign(plan: node_pb2.Plan, key: StageKey, node: tracker_pb2.NodeInfo) -> node_pb2.Plan:
    out = node_pb2.Plan()
    out.CopyFrom(plan)
    for a in out.stages:
        if (a.replica, a.stage) == key:
            move_to(a, node)
    out.summary = plan_summary(out)
    return out


def reassign(plan: node_pb2.Plan, nodes: list[tracker_pb2.NodeInfo],
             predict: Callable[[node_pb2.Plan], float],
             need: Callable[[node_pb2.StageAssignment], float]) -> node_pb2.Plan:
    """A better assignment of ``plan``'s stages to ``nodes``, each stage keeping its
    layer range: greedy steepest descent, each round moving the one stage to the
    unused node (one the plan does not use, with at least ``need(stage)`` bytes of
    memory) that lowers ``predict`` (seconds per step) most, until no move helps.
    Returns ``plan`` itself when nothing does. O(stages² · nodes) predictions."""
    best, best_t = plan, predict(plan)
    shares = memory_shares(nodes)  # nodes of one host share its memory
    for _ in range(len(plan.stages)):
        used = PlanView(best).node_ids()
        spare = [n for n in nodes if n.node_id not in used]
        step_best = None
        for key, a in sorted(PlanView(best).stages.items()):
            for n in spare:
                if shares[n.node_id] < need(a):
                    continue
                cand = _assign(best, key, n)
                t = predict(cand)
                if t < best_t * (1 - 1e-9) and (step_best is None or t < step_best[1]):
                    step_best = (cand, t)
        if step_best is None:
            break
        best, best_t = step_best
    return best


