"""Planning: pure functions from a cluster view and a model profile to a plan.

Nothing here does I/O or imports torch; see :func:`make_plan`.
"""
from __future__ import annotations

from .partition import partition, stage_memory_bytes
from .types import (ClusterView, DEFAULT_LINK, LayerProfile, Link, ModelProfile, NodeSpec, Plan,
                    PlanError, ReplicaGroup, StagePlan, TrainConfig)


def pipeline_step_seconds(stage_seconds: list[float], microbatches: int) -> float:
    """Step time of a synchronous pipeline: fill and drain, then the bottleneck repeats.

    ``sum(t) + (M - 1) · max(t)`` for per-microbatch stage times ``t`` (seconds):
    the GPipe/1F1B estimate of Huang et al., "GPipe" (NeurIPS 2019).
    """
    return sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)


def make_plan(cluster: ClusterView, profile: ModelProfile, config: TrainConfig) -> Plan:
    """Plan one pipeline over the cluster's nodes.

    Nodes are taken fastest first; for every chain length k the min-max
    partition (:func:`partition`) is computed and the k with the least
    predicted step time wins, so a node that would slow the job down is left
    without a stage. ``config.stages`` pins the chain length.

    Raises:
        PlanError: no node, no layer, or no chain whose stages fit in memory
            (the message gives the model's and the swarm's bytes).
    """
    if not cluster.nodes:
        raise PlanError("no node is available")
    if not profile.layers:
        raise PlanError("the model has no layers")
    nodes = sorted(cluster.nodes, key=lambda n: (-n.flops, n.node_id))
    best: tuple[float, list[NodeSpec], list[tuple[int, int]]] | None = None
    mb = config.batch_size / config.microbatches
    depths = range(1, min(len(nodes), len(profile.layers)) + 1)
    if config.stages:
        if config.stages > min(len(nodes), len(profile.layers)):
            raise PlanError(f"{config.stages} stages asked for, but there are {len(nodes)} "
                            f"node(s) and {len(profile.layers)} layer(s)")
        depths = [config.stages]
    for k in depths:
        chain = nodes[:k]
        found = partition(chain, profile, config, cluster.link)
        if found is None:
            continue
        ranges, _ = found
        times = []
        for i, (s, e) in enumerate(ranges):
            t = sum(layer.flops for layer in profile.layers[s:e]) * mb / chain[i].flops
            if i + 1 < k:
                nbytes = profile.layers[e - 1].activation_bytes * mb
                t += cluster.link(chain[i].node_id, chain[i + 1].node_id).transfer_seconds(nbytes)
                t += cluster.link(chain[i + 1].node_id, chain[i].node_id).transfer_seconds(nbytes)
            times.append(t)
        step = pipeline_step_seconds(times, config.microbatches)
        if best is None or step < best[0]:
            best = (step, chain, ranges)
    if best is None:
        need = stage_memory_bytes(profile, 0, len(profile.layers), config, 0, 1)
        have = sum(n.memory_bytes for n in cluster.nodes)
        raise PlanError(
            f"no split of the model's {len(profile.layers)} layers fits the nodes' memory: "
            f"the whole job needs about {need / 2**20:.1f} MiB, the {len(cluster.nodes)} "
            f"node(s) have {have / 2**20:.1f} MiB in all")
    step, chain, ranges = best
    stages = [StagePlan(n.node_id, s, e) for n, (s, e) in zip(chain, ranges)]
    used = {n.node_id for n in chain}
    return Plan(groups=[ReplicaGroup(stages)], predicted_step_seconds=step,
                unused=[n.node_id for n in cluster.nodes if n.node_id not in used])


__all__ = ["ClusterView", "DEFAULT_LINK", "LayerProfile", "Link", "ModelProfile", "NodeSpec",
           "Plan", "PlanError", "ReplicaGroup", "StagePlan", "TrainConfig", "make_plan",
           "partition", "pipeline_step_seconds", "stage_memory_bytes"]
