"""Hugging Face causal LMs as fedpipe layers: exact logits, causal blocks, tied copies,
meta models, checkpoints in and out. Real ``transformers`` classes, tiny configs."""
from __future__ import annotations

import copy
import pickle

import cloudpickle
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from fedpipe.hf import AdapterError, lm_loss, save_pretrained, sequential  # noqa: E402
from fedpipe.runtime.materialize import (  # noqa: E402
    TIES_ATTRIBUTE,
    materialize,
    materialize_layers,
    meta_profile,
    norm_parameters,
    sum_tied_gradients,
    uninitializable,
)
from fedpipe.runtime.weights import WeightFiles, load_layers  # noqa: E402

VOCAB, SEQ = 256, 16


def _text_batches(batch: int = 4, steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, next-byte target) windows of Python's own documentation, as bytes."""
    from pydoc_data.topics import topics

    data = torch.tensor(list("".join(topics[k] for k in sorted(topics))[:20000].encode()),
                        dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=g).tolist()
        chunk = torch.stack([data[s:s + SEQ + 1] for s in starts])
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def _gpt2_config(**kw) -> GPT2Config:
    base = dict(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**base, **kw})


def _gpt2(seed: int = 0, dtype=torch.float64, **kw) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(_gpt2_config(**kw)).to(dtype)


