"""The Tracker gRPC servicer: each RPC decodes, calls the domain, maps its errors.

The domain lives in :mod:`~fedpipe.tracker.registry` (nodes),
:mod:`~fedpipe.tracker.jobs` (the job life cycle) and the parts
:class:`~fedpipe.tracker.scheduler.Tracker` assembles,
:mod:`~fedpipe.tracker.scheduler` (the background loops) and
:mod:`~fedpipe.tracker.store` (state); its errors
(:mod:`~fedpipe.tracker.errors`) become status codes in
:data:`~fedpipe.tracker.status.STATUS`, the one place they are mapped; who may
submit what is :mod:`~fedpipe.tracker.admission`'s. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from .. import net
# cli.py and fedpipe.testing import these two from here
from ..planner.protoio import cluster_view, unmeasured  # noqa: F401
from ..proto import tracker_pb2, tracker_pb2_grpc
from ..security import Role, TlsConfig, identity_of
from ..security.policy import require_owner, require_self
from ..net.trackers import LEADER_KEY
from . import errors
from .admission import MAX_JOB_BYTES, MAX_JOBS_PER_OWNER, Admission, NodeNames
from .nodes import GrpcNodeCalls
from .jobs import LIST_JOBS
from .leader import LeaderFence, Leadership
from .rebalance import REBALANCE_THRESHOLD
from .registry import HEARTBEAT_RATE
from .retention import RETENTION
from .scheduler import Tracker
from .status import STATUS, status_of, stream, unary  # noqa: F401 (STATUS, status_of: re-export)
from .store import Store, open_store
from .watches import WatchSlots

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

MAX_REGISTERING = 8
"""Registrations the tracker runs at once. Each holds a server thread while it dials the
node and waits its turn to write, so a swarm registering at once (10,000 nodes after a
tracker restart) would take every thread and starve heartbeats into lost leases; the
excess is refused with UNAVAILABLE, which nodes retry with backoff
(:func:`fedpipe.net.retry`)."""

PLAN_PROCESSES = 1
"""Worker processes that make the tracker's plans (:mod:`.planning`): planning in the
tracker's own process holds the GIL about 90 ms per job, and heartbeats wait that long."""

