"""`fedpipe node`: probe, serve the Node service, register with the tracker, heartbeat."""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import uuid

import cloudpickle
import grpc
import torch

from .. import __version__, net
from ..net import timeouts, trackers
from ..net.emulation import LinkProfile
from ..net.dataplane.caps import Sources
from ..net.relay import Allocation, Homing
from ..observe.metrics import NodeMetrics, start_metrics
from ..observe.serving import LOCALHOST, Served
from ..proto import tracker_pb2, tracker_pb2_grpc
from ..runtime.stage import StageError
from ..security import CertError, DenyList, Role, TlsConfig
from ..spec import PROTOCOL_VERSION
from ..wire import rpc
from .draining import DrainClock
from .parts import build_parts
from .reports import UNREACHABLE, ReportQueue
from .probe import probe, resolve_device
from .service import NodeService

log = logging.getLogger("fedpipe.node")

DRAIN_TIMEOUT = 60.0
"""Default seconds a draining node waits for its stages to be handed over before it exits;
``node/fedpipe-node.service``'s ``TimeoutStopSec`` is a little more."""
DRAIN_POLL = 0.2
"""Seconds between a draining node's looks at whether it may exit."""


def local_versions() -> tracker_pb2.Versions:
    """This process's versions, as the tracker compares them at registration."""
    return tracker_pb2.Versions(fedpipe=__version__, protocol=PROTOCOL_VERSION,
                                python=f"{sys.version_info.major}.{sys.version_info.minor}",
                                torch=torch.__version__, cloudpickle=cloudpickle.__version__)


