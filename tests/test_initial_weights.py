"""A stage's initial weights when its layers come as code only (issue 22), in one process:
what a node makes, reads or waits for (:mod:`fedpipe.node.initial`), what the client sends
(:mod:`fedpipe.client.weights`), and that the job's signature covers the weights."""
from __future__ import annotations

import copy

import cloudpickle
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client.weights import meta_copy, package, weight_frames, weight_tensors
from fedpipe.node.initial import WeightsRefused, allocate, make_layers
from fedpipe.proto import node_pb2
from fedpipe.runtime.weights import layer_digest, save_layers
from fedpipe.security.signing import job_message
from fedpipe.spec import JobSpec, WeightsSpec
from fedpipe.wire import frames


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Linear(4, 3))


def _request(layers: list[bytes], resume_step: int = 0) -> node_pb2.LoadStageRequest:
    return node_pb2.LoadStageRequest(layers=layers, resume_step=resume_step)


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_a_node_makes_its_seeded_layers_as_materialize_makes_them_in_one_process():
    with torch.device("meta"):
        model = mlp()
    code = package(model, torch.zeros(2, 6), seed=9)
    whole = fedpipe.materialize(copy.deepcopy(model), 9)
    made, pending = make_layers(_request(code.layers[2:4]), code.weights, 2, torch.device("cpu"))
    assert pending is None
    _same(made[0], whole[2])
    _same(made[1], whole[3])


def test_a_streamed_stage_waits_then_takes_its_layers_and_refuses_a_changed_tensor():
    torch.manual_seed(0)
    model = mlp()
    code = package(model, torch.zeros(2, 6))
    assert code.weights.source == "stream" and code.tensors is not None
    made, pending = make_layers(_request(code.layers[2:4]), code.weights, 2, torch.device("cpu"))
    assert pending is not None and not pending.arrived.is_set()
    forged = {k: v.clone() for k, v in model[2].state_dict().items()}
    forged["bias"][0] += 1
    with pytest.raises(WeightsRefused, match="layer 2"):
        pending.fill([(f"2.{k}", v) for k, v in forged.items()])
    assert not pending.arrived.is_set()
    with pytest.raises(WeightsRefused, match="layer 1 is not one of"):
        pending.fill([("1.weight", model[0].weight)])
    env = node_pb2.Envelope(job_id="j", kind=node_pb2.KIND_WEIGHTS)
    sent = frames.read_tensors(weight_frames(env, weight_tensors(2, 4, code.tensors)))
    pending.fill((h.name, t) for h, t in sent)
    assert pending.arrived.is_set()
    _same(made[0], model[2])
    _same(made[1], model[3])


def test_a_stage_that_restores_a_snapshot_waits_for_no_weights():
    code = package(mlp(), torch.zeros(2, 6))
    _, pending = make_layers(_request(code.layers[:2], resume_step=3), code.weights, 0,
                             torch.device("cpu"))
    assert pending is None


def test_a_node_reads_its_layers_from_files_it_can_read_and_waits_when_it_cannot(tmp_path):
    torch.manual_seed(1)
    real = mlp()
    path = save_layers(list(real), tmp_path / "w")
    with torch.device("meta"):
        model = mlp()
    code = package(model, torch.zeros(2, 6), weights=path)
    assert code.weights.source == "files"
    made, pending = make_layers(_request(code.layers[2:]), code.weights, 2, torch.device("cpu"))
    assert pending is None
    _same(made[0], real[2])
    elsewhere = WeightsSpec(source="files", path=str(tmp_path / "not-here"),
                            digests=code.weights.digests)
    _, pending = make_layers(_request(code.layers[2:]), elsewhere, 2, torch.device("cpu"))
    assert pending is not None  # the client streams them


def test_files_whose_tensors_differ_from_the_signed_digests_are_refused(tmp_path):
    torch.manual_seed(2)
    path = save_layers(list(mlp()), tmp_path / "w")
    with torch.device("meta"):
        model = mlp()
    code = package(model, torch.zeros(2, 6), weights=path)
    torch.manual_seed(3)
    save_layers(list(mlp()), tmp_path / "w")  # the files changed after submit
    with pytest.raises(WeightsRefused, match="layer 0"):
        make_layers(_request(code.layers[:2]), code.weights, 0, torch.device("cpu"))


def test_code_carries_no_weights_and_keeps_non_persistent_buffers():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1000, 1000)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

        def forward(self, x):
            return self.lin(x)

    layer = Cached()
    blob = cloudpickle.dumps(meta_copy(layer))
    assert len(blob) < 16 * 1024  # a 4 MB layer as code
    assert not layer.lin.weight.is_meta  # the client's layer is untouched
    made = allocate(cloudpickle.loads(blob), torch.device("cpu"))
    assert torch.equal(made.table, torch.arange(4.0)) and not made.lin.weight.is_meta


def test_the_job_signature_covers_the_weights_digests_and_the_seed():
    base = JobSpec(steps=1, weights=WeightsSpec("stream", digests=("a" * 64,)))
    msg = job_message("owner", [b"x"], base.to_proto())
    other = base.with_(weights=WeightsSpec("stream", digests=("b" * 64,)))
    assert job_message("owner", [b"x"], other.to_proto()) != msg
    seeded = JobSpec(steps=1, weights=WeightsSpec("seed", seed=1)).to_proto()
    reseeded = JobSpec(steps=1, weights=WeightsSpec("seed", seed=2)).to_proto()
    assert job_message("o", [b"x"], seeded) != job_message("o", [b"x"], reseeded)


def test_layer_digests_match_between_client_and_node():
    layer = nn.Linear(3, 2)
    assert layer_digest(layer.state_dict()) == layer_digest(
        {k: v.clone() for k, v in layer.state_dict().items()})


def test_one_stream_fills_a_stage_at_a_time_and_an_idle_one_is_taken_over(monkeypatch):
    from fedpipe.client.weights import weight_tensors
    from fedpipe.net import timeouts
    torch.manual_seed(5)
    model = mlp()
    code = package(model, torch.zeros(2, 6))
    assert code.tensors is not None
    _, pending = make_layers(_request(code.layers[2:4]), code.weights, 2, torch.device("cpu"))
    assert pending is not None
    first, *rest = weight_tensors(2, 4, code.tensors)
    pending.begin("a")
    pending.take("a", *first)
    with pytest.raises(WeightsRefused, match="another stream is loading"):
        pending.begin("b")  # a is under way
    monkeypatch.setattr(timeouts, "WEIGHTS_IDLE", 0.0)  # a went quiet: b takes over
    pending.begin("b")
    with pytest.raises(WeightsRefused, match="of no stream started here"):
        pending.take("a", *rest[0])
    for name, t in [first, *rest]:
        pending.take("b", name, t)
    pending.end("b")
    assert pending.arrived.is_set()
