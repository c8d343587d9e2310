"""The one server factory (fedpipe.net.server): a held port is an error, control calls keep
threads of their own while data streams fill theirs, and readiness over grpc.health.v1.

In-process tests check the factory's parts; the others run real tracker and node
processes (``python -m fedpipe``) on 127.0.0.1.
"""
from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from fedpipe.testing import NODE_SERVICE, TRACKER_SERVICE, LocalSwarm, child_env, free_port
from fedpipe.wire import frames as wire_frames
from fedpipe.wire import rpc

pytestmark = pytest.mark.timeout(180)
QUICK = 2.0  # seconds: the deadline a control call must meet while the data side is full
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- in process ---------------------------------------------------------------------------

SHAPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class Gate:
    """Handlers for a test service with one method of each RPC shape; each call
    holds its server thread until the gate opens."""

    def __init__(self):
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)

    def _hold(self):
        self.entered.release()
        self.open.wait(30)

    def handler(self) -> grpc.GenericRpcHandler:
        def uu(req, ctx):
            self._hold()
            return b"uu"

        def us(req, ctx):
            self._hold()
            yield b"us"

        def su(reqs, ctx):
            self._hold()
            return b"".join(reqs)

        def ss(reqs, ctx):
            self._hold()
            yield from reqs

        make = {"unary_unary": grpc.unary_unary_rpc_method_handler,
                "unary_stream": grpc.unary_stream_rpc_method_handler,
                "stream_unary": grpc.stream_unary_rpc_method_handler,
                "stream_stream": grpc.stream_stream_rpc_method_handler}
        return grpc.method_handlers_generic_handler("test.Gate", {
            shape: make[shape](fn) for shape, fn in zip(SHAPES, (uu, us, su, ss))} | {
            "Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"pong")})


def run(ch: grpc.Channel, method: str, timeout: float) -> tuple[grpc.StatusCode, str]:
    """Call ``/test.Gate/<method>`` (its name is its shape) to the end; (status, details)."""
    shape = method if method in SHAPES else "unary_unary"
    rpc = getattr(ch, shape)(f"/test.Gate/{method}")
    arg = b"x" if shape.startswith("unary") else iter([b"x"])
    try:
        out = rpc(arg, timeout=timeout)
        if shape.endswith("stream"):
            list(out)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture
def gate_server():
    gate = Gate()
    srv = net.server(4, data_methods={f"/test.Gate/{s}" for s in SHAPES}, data_calls=1)
    srv.add_generic_rpc_handlers((gate.handler(),))
    port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    ch = net.channel(f"127.0.0.1:{port}")
    yield gate, ch
    gate.open.set()
    ch.close()
    srv.stop(None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_data_call_beyond_the_limit_is_refused_at_once_and_control_still_answers(
        gate_server, shape):
    gate, ch = gate_server
    held: list = []
    holder = threading.Thread(target=lambda: held.append(run(ch, shape, 30)), daemon=True)
    holder.start()
    assert gate.entered.acquire(timeout=10), "the first data call never reached its handler"

    for other in SHAPES:  # the limit is shared by every data method, whatever its shape
        start = time.monotonic()
        code, details = run(ch, other, QUICK)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (other, code, details)
        assert "1 data-plane calls" in details and "DATA_CALLS" in details, details
        assert time.monotonic() - start < QUICK
    assert run(ch, "Ping", QUICK) == (grpc.StatusCode.OK, "")

    gate.open.set()  # the held call ends, and gives its slot back
    holder.join(10)
    assert held == [(grpc.StatusCode.OK, "")]
    deadline = time.monotonic() + 10
    while (got := run(ch, shape, QUICK))[0] != grpc.StatusCode.OK:
        # the slot is released when the RPC's status has gone out, just after the handler
        assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, got
        assert time.monotonic() < deadline, "the held call's slot was not given back"
        time.sleep(0.05)


def test_a_server_leaves_threads_for_control_calls():
    with pytest.raises(ValueError, match="control calls need threads"):
        net.server(8, data_calls=8)


def test_health_is_not_serving_before_start_serving_after_and_not_serving_from_stop():
    srv = net.server()
    node_pb2_grpc.add_NodeServicer_to_server(node_pb2_grpc.NodeServicer(), srv)
    port = net.bind(srv, "127.0.0.1", 0)

    def status(service):
        return srv.health.Check(health_pb2.HealthCheckRequest(service=service), None).status

    assert status("") == status(NODE_SERVICE) == NOT_SERVING
    srv.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert net.serving(ch) and net.serving(ch, NODE_SERVICE)
        assert not net.serving(ch, TRACKER_SERVICE)  # not on this server
    srv.stop(None).wait(10)
    assert status("") == status(NODE_SERVICE) == NOT_SERVING


# -- real processes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lone_tracker():
    """A tracker process with no node: a job submitted to it waits PENDING."""
    with LocalSwarm(n_nodes=0) as s:
        yield s


@pytest.fixture(scope="module")
def one_node():
    with LocalSwarm(n_nodes=1) as s:
        yield s


def fedpipe_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpipe", *args], capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def still_serving(address: str, service: str) -> bool:
    with net.channel(address) as ch:
        return net.serving(ch, service)


@pytest.mark.processes
def test_a_second_tracker_on_a_held_port_exits_with_a_clear_error(lone_tracker, tmp_path):
    port = lone_tracker.tracker.rsplit(":", 1)[1]
    out = fedpipe_cli("tracker", "--host", "127.0.0.1", "--port", port,
                      "--db", str(tmp_path / "second.db"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"fedpipe tracker: OSError: cannot listen on 127.0.0.1:{port}: port {port} is in " \
           f"use by another process" in out.stderr, out.stderr
    assert "listening" not in out.stdout
    assert still_serving(lone_tracker.tracker, TRACKER_SERVICE)


@pytest.mark.processes
def test_a_second_node_on_a_held_port_exits_with_a_clear_error(one_node):
    [held] = one_node.client().nodes()
    port = held.address.rsplit(":", 1)[1]
    out = fedpipe_cli("node", "--tracker", one_node.tracker, "--host", "127.0.0.1",
                      "--port", port, "--device", "cpu", "--threads", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use by another process" \
        in out.stderr, out.stderr
    assert [n.address for n in one_node.client().nodes()] == [held.address]
    assert still_serving(held.address, NODE_SERVICE)


def settle(calls: list, refused: int, what: str) -> list:
    """Wait until ``refused`` of ``calls`` (futures) have ended; return those that ended."""
    deadline = time.monotonic() + 30
    while sum(c.done() for c in calls) < refused:
        assert time.monotonic() < deadline, f"{what}: only {sum(c.done() for c in calls)} " \
                                            f"of {len(calls)} calls ended, {refused} expected"
        time.sleep(0.05)
    time.sleep(0.5)  # any further refusal would come at once
    return [c for c in calls if c.done()]


def assert_refused_for_the_limit(ended: list) -> None:
    for c in ended:
        assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (c.code(), c.details())
        assert f"{net.DATA_CALLS} data-plane calls" in c.details(), c.details()


def connections(address: str, n: int) -> list[grpc.Channel]:
    """``n`` channels to ``address``, each its own TCP connection: without TLS, each is a
    peer of its own for the per-peer limit."""
    return [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(n)]


def idle_sends(stubs: list, n: int) -> tuple[list, list]:
    """``n`` Send streams that send nothing, spread over ``stubs`` in turn: (queues, calls)."""
    idle: list = []
    calls = []
    for i in range(n):
        frames: queue.SimpleQueue = queue.SimpleQueue()
        idle.append(frames)
        calls.append(stubs[i % len(stubs)].Send.future(iter(frames.get, None)))
    return idle, calls


@pytest.mark.processes
def test_a_node_answers_ping_while_idle_send_streams_fill_its_data_side(one_node):
    """Idle Send streams (a peer that opened one and sent nothing) each hold a server
    thread; a pool's worth of them, from several peers, must not stop the node answering
    Ping."""
    [node] = one_node.client().nodes()
    peers = -(-net.SERVER_THREADS // net.PEER_DATA_CALLS)  # each within its own limit
    chans = connections(node.address, peers)
    with net.channel(node.address) as ch:
        stub = node_pb2_grpc.NodeStub(ch)
        idle, calls = idle_sends([node_pb2_grpc.NodeStub(c) for c in chans], net.SERVER_THREADS)
        try:
            ended = settle(calls, net.SERVER_THREADS - net.DATA_CALLS, "Send")
            assert len(ended) == net.SERVER_THREADS - net.DATA_CALLS
            assert_refused_for_the_limit(ended)
            for _ in range(3):
                start = time.monotonic()
                stub.Ping(node_pb2.PingRequest(), timeout=QUICK)
                assert time.monotonic() - start < QUICK
                assert stub.Probe(node_pb2.ProbeRequest(), timeout=QUICK).cores >= 1
        finally:
            for frames in idle:
                frames.put(None)  # each stream ends, empty
        for c in calls:
            if c not in ended:
                assert isinstance(c.result(timeout=30), node_pb2.SendReply)
    for c in chans:
        c.close()


def probe_frames() -> list[bytes]:
    """One small link-measurement tensor (a probe), as a peer sends it."""
    env = node_pb2.Envelope(kind=node_pb2.KIND_PROBE, batch_size=1)
    return list(wire_frames.encode_frames(torch.zeros(16), envelope=env))


@pytest.mark.processes
def test_one_peers_idle_send_streams_past_its_limit_are_refused_and_others_served(one_node):
    """Issue 11: limits per peer. One connection (a peer, without TLS) opens more idle Send
    streams than one peer may hold: the excess is refused naming the limit, at once, while
    another peer's Send and the node's heartbeats to the tracker go on."""
    [node] = one_node.client().nodes()
    extra = 5
    hog, other = connections(node.address, 2)
    idle, calls = idle_sends([node_pb2_grpc.NodeStub(hog)], net.PEER_DATA_CALLS + extra)
    try:
        ended = settle(calls, extra, "Send")
        assert len(ended) == extra
        for c in ended:
            assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (c.code(), c.details())
            assert f"already has {net.PEER_DATA_CALLS} data-plane calls open on this server, " \
                   f"the most one peer may have at once ({net.PEER_DATA_CALLS}" in c.details()
        for _ in range(3):
            start = time.monotonic()
            reply = rpc.NodeStub(other).Send(iter(probe_frames()), timeout=QUICK)
            assert isinstance(reply, node_pb2.SendReply)
            assert time.monotonic() - start < QUICK
        # the node's heartbeats still reach the tracker: it is not declared lost past a lease
        time.sleep(one_node.lease * 1.5)
        [again] = one_node.client().nodes()
        assert again.alive and again.node_id == node.node_id
    finally:
        for frames in idle:
            frames.put(None)
    for c in calls:
        if c not in ended:
            assert isinstance(c.result(timeout=30), node_pb2.SendReply)
    hog.close()
    other.close()


@pytest.mark.processes
def test_the_tracker_takes_heartbeats_while_idle_watches_fill_its_data_side(lone_tracker):
    """WatchJob streams last as long as their job; a pool's worth of watchers must not stop
    the tracker taking heartbeats and registrations."""
    client = lone_tracker.client()
    job = client.submit(nn.Sequential(nn.Linear(4, 2)), nn.functional.mse_loss,
                        fedpipe.optimizer(torch.optim.SGD, lr=0.1),
                        [(torch.zeros(4, 4), torch.zeros(4, 2))], steps=1)
    assert job.status().state == "PENDING"  # no node: it waits, and so do its watchers
    stub = tracker_pb2_grpc.TrackerStub(client.channel)
    chans = connections(lone_tracker.tracker, -(-net.SERVER_THREADS // net.PEER_DATA_CALLS))
    watchers = [tracker_pb2_grpc.TrackerStub(c) for c in chans]
    calls = [watchers[i % len(watchers)].WatchJob(tracker_pb2.WatchJobRequest(job_id=job.id))
             for i in range(net.SERVER_THREADS)]
    try:
        # the client's own feeder holds one watch until the job runs
        refused = net.SERVER_THREADS - (net.DATA_CALLS - 1)
        ended = settle(calls, refused, "WatchJob")
        assert len(ended) == refused
        assert_refused_for_the_limit(ended)
        for _ in range(3):
            start = time.monotonic()
            reply = stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id="nobody"), timeout=QUICK)
            assert not reply.known
            assert list(stub.ListNodes(tracker_pb2.ListNodesRequest(), timeout=QUICK).nodes) == []
            assert time.monotonic() - start < QUICK
    finally:
        for c in calls:
            c.cancel()
        for c in chans:
            c.close()
        job.cancel()


@pytest.mark.processes
def test_a_node_says_where_it_listens_and_what_it_advertises_apart(tmp_path):
    # it printed the advertised address as the one it listens on
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedpipe", "node", "--tracker", f"127.0.0.1:{free_port()}",
         "--host", "127.0.0.1", "--port", "0", "--advertise", "127.0.0.2", "--name", "adv",
         "--threads", "1", "--snapshot-dir", str(tmp_path / "snap")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env())
    try:
        line = proc.stdout.readline()  # printed before it looks for the (absent) tracker
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert "fedpipe node adv listening on 127.0.0.1:" in line, line
    assert ", advertised as 127.0.0.2:" in line, line
