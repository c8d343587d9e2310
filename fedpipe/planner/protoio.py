"""Conversion between the wire's messages and the planner's dataclasses.

The counterpart of :mod:`~fedpipe.planner.jsonio` for protobuf: the tracker
turns its registry and a submission into a :class:`~fedpipe.planner.ClusterView`,
a :class:`~fedpipe.planner.ModelProfile` and a :class:`~fedpipe.planner.TrainConfig`,
and the planner's :class:`~fedpipe.planner.Plan` back into a ``fedpipe.v1.Plan``.
No I/O and no torch, like the rest of the planner.
"""
from __future__ import annotations

from ..proto import node_pb2, tracker_pb2
from ..spec import SNAPSHOTS_KEPT, JobSpec
from .types import ClusterView, LayerProfile, Link, ModelProfile, NodeSpec, Plan, TrainConfig


def cluster_view(nodes: list[tracker_pb2.NodeInfo],
                 links: list[node_pb2.LinkMeasurement]) -> ClusterView:
    """The planner's view of nodes and measured links.

    Links to or from nodes not in ``nodes``, and failed measurements
    (bandwidth 0), are left out; the planner uses its default link for them.
    """
    ids = {n.node_id for n in nodes}
    return ClusterView(
        [NodeSpec(n.node_id, n.resources.flops, n.resources.memory_bytes, n.name,
                  n.resources.device) for n in nodes],
        {(m.src_id, m.dst_id): Link(m.bandwidth, m.latency)
         for m in links if m.src_id in ids and m.dst_id in ids and m.bandwidth > 0})


def unmeasured(nodes: list[tracker_pb2.NodeInfo], links: list[node_pb2.LinkMeasurement]
               ) -> list[tuple[str, str]]:
    """Ordered pairs ``(src_id, dst_id)`` of ``nodes`` not measured since both registered."""
    seen = {(m.src_id, m.dst_id): m.measured_at for m in links}
    return [(a.node_id, b.node_id) for a in nodes for b in nodes
            if a.node_id != b.node_id
            and seen.get((a.node_id, b.node_id), 0) < max(a.registered, b.registered)]


def model_profile(p: tracker_pb2.ModelProfile) -> ModelProfile:
    """The planner's model profile from its message (FLOP per sample, bytes per sample)."""
    return ModelProfile([LayerProfile(lp.name, lp.flops, lp.activation_bytes, lp.parameter_bytes)
                         for lp in p.layers], p.input_bytes)


def train_config(spec: JobSpec) -> TrainConfig:
    """The planner's training config for a job: every node keeps its stages'
    checkpoint snapshots and, as a buddy, as many of another stage's."""
    return TrainConfig(batch_size=spec.batch_size, microbatches=spec.microbatches,
                       schedule=spec.schedule, stages=spec.stages, replicas=spec.replicas,
                       activation_compression=spec.activation_compression,
                       gradient_compression=spec.gradient_compression,
                       sync_every=spec.sync_every, snapshot_copies=2 * SNAPSHOTS_KEPT)


def plan_message(plan: Plan, nodes: dict[str, tracker_pb2.NodeInfo]) -> node_pb2.Plan:
    """The ``fedpipe.v1.Plan`` of a planner plan, with node addresses and a one-line summary.

    Args:
        plan: the planner's plan; group ``r``'s ``i``-th stage becomes
            ``StageKey(r, i)``.
        nodes: every node the plan uses, by node id.

    Raises:
        KeyError: the plan names a node missing from ``nodes``.
    """
    msg = node_pb2.Plan(predicted_step_seconds=plan.predicted_step_seconds,
                        sync_seconds=plan.sync_seconds)
    parts = []
    for r, group in enumerate(plan.groups):
        msg.replicas.append(node_pb2.ReplicaInfo(microbatches=group.microbatches,
                                                 samples=group.samples,
                                                 predicted_seconds=group.predicted_seconds))
        for i, s in enumerate(group.stages):
            n = nodes[s.node_id]
            msg.stages.append(node_pb2.StageAssignment(
                replica=r, stage=i, node_id=s.node_id, node_name=n.name, address=n.address,
                layer_start=s.layer_start, layer_end=s.layer_end,
                activation_codec=s.activation_codec, gradient_codec=s.gradient_codec))
            group_tag = f"group {r} " if len(plan.groups) > 1 else ""
            parts.append(f"{group_tag}{n.name}: layers {s.layer_start}-{s.layer_end - 1}")
    msg.summary = "; ".join(parts)
    return msg
