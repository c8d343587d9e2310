"""The node in parts, in one process: shared channels, the stage registry, the RPCs.

Two Node services run on real gRPC servers on 127.0.0.1 in this process; no
tracker: the tests load stages with LoadStage as the tracker would, feed
inputs as the client would, and collect the stage reports the node sends.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time

import cloudpickle
import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.node.peers import ChannelPool, StagePeers
from fedpipe.node.service import NodeService
from fedpipe.node.stages import StageSlot
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2
from fedpipe.spec import JobSpec, Kind
from fedpipe.wire import frames, rpc
from reference import max_relative_difference, single_process

pytestmark = pytest.mark.timeout(60)
R = tracker_pb2.StageReport


class Node:
    """A NodeService on a real server on 127.0.0.1, its reports in a list."""

    def __init__(self, name: str):
        self.reports: list[tracker_pb2.StageReport] = []
        self.cond = threading.Condition()
        self.service = NodeService(lambda: name, name, node_pb2.Resources(device="cpu"),
                                   self._report)
        self.server = net.server(max_workers=16)
        rpc.add_node_servicer(self.service, self.server)
        self.address = f"127.0.0.1:{net.bind(self.server, '127.0.0.1', 0)}"
        self.server.start()
        self.channel = net.channel(self.address)
        self.stub = rpc.NodeStub(self.channel)

    def _report(self, report):
        with self.cond:
            self.reports.append(report)
            self.cond.notify_all()

    def wait_for(self, status, n: int, timeout: float = 30.0) -> list:
        with self.cond:
            assert self.cond.wait_for(
                lambda: sum(r.status == status for r in self.reports) >= n, timeout), \
                [(r.stage, r.status, r.step, r.error) for r in self.reports]
            return [r for r in self.reports if r.status == status]

    def close(self):
        self.service.stop_all()
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def nodes():
    made = [Node("a"), Node("b")]
    yield made
    for n in made:
        n.close()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def data(steps: int, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def load_pipeline(nodes, model, cuts, spec: JobSpec, job_id="job"):
    """LoadStage of each cut ``(start, end)`` on the node of the same index; the plan."""
    plan = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=s, node_id=n.address, address=n.address,
                                 node_name=f"n{s}", layer_start=a, layer_end=b)
        for s, (n, (a, b)) in enumerate(zip(nodes, cuts))])
    for s, (n, (a, b)) in enumerate(zip(nodes, cuts)):
        n.stub.LoadStage(node_pb2.LoadStageRequest(
            job_id=job_id, replica=0, stage=s, plan=plan, config=spec.to_proto(),
            layers=[cloudpickle.dumps(layer) for layer in list(model)[a:b]]), timeout=30)
    return plan


def feed(first: Node, last: Node, n_stages: int, batches, microbatches: int, job_id="job",
         whole: bool = True, first_step: int = 0):
    """Send every step's inputs to stage 0 and targets to the last stage: as the client
    does, one tensor of all the step's microbatches per kind (``whole``), or one tensor
    per microbatch; ``batches`` are steps ``first_step``, ``first_step + 1``, ..."""
    for step, (x, y) in enumerate(batches, first_step):
        for node, stage, kind, t in ((first, 0, Kind.INPUT, x),
                                     (last, n_stages - 1, Kind.TARGET, y)):
            if whole:
                env = node_pb2.Envelope(job_id=job_id, replica=0, stage=stage, kind=kind,
                                        step=step, microbatches=microbatches,
                                        batch_size=len(x))
                rpc.send(node.stub, frames.encode_frames(t, envelope=env), timeout=30)
                continue
            envs = [node_pb2.Envelope(job_id=job_id, replica=0, stage=stage, kind=kind,
                                      step=step, microbatch=m, batch_size=len(x))
                    for m in range(microbatches)]
            node.stub.Send(itertools.chain.from_iterable(
                frames.encode_frames(piece, envelope=env)
                for env, piece in zip(envs, torch.tensor_split(t, microbatches))), timeout=30)


def fetch(node: Node, stage: int, job_id="job") -> dict:
    return {head.name: t for head, t in frames.read_tensors(node.stub.FetchState(
        node_pb2.FetchStateRequest(job_id=job_id, replica=0, stage=stage), timeout=30))}


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_two_stage_pipeline_trains_and_every_stage_reports_each_step_once(nodes, schedule):
    steps, m = 4, 2
    model, batches = mlp(), data(steps)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    spec = JobSpec(steps=steps, microbatches=m, batch_size=8, schedule=schedule,
                   optimizer=cloudpickle.dumps(sgd),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy),
                   max_staleness=0).validate()
    load_pipeline(nodes, model, [(0, 2), (2, 3)], spec)
    feed(nodes[0], nodes[1], 2, batches, m)
    for n in nodes:
        n.wait_for(R.STATUS_DONE, 1)
    got = {**fetch(nodes[0], 0), **fetch(nodes[1], 1)}
    want = single_process(model, nn.functional.cross_entropy, sgd, batches)
    assert max_relative_difference(got, model.state_dict()) > 1e-3
    assert max_relative_difference(got, want) <= 1e-5

    for stage, n in enumerate(nodes):
        with n.cond:
            reports = list(n.reports)
        step_reports = [r for r in reports if r.status == R.STATUS_STEP]
        assert [r.step for r in step_reports] == list(range(1, steps + 1)), stage
        assert [r.status for r in reports] == [R.STATUS_STEP] * steps + [R.STATUS_DONE]
        for r in step_reports:
            assert (r.replica, r.stage, r.node_id, r.samples) == (0, stage, n.service.name, 8)
            parts = (r.compute_seconds, r.wait_seconds, r.send_seconds)
            assert all(p >= 0 for p in parts) and r.seconds > 0
            assert sum(parts) == pytest.approx(r.seconds, abs=1e-6)
            assert r.compute_seconds > 0
        if stage == 1:
            assert all(math.isfinite(r.loss) and r.loss > 0 for r in step_reports)
        else:
            # stage 0 waits for stage 1's gradients in every step, and sends activations
            assert all(r.loss == 0 for r in step_reports)
            assert all(r.wait_seconds > 0 and r.send_seconds > 0 for r in step_reports)

    # the stages ended, so the channel stage 0 opened to node b is closed
    stage0 = nodes[0].service.stages.get(StageSlot("job", 0, 0))
    stage0.thread.join(10)
    assert nodes[0].service.channels.addresses() == set()


def test_a_step_fed_as_one_tensor_per_kind_trains_as_fed_per_microbatch(nodes):
    """The client's form (Envelope.microbatches: the node cuts the step's tensor) and one
    tensor per microbatch give the same weights, bit for bit; a tensor that claims more
    microbatches than the stage runs or than it has rows, or several microbatches of a
    peer's kind, is refused with INVALID_ARGUMENT and the stage goes on."""
    steps, m = 3, 4
    model, batches = mlp(), data(steps)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    spec = JobSpec(steps=steps, microbatches=m, batch_size=8, optimizer=cloudpickle.dumps(sgd),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy)).validate()
    got = {}
    for job, whole in (("whole", True), ("pieces", False)):
        load_pipeline(nodes, model, [(0, 2), (2, 3)], spec, job_id=job)
        if whole:
            for env, t, why in (
                    (dict(kind=Kind.INPUT, microbatches=m + 1), torch.zeros(8, 8),
                     "runs 4 per step"),
                    (dict(kind=Kind.INPUT, microbatch=1, microbatches=m), torch.zeros(8, 8),
                     "out of range"),
                    (dict(kind=Kind.INPUT, microbatches=m), torch.zeros(3, 8), "cannot hold"),
                    (dict(kind=Kind.GRADIENT, microbatches=m), torch.zeros(8, 16),
                     "only a client's inputs"),
                    (dict(kind=Kind.INPUT, microbatches=-1), torch.zeros(8, 8), ">= 0"),
                    (dict(kind=Kind.INPUT, microbatch=m), torch.zeros(2, 8), "out of range"),
                    (dict(kind=Kind.TARGET, microbatches=m), torch.zeros(8), "go to stage 1")):
                with pytest.raises(grpc.RpcError) as e:
                    rpc.send(nodes[0].stub, frames.encode_frames(t, envelope=node_pb2.Envelope(
                        job_id=job, stage=0, step=0, batch_size=8, **env)), timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, env
                assert why in e.value.details(), (env, e.value.details())
        feed(nodes[0], nodes[1], 2, batches, m, job_id=job, whole=whole)
        for n in nodes:
            n.wait_for(R.STATUS_DONE, len(got) + 1)
        got[job] = {**fetch(nodes[0], 0, job), **fetch(nodes[1], 1, job)}
    assert got["whole"].keys() == got["pieces"].keys()
    assert all(torch.equal(got["whole"][k], got["pieces"][k]) for k in got["whole"])
    want = single_process(model, nn.functional.cross_entropy, sgd, batches)
    assert max_relative_difference(got["whole"], want) <= 1e-5


def test_a_step_refused_in_part_leaves_none_of_its_microbatches_behind(nodes):
    """Microbatch 2 of step 0 came alone; the whole step then collides with it and is
    refused (ALREADY_EXISTS) with nothing of it filed, so the other three can still be
    sent one by one, and the job ends exactly as one process trains."""
    steps, m = 2, 4
    model, batches = mlp(), data(steps)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1)
    spec = JobSpec(steps=steps, microbatches=m, batch_size=8, optimizer=cloudpickle.dumps(sgd),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy)).validate()
    load_pipeline(nodes, model, [(0, 2), (2, 3)], spec)
    (x, y), pieces = batches[0], torch.tensor_split(batches[0][0], m)

    def send_input(t, **env):
        rpc.send(nodes[0].stub, frames.encode_frames(t, envelope=node_pb2.Envelope(
            job_id="job", stage=0, kind=Kind.INPUT, step=0, batch_size=8, **env)), timeout=30)

    send_input(pieces[2], microbatch=2)
    with pytest.raises(grpc.RpcError) as e:
        send_input(x, microbatches=m)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for i in (0, 1, 3):
        send_input(pieces[i], microbatch=i)
    rpc.send(nodes[1].stub, frames.encode_frames(y, envelope=node_pb2.Envelope(
        job_id="job", stage=1, kind=Kind.TARGET, step=0, microbatches=m, batch_size=8)),
        timeout=30)
    feed(nodes[0], nodes[1], 2, batches[1:], m, first_step=1)
    for n in nodes:
        n.wait_for(R.STATUS_DONE, 1)
    got = {**fetch(nodes[0], 0), **fetch(nodes[1], 1)}
    want = single_process(model, nn.functional.cross_entropy, sgd, batches)
    assert max_relative_difference(got, want) <= 1e-5


