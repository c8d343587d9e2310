"""Several tracker addresses, one leader, in-process: two trackers share one SQLite file
with a leader lease; a channel given both addresses follows whichever leads
(:mod:`fedpipe.net.trackers`). The trackers' planners run in worker processes, so those
tests are process tests."""
from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from fedpipe import net
from fedpipe.net import timeouts, trackers
from fedpipe.testing import child_env, free_port
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from fedpipe.tracker.service import FailoverService, TrackerService, serve
from tracker_fakes import registration

pytestmark = pytest.mark.timeout(60)
LEASE = 1.0


def test_tracker_targets_are_split_checked_and_deduplicated():
    assert trackers.addresses("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert trackers.addresses("[::1]:7070") == ["[::1]:7070"]
    assert trackers.several("a:1,b:2") and not trackers.several("a:1")
    for bad, why in (("a:1,", "'' in 'a:1,': expected HOST:PORT"),
                     ("a:1,b", "'b' in 'a:1,b': expected HOST:PORT"),
                     ("a:x,b:2", "port in 1..65535, not 'x'"),
                     ("127.0.0.1", "'127.0.0.1': expected HOST:PORT"),
                     ("t:70000", "port in 1..65535, not '70000'"),
                     ("http://t:7070", "not a URL"),
                     ("::1:7070", "an IPv6 host in brackets"),  # gRPC would dial port 443
                     ("fe80::1%eth0:7070", "an IPv6 host in brackets"),
                     ("t:\u00b2", "port in 1..65535, not '\u00b2'"),  # was: int() raised
                     ("t:\u0667\u0660", "port in 1..65535"),  # non-ASCII digits
                     ("ho st:7070", "no spaces")):
        with pytest.raises(ValueError, match=re.escape(why)):
            trackers.addresses(bad)


def test_a_client_or_a_node_refuses_a_tracker_address_without_a_port_at_once():
    # was: 127.0.0.1 meant port 443, and the first call failed with gRPC's UNAVAILABLE
    # (the node retried it for ever)
    from fedpipe import Client
    from fedpipe.node.daemon import NodeDaemon

    with pytest.raises(ValueError, match="tracker '127.0.0.1': expected HOST:PORT"):
        Client("127.0.0.1")
    with pytest.raises(ValueError, match="tracker '127.0.0.1': expected HOST:PORT"):
        NodeDaemon("127.0.0.1")


@pytest.fixture
def two(tmp_path):
    db = str(tmp_path / "shared.db")
    started = []
    for _ in range(2):
        srv, service, port = serve("127.0.0.1", 0, db, lease=5.0, link_refresh=0,
                                   leader_lease=LEASE)
        started.append((srv, service, f"127.0.0.1:{port}"))
    yield started
    for srv, service, _ in started:
        service.close()
        srv.stop(None)
        service.store.close()


def list_nodes(ch: grpc.Channel) -> tracker_pb2.ListNodesReply:
    return tracker_pb2_grpc.TrackerStub(ch).ListNodes(tracker_pb2.ListNodesRequest(),
                                                      timeout=timeouts.CONTROL_RPC)


@pytest.mark.processes
def test_the_first_tracker_leads_and_a_standby_refuses_naming_it(two):
    (_, a, a_addr), (_, b, b_addr) = two
    assert isinstance(a, FailoverService) and isinstance(b, FailoverService)
    assert a.tracker is not None and b.tracker is None
    with grpc.insecure_channel(b_addr) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list_nodes(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trackers.leader_of(err.value) == a_addr
    assert f"the leader is at {a_addr}" in err.value.details()
    assert not net.serving(grpc.insecure_channel(b_addr), "fedpipe.v1.Tracker")
    assert net.serving(grpc.insecure_channel(a_addr), "fedpipe.v1.Tracker")


@pytest.mark.processes
def test_a_channel_given_both_addresses_follows_the_redirect_then_the_takeover(two):
    (a_srv, a, a_addr), (_, b, b_addr) = two
    ch = net.channel(f"{b_addr},{a_addr}")  # the standby first: its redirect is followed
    assert isinstance(ch, trackers.LeaderChannel)
    list_nodes(ch)
    assert ch.trackers.current() == a_addr
    a.close()  # steps down and releases the lease: b takes over at its next look
    a_srv.stop(None)
    deadline = time.monotonic() + 10 * LEASE
    while b.tracker is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the call meets the dead address, which refuses the connection: nothing was sent,
    # so the same call goes on to the next address: b, which leads
    reply = list_nodes(ch)
    assert isinstance(reply, tracker_pb2.ListNodesReply)
    assert ch.trackers.current() == b_addr
    ch.close()


@pytest.mark.processes
def test_a_tracker_alone_without_a_lease_is_the_plain_service(tmp_path):
    srv, service, _ = serve("127.0.0.1", 0, str(tmp_path / "t.db"), link_refresh=0)
    try:
        assert isinstance(service, TrackerService)
        assert service.store.lease().epoch == 0  # it never took a lease
    finally:
        service.close()
        srv.stop(None)
        service.store.close()


class _Pinged(node_pb2_grpc.NodeServicer):
    """A node address that answers the tracker's registration Ping, and nothing else."""

    def Ping(self, request, context):
        return node_pb2.PingReply()


@pytest.mark.processes
def test_a_leader_stopped_with_heartbeats_unpersisted_closes_without_an_error(two, caplog):
    # the lease is revoked before the leader's state closes, so its last heartbeats'
    # write is refused (Deposed); that used to escape close() as a logged traceback
    # and skip closing the planner's worker
    (_, a, a_addr), _ = two
    pinged = net.server(max_workers=2)
    node_pb2_grpc.add_NodeServicer_to_server(_Pinged(), pinged)
    port = net.bind(pinged, "127.0.0.1", 0)
    pinged.start()
    try:
        with grpc.insecure_channel(a_addr) as ch:
            stub = tracker_pb2_grpc.TrackerStub(ch)
            node_id = stub.RegisterNode(registration("n0", port), timeout=10).node_id
            stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=node_id), timeout=10)
        tracker = a.tracker
        assert tracker is not None and tracker.registry._dirty  # a beat not yet persisted
        with caplog.at_level(logging.INFO, logger="fedpipe.tracker"):
            a.close()
        assert a.tracker is None
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        assert any("last heartbeats were not persisted" in r.getMessage()
                   for r in caplog.records)
        assert tracker.planner._pool is None  # the planner's worker was stopped
    finally:
        pinged.stop(grace=0).wait()


