"""The calls the tracker makes to nodes, behind a small protocol.

The job life cycle (:mod:`~fedpipe.tracker.jobs`) and the link measurer
(:mod:`~fedpipe.tracker.links`) talk to nodes only through :class:`NodeCalls`,
so their tests can pass fakes and run without gRPC or processes.
:class:`GrpcNodeCalls` is the real one: a cached channel per node address (at
most :data:`MAX_CHANNELS`, the least recently used closed first, so a swarm of
10,000 nodes does not hold 10,000 connections open; link measurement opens one
channel per call), all closed by
:meth:`GrpcNodeCalls.close`, and the deadlines of :mod:`fedpipe.net.timeouts`.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import grpc

from .. import net
from ..net import timeouts
from ..proto import node_pb2, node_pb2_grpc
from ..security import TlsConfig


MAX_CHANNELS = 256
"""Channels to nodes kept open; a call to another node closes the least recently used."""


class NodeCallError(Exception):
    """A call to a node failed; the message is the node's (or the transport's) reason."""


class NodeCalls(Protocol):
    """What the tracker asks of a node at ``address`` (``HOST:PORT``).

    Every method raises :class:`NodeCallError` when the call fails.
    """

    def load_stage(self, address: str, request: node_pb2.LoadStageRequest) -> None:
        """Load one stage of a job."""

    def stop_job(self, address: str, request: node_pb2.StopJobRequest) -> None:
        """Stop (and maybe release) a job's stages on the node."""

    def hold_at(self, address: str, request: node_pb2.HoldAtRequest) -> node_pb2.HoldAtReply:
        """Ask a job's stages on the node to stop at a step boundary (a hand-over cut)."""

    def assign_job(self, address: str, request: node_pb2.AssignJobRequest) -> None:
        """Tell the node which nodes a new plan epoch of a job assigns (so it serves them
        the job's state it holds)."""

    def measure_links(self, address: str, request: node_pb2.MeasureLinksRequest
                      ) -> node_pb2.MeasureLinksReply:
        """Measure the node's links to ``request.peers``."""

    def ping(self, address: str, timeout: float) -> None:
        """A round trip within ``timeout`` seconds (is the node there and answering?)."""


class GrpcNodeCalls:
    """:class:`NodeCalls` over gRPC, with a channel per node address (at most
    ``max_channels`` open; see the module docstring).

    Args:
        max_channels: the most channels kept open (least recently used closed first).
        tls: the tracker's certificate, for mutual TLS to nodes (None: plaintext).
    """

    def __init__(self, max_channels: int = MAX_CHANNELS, tls: TlsConfig | None = None):
        self.tls = tls
        self._lock = threading.Lock()
        self._channels: OrderedDict[str, grpc.Channel] = OrderedDict()
        self.max_channels = max_channels

    def _stub(self, address: str) -> node_pb2_grpc.NodeStub:
        evicted = []
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = net.channel(address, tls=self.tls)
                while len(self._channels) > self.max_channels:
                    evicted.append(self._channels.popitem(last=False)[1])
            else:
                self._channels.move_to_end(address)
        # a call still running on an evicted channel fails with CANCELLED, like any failed
        # call; with hundreds of channels that needs hundreds of concurrent calls
        for old in evicted:
            old.close()
        return node_pb2_grpc.NodeStub(ch)

    @staticmethod
    def _call(method, request, timeout: float):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise NodeCallError(e.details() or e.code().name) from None

    def load_stage(self, address, request):
        self._call(self._stub(address).LoadStage, request, timeouts.LOAD_STAGE_RPC)

    def stop_job(self, address, request):
        self._call(self._stub(address).StopJob, request, timeouts.CONTROL_RPC)

    def hold_at(self, address, request):
        return self._call(self._stub(address).HoldAt, request, timeouts.CONTROL_RPC)

    def assign_job(self, address, request):
        self._call(self._stub(address).AssignJob, request, timeouts.CONTROL_RPC)

    def measure_links(self, address, request):
        # a channel of its own: the measurer visits every node in turn, and through the
        # cache it would evict the channels of running deploys
        with net.channel(address, tls=self.tls) as ch:
            return self._call(node_pb2_grpc.NodeStub(ch).MeasureLinks, request,
                              timeouts.measure_links(len(request.peers)))

    def ping(self, address, timeout):
        self._call(self._stub(address).Ping, node_pb2.PingRequest(), timeout)

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), OrderedDict()
        for ch in channels:
            ch.close()