def test_the_same_load_again_is_the_live_stage_and_trains_as_one(nodes):
    """A tracker that took over redoes the recovery its predecessor began: its LoadStage
    of a stage already loaded for that plan and epoch is taken as done, not refused."""
    steps, m = 2, 2
    model, batches = mlp(), data(steps)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1)
    spec = JobSpec(steps=steps, microbatches=m, batch_size=8, optimizer=cloudpickle.dumps(sgd),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy)).validate()
    plan = load_pipeline(nodes, model, [(0, 2), (2, 3)], spec)
    assert load_pipeline(nodes, model, [(0, 2), (2, 3)], spec) == plan  # no ALREADY_EXISTS
    feed(nodes[0], nodes[1], 2, batches, m)
    for n in nodes:
        n.wait_for(R.STATUS_DONE, 1)
    got = {**fetch(nodes[0], 0), **fetch(nodes[1], 1)}
    want = single_process(model, nn.functional.cross_entropy, sgd, batches)
    assert max_relative_difference(got, want) <= 1e-5


def test_load_errors_map_to_status_codes_and_leave_no_channel(nodes):
    model = mlp()
    spec = JobSpec(steps=1, microbatches=1, batch_size=1,
                   optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1)),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy))
    load_pipeline(nodes, model, [(0, 2), (2, 3)], spec)
    with pytest.raises(grpc.RpcError) as e:
        load_pipeline(nodes[:1], model, [(0, 2)], spec)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:
        nodes[0].stub.LoadStage(node_pb2.LoadStageRequest(
            job_id="other", replica=0, stage=0, config=spec.to_proto(),
            plan=node_pb2.Plan(stages=[node_pb2.StageAssignment(replica=0, stage=0,
                                                                address=nodes[1].address)]),
            layers=[b"not a pickle"]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot load stage 0" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a tensor for a stage this node does not hold
        nodes[0].stub.Send(iter(frames.encode_frames(torch.zeros(2), envelope=node_pb2.Envelope(
            job_id="other", kind=Kind.INPUT, batch_size=2))), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:  # a step past the job's end
        nodes[0].stub.Send(iter(frames.encode_frames(torch.zeros(2), envelope=node_pb2.Envelope(
            job_id="job", kind=Kind.INPUT, step=5, batch_size=2))), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    nodes[0].stub.StopJob(node_pb2.StopJobRequest(job_id="job", release=True), timeout=30)
    nodes[1].stub.StopJob(node_pb2.StopJobRequest(job_id="job", release=True), timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        fetch(nodes[0], 0)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert nodes[0].reports == [] and nodes[1].reports == []  # stopped, not failed


def test_channel_pool_shares_one_channel_per_address_until_the_last_user_lets_go(nodes):
    pool, address = ChannelPool(), nodes[1].address
    first, second = pool.acquire(address), pool.acquire(address)
    assert first is second and pool.users(address) == 2
    pool.release(address)
    node_pb2_grpc.NodeStub(first).Ping(node_pb2.PingRequest(), timeout=10)  # still open
    pool.release(address)
    assert pool.users(address) == 0 and pool.addresses() == set()
    with pytest.raises(ValueError, match="closed channel"):
        node_pb2_grpc.NodeStub(first).Ping(node_pb2.PingRequest(), timeout=10)
    with pytest.raises(KeyError):
        pool.release(address)
    with pool.borrow(address) as ch:
        assert pool.users(address) == 1
        node_pb2_grpc.NodeStub(ch).Ping(node_pb2.PingRequest(), timeout=10)
    assert pool.addresses() == set()


def test_stages_talking_to_one_peer_share_its_channel(nodes):
    pool = ChannelPool()
    peer = node_pb2.StageAssignment(address=nodes[1].address, node_name="b")
    a, b = StagePeers(pool), StagePeers(pool)
    sa, sb = a.sender(peer), b.sender(peer)
    assert sa is not sb and sa is a.sender(peer)  # a sender per stage, one per address
    assert pool.users(peer.address) == 2 and pool.addresses() == {peer.address}
    probe = node_pb2.Envelope(kind=Kind.PROBE)
    sa.submit(probe, torch.zeros(4), "raw")
    a.flush()  # the peer has it
    a.close()
    a.close()  # idempotent
    assert pool.users(peer.address) == 1
    sb.submit(probe, torch.zeros(4), "raw")
    b.flush()  # the channel still works for the stage that holds it
    b.close()
    assert pool.addresses() == set()


def test_closing_a_sender_with_an_open_stream_logs_no_error(nodes, caplog):
    """A drain or stop closes its senders, cancelling their open streams: that is a clean
    end, not an error (it was logged as ``Exception in callback PeerSender._ended``)."""
    peers = StagePeers(ChannelPool())
    sender = peers.sender(node_pb2.StageAssignment(address=nodes[1].address, node_name="b"))
    sender.submit(node_pb2.Envelope(kind=Kind.PROBE), torch.zeros(4), "raw")
    sender.encoder.submit(lambda: None).result()  # the stream is open
    call = sender.stream.call
    with caplog.at_level(logging.DEBUG):
        peers.close()
        deadline = time.monotonic() + 10
        while not call.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the done callbacks run on gRPC's thread
    assert call.cancelled()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert sender.error is None


def test_measure_links_borrows_a_channel_and_gives_it_back(nodes):
    reply = nodes[0].stub.MeasureLinks(node_pb2.MeasureLinksRequest(
        peers=[node_pb2.Peer(node_id="b", name="b", address=nodes[1].address)], pings=2,
        max_probe_bytes=2**20, probe_seconds=0.05), timeout=60)
    (link,) = reply.links
    assert not link.error and link.latency > 0 and link.bandwidth > 0
    assert nodes[0].service.channels.addresses() == set()


def checkpointed_pipeline(nodes, steps=6, every=2, job_id="job"):
    model, batches = mlp(), data(steps)
    sgd = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    spec = JobSpec(steps=steps, microbatches=2, batch_size=8, schedule="1f1b",
                   optimizer=cloudpickle.dumps(sgd),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy),
                   checkpoint_every=every).validate()
    plan = load_pipeline(nodes, model, [(0, 2), (2, 3)], spec, job_id)
    feed(nodes[0], nodes[1], 2, batches, 2, job_id)
    for n in nodes:
        n.wait_for(R.STATUS_DONE, 1)
    return model, batches, sgd, spec, plan


def test_checkpoints_go_to_the_buddy_and_a_stage_resumes_from_either_copy(nodes):
    model, batches, sgd, spec, plan = checkpointed_pipeline(nodes)
    for n in nodes:  # every checkpoint but the last step's, acknowledged once the buddy has it
        acks = [r.step for r in n.wait_for(R.STATUS_CHECKPOINT, 2)]
        assert acks == [2, 4], acks
    # each node keeps its buddy's snapshots (the other stage's), and its own stage's newest
    # two: the last checkpoint and the final state after the last step (for Job.save)
    a, b = (n.service.stages.snapshots for n in nodes)
    from fedpipe.spec import StageKey
    assert b.steps("job", StageKey(0, 0)) == [2, 4] == a.steps("job", StageKey(0, 1))
    assert a.steps("job", StageKey(0, 0)) == [4, 6] == b.steps("job", StageKey(0, 1))
    # a new epoch of stage 1, loaded on node a (its buddy), resumes from the step-4 snapshot
    # fetched from node b, and takes only epoch-1 tensors
    plan.epoch = 1
    plan.stages[1].address = nodes[0].address
    nodes[0].stub.LoadStage(node_pb2.LoadStageRequest(
        job_id="job", replica=0, stage=1, plan=plan, config=spec.to_proto(), resume_step=4,
        snapshot_sources=[nodes[1].address],
        layers=[cloudpickle.dumps(layer) for layer in list(model)[2:3]]), timeout=30)
    restored = nodes[0].service.stages.get(StageSlot("job", 0, 1))
    want = single_process(model, nn.functional.cross_entropy, sgd, batches[:4])
    got = {f"{2 + int(k.split('.')[0])}.{k.split('.', 1)[1]}": v
           for k, v in restored.module.state_dict().items()}
    assert max_relative_difference(got, {k: want[k] for k in got}) <= 1e-6
    with pytest.raises(grpc.RpcError) as e:  # a tensor of the old epoch is refused
        nodes[0].stub.Send(iter(frames.encode_frames(torch.zeros(4, 4), envelope=node_pb2.Envelope(
            job_id="job", stage=1, kind=Kind.ACTIVATION, step=4, batch_size=8, epoch=0))),
            timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in e.value.details()


def test_a_corrupt_snapshot_is_refused_and_no_snapshot_fails_the_load_with_the_reason(nodes):
    model, _, _, spec, plan = checkpointed_pipeline(nodes)
    stream = list(nodes[1].stub.FetchSnapshot(node_pb2.FetchSnapshotRequest(
        job_id="job", replica=0, stage=1, step=4), timeout=30))
    cut = stream[-1][:-3]  # the last frame loses its last 3 payload bytes
    with pytest.raises(grpc.RpcError) as e:
        nodes[0].stub.PutSnapshot(iter(stream[:-1] + [cut]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    plan.epoch = 1
    with pytest.raises(grpc.RpcError) as e:  # step 3 was never a checkpoint
        nodes[0].stub.LoadStage(node_pb2.LoadStageRequest(
            job_id="job", replica=0, stage=1, plan=plan, config=spec.to_proto(), resume_step=3,
            snapshot_sources=[nodes[1].address],
            layers=[cloudpickle.dumps(layer) for layer in list(model)[2:3]]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no snapshot of step 3" in e.value.details()


def test_released_and_dropped_stages_free_their_memory_at_once(nodes):
    import gc
    import weakref

    checkpointed_pipeline(nodes)
    refs = [weakref.ref(n.service.stages.get(StageSlot("job", 0, s)).module[0].weight)
            for s, n in enumerate(nodes)]
    gc.disable()  # only the release may free them, not a collection that happens to run
    try:
        nodes[0].stub.StopJob(node_pb2.StopJobRequest(job_id="job", release=True), timeout=30)
        assert refs[0]() is None  # released: gone at once, cycles and all
        assert nodes[0].service.stages.snapshots.jobs() == set()
        # the tracker's reconciliation drops an ended job's stages and snapshots
        held = nodes[1].service.stages.holdings()
        assert [(r.job_id, r.stage) for r in held] == [("job", 1)]
        nodes[1].service.stages.drop([], ["job"])
        assert refs[1]() is None
        assert nodes[1].service.stages.holdings() == []
    finally:
        gc.enable()