def _llama(seed: int = 0, dtype=torch.float64, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**base, **kw})).to(dtype)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_the_layers_compute_the_models_logits_in_float64(build, attn):
    model = build(attn_implementation=attn).eval()
    x, _ = _text_batches()[0]
    want = model(x).logits
    adapted = sequential(copy.deepcopy(model))
    got = adapted.layers.eval()(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_bare_gpt2_block_attends_both_ways_under_eager_but_the_adapter_is_causal():
    model = _gpt2(attn_implementation="eager").eval()
    adapted = sequential(model)
    h = torch.randn(1, SEQ, 32, dtype=torch.float64)
    later = h.clone()
    later[:, -1] = torch.randn(32, dtype=torch.float64)  # change only the last position
    bare = adapted.layers[1].layer
    assert not torch.allclose(bare(h)[:, 0], bare(later)[:, 0])  # position 0 saw the future
    block = adapted.layers[1]
    torch.testing.assert_close(block(h)[:, :-1], block(later)[:, :-1], rtol=0, atol=0)


def test_the_loss_is_the_models_loss_on_shifted_targets():
    model = _gpt2(dtype=torch.float32).eval()  # transformers computes its loss in float32
    x, _ = _text_batches()[0]
    want = model(x, labels=x).loss
    targets = torch.cat([x[:, 1:], torch.full((x.shape[0], 1), -100)], dim=1)
    got = lm_loss(sequential(copy.deepcopy(model)).layers.eval()(x), targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _train(step_fn, params, batches, lr=1e-2):
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        losses.append(step_fn(x, y))
        opt.step()
    return losses


def test_training_the_untied_layers_equals_training_the_model_with_dropout():
    model = _gpt2(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    adapted = sequential(copy.deepcopy(model))
    batches = _text_batches()

    def hf_step(x, y):
        torch.manual_seed(11)  # same dropout masks: the layers draw in the model's order
        loss = lm_loss(model(x).logits, y)
        loss.backward()
        return loss.item()

    def layers_step(x, y):
        torch.manual_seed(11)
        loss = lm_loss(adapted.layers(x), y)
        loss.backward()
        return loss.item()

    assert adapted.tied_parameters == []
    want = _train(hf_step, model.parameters(), batches)
    got = _train(layers_step, adapted.layers.parameters(), batches)
    assert got == pytest.approx(want, rel=0, abs=1e-12)
    torch.testing.assert_close(adapted.layers[-1].lm_head.weight, model.lm_head.weight,
                               rtol=0, atol=1e-12)


def test_tied_copies_with_summed_gradients_train_as_the_tied_model():
    model = _gpt2(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    assert model.lm_head.weight is model.transformer.wte.weight
    adapted = sequential(copy.deepcopy(model))
    layers, ties = adapted.layers, adapted.tied_parameters
    last = len(layers) - 1
    assert ties == [[(0, "tokens.weight"), (last, "lm_head.weight")]]
    assert layers[0].tokens.weight is not layers[last].lm_head.weight
    batches = _text_batches(steps=6)

    def hf_step(x, y):
        loss = lm_loss(model(x).logits, y)
        loss.backward()
        return loss.item()

    def layers_step(x, y):
        loss = lm_loss(layers(x), y)
        loss.backward()
        sum_tied_gradients(layers, ties)
        return loss.item()

    want = _train(hf_step, model.parameters(), batches)
    got = _train(layers_step, layers.parameters(), batches)
    assert got == pytest.approx(want, rel=0, abs=1e-5)
    torch.testing.assert_close(layers[0].tokens.weight, layers[last].lm_head.weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(layers[0].tokens.weight, model.transformer.wte.weight,
                               rtol=0, atol=1e-5)


def test_a_tied_parameter_counts_once_in_the_clipped_global_norm():
    model = _gpt2()
    adapted = sequential(copy.deepcopy(model))
    layers, ties = adapted.layers, adapted.tied_parameters
    x, y = _text_batches()[0]
    torch.manual_seed(1)
    lm_loss(model(x).logits, y).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    torch.manual_seed(1)
    lm_loss(layers(x), y).backward()
    sum_tied_gradients(layers, ties)
    stages = [{0: layers[0], 1: layers[1]}, {i: layers[i] for i in range(2, len(layers))}]
    squares = [sum(p.grad.pow(2).sum() for p in norm_parameters(s, ties)) for s in stages]
    torch.testing.assert_close(sum(squares).sqrt(), want, rtol=1e-12, atol=0)
    assert len(norm_parameters(stages[1], ties)) == len(list(layers[2:].parameters())) - 1


def test_without_the_sum_the_tied_copies_drift_apart():
    adapted = sequential(_gpt2())
    layers = adapted.layers
    x, y = _text_batches()[0]
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    lm_loss(layers(x), y).backward()
    opt.step()
    assert not torch.equal(layers[0].tokens.weight, layers[-1].lm_head.weight)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_meta_model_is_made_alike_whole_and_stage_by_stage(build):
    def meta():
        with torch.device("meta"):
            return sequential(build(dtype=torch.float32))

    adapted = meta()
    layers = adapted.layers
    assert uninitializable(layers, adapted.init_fn, adapted.tied_parameters) == []
    whole = materialize(layers, seed=4, init_fn=adapted.init_fn, ties=adapted.tied_parameters)
    again = meta()
    last = len(whole) - 1
    # what a node gets: its layers and the tie's source, pickled on meta (a few KiB each)
    sent = {i: cloudpickle.dumps(again.layers[i]) for i in (0, 2, last)}
    assert max(map(len, sent.values())) < 16 * 1024
    node = {i: pickle.loads(b) for i, b in sent.items()}
    init_fn = pickle.loads(cloudpickle.dumps(again.init_fn))
    alone = materialize_layers(node, [2, last], seed=4, init_fn=init_fn,
                               ties=again.tied_parameters)
    assert node[0].tokens.weight.is_meta  # the source was made on the side, not in place
    for got, i in zip(alone, (2, last)):
        for key, t in whole[i].state_dict().items():
            assert torch.equal(got.state_dict()[key], t), (i, key)
    if adapted.tied_parameters:
        assert torch.equal(whole[0].tokens.weight, whole[last].lm_head.weight)
    x, y = _text_batches()[0]
    assert torch.isfinite(lm_loss(whole(x), y))


def test_the_models_own_init_scales_gpt2_residual_projections():
    with torch.device("meta"):
        adapted = sequential(_gpt2(dtype=torch.float32, n_layer=2, n_embd=256, n_head=4))
    whole = materialize(adapted.layers, seed=0, init_fn=adapted.init_fn)
    std = whole[1].layer.attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * 2) ** 0.5, rel=0.05)
    assert whole[1].layer.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_without_the_models_init_gpt2s_conv1d_is_named_uninitializable():
    with torch.device("meta"):
        adapted = sequential(_gpt2(dtype=torch.float32))
    missing = uninitializable(adapted.layers)
    assert (1, "layer.attn.c_attn.weight") in missing
    assert all(i in (1, 2, 3) for i, _ in missing)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_save_pretrained_directory_loads_into_a_meta_stage(build, tmp_path):
    model = build(dtype=torch.float32).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in WeightFiles(tmp_path)) != tied  # a tied head is stored once
    with torch.device("meta"):
        adapted = sequential(build(dtype=torch.float32))
    layers = materialize(adapted.layers, seed=1, init_fn=adapted.init_fn,
                         ties=adapted.tied_parameters).eval()
    load_layers(tmp_path, dict(enumerate(layers)), names=adapted.names)
    x, _ = _text_batches()[0]
    torch.testing.assert_close(layers(x), model(x).logits, rtol=0, atol=1e-5)


def test_the_layers_save_back_to_a_checkpoint_from_pretrained_loads(tmp_path):
    adapted = sequential(_gpt2(dtype=torch.float32))
    layers = adapted.layers.eval()
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(0.01)  # not the model's init: the saved values must be these
        layers[-1].lm_head.weight.copy_(layers[0].tokens.weight)
    save_pretrained(adapted, tmp_path, max_shard_bytes=30_000)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x, _ = _text_batches()[0]
    torch.testing.assert_close(loaded(x).logits, layers(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_meta_profile_of_the_layers_allocates_nothing_and_counts_attention(attn):
    with torch.device("meta"):
        adapted = sequential(_gpt2(dtype=torch.float32, attn_implementation=attn))
    prof = meta_profile(adapted.layers, torch.zeros(2, SEQ, dtype=torch.int64))
    assert [la.name for la in prof.layers] == ["0:Embeddings", "1:Block", "2:Block", "3:Block",
                                               "4:Head"]
    assert prof.layers[1].activation_bytes == SEQ * 32 * 4
    assert prof.layers[4].activation_bytes == SEQ * VOCAB * 4
    assert prof.layers[4].parameter_bytes == (VOCAB * 32 + 2 * 32) * 4
    # per sample forward: 12 d^2 T for the projections + 2 d T^2 attention, times 3 with backward
    d, t = 32, SEQ
    assert prof.layers[1].flops >= 3 * (2 * 12 * d * d * t + 4 * d * t * t)


def test_an_unknown_model_type_is_refused_with_the_known_ones():
    class Fake(nn.Module):
        config = type("C", (), {"model_type": "bert"})()

    with pytest.raises(AdapterError, match="'bert'.*gpt2, llama"):
        sequential(Fake())


def test_a_meta_llama_from_files_without_its_init_is_refused_naming_the_rotary_buffer(tmp_path):
    """The rotary embedding's ``inv_freq`` is in no file (not in the state_dict): without
    the model's init a node would run it with fresh storage's undefined contents."""
    from fedpipe.client.weights import package
    from fedpipe.runtime.materialize import MaterializeError

    _llama(dtype=torch.float32).save_pretrained(tmp_path)
    with torch.device("meta"):
        adapted = sequential(_llama(dtype=torch.float32))
    x, _ = _text_batches()[0]
    with pytest.raises(MaterializeError, match=r"layer 1 \(Block\).*rotary\.inv_freq.*init_fn="):
        package(adapted.layers, x, weights=tmp_path, names=adapted.names)
    code = package(adapted.layers, x, weights=tmp_path, names=adapted.names,
                   init_fn=adapted.init_fn)
    assert code.weights.source == "files"


def test_the_layers_record_their_ties_for_submits_default():
    # submit(ties=None) takes them, so weights=PATH without ties= still trains the tied model
    tied = sequential(_gpt2())
    assert getattr(tied.layers, TIES_ATTRIBUTE) == tied.tied_parameters
    assert tied.tied_parameters == [[(0, "tokens.weight"), (4, "lm_head.weight")]]
    untied = sequential(_llama(tie_word_embeddings=False))
    assert getattr(untied.layers, TIES_ATTRIBUTE) == [] == untied.tied_parameters
