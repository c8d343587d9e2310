"""The Tracker service: node registry with leases, job life cycle, plans, events.

A scheduler thread expires leases, plans PENDING jobs onto live nodes and
deploys their stages; nodes report steps and completion back through
``ReportStage``. All state lives in :class:`~fedpipe.tracker.store.Store`.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent import futures

import grpc

from .. import net, planner
from ..proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from ..spec import ACTIVE, TERMINAL, JobSpec, JobSpecError, PlanView, state_name
from .store import Store

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2


def cluster_view(nodes: list[tracker_pb2.NodeInfo],
                 links: list[node_pb2.LinkMeasurement]) -> planner.ClusterView:
    """The planner's view of nodes and measured links (unmeasured pairs: the default link)."""
    ids = {n.node_id for n in nodes}
    return planner.ClusterView(
        [planner.NodeSpec(n.node_id, n.resources.flops, n.resources.memory_bytes, n.name,
                          n.resources.device) for n in nodes],
        {(m.src_id, m.dst_id): planner.Link(m.bandwidth, m.latency)
         for m in links if m.src_id in ids and m.dst_id in ids and m.bandwidth > 0})


def unmeasured(nodes: list[tracker_pb2.NodeInfo], links: list[node_pb2.LinkMeasurement]
               ) -> list[tuple[str, str]]:
    """Ordered pairs of live nodes without a measurement since both registered."""
    seen = {(m.src_id, m.dst_id): m.measured_at for m in links}
    return [(a.node_id, b.node_id) for a in nodes for b in nodes
            if a.node_id != b.node_id
            and seen.get((a.node_id, b.node_id), 0) < max(a.registered, b.registered)]


def model_profile(p: tracker_pb2.ModelProfile) -> planner.ModelProfile:
    """The planner's model profile from its message."""
    return planner.ModelProfile(
        [planner.LayerProfile(lp.name, lp.flops, lp.activation_bytes, lp.parameter_bytes)
         for lp in p.layers], p.input_bytes)


def train_config(spec: JobSpec) -> planner.TrainConfig:
    """The planner's training config for a job."""
    return planner.TrainConfig(batch_size=spec.batch_size, microbatches=spec.microbatches,
                               schedule=spec.schedule, stages=spec.stages,
                               replicas=spec.replicas,
                               activation_compression=spec.activation_compression,
                               gradient_compression=spec.gradient_compression,
                               sync_every=spec.sync_every)


MAX_NAME = 256


def validate_node(request: tracker_pb2.RegisterNodeRequest) -> str | None:
    """What is wrong with a registration, or None."""
    host, _, port = request.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        return f"node address must be HOST:PORT with a port in 1..65535, got {request.address!r}"
    r = request.resources
    if not (math.isfinite(r.flops) and r.flops > 0) or r.memory_bytes <= 0:
        return "node resources must have finite flops > 0 and memory_bytes > 0"
    if len(request.name) > MAX_NAME or len(request.address) > MAX_NAME:
        return f"node name and address must be at most {MAX_NAME} characters"
    return None


def validate(request: tracker_pb2.SubmitJobRequest) -> str | None:
    """What is wrong with a submission, or None."""
    if not request.layers:
        return "the job has no layers"
    if len(request.profile.layers) != len(request.layers):
        return (f"the profile has {len(request.profile.layers)} layers but the job "
                f"{len(request.layers)}")
    try:
        JobSpec.from_proto(request.config).validate(len(request.layers))
    except JobSpecError as e:
        return str(e)
    for i, lp in enumerate(request.profile.layers):
        if not (math.isfinite(lp.flops) and lp.flops >= 0):
            return f"profile layer {i} ({lp.name}): flops must be a finite number >= 0"
    return None


