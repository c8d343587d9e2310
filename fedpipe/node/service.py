"""The Node gRPC service: each RPC decodes its request, calls, and maps errors to status codes.

What it calls (:class:`~fedpipe.node.parts.NodeParts`): the stage registry
(:mod:`~fedpipe.node.stages`), the data plane (:mod:`~fedpipe.node.admission`),
the snapshot desk (:mod:`~fedpipe.node.snapshots`), the job access book
(:mod:`~fedpipe.node.access`), the stream watch (:mod:`~fedpipe.node.streams`) and
the shared channels (:mod:`~fedpipe.node.peers`). Every handler wears
:func:`~fedpipe.node.errors.maps_errors`, so a domain error has one status code
wherever it is raised (:data:`~fedpipe.node.errors.STATUS`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from ..net import timeouts
from ..net.dataplane import DataPlane as SocketPlane
from ..net.dataplane import LinkFailed
from ..net.emulation import LinkProfile
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2, node_pb2_grpc, tracker_pb2
from ..security import TlsConfig, identity_of
from ..wire import frames
from ..wire.format import WireError
from . import fetches
from .access import Quorum
from .errors import InvalidRequest, maps_errors
from .lifecycle import StageSlot
from .mailbox import JOB_TENSORS
from .parts import NodeParts, build_parts
from .linkprobe import (MAX_PINGS, MAX_PROBE_BYTES, MAX_PROBE_SECONDS, PROBE_BYTES,
                        PROBE_PINGS, PROBE_SECONDS, measure_link, measure_socket_link)

log = logging.getLogger(__name__)

MAX_MEASURE_PEERS = 4096
"""The most peers one MeasureLinks call may ask a node to probe (each probe sends up to
``MAX_PROBE_BYTES``, so this bounds what one request can make a node send)."""


class _SocketProbeFailed(Exception):
    """A probe over the socket data plane failed: recorded in the link's measurement."""


