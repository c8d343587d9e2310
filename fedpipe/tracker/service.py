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

import grpc

from .. import net
# cli.py and fedpipe.testing import these two from here
from ..planner.protoio import cluster_view, unmeasured  # noqa: F401
from ..proto import tracker_pb2, tracker_pb2_grpc
from ..security import TlsConfig
from . import errors
from .nodes import GrpcNodeCalls
from .scheduler import Tracker
from .store import SqliteStore

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2

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
    """Answer a unary RPC whose domain call raised a :class:`~.errors.TrackerError` with
    that error's status code and message."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            return method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
    return call


def _stream(method):
    """:func:`_unary` for a server-streaming RPC."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            yield from method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
    return call


class TrackerService(tracker_pb2_grpc.TrackerServicer):
    """The Tracker service over a :class:`~fedpipe.tracker.scheduler.Tracker`."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.store = tracker.store  # the caller closes it after the server stops

    def close(self) -> None:
        """Stop the tracker's background loops and close its channels to nodes."""
        self.tracker.close()

    @_unary
    def RegisterNode(self, request, context):
        node_id = self.tracker.register(request)
        r = self.tracker.registry
        return S.RegisterNodeReply(node_id=node_id, lease_seconds=r.lease,
                                   heartbeat_seconds=r.heartbeat_seconds)

    @_unary
    def Heartbeat(self, request, context):
        r = self.tracker.registry
        known = r.leave(request.node_id) if request.leaving else r.heartbeat(request.node_id)
        drop, drop_jobs = self.tracker.jobs.reconcile(request.node_id, list(request.holds))
        return S.HeartbeatReply(known=known, lease_seconds=r.lease,
                                heartbeat_seconds=r.heartbeat_seconds, drop=drop,
                                drop_jobs=drop_jobs)

    @_unary
    def ListNodes(self, request, context):
        store = self.tracker.store
        return S.ListNodesReply(nodes=store.nodes(request.include_lost), links=store.links())

    @_unary
    def SubmitJob(self, request, context):
        return S.SubmitJobReply(job_id=self.tracker.jobs.submit(request))

    @_unary
    def GetJob(self, request, context):
        return self.tracker.jobs.get(request.job_id)

    @_unary
    def CancelJob(self, request, context):
        return self.tracker.jobs.cancel(request.job_id, request.reason)

    @_stream
    def WatchJob(self, request, context):
        stopping = self.tracker.stop_event
        yield from self.tracker.jobs.watch(
            request.job_id, request.after_seq,
            active=lambda: context.is_active() and not stopping.is_set())

    @_unary
    def ReportStage(self, request, context):
        self.tracker.jobs.report(request)
        return S.StageReportReply()


def serve(host: str, port: int, db: str, lease: float = 10.0, link_refresh: float = 300.0,
          *, tls: TlsConfig | None = None) -> tuple[grpc.Server, TrackerService, int]:
    """Start a tracker server on the SQLite file ``db``; returns ``(server, service, port)``.

    Args:
        tls: the tracker's certificate (role tracker): the server takes only mutual
            TLS and enforces the policy table, and the tracker's calls to nodes
            show this certificate. None: plaintext.

    Raises:
        OSError: the port cannot be bound.
        sqlite3.Error: the database cannot be opened.
    """
    service = TrackerService(Tracker(SqliteStore(db), GrpcNodeCalls(tls), lease=lease,
                                     link_refresh=link_refresh))
    srv = net.server(tls=tls)
    tracker_pb2_grpc.add_TrackerServicer_to_server(service, srv)
    real = net.bind(srv, host, port)
    srv.start()
    return srv, service, real
