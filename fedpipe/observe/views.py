"""The figures every view shows, computed once from plain data.

Inputs are the protocol's messages (``NodeInfo``, ``LinkMeasurement``,
``JobInfo``, ``JobEvent``, ``Plan``) and the planner's dataclasses; outputs are
dataclasses (:class:`StepRecord`, :class:`PlanLayout`) and the JSON-shaped
dicts of the tracker's HTTP API (``*_view`` functions; the API is documented in
``docs/metrics.md``). Nothing here does I/O or imports torch. The tracker's
HTTP server uses it; the tracker's core does not (a plan's conversion lives in
:mod:`fedpipe.planner.protoio`, a stage's step split in
:class:`fedpipe.planner.types.StageTime`, a recovery's words in
:mod:`fedpipe.recovery_text`; all three are re-exported here for the views).

Units: seconds, bytes, bytes/s, FLOP/s; times are seconds since the epoch.
Numbers that are not finite (a diverged loss) become ``None`` in the JSON views,
since JSON has no NaN.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .. import planner
from ..planner.costs import host_memory_shares
from ..planner.protoio import cluster_view, plan_from_message, predicted_of
from ..planner.simulate import stage_costs
from ..planner.types import StageTime, reach
from ..proto import node_pb2, tracker_pb2
from ..recovery_text import recovery_headline, recovery_what
from ..spec import ACTIVE, NODE_DRAINED, NODE_LEFT, TERMINAL, StageKey, state_name

# ---------------------------------------------------------------------------
# Steps


@dataclass(frozen=True)
class StepRecord:
    """One completed step of a job, as the tracker recorded it.

    Attributes:
        step: the step number (1-based: the count of completed steps).
        time: when the tracker recorded it, seconds since the epoch.
        loss: the step's batch-mean loss (NaN if it diverged).
        samples_per_second: the step's samples over its slowest group's wall time.
        epoch: the job's plan epoch (a recovery starts a new one and may
            record steps it had recorded before: they were replayed).
        seq: the event's sequence number.
        stages: each stage's time split for this step, where reported.
    """

    step: int
    time: float
    loss: float
    samples_per_second: float
    epoch: int = 0
    seq: int = 0
    stages: tuple[StageTime, ...] = ()


def is_step_event(ev: tracker_pb2.JobEvent) -> bool:
    """A completed step (``step > 0``), not a state change or a checkpoint."""
    return ev.step > 0 and ev.checkpoint_step == 0


def is_checkpoint_event(ev: tracker_pb2.JobEvent) -> bool:
    """A checkpoint every stage acknowledged."""
    return ev.checkpoint_step > 0


def step_records(events: Iterable[tracker_pb2.JobEvent]) -> list[StepRecord]:
    """The step events of ``events`` as records, in event order (replayed steps included)."""
    return [StepRecord(ev.step, ev.time, ev.loss, ev.samples_per_second, ev.epoch, ev.seq)
            for ev in events if is_step_event(ev)]


def latest_per_step(records: Sequence[StepRecord]) -> list[StepRecord]:
    """One record per step number, the last recorded (a replay wins), by step."""
    last: dict[int, StepRecord] = {}
    for r in records:
        last[r.step] = r
    return [last[s] for s in sorted(last)]


MEASURE_WINDOW = 20
"""Consecutive steps :func:`measured_step_seconds` takes the median over."""


def measured_step_seconds(records: Sequence[StepRecord], window: int = MEASURE_WINDOW
                          ) -> float | None:
    """The measured step time: the median gap between the tracker's records of
    consecutive steps of one epoch, over the last ``window`` such gaps, seconds.

    The gap is what a user waits per step (stage compute, waiting and sending,
    reports), comparable with a plan's ``predicted_step_seconds``. A pause (no
    data fed, a recovery) shows as one long gap, which the median discounts.
    None while fewer than two consecutive steps are recorded.
    """
    gaps: list[float] = []
    for prev, cur in zip(records, records[1:]):
        if cur.step == prev.step + 1 and cur.epoch == prev.epoch:
            gaps.append(cur.time - prev.time)
    gaps = gaps[-window:]
    return statistics.median(gaps) if gaps else None


class History:
    """A job's step records and state changes, read incrementally from its events.

    Feed it the events after :attr:`last_seq` (``source.events(job, h.last_seq)``).
    Memory is bounded: beyond ``max_records`` step records, every other record of
    the older half is dropped (the curve keeps its shape and its latest steps
    exactly); beyond ``max_changes`` state changes, the oldest go.

    Not thread-safe: guard a shared one with a lock.
    """

    def __init__(self, max_records: int = 4000, max_changes: int = 500):
        if max_records < 4:
            raise ValueError(f"max_records must be at least 4, got {max_records}")
        self.max_records = max_records
        self.records: list[StepRecord] = []
        self.changes: deque[tracker_pb2.JobEvent] = deque(maxlen=max_changes)
        self.checkpoints: deque[tracker_pb2.JobEvent] = deque(maxlen=max_changes)
        self.last_seq = 0

    def extend(self, events: Iterable[tracker_pb2.JobEvent]) -> None:
        """Add events (in order, each with ``seq > last_seq``; older ones are ignored)."""
        for ev in events:
            if ev.seq <= self.last_seq:
                continue
            self.last_seq = ev.seq
            if is_step_event(ev):
                self.records.extend(step_records([ev]))
            elif is_checkpoint_event(ev):
                self.checkpoints.append(ev)
            else:
                self.changes.append(ev)
        if len(self.records) > self.max_records:
            half = len(self.records) // 2
            self.records = self.records[:half:2] + self.records[half:]

    @property
    def last(self) -> StepRecord | None:
        """The latest step record, or None."""
        return self.records[-1] if self.records else None


# ---------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class StageBox:
    """One stage of a plan as drawn: where it runs, its layers, what it sends.

    Attributes:
        predicted_compute: predicted forward + backward seconds per step
            (None without a model profile).
        predicted_send: predicted seconds per step its outgoing links are busy
            with its activations and gradients (None without a profile).
        measured: the stage's reported split of its last step, if reported.
        recompute: the stage re-runs its forward in backward, keeping only its inputs
            (``StageAssignment.recompute``: ``recompute=True``, or chosen by "auto").
        relay: the relay its node is homed at, outbound-only behind NAT
            (``StageAssignment.relay``, :attr:`fedpipe.planner.NodeSpec.relay`; "": its
            node is reached directly). Said in words by :func:`reach`.
    """

    replica: int
    stage: int
    node_id: str
    node_name: str
    device: str
    layer_start: int
    layer_end: int
    activation_codec: str
    gradient_codec: str
    predicted_compute: float | None = None
    predicted_send: float | None = None
    measured: StageTime | None = None
    recompute: bool = False
    relay: str = ""

    @property
    def key(self) -> StageKey:
        return StageKey(self.replica, self.stage)

    @property
    def predicted(self) -> float | None:
        """Predicted busy seconds per step: compute + sending."""
        if self.predicted_compute is None:
            return None
        return self.predicted_compute + (self.predicted_send or 0.0)


@dataclass(frozen=True)
class PlanLayout:
    """A plan as drawn: replica groups × stages, the bottleneck, predicted and measured.

    Attributes:
        groups: each group's stages, first to last.
        bottleneck: the stage busiest per step, or None (one stage, or no figures).
        bottleneck_basis: "measured" (every stage reported its step split; the
            stage with the most compute + send time), "predicted" (from the
            model profile and the nodes' speeds and links), or "".
        measured_step_seconds: see :func:`measured_step_seconds`; None if unknown.
    """

    groups: tuple[tuple[StageBox, ...], ...]
    predicted_step_seconds: float
    sync_seconds: float = 0.0
    schedule: str = ""
    bottleneck: StageKey | None = None
    bottleneck_basis: str = ""
    measured_step_seconds: float | None = None

    @property
    def stages(self) -> list[StageBox]:
        return [b for g in self.groups for b in g]


def predicted_stage_seconds(plan: planner.Plan, cluster: planner.ClusterView,
                            profile: planner.ModelProfile, config: planner.TrainConfig
                            ) -> dict[StageKey, tuple[float, float]]:
    """Per stage, ``(compute, send)`` predicted seconds per step, priced as the
    simulator prices them (:func:`fedpipe.planner.simulate.stage_costs`).

    Raises:
        KeyError: the plan names a node the cluster lacks.
        PlanError: an unknown codec.
    """
    return {key: (c.compute, c.send)
            for key, c in stage_costs(plan, cluster, profile, config).items()}


def plan_layout(plan: planner.Plan, *, names: Mapping[str, str] | None = None,
                devices: Mapping[str, str] | None = None,
                relays: Mapping[str, str] | None = None,
                cluster: planner.ClusterView | None = None,
                profile: planner.ModelProfile | None = None,
                config: planner.TrainConfig | None = None,
                stage_times: Sequence[StageTime] = (),
                measured_step: float | None = None,
                predicted: Mapping[StageKey, tuple[float | None, float | None]] | None = None
                ) -> PlanLayout:
    """Lay a plan out for drawing and find its bottleneck stage.

    Args:
        plan: the planner's plan (a job's: :func:`plan_from_message`).
        names, devices, relays: node id -> name, device and the relay an outbound-only
            node is homed at (default: from ``cluster``, else the id, "" and "").
        cluster, profile, config: when all three are given, each stage gets its
            predicted compute and send seconds (:func:`predicted_stage_seconds`).
        stage_times: the stages' reported step splits; when every stage has
            one, the bottleneck is the measured one.
        measured_step: the job's measured step time, seconds.
        predicted: per stage, ``(compute, send)`` predicted seconds per step as
            the tracker priced them when it made the plan (the plan's assignments:
            :func:`~fedpipe.planner.protoio.predicted_of`; either may be None); used
            where ``cluster``, ``profile`` and ``config`` are not given.

    Raises:
        KeyError, PlanError: as :func:`predicted_stage_seconds`.
    """
    names = dict(names or {})
    devices = dict(devices or {})
    relays = dict(relays or {})
    if cluster is not None:
        for n in cluster.nodes:
            names.setdefault(n.node_id, n.name or n.node_id)
            devices.setdefault(n.node_id, n.device)
            relays.setdefault(n.node_id, n.relay)
    priced: Mapping[StageKey, tuple[float | None, float | None]] = (
        dict(predicted or {}) if cluster is None or profile is None or config is None
        else predicted_stage_seconds(plan, cluster, profile, config))
    measured = {StageKey(t.replica, t.stage): t for t in stage_times}
    groups = []
    for r, g in enumerate(plan.groups):
        boxes = []
        for i, s in enumerate(g.stages):
            key = StageKey(r, i)
            comp, send = priced.get(key, (None, None))
            boxes.append(StageBox(r, i, s.node_id, names.get(s.node_id, s.node_id),
                                  devices.get(s.node_id, ""), s.layer_start, s.layer_end,
                                  s.activation_codec, s.gradient_codec, comp, send,
                                  measured.get(key), s.recompute,
                                  relays.get(s.node_id, "")))
        groups.append(tuple(boxes))
    boxes = [b for g in groups for b in g]
    bottleneck, basis = None, ""
    if len(boxes) > 1:
        if all(b.measured is not None for b in boxes):
            bottleneck = max(boxes, key=lambda b: b.measured.compute + b.measured.send).key
            basis = "measured"
        elif all(b.predicted is not None for b in boxes):
            bottleneck, basis = max(boxes, key=lambda b: b.predicted).key, "predicted"
    return PlanLayout(tuple(groups), plan.predicted_step_seconds, plan.sync_seconds,
                      plan.schedule or (config.schedule if config else ""), bottleneck, basis,
                      measured_step)


# ---------------------------------------------------------------------------
# JSON views (the HTTP API's bodies)


def _num(x: float | None) -> float | None:
    """A JSON-safe number: None for None, NaN and infinities."""
    return x if x is not None and math.isfinite(x) else None


def node_view(n: tracker_pb2.NodeInfo, now: float) -> dict:
    """One node: identity, device, speed, memory, and alive (or draining) or lost and why;
    ``reach`` says how peers reach it: "outbound-only via RELAY" for a node behind NAT homed
    at that relay (its addresses are the relay's ports), "direct" otherwise.

    A lost node's ``why`` is the tracker's ``lost_reason``: a node that left on purpose
    says so ("left the swarm after its drain"); one that missed its lease, or whose
    reason the tracker does not know, says how long ago its last heartbeat came.
    """
    r = n.resources
    last = time.strftime("%H:%M:%S", time.localtime(n.last_heartbeat))
    if n.alive:
        why = ""
    elif _left(n):
        why = f"{n.lost_reason} (last heartbeat {last})"
    elif n.lost_reason:
        why = f"lost: {n.lost_reason} (last heartbeat {last})"
    else:
        why = (f"lost: no heartbeat for {max(0.0, now - n.last_heartbeat):.0f} s "
               f"(last {last})")
    return {"id": n.node_id, "name": n.name, "address": n.address, "alive": n.alive,
            "state": (("draining" if n.draining else "alive") if n.alive
                      else "left" if _left(n) else "lost"), "why": why,
            "device": r.device, "device_name": r.device_name, "cores": r.cores,
            "flops": r.flops, "memory_bytes": r.memory_bytes, "hostname": r.hostname,
            "last_heartbeat": n.last_heartbeat, "registered": n.registered,
            "relay": n.relay, "reach": reach(n.relay)}


def _left(n: tracker_pb2.NodeInfo) -> bool:
    """Whether node ``n`` is gone because it left on purpose (stopped, or drained), not
    lost: the tracker's reason says so."""
    return not n.alive and n.lost_reason in (NODE_LEFT, NODE_DRAINED)


def swarm_view(nodes: Sequence[tracker_pb2.NodeInfo],
               links: Sequence[node_pb2.LinkMeasurement], now: float | None = None) -> dict:
    """The swarm: nodes, links, the link matrix and the live capacity.

    ``matrix`` is over the nodes in order (``names``, ``ids``):
    ``bandwidth[i][j]`` (bytes/s) and ``latency[i][j]`` (seconds) of the link
    from node i to node j, None where unmeasured; ``links`` lists those between live
    nodes only (a gone node's stay in the matrix, not in the links table). ``totals`` counts
    the nodes alive, those that left on purpose (stopped or drained) and those lost
    apart, and sums the live nodes' FLOP/s and memory bytes, nodes that share a host
    counted within its memory, as the planner counts them
    (:func:`~fedpipe.planner.costs.host_memory_shares`).
    """
    now = time.time() if now is None else now
    ids = [n.node_id for n in nodes]
    at = {nid: i for i, nid in enumerate(ids)}
    names = {n.node_id: n.name for n in nodes}
    bw: list[list[float | None]] = [[None] * len(ids) for _ in ids]
    lat: list[list[float | None]] = [[None] * len(ids) for _ in ids]
    out_links = []
    alive = {n.node_id for n in nodes if n.alive}
    for m in links:
        if m.src_id in alive and m.dst_id in alive:
            out_links.append({"src": m.src_id, "dst": m.dst_id,
                              "src_name": names.get(m.src_id, m.src_id),
                              "dst_name": names.get(m.dst_id, m.dst_id),
                              "bandwidth": m.bandwidth, "latency": m.latency,
                              "measured_at": m.measured_at})
        if m.src_id in at and m.dst_id in at:
            bw[at[m.src_id]][at[m.dst_id]] = _num(m.bandwidth)
            lat[at[m.src_id]][at[m.dst_id]] = _num(m.latency)
    live = [n for n in nodes if n.alive]
    left = sum(1 for n in nodes if _left(n))
    return {"time": now,
            "nodes": [node_view(n, now) for n in nodes],
            "links": out_links,
            "matrix": {"ids": ids, "names": [names[i] for i in ids], "bandwidth": bw,
                       "latency": lat},
            "totals": {"alive": len(live), "left": left, "lost": len(nodes) - len(live) - left,
                       "flops": sum(n.resources.flops for n in live),
                       "memory_bytes": sum(host_memory_shares(
                           cluster_view(live, []).nodes).values())}}


def _event_view(ev: tracker_pb2.JobEvent) -> dict:
    return {"seq": ev.seq, "time": ev.time, "state": state_name(ev.state), "reason": ev.reason,
            "epoch": ev.epoch, "checkpoint_step": ev.checkpoint_step}


def stage_timings(info: tracker_pb2.JobInfo) -> list[StageTime]:
    """A job's measured per-stage step splits as ``GetJob`` carries them
    (``JobInfo.stage_times``)."""
    return [StageTime(t.replica, t.stage, t.compute_seconds, t.wait_seconds, t.send_seconds,
                      t.peak_memory_bytes, t.predicted_memory_bytes) for t in info.stage_times]


def job_layout(info: tracker_pb2.JobInfo, history: History,
               stage_times: Sequence[StageTime] | None = None,
               devices: Mapping[str, str] | None = None) -> PlanLayout | None:
    """Job ``info``'s plan laid out (:func:`plan_layout`), the same for ``fedpipe status``
    and the dashboard: each stage's predicted split is the one the tracker priced the plan
    with (:func:`~fedpipe.planner.protoio.predicted_of`), its measured split
    ``stage_times`` (a source that keeps them), else what ``GetJob`` carries
    (:func:`stage_timings`); ``devices``: node id -> device. None before it is planned."""
    if not info.plan.stages:
        return None
    return plan_layout(plan_from_message(info.plan),
                       names={a.node_id: a.node_name for a in info.plan.stages},
                       relays={a.node_id: a.relay for a in info.plan.stages}, devices=devices,
                       stage_times=stage_timings(info) if stage_times is None else stage_times,
                       measured_step=measured_step_seconds(history.records),
                       predicted=predicted_of(info.plan))


def _stage_time_view(t: StageTime | None) -> dict | None:
    return None if t is None else {"compute": t.compute, "wait": t.wait, "send": t.send}


def _memory_view(t: StageTime | None) -> dict:
    """A stage's memory, bytes: its measured peak and the planner's prediction (None
    where not reported)."""
    return {"peak": t.peak_memory or None if t else None,
            "predicted": t.predicted_memory or None if t else None}


def recovery_view(rec: tracker_pb2.Recovery) -> dict:
    """One recovery: when, its cause ("loss", "drain", "rebalance", or the client's), who
    was lost (``lost``; "" for a rebalance), the nodes stages moved from and to, both in
    words (``what``, :func:`recovery_what`), the checkpoint, the steps recomputed, and the
    seconds it took to detect, replan and restore."""
    return {"time": rec.time, "cause": rec.cause or "loss", "lost": rec.lost,
            "moved_from": rec.moved_from, "moved_to": rec.moved_to, "what": recovery_what(rec),
            "checkpoint_step": rec.checkpoint_step,
            "steps_recomputed": rec.steps_recomputed, "detect_seconds": rec.detect_seconds,
            "replan_seconds": rec.replan_seconds, "restore_seconds": rec.restore_seconds,
            "epoch": rec.epoch,
            "seconds": rec.detect_seconds + rec.replan_seconds + rec.restore_seconds}


def job_summary(info: tracker_pb2.JobInfo, last: StepRecord | None) -> dict:
    """A job in a list: state and reason, progress, loss, samples/s, recoveries.

    ``loss`` is the job's (the tracker's last completed step); ``samples_per_second``
    is the last recorded step's (None before the first step).
    """
    return {"id": info.job_id, "name": info.name, "state": state_name(info.state),
            "reason": info.reason, "step": info.step, "steps": info.steps,
            "progress": info.step / info.steps if info.steps else 0.0,
            "loss": _num(info.loss) if info.step else None,
            "samples_per_second": _num(last.samples_per_second) if last else None,
            "created": info.created, "epoch": info.epoch,
            "checkpoint_step": info.checkpoint_step, "recoveries": len(info.recoveries),
            "active": info.state in ACTIVE, "terminal": info.state in TERMINAL}


def layout_view(layout: PlanLayout) -> dict:
    """A plan layout as JSON: groups of stages and the bottleneck (the step times are
    the job's, in :func:`job_view`)."""
    def box(b: StageBox) -> dict:
        return {"replica": b.replica, "stage": b.stage, "node_id": b.node_id,
                "node_name": b.node_name, "device": b.device, "layer_start": b.layer_start,
                "layer_end": b.layer_end, "activation_codec": b.activation_codec,
                "gradient_codec": b.gradient_codec,
                "predicted_compute": _num(b.predicted_compute),
                "predicted_send": _num(b.predicted_send),
                "measured": _stage_time_view(b.measured),
                "memory": _memory_view(b.measured), "recompute": b.recompute,
                "relay": b.relay, "reach": reach(b.relay),
                "bottleneck": layout.bottleneck == b.key}

    return {"groups": [[box(b) for b in g] for g in layout.groups],
            "schedule": layout.schedule, "sync_seconds": layout.sync_seconds,
            "bottleneck": list(layout.bottleneck) if layout.bottleneck else None,
            "bottleneck_basis": layout.bottleneck_basis}


def record_view(r: StepRecord) -> dict:
    """One step record as JSON."""
    return {"step": r.step, "time": r.time, "loss": _num(r.loss),
            "samples_per_second": _num(r.samples_per_second), "epoch": r.epoch, "seq": r.seq,
            "stages": [{"replica": t.replica, "stage": t.stage, **_stage_time_view(t)}
                       for t in r.stages]}


def job_view(info: tracker_pb2.JobInfo, history: History, layout: PlanLayout | None,
             config: node_pb2.JobConfig | None = None) -> dict:
    """A job in full: its summary, plan layout, step history, state changes,
    checkpoints and recoveries, and predicted against measured step time."""
    out = job_summary(info, history.last)
    measured = measured_step_seconds(history.records)
    out.update({
        "plan": layout_view(layout) if layout is not None else None,
        "summary": info.plan.summary,
        "step_seconds": {"predicted": _num(info.plan.predicted_step_seconds) or None,
                         "measured": _num(measured),
                         "calibrated": info.plan.calibrated},
        "history": [record_view(r) for r in history.records],
        "events": [_event_view(ev) for ev in history.changes],
        "checkpoints": [{"step": ev.checkpoint_step, "time": ev.time, "epoch": ev.epoch,
                         "seq": ev.seq}
                        for ev in history.checkpoints],
        "recoveries": [recovery_view(r) for r in info.recoveries],
        "last_seq": history.last_seq,
    })
    if config is not None:
        out["config"] = {"batch_size": config.batch_size, "microbatches": config.microbatches,
                         "schedule": config.schedule, "replica_sync": config.replica_sync,
                         "activation_compression": config.activation_compression,
                         "gradient_compression": config.gradient_compression,
                         "checkpoint_every": config.checkpoint_every,
                         "precision": config.precision or "fp32",
                         "recompute": config.recompute or "off"}
    return out


__all__ = ["History", "PlanLayout", "StageBox", "StageTime", "StepRecord", "is_step_event",
           "is_checkpoint_event", "job_layout", "job_summary", "job_view", "latest_per_step",
           "layout_view",
           "measured_step_seconds", "node_view", "plan_from_message", "plan_layout",
           "predicted_stage_seconds", "record_view", "recovery_headline", "recovery_view",
           "recovery_what", "stage_timings",
           "step_records", "swarm_view"]
