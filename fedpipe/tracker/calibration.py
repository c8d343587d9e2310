"""The tracker's calibrated cost model: corrections fitted from the stages' step times.

:class:`Calibration` remembers, for each plan the tracker makes, what it was
planned with (the probed cluster, the model profile, the config) and what the
model predicted per stage; as a job's stages report their step splits it
fits (:mod:`fedpipe.planner.calibrate`) a correction per node and the cost
per message, and hands the planner a calibrated
:class:`~fedpipe.planner.ClusterView` for later plans and replans. Kept in
memory: a restarted tracker calibrates again from its next jobs. No torch.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from ..planner import calibrate
from ..planner.simulate import StageCost, simulate, stage_costs
from ..planner.types import (RUNTIME_OVERHEADS, ClusterView, ModelProfile, Overheads, Plan,
                             TrainConfig)
from ..spec import StageKey

SAMPLED_PLANS = 32
"""Plans (job and epoch) whose stage samples the fit uses: the most recently observed."""
REFIT_SECONDS = 5.0
"""Least wall time between two fits of one plan: a fit simulates the plan a few dozen
times (tens of ms of the tracker's CPU, taken from the nodes when they share its
machine), and a plan's later windows of steps add little to its first."""


@dataclass
class _Planned:
    """What a plan was made with and what the model predicted for it."""

    plan: Plan
    probed: ClusterView            # the plan's nodes at their probed speeds
    profile: ModelProfile
    config: TrainConfig
    predicted: dict[StageKey, float]  # per stage, compute seconds per step


