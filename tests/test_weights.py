"""Layer weights in safetensors: sharded write, a stage's slice read back, digests, errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fedpipe.runtime.materialize import materialize, materialize_layers
from fedpipe.runtime.weights import (
    INDEX_NAME,
    ShardWriter,
    WeightFiles,
    WeightsError,
    check_weights,
    layer_digest,
    layer_tensors,
    load_layer,
    load_layers,
    save_layers,
)


def _model(meta: bool = False) -> nn.Sequential:
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                             nn.Linear(32, 4))
    if meta:
        with torch.device("meta"):
            return build()
    return build()


def test_a_sharded_directory_has_the_hugging_face_index_and_every_tensor(tmp_path):
    model = _model()
    save_layers(model, tmp_path, max_shard_bytes=1500)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in model.state_dict().values())
    with WeightFiles(tmp_path) as f:
        for key, t in model.state_dict().items():
            assert torch.equal(f.tensor(key), t)


def test_one_shard_is_a_single_model_file(tmp_path):
    save_layers(_model(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert sorted(WeightFiles(tmp_path).keys()) == sorted(_model().state_dict())


def test_a_stage_loads_only_its_layers_and_equals_the_saved_model(tmp_path):
    saved = _model()
    saved[1].running_mean.add_(3.0)  # a buffer travels too
    save_layers(saved, tmp_path, max_shard_bytes=1500)
    stage = materialize_layers(list(_model(meta=True)), [1, 3], seed=123)
    load_layers(tmp_path, {1: stage[0], 3: stage[1]})
    for got, i in zip(stage, (1, 3)):
        for key, t in saved[i].state_dict().items():
            assert torch.equal(got.state_dict()[key], t), (i, key)


def test_a_single_file_path_loads_too(tmp_path):
    file = tmp_path / "w.safetensors"
    save_file({f"{k}": v for k, v in _model().state_dict().items()}, str(file))
    whole = materialize(_model(meta=True), seed=1)
    load_layers(file, dict(enumerate(whole)))
    for key, t in _model().state_dict().items():
        assert torch.equal(whole.state_dict()[key], t)


def test_a_missing_tensor_names_the_layer_and_the_names_looked_for(tmp_path):
    state = _model().state_dict()
    del state["3.bias"]
    save_file(state, str(tmp_path / "w.safetensors"))
    with WeightFiles(tmp_path / "w.safetensors") as f:
        with pytest.raises(WeightsError, match=r"layer 3: no tensor for 'bias'.*'3.bias'"):
            check_weights(f, _model(meta=True))


def test_a_shape_mismatch_names_both_shapes(tmp_path):
    state = _model().state_dict()
    state["4.weight"] = torch.zeros(5, 32)
    save_file(state, str(tmp_path / "w.safetensors"))
    with WeightFiles(tmp_path / "w.safetensors") as f:
        with pytest.raises(WeightsError, match=r"layer 4: 'weight' has shape \(4, 32\) in the "
                                               r"model but '4.weight' has shape \(5, 32\)"):
            layer_tensors(f, 4, _model(meta=True)[4])


def test_not_a_weights_path_is_refused(tmp_path):
    with pytest.raises(WeightsError, match="not a safetensors file"):
        WeightFiles(tmp_path)


def test_load_layer_refuses_unexpected_and_missing_keys():
    layer = nn.Linear(2, 2)
    with pytest.raises(WeightsError, match="layer 5: unexpected tensor"):
        load_layer(layer, 5, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2),
                              "other": torch.zeros(1)})
    with pytest.raises(WeightsError, match="layer 5: no tensor for 'bias'"):
        load_layer(layer, 5, {"weight": torch.zeros(2, 2)})


def test_a_digest_from_the_files_equals_the_digest_of_the_loaded_layer(tmp_path):
    model = _model()
    save_layers(model, tmp_path, max_shard_bytes=1500)
    with WeightFiles(tmp_path) as f:
        from_files = [layer_digest(layer_tensors(f, i, layer)) for i, layer in enumerate(model)]
    assert from_files == [layer_digest(layer.state_dict()) for layer in model]
    assert len(set(from_files[:2])) == 2
    changed = _model()
    with torch.no_grad():
        changed[3].weight[0, 0] += 1e-3
    assert layer_digest(changed[3].state_dict()) != from_files[3]
    assert layer_digest(changed[0].state_dict()) == from_files[0]


def test_two_tensors_with_one_name_are_refused(tmp_path):
    with pytest.raises(WeightsError, match="a name already written"):
        save_layers(_model(), tmp_path, names=lambda i, k: (k,))


def test_layers_streamed_stage_by_stage_make_the_same_checkpoint(tmp_path):
    model = _model()
    save_layers(model, tmp_path / "whole", max_shard_bytes=1500)
    writer = ShardWriter(tmp_path / "streamed", max_shard_bytes=1500)
    for stage in ([3, 4], [0, 1, 2]):  # stages in any order, each layer once
        for i in stage:
            writer.add(i, {k: v.clone() for k, v in model[i].state_dict().items()})
    writer.close()
    assert not list((tmp_path / "streamed").glob("*.partial"))
    with WeightFiles(tmp_path / "whole") as a, WeightFiles(tmp_path / "streamed") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.keys())


@pytest.mark.parametrize("index, message", [
    ("{not json", "not a JSON object"),
    ("[]", "not a JSON object"),
    ("{}", 'no "weight_map"'),
    ('{"weight_map": {"0.weight": "gone.safetensors"}}', "gone.safetensors: not a readable"),
])
def test_a_broken_index_or_a_missing_shard_is_a_weights_error_naming_the_file(tmp_path, index,
                                                                              message):
    # were: JSONDecodeError, AttributeError, KeyError('weight_map') and FileNotFoundError
    # out of submit, the first three naming no file
    (tmp_path / INDEX_NAME).write_text(index)
    with pytest.raises(WeightsError, match=message):
        with WeightFiles(tmp_path) as files:
            check_weights(files, [nn.Linear(2, 2)])


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\""])
def test_a_file_that_is_not_safetensors_is_a_weights_error_naming_it(tmp_path, content):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(content)  # was: safetensors' SafetensorError, naming no file
    with pytest.raises(WeightsError, match="model.safetensors: not a readable safetensors"):
        WeightFiles(bad)
