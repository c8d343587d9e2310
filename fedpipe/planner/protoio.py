"""Conversion between the wire's messages and the planner's dataclasses.

The counterpart of :mod:`~fedpipe.planner.jsonio` for protobuf: the tracker
turns its registry and a submission into a :class:`~fedpipe.planner.ClusterView`,
a :class:`~fedpipe.planner.ModelProfile` and a :class:`~fedpipe.planner.TrainConfig`,
and the planner's :class:`~fedpipe.planner.Plan` to a ``fedpipe.v1.Plan``
(:func:`plan_message`) and back (:func:`plan_from_message`). The one home of
that conversion: the tracker and the dashboard both read it from here.
No I/O and no torch, like the rest of the planner.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import statistics
from typing import Iterable, Mapping, Sequence

from ..proto import node_pb2, tracker_pb2
from ..spec import SNAPSHOTS_KEPT, JobSpec, PlanView, StageKey
from ..spec.optimizers import state_factor, step_scratch
from ..wire.codecmodel import CodecSpeed
from .costs import StageCodecs, host_memory_shares, stage_memory_bytes
from .simulate import StageCost
from .types import (ClusterView, LayerProfile, Link, ModelProfile, NodeSpec, Plan, ReplicaGroup,
                    StagePlan, TrainConfig)
from ..units import layer_range


def site_of(address: str) -> str:
    """The site of a node at ``address`` (``HOST:PORT``): where its links are alike.

    An IPv4 host's site is its /24 network ("10.1.2.0/24"), an IPv6 host's its
    /64; any other host (a DNS name) is a site of its own. Nodes of one site
    are assumed to share their links' figures (see :func:`cluster_view`), so
    the tracker measures only a few links per node
    (:mod:`fedpipe.tracker.links`). Returns "" for an address without a host.
    """
    host = address.rpartition(":")[0].strip("[]")
    if not host:
        return ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))


def cluster_view(nodes: list[tracker_pb2.NodeInfo],
                 links: list[node_pb2.LinkMeasurement]) -> ClusterView:
    """The planner's view of nodes and measured links.

    Speeds are the nodes' probed FLOP/s (the tracker divides them by fitted
    corrections: :func:`fedpipe.planner.calibrate.corrected`). Nodes that
    advertise a ``host_id`` share its ``host_cores``
    (:func:`fedpipe.planner.costs.host_factors`) and its ``host_memory_bytes``
    (:func:`fedpipe.planner.costs.host_memory_shares`).

    Links to or from nodes not in ``nodes``, and failed measurements
    (bandwidth 0), are left out. The tracker measures only some pairs
    (:func:`fedpipe.tracker.links.select_peers`); the planner takes an
    unmeasured pair ``a -> b`` to be like the measured links between their
    sites (:func:`site_of`): ``site_links[(site a, site b)]`` is the median
    bandwidth and median latency of the measured links from site a to site b,
    else of those from b to a (links are about symmetric), else the planner's
    :data:`~fedpipe.planner.types.DEFAULT_LINK`. O(len(nodes) + len(links)).
    """
    specs = [NodeSpec(n.node_id, n.resources.flops,
                      n.resources.memory_bytes, n.name, n.resources.device, site_of(n.address),
                      n.resources.host_id, max(1, n.resources.cores), n.resources.host_cores,
                      n.resources.host_memory_bytes, relay=n.relay,
                      snapshots_on_disk=n.resources.snapshots_on_disk,
                      codec_speeds=codec_speeds(n.resources.codec_speeds))
             for n in nodes]
    site = {s.node_id: s.site for s in specs}
    measured = {(m.src_id, m.dst_id): Link(m.bandwidth, m.latency)
                for m in links if m.src_id in site and m.dst_id in site and m.bandwidth > 0}
    by_sites: dict[tuple[str, str], list[Link]] = {}
    for (a, b), lk in measured.items():
        if site[a] and site[b]:
            by_sites.setdefault((site[a], site[b]), []).append(lk)
    site_links = {pair: _median_link(found) for pair, found in by_sites.items()}
    for (sa, sb), lk in list(site_links.items()):
        site_links.setdefault((sb, sa), lk)
    return ClusterView(specs, measured, site_links=site_links)


def _median_link(links: list[Link]) -> Link:
    return Link(statistics.median(lk.bandwidth for lk in links),
                statistics.median(lk.latency for lk in links))


MEASURE_NEIGHBOURS = 8
"""A node measures its links to at most this many members of its own site (k)."""
MEASURE_SITES = 8
"""A site's representative measures its links to the representatives of at most this many
other sites."""


def band(order: Sequence[str], i: int, width: int) -> list[str]:
    """The neighbours of ``order[i]``: the members at most ``width // 2`` places from it.

    The relation is symmetric (``b`` is in ``a``'s band iff ``a`` is in
    ``b``'s), each member has at most ``width`` neighbours, and a sequence of
    at most ``width // 2 + 1`` members is complete.
    """
    h = width // 2
    return [order[j] for j in range(max(0, i - h), min(len(order), i + h + 1)) if j != i]


def measurement_peers(nodes: list[tracker_pb2.NodeInfo]) -> dict[str, list[str]]:
    """The directed links the tracker measures among ``nodes``: peers by node id.

    The rule (its incremental form is :class:`fedpipe.tracker.links.LinkMeasurer`):
    group nodes into sites (:func:`site_of`), each ordered by registration
    (then node id); a node measures its links to its :func:`band` of
    :data:`MEASURE_NEIGHBOURS` within its site, and each site's
    representative (its oldest node) to the band of :data:`MEASURE_SITES` among
    the representatives, ordered the same way. So each node measures at most
    ``MEASURE_NEIGHBOURS + MEASURE_SITES`` links, a joining node adds O(k)
    measurements, not O(n), and a small site (up to ``MEASURE_NEIGHBOURS // 2 + 1``
    nodes) is measured in full, both ways. The planner's assumption for the
    other pairs is :func:`cluster_view`'s. O(n log n).
    """
    sites: dict[str, list[str]] = {}
    for n in sorted(nodes, key=lambda n: (n.registered, n.node_id)):
        sites.setdefault(site_of(n.address), []).append(n.node_id)
    peers: dict[str, list[str]] = {}
    for members in sites.values():
        for i, m in enumerate(members):
            peers[m] = band(members, i, MEASURE_NEIGHBOURS)
    reps = [members[0] for members in sites.values()]  # sites in their rep's order
    for i, r in enumerate(reps):
        peers[r] += band(reps, i, MEASURE_SITES)
    return peers


def unmeasured(nodes: list[tracker_pb2.NodeInfo], links: list[node_pb2.LinkMeasurement]
               ) -> list[tuple[str, str]]:
    """Ordered pairs ``(src_id, dst_id)`` of ``nodes`` that the tracker measures
    (:func:`measurement_peers`) not measured since both registered. O(n log n + len(links))."""
    seen = {(m.src_id, m.dst_id): m.measured_at for m in links}
    registered = {n.node_id: n.registered for n in nodes}
    return [(a, b) for a, peers in measurement_peers(nodes).items() for b in peers
            if seen.get((a, b), 0) < max(registered[a], registered[b])]


def memory_shares(nodes: list[tracker_pb2.NodeInfo]) -> dict[str, int]:
    """Per node id, the memory its stages may use, bytes, as the planner sees it: its
    own, but no more than its share of its host's among ``nodes``
    (:func:`~fedpipe.planner.costs.host_memory_shares`)."""
    return host_memory_shares(cluster_view(nodes, []).nodes)


def model_profile(p: tracker_pb2.ModelProfile) -> ModelProfile:
    """The planner's model profile from its message (FLOP per sample, bytes per sample)."""
    return ModelProfile([LayerProfile(lp.name, lp.flops, lp.activation_bytes, lp.parameter_bytes,
                                      lp.activation_width) for lp in p.layers], p.input_bytes)


def train_config(spec: JobSpec) -> TrainConfig:
    """The planner's training config for a job: every node keeps its stages'
    checkpoint snapshots and, as a buddy, as many of another stage's; the state kept
    per parameter byte is the job's optimizer's (:func:`fedpipe.spec.optimizers.state_factor`)."""
    return TrainConfig(batch_size=spec.batch_size, microbatches=spec.microbatches,
                       schedule=spec.schedule, max_staleness=spec.max_staleness,
                       state_factor=state_factor(spec.optimizer_kind),
                       step_scratch=step_scratch(spec.optimizer_kind),
                       stages=spec.stages, cuts=spec.cuts, replicas=spec.replicas,
                       activation_compression=spec.activation_compression,
                       gradient_compression=spec.gradient_compression,
                       sync_every=spec.sync_every, snapshot_copies=2 * SNAPSHOTS_KEPT,
                       recompute=spec.recompute, precision=spec.precision)


def assignment_memory_bytes(plan: node_pb2.Plan, a: node_pb2.StageAssignment,
                            profile: ModelProfile, config: TrainConfig) -> float:
    """The predicted peak memory of stage ``a`` of the plan message ``plan``, bytes
    (:func:`~fedpipe.planner.costs.stage_memory_bytes` at its place in its group's
    chain, with its group's microbatches, the codecs it and its neighbours send, and
    whether it recomputes);
    0 when ``profile`` does not cover the stage's layers (no profile).

    Raises:
        PlanError: the plan names an unknown codec.
    """
    if a.layer_end > len(profile.layers) or a.layer_start >= a.layer_end:
        return 0.0
    view = PlanView(plan)
    before, after = view.neighbours(StageKey(a.replica, a.stage))
    codecs = StageCodecs(a.activation_codec or "raw", a.gradient_codec or "raw",
                         before.activation_codec or "raw" if before is not None else "raw",
                         after.gradient_codec or "raw" if after is not None else "raw")
    return stage_memory_bytes(profile, a.layer_start, a.layer_end, config, a.stage,
                              view.depth(a.replica), view.microbatches(a.replica), codecs,
                              recompute=a.recompute, snapshots_on_disk=a.snapshots_on_disk)


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
                        sync_seconds=plan.sync_seconds, calibrated=plan.calibrated)
    for r, group in enumerate(plan.groups):
        msg.replicas.append(node_pb2.ReplicaInfo(microbatches=group.microbatches,
                                                 samples=group.samples,
                                                 predicted_seconds=group.predicted_seconds))
        for i, s in enumerate(group.stages):
            n = nodes[s.node_id]
            msg.stages.append(node_pb2.StageAssignment(
                replica=r, stage=i, node_id=s.node_id, node_name=n.name, address=n.address,
                data_address=n.data_address, relay=n.relay,
                layer_start=s.layer_start, layer_end=s.layer_end,
                activation_codec=s.activation_codec, gradient_codec=s.gradient_codec,
                recompute=s.recompute, snapshots_on_disk=n.resources.snapshots_on_disk))
    msg.summary = plan_summary(msg)
    return msg