class TrackerService(tracker_pb2_grpc.TrackerServicer):
    """The Tracker service over a :class:`~fedpipe.tracker.scheduler.Tracker`.

    Who may call which method is the policy table's
    (:data:`fedpipe.security.policy.POLICY`, enforced before a method runs);
    what needs the tracker's knowledge is checked here, with the caller's
    identity (None without TLS, when every check passes): a node speaks only
    for itself, a client only for its own jobs.
    """

    def __init__(self, tracker: Tracker, tls: TlsConfig | None = None, *,
                 max_job_bytes: int = MAX_JOB_BYTES, max_jobs_per_owner: int = MAX_JOBS_PER_OWNER):
        self.tracker = tracker
        # checks job signatures against the swarm CA and deny list (None: no TLS)
        self.verifier = tls.authenticator() if tls is not None else None
        self.admission = Admission(tracker.store, tracker.jobs, self.verifier,
                                   max_job_bytes=max_job_bytes,
                                   max_jobs_per_owner=max_jobs_per_owner)
        self.store = tracker.store  # the caller closes it after the server stops
        self.names = NodeNames(tracker.store)
        self._registering = threading.BoundedSemaphore(MAX_REGISTERING)
        self.watches = WatchSlots()

    def _speaks_for(self, context, node_id: str) -> None:
        """A node may heartbeat, leave and report only as itself.

        Raises:
            PermissionDenied: ``node_id`` is another node's (or no node's).
        """
        identity = identity_of(context)
        if identity is not None:
            require_self(identity, self.names.name(node_id) or f"(unknown id {node_id})")

    def _owned(self, context, job_id: str) -> tracker_pb2.JobInfo:
        """The job, if the caller may see and change it (its owner, or admin).

        Raises:
            NotFound: no such job.
            PermissionDenied: another client's job.
        """
        job = self.tracker.jobs.get(job_id)
        require_owner(identity_of(context), job.owner, job_id=job_id)
        return job

    def close(self) -> None:
        """Stop the tracker's background loops and close its channels to nodes."""
        self.tracker.close()

    @unary
    def RegisterNode(self, request, context):
        require_self(identity_of(context), request.name)
        if not self._registering.acquire(blocking=False):
            raise errors.Unavailable(
                f"the tracker is registering {MAX_REGISTERING} nodes already, the most it "
                f"takes at once (so heartbeats keep their threads); retry with backoff")
        try:
            node_id = self.tracker.register(request)
        finally:
            self._registering.release()
        self.names.add(node_id, request.name)
        r = self.tracker.registry
        return S.RegisterNodeReply(node_id=node_id, lease_seconds=r.lease_seconds,
                                   heartbeat_seconds=r.heartbeat_seconds)

    @unary
    def Heartbeat(self, request, context):
        self._speaks_for(context, request.node_id)
        r, t = self.tracker.registry, self.tracker
        if request.leaving:  # a node leaving while it drains leaves drained
            known = r.leave(request.node_id, drained=request.draining
                            or request.node_id in t.drains.now_draining())
        else:
            known = r.heartbeat(request.node_id)
        if known and request.draining and not request.leaving:
            t.rebalancer.drain(request.node_id)  # a node's SIGTERM, or told so before a restart
        drop, drop_jobs = t.retention.reconcile(request.node_id, list(request.holds))
        if known and not request.leaving:  # acks a tracker that took over did not count
            t.progress.held(request.node_id, list(request.holds))
        # the lease the registry just held the node to (it moves only as nodes join or go),
        # and the swarm's deny list, whole: the node refuses these on every call it serves
        revoked = self.verifier.deny_list().to_proto() if self.verifier is not None else []
        return S.HeartbeatReply(known=known, lease_seconds=r.lease_seconds,
                                heartbeat_seconds=r.heartbeat_seconds, drop=drop,
                                drop_jobs=drop_jobs,
                                drain=request.node_id in t.drains.now_draining(),
                                drained=t.rebalancer.drained(request.node_id), revoked=revoked,
                                checkpoints=t.retention.checkpoints(list(request.holds)))

    @unary
    def ListNodes(self, request, context):
        store = self.tracker.store
        nodes = self.tracker.registry.from_memory(store.nodes(request.include_lost))
        return S.ListNodesReply(nodes=self.tracker.drains.annotate(nodes), links=store.links())

    @unary
    def DrainNode(self, request, context):
        identity = identity_of(context)
        rebalancer = self.tracker.rebalancer
        node = rebalancer.find(request.node)
        if identity is not None and identity.role is Role.NODE:
            require_self(identity, node.name)  # a node drains only itself
        node, jobs = rebalancer.drain(node.node_id)
        return S.DrainNodeReply(node=node, jobs=jobs, drained=rebalancer.drained(node.node_id))

    @unary
    def SubmitJob(self, request, context):
        identity = identity_of(context)
        job_id = self.admission.submit(request, identity.name if identity is not None else "",
                                       str(identity or "a caller without TLS"))
        self.tracker.feeders.submitted(job_id)
        return S.SubmitJobReply(job_id=job_id)

    @unary
    def GetJob(self, request, context):
        self._owned(context, request.job_id)
        job = self.tracker.replicas.annotate(self.tracker.progress.info(request.job_id))
        job.feeder = self.tracker.feeders.feeder(request.job_id)
        return self.tracker.feeders.shown(job)

    @unary
    def ListJobs(self, request, context):
        identity = identity_of(context)  # without TLS, and for the operator: every job
        owner = None if identity is None or identity.role is Role.ADMIN else identity.name
        return S.ListJobsReply(jobs=self.tracker.jobs.listed(owner, request.limit or LIST_JOBS))

    @unary
    def CancelJob(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.jobs.cancel(request.job_id, request.reason, request.keep_weights)

    @stream
    def WatchJob(self, request, context):
        self._owned(context, request.job_id)
        identity = identity_of(context)
        if identity is not None:  # without TLS a caller is a connection: any number
            refused = self.watches.take(request.job_id, identity.uri)
            if refused is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            release = functools.partial(self.watches.give, request.job_id, identity.uri)
            if not context.add_callback(release):
                release()
        stopping = self.tracker.stop_event
        if request.feeder:  # the stream is the feeding client's presence (see .clients)
            feeders = self.tracker.feeders
            feeders.attach(request.job_id, request.feeder, request.take_over)
            context.add_callback(lambda: feeders.detach(request.job_id, request.feeder))
        yield from self.tracker.progress.watch(
            request.job_id, request.after_seq,
            active=lambda: context.is_active() and not stopping.is_set())

    @unary
    def RestoreJob(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.recovery.restore(request.job_id, request.step)

    @unary
    def ReportStage(self, request, context):
        # the node must be itself; progress.report then checks it runs that stage
        self._speaks_for(context, request.node_id)
        self.tracker.progress.report(request)
        return S.StageReportReply()

    @unary
    def ReplicaQuorum(self, request, context):
        self._speaks_for(context, request.node_id)
        return self.tracker.replicas.ask(request)

    @unary
    def JoinReplica(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.replicas.join(request.job_id, request.replica, request.step)


class Terms:
    """The leader's :class:`TrackerService`, built at each takeover and closed at each
    step-down (:class:`~.leader.Leadership`'s ``on_lead`` and ``on_depose``).

    Args:
        build: makes the service over a fresh :class:`~.scheduler.Tracker` (which
            rebuilds its memory from the store).
        serving: told whether this tracker leads, at every change and by :meth:`announce`
            (the server's health: a standby's Tracker service is NOT_SERVING, so what
            waits for a tracker to serve waits for a leader).
    """

    def __init__(self, build: Callable[[], TrackerService],
                 serving: Callable[[bool], None] = lambda leads: None):
        self.build, self.serving = build, serving
        self._lock = threading.Lock()
        self._service: TrackerService | None = None

    def current(self) -> TrackerService | None:
        """The leader's service (None: this tracker stands by)."""
        return self._service

    def lead(self, epoch: int) -> None:
        service = self.build()
        with self._lock:
            self._service = service
            self.serving(True)

    def depose(self, why: str) -> None:
        with self._lock:
            service, self._service = self._service, None
            self.serving(False)
        if service is not None:
            service.close()

    def announce(self) -> None:
        """Tell ``serving`` the state now (after the server's start said SERVING)."""
        with self._lock:
            self.serving(self._service is not None)


class FailoverService(tracker_pb2_grpc.TrackerServicer):
    """The Tracker service of one of several trackers on one database: the leader's
    :class:`TrackerService` while this tracker leads, else UNAVAILABLE with the leader's
    address in the trailing metadata :data:`~fedpipe.net.trackers.LEADER_KEY` (callers
    with several addresses follow it, :mod:`fedpipe.net.trackers`).

    Every method of the service is forwarded (made below from the service's descriptor),
    so a method added to the proto needs nothing here.

    Attributes:
        store: the shared store (its opener closes it).
        leadership: this tracker's claim on the lease.
    """

    def __init__(self, terms: Terms, leadership: Leadership, store: Store):
        self.terms, self.leadership, self.store = terms, leadership, store

    @property
    def tracker(self) -> Tracker | None:
        """The leader's domain (None while this tracker stands by)."""
        service = self.terms.current()
        return service.tracker if service is not None else None

    def leading(self, context) -> TrackerService:
        """The service to run a call on, or the call answered UNAVAILABLE (gRPC's abort
        raises) with the leader's address when one is known."""
        service = self.terms.current()
        leads = self.leadership.fence.leading()
        if service is not None and leads:
            return service
        if leads:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"this tracker ({self.leadership.address}) has just taken over as the "
                          f"leader and is loading the swarm's state from the store; retry")
        leader = self.leadership.leader()
        if leader is not None:
            context.set_trailing_metadata(((LEADER_KEY, leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"this tracker ({self.leadership.address}) is a standby: the leader "
                          f"is at {leader}; call it (give every tracker's address, "
                          f"--tracker a:7070,b:7070, and calls follow the leader)")
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"no tracker leads now: the leader's lease lapsed and a standby takes "
                      f"over within {self.leadership.lease:g} s; retry")
        raise AssertionError("context.abort raises")

    def close(self) -> None:
        """Step down (releasing the lease, so a standby takes over at once) and stop."""
        self.leadership.close()


def _forward(name: str, streaming: bool):
    if streaming:
        def forward_stream(self: FailoverService, request, context):
            yield from getattr(self.leading(context), name)(request, context)
        forward_stream.__name__ = name
        return forward_stream

    def forward(self: FailoverService, request, context):
        return getattr(self.leading(context), name)(request, context)
    forward.__name__ = name
    return forward


for _method in S.DESCRIPTOR.services_by_name["Tracker"].methods:
    setattr(FailoverService, _method.name, _forward(_method.name, _method.server_streaming))


def serve(host: str, port: int, db: str, lease: float = 10.0, link_refresh: float = 300.0,
          *, tls: TlsConfig | None = None, insecure: bool = False,
          max_job_bytes: int = MAX_JOB_BYTES, heartbeat_rate: float | None = None,
          freeze_heap: bool = False, retention: float | None = None,
          rebalance_threshold: float = REBALANCE_THRESHOLD, leader_lease: float = 0.0,
          advertise: str | None = None
          ) -> tuple[grpc.Server, TrackerService | FailoverService, int]:
    """Start a tracker server on the store ``db``; returns ``(server, service, port)``.

    Args:
        db: a SQLite file, or a store URL (``postgresql://...``, see
            :func:`~fedpipe.tracker.store.open_store`).
        tls: the tracker's certificate (role tracker): the server takes only mutual
            TLS and enforces the policy table, and the tracker's calls to nodes
            show this certificate. None: plaintext.
        insecure: allow plaintext on a non-loopback ``host`` (see
            :func:`fedpipe.net.check_plaintext`).
        max_job_bytes: the most bytes of layers a job may carry.
        heartbeat_rate: the most heartbeats per second asked of the whole swarm (None:
            :data:`~fedpipe.tracker.registry.HEARTBEAT_RATE`); a larger swarm is told
            a longer interval and lease.
        freeze_heap: keep the objects that registered nodes leave out of the garbage
            collector's full passes (:meth:`~.scheduler.Tracker.freeze_heap`); for a
            process that is only a tracker (``fedpipe tracker``).
        retention: seconds an ended job's weights stay on the nodes (None:
            :data:`~fedpipe.tracker.retention.RETENTION`).
        rebalance_threshold: see :class:`~fedpipe.tracker.scheduler.Tracker`.
        leader_lease: > 0: this tracker shares ``db`` with other trackers: it leads
            through a lease of this many seconds (:mod:`.leader`), or stands by; every
            write is fenced, and the service returned is a :class:`FailoverService`
            (whose ``tracker`` is None while it stands by). 0: it is the only tracker.
        advertise: the ``HOST:PORT`` standbys name when this tracker leads (default
            ``host:port``, the real port).

    Raises:
        ValueError: plaintext on a non-loopback ``host`` without ``insecure``.
        OSError: the port cannot be bound.
        StoreError: the store cannot be opened (a bad URL, an unreachable database, a
            schema newer than this fedpipe; :mod:`fedpipe.tracker.store`).
    """
    net.check_plaintext(host, tls, insecure, "the tracker")
    rate = HEARTBEAT_RATE if heartbeat_rate is None else heartbeat_rate
    fence = LeaderFence() if leader_lease > 0 else None
    store = open_store(db, fence)

    def build() -> TrackerService:
        return TrackerService(Tracker(store, GrpcNodeCalls(tls=tls), lease=lease,
                                      link_refresh=link_refresh, heartbeat_rate=rate,
                                      plan_processes=PLAN_PROCESSES, freeze_heap=freeze_heap,
                                      rebalance_threshold=rebalance_threshold,
                                      retention=RETENTION if retention is None else retention),
                              tls, max_job_bytes=max_job_bytes)

    srv = net.server(tls=tls, client_calls=net.TRACKER_CLIENT_DATA_CALLS)
    try:
        real = net.bind(srv, host, port)
    except OSError:
        store.close()
        raise
    service: TrackerService | FailoverService
    if fence is None:
        service = build()
    else:
        terms = Terms(build, serving=functools.partial(_health, srv))
        bound = f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{real}"
        leadership = Leadership(store, fence, advertise or bound, lease=leader_lease,
                                on_lead=terms.lead, on_depose=terms.depose)
        leadership.start()  # a tracker alone on its database leads before it serves
        service = FailoverService(terms, leadership, store)
    tracker_pb2_grpc.add_TrackerServicer_to_server(service, srv)
    srv.start()
    if isinstance(service, FailoverService):
        service.terms.announce()
    return srv, service, real


TRACKER_SERVICE = S.DESCRIPTOR.services_by_name["Tracker"].full_name
"""The Tracker service's full name, as ``grpc.health.v1`` reports it."""


def _health(srv: net.Server, leads: bool) -> None:
    """Report the Tracker service SERVING on ``srv`` while this tracker leads, else NOT_SERVING."""
    srv.health.set(TRACKER_SERVICE, health_pb2.HealthCheckResponse.SERVING if leads
                   else health_pb2.HealthCheckResponse.NOT_SERVING)
