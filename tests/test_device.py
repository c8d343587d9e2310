"""Device placement on the CPU side: which device a node picks, and that a stage built for a
device gets what it receives and restores on that device.

A stage is built here for torch's ``meta`` device, which every torch build has: tensors
that arrive on the CPU must leave the transport and the snapshot restore on the stage's
device, as they would on ``cuda`` (tools/gpu-smoke.sh runs the real thing on a GPU).
"""
from __future__ import annotations

import cloudpickle
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.node import probe
from fedpipe.node.admission import BOUNDED_KINDS
from fedpipe.node.mailbox import Mailbox
from fedpipe.node.peers import ChannelPool, StagePeers
from fedpipe.node.wiring import StageTransport, build_stage
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint
from fedpipe.spec import JobSpec, Kind

pytestmark = pytest.mark.timeout(60)


def test_auto_picks_cuda_only_when_torch_sees_a_gpu_and_cuda_without_one_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.resolve_device("auto") == "cpu"
    assert probe.resolve_device("cpu") == "cpu"
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {asked}: no CUDA device is visible"):
            probe.resolve_device(asked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert probe.resolve_device("auto") == "cuda"
    assert probe.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="unknown device 'tpu'; use cpu, cuda, cuda:N or auto"):
        probe.resolve_device("tpu")


def test_this_machines_auto_device_is_the_one_torch_can_use():
    device = probe.resolve_device("auto")
    torch.zeros(1, device=device)  # a device torch cannot use would raise here
    if not torch.cuda.is_available():
        assert device == "cpu"


def request(momentum: float = 0.9) -> node_pb2.LoadStageRequest:
    """Stage 1 of a two-stage Linear-Tanh-Linear, trained with SGD and momentum."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    spec = JobSpec(steps=4, microbatches=2, batch_size=8, schedule="1f1b",
                   optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1,
                                                                 momentum=momentum)),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy)).validate()
    plan = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=s, node_id=f"n{s}", address=f"127.0.0.1:{s + 1}",
                                 node_name=f"n{s}", layer_start=a, layer_end=b)
        for s, (a, b) in enumerate([(0, 2), (2, 3)])])
    return node_pb2.LoadStageRequest(job_id="job", replica=0, stage=1, plan=plan,
                                     config=spec.to_proto(),
                                     layers=[cloudpickle.dumps(layer) for layer in layers[2:]])


@pytest.fixture
def pool():
    pool = ChannelPool()
    yield pool
    assert pool.addresses() == set()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_stage_receives_its_tensors_on_its_own_device(pool, device):
    mailbox = Mailbox(4, bounded=BOUNDED_KINDS)
    peers = StagePeers(pool)
    try:
        stage = build_stage(request(), torch.device(device), mailbox, peers)
        assert {p.device.type for p in stage.module.parameters()} == {device}
        assert stage.plan is not None
        transport = StageTransport(stage, mailbox, torch.device(device))
        arrived = torch.randn(4, 16)  # as the wire decodes it: a CPU tensor
        mailbox.put(stage.inbox, Kind.ACTIVATION, 0, 1, arrived, 8)
        got, batch = transport.recv(Kind.ACTIVATION, 0, 1, timeout=5)
        assert got.device.type == device and batch == 8 and got.shape == arrived.shape
        if device == "cpu":
            assert torch.equal(got, arrived)
    finally:
        peers.close()


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")  # meta: no data
def test_a_cpu_snapshot_restores_into_a_stage_on_another_device(pool):
    """Snapshots travel as CPU tensors; restoring one puts the optimizer state (momentum
    buffers) on the stage's device, where its parameters are."""
    cpu_peers, meta_peers = StagePeers(pool), StagePeers(pool)
    try:
        trained = build_stage(request(), torch.device("cpu"), Mailbox(4, BOUNDED_KINDS),
                              cpu_peers)
        out = trained.module(torch.randn(8, 16)).sum()
        out.backward()
        opt = trained.parts["optimizer"]
        assert isinstance(opt, torch.optim.Optimizer)
        opt.step()  # momentum buffers exist now
        snap = checkpoint.take(trained.parts, step=1)
        assert {t.device.type for t in snap.tensors.values()} == {"cpu"}
        assert any("momentum_buffer" in name for name in snap.tensors)
        # the snapshot crosses the wire as wire frames, as PutSnapshot/FetchSnapshot carry it
        _, received = checkpoint.from_frames(checkpoint.to_frames(snap), max_bytes=2**20)

        restored = build_stage(request(), torch.device("meta"), Mailbox(4, BOUNDED_KINDS),
                               meta_peers)
        checkpoint.restore(restored.parts, received)
        meta_opt = restored.parts["optimizer"]
        assert isinstance(meta_opt, torch.optim.Optimizer)
        buffers = [s["momentum_buffer"] for s in meta_opt.state.values()]
        assert len(buffers) == 2 and all(b.device.type == "meta" for b in buffers)
        assert {p.device.type for p in restored.module.parameters()} == {"meta"}
    finally:
        cpu_peers.close()
        meta_peers.close()