def _dashboard_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _wait_output(proc: subprocess.Popen, lines: list[str], text: str, deadline: float) -> None:
    while not any(text in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        lines.append(proc.stdout.readline())


@pytest.mark.processes
def test_a_standby_that_takes_over_serves_the_dashboard(tmp_path):
    # the CLI served the dashboard only if the tracker led at its start: after a
    # takeover --http-port answered nothing
    db, procs, ports = str(tmp_path / "shared.db"), [], [free_port(), free_port()]
    try:
        for port in ports:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fedpipe", "tracker", "--host", "127.0.0.1",
                 "--port", str(free_port()), "--db", db, "--leader-lease", str(LEASE),
                 "--link-refresh", "0", "--http-port", str(port)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()))
            lines: list[str] = []
            _wait_output(procs[-1], lines, "leads" if len(procs) == 1 else "stands by",
                         time.monotonic() + 60)
        assert _dashboard_answers(ports[0]) and not _dashboard_answers(ports[1])
        procs[0].send_signal(signal.SIGTERM)  # gives the lease up: the standby leads
        assert procs[0].wait(timeout=30) == 0
        deadline = time.monotonic() + 10 * LEASE + 5 * timeouts.OBSERVE_LEADER
        while not _dashboard_answers(ports[1]):
            assert procs[1].poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=30)