def plan_summary(msg: node_pb2.Plan) -> str:
    """A plan message's one-line summary: each stage's node and layers, in order, each
    after "group R " when there are several groups ("node0: layers 0-2; node1: layer 3")."""
    view = PlanView(msg)
    tag = len(view.replicas) > 1
    return "; ".join(f"{'group %d ' % k.replica if tag else ''}{a.node_name}: "
                     f"{layer_range(a.layer_start, a.layer_end)}"
                     for k, a in sorted(view.stages.items()))


def move_to(a: node_pb2.StageAssignment, node: tracker_pb2.NodeInfo) -> None:
    """Stage ``a`` moves to ``node`` (a recovery, a drain, a rebuilt replica group): its
    addresses and snapshot keeping become the node's, and its predicted split, priced on
    the node it had, is cleared until the plan is priced again (:func:`set_predicted`)."""
    a.node_id, a.node_name, a.address = node.node_id, node.name, node.address
    a.data_address, a.relay = node.data_address, node.relay
    a.snapshots_on_disk = node.resources.snapshots_on_disk
    a.predicted_compute_seconds = a.predicted_send_seconds = 0.0


def set_predicted(msg: node_pb2.Plan, costs: Mapping[StageKey, StageCost]) -> None:
    """Write each stage's predicted compute and send seconds per step (``costs``, from
    :func:`~fedpipe.planner.simulate.stage_costs` as the tracker priced the plan) on its
    assignment in ``msg``: the one home of a plan's per-stage prediction, which ``fedpipe
    status`` and the dashboard both show. A stage ``costs`` lacks keeps 0 (none)."""
    for a in msg.stages:
        cost = costs.get(StageKey(a.replica, a.stage))
        a.predicted_compute_seconds = cost.compute if cost is not None else 0.0
        a.predicted_send_seconds = cost.send if cost is not None else 0.0