class NodeService(node_pb2_grpc.NodeServicer):
    """The Node service of one node process.

    Args:
        node_id, name, resources, report, trust_code, input_capacity, job_tensors, links,
            metrics, tls, idle_stream, job_snapshot_bytes, quorum: as
            :func:`~fedpipe.node.parts.build_parts`, which builds the node's parts from them.
        parts: the node's parts, built already (a test's fakes); the arguments above
            but ``node_id``, ``name`` and ``resources`` are then unused.
    """

    def __init__(self, node_id: Callable[[], str], name: str, resources: node_pb2.Resources,
                 report: Callable[[tracker_pb2.StageReport], None], *, trust_code: bool = False,
                 input_capacity: int = 64, job_tensors: int = JOB_TENSORS,
                 links: LinkProfile | None = None, metrics: NodeMetrics | None = None,
                 tls: TlsConfig | None = None, idle_stream: float = timeouts.IDLE_STREAM,
                 job_snapshot_bytes: int | None = None, quorum: Quorum | None = None,
                 parts: NodeParts | None = None):
        self.node_id, self.name, self.resources = node_id, name, resources
        if parts is None:
            parts = build_parts(node_id, name, resources, report, trust_code=trust_code,
                                input_capacity=input_capacity, job_tensors=job_tensors,
                                links=links, metrics=metrics, tls=tls, idle_stream=idle_stream,
                                job_snapshot_bytes=job_snapshot_bytes, quorum=quorum)
        self.parts = parts
        self.stages, self.data, self.desk = parts.stages, parts.data, parts.desk
        self.access, self.streams, self.channels = parts.access, parts.streams, parts.channels
        self.verifier = parts.access.verifier
        self.weights = parts.weights

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        self.stages.stop_all()
        self.streams.close()

    # -- control plane ------------------------------------------------------
    @maps_errors
    def Probe(self, request, context):
        return self.resources

    @maps_errors
    def LoadStage(self, request, context):
        if not request.layers:  # a stage thread with nothing to run would wait forever
            raise InvalidRequest(f"LoadStage of job {request.job_id!r} has no layers")
        self.access.check_code(request, context.peer())
        self.access.learn_plan(request.job_id, request.plan, request.owner)
        self.stages.load(request)
        return node_pb2.LoadStageReply()

    @maps_errors
    def StopJob(self, request, context):
        self.access.require_owner(identity_of(context), request.job_id)
        self.stages.stop_job(request.job_id, request.release, request.before_epoch,
                             request.replicas)
        return node_pb2.StopJobReply()

    @maps_errors
    def FetchState(self, request, context):
        tensors = fetches.state(self.access, self.stages, identity_of(context), request)
        with self.streams.open(context, "FetchState", request.job_id) as watch:
            for name, t in tensors:
                yield from watch.track(frames.encode_frames(t, name=name))

    @maps_errors
    def PutSnapshot(self, request_iterator, context):
        with self.streams.open(context, "PutSnapshot") as watch:
            def check(env: node_pb2.Envelope) -> None:
                watch.belongs_to(env.job_id)
                self.access.check_snapshot(identity_of(context), env)
            self.desk.receive(watch.track(request_iterator), check)
        return node_pb2.SendReply()

    @maps_errors
    def PutWeights(self, request_iterator, context):
        with self.streams.open(context, "PutWeights") as watch:
            identity = identity_of(context)

            def check(env: node_pb2.Envelope) -> None:
                watch.belongs_to(env.job_id)
                self.access.require_owner(identity, env.job_id)
            self.weights.receive(watch.track(request_iterator), check)
        return node_pb2.SendReply()

    @maps_errors
    def FetchSnapshot(self, request, context):
        tensors = fetches.snapshot(self.access, self.desk, identity_of(context), request)
        with self.streams.open(context, "FetchSnapshot", request.job_id) as watch:
            for name, t in tensors:
                yield from watch.track(frames.encode_frames(t, name=name))

    # -- data plane ---------------------------------------------------------
    @maps_errors
    def Send(self, request_iterator, context):
        with self.streams.open(context, "Send") as watch:
            identity = identity_of(context)

            def check(head: node_pb2.Frame) -> None:
                env = head.envelope
                if env.kind != node_pb2.KIND_PROBE:
                    watch.belongs_to(env.job_id)
                self.access.check_sender(identity, env, lambda e: self.stages.get(
                    StageSlot(e.job_id, e.replica, e.stage)).n_stages)
            self.data.receive(watch.track(request_iterator), check, context.is_active)
        return node_pb2.SendReply()

    @maps_errors
    def SendOne(self, request, context):
        # Send's single-frame form: a unary call (fedpipe.wire.rpc.send)
        return self.Send(iter((request,)), context)

    @maps_errors
    def HoldAt(self, request, context):
        accepted, done = self.stages.hold(request.job_id, request.epoch, request.step)
        return node_pb2.HoldAtReply(accepted=accepted, done=done)

    @maps_errors
    def AssignJob(self, request, context):
        # the policy admits only the tracker: a node's word on its own assignment never counts
        if not request.job_id:
            raise InvalidRequest("AssignJob names no job")
        self.access.learn(request.job_id, request.owner, request.node_names)
        moved = self.stages.readdress(request.job_id, request.epoch, request.stages)
        plane = self.parts.sockets
        for name, (old, new) in moved.items():
            log.info("job %s: node %s moved (data plane %s -> %s)", request.job_id, name, old,
                     new)
            if plane is not None:
                plane.redirect(name, old, new)
        log.info("job %s: plan epoch %d assigns %s", request.job_id, request.epoch,
                 ", ".join(sorted(set(request.node_names))))
        return node_pb2.AssignJobReply()

    # -- link measurement ---------------------------------------------------
    @maps_errors
    def Ping(self, request, context):
        return node_pb2.PingReply()

    @maps_errors
    def MeasureLinks(self, request, context):
        pings = min(max(request.pings, 1), MAX_PINGS) if request.pings else PROBE_PINGS
        max_bytes = min(request.max_probe_bytes or PROBE_BYTES, MAX_PROBE_BYTES)
        seconds = min(request.probe_seconds or PROBE_SECONDS, MAX_PROBE_SECONDS)
        if len(request.peers) > MAX_MEASURE_PEERS:
            raise InvalidRequest(f"MeasureLinks asks for {len(request.peers)} peers, more than "
                                 f"{MAX_MEASURE_PEERS} at once")
        out = node_pb2.MeasureLinksReply()
        for peer in request.peers:
            host, colon, port = peer.data_address.rpartition(":")
            if peer.data_address and not (host and colon and port.isdigit()):
                raise InvalidRequest(f"MeasureLinks: peer {peer.name!r}'s data address "
                                     f"{peer.data_address!r} is not HOST:PORT")
        for peer in request.peers:
            m = node_pb2.LinkMeasurement(src_id=self.node_id(), dst_id=peer.node_id,
                                         measured_at=time.time())
            plane = self.parts.sockets if peer.data_address else None
            try:
                if plane is not None:  # the path its tensors take
                    m.latency, m.bandwidth = self._measure_socket(plane, peer, pings, max_bytes,
                                                                  seconds)
                else:
                    with self.channels.borrow(peer.address, self.parts.shaper(peer.name)) as ch:
                        m.latency, m.bandwidth = measure_link(ch, pings=pings,
                                                              max_bytes=max_bytes,
                                                              seconds=seconds)
            except grpc.RpcError as e:
                m.error = f"{e.code().name}: {e.details()}"
            except _SocketProbeFailed as e:
                m.error = f"socket data plane: {e}"
            out.links.append(m)
        return out

    def _measure_socket(self, plane: SocketPlane, peer: node_pb2.Peer, pings: int,
                        max_bytes: int, seconds: float) -> tuple[float, float]:
        """``(latency, bandwidth)`` to ``peer`` over the socket data plane.

        Raises:
            _SocketProbeFailed: the link failed or the peer refused a probe.
        """
        try:
            return measure_socket_link(  # a probe is no job's: the peer's untagged link
                plane.link(peer.name, peer.data_address),
                self.parts.pacer(peer.name), pings=pings, max_bytes=max_bytes, seconds=seconds)
        except (LinkFailed, WireError, OSError) as e:  # PeerRefused is a WireError
            raise _SocketProbeFailed(str(e)) from e
