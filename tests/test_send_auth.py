"""Who may put what on a node's data plane, over real mutual TLS on 127.0.0.1 in one process.

A NodeService with a node certificate serves a real TLS server; the test plays the
tracker (it loads the job's two stages straight into the node's registry, so no job
signature is needed) and every other caller, each with its own certificate:

- Send: only nodes of the job's plans, or its own client with inputs for the first
  stage and targets for the last (issue: a stray node certificate fed any job);
- PutSnapshot: only under a stage key of the job's plans, within the per-job byte budget;
- a stream open when its caller's certificate is revoked ends at its next message.
"""
from __future__ import annotations

import queue
import threading

import cloudpickle
import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.net.dataplane import DataPlane, PeerRefused
from fedpipe.node.parts import build_parts
from fedpipe.node.service import NodeService
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.runtime import checkpoint
from fedpipe.security import DenyList, TlsConfig, certs
from fedpipe.spec import JobSpec, Kind, StageKey
from fedpipe.wire import frames, rpc

pytestmark = pytest.mark.timeout(60)
JOB = "j1"
BUDGET = 2500  # the node's per-job snapshot budget here, bytes
RPC = 10


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    certs.make_ca(d)
    for role, name in (("node", "n0"), ("node", "n1"), ("node", "stray"), ("node", "probe"),
                       ("node", "joiner"),
                       ("client", "alice"), ("client", "bob")):
        certs.issue(d, role, name, hosts=["127.0.0.1"])
    tls = TlsConfig.load(d, "n0")
    resources = node_pb2.Resources(device="cpu")
    # with a socket data plane too: its listener admits tensors as Send does
    parts = build_parts(lambda: "n0", "n0", resources, lambda report: None, tls=tls,
                        job_snapshot_bytes=BUDGET, data_port=0)
    service = NodeService(lambda: "n0", "n0", resources, lambda report: None, parts=parts)
    server = net.server(max_workers=16, tls=tls)
    rpc.add_node_servicer(service, server)
    address = f"127.0.0.1:{net.bind(server, '127.0.0.1', 0)}"
    server.start()
    # a two-stage job: both stages here on n0, n1 in its plan too (a later epoch's node)
    spec = JobSpec(steps=50, microbatches=1, batch_size=2, schedule="gpipe",
                   optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1)),
                   loss_fn=cloudpickle.dumps(nn.functional.mse_loss)).validate()
    plan = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=i, node_id="n0", address=address,
                                 node_name="n0", layer_start=i, layer_end=i + 1)
        for i in range(2)])
    for i in range(2):
        request = node_pb2.LoadStageRequest(
            job_id=JOB, replica=0, stage=i, plan=plan, config=spec.to_proto(), owner="alice",
            layers=[cloudpickle.dumps(nn.Linear(4, 4))])
        # what LoadStage learns, without the tracker's signature
        service.access.learn_plan(JOB, plan, "alice")
        service.stages.load(request)
    later = node_pb2.LoadStageRequest(job_id=JOB, owner="alice", plan=node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=1, node_id="n1", node_name="n1")]))
    service.access.learn_plan(JOB, later.plan, "alice")
    channels: dict[str, grpc.Channel] = {}

    def stub(name: str) -> rpc.NodeStub:
        if name not in channels:
            channels[name] = net.channel(address, tls=TlsConfig.load(d, name))
        return rpc.NodeStub(channels[name])

    yield d, service, stub
    for ch in channels.values():
        ch.close()
    service.stop_all()
    parts.close()
    server.stop(grace=None)


def tensor(kind: Kind, stage: int, step: int = 10_000, job: str = JOB) -> list[bytes]:
    """One tensor's frames; the default step is past the job's end, so a tensor that is
    admitted by identity is then refused for its step (INVALID_ARGUMENT) and never runs."""
    env = node_pb2.Envelope(job_id=job, replica=0, stage=stage, kind=kind, step=step,
                            microbatch=0, batch_size=2)
    return list(frames.encode_frames(torch.ones(2, 4), envelope=env))


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


