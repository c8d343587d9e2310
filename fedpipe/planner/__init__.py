"""Planning: pure functions from a cluster view and a model profile to a plan.

Nothing here does I/O (except :mod:`~fedpipe.planner.jsonio`, which only
converts JSON-shaped objects) or imports torch; see :func:`make_plan`.

Modules: ``types`` (dataclasses), ``codecs`` (codec prices and choices), ``costs``
(the cost model), ``context`` (precomputed arrays), ``partition`` (the min-max
layer split), ``ordering`` (bottleneck path, locality order), ``grouping``
(replica groups), ``evaluate`` (estimate and plan building), ``simulate`` (the
discrete-event simulator), ``search`` (:func:`make_plan`), ``relayed`` (no bottleneck
stage behind a relay), ``baselines`` and
``exhaustive`` (reference planners for benchmarks and tests), ``jsonio``, ``protoio``
(to and from the protocol messages).
"""
from __future__ import annotations

from .costs import stage_memory_bytes
from .search import make_plan
from .simulate import SimResult, simulate
from .types import (ClusterView, DEFAULT_LINK, LayerProfile, Link, ModelProfile, NodeSpec, Plan,
                    PlanError, ReplicaGroup, SearchOptions, StagePlan, TrainConfig)


def choose_replica_sync(plan: Plan, max_share: float = 0.25) -> str:
    """How a plan's replica groups should agree: "allreduce" or "diloco".

    The per-step gradient all-reduce is kept while it adds at most
    ``max_share`` of the groups' compute time to a step
    (``plan.sync_seconds`` against the rest of the predicted step); beyond
    that, DiLoCo's outer steps every H inner steps pay the cross-group links
    H times less often (Douillard et al., "DiLoCo", 2023). One group: "allreduce"
    (nothing to sync).
    """
    if len(plan.groups) < 2:
        return "allreduce"
    compute = max(plan.predicted_step_seconds - plan.sync_seconds, 1e-12)
    return "diloco" if plan.sync_seconds > max_share * compute else "allreduce"


__all__ = ["ClusterView", "DEFAULT_LINK", "LayerProfile", "Link", "ModelProfile", "NodeSpec",
           "Plan", "PlanError", "ReplicaGroup", "SearchOptions", "SimResult", "StagePlan",
           "TrainConfig", "choose_replica_sync", "make_plan", "simulate",
           "stage_memory_bytes"]
