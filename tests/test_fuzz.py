"""Fuzzing every RPC: malformed calls get a status, never a crash or a hang, and a job still trains.

The small run here (seeded, a few hundred calls) goes to a real LocalSwarm; the
long one is ``benchmarks/fuzz.py``. Two in-process servers with planted defects
check that the harness sees a crash and a hang when there is one.
"""
from __future__ import annotations

import threading

import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.examples import digits
from fedpipe.net import timeouts
from fedpipe.net.dataplane import Code, DataPlane, Refused, Timeouts
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2
from fedpipe.security import certs
from fedpipe.testing import LocalSwarm, fuzz, fuzzdata
from fedpipe.wire import rpc

pytestmark = pytest.mark.timeout(180)
CALLS = 300  # more than the 111 that try each (server, method, mutation) once
SOCKET_CALLS = {False: 300, True: 150}  # hostile sequences to a data port, plain and TLS


@pytest.mark.processes
@pytest.mark.timeout(300)  # a swarm start, the calls and a job; slow on a loaded machine
def test_a_fuzzed_swarm_answers_every_call_stays_up_and_still_trains():
    with LocalSwarm(n_nodes=2) as swarm:
        targets = fuzz.swarm_targets(swarm)
        with fuzz.Fuzzer(targets, seed=11, deadline=30.0) as fz:
            report = fz.run(CALLS, workers=4)
            assert fz.cleanup() == []
            for t in targets:
                t.alive()
                assert fz.responsive(t), t.name
        assert report.calls == CALLS
        assert report.crashes == [] and report.hangs == [], report.summary()
        assert report.outcomes["ok"] == CALLS, report.summary()
        # every RPC of both services got every mutation that applies to it
        tried = {(kind, name, mutation) for kind, name, mutation in report.by_method}
        for service, kind in ((tracker_pb2.DESCRIPTOR.services_by_name["Tracker"], "tracker"),
                              (node_pb2.DESCRIPTOR.services_by_name["Node"], "node")):
            for m in fuzz.methods(service):
                for mutation in fuzz.mutations_of(m, fz.seeds):
                    assert (kind, m.name, mutation.value) in tried, (kind, m.name, mutation)
        # a request that does not parse is refused as such, not as a server fault
        assert report.codes["INVALID_ARGUMENT"] > 0 and report.codes["INTERNAL"] == 0, \
            report.summary()

        x, y, _, _ = digits.load()
        torch.manual_seed(0)
        job = swarm.client().submit(digits.make_model(hidden=32), nn.functional.cross_entropy,
                                    fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                                    digits.batches(x, y, 32), steps=12, microbatches=2,
                                    stages=2, replicas=1)
        status = job.wait(timeout=120, progress=False)
        assert status.state == "SUCCEEDED", status
        assert 0.0 < status.loss < 2.3  # cross-entropy of 10 classes starts at ln 10 = 2.30


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_hostile_sequences_to_a_nodes_data_port_neither_crash_nor_hang_it(monkeypatch, tls):
    monkeypatch.setenv("FEDPIPE_DATA_FIRST_RECORD", "1")  # the node's: a stall ends in 1 s
    with LocalSwarm(n_nodes=1, tls=tls) as swarm:
        hostile, probe = [], None
        if tls:  # a node's certificate and a client's (kinds a client may not send)
            hostile = [swarm.issue(certs.Role.NODE, "fuzz-node"),
                       swarm.issue(certs.Role.CLIENT, "fuzz-client")]
            probe = swarm.issue(certs.Role.NODE, fuzzdata.PROBE_NAME)
        targets = fuzzdata.data_targets(swarm, hostile, probe)
        assert len(targets) == 1, "the node offers no data port"
        with fuzzdata.DataFuzzer(targets, seed=24, deadline=timeouts.CONTROL_RPC) as fz:
            report = fz.run(SOCKET_CALLS[tls], workers=4)
            targets[0].node.alive()
            assert fz.serving(targets[0])
        log = swarm.log(swarm.nodes[0])
    assert report.calls == SOCKET_CALLS[tls]
    # (a call the node closes late on a loaded machine is slow, DEADLINE, not a failure)
    assert report.crashes == [] and report.hangs == [], report.summary()
    assert {case for _, case, _ in report.by_method} == set(fuzzdata.Records.CASES)
    # refused as what they are: malformed, too slow, for no stage here (or not allowed)
    assert report.codes["INVALID_ARGUMENT"] > 0 and report.codes["DEADLINE_EXCEEDED"] > 0
    assert report.codes["PERMISSION_DENIED" if tls else "NOT_FOUND"] > 0, report.summary()
    assert "Traceback" not in log