class Calibration:
    """Per-node corrections and the per-message cost, fitted from measured steps.
    Thread-safe.

    Args:
        base: the runtime's overheads before any fit.
        plans: see :data:`SAMPLED_PLANS`.
    """

    def __init__(self, base: Overheads = RUNTIME_OVERHEADS, plans: int = SAMPLED_PLANS):
        self.base, self.max_plans = base, plans
        self._lock = threading.Lock()
        self._planned: OrderedDict[tuple[str, int], _Planned] = OrderedDict()
        # (job, epoch) -> its stages' samples and fitted message cost, most recent last
        self._observed: OrderedDict[tuple[str, int],
                                    tuple[list[calibrate.StageSample], float]] = OrderedDict()
        self._fitted: OrderedDict[tuple[str, int], float] = OrderedDict()  # -> monotonic time
        self._corrections: dict[str, float] = {}
        self._message = base.message

    # -- what the planner gets -------------------------------------------------
    @property
    def calibrated(self) -> bool:
        """Whether any measured plan has been fitted."""
        with self._lock:
            return bool(self._observed)

    def corrections(self) -> dict[str, float]:
        """Node id -> its fitted correction (measured / predicted compute)."""
        with self._lock:
            return dict(self._corrections)

    def overheads(self) -> Overheads:
        """The runtime's overheads with the fitted per-message cost."""
        with self._lock:
            return dataclasses.replace(self.base, message=self._message)

    def cluster(self, probed: ClusterView) -> ClusterView:
        """``probed`` (probed speeds, as :func:`~fedpipe.planner.protoio.cluster_view`
        gives it) corrected: what the planner should plan on.

        A node not yet measured gets the median correction of the measured nodes
        of its host, else of all measured nodes (a new node is likelier to run a
        model like its peers than at its probed speed), else none.
        """
        with self._lock:
            corr, over = dict(self._corrections), dataclasses.replace(
                self.base, message=self._message)
        return dataclasses.replace(calibrate.corrected(probed, _filled(probed, corr)),
                                   overheads=over)

    def covers(self, plan: Plan, probed: ClusterView) -> bool:
        """Whether every node of ``plan`` has a correction of its own or of a measured
        node on its host: its prediction is calibrated, not guessed."""
        with self._lock:
            corr = dict(self._corrections)
        hosts = {n.host for n in probed.nodes if n.node_id in corr and n.host}
        host = {n.node_id: n.host for n in probed.nodes}
        return all(s.node_id in corr or (host.get(s.node_id) and host[s.node_id] in hosts)
                   for g in plan.groups for s in g.stages)

    def predict(self, plan: Plan, probed: ClusterView, profile: ModelProfile,
                config: TrainConfig) -> Plan:
        """``plan`` with its predicted step time from the calibrated model (a replan that
        moved stages keeps the old prediction otherwise).

        Raises:
            KeyError, PlanError: as :func:`~fedpipe.planner.simulate.simulate`.
        """
        cluster = self.cluster(probed)
        sim = simulate(plan, cluster, profile, config)
        return dataclasses.replace(plan, predicted_step_seconds=sim.step_seconds,
                                   sync_seconds=sim.sync_seconds,
                                   calibrated=self.covers(plan, probed))

    # -- what the tracker tells it ---------------------------------------------
    def planned(self, job_id: str, epoch: int, plan: Plan, probed: ClusterView,
                profile: ModelProfile, config: TrainConfig) -> dict[StageKey, StageCost]:
        """Job ``job_id`` runs ``plan`` in ``epoch``; ``probed`` is the cluster at
        probed speeds (only the plan's nodes are kept). Returns each stage's predicted
        seconds per step on the calibrated cluster (what the plan message carries:
        :func:`~fedpipe.planner.protoio.set_predicted`).

        Raises:
            KeyError, PlanError: as :func:`~fedpipe.planner.simulate.stage_costs`.
        """
        used = {s.node_id for g in plan.groups for s in g.stages}
        # the fit prices the fixed costs as the planner does, so corrections scale FLOP only
        mine = dataclasses.replace(probed, nodes=[n for n in probed.nodes if n.node_id in used],
                                   overheads=self.base)
        costs = stage_costs(plan, self.cluster(mine), profile, config)
        predicted = {k: c.compute for k, c in costs.items()}
        with self._lock:
            self._planned.pop((job_id, epoch), None)
            self._planned[(job_id, epoch)] = _Planned(plan, mine, profile, config, predicted)
            while len(self._planned) > 4 * self.max_plans:
                self._planned.popitem(last=False)
        return costs

    def observe(self, job_id: str, epoch: int, measured: Mapping[StageKey, float],
                step_seconds: float) -> bool:
        """Fit from a plan's measured step: per stage its compute seconds per step
        (median of recent steps), and the step's wall time, seconds. A later
        observation of the same plan replaces the earlier; one within
        :data:`REFIT_SECONDS` of the plan's last fit is skipped. Returns whether
        the plan was known and fitted now.

        Raises:
            KeyError, PlanError: as :func:`~fedpipe.planner.simulate.simulate`.
        """
        now = time.monotonic()
        with self._lock:
            p = self._planned.get((job_id, epoch))
            if p is None or not measured or not step_seconds > 0 or \
                    now - self._fitted.get((job_id, epoch), -math.inf) < REFIT_SECONDS:
                return False
            self._fitted.pop((job_id, epoch), None)
            self._fitted[(job_id, epoch)] = now
            while len(self._fitted) > 4 * self.max_plans:
                self._fitted.popitem(last=False)
        samples = calibrate.stage_samples(p.plan, p.probed, p.profile, p.config, measured,
                                          step_seconds)
        own = calibrate.fit_corrections(samples)  # this plan's nodes, from this plan alone
        cluster = dataclasses.replace(calibrate.corrected(p.probed, own), overheads=self.base)
        message = calibrate.fit_message(p.plan, cluster, p.profile, p.config, step_seconds)
        with self._lock:
            self._observed.pop((job_id, epoch), None)
            self._observed[(job_id, epoch)] = (samples, message)
            while len(self._observed) > self.max_plans:
                self._observed.popitem(last=False)
            everything = [s for got, _ in self._observed.values() for s in got]
            self._corrections = calibrate.fit_corrections(everything)
            self._message = statistics.median(m for _, m in self._observed.values())
        return True


def _filled(cluster: ClusterView, corrections: Mapping[str, float]) -> dict[str, float]:
    """``corrections`` with a guess for each node of ``cluster`` that has none: the
    median of its host's measured nodes, else of every measured node."""
    if not corrections:
        return {}
    out = dict(corrections)
    by_host: dict[str, list[float]] = {}
    for n in cluster.nodes:
        if n.node_id in corrections and n.host:
            by_host.setdefault(n.host, []).append(corrections[n.node_id])
    overall = statistics.median(corrections.values())
    for n in cluster.nodes:
        if n.node_id not in out:
            mates = by_host.get(n.host) if n.host else None
            out[n.node_id] = statistics.median(mates) if mates else overall
    return out
