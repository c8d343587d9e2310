"""A model whose sizes do not fit its data is refused at submit in one paragraph naming the
layer, in-process: ``Client.submit`` profiles the model before any call, so a client of a
tracker that does not exist reaches the check (no swarm, no process)."""
from __future__ import annotations

import traceback
from collections import OrderedDict

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client import Client, LayerInputError
from fedpipe.client.profile import profile_model
from fedpipe.runtime.layercall import expected_input
from fedpipe.runtime.materialize import meta_profile

pytestmark = pytest.mark.timeout(60)

NOWHERE = "127.0.0.1:1"
"""A tracker address no call reaches: submit must fail before it calls."""


def _submit(model: nn.Sequential, features: int = 64) -> LayerInputError:
    data = [(torch.rand(8, features), torch.randint(0, 10, (8,)))]  # digits: 64 features
    with Client(NOWHERE) as client, pytest.raises(LayerInputError) as caught:
        client.submit(model, nn.functional.cross_entropy,
                      fedpipe.optimizer(torch.optim.SGD, lr=0.1), data, steps=1)
    return caught.value


def _unchained(e: BaseException) -> str:
    text = "".join(traceback.format_exception(e))
    assert "During handling of the above exception" not in text
    assert "direct cause of the following exception" not in text
    return text


def test_digits_into_a_first_linear_of_32_is_refused_naming_the_layer_and_both_shapes():
    # was a 98-line traceback: torch's meta error, then "During handling ...", the real one
    e = _submit(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
    assert str(e).startswith(
        "layer 0 (Linear) cannot take its input, a float32 tensor of shape (8, 64) (the "
        "batch's inputs): it expects (..., 32) (in_features=32); torch says: mat1 and mat2 "
        "shapes cannot be multiplied (8x64 and 32x64). ")
    assert (e.index, e.shape, e.expected) == (0, (8, 64), "(..., 32) (in_features=32)")
    assert isinstance(e, ValueError)
    assert len(_unchained(e).splitlines()) < 30


def test_a_named_layer_deeper_in_is_named_with_where_its_input_came_from():
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(64, 16), act=nn.ReLU(),
                                      fc2=nn.Linear(32, 10)))
    e = _submit(model)
    assert str(e).startswith("layer 2 'fc2' (Linear) cannot take its input, a float32 tensor "
                             "of shape (8, 16) (layer 1's output): it expects (..., 32)")
    _unchained(e)


def test_a_meta_model_is_refused_the_same_way_without_running_for_real():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 16), nn.LayerNorm(8))
    e = _submit(model)
    assert str(e).startswith("layer 1 (LayerNorm) cannot take its input, a float32 tensor of "
                             "shape (8, 16) (layer 0's output): it expects (..., 8) "
                             "(normalized_shape=(8,)); torch says: ")
    _unchained(e)


def test_both_profilers_raise_it_and_a_layer_of_no_known_sizes_gives_torchs_reason_alone():
    class Square(nn.Module):
        def forward(self, x):
            return x @ x

    real = nn.Sequential(nn.Linear(4, 3), Square())
    for profile in (profile_model, meta_profile):
        model = real if profile is profile_model else real.to("meta")
        with pytest.raises(LayerInputError) as caught:
            profile(model, torch.zeros(2, 4))
        assert str(caught.value).startswith(
            "layer 1 (Square) cannot take its input, a float32 tensor of shape (2, 3) "
            "(layer 0's output); torch says: ")
        assert caught.value.expected is None


@pytest.mark.parametrize("layer,expected", [
    (nn.Conv2d(3, 8, 3), "(N, 3, ...) (in_channels=3)"),
    (nn.BatchNorm1d(5), "(N, 5, ...) (num_features=5)"),
    (nn.GroupNorm(2, 6), "(N, 6, ...) (num_channels=6)"),
    (nn.Embedding(50, 4), "integer indices in 0..49 (num_embeddings=50)"),
    (nn.LazyLinear(3), None), (nn.ReLU(), None)])
def test_what_a_layer_expects_comes_from_its_sizes(layer, expected):
    assert expected_input(layer) == expected
