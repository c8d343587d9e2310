"""Saves written a stage at a time (issue 22, item 6): each stage's snapshot goes to its
own safetensors shard, in the Hugging Face layout, so the client never holds the whole
model; a model from :func:`fedpipe.hf.sequential` saves under the original model's names,
with its ``config.json``, and ``transformers``' ``from_pretrained`` loads it back.

In-process: the stages are the real fedpipe parts (layers, AdamW, layout) snapshotted as a
node snapshots them (:func:`fedpipe.runtime.checkpoint.take`), written by the real writer.
The swarm test (a meta job trained over 3 nodes, then ``job.save``) is in
tests/test_bigmodel_hf.py."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fedpipe.client import checkpoints
from fedpipe.hf import checkpoint_names, lm_loss, sequential
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint
from fedpipe.runtime.layerstate import Layout
from fedpipe.runtime.materialize import sum_tied_gradients
from fedpipe.runtime.weights import INDEX_NAME, WeightFiles, WeightsError
from fedpipe.spec import StageKey

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB, SEQ = 256, 16


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                      embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0))


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _stages(layers: nn.Sequential, bounds: list[int]) -> tuple[node_pb2.Plan, list]:
    """The plan of stages [bounds[k], bounds[k+1]) and each stage's parts (its layers, AdamW
    over them, its layout), after one training step of the whole model."""
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=k, layer_start=a, layer_end=b, address=f"n{k}:1")
        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        module = nn.Sequential(*layers[a:b])
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        parts.append({"module": module, "optimizer": opt, "layers": Layout(module, a)})
    return plan, parts


def _step(layers: nn.Sequential, parts: list, ties) -> None:
    x = _tokens()
    lm_loss(layers(x), x).backward()
    sum_tied_gradients(layers, ties)
    for p in parts:
        p["optimizer"].step()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_save_from_stages_loads_into_the_original_architecture(build, tmp_path):
    adapted = sequential(build())
    layers, ties = adapted.layers, adapted.tied_parameters
    plan, parts = _stages(layers, [0, 2, 4, len(layers)])
    _step(layers, parts, ties)
    names, config = checkpoint_names(layers)
    copies = {m for group in ties for m in group[1:]}
    pulled = []

    def snapshots():  # what Job.save pulls: one stage after the other
        for k, p in enumerate(parts):
            pulled.append(k)
            yield StageKey(0, k), checkpoint.take(p, 1)

    folder = checkpoints.write(tmp_path / "saved", 1, snapshots(), plan, steps=5,
                               names=names, skip=lambda i, key: (i, key) in copies,
                               model_config=config)
    assert pulled == [0, 1, 2]
    index = json.loads((folder / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert (folder / "config.json").is_file()
    files = WeightFiles(folder)
    assert ("lm_head.weight" in files) == (not ties)  # a tied head is stored once
    assert not any(n.startswith(("optimizer", "module")) for n in files.keys())
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is type(build())
    layers.eval()
    x = _tokens()
    torch.testing.assert_close(loaded(x).logits, layers(x), rtol=0, atol=1e-5)
    assert not torch.allclose(build().eval()(x).logits, layers(x))  # the trained weights

    saved = checkpoints.read(folder)  # resume_from reads it back, bit for bit
    for k, p in enumerate(parts):
        want = checkpoint.take(p, 1)
        got = saved.snapshots[StageKey(0, k)]
        assert set(got.tensors) == set(want.tensors)
        assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
        assert got.skeleton == want.skeleton


def test_a_plain_sequential_saves_under_its_own_names_and_keeps_a_tied_copy_in_its_state(
        tmp_path):
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    plan, parts = _stages(layers, [0, 1, 3])
    snaps = {StageKey(0, k): checkpoint.take(p, 0) for k, p in enumerate(parts)}
    folder = checkpoints.write(tmp_path / "one", 0, snaps, plan, steps=2,
                               skip=lambda i, key: (i, key) == (2, "bias"))
    files = WeightFiles(folder)
    assert sorted(files.keys()) == ["0.bias", "0.weight", "2.weight"]
    assert torch.equal(files.tensor("2.weight"), layers[2].weight)
    again = checkpoints.read(folder).snapshots[StageKey(0, 1)]
    assert torch.equal(again.tensors["module/1.bias"], layers[2].bias)
    assert not (folder / "config.json").exists()


def test_two_layers_saved_under_one_name_are_refused_naming_it(tmp_path):
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan, parts = _stages(layers, [0, 1, 2])
    snaps = {StageKey(0, k): checkpoint.take(p, 0) for k, p in enumerate(parts)}
    with pytest.raises(WeightsError, match=r"'same\.(weight|bias)', a name already written"):
        checkpoints.write(tmp_path, 0, snaps, plan, steps=1,
                          names=lambda i, key: (f"same.{key}",))
    assert not (tmp_path / checkpoints.META).exists()  # nothing marked complete
