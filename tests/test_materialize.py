"""Meta-device layers: seeded materialization, the initialization check, the meta profile."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpipe.client.profile import profile_model
from fedpipe.examples.text import char_transformer
from fedpipe.runtime.materialize import (
    MaterializeError,
    check_initializable,
    layer_seed,
    materialize,
    materialize_layers,
    meta_profile,
    shared_across_layers,
    uninitializable,
)


class Scaled(nn.Module):
    """A custom layer with a parameter registered directly: no reset_parameters."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.lin(x) * self.scale


class Cached(nn.Module):
    """A layer with a non-persistent buffer computed in __init__ (lost on meta)."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("table", torch.arange(d, dtype=torch.float32), persistent=False)

    def forward(self, x):
        return x + self.table


def _meta_mixed() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16),
                             nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_layers_made_alone_equal_the_same_layers_of_the_whole_model():
    whole = materialize(_meta_mixed(), seed=7)
    alone = materialize_layers(list(_meta_mixed()), [2, 3], seed=7)
    _assert_same(alone[0], whole[2])
    _assert_same(alone[1], whole[3])
    assert not any(p.is_meta for p in whole.parameters())


def test_the_text_model_with_multihead_attention_is_made_whole_and_alone_alike():
    with torch.device("meta"):
        meta = char_transformer(d=32, heads=4, blocks=3, seq=16)
    with torch.device("meta"):
        other = char_transformer(d=32, heads=4, blocks=3, seq=16)
    assert uninitializable(meta) == []
    whole = materialize(meta, seed=3)
    (block,) = materialize_layers(list(other), [2], seed=3)
    _assert_same(block, whole[2])
    attn = whole[1].attn
    assert torch.equal(attn.out_proj.bias, torch.zeros_like(attn.out_proj.bias))  # MHA's own init
    assert attn.in_proj_weight.abs().sum() > 0


def test_materialization_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    expected = torch.rand(4)
    torch.set_rng_state(before)
    materialize(_meta_mixed(), seed=1)
    assert torch.equal(torch.rand(4), expected)


def test_seeds_and_layer_indices_give_different_weights():
    a, b = materialize(_meta_mixed(), seed=1), materialize(_meta_mixed(), seed=2)
    assert not torch.equal(a[3].weight, b[3].weight)
    assert layer_seed(1, 3) != layer_seed(1, 5) and layer_seed(1, 3) == layer_seed(1, 3)
    assert 0 <= layer_seed(2**40, 10**6) < 2**63


def test_batchnorm_running_stats_are_reset_on_materialization():
    bn = materialize(_meta_mixed(), seed=0)[2]
    assert torch.equal(bn.running_mean, torch.zeros(16))
    assert torch.equal(bn.running_var, torch.ones(16))
    assert int(bn.num_batches_tracked) == 0


def test_a_parameter_nothing_initializes_is_named_with_its_layer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled(4), Cached(4))
    assert uninitializable(model) == [(1, "scale"), (2, "table")]
    with pytest.raises(MaterializeError, match=r"layer 1 \(Scaled\).*scale.*1 in later"):
        check_initializable(model)


def test_an_init_fn_covers_what_reset_parameters_does_not():
    def init_fn(layer: nn.Module, index: int, g: torch.Generator) -> None:
        if isinstance(layer, Scaled):
            nn.init.normal_(layer.scale, generator=g)
        if isinstance(layer, Cached):
            layer.table.copy_(torch.arange(4, dtype=torch.float32))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled(4), Cached(4))
    assert uninitializable(model, init_fn) == []
    check_initializable(model, init_fn)
    made = materialize(model, seed=5, init_fn=init_fn)
    assert torch.equal(made[2].table, torch.arange(4, dtype=torch.float32))
    with torch.device("meta"):
        again = nn.Sequential(nn.Linear(4, 4), Scaled(4), Cached(4))
    (alone,) = materialize_layers(list(again), [1], seed=5, init_fn=init_fn)
    assert torch.equal(alone.scale, made[1].scale)


def test_a_layer_with_weights_is_not_checked_or_remade():
    real = nn.Linear(4, 4)
    kept = _state(real)
    with torch.device("meta"):
        model = nn.Sequential(real, Scaled(4))
    model[0] = real
    assert uninitializable(model) == [(1, "scale")]
    materialize_layers(list(model), [0], seed=0)
    assert all(torch.equal(v, kept[k]) for k, v in model[0].state_dict().items())


def test_a_tied_copy_starts_equal_to_its_source_even_made_alone():
    def meta():
        with torch.device("meta"):
            return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))

    ties = [[(0, "weight"), (2, "weight")]]
    whole = materialize(meta(), seed=9, ties=ties)
    assert torch.equal(whole[0].weight, whole[2].weight)
    (head,) = materialize_layers(list(meta()), [2], seed=9, ties=ties)
    assert torch.equal(head.weight, whole[2].weight)
    with pytest.raises(MaterializeError, match="layer 2 has no parameter"):
        materialize(meta(), seed=9, ties=[[(0, "weight"), (2, "nope")]])


def test_a_parameter_shared_by_two_layers_is_reported_with_both():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(4, 4), head)
    assert shared_across_layers(model) == [((0, "weight"), (2, "weight"))]
    assert shared_across_layers(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


def _compare_profiles(real: nn.Sequential, meta: nn.Sequential, sample: torch.Tensor):
    got, want = meta_profile(meta, sample), profile_model(real, sample)
    assert got.input_bytes == want.input_bytes and got.element_bytes == 4
    assert [la.name for la in got.layers] == [la.name for la in want.layers]
    for g, w in zip(got.layers, want.layers):
        assert (g.activation_bytes, g.parameter_bytes) == (w.activation_bytes, w.parameter_bytes)
    assert all(p.grad is None for p in meta.parameters())
    return [g.flops for g in got.layers], [w.flops for w in want.layers]


def test_the_meta_profile_equals_the_profile_of_the_real_model():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(),
                             nn.LayerNorm(32), nn.Linear(32, 50))

    with torch.device("meta"):
        meta = build()
    got, want = _compare_profiles(build(), meta, torch.randint(0, 50, (4, 8)))
    assert got == pytest.approx(want)


def test_the_meta_profile_counts_attention_that_the_fused_cpu_kernel_hides():
    # On the CPU, nn.MultiheadAttention runs a fused attention kernel the FLOP counter
    # does not see; on meta it decomposes into bmm, which is counted: 4 * T^2 * d per
    # sample forward (scores and values), twice that backward.
    real = char_transformer(d=32, heads=4, blocks=2, seq=16)
    with torch.device("meta"):
        meta = char_transformer(d=32, heads=4, blocks=2, seq=16)
    got, want = _compare_profiles(real, meta, torch.randint(0, 128, (4, 16)))
    assert got[0] == want[0] and got[3] == want[3]
    for block in (1, 2):
        assert got[block] - want[block] == pytest.approx(3 * 2 * 2 * 16 * 16 * 32)


def test_the_meta_profile_refuses_real_weights_and_tuple_outputs():
    with pytest.raises(MaterializeError, match="layer 0 has tensors off the meta device"):
        meta_profile(nn.Sequential(nn.Linear(2, 2)), torch.zeros(1, 2))

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(TypeError, match="layer 0 \\(Pair\\)"):
        meta_profile(nn.Sequential(Pair()), torch.zeros(1, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_layer_made_on_a_gpu_has_the_weights_made_on_the_cpu():
    (on_gpu,) = materialize_layers(list(_meta_mixed()), [3], seed=2, device="cuda")
    (on_cpu,) = materialize_layers(list(_meta_mixed()), [3], seed=2)
    assert on_gpu.weight.is_cuda
    assert torch.equal(on_gpu.weight.cpu(), on_cpu.weight)
