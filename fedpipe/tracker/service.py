"""The Tracker gRPC servicer: each RPC decodes, calls the domain, maps its errors.

The domain lives in :mod:`~fedpipe.tracker.registry` (nodes),
:mod:`~fedpipe.tracker.jobs` (the job life cycle),
:mod:`~fedpipe.tracker.scheduler` (the background loops) and
:mod:`~fedpipe.tracker.store` (state); its errors
(:mod:`~fedpipe.tracker.errors`) become status codes in :data:`STATUS`, the
one place they are mapped. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import logging
import threading

import grpc

from .. import net
# cli.py and fedpipe.testing import these two from here
from ..planner.protoio import cluster_view, unmeasured  # noqa: F401
from ..proto import tracker_pb2, tracker_pb2_grpc
from ..spec import ACTIVE
from ..security import Role, SecurityError, TlsConfig, identity_of
from ..security.policy import require_owner, require_self
from ..security.signing import verify_job
from . import errors
from .nodes import GrpcNodeCalls
from .registry import HEARTBEAT_RATE
from .scheduler import Tracker
from .store import open_store
from .watches import WatchSlots

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

MAX_JOB_BYTES = 128 * 2**20
"""The most bytes of layers a submitted job may carry (they are stored in the tracker's
database and sent to nodes); ``fedpipe tracker --max-job-bytes`` changes it."""
MAX_JOBS_PER_OWNER = 8
"""The most jobs one client (certificate) may have pending or running at once; more are
refused with RESOURCE_EXHAUSTED and the count, so one client cannot flood the tracker."""
MAX_REGISTERING = 8
"""Registrations the tracker runs at once. Each holds a server thread while it dials the
node and waits its turn to write, so a swarm registering at once (10,000 nodes after a
tracker restart) would take every thread and starve heartbeats into lost leases; the
excess is refused with UNAVAILABLE, which nodes retry with backoff
(:func:`fedpipe.net.retry`)."""

PLAN_PROCESSES = 1
"""Worker processes that make the tracker's plans (:mod:`.planning`): planning in the
tracker's own process holds the GIL about 90 ms per job, and heartbeats wait that long."""