class _Listener:
    """A data port whose receiver has a planted defect for tensors that are not probes:
    ``admit`` raises an exception it does not map (``crash``), or blocks (a reader that
    never returns); probes pass, so the fuzzer's good connection works."""

    def __init__(self, crash: bool):
        self.crash, self.release = crash, threading.Event()

    def admit(self, peer, header):
        if header.envelope.kind != node_pb2.KIND_PROBE:
            if self.crash:
                raise RuntimeError("planted defect")
            self.release.wait()
            raise Refused(Code.UNAVAILABLE, "released")
        return 1 << 20

    def deliver(self, peer, header, tensor):
        pass


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "hang"])
def test_the_data_port_harness_sees_a_planted_crash_and_a_planted_hang(planted, crash):
    _, address = planted  # answers Ping
    receiver = _Listener(crash)
    with DataPlane("planted", receiver, timeouts=Timeouts(first_record=0.3)) as plane:
        target = fuzzdata.DataTarget("planted", plane.address,
                                     fuzz.node_target("planted", address))
        try:
            with fuzzdata.DataFuzzer([target], seed=3, deadline=1.0) as fz:
                report = fz.run(40, workers=4, batch=20)
        finally:
            receiver.release.set()
    found = report.crashes if crash else report.hangs
    assert found and report.outcomes["crash" if crash else "hang"] == len(found), \
        report.summary()
    if crash:
        assert all("planted defect" in c for c in report.crashes), report.summary()
        assert report.hangs == []
    else:
        assert all("did not close" in h for h in report.hangs), report.summary()


class _Planted(node_pb2_grpc.NodeServicer):
    """A node whose Probe raises, and whose StopJob blocks until released and makes Ping
    block too (a server that stopped answering); Ping answers until then."""

    def __init__(self):
        self.release, self.stuck = threading.Event(), threading.Event()

    def Probe(self, request, context):
        raise RuntimeError("planted defect")

    def StopJob(self, request, context):
        self.stuck.set()
        self.release.wait()
        return node_pb2.StopJobReply()

    def Ping(self, request, context):
        if self.stuck.is_set():
            self.release.wait()
        return node_pb2.PingReply()


@pytest.fixture
def planted():
    servicer = _Planted()
    srv = net.server(max_workers=2, data_calls=1)
    rpc.add_node_servicer(servicer, srv)
    port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    srv.stop(0).wait()


def _only(target: fuzz.Target, name: str) -> fuzz.Target:
    return fuzz.Target(target.name, target.address,
                       tuple(m for m in target.methods if m.name == name), target.probe)


def test_the_harness_counts_an_unhandled_exception_as_a_crash(planted):
    _, address = planted
    target = _only(fuzz.node_target("planted", address), "Probe")
    with fuzz.Fuzzer([target], seed=1, deadline=5.0, seeds={}) as fz:
        report = fz.run(20, workers=2, batch=10)
    parsed = report.codes["UNKNOWN"]  # requests that parse reach the planted raise
    assert parsed > 0 and len(report.crashes) == parsed, report.summary()
    assert report.hangs == []


def test_the_harness_counts_a_server_that_stops_answering_as_a_hang(planted):
    servicer, address = planted
    target = _only(fuzz.node_target("planted", address), "StopJob")
    with fuzz.Fuzzer([target], seed=1, deadline=0.5, probe_deadline=0.3, seeds={}) as fz:
        report = fz.run(2, workers=2, batch=2)  # random bytes, then random fields
    assert servicer.stuck.is_set()
    assert report.outcomes["hang"] >= 1 and report.hangs, report.summary()
    servicer.release.set()


def test_a_request_that_does_not_parse_is_refused_naming_its_type(planted):
    _, address = planted
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(f"/{rpc.SERVICE}/Ping")(b"\xff\xff\xff", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse as fedpipe.v1.PingRequest" in err.value.details()