class TrackerService(tracker_pb2_grpc.TrackerServicer):
    """The tracker.

    Args:
        store: the SQLite state.
        lease: seconds a node may go without a heartbeat before it is marked lost.
        link_refresh: seconds between re-measurements of every link (0: only
            when nodes join).
        link_wait: seconds a job waits for the links of newly joined nodes to
            be measured before it is planned with default figures.
    """

    def __init__(self, store: Store, lease: float = 10.0, link_refresh: float = 300.0,
                 link_wait: float = 30.0):
        self.store, self.lease = store, lease
        self.link_refresh, self.link_wait = link_refresh, link_wait
        self.wake = threading.Condition()
        self.stop_event = threading.Event()
        self.measure_now = threading.Event()
        self.partial: dict[tuple[str, int], list] = {}  # (job, step) -> groups, loss, samples, s
        self.store.renew_all()
        for job_id in self.store.jobs_in(S.JOB_STATE_PLANNING, S.JOB_STATE_DEPLOYING):
            self._fail(job_id, "the tracker restarted while the job was being planned or "
                               "deployed; submit it again")
        self.threads = [threading.Thread(target=self._scheduler, name="scheduler", daemon=True),
                        threading.Thread(target=self._measurer, name="links", daemon=True)]
        for th in self.threads:
            th.start()

    def close(self) -> None:
        self.stop_event.set()
        self.measure_now.set()
        self._notify()
        for th in self.threads:
            th.join(timeout=5)

    def _notify(self) -> None:
        with self.wake:
            self.wake.notify_all()

    # -- nodes --------------------------------------------------------------
    def RegisterNode(self, request, context):
        problem = validate_node(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        node_id = self.store.upsert_node(request.name or request.address, request.address,
                                         request.resources)
        log.info("node %s (%s) registered at %s", request.name, node_id, request.address)
        self.measure_now.set()
        self._notify()
        return S.RegisterNodeReply(node_id=node_id, lease_seconds=self.lease)

    def Heartbeat(self, request, context):
        if request.leaving:
            known = self.store.mark_lost(request.node_id)
            if known:
                log.info("node %s is leaving", request.node_id)
                self._lost({request.node_id}, "left the swarm")
            return S.HeartbeatReply(known=known, lease_seconds=self.lease)
        return S.HeartbeatReply(known=self.store.heartbeat(request.node_id),
                                lease_seconds=self.lease)

    def ListNodes(self, request, context):
        return S.ListNodesReply(nodes=self.store.nodes(request.include_lost),
                                links=self.store.links())

    # -- links --------------------------------------------------------------
    def _measurer(self) -> None:
        """Measure every link when nodes join and every ``link_refresh`` seconds."""
        self.measure_now.set()
        while not self.stop_event.is_set():
            self.measure_now.wait(self.link_refresh or None)
            self.measure_now.clear()
            if self.stop_event.is_set():
                return
            try:
                self.measure_links()
            except Exception:  # noqa: BLE001 — try again at the next trigger
                log.exception("link measurement failed")
            self._notify()

    def measure_links(self) -> None:
        """Ask each live node, one at a time, to measure its links to the others."""
        nodes = self.store.nodes()
        for n in nodes:
            peers = [node_pb2.Peer(node_id=p.node_id, name=p.name, address=p.address)
                     for p in nodes if p.node_id != n.node_id]
            if not peers:
                continue
            try:
                reply = node_pb2_grpc.NodeStub(net.channel(n.address)).MeasureLinks(
                    node_pb2.MeasureLinksRequest(peers=peers), timeout=60 + 30 * len(peers))
            except grpc.RpcError as e:
                log.warning("node %s could not measure its links: %s", n.name, e.details())
                continue
            self.store.set_links(reply.links)
            for m in reply.links:
                if m.error:
                    log.warning("link %s -> %s: %s", n.name, m.dst_id, m.error)
        log.info("measured %d links among %d nodes", len(nodes) * (len(nodes) - 1), len(nodes))

    # -- jobs ---------------------------------------------------------------
    def SubmitJob(self, request, context):
        problem = validate(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        nodes = self.store.nodes()
        if nodes:
            need = planner.stage_memory_bytes(model_profile(request.profile), 0,
                                              len(request.layers),
                                              train_config(JobSpec.from_proto(request.config)),
                                              0, 1)
            have = sum(n.resources.memory_bytes for n in nodes)
            if need > have:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the job needs about {need / 2**20:.1f} MiB (weights, gradients, "
                              f"optimizer state, activations) but the swarm's {len(nodes)} "
                              f"node(s) have {have / 2**20:.1f} MiB in all")
        reason = "queued for planning" if nodes else "waiting for a node to register"
        job_id = self.store.add_job(request, reason)
        log.info("job %s submitted: %d layers, %d steps", job_id, len(request.layers),
                 request.config.steps)
        self._notify()
        return S.SubmitJobReply(job_id=job_id)

    def _job(self, job_id, context) -> tracker_pb2.JobInfo:
        try:
            return self.store.job(job_id)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")

    def GetJob(self, request, context):
        return self._job(request.job_id, context)

    def CancelJob(self, request, context):
        job = self._job(request.job_id, context)
        if self.store.set_state(job.job_id, S.JOB_STATE_CANCELLED,
                                request.reason or "cancelled by the client"):
            self._stop_stages(job.job_id, "cancelled", release=True)
            self._notify()
        return self.store.job(job.job_id)

    def WatchJob(self, request, context):
        self._job(request.job_id, context)
        seq = request.after_seq
        while context.is_active() and not self.stop_event.is_set():
            events = self.store.events(request.job_id, seq)
            for ev in events:
                yield ev
                seq = ev.seq
            if not events:
                if self.store.job(request.job_id).state in TERMINAL:
                    return
                with self.wake:
                    self.wake.wait(0.5)

    def ReportStage(self, request, context):
        R = S.StageReport
        try:
            job = self.store.job(request.job_id)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")
        if job.state in TERMINAL:
            return S.StageReportReply()
        mine = [a for a in job.plan.stages
                if (a.replica, a.stage) == (request.replica, request.stage)]
        if not mine or mine[0].node_id != request.node_id:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"node {request.node_id!r} does not run stage {request.stage} "
                          f"(replica {request.replica}) of job {job.job_id}")
        if job.state not in ACTIVE or not 0 <= request.step <= job.steps:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job.job_id} is {state_name(job.state)} with {job.steps} steps; "
                          f"report of step {request.step} refused")
        if request.status == R.STATUS_STEP:
            self._step(job, request)
        elif request.status == R.STATUS_DONE:
            if self.store.stage_done(job.job_id, request.replica, request.stage):
                self.store.set_state(job.job_id, S.JOB_STATE_SUCCEEDED,
                                     f"all {job.steps} steps done")
                log.info("job %s succeeded", job.job_id)
        elif request.status == R.STATUS_FAILED:
            self._fail(job.job_id, f"stage {request.stage} (replica {request.replica}) on node "
                                   f"{request.node_id} failed: {request.error}")
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown report status {request.status}")
        self._notify()
        return S.StageReportReply()

    def _step(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """Add one replica group's share of a step; record the step when all groups reported.

        Each group's loss is its part of the batch-mean loss, so the step's loss
        is their sum, and its samples/s the total samples over the slowest group's time.
        """
        groups = max(1, len(job.plan.replicas))
        if report.stage != PlanView(job.plan).depth(report.replica) - 1:
            return  # every stage reports its step; the loss and samples come from the last
        with self.wake:
            part = self.partial.setdefault((job.job_id, report.step), [0, 0.0, 0, 0.0])
            part[0] += 1
            part[1] += report.loss
            part[2] += report.samples
            part[3] = max(part[3], report.seconds)
            if part[0] < groups:
                return
            del self.partial[(job.job_id, report.step)]
        _, loss, samples, seconds = part
        self.store.record_step(job.job_id, report.step, loss,
                               samples / seconds if seconds > 0 else 0.0)

    # -- scheduling ---------------------------------------------------------
    def _fail(self, job_id: str, reason: str) -> None:
        if self.store.set_state(job_id, S.JOB_STATE_FAILED, reason):
            log.warning("job %s failed: %s", job_id, reason)
            self._stop_stages(job_id, reason, release=False)

    def _stop_stages(self, job_id: str, reason: str, release: bool) -> None:
        plan = self.store.job(job_id).plan
        for address in {a.address for a in plan.stages}:
            try:
                node_pb2_grpc.NodeStub(net.channel(address)).StopJob(
                    node_pb2.StopJobRequest(job_id=job_id, reason=reason, release=release),
                    timeout=5)
            except grpc.RpcError as e:
                log.warning("could not stop job %s on %s: %s", job_id, address, e.details())

    def _scheduler(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._tick()
            except Exception:  # noqa: BLE001 — keep scheduling whatever one job did
                log.exception("scheduler error")
            with self.wake:
                self.wake.wait(min(1.0, self.lease / 4))

    def _lost(self, lost: set[str], why: str) -> None:
        """Fail the active jobs that have a stage on any of the ``lost`` nodes."""
        if not lost:
            return
        names = {n.node_id: n.name for n in self.store.nodes(include_lost=True)}
        for job_id in self.store.jobs_in(*ACTIVE):
            used = {a.node_id for a in self.store.job(job_id).plan.stages} & lost
            if used:
                self._fail(job_id, f"node(s) {', '.join(sorted(names.get(n, n) for n in used))} "
                                   f"{why}")

    def _tick(self) -> None:
        lost = set(self.store.expire_nodes(self.lease))
        for nid in lost:
            log.warning("node %s missed its lease of %.1f s: marked lost", nid, self.lease)
        self._lost(lost, f"lost (no heartbeat for {self.lease:.0f} s)")
        for job_id in self.store.jobs_in(S.JOB_STATE_PENDING):
            spec = self.store.spec(job_id)
            job = self.store.job(job_id)
            nodes = self.store.nodes()
            if not nodes:
                if spec.pending_timeout and time.time() - job.created > spec.pending_timeout:
                    self._fail(job_id, f"no node registered within {spec.pending_timeout:.0f} s")
                continue
            links = self.store.links()
            missing = unmeasured(nodes, links)
            if missing and time.time() - job.created < self.link_wait:
                continue  # the links of nodes that just joined are being measured
            self._start(job_id, spec, nodes, links)

    def _start(self, job_id: str, spec: tracker_pb2.SubmitJobRequest,
               nodes: list[tracker_pb2.NodeInfo], links: list[node_pb2.LinkMeasurement]) -> None:
        if not self.store.set_state(job_id, S.JOB_STATE_PLANNING,
                                    f"planning over {len(nodes)} node(s)",
                                    only_from={S.JOB_STATE_PENDING}):
            return
        try:
            cluster, profile = cluster_view(nodes, links), model_profile(spec.profile)
            job = JobSpec.from_proto(spec.config)
            plan = planner.make_plan(cluster, profile, train_config(job))
            if job.replica_sync == "auto":
                job = job.with_(replica_sync=planner.choose_replica_sync(plan))
                if job.replica_sync == "diloco":  # plan again, paying the sync 1/H
                    plan = planner.make_plan(cluster, profile, train_config(job))
            spec.config.CopyFrom(job.to_proto())
        except planner.PlanError as e:
            self._fail(job_id, f"no plan: {e}")
            return
        except Exception as e:  # noqa: BLE001 — a planner bug must not leave the job PLANNING
            log.exception("planning job %s failed", job_id)
            self._fail(job_id, f"planning failed: {type(e).__name__}: {e}")
            return
        msg = plan_message(plan, {n.node_id: n for n in nodes})
        self.store.set_plan(job_id, msg)
        sync = f" (replica groups sync by {job.replica_sync})" if len(plan.groups) > 1 else ""
        self.store.set_state(job_id, S.JOB_STATE_DEPLOYING,
                             "loading stages: " + msg.summary + sync)
        error = self._deploy(job_id, spec, msg)
        if error:
            self._fail(job_id, error)
        else:
            self.store.set_state(job_id, S.JOB_STATE_RUNNING, "all stages loaded",
                                 only_from={S.JOB_STATE_DEPLOYING})
        self._notify()

    def _deploy(self, job_id: str, spec, plan: node_pb2.Plan) -> str | None:
        def load(a: node_pb2.StageAssignment):
            req = node_pb2.LoadStageRequest(
                job_id=job_id, replica=a.replica, stage=a.stage, plan=plan, config=spec.config,
                layers=self.store.layers(job_id, a.layer_start, a.layer_end))
            node_pb2_grpc.NodeStub(net.channel(a.address)).LoadStage(req, timeout=120)

        with futures.ThreadPoolExecutor(max(1, len(plan.stages))) as pool:
            results = {a.stage: pool.submit(load, a) for a in plan.stages}
        for stage, fut in sorted(results.items()):
            err = fut.exception()
            if err is not None:
                detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
                return f"stage {stage} could not be loaded: {detail}"
        return None


def plan_message(plan: planner.Plan, nodes: dict[str, tracker_pb2.NodeInfo]) -> node_pb2.Plan:
    """The Plan message for a planner plan, with node addresses and a one-line summary."""
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


def serve(host: str, port: int, db: str, lease: float = 10.0, link_refresh: float = 300.0
          ) -> tuple[grpc.Server, TrackerService, int]:
    """Start a tracker server; returns ``(server, service, port)``.

    Raises:
        OSError: the port cannot be bound.
        sqlite3.Error: the database cannot be opened.
    """
    service = TrackerService(Store(db), lease, link_refresh)
    srv = net.server()
    tracker_pb2_grpc.add_TrackerServicer_to_server(service, srv)
    real = net.bind(srv, host, port)
    srv.start()
    return srv, service, real