SEND_CASES = [
    # a node certificate no plan of the job names feeds none of its stages
    ("stray", Kind.INPUT, 0, grpc.StatusCode.PERMISSION_DENIED,
     "node 'stray' is not assigned to job j1"),
    ("stray", Kind.ACTIVATION, 1, grpc.StatusCode.PERMISSION_DENIED,
     "node 'stray' is not assigned to job j1"),
    ("stray", Kind.GRADIENT, 0, grpc.StatusCode.PERMISSION_DENIED,
     "node 'stray' is not assigned to job j1"),
    # the job's nodes (this epoch's or another's) pass, to the envelope's own checks
    ("n0", Kind.ACTIVATION, 1, grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ("n1", Kind.GRADIENT, 0, grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    # the owner feeds inputs to the first stage and targets to the last, nothing else
    ("alice", Kind.INPUT, 0, grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ("alice", Kind.TARGET, 1, grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ("alice", Kind.INPUT, 1, grpc.StatusCode.PERMISSION_DENIED,
     "may not send KIND_INPUT to stage 1 of job j1: a client feeds only stage 0"),
    ("alice", Kind.TARGET, 0, grpc.StatusCode.PERMISSION_DENIED,
     "may not send KIND_TARGET to stage 0 of job j1: a client feeds only stage 1"),
    ("bob", Kind.INPUT, 0, grpc.StatusCode.PERMISSION_DENIED,
     "client 'bob' is not the owner of job j1"),
]


@pytest.mark.parametrize("caller, kind, stage, code, says", SEND_CASES)
def test_send_admits_the_jobs_nodes_and_its_owner_for_its_own_stages(swarm, caller, kind,
                                                                      stage, code, says):
    _, service, stub = swarm
    got, details = refusal(lambda: rpc.send(stub(caller), tensor(kind, stage), timeout=RPC))
    assert got is code, details
    assert says in details
    assert service.stages.runs(JOB)  # refused callers leave the job running


class Nothing:
    """A caller's own data plane takes nothing from the node."""

    def admit(self, peer, header):
        raise AssertionError("the node sent the caller a tensor")

    def deliver(self, peer, header, tensor):
        raise AssertionError("the node sent the caller a tensor")


@pytest.mark.parametrize("caller, kind, stage, code, says", SEND_CASES)
def test_the_socket_data_plane_admits_as_send_does_by_the_callers_certificate(
        swarm, caller, kind, stage, code, says):
    d, service, _ = swarm
    role = "client" if caller in ("alice", "bob") else "node"
    env = node_pb2.Envelope(job_id=JOB, replica=0, stage=stage, kind=kind, step=10_000,
                            microbatch=0, batch_size=2)
    with DataPlane(caller, Nothing(), role=role, tls=TlsConfig.load(d, caller)) as plane:
        link = plane.link("n0", service.parts.sockets.address)
        with pytest.raises(PeerRefused) as e:
            link.send(torch.ones(2, 4), envelope=env, flush=True)
    assert e.value.code.value == code.value[0], str(e.value)
    assert says in str(e.value)
    assert service.stages.runs(JOB)


def snapshot_frames(stage: int, step: int, replica: int = 0, floats: int = 256) -> list[bytes]:
    snap = checkpoint.Snapshot(step, skeleton={"module": {"$t": "w"}},
                               tensors={"w": torch.zeros(floats)})
    return list(checkpoint.to_frames(snap, node_pb2.Envelope(
        job_id=JOB, replica=replica, stage=stage, kind=Kind.SNAPSHOT, step=step)))


def test_snapshots_are_kept_only_under_the_jobs_stage_keys_and_within_its_budget(swarm):
    _, service, stub = swarm
    n1 = stub("n1")
    code, details = refusal(lambda: n1.PutSnapshot(iter(snapshot_frames(0, 1, replica=1000)),
                                                   timeout=RPC))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "job 'j1' has no stage 0 of replica group 1000" in details
    assert service.stages.snapshots.jobs() == set()

    for step in (1, 2, 3):  # 1 KiB each; the third pushes out the first, so it fits
        n1.PutSnapshot(iter(snapshot_frames(0, step)), timeout=RPC)
    assert service.stages.snapshots.steps(JOB, StageKey(0, 0)) == [2, 3]
    code, details = refusal(lambda: n1.PutSnapshot(iter(snapshot_frames(1, 1)), timeout=RPC))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"one job's kept snapshots {BUDGET} bytes" in details
    assert service.stages.snapshots.steps(JOB, StageKey(0, 1)) == []
    # a snapshot past the room left (the budget less step 3's, step 2's going) is refused
    # on its tensor's header, before its 4 MiB are read
    code, details = refusal(lambda: n1.PutSnapshot(iter(snapshot_frames(0, 4, floats=2**20)),
                                                   timeout=RPC))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tensor 'w' of 4194304 bytes" in details and "limit of 1476 bytes" in details
    assert service.stages.snapshots.steps(JOB, StageKey(0, 0)) == [2, 3]
    code, details = refusal(lambda: stub("stray").PutSnapshot(iter(snapshot_frames(0, 5)),
                                                              timeout=RPC))
    assert code is grpc.StatusCode.PERMISSION_DENIED


def test_an_open_stream_ends_at_its_next_message_once_its_certificate_is_revoked(swarm):
    d, service, stub = swarm
    q: queue.Queue = queue.Queue()
    probe = list(frames.encode_frames(torch.zeros(4), envelope=node_pb2.Envelope(
        kind=Kind.PROBE, batch_size=1)))

    def feed():
        while (item := q.get()) is not None:
            yield from item

    call = stub("probe").Send.future(feed(), timeout=RPC)
    q.put(probe)
    while service.streams.count() == 0:  # the stream is open and its probe went by
        threading.Event().wait(0.01)
    entry = certs.revoke(d, "probe")
    service.verifier.set_deny_list(DenyList((entry,)))  # as the tracker's heartbeat pushes it
    q.put(probe)
    with pytest.raises(grpc.RpcError) as e:
        call.result(timeout=RPC)
    q.put(None)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "Send stream ended: its certificate was revoked" in e.value.details()


def test_a_quorum_reply_with_a_newer_plan_admits_a_joining_groups_nodes(swarm):
    _, service, stub = swarm
    send = lambda: rpc.send(stub("joiner"), tensor(Kind.REDUCE, 0), timeout=RPC)  # noqa: E731
    assert refusal(send)[0] is grpc.StatusCode.PERMISSION_DENIED
    newer = node_pb2.Plan(stages=[node_pb2.StageAssignment(replica=3, stage=0,
                                                           node_name="joiner")])
    quorum = service.access.learning(lambda request: tracker_pb2.ReplicaQuorumReply(plan=newer))
    assert quorum is not None
    quorum(tracker_pb2.ReplicaQuorumRequest(job_id=JOB, replica=0, stage=0))
    code, details = refusal(send)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, details  # past identity, to the envelope
    assert StageKey(3, 0) in service.access.get(JOB).keys
