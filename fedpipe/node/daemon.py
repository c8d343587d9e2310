"""`fedpipe node`: probe, serve the Node service, register with the tracker, heartbeat."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
import torch

from .. import net
from ..net.emulation import LinkProfile
from ..proto import node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from .probe import probe, resolve_device
from .service import NodeService

log = logging.getLogger("fedpipe.node")


class NodeDaemon:
    """One node process: its server, its tracker session and heartbeats.

    Args:
        tracker: tracker ``HOST:PORT``.
        host, port: where to serve (port 0 takes a free port; :attr:`port` tells which).
        advertise: host peers should dial (default: ``host``, or 127.0.0.1 for 0.0.0.0).
        name: human-readable node name.
        device: "cpu", "cuda[:N]" or "auto".
        threads: torch intra-op threads.
        trust_code: accept pickled layers from non-loopback peers.
        memory_limit: cap on advertised memory, bytes.
        link_profile: path of an emulated link profile (:mod:`fedpipe.net.emulation`).

    Raises:
        ValueError: an unusable device, or a malformed link profile.
        OSError: the port cannot be bound.
    """

    def __init__(self, tracker: str, host: str = "127.0.0.1", port: int = 0, *,
                 advertise: str | None = None, name: str = "", device: str = "auto",
                 threads: int | None = None, trust_code: bool = False,
                 memory_limit: int | None = None, link_profile: str | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.tracker_address = tracker
        self.resources = probe(resolve_device(device), memory_limit)
        self.stop_event = threading.Event()
        self.node_id = ""
        self.lease = 10.0
        self.tracker = tracker_pb2_grpc.TrackerStub(net.channel(tracker))
        self.reports = futures.ThreadPoolExecutor(1, thread_name_prefix="report")
        links = LinkProfile.load(link_profile) if link_profile else None
        self.server = net.server()
        self.port = net.bind(self.server, host, port)
        adv = advertise or ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        self.address = f"{adv}:{self.port}"
        self.name = name or f"node-{self.port}"
        self.service = NodeService(lambda: self.node_id, self.name, self.resources, self._report,
                                   trust_code=trust_code, links=links)
        node_pb2_grpc.add_NodeServicer_to_server(self.service, self.server)

    def _report(self, report: tracker_pb2.StageReport) -> None:
        self.reports.submit(lambda: net.retry(
            lambda: self.tracker.ReportStage(report, timeout=10), "report to tracker",
            stop=self.stop_event.is_set))

    def register(self) -> None:
        """Register with the tracker, retrying with backoff while it is unreachable."""
        req = tracker_pb2.RegisterNodeRequest(name=self.name, address=self.address,
                                              resources=self.resources)
        reply = net.retry(lambda: self.tracker.RegisterNode(req, timeout=10),
                          f"registering with tracker {self.tracker_address}",
                          max_delay=5.0, stop=self.stop_event.is_set)
        self.node_id, self.lease = reply.node_id, reply.lease_seconds
        log.info("registered as %s (%s) at %s: %s, %d cores, %.1f GFLOP/s, %.1f GiB",
                 self.name, self.node_id, self.address, self.resources.device,
                 self.resources.cores, self.resources.flops / 1e9,
                 self.resources.memory_bytes / 2**30)

    def _heartbeat(self) -> None:
        while not self.stop_event.wait(self.lease / 4):
            try:
                reply = self.tracker.Heartbeat(
                    tracker_pb2.HeartbeatRequest(node_id=self.node_id), timeout=5)
                if not reply.known:
                    log.warning("tracker does not know this node; registering again")
                    self.register()
            except grpc.RpcError as e:
                log.warning("heartbeat to tracker %s failed (%s: %s)", self.tracker_address,
                            e.code().name, e.details())

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`stop`."""
        self.server.start()
        log.info("serving on %s", self.address)
        try:
            self.register()
        except grpc.RpcError:
            if not self.stop_event.is_set():
                raise
        hb = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        hb.start()
        self.stop_event.wait()
        self.service.stop_all()
        if self.node_id:
            try:  # so no job is planned onto a node that is gone
                self.tracker.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=self.node_id,
                                                                    leaving=True), timeout=2)
            except grpc.RpcError as e:
                log.warning("could not tell the tracker this node is leaving: %s", e.details())
        self.server.stop(grace=1).wait()

    def stop(self, *_) -> None:
        """Ask :meth:`run` to return."""
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
