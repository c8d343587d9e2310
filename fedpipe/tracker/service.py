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
from ..security import SecurityError, TlsConfig, identity_of
from ..security.policy import require_owner, require_self
from ..security.signing import verify_job
from . import errors
from .nodes import GrpcNodeCalls
from .scheduler import Tracker
from .store import SqliteStore

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

MAX_JOB_BYTES = 128 * 2**20
"""The most bytes of layers a submitted job may carry (they are stored in the tracker's
database and sent to nodes); ``fedpipe tracker --max-job-bytes`` changes it."""
MAX_JOBS_PER_OWNER = 8
"""The most jobs one client (certificate) may have pending or running at once; more are
refused with RESOURCE_EXHAUSTED and the count, so one client cannot flood the tracker."""

STATUS: dict[type[errors.TrackerError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
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
        node_id = self.tracker.register(request)
        with self._names_lock:
            self._names[node_id] = request.name
        r = self.tracker.registry
        return S.RegisterNodeReply(node_id=node_id, lease_seconds=r.lease,
                                   heartbeat_seconds=r.heartbeat_seconds)

    @_unary
    def Heartbeat(self, request, context):
        self._speaks_for(context, request.node_id)
        r = self.tracker.registry
        known = r.leave(request.node_id) if request.leaving else r.heartbeat(request.node_id)
        drop, drop_jobs = self.tracker.jobs.reconcile(request.node_id, list(request.holds))
        # the swarm's deny list, whole: the node refuses these on every call it serves
        revoked = self.verifier.deny_list().to_proto() if self.verifier is not None else []
        return S.HeartbeatReply(known=known, lease_seconds=r.lease,
                                heartbeat_seconds=r.heartbeat_seconds, drop=drop,
                                drop_jobs=drop_jobs, revoked=revoked)

    @_unary
    def ListNodes(self, request, context):
        store = self.tracker.store
        return S.ListNodesReply(nodes=store.nodes(request.include_lost), links=store.links())

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
            return S.SubmitJobReply(job_id=self.tracker.jobs.submit(request))

    @_unary
    def GetJob(self, request, context):
        return self._owned(context, request.job_id)

    @_unary
    def CancelJob(self, request, context):
        self._owned(context, request.job_id)
        return self.tracker.jobs.cancel(request.job_id, request.reason, request.keep_weights)

    @_stream
    def WatchJob(self, request, context):
        self._owned(context, request.job_id)
        stopping = self.tracker.stop_event
        yield from self.tracker.jobs.watch(
            request.job_id, request.after_seq,
            active=lambda: context.is_active() and not stopping.is_set())

    @_unary
    def ReportStage(self, request, context):
        # the node must be itself; jobs.report then checks it runs that stage
        self._speaks_for(context, request.node_id)
        self.tracker.jobs.report(request)
        return S.StageReportReply()


def serve(host: str, port: int, db: str, lease: float = 10.0, link_refresh: float = 300.0,
          *, tls: TlsConfig | None = None, insecure: bool = False,
          max_job_bytes: int = MAX_JOB_BYTES) -> tuple[grpc.Server, TrackerService, int]:
    """Start a tracker server on the SQLite file ``db``; returns ``(server, service, port)``.

    Args:
        tls: the tracker's certificate (role tracker): the server takes only mutual
            TLS and enforces the policy table, and the tracker's calls to nodes
            show this certificate. None: plaintext.
        insecure: allow plaintext on a non-loopback ``host`` (see
            :func:`fedpipe.net.check_plaintext`).
        max_job_bytes: the most bytes of layers a job may carry.

    Raises:
        ValueError: plaintext on a non-loopback ``host`` without ``insecure``.
        OSError: the port cannot be bound.
        sqlite3.Error: the database cannot be opened.
    """
    net.check_plaintext(host, tls, insecure, "the tracker")
    service = TrackerService(Tracker(SqliteStore(db), GrpcNodeCalls(tls=tls), lease=lease,
                                     link_refresh=link_refresh), tls,
                             max_job_bytes=max_job_bytes)
    srv = net.server(tls=tls)
    tracker_pb2_grpc.add_TrackerServicer_to_server(service, srv)
    real = net.bind(srv, host, port)
    srv.start()
    return srv, service, real
