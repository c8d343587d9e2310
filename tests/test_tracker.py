"""The tracker over real gRPC (in this process) and the node daemon's side of registration."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from fedpipe import net
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from fedpipe.spec import PROTOCOL_VERSION
from fedpipe.testing import free_port
from tracker_fakes import registration, versions_with

pytestmark = pytest.mark.timeout(120)


@pytest.mark.processes
def test_importing_the_tracker_service_imports_neither_torch_nor_the_runtime():
    code = ("import sys, fedpipe.tracker.service, fedpipe.tracker.jobs, fedpipe.planner.protoio\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
            "'fedpipe.runtime', 'fedpipe.wire.codecs', 'fedpipe.node', 'fedpipe.client')))\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture
def tracker(tmp_path):
    from fedpipe.tracker.service import serve

    srv, service, port = serve("127.0.0.1", 0, str(tmp_path / "tracker.db"), lease=8.0)
    channel = net.channel(f"127.0.0.1:{port}")
    yield tracker_pb2_grpc.TrackerStub(channel)
    channel.close()
    service.close()
    srv.stop(grace=0).wait()
    service.store.close()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


class Pinged(node_pb2_grpc.NodeServicer):
    """A node address that answers the tracker's registration Ping, and nothing else."""

    def Ping(self, request, context):
        return node_pb2.PingReply()


@pytest.fixture
def reachable():
    """Two ports on 127.0.0.1 that answer Ping, as a registering node's address must."""
    srv = net.server(max_workers=4)
    node_pb2_grpc.add_NodeServicer_to_server(Pinged(), srv)
    ports = [net.bind(srv, "127.0.0.1", 0) for _ in range(2)]
    srv.start()
    yield ports
    srv.stop(grace=0).wait()


@pytest.mark.processes  # serve() starts the tracker's planner worker process
def test_registration_errors_arrive_as_their_status_codes_and_the_tracker_keeps_serving(
        tracker, reachable):
    a, b = reachable
    reply = tracker.RegisterNode(registration("alpha", a), timeout=10)
    assert (reply.lease_seconds, reply.heartbeat_seconds) == (8.0, 2.0)
    code, details = code_of(lambda: tracker.RegisterNode(registration("beta", a, boot="b"),
                                                         timeout=10))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'alpha'" in details, details
    # an address the tracker cannot dial (NAT, a wrong --advertise) is refused, named
    code, details = code_of(lambda: tracker.RegisterNode(registration("far", free_port()),
                                                         timeout=30))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "cannot reach node 'far'" in details
    assert "`fedpipe relay --port PORT`" in details and "--relay" in details, details
    # homed at a relay whose port does not answer: refused, naming the relay
    far = registration("far", free_port())
    far.relay = "127.0.0.1:1"
    code, details = code_of(lambda: tracker.RegisterNode(far, timeout=30))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "through its relay 127.0.0.1:1" \
        in details, details
    old = registration("gamma", b, versions=versions_with(protocol=PROTOCOL_VERSION - 1))
    code, details = code_of(lambda: tracker.RegisterNode(old, timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol {PROTOCOL_VERSION - 1}" in details and \
        f"speaks protocol {PROTOCOL_VERSION}" in details, details
    code, details = code_of(lambda: tracker.GetJob(tracker_pb2.GetJobRequest(job_id="nope"),
                                                   timeout=10))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "no job 'nope'")
    code, _ = code_of(lambda: list(tracker.WatchJob(tracker_pb2.WatchJobRequest(job_id="nope"),
                                                    timeout=10)))
    assert code == grpc.StatusCode.NOT_FOUND
    hb = tracker.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=reply.node_id), timeout=10)
    assert hb.known and hb.heartbeat_seconds == 2.0
    # an outbound-only node: the address it advertises (its relay's port) answers
    homed = registration("delta", b)
    homed.relay = "127.0.0.1:7"
    tracker.RegisterNode(homed, timeout=10)
    nodes = tracker.ListNodes(tracker_pb2.ListNodesRequest(), timeout=10).nodes
    assert [(n.name, n.relay) for n in nodes] == [("alpha", ""), ("delta", "127.0.0.1:7")]


class RecordingTracker(tracker_pb2_grpc.TrackerServicer):
    """A tracker that asks for heartbeats every 0.2 s and records what nodes send."""

    def __init__(self):
        self.registrations: list[tracker_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[float] = []

    def RegisterNode(self, request, context):
        self.registrations.append(request)
        return tracker_pb2.RegisterNodeReply(node_id="n1", lease_seconds=60.0,
                                             heartbeat_seconds=0.2)

    def Heartbeat(self, request, context):
        self.heartbeats.append(time.monotonic())
        return tracker_pb2.HeartbeatReply(known=True, lease_seconds=60.0, heartbeat_seconds=0.2)


def test_the_daemon_sends_its_versions_and_boot_id_and_heartbeats_as_the_tracker_says():
    import cloudpickle
    import torch

    import fedpipe
    from fedpipe.node.daemon import NodeDaemon

    fake = RecordingTracker()
    srv = net.server(4)
    tracker_pb2_grpc.add_TrackerServicer_to_server(fake, srv)
    port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    daemon = NodeDaemon(f"127.0.0.1:{port}", device="cpu", memory_limit=2**28)
    run = threading.Thread(target=daemon.run, daemon=True)
    try:
        run.start()
        deadline = time.monotonic() + 60
        # a 60 s lease would mean a heartbeat every 15 s: 5 within 3 s follow the tracker's 0.2 s
        while len(fake.heartbeats) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(fake.heartbeats) >= 5 and daemon.heartbeat_seconds == 0.2
    finally:
        daemon.stop()
        run.join(30)
        srv.stop(grace=0).wait()
    req = fake.registrations[0]
    v = req.versions
    assert (v.fedpipe, v.protocol, v.torch, v.cloudpickle) == \
        (fedpipe.__version__, PROTOCOL_VERSION, torch.__version__, cloudpickle.__version__)
    assert v.python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert req.boot_id == daemon.boot_id and len(req.boot_id) == 32
