"""A job's layers made of ``transformers`` classes record the client's ``transformers``
version, and a node with another version refuses the job's stages, naming both (issue 22,
item 5), before it unpickles a layer. The real node wiring (``build_stage``) builds the
stage; the other version is the job's record, since one process has one ``transformers``."""
from __future__ import annotations

import cloudpickle
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.hf import sequential
from fedpipe.node.admission import BOUNDED_KINDS
from fedpipe.node.errors import StageLoadError
from fedpipe.node.mailbox import Mailbox
from fedpipe.node.peers import ChannelPool, StagePeers
from fedpipe.node.wiring import build_stage
from fedpipe.proto import node_pb2
from fedpipe.runtime import libraries
from fedpipe.spec import JobSpec

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _layers() -> nn.Sequential:
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    with torch.device("meta"):
        return sequential(GPT2LMHeadModel(config)).layers


def test_layers_of_transformers_classes_record_its_version_and_plain_ones_none():
    assert libraries.used_by(_layers()) == (("transformers", transformers.__version__),)
    assert libraries.used_by(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ()


def test_the_version_travels_in_the_job_config():
    spec = JobSpec(steps=1, libraries=(("transformers", "4.1.0"),))
    assert JobSpec.from_proto(spec.to_proto()).libraries == spec.libraries
    assert JobSpec.from_proto(JobSpec(steps=1).to_proto()).libraries == ()


def _request(recorded: str, layers: list[bytes]) -> node_pb2.LoadStageRequest:
    spec = JobSpec(steps=2, schedule="1f1b",
                   optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1)),
                   loss_fn=cloudpickle.dumps(nn.functional.cross_entropy),
                   libraries=(("transformers", recorded),)).validate()
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=0, node_id="n0", address="127.0.0.1:1", node_name="n0",
        layer_start=0, layer_end=len(layers))])
    return node_pb2.LoadStageRequest(job_id="job-7", replica=0, stage=0, plan=plan,
                                     config=spec.to_proto(), layers=layers)


def _build(request: node_pb2.LoadStageRequest):
    pool = ChannelPool()
    peers = StagePeers(pool)
    try:
        return build_stage(request, torch.device("meta"), Mailbox(4, BOUNDED_KINDS), peers)
    finally:
        peers.close()


def test_a_node_with_another_transformers_refuses_the_stage_naming_both_versions():
    mine = transformers.__version__
    # not even a pickle: the refusal comes before any layer is unpickled
    with pytest.raises(StageLoadError, match=rf"job 'job-7'.*transformers 0\.0\.1 on its "
                                             rf"client but this node runs transformers "
                                             rf"{mine}"):
        _build(_request("0.0.1", [b"not a pickle"]))


def test_a_node_with_the_same_transformers_builds_the_stage():
    stage = _build(_request(transformers.__version__,
                            [cloudpickle.dumps(layer) for layer in _layers()]))
    assert len(stage.module) == 3


def test_a_node_without_the_library_says_so(monkeypatch):
    monkeypatch.setattr(libraries, "installed", lambda name: None)
    with pytest.raises(libraries.LibraryMismatch, match="this node does not have transformers"):
        libraries.check((("transformers", "4.1.0"),))