STATUS: dict[type[errors.TrackerError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}
"""The status code of each domain error."""


def status_of(error: errors.TrackerError) -> grpc.StatusCode:
    """The status code for a domain error (its nearest mapped base class; else INTERNAL)."""
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def _unary(method):
    """Answer a unary RPC whose domain call raised a :class:`~.errors.TrackerError` (or whose
    identity check raised a :class:`~fedpipe.security.SecurityError`) with that error's
    status code and message."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            return method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
        except SecurityError as e:
            context.abort(e.code, str(e))
    return call


def _stream(method):
    """:func:`_unary` for a server-streaming RPC."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            yield from method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
        except SecurityError as e:
            context.abort(e.code, str(e))
    return call


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
        self.max_job_bytes, self.max_jobs_per_owner = max_job_bytes, max_jobs_per_owner
        self._submit_lock = threading.Lock()  # the per-owner count and the insert, as one
        # checks job signatures against the swarm CA and deny list (None: no TLS)
        self.verifier = tls.authenticator() if tls is not None else None
        self.store = tracker.store  # the caller closes it after the server stops
        self._names: dict[str, str] = {}  # node_id -> name; ids are never reused
        self._names_lock = threading.Lock()
        self._registering = threading.BoundedSemaphore(MAX_REGISTERING)
        self.watches = WatchSlots()

    def _node_name(self, node_id: str) -> str | None:
        """The registered name of ``node_id`` (None: no such node)."""
        with self._names_lock:
            name = self._names.get(node_id)
        if name is None:  # registered before a restart: look it up once
            for rec in self.store.node_records(include_lost=True):
                if rec.info.node_id == node_id:
                    name = rec.info.name
                    with self._names_lock:
                        self._names[node_id] = name
                    break
        return name

    def _speaks_for(self, context, node_id: str) -> None:
        """A node may heartbeat, leave and report only as itself.

        Raises:
            PermissionDenied: ``node_id`` is another node's (or no node's).
        """
        identity = identity_of(context)
        if identity is not None:
            require_self(identity, self._node_name(node_id) or f"(unknown id {node_id})")

    def _admit_job(self, request: tracker_pb2.SubmitJobRequest) -> None:
        """Bounds on a submission: its size, and its owner's jobs not yet ended.

        Raises:
            InvalidArgument: the layers are larger than ``max_job_bytes`` in all.
            ResourceExhausted: the owner already has ``max_jobs_per_owner`` jobs
                pending or running (only with TLS, where owners are known).
        """
        size = sum(len(b) for b in request.layers)
        if size > self.max_job_bytes:
            raise errors.InvalidArgument(
                f"the job's layers are {size / 2**20:.1f} MiB, more than this tracker's limit "
                f"of {self.max_job_bytes / 2**20:.1f} MiB (fedpipe tracker --max-job-bytes)")
        if not request.owner:
            return
        store = self.tracker.store
        live = [j for j in store.jobs_in(S.JOB_STATE_PENDING, *ACTIVE)
                if store.job(j).owner == request.owner]
        if len(live) >= self.max_jobs_per_owner:
            raise errors.ResourceExhausted(
                f"client {request.owner!r} already has {len(live)} jobs pending or running, "
                f"the most one client may have at once ({self.max_jobs_per_owner}); submit "
                f"again when one ends")

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

    @_unary
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
        with self._names_lock:
            self._names[node_id] = request.name
        r = self.tracker.registry
        return S.RegisterNodeReply(node_id=node_id, lease_seconds=r.lease_seconds,
                                   heartbeat_seconds=r.heartbeat_seconds)

    @_unary
    def Heartbeat(self, request, context):
        self._speaks_for(context, request.node_id)
        r = self.tracker.registry
        known = r.leave(request.node_id) if request.leaving else r.heartbeat(request.node_id)
        elastic = self.tracker.elastic
        if known and request.draining and not request.leaving:
            elastic.drain(request.node_id)  # a node's SIGTERM, or told so before a restart
        drop, drop_jobs = self.tracker.jobs.reconcile(request.node_id, list(request.holds))
        # the lease the registry just held the node to (it moves only as nodes join or go),
        # and the swarm's deny list, whole: the node refuses these on every call it serves
        revoked = self.verifier.deny_list().to_proto() if self.verifier is not None else []
        return S.HeartbeatReply(known=known, lease_seconds=r.lease_seconds,
                                heartbeat_seconds=r.heartbeat_seconds, drop=drop,
                                drop_jobs=drop_jobs,
                                drain=request.node_id in elastic.draining,
                                drained=elastic.drained(request.node_id), revoked=revoked,
                                checkpoints=self.tracker.jobs.checkpoints(list(request.holds)))

    @_unary
    def ListNodes(self, request, context):
        store = self.tracker.store
        return S.ListNodesReply(nodes=self.tracker.elastic.annotate(
            store.nodes(request.include_lost)), links=store.links())

    @_unary
    def DrainNode(self, request, context):
        identity = identity_of(context)
        node = self.tracker.elastic.find(request.node)
        if identity is not None and identity.role is Role.NODE:
            require_self(identity, node.name)  # a node drains only itself
        node, jobs = self.tracker.elastic.drain(node.node_id)
        return S.DrainNodeReply(node=node, jobs=jobs,
                                drained=self.tracker.elastic.drained(node.node_id))

    @_unary
    def SubmitJob(self, request, context):
        identity = identity_of(context)
        owner = identity.name if identity is not None else ""
        if request.owner and request.owner != owner:
            raise errors.PermissionDenied(f"the job says its owner is {request.owner!r} but "
                                          f"it comes from {identity or 'a caller without TLS'}")
        request.owner = owner
        if self.verifier is not None:
            if len(request.layer_digests) != len(request.layers):
                raise errors.InvalidArgument(f"the job has {len(request.layers)} layers but "
                                             f"{len(request.layer_digests)} layer digests")
            verify_job(self.verifier, owner=owner, client_cert=request.client_cert,
                       job_signature=request.job_signature, digests=request.layer_digests,
                       config=request.config, layers=request.layers)
        with self._submit_lock:
            self._admit_job(request)
            job_id = self.tracker.jobs.submit(request)
        self.tracker.feeders.submitted(job_id)
        return S.SubmitJobReply(job_id=job_id)

    @_unary
    def GetJob(self, request, context):
        self._owned(context, request.job_id)
        job = self.tracker.jobs.replicas.annotate(self.tracker.jobs.info(request.job_id))
        job.feeder = self.tracker.feeders.feeder(request.job_id)
        return self.tracker.feeders.shown(job)

    @_unary
    def CancelJob(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.jobs.cancel(request.job_id, request.reason, request.keep_weights)

    @_stream
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
        yield from self.tracker.jobs.watch(
            request.job_id, request.after_seq,
            active=lambda: context.is_active() and not stopping.is_set())

    @_unary
    def RestoreJob(self, request, context):
        job = self._owned(context, request.job_id)
        if not 0 < request.step < job.steps:
            raise errors.InvalidArgument(f"job {job.job_id} has {job.steps} steps: it cannot "
                                         f"resume at step {request.step}")
        self.tracker.jobs.rewind_for_client(
            job.job_id, f"restoring the client's checkpoint of step {request.step}",
            rewind_to=request.step, restored=True)
        return self.tracker.jobs.get(job.job_id)

    @_unary
    def ReportStage(self, request, context):
        # the node must be itself; jobs.report then checks it runs that stage
        self._speaks_for(context, request.node_id)
        self.tracker.jobs.report(request)
        return S.StageReportReply()

    @_unary
    def ReplicaQuorum(self, request, context):
        self._speaks_for(context, request.node_id)
        return self.tracker.jobs.replicas.ask(request)

    @_unary
    def JoinReplica(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.jobs.replicas.join(request.job_id, request.replica, request.step)


def serve(host: str, port: int, db: str, lease: float = 10.0, link_refresh: float = 300.0,
          *, tls: TlsConfig | None = None, insecure: bool = False,
          max_job_bytes: int = MAX_JOB_BYTES, heartbeat_rate: float | None = None,
          freeze_heap: bool = False) -> tuple[grpc.Server, TrackerService, int]:
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

    Raises:
        ValueError: plaintext on a non-loopback ``host`` without ``insecure``.
        OSError: the port cannot be bound.
        StoreError: the store cannot be opened (a bad URL, an unreachable database, a
            schema newer than this fedpipe; :mod:`fedpipe.tracker.store`).
    """
    net.check_plaintext(host, tls, insecure, "the tracker")
    rate = HEARTBEAT_RATE if heartbeat_rate is None else heartbeat_rate
    service = TrackerService(Tracker(open_store(db), GrpcNodeCalls(tls=tls), lease=lease,
                                     link_refresh=link_refresh, heartbeat_rate=rate,
                                     plan_processes=PLAN_PROCESSES,
                                     freeze_heap=freeze_heap), tls,
                             max_job_bytes=max_job_bytes)
    srv = net.server(tls=tls, client_calls=net.TRACKER_CLIENT_DATA_CALLS)
    tracker_pb2_grpc.add_TrackerServicer_to_server(service, srv)
    real = net.bind(srv, host, port)
    srv.start()
    return srv, service, real