def predicted_of(msg: node_pb2.Plan) -> dict[StageKey, tuple[float, float]]:
    """Per stage of ``msg``, its ``(compute, send)`` predicted seconds per step as the
    tracker priced them when it made the plan (:func:`set_predicted`); stages without a
    prediction are left out."""
    return {StageKey(a.replica, a.stage): (a.predicted_compute_seconds, a.predicted_send_seconds)
            for a in msg.stages if a.predicted_compute_seconds > 0}


def plan_from_message(msg: node_pb2.Plan) -> Plan:
    """The planner's :class:`~fedpipe.planner.Plan` of a job's plan message: the
    inverse of :func:`plan_message` (node names, addresses and the summary stay
    in the message)."""
    view = PlanView(msg)
    groups = []
    for r, chain in zip(view.replicas, view.chains()):
        info = msg.replicas[r] if r < len(msg.replicas) else node_pb2.ReplicaInfo()
        groups.append(ReplicaGroup(
            [StagePlan(a.node_id, a.layer_start, a.layer_end, a.activation_codec,
                       a.gradient_codec, a.recompute) for a in chain],
            info.microbatches, info.samples, info.predicted_seconds))
    return Plan(groups, msg.predicted_step_seconds, sync_seconds=msg.sync_seconds,
                calibrated=msg.calibrated)


def codec_speeds(speeds: Iterable[node_pb2.CodecSpeed]) -> tuple[CodecSpeed, ...]:
    """A node's advertised codec costs (``Resources.codec_speeds``) as the planner's."""
    return tuple(CodecSpeed(s.codec, s.encode_fixed, s.encode_per_byte, s.decode_fixed,
                            s.decode_per_byte) for s in speeds)


def codec_speed_messages(speeds: Iterable[CodecSpeed]) -> list[node_pb2.CodecSpeed]:
    """Codec costs as a node advertises them (``Resources.codec_speeds``): the inverse of
    :func:`codec_speeds`."""
    return [node_pb2.CodecSpeed(**dataclasses.asdict(s)) for s in speeds]
