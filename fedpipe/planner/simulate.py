"""Discrete-event simulator of one training step under the GPipe, 1F1B and async schedules.

Each stage is a resource that runs its forward (F) and backward (B) passes in
the order its schedule gives; each directed link is a resource that sends one
tensor at a time, first come first served, and delivers it ``latency`` seconds
after the send ends. Dependencies: F(i, m) -> send -> F(i+1, m) and
B(i+1, m) -> send -> B(i, m). After its last backward pass a node joins the
all-reduce rings of its layers (:func:`fedpipe.planner.costs.schedule_sync`),
then runs its optimizer step. Each pass and message also pays the cluster's
fixed :class:`~fedpipe.planner.types.Overheads`, and nodes that share a
machine's cores compute slower (:func:`~fedpipe.planner.costs.host_factors`).
The plan's ``predicted_step_seconds`` is this simulator's answer.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from ..spec import Action, SpecError, StageKey, async_stream, schedule_order, stage_recomputes
from .costs import (ChainStage, chain_costs, host_factors, optimizer_seconds, pass_seconds,
                    precision_flops, schedule_sync, sync_per_step, sync_segments)
from .steptime import steps_in_flight, useful_overlap
from .types import (ClusterView, ModelProfile, NodeSpec, Overheads, Plan, PlanError,
                    TrainConfig)


class _Engine:
    """Operations on resources, with dependencies, run by an event loop.

    A resource either runs its operations in a fixed order (a stage's schedule)
    or first come first served (a link). An operation starts when its
    dependencies have delivered and its resource is free; it delivers
    ``lag`` seconds after it ends.
    """

    def __init__(self) -> None:
        self.dur: list[float] = []
        self.lag: list[float] = []
        self.res: list[int] = []
        self.succ: list[list[int]] = []
        self.npred: list[int] = []
        self.orders: list[list[int] | None] = []

    def resource(self, fixed_order: bool) -> int:
        self.orders.append([] if fixed_order else None)
        return len(self.orders) - 1

    def op(self, res: int, dur: float, lag: float = 0.0) -> int:
        self.dur.append(dur)
        self.lag.append(lag)
        self.res.append(res)
        self.succ.append([])
        self.npred.append(0)
        i = len(self.dur) - 1
        order = self.orders[res]
        if order is not None:
            order.append(i)
        return i

    def dep(self, before: int, after: int) -> None:
        self.succ[before].append(after)
        self.npred[after] += 1

    def run(self) -> list[float]:
        """Simulate; returns each operation's end time, seconds.

        Raises:
            RuntimeError: the operations deadlock (a bug in how they were built).
        """
        return _Run(self).run()


_FINISH, _DELIVER = 0, 1
"""Event kinds of :class:`_Run`: an operation ends (its resource is free), or it delivers
(its successors may start). At equal times a finish comes first."""


class _Run:
    """The state of one :meth:`_Engine.run`: the event loop over the engine's operations.

    Args:
        eng: the operations, resources and dependencies (not modified).
    """

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng
        n_res, n_ops = len(eng.orders), len(eng.dur)
        self.end = [-1.0] * n_ops
        self.npred = list(eng.npred)
        self.busy = [False] * n_res
        self.pos = [0] * n_res  # fixed-order resources: the next operation's place
        self.ready = [False] * n_ops
        self.fifo: list[list[tuple[float, int]]] = [[] for _ in range(n_res)]
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, op)
        self.seq = 0

    def run(self) -> list[float]:
        """Each operation's end time, seconds (see :meth:`_Engine.run`)."""
        for op in range(len(self.eng.dur)):
            if self.npred[op] == 0:
                self._make_ready(op, 0.0)
        while self.events:
            t, kind, _, op = heapq.heappop(self.events)
            if kind == _FINISH:
                self._finish(op, t)
            else:
                self._deliver(op, t)
        if min(self.end, default=0.0) < 0:
            raise RuntimeError("simulated operations deadlocked")
        return self.end

    def _push(self, t: float, kind: int, op: int) -> None:
        heapq.heappush(self.events, (t, kind, self.seq, op))
        self.seq += 1

    def _next_op(self, r: int) -> int | None:
        """The operation resource ``r`` may run now (taken from its queue), or None."""
        order = self.eng.orders[r]
        if order is not None:
            pos = self.pos[r]
            if pos >= len(order) or not self.ready[order[pos]]:
                return None
            self.pos[r] += 1
            return order[pos]
        if self.fifo[r]:
            return heapq.heappop(self.fifo[r])[1]
        return None

    def _start(self, r: int, t: float) -> None:
        """Start resource ``r``'s next operation at ``t`` if it is free and one may run."""
        if self.busy[r]:
            return
        op = self._next_op(r)
        if op is None:
            return
        self.busy[r] = True
        self.end[op] = t + self.eng.dur[op]
        self._push(self.end[op], _FINISH, op)

    def _make_ready(self, op: int, t: float) -> None:
        """Every dependency of ``op`` has delivered, at ``t``."""
        self.ready[op] = True
        r = self.eng.res[op]
        if self.eng.orders[r] is None:
            heapq.heappush(self.fifo[r], (t, op))
        self._start(r, t)

    def _finish(self, op: int, t: float) -> None:
        """``op`` ends at ``t``: it delivers ``lag`` later; its resource takes the next."""
        r = self.eng.res[op]
        self.busy[r] = False
        self._push(t + self.eng.lag[op], _DELIVER, op)
        self._start(r, t)

    def _deliver(self, op: int, t: float) -> None:
        """``op`` delivers at ``t``: successors with no dependency left become ready."""
        for nxt in self.eng.succ[op]:
            self.npred[nxt] -= 1
            if self.npred[nxt] == 0:
                self._make_ready(nxt, t)


@dataclass
class GroupTimeline:
    """One replica group's simulated step.

    Attributes:
        finish: when its last pass ends, seconds.
        last_backward: per stage, when its last backward pass ends, seconds.
        order: per stage, its passes in the order the simulation ran them.
    """

    finish: float
    last_backward: list[float]
    order: list[list[Action]]


def simulate_group(forward: Sequence[float], backward: Sequence[float],
                   act_busy: Sequence[float], act_latency: Sequence[float],
                   grad_busy: Sequence[float], grad_latency: Sequence[float],
                   microbatches: int, schedule: str,
                   optimizer: Sequence[float] | None = None,
                   max_staleness: int = 0) -> GroupTimeline:
    """Simulate one pipeline for one step.

    Under "async" with staleness, steps overlap (:func:`fedpipe.spec.async_stream`), so
    one step alone says little: a stream of :data:`STREAM_ROUNDS` rounds of ``k + 1``
    steps is simulated (``k`` the staleness that can bind,
    :func:`~fedpipe.planner.steptime.useful_overlap`), each stage's optimizer step after the
    last backward of each step, and the timeline is its steady state, away from both
    ends of the stream: ``finish`` is the seconds per step over the middle rounds
    (:data:`TIMED_ROUNDS`), ``last_backward`` each stage's last backward of the last
    timed step counted from that step's start (0 at least), ``order`` that step's passes.
    With staleness 0 it is one flushed step, as "1f1b".

    Args:
        forward, backward: per stage, seconds of one microbatch's pass.
        act_busy, act_latency: per link i -> i+1 (``len(forward) - 1`` of them),
            seconds the activation keeps the link busy and its latency.
        grad_busy, grad_latency: the same for the gradient sent from i+1 to i.
        microbatches: microbatches in the step.
        schedule: "gpipe", "1f1b" or "async".
        optimizer: per stage, seconds of its optimizer step, run after its
            last pass (None: none); ``finish`` includes it, ``last_backward`` not.
        max_staleness: under "async", steps a forward may run ahead of the updates.

    Raises:
        PlanError: unknown schedule.
    """
    n, m = len(forward), microbatches
    overlap = useful_overlap(steps_in_flight(schedule, max_staleness), m, n)
    steps = STREAM_ROUNDS * overlap if overlap > 1 else 1
    eng = _Engine()
    stage_res = [eng.resource(fixed_order=True) for _ in range(n)]
    act_res = [eng.resource(fixed_order=False) for _ in range(n - 1)]
    grad_res = [eng.resource(fixed_order=False) for _ in range(n - 1)]
    F: list[dict[int, int]] = [{} for _ in range(n)]
    B: list[dict[int, int]] = [{} for _ in range(n)]
    updates: list[list[int]] = [[] for _ in range(n)]  # per stage, its steps' last ops
    for s in range(n):
        try:  # the very list of actions the stage's runtime runs
            order = (async_stream(s, n, m, steps, overlap - 1) if overlap > 1
                     else schedule_order(schedule, s, n, m))
        except SpecError as e:
            raise PlanError(str(e)) from None
        for action in order:
            i = action.microbatch
            if action.kind == "F":
                F[s][i] = eng.op(stage_res[s], forward[s])
                continue
            B[s][i] = eng.op(stage_res[s], backward[s])
            if i % m == m - 1:  # the step's last backward (backwards run in order)
                updates[s].append(B[s][i] if optimizer is None
                                  else eng.op(stage_res[s], optimizer[s]))
    for i in range(steps * m):
        for s in range(n):
            eng.dep(F[s][i], B[s][i])
            if s + 1 < n:
                ta = eng.op(act_res[s], act_busy[s], act_latency[s])
                eng.dep(F[s][i], ta)
                eng.dep(ta, F[s + 1][i])
                tg = eng.op(grad_res[s], grad_busy[s], grad_latency[s])
                eng.dep(B[s + 1][i], tg)
                eng.dep(tg, B[s][i])
    end = eng.run()
    if steps == 1:
        timed, finish, start = 0, max(end, default=0.0), 0.0
    else:
        lo, hi = (r * overlap - 1 for r in TIMED_ROUNDS)  # the steps ending the rounds
        done = {k: max(end[u[k]] for u in updates) for k in (lo, hi)}  # when each ended
        timed = hi
        finish = (done[hi] - done[lo]) / (hi - lo)
        start = done[hi] - finish
    first = timed * m  # the timed step's first microbatch
    last_b = [max(0.0, end[B[s][first + m - 1]] - start) for s in range(n)]
    ran = [sorted([(end[op] - eng.dur[op], Action("F", i - first))
                   for i, op in F[s].items() if first <= i < first + m]
                  + [(end[op] - eng.dur[op], Action("B", i - first))
                     for i, op in B[s].items() if first <= i < first + m],
                  key=lambda e: e[0]) for s in range(n)]
    return GroupTimeline(finish, last_b, [[a for _, a in r] for r in ran])


STREAM_ROUNDS = 5
"""Rounds of ``k + 1`` steps (``k`` the staleness) :func:`simulate_group` runs of an
"async" stream."""
TIMED_ROUNDS = (2, 4)
"""The rounds whose steps :func:`simulate_group` times: after the first two (the stream
fills the pipeline) and before the last (it drains with no later forwards competing); two
rounds, as the steady state may repeat over more than one."""


@dataclass
class SimResult:
    """A simulated step.

    Attributes:
        step_seconds: the whole step, all-reduce included, seconds.
        group_seconds: per group, its forward and backward passes, seconds.
        sync_seconds: how much the all-reduce adds after the slowest group,
            divided by the config's ``sync_every`` (per step), seconds.
        busy: per node id, the fraction of the step it computes (what its host's
            sharing is priced by: :func:`~fedpipe.planner.costs.host_factors`).
    """

    step_seconds: float
    group_seconds: list[float]
    sync_seconds: float
    busy: dict[str, float] = field(default_factory=dict)


def group_shares(plan: Plan, config: TrainConfig) -> list[tuple[int, float]]:
    """Per group, ``(microbatches, samples)`` per step.

    A group's own fields win; where they are 0 the job's microbatches and
    samples are shared equally.
    """
    r = len(plan.groups)
    out = []
    for gi, g in enumerate(plan.groups):
        m = g.microbatches or max(1, config.microbatches // r + (gi < config.microbatches % r))
        samples = g.samples or m * config.batch_size / config.microbatches
        out.append((m, float(samples)))
    return out


def simulate(plan: Plan, cluster: ClusterView, profile: ModelProfile,
             config: TrainConfig) -> SimResult:
    """Simulate one optimizer step of ``plan``.

    Compute and transfer times come from :mod:`fedpipe.planner.costs` with each
    group's microbatch size and each stage's codecs.

    Raises:
        PlanError: unknown schedule or codec.
        KeyError: the plan names a node the cluster does not have.
    """
    nodes = {n.node_id: n for n in cluster.nodes}
    used = [nodes[i] for i in _node_ids(plan)]
    shared = {n.host for n in used if n.host and n.host_cores > 0}
    result = _simulate_once(plan, cluster, profile, config, host_factors(used))
    if any(sum(n.host == h for n in used) > 1 for h in shared):
        # a fixed point: the nodes' busy fractions set the host's slowdown, which sets
        # their busy fractions; a few rounds settle it (pipelines idle in their bubbles
        # and while waiting on slow links, so they contend less than always-on threads)
        for _ in range(HOST_ROUNDS):
            result = _simulate_once(plan, cluster, profile, config,
                                    host_factors(used, result.busy))
    return result


HOST_ROUNDS = 3
"""Rounds of :func:`simulate`'s fixed point between busy fractions and host sharing."""


def _simulate_once(plan: Plan, cluster: ClusterView, profile: ModelProfile,
                   config: TrainConfig, host: dict[str, float]) -> SimResult:
    """:func:`simulate` with each node's host slowdown given."""
    nodes = {n.node_id: n for n in cluster.nodes}
    speeds = {n.node_id: n.codec_speeds for n in cluster.nodes}
    over = cluster.overheads
    compute: dict[str, float] = {}  # node id -> its compute seconds per step
    group_seconds: list[float] = []
    ready: dict[Hashable, float] = {}  # node id -> end of its last backward pass, seconds
    for g, (m, samples) in zip(plan.groups, group_shares(plan, config)):
        mb = samples / m
        st = g.stages

        def passes(s: ChainStage, mb: float = mb) -> tuple[float, float]:
            return _passes(profile, s, nodes[s.node_id], mb, config, over, host[s.node_id])

        costs = chain_costs(profile, st, mb, passes, cluster.link, over.message, speeds, m,
                            config.precision)
        fwd, bwd = costs.forward, costs.backward
        opt = [optimizer_seconds(profile, s.layer_start, s.layer_end, over, host[s.node_id])
               for s in st]
        tl = simulate_group(fwd, bwd, costs.act_busy, costs.act_latency, costs.grad_busy,
                            costs.grad_latency, m, config.schedule, opt, config.max_staleness)
        for s, f, b, o in zip(st, fwd, bwd, opt):
            compute[s.node_id] = compute.get(s.node_id, 0.0) + m * (f + b) + o
        group_seconds.append(tl.finish)
        ready.update((s.node_id, t) for s, t in zip(st, tl.last_backward))

    def link(a: str, b: str) -> tuple[float, float]:
        lk = cluster.link(a, b)
        return lk.bandwidth, lk.latency

    segments = sync_segments([[(s.node_id, s.layer_start, s.layer_end) for s in g.stages]
                              for g in plan.groups], profile, link)
    slowest = max(group_seconds, default=0.0)
    extra = sync_per_step(slowest, schedule_sync(segments, ready), config)
    step = slowest + extra
    return SimResult(step, group_seconds, extra,
                     {n: min(1.0, c / step) if step > 0 else 1.0 for n, c in compute.items()})


def _passes(profile: ModelProfile, s: ChainStage, node: NodeSpec, samples: float,
            config: TrainConfig, over: Overheads, host: float) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one microbatch through stage ``s`` on ``node``:
    at the config's precision, a recomputing stage's backward with its extra forward."""
    return pass_seconds(profile, s.layer_start, s.layer_end,
                        precision_flops(node, config.precision), samples, over, host,
                        recompute=stage_recomputes(config.recompute, s.recompute))


def _node_ids(plan: Plan) -> list[str]:
    """The distinct nodes ``plan`` uses, in plan order."""
    return list(dict.fromkeys(s.node_id for g in plan.groups for s in g.stages))


@dataclass(frozen=True)
class StageCost:
    """What the cost model predicts one stage spends per step, seconds.

    Attributes:
        flop: its passes' FLOP on its node's speed, slowed by sharing its host
            (:func:`~fedpipe.planner.costs.host_factors`): the part a per-node
            correction scales.
        fixed: the runtime's fixed costs of its passes and its optimizer step
            (:class:`~fedpipe.planner.types.Overheads`).
        send: its outgoing links' busy time for its tensors.
    """

    flop: float
    fixed: float
    send: float

    @property
    def compute(self) -> float:
        """flop + fixed: what the stage's reported ``compute_seconds`` measures."""
        return self.flop + self.fixed


def stage_costs(plan: Plan, cluster: ClusterView, profile: ModelProfile,
                config: TrainConfig, busy: Mapping[str, float] | None = None
                ) -> dict[StageKey, StageCost]:
    """Per stage, its predicted compute (split as :class:`StageCost`) and send seconds
    per step, priced as :func:`simulate` prices them. ``busy`` is each node's busy
    fraction of the step, for its host's sharing (default: :func:`simulate`'s).

    Raises:
        KeyError: the plan names a node the cluster lacks.
        PlanError: an unknown codec.
    """
    nodes = {n.node_id: n for n in cluster.nodes}
    if busy is None:
        busy = simulate(plan, cluster, profile, config).busy
    host = host_factors([nodes[i] for i in _node_ids(plan)], busy)
    speeds = {n.node_id: n.codec_speeds for n in cluster.nodes}
    over = cluster.overheads
    out: dict[StageKey, StageCost] = {}
    for r, (g, (m, samples)) in enumerate(zip(plan.groups, group_shares(plan, config))):
        mb = samples / m

        def passes(s: ChainStage, mb: float = mb) -> tuple[float, float]:
            return _passes(profile, s, nodes[s.node_id], mb, config, over, host[s.node_id])

        costs = chain_costs(profile, g.stages, mb, passes, cluster.link, over.message, speeds,
                            m, config.precision)
        for i, s in enumerate(g.stages):
            fixed = 2 * m * over.microbatch
            fixed += optimizer_seconds(profile, s.layer_start, s.layer_end, over, host[s.node_id])
            send = 0.0
            if i + 1 < len(g.stages):
                send += m * costs.act_busy[i]
            if i > 0:
                send += m * costs.grad_busy[i - 1]
            f, b = costs.forward[i], costs.backward[i]
            out[StageKey(r, i)] = StageCost(m * (f + b) - 2 * m * over.microbatch,
                                            fixed, send)
    return out
