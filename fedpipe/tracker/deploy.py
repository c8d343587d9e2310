"""Planning a job and loading its stages: PENDING -> PLANNING -> DEPLOYING -> RUNNING.

:meth:`Deployer.start` plans a PENDING job over the scheduler's candidate nodes
(:mod:`.planning`, on the calibrated cluster of :mod:`.calibration`), and
:meth:`Deployer.plan_ready` stores the plan and loads every stage at once
(:meth:`Deployer.deploy`). A recovery (:mod:`.recovery`) and a rebuilt replica
group (:mod:`.replica_groups`) load stages through the same :meth:`Deployer.deploy`
and :meth:`Deployer.assign`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures
from typing import Callable

from .. import planner
from ..planner.protoio import (assignment_memory_bytes, cluster_view, plan_from_message,
                               plan_message, set_predicted, train_config)
from ..proto import node_pb2, tracker_pb2
from ..spec import JobSpec, PlanView, StageKey, peer_of
from .calibration import Calibration
from .jobs import Jobs, stage_name
from .nodes import NodeCallError, NodeCalls
from .planning import Planner
from .specs import JobSpecs
from .store import Store

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

CHECKPOINT_SECONDS = 30.0
"""Default checkpoint interval, as training time: a recovery recomputes at most about this."""


def checkpoint_every(job: JobSpec, step_seconds: float) -> int:
    """Steps between checkpoints: the job's own setting, else as many steps as take
    :data:`CHECKPOINT_SECONDS` at ``step_seconds`` per step (at least 1)."""
    if job.checkpoint_every:
        return job.checkpoint_every
    return max(1, min(job.steps, int(CHECKPOINT_SECONDS / max(step_seconds, 1e-3))))


def _no_sources(key: StageKey) -> list[str]:
    return []


def _no_pieces(key: StageKey) -> list[node_pb2.SnapshotPiece]:
    return []


def _peers_outside(old: node_pb2.Plan | None, plan: node_pb2.Plan) -> list[node_pb2.Peer]:
    """The nodes of ``old`` that ``plan`` does not name, once each: where a snapshot
    source outside the new plan is, on the socket data plane too (through its relay)."""
    if old is None:
        return []
    named = {a.address for a in plan.stages}
    peers = {a.address: peer_of(a) for a in old.stages if a.address not in named}
    return list(peers.values())


class Deployer:
    """Plans jobs and loads their stages.

    Args:
        store: the tracker's state.
        nodes: how to reach nodes (LoadStage, AssignJob).
        jobs: the life cycle (moves the job, fails it).
        specs: each job's decoded spec.
        live_nodes: the live nodes (the registry's, in memory).
        calibration: the cost model fitted from measured steps.
        planner: makes plans (in a worker process, or in-process).
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, jobs: Jobs, specs: JobSpecs,
                 live_nodes: Callable[[], list[tracker_pb2.NodeInfo]],
                 calibration: Calibration, planner: Planner,
                 clock: Callable[[], float] = time.time):
        self.store, self.nodes, self.jobs, self.specs = store, nodes, jobs, specs
        self.live_nodes, self.calibration, self.planner = live_nodes, calibration, planner
        self.clock = clock

    def start(self, job_id: str, nodes: list[tracker_pb2.NodeInfo],
              links: list[node_pb2.LinkMeasurement]) -> None:
        """Plan a PENDING job over ``nodes`` and deploy it: PLANNING, DEPLOYING, then RUNNING.

        A planner error, a planner bug or a stage that cannot be loaded fails
        the job with the reason; nothing is raised.
        """
        if not self.jobs.move(job_id, S.JOB_STATE_PLANNING, f"planning over {len(nodes)} node(s)",
                              only_from={S.JOB_STATE_PENDING}):
            return
        self.jobs.notify()
        spec = self.specs.get(job_id)
        try:
            probed = cluster_view(nodes, links)
            cluster = self.calibration.cluster(probed)
            plan, job = self.planner.plan(cluster, spec.profile, spec.job)
            plan = dataclasses.replace(plan, calibrated=self.calibration.covers(plan, probed))
            costs = self.calibration.planned(job_id, self.store.job(job_id).epoch, plan,
                                             probed, spec.profile, train_config(job))
        except planner.PlanError as e:
            self.jobs.fail(job_id, f"no plan: {e}")
            return
        except Exception as e:  # noqa: BLE001 — a planner bug must not leave the job PLANNING
            log.exception("planning job %s failed", job_id)
            self.jobs.fail(job_id, f"planning failed: {type(e).__name__}: {e}")
            return
        msg = plan_message(plan, {n.node_id: n for n in nodes})
        set_predicted(msg, costs)
        sync = f" (replica groups sync by {job.replica_sync})" if len(plan.groups) > 1 else ""
        self.plan_ready(job_id, msg, job, sync)

    def plan_ready(self, job_id: str, plan: node_pb2.Plan, job: JobSpec, note: str = "") -> None:
        """A plan is ready: store it, move to DEPLOYING, load every stage, then RUNNING.

        Args:
            plan: the plan message (see :func:`~fedpipe.planner.protoio.plan_message`).
            job: the job's spec with "auto" settings resolved; it is what the
                stages run by.
            note: appended to the DEPLOYING reason.
        """
        job = job.with_(checkpoint_every=checkpoint_every(job, plan.predicted_step_seconds))
        self.store.set_plan(job_id, plan)
        self.specs.set_config(job_id, job)  # what the stages run by, resolved
        if not self.jobs.move(job_id, S.JOB_STATE_DEPLOYING,
                              "loading stages: " + plan.summary + note,
                              only_from={S.JOB_STATE_PLANNING}):
            return
        self.jobs.notify()
        failures = self.deploy(job_id, plan, job)
        if failures:  # unless a lost node already moved it to RECOVERING
            self.jobs.fail(job_id, "; ".join(failures.values()),
                           only_from={S.JOB_STATE_DEPLOYING})
        else:
            self.jobs.move(job_id, S.JOB_STATE_RUNNING, "all stages loaded",
                           only_from={S.JOB_STATE_DEPLOYING})
        self.jobs.notify()

    def deploy(self, job_id: str, plan: node_pb2.Plan, job: JobSpec, resume_step: int = 0,
               sources: Callable[[StageKey], list[str]] = _no_sources,
               pieces: Callable[[StageKey], list[node_pb2.SnapshotPiece]] = _no_pieces,
               old: node_pb2.Plan | None = None) -> dict[StageKey, str]:
        """Load every stage at once (at ``resume_step``, restoring from a snapshot
        ``sources(key)`` may hold, or from the old stages' ``pieces(key)`` where the
        plan splits the layers otherwise); return why each stage that failed to load
        failed. ``old``: the plan the snapshots were taken under; its nodes that
        ``plan`` does not name go with each load (``snapshot_peers``: their data ports).

        Results are kept by :class:`~fedpipe.spec.StageKey`, so stage ``s``
        of one replica group never hides stage ``s`` of another.
        """
        view = PlanView(plan)
        if len(view.stages) != len(plan.stages):
            return {StageKey(-1, -1): f"the plan names a stage twice: {plan.summary}"}
        config = job.to_proto()
        profile, priced = self.specs.get(job_id).profile, train_config(job)
        # the owner and the client's signature travel with the code: nodes check them
        signed = self.specs.request(job_id)
        if resume_step:  # state moves: its holders must serve the new plan's nodes
            self.assign(job_id, plan, {s for key in view.stages for s in sources(key)})

        peers = _peers_outside(old, plan) if resume_step else []

        def load(a: node_pb2.StageAssignment) -> None:
            key = StageKey(a.replica, a.stage)
            self.nodes.load_stage(a.address, node_pb2.LoadStageRequest(
                job_id=job_id, replica=a.replica, stage=a.stage, plan=plan, config=config,
                layers=self.store.layers(job_id, a.layer_start, a.layer_end),
                resume_step=resume_step,
                snapshot_sources=sources(key) if resume_step else [],
                snapshot_pieces=pieces(key) if resume_step else [],
                owner=signed.owner, job_signature=signed.job_signature,
                client_cert=signed.client_cert, layer_digests=signed.layer_digests,
                predicted_memory_bytes=int(assignment_memory_bytes(plan, a, profile, priced)),
                snapshot_peers=peers))

        with futures.ThreadPoolExecutor(max(1, len(view.stages))) as pool:
            results = {key: pool.submit(load, a) for key, a in view.stages.items()}
        failures = {}
        for key, fut in sorted(results.items()):
            err = fut.exception()
            if err is not None:
                detail = str(err) if isinstance(err, NodeCallError) \
                    else f"{type(err).__name__}: {err}"
                failures[key] = f"{stage_name(key)} on {view[key].node_name} could not be " \
                                f"loaded: {detail}"
        return failures

    def assign(self, job_id: str, plan: node_pb2.Plan, holders: set[str]) -> None:
        """Tell the nodes at ``holders`` (addresses of nodes that may hold the job's
        snapshots or state) which nodes ``plan`` assigns, before its LoadStage calls.

        Under TLS a node serves a job's state only to nodes a plan it was told of
        assigned (:func:`fedpipe.security.policy.require_owner_or_assigned`); a
        recovery's spare, a drain's or rebalance's new node and a healed replica
        group's nodes were in no plan the holders saw. The word comes from the
        tracker (AssignJob admits no other role), never from the fetching node.
        All at once, each within ``CONTROL_RPC`` seconds; a lost holder is not asked
        (a paused one would hold the loads up for that long) and one that cannot be
        reached is skipped: the stages' fetches go elsewhere.
        """
        holders = holders & {n.address for n in self.live_nodes()}
        if not holders:
            return
        request = node_pb2.AssignJobRequest(
            job_id=job_id, epoch=plan.epoch, owner=self.specs.request(job_id).owner,
            node_names=sorted({a.node_name for a in plan.stages}))

        def tell(address: str) -> None:
            try:
                self.nodes.assign_job(address, request)
            except NodeCallError as e:
                log.info("job %s: could not tell %s of plan epoch %d's nodes: %s", job_id,
                         address, plan.epoch, e)

        with futures.ThreadPoolExecutor(len(holders)) as pool:
            list(pool.map(tell, sorted(holders)))

    def predict(self, job_id: str, plan: node_pb2.Plan, nodes: list[tracker_pb2.NodeInfo]
                ) -> None:
        """Set a replanned ``plan``'s predicted step time from the calibrated cost model,
        and remember it for the next fit (a failure keeps the old prediction)."""
        spec = self.specs.get(job_id)
        try:
            probed = cluster_view(nodes, self.store.links_among(n.node_id for n in nodes))
            new = self.calibration.predict(plan_from_message(plan), probed, spec.profile,
                                           spec.config)
            plan.predicted_step_seconds, plan.sync_seconds = (new.predicted_step_seconds,
                                                              new.sync_seconds)
            plan.calibrated = new.calibrated
            set_predicted(plan, self.calibration.planned(job_id, plan.epoch, new, probed,
                                                         spec.profile, spec.config))
        except (planner.PlanError, KeyError) as e:
            log.warning("job %s: cannot predict the replanned step time: %s", job_id, e)