class NodeDaemon:
    """One node process: its server, its tracker session and heartbeats.

    Each daemon has a fresh boot id: the tracker treats a node that registers
    again from the same address with another boot id as a new incarnation and
    fences the old one off. It heartbeats as often as the tracker's last reply says.

    Args:
        tracker: tracker ``HOST:PORT``.
        host, port: where to serve (port 0 takes a free port; :attr:`port` tells which).
        advertise: host peers should dial (default: ``host``, or 127.0.0.1 for 0.0.0.0).
        name: human-readable node name.
        device: "cpu", "cuda[:N]" or "auto".
        threads: torch intra-op threads.
        trust_code: accept pickled layers from non-loopback peers.
        memory_limit: cap on advertised memory, bytes.
        host_id: the machine this node shares its cores with other nodes of (the
            planner's ``host_factors``), instead of the probed one (the boot id);
            "" for none, as for containers that share a kernel but not cores.
        link_profile: path of an emulated link profile (:mod:`fedpipe.net.emulation`).
        snapshot_dir: keep checkpoint snapshots as files in this directory, not in
            memory, and advertise it (``Resources.snapshots_on_disk``: the planner then
            prices none in this node's memory); None: in memory.
        metrics_port: serve Prometheus metrics (:class:`~fedpipe.observe.metrics.NodeMetrics`)
            at ``http://METRICS_HOST:PORT/metrics`` (0: no metrics).
        metrics_host: address the metrics bind; 127.0.0.1 by default, since they have
            no authentication.
        tls: this node's certificate (role node): its server takes only mutual TLS
            and enforces the policy table, and its calls to the tracker and peers
            show it. ``name`` must be the certificate's name (default: it is).
            None: plaintext. With TLS ``trust_code`` is ignored: code loads only
            from jobs signed by a client certificate.
        insecure: allow plaintext on a non-loopback ``host`` (see
            :func:`fedpipe.net.check_plaintext`).
        drain_timeout: on SIGTERM (or when the tracker drains it), seconds to wait
            for the tracker to move this node's stages to other nodes before it
            exits anyway (0: exit at once), counted only while a tracker leads: a
            leaderless window is waited out for up to
            :data:`~fedpipe.net.timeouts.LEADER_WAIT` s (:mod:`.draining`). SIGINT
            always exits at once.
        data_port: the port of this node's socket data plane (:mod:`fedpipe.net.dataplane`)
            on ``host`` (0: a free one; :attr:`data_address` tells which), advertised to
            the tracker so peers send this node tensors there; None: none, peers send
            over gRPC.
        relays: outbound-only: home at the first of these relays (``HOST:PORT``) that
            answers (:class:`fedpipe.net.relay.Homing`) and advertise the addresses it
            allocates, not this node's own; the node's own ports listen on ``host`` only
            for the relay's loopback streams. Empty: this node is reachable.

    Raises:
        ValueError: a ``tracker`` that is not ``HOST:PORT``
            (:func:`fedpipe.net.trackers.addresses`), an unusable device, a malformed
            link profile, or a ``name``
            that is not the TLS certificate's, or plaintext on a non-loopback ``host``
            without ``insecure``.
        RelayRefused: every relay of ``relays`` refused this node (their reasons).
        OSError: the port, the data port or the metrics port cannot be bound.
    """

    def __init__(self, tracker: str, host: str = "127.0.0.1", port: int = 0, *,
                 advertise: str | None = None, name: str = "", device: str = "auto",
                 threads: int | None = None, trust_code: bool = False,
                 memory_limit: int | None = None, link_profile: str | None = None,
                 metrics_port: int = 0, metrics_host: str = LOCALHOST,
                 tls: TlsConfig | None = None, insecure: bool = False,
                 drain_timeout: float = DRAIN_TIMEOUT, host_id: str | None = None,
                 data_port: int | None = 0, relays: list[str] | None = None,
                 snapshot_dir: str | None = None):
        trackers.addresses(tracker)  # a bad address now, not as UNAVAILABLE for ever
        net.check_plaintext(host, tls, insecure, "this node")
        if tls is not None:
            if trust_code:
                log.warning("--trust-code is ignored under TLS: this node loads code only "
                            "from jobs signed by a client certificate of the swarm CA")
                trust_code = False
            if tls.identity.role is not Role.NODE:
                raise ValueError(f"a node needs a certificate with role node, not "
                                 f"{tls.identity} ({tls.directory})")
            if name and name != tls.name:
                raise ValueError(f"--name {name!r} is not the name in this node's certificate "
                                 f"({tls.name!r}): a node may speak only as its certificate")
            name = tls.name
        if threads:
            torch.set_num_threads(threads)
        self.tracker_address = tracker
        self.resources = probe(resolve_device(device), memory_limit)
        if host_id is not None:
            self.resources.host_id = host_id
        self.resources.snapshots_on_disk = snapshot_dir is not None
        self.stop_event = threading.Event()
        self.drain_timeout = drain_timeout
        self.draining = threading.Event()
        """Set once this node drains (SIGTERM, or the tracker's word): it says so in every
        heartbeat and exits when the tracker says no job needs it, or after drain_timeout."""
        self.drained = threading.Event()
        self.drain_clock = DrainClock(drain_timeout)
        """The drain's timeout counts only while a tracker leads (:mod:`.draining`)."""
        self.node_id = ""
        self.boot_id = uuid.uuid4().hex
        self.lease = 10.0
        self.heartbeat_seconds = self.lease / 4  # until the tracker's first reply says
        self.tls = tls
        self._deny_serials: frozenset[int] = frozenset()
        self.tracker = tracker_pb2_grpc.TrackerStub(net.channel(tracker, tls=tls))
        self.reports = ReportQueue(
            lambda r: self.tracker.ReportStage(r, timeout=timeouts.CONTROL_RPC))
        links = LinkProfile.load(link_profile) if link_profile else None
        self.server = net.server(tls=tls)
        self.port = net.bind(self.server, host, port)
        adv = advertise or ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        self.address = f"{adv}:{self.port}"
        self.name = name or f"node-{self.port}"
        self.metrics = NodeMetrics(self.name) if metrics_port else None
        self.metrics_server: Served | None = None
        if self.metrics is not None:
            self.metrics_server = start_metrics(self.metrics.registry, metrics_port,
                                                metrics_host)
        sources = Sources() if relays else None  # relayed streams' dialers, for the caps
        parts = build_parts(lambda: self.node_id, self.name, self.resources, self._report,
                            trust_code=trust_code, links=links, metrics=self.metrics,
                            tls=tls, quorum=self._quorum, data_port=data_port,
                            data_host=host, snapshot_dir=snapshot_dir, data_sources=sources)
        self.parts = parts
        self.data_address = f"{adv}:{parts.sockets.port}" if parts.sockets is not None else ""
        """``HOST:PORT`` of this node's socket data plane ("": none)."""
        self.service = NodeService(lambda: self.node_id, self.name, self.resources, self._report,
                                   parts=parts)
        rpc.add_node_servicer(self.service, self.server)
        self.homing: Homing | None = None
        """This node's tie to its relays (None: it is reachable at its own addresses)."""
        if relays:
            self.homing = Homing(relays, self.name, self.port,
                                 parts.sockets.port if parts.sockets is not None else None,
                                 local_host=host, tls=tls, on_moved=self._moved,
                                 on_displaced=lambda why: self.stop(), sources=sources)
            try:
                self._take(self.homing.home())
            except BaseException:
                self.parts.close()
                raise

    def _take(self, alloc: Allocation) -> None:
        """Advertise a relay's allocation as this node's addresses."""
        self.address = alloc.grpc_address
        self.data_address = alloc.data_address

    def _moved(self, alloc: Allocation) -> None:
        """A re-homing changed this node's addresses: register them with the tracker,
        naming this node's id.

        The tracker keeps the id of a live node that moved relays (same name and boot id):
        its stages go on, and the jobs' plans follow the new addresses, the peers' links
        redialing them (:mod:`fedpipe.tracker.readdress`). If it gives a new id instead
        (this node's lease ran out meanwhile), this is a new incarnation: the old one's
        stages stop and it says it leaves, so its jobs recover as from a node loss now,
        instead of after its lease."""
        self._take(alloc)
        log.warning("node %s moved to relay %s: registering its new addresses %s, %s",
                    self.name, alloc.relay, alloc.grpc_address, alloc.data_address or "-")
        old = self.node_id
        if not old:
            return  # not registered yet: the registration takes the new addresses
        try:
            self.register(moving=True)
            if self.node_id != old:
                # stopped, the old incarnation's stages send no stale tensor
                self.service.stages.stop_live(f"node {self.name} moved to relay {alloc.relay}")
                self.tracker.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=old, leaving=True),
                                       timeout=timeouts.LEAVING_RPC)
        except grpc.RpcError as e:  # the heartbeat registers again if the tracker lost it
            log.warning("could not register the new addresses: %s", e.details())

    def _report(self, report: tracker_pb2.StageReport) -> None:
        self.reports.put(report)

    def _quorum(self, request: tracker_pb2.ReplicaQuorumRequest
                ) -> tracker_pb2.ReplicaQuorumReply:
        """One ReplicaQuorum call for a stage, retried while no tracker leads, for at most
        :data:`~fedpipe.net.timeouts.LEADER_WAIT` s (the stage waits: the step cannot
        commit without one).

        Raises:
            StageError: no tracker led within that deadline (the stage fails, and its
                job with this reason once a tracker leads again).
            grpc.RpcError: a refusal, or the node stops.
        """
        deadline = time.monotonic() + timeouts.LEADER_WAIT
        try:
            return net.retry(
                lambda: self.tracker.ReplicaQuorum(request, timeout=timeouts.QUORUM_RPC),
                "replica quorum", max_delay=timeouts.RECONNECT_BACKOFF_MAX,
                stop=lambda: self.stop_event.is_set() or time.monotonic() > deadline,
                on_retry=self.reports.unreachable)
        except grpc.RpcError as e:
            if self.stop_event.is_set() or e.code() not in UNREACHABLE:
                raise
            raise StageError(
                f"no tracker led within LEADER_WAIT={timeouts.LEADER_WAIT:.0f} s to commit "
                f"step {request.step} of the replica groups ({e.code().name}: "
                f"{e.details()}); set FEDPIPE_LEADER_WAIT to wait longer") from None

    def register(self, moving: bool = False) -> None:
        """Register with the tracker, retrying with backoff while it is unreachable
        (``moving``: at new addresses, naming the id this node holds)."""
        req = tracker_pb2.RegisterNodeRequest(node_id=self.node_id if moving else "",
                                              name=self.name, address=self.address,
                                              resources=self.resources,
                                              versions=local_versions(), boot_id=self.boot_id,
                                              data_address=self.data_address,
                                              relay=self.homing.relay if self.homing else "")
        reply = net.retry(lambda: self.tracker.RegisterNode(req, timeout=timeouts.CONTROL_RPC),
                          "registering", peer=f"tracker {self.tracker_address}",
                          max_delay=5.0, stop=self.stop_event.is_set)
        self.node_id = reply.node_id
        self._lease_from(reply)
        log.info("registered as %s (%s) at %s: %s, %d cores, %.1f GFLOP/s, %.1f GiB",
                 self.name, self.node_id, self.address, self.resources.device,
                 self.resources.cores, self.resources.flops / 1e9,
                 self.resources.memory_bytes / 2**30)

    def _lease_from(self, reply) -> None:
        """Take the lease and heartbeat interval the tracker's reply sets."""
        self.lease = reply.lease_seconds or self.lease
        # a tracker that leaves the interval unset (0) gets the lease/4 it used to mean
        self.heartbeat_seconds = reply.heartbeat_seconds or self.lease / 4

    def _take_deny_list(self, reply: tracker_pb2.HeartbeatReply) -> None:
        """Refuse the certificates the tracker's deny list names, on every call this node
        serves (its server and its job-signature checks share one authenticator)."""
        if self.tls is None:
            return
        try:
            deny = DenyList.from_proto(reply.revoked)
        except CertError as e:  # keep the last good list rather than forget revocations
            log.error("the tracker's deny list is unusable, keeping the last one: %s", e)
            return
        if deny.serials != self._deny_serials:
            log.info("deny list from the tracker: %d revoked certificate(s)%s",
                     len(deny.entries), "".join(f", {e.name!r}" for e in deny.entries[:5]))
            self._deny_serials = deny.serials
        self.tls.authenticator().set_deny_list(deny)

    def _heartbeat(self) -> None:
        while not self.stop_event.wait(self.heartbeat_seconds):
            try:
                # what this node holds; the reply names what it must drop (reconciliation:
                # a stop message lost while the node was unreachable is never lost for good)
                reply = self.tracker.Heartbeat(
                    tracker_pb2.HeartbeatRequest(node_id=self.node_id,
                                                 holds=self.service.stages.holdings(),
                                                 draining=self.draining.is_set()),
                    timeout=timeouts.HEARTBEAT_RPC)
                if reply.drain and not self.draining.is_set():
                    log.info("the tracker drains this node: its stages move to other nodes")
                    self.drain()
                if reply.drained and self.draining.is_set():
                    self.drained.set()
                if reply.drop or reply.drop_jobs:
                    self.service.stages.drop(list(reply.drop), list(reply.drop_jobs))
                for job_id, step in reply.checkpoints.items():
                    self.service.stages.snapshots.protect(job_id, step)
                self._take_deny_list(reply)
                if reply.known:
                    self._lease_from(reply)
                else:
                    log.warning("tracker does not know this node; registering again")
                    self.register()
                self.drain_clock.reached()
            except grpc.RpcError as e:
                if e.code() in UNREACHABLE:
                    self.drain_clock.unreachable()
                log.warning("heartbeat to tracker %s failed (%s)", self.tracker_address,
                            net.reason(e))

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
        while not self.stop_event.wait(DRAIN_POLL):
            if self.draining.is_set() and self._drain_over():
                break
        self.stop_event.set()
        self.service.stop_all()
        self.reports.flush(timeouts.LEAVING_RPC)  # the stages' last words, best effort
        self.reports.close()
        if self.node_id:
            try:  # so no job is planned onto a node that is gone
                self.tracker.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=self.node_id,
                                                                    leaving=True),
                                       timeout=timeouts.LEAVING_RPC)
            except grpc.RpcError as e:
                log.warning("could not tell the tracker this node is leaving (%s)",
                            net.reason(e))
        self.server.stop(grace=1).wait()
        if self.homing is not None:
            self.homing.close()
        self.parts.close()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def stop(self, *_) -> None:
        """Ask :meth:`run` to return at once."""
        self.stop_event.set()

    def drain(self, *_) -> None:
        """Drain, then return from :meth:`run`: the tracker moves this node's stages to
        other nodes at the next step boundary (:mod:`fedpipe.tracker.elastic`); the node
        takes no new work and returns once no job needs it, or after ``drain_timeout``
        seconds. A drain already under way is not restarted."""
        if self.draining.is_set():
            return
        self.drain_clock.start()
        self.draining.set()
        if self.drain_timeout <= 0 or not self.node_id:
            self.stop()
            return
        threading.Thread(target=self._ask_drain, name="drain", daemon=True).start()

    def _ask_drain(self) -> None:
        """Tell the tracker at once (the heartbeats say it too). While no tracker leads the
        call is sent again, until one does or the drain is over (:mod:`.draining`): the
        stages train on meanwhile, and the drain's timeout does not run."""
        def unreachable(e: grpc.RpcError) -> None:
            self.drain_clock.unreachable()
            self.reports.unreachable(e)  # one line while it lasts, not one per try

        log.info("draining: waiting up to %.0f s (while a tracker leads) for the tracker "
                 "to move this node's stages", self.drain_timeout)
        try:
            reply = net.retry(
                lambda: self.tracker.DrainNode(
                    tracker_pb2.DrainNodeRequest(node=self.node_id or self.name),
                    timeout=timeouts.CONTROL_RPC),
                "asking the tracker to drain this node", max_delay=timeouts.RECONNECT_BACKOFF_MAX,
                stop=lambda: self.stop_event.is_set() or self.drained.is_set()
                or self.drain_clock.over() is not None, on_retry=unreachable)
        except grpc.RpcError as e:
            log.warning("could not ask the tracker to drain this node (%s); the heartbeats "
                        "say it", net.reason(e))
            return
        self.drain_clock.reached()
        if reply.drained:  # no job needs this node: exit now, not a heartbeat later
            self.drained.set()

    def _drain_over(self) -> bool:
        """Whether a draining node may exit: no job needs it, or its time is up."""
        if self.drained.is_set():
            log.info("drained: no job needs this node; exiting")
            return True
        why = self.drain_clock.over()
        if why is not None:
            log.warning("%s", why)
            return True
        return False

    def install_signal_handlers(self) -> None:
        """SIGTERM (``systemctl stop``) drains; SIGINT (Ctrl-C) stops at once, as does a
        second SIGTERM."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop() if self.draining.is_set()
                      else self.drain())
        signal.signal(signal.SIGINT, self.stop)
