"""A stage's measured peak on a CPU starts after its code is unpickled (issue 22, item 3):
the modules that code imports (the first job's ``transformers``) are the node's, not the
stage's, so they are not counted; its weights, made after, are.

The real node wiring builds the stage (:func:`fedpipe.node.parts.stage_builder`, as a node
does, measuring with :class:`~fedpipe.node.memory.StageMemory`); the heavy import is a
module written here that keeps 64 MiB resident once imported."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.node.admission import BOUNDED_KINDS
from fedpipe.node.lifecycle import StageSlot
from fedpipe.node.mailbox import Mailbox
from fedpipe.node.memory import StageMemory, reset_peak_rss
from fedpipe.node.parts import stage_builder
from fedpipe.node.peers import ChannelPool, StagePeers
from fedpipe.node.reports import StageReporter
from fedpipe.node.wiring import build_stage
from fedpipe.proto import node_pb2
from fedpipe.spec import JobSpec, WeightsSpec

pytestmark = pytest.mark.timeout(60)
HEAVY = 64 * 2**20
CPU = torch.device("cpu")


def _heavy_layer(tmp_path, name: str) -> bytes:
    """A meta layer of a class from module ``name``, which holds HEAVY resident bytes once
    imported, pickled by reference (unpickling it imports the module again)."""
    (tmp_path / f"{name}.py").write_text(
        "from torch import nn\n"
        f"BALLAST = bytearray({HEAVY})\n"
        "BALLAST[::4096] = b'x' * len(BALLAST[::4096])  # every page touched: resident\n"
        "class Wide(nn.Linear):\n"
        "    pass\n")
    module = __import__(name)
    with torch.device("meta"):
        layer = module.Wide(256, 256)  # 256 KiB of weights
    blob = cloudpickle.dumps(layer)
    del sys.modules[name]  # the node's unpickling imports it afresh
    return blob


def _request(job: str, layer: bytes) -> node_pb2.LoadStageRequest:
    spec = JobSpec(steps=2, optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD,
                                                                          lr=0.1)),
                   loss_fn=cloudpickle.dumps(nn.functional.mse_loss),
                   weights=WeightsSpec(source="seed", seed=1)).validate()
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=0, node_id="n0", address="127.0.0.1:1", node_name="n0",
        layer_start=0, layer_end=1)])
    return node_pb2.LoadStageRequest(job_id=job, plan=plan, config=spec.to_proto(),
                                     layers=[layer], predicted_memory_bytes=2**20)


def test_a_stage_whose_code_imports_a_heavy_module_does_not_count_it(tmp_path, monkeypatch):
    if not reset_peak_rss():
        pytest.skip("this kernel does not let the peak resident set be reset")
    monkeypatch.syspath_prepend(str(tmp_path))
    memory = StageMemory(CPU, 0)
    mailbox = Mailbox(4, BOUNDED_KINDS)
    build = stage_builder(CPU, mailbox, lambda: "n0", lambda *a: None,
                          StageReporter(lambda: "n0", lambda r: None, memory=memory), None,
                          memory)
    peers = StagePeers(ChannelPool())
    try:
        counted = _request("plain", _heavy_layer(tmp_path, "heavy_plain"))
        memory.admit(counted, [])  # the peak from before the load, as it was measured
        build_stage(counted, CPU, mailbox, peers)
        before, _ = memory.figures(StageSlot("plain", 0, 0))

        request = _request("job", _heavy_layer(tmp_path, "heavy_node"))
        memory.admit(request, [])  # as the registry admits a stage before it builds it
        stage = build(request, peers)
        peak, predicted = memory.figures(StageSlot("job", 0, 0))
    finally:
        peers.close()
        sys.modules.pop("heavy_plain", None)
        sys.modules.pop("heavy_node", None)
    assert stage.module[0].weight.device == CPU  # its weights were made on the node
    assert before >= HEAVY  # measured from before the load, the import counts
    assert peak < HEAVY // 4 and predicted == 2**20  # from after the unpickling, it does not
