"""The planner prices the lowrank codecs by their size model (issue 23, item 5): the row
width comes with the model's profile, the coefficients and the basis amortised over its
refresh period are what the wire sends, and "auto" takes lowrank only where its measured
convergence factor allows."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fedpipe.client.profile import profile_json, profile_model
from fedpipe.client.weights import profile_message
from fedpipe.planner import (ClusterView, LayerProfile, Link, ModelProfile, NodeSpec,
                             SearchOptions, TrainConfig, jsonio, make_plan, simulate)
from fedpipe.planner.codecs import auto_activation, candidates, codec_cost, converges
from fedpipe.planner.protoio import model_profile
from fedpipe.runtime.materialize import meta_profile
from fedpipe.wire import codecmodel
from fedpipe.wire.codecs import encode
from fedpipe.wire.lowrank import End, Subspace

pytestmark = pytest.mark.timeout(120)

KEY = "boundary/0"


@pytest.mark.parametrize("spec", ["lowrank:8@3", "lowrank8:8@3", "lowrank8:1@1"])
def test_the_priced_bytes_are_what_the_wire_sends_with_the_basis_amortised(spec):
    sender, receiver = Subspace(), Subspace()
    shape, microbatches, steps = (4, 16, 32), 5, 6  # two refresh periods of 3 steps (spec @3)
    g = torch.Generator().manual_seed(0)
    sent = grads = 0
    for step in range(steps if spec.endswith("@3") else 1):
        for _ in range(microbatches):
            x = torch.randn(shape, generator=g)
            sent += len(encode(x, spec, end=End(sender, KEY, step)).payload)
            # the receiver (the gradients' sender) holds the basis the message carried
            receiver.incoming(KEY, sender.basis(KEY).matrix, sender.basis(KEY).version,
                              32, sender.basis(KEY).matrix.shape[1])
            grads = len(encode(torch.randn(shape, generator=g), spec,
                               end=End(receiver, KEY)).payload)
    messages = microbatches * (steps if spec.endswith("@3") else 1)
    cost, nbytes = codec_cost(spec), 4 * 16 * 32 * 4.0
    assert cost.wire_bytes(nbytes, 4, 32, microbatches) == pytest.approx(sent / messages)
    assert cost.wire_bytes(nbytes, 4, 32, 0) == pytest.approx(grads)  # gradients: no basis
    # a bf16 tensor has half the bytes for the same rows: the coefficients stay float32
    assert cost.wire_bytes(nbytes / 2, 2, 32, microbatches) == pytest.approx(sent / messages)


def test_without_a_width_lowrank_is_priced_as_no_saving():
    assert codec_cost("lowrank8:16@50").wire_bytes(1e6, 4, 0, 4) == 1e6
    assert codec_cost("lowrank:16").wire_bytes(0.0, 4, 64, 4) == 0.0
    # zstd after lowrank: the model's expected share of the coefficients
    plain, zstd = codec_cost("lowrank:16"), codec_cost("lowrank:16+zstd")
    assert zstd.wire_bytes(1e6, 4, 64, 0) == pytest.approx(
        plain.wire_bytes(1e6, 4, 64, 0) * codecmodel.MODELS["lowrank"].zstd_ratio)


class Tokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def test_the_profile_carries_each_layers_row_width_to_the_planner():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 12), Tokens(), nn.Linear(5 * 12, 3),
                          nn.Flatten(0))
    sample = torch.zeros(2, 5, dtype=torch.long)
    want = [8, 12, 60, 3, 0]  # the last: a 1-dim output, whose last dimension is the batch's
    prof = profile_model(model, sample)
    assert [la.activation_width for la in prof.layers] == want
    assert [la.activation_width for la in model_profile(prof).layers] == want
    assert [la.activation_width for la in jsonio.profile_from_json(
        profile_json(model, sample)).layers] == want
    meta = meta_profile(list(model.to("meta")), sample)
    assert [la.activation_width for la in meta.layers] == want
    again = model_profile(profile_message(meta))
    assert [la.activation_width for la in again.layers] == want
    assert jsonio.profile_from_json(jsonio.profile_to_json(meta)) == meta


def slow_pair(compression: str, width: int = 1024):
    """A 2-stage plan over a 10 Mbit/s link of an 8-layer model whose boundary carries
    rows of ``width`` float32 values, 4 MB per sample, and its cluster, profile, config."""
    nodes = [NodeSpec("a", 1e12, 10**12), NodeSpec("b", 1e12, 10**12)]
    cluster = ClusterView(nodes, default_link=Link(1.25e6, 0.02))
    prof = ModelProfile([LayerProfile(f"l{i}", 1e10, 4 * 10**6, 10**6, width)
                         for i in range(8)])
    config = TrainConfig(batch_size=16, microbatches=4, stages=2, compression=compression)
    plan = make_plan(cluster, prof, config, SearchOptions(iterations=40, time_limit_s=10))
    return plan, cluster, prof, config


def test_a_named_lowrank_codec_is_priced_by_its_size_and_the_plan_shows_it():
    plan, cluster, prof, config = slow_pair("lowrank8:16@50")
    first, second = plan.groups[0].stages
    assert (first.activation_codec, second.gradient_codec) == ("lowrank8:16@50",) * 2
    raw, *_ = slow_pair("none")
    # 16 MB per microbatch at 1.25 MB/s raw; lowrank8:16 of 1024-wide rows: 20 B a row
    assert simulate(plan, cluster, prof, config).step_seconds * 50 < \
        simulate(raw, cluster, prof, config).step_seconds
    blind, _, unknown, _ = slow_pair("lowrank8:16@50", width=0)  # no width: no saving
    assert simulate(blind, cluster, unknown, config).step_seconds > \
        simulate(raw, cluster, prof, config).step_seconds / 2
    table = jsonio.format_plan(plan, cluster, prof, config)
    rows = 4 * 4e6 / (4 * 1024)  # 4 samples of 4 MB a microbatch, in 1024-value rows
    act = rows * 20 + 4 * 1024 * 16 / (50 * 4)  # and the basis, once per 50 steps of 4 mb
    assert f"{act / 1e3:.1f} kB" == "78.5 kB" and "78.1 kB" in table  # gradients: no basis
    assert "78.5 kB" in table
    assert "predicted T: 1.80 x" in table and "lowrank8 never reached the target" in table


def lowrank8_measured(monkeypatch, factor: float) -> None:
    """As if benchmarks/wan.py had measured lowrank8 reaching the target at ``factor``."""
    monkeypatch.setitem(codecmodel.MODELS, "lowrank8", dataclasses.replace(
        codecmodel.MODELS["lowrank8"], steps_factor=factor))
    monkeypatch.setattr(codecmodel, "STEPS_LOWER_BOUND", frozenset())


def test_auto_takes_lowrank_only_where_its_measured_factor_allows(monkeypatch):
    chosen = slow_pair("auto")[0].groups[0].stages[0].activation_codec
    assert not converges("lowrank8:16@50") and "lowrank" not in chosen  # never reached target
    lowrank8_measured(monkeypatch, 1.3)
    assert auto_activation("1f1b")[-1] == "lowrank8:16@50" and "lowrank8:16@50" not in \
        candidates(TrainConfig(batch_size=16, microbatches=4, schedule="async"))[0]
    plan, cluster, prof, config = slow_pair("auto")
    first, second = plan.groups[0].stages
    assert first.activation_codec == "lowrank8:16@50"  # 20 B a row against int8+zstd's ~600
    assert "lowrank" not in second.gradient_codec  # gradients: "auto" never picks it
    table = jsonio.format_plan(plan, cluster, prof, config)
    assert "predicted T: 1.30 x" in table and "never reached" not in table
    lowrank8_measured(monkeypatch, 30.0)  # a faster step, but 30x the steps: not taken
    assert "lowrank" not in slow_pair("auto")[0].groups[0].stages[0].activation_codec
    # a fast link: raw's step is not slower, and lowrank's factor makes its T larger
    lowrank8_measured(monkeypatch, 1.3)
    fast = make_plan(ClusterView([NodeSpec("a", 1e12, 10**12), NodeSpec("b", 1e12, 10**12)],
                                 default_link=Link(1.25e11, 1e-5)),
                     slow_pair("none")[2], TrainConfig(batch_size=16, microbatches=4, stages=2,
                                                       compression="auto"),
                     SearchOptions(iterations=40, time_limit_s=10))
    assert "lowrank" not in fast.groups[0].stages[0].activation_codec
