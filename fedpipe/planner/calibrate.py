"""Fitting the cost model to measured step times: per-node corrections, per-message cost.

The cost model (:mod:`~fedpipe.planner.costs`) prices a stage's passes by its
node's probed FLOP/s, which a real model's small matmuls, Python dispatch and
the runtime's threads rarely reach (issue 12: nodes probed 117–155 GFLOP/s, an
MLP ran at 39). Each stage reports, once per step, its wall time split into
compute, waiting and sending. From those this module fits, as in the
calibrate-then-predict loop of performance models such as Paleo (Qi et al.,
ICLR 2017) and the profile-driven planners of PipeDream (Narayanan et al.,
SOSP 2019):

* a **correction per node**, ``c = Σ (measured compute − fixed) / Σ flop`` over
  the stages it ran (:func:`fit_corrections`): how many times longer than its
  probed speed predicts its passes take. Nodes of one machine with the same
  device and threads are one kind of hardware and get one correction, fitted
  from all their stages: fitted apart, the node given fewer layers carries a
  larger share of fixed costs per FLOP, looks slower, and is given fewer
  layers still at the next plan. The planner then prices the node at
  ``flops / c`` (:func:`fedpipe.planner.protoio.cluster_view`). The host's
  sharing of cores is priced apart (:func:`~fedpipe.planner.costs.host_factors`)
  and divided out, so a correction carries over to a plan that puts more or
  fewer nodes on the same machine;
* the **cost per message** (:func:`fit_message`): with the corrected compute,
  the fixed cost per tensor message at which the simulator's step equals the
  measured one (bisection: the simulated step grows with it).

Pure functions over the planner's dataclasses; the tracker keeps the samples
(:mod:`fedpipe.tracker.calibration`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..spec import StageKey
from .simulate import simulate, stage_costs
from .types import ClusterView, ModelProfile, NodeSpec, Plan, TrainConfig

MIN_CORRECTION, MAX_CORRECTION = 0.05, 100.0
"""Bounds of a node's correction: a report outside them is a broken clock or a
stalled node, not a speed."""
MAX_MESSAGE_SECONDS = 0.05
"""Largest per-message cost :func:`fit_message` returns, seconds."""


@dataclass(frozen=True)
class StageSample:
    """One stage's measured compute against the model's, seconds per step.

    Attributes:
        node_id: the node that ran the stage.
        measured: the stage's reported compute seconds (median of recent steps).
        flop: the model's FLOP-priced part at the node's probed speed, host
            sharing included (:attr:`~fedpipe.planner.simulate.StageCost.flop`).
        fixed: the model's fixed part (:attr:`~fedpipe.planner.simulate.StageCost.fixed`).
        hardware: what the node runs on, for nodes that share a machine (host,
            device and threads: :func:`hardware`); "" for a machine of its own.
    """

    node_id: str
    measured: float
    flop: float
    fixed: float
    hardware: str = ""


def stage_samples(plan: Plan, probed: ClusterView, profile: ModelProfile, config: TrainConfig,
                  measured: Mapping[StageKey, float],
                  step_seconds: float | None = None) -> list[StageSample]:
    """A sample per stage of ``plan`` with a measured compute time.

    Args:
        probed: the cluster with the nodes' probed speeds (no corrections).
        measured: per stage, its reported compute seconds per step; stages
            missing here are left out.
        step_seconds: the measured step; with it, the nodes' host sharing is
            priced by their measured busy fractions (compute / step) rather
            than the probed model's.

    Raises:
        KeyError: the plan names a node ``probed`` lacks.
        PlanError: an unknown codec.
    """
    busy: dict[str, float] | None = None
    if step_seconds:
        spent: dict[str, float] = {}
        for r, g in enumerate(plan.groups):
            for i, s in enumerate(g.stages):
                spent[s.node_id] = spent.get(s.node_id, 0.0) + measured.get(StageKey(r, i), 0.0)
        busy = {n: min(1.0, c / step_seconds) for n, c in spent.items()}
    costs = stage_costs(plan, probed, profile, config, busy)
    spec = {n.node_id: n for n in probed.nodes}
    out = []
    for r, g in enumerate(plan.groups):
        for i, s in enumerate(g.stages):
            key = StageKey(r, i)
            if key in measured:
                c = costs[key]
                out.append(StageSample(s.node_id, measured[key], c.flop, c.fixed,
                                       hardware(spec[s.node_id])))
    return out


def hardware(node: NodeSpec) -> str:
    """The hardware ``node`` computes on, as the fit pools it: its host, device and
    threads ("" for a node without a host: a machine of its own)."""
    return f"{node.host}/{node.device}/{node.threads}" if node.host else ""


def fit_corrections(samples: Iterable[StageSample]) -> dict[str, float]:
    """Per node id, its correction: ``Σ (measured − fixed) / Σ flop`` over the samples
    of its hardware (:attr:`StageSample.hardware`; its own where that is ""), clamped to
    [:data:`MIN_CORRECTION`, :data:`MAX_CORRECTION`].

    A ratio of sums, so a stage with more work weighs more and a near-empty
    stage (all fixed cost) cannot swing it. Nodes whose samples have no FLOP
    are left out.
    """
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    pool: dict[str, str] = {}
    for s in samples:
        k = pool[s.node_id] = s.hardware or f"node {s.node_id}"
        num[k] = num.get(k, 0.0) + max(0.0, s.measured - s.fixed)
        den[k] = den.get(k, 0.0) + s.flop
    return {n: min(MAX_CORRECTION, max(MIN_CORRECTION, num[k] / den[k]))
            for n, k in pool.items() if den[k] > 0}


def corrected(cluster: ClusterView, corrections: Mapping[str, float]) -> ClusterView:
    """``cluster`` with each node's speed divided by its correction (1 where absent)."""
    nodes = [dataclasses.replace(n, flops=n.flops / corrections.get(n.node_id, 1.0))
             for n in cluster.nodes]
    return dataclasses.replace(cluster, nodes=nodes)


def fit_message(plan: Plan, cluster: ClusterView, profile: ModelProfile, config: TrainConfig,
                measured_step: float, iterations: int = 20) -> float:
    """The per-message cost, seconds, at which :func:`~fedpipe.planner.simulate.simulate`
    of ``plan`` on ``cluster`` (corrected speeds) takes ``measured_step`` seconds.

    0 when even free messages simulate slower than measured, and
    :data:`MAX_MESSAGE_SECONDS` when even that is too fast; a plan without
    messages (one stage) returns ``cluster.overheads.message`` unchanged.

    Raises:
        KeyError, PlanError: as :func:`~fedpipe.planner.simulate.simulate`.
    """
    if all(len(g.stages) < 2 for g in plan.groups):
        return cluster.overheads.message

    def step(message: float) -> float:
        over = dataclasses.replace(cluster.overheads, message=message)
        return simulate(plan, dataclasses.replace(cluster, overheads=over), profile,
                        config).step_seconds

    lo, hi = 0.0, MAX_MESSAGE_SECONDS
    if step(lo) >= measured_step:
        return lo
    if step(hi) <= measured_step:
        return hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_step else (lo, mid)
    return (lo + hi) / 2
