"""Planning: pure functions from a cluster view and a model profile to a plan.

Nothing here does I/O (except :mod:`~fedpipe.planner.jsonio`, which only
converts JSON-shaped objects) or imports torch; see :func:`make_plan`.

Modules: ``types`` (dataclasses), ``codecs`` (codec names and sizes), ``costs``
(the cost model), ``context`` (precomputed arrays), ``partition`` (the min-max
layer split), ``ordering`` (bottleneck path, locality order), ``grouping``
(replica groups), ``evaluate`` (estimate and plan building), ``simulate`` (the
discrete-event simulator), ``search`` (:func:`make_plan`), ``baselines`` and
``exhaustive`` (reference planners for benchmarks and tests), ``jsonio``.
"""
from __future__ import annotations

from .costs import stage_memory_bytes
from .partition import partition
from .search import make_plan
from .simulate import SimResult, simulate
from .types import (ClusterView, DEFAULT_LINK, LayerProfile, Link, ModelProfile, NodeSpec, Plan,
                    PlanError, ReplicaGroup, SearchOptions, StagePlan, TrainConfig)


def pipeline_step_seconds(stage_seconds: list[float], microbatches: int) -> float:
    """Step time of a synchronous pipeline: fill and drain, then the bottleneck repeats.

    ``sum(t) + (M - 1) · max(t)`` for per-microbatch stage times ``t`` (seconds):
    the GPipe/1F1B estimate of Huang et al., "GPipe" (NeurIPS 2019).
    """
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


__all__ = ["ClusterView", "DEFAULT_LINK", "LayerProfile", "Link", "ModelProfile", "NodeSpec",
           "Plan", "PlanError", "ReplicaGroup", "SearchOptions", "SimResult", "StagePlan",
           "TrainConfig", "make_plan", "partition", "pipeline_step_seconds", "simulate",
           "stage_memory_bytes"]
