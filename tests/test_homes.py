"""One home per fact: each is written once and read from there (issue 21, item 4).

In-process checks: the tracker's core reads plans, stage times and recovery words
from torch-free homes, not from the dashboard's views; a codec's sizes and costs
are one row of ``fedpipe.wire.codecmodel`` that the wire and the planner both
read; the two method sets of the network layer have two names.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import pathlib

import pytest
import torch

from fedpipe import net
from fedpipe.planner import codecs as planner_codecs
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import CODEC_PARAMS, parse_codec
from fedpipe.wire import codecmodel, rpc
from fedpipe.wire.codecs import CODECS, decode, encode

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fedpipe"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (lazy imports too), as written:
    relative ones with their leading dots."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_the_trackers_core_imports_nothing_from_the_dashboards_views():
    # http.py is the dashboard's server: the one tracker module that draws views
    core = [p for p in sorted((ROOT / "tracker").rglob("*.py")) if p.name != "http.py"]
    assert core
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p)
                                                 if "observe" in m.split("."))
                 for p in core}
    assert {p: m for p, m in offenders.items() if m} == {}


def test_the_codec_model_is_torch_free():
    allowed = {"__future__", "dataclasses", "math", "typing", "..spec"}
    assert imported_modules(ROOT / "wire" / "codecmodel.py") <= allowed


def test_a_plan_survives_the_protocol_both_ways():
    from fedpipe.observe import views
    from fedpipe.planner import protoio
    from fedpipe.planner.types import Plan, ReplicaGroup, StagePlan

    plan = Plan([ReplicaGroup([StagePlan("a", 0, 2, "int8", "raw"),
                               StagePlan("b", 2, 5, "raw", "bf16+zstd:1")], 3, 12, 0.5),
                 ReplicaGroup([StagePlan("c", 0, 5)], 1, 4, 0.25)],
                predicted_step_seconds=0.75, sync_seconds=0.1, calibrated=True)
    nodes = {n: tracker_pb2.NodeInfo(node_id=n, name=f"node-{n}", address=f"10.0.0.1:{i}")
             for i, n in enumerate("abc")}
    msg = protoio.plan_message(plan, nodes)
    assert isinstance(msg, node_pb2.Plan)
    assert protoio.plan_from_message(msg) == plan
    assert views.plan_from_message is protoio.plan_from_message  # re-exported, not copied


@pytest.mark.parametrize("spec", ["raw", "fp16", "bf16", "int8", "int8:16", "int8:4096",
                                  "topk", "topk:0.3", "topk:1.0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("numel", [0, 1, 127, 1000])
def test_the_wire_encodes_exactly_the_bytes_its_model_says(spec, dtype, numel):
    msg = encode(torch.randn(numel).to(dtype), spec)
    parsed = parse_codec(spec)
    k = parsed.k(numel) if parsed.name == "topk" else 0
    itemsize = dtype.itemsize  # raw's and topk's values keep the tensor's dtype
    layout = codecmodel.Layout(numel, itemsize, parsed.block_size, k)
    assert msg.encoded_bytes == codecmodel.MODELS[parsed.name].encoded_bytes(layout)
    assert decode(msg).shape == (numel,)


@pytest.mark.parametrize("spec", ["raw", "fp16", "bf16", "int8", "topk:0.01", "topk:0.3"])
def test_the_planners_size_estimate_is_near_the_exact_size_of_a_float32_tensor(spec):
    numel = 1 << 16
    exact = encode(torch.randn(numel), spec).encoded_bytes / (4 * numel)
    estimate = planner_codecs.codec_cost(spec).wire_factor
    assert estimate == pytest.approx(exact, rel=0.06)  # int8's 0.27 against 1/4 + 1/128


def test_every_codec_has_one_model_and_one_implementation_that_agree_on_lossiness():
    assert set(codecmodel.MODELS) == set(CODECS) == set(CODEC_PARAMS)
    for name, impl in CODECS.items():
        assert impl.lossy == codecmodel.MODELS[name].lossy


def test_the_planner_prices_a_codec_from_its_model_row(monkeypatch):
    row = dataclasses.replace(codecmodel.MODELS["fp16"], fp32_ratio=lambda spec: 0.125,
                              seconds_per_byte=7e-9, zstd_ratio=0.5)
    monkeypatch.setitem(codecmodel.MODELS, "fp16", row)
    cost = planner_codecs.codec_cost("fp16+zstd")
    assert cost.wire_factor == pytest.approx(0.125 * 0.5)
    assert cost.seconds_per_byte == pytest.approx(7e-9 + codecmodel.ZSTD_SECONDS_PER_BYTE)
    assert math.isclose(planner_codecs.codec_cost("fp16").wire_factor, 0.125)


def test_the_network_layer_names_its_two_method_sets_apart():
    node, tracker = "/fedpipe.v1.Node/", "/fedpipe.v1.Tracker/"
    assert net.STREAMING_METHODS == {node + "Send", node + "FetchState", node + "PutSnapshot",
                                     node + "FetchSnapshot", node + "PutWeights",
                                     tracker + "WatchJob"}
    assert rpc.FRAME_METHODS == {node + "Send", node + "SendOne", node + "FetchState",
                                 node + "PutSnapshot", node + "FetchSnapshot",
                                 node + "PutWeights"}
    assert not hasattr(net, "DATA_METHODS") and not hasattr(rpc, "DATA_METHODS")
