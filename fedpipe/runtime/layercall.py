"""One child of a model run on what the child before it gave, as the client's profilers run
each (:func:`fedpipe.runtime.materialize.meta_profile` on the meta device,
:func:`fedpipe.client.profile.profile_model` for real): the one place that names a child
that cannot take its input, before any job is made.

A model whose sizes do not fit its data (64 features into an ``nn.Linear(32, ...)``)
fails deep inside torch; :class:`LayerInputError` says it in one paragraph: the child's
index, name and type, the shape and dtype it got and from where, what it expects when its
type says (:func:`expected_input`), and torch's own reason.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerInputError(ValueError):
    """A child of the model's ``nn.Sequential`` cannot take its input (the batch's inputs
    for child 0, the output of the child before it otherwise): the message names the
    child (index, name, type), the shape and dtype it got, what it expects when known,
    and torch's reason.

    Attributes:
        index: the child's index in the ``nn.Sequential``.
        shape: the shape of the input it got.
        expected: what its type says it takes (:func:`expected_input`), or None.
    """

    def __init__(self, message: str, index: int, shape: tuple[int, ...],
                 expected: str | None):
        super().__init__(message)
        self.index, self.shape, self.expected = index, shape, expected


def expected_input(layer: nn.Module) -> str | None:
    """What ``layer`` takes, in words, from its sizes (``(..., 32) (in_features=32)`` for
    ``nn.Linear(32, ...)``); None for a type that does not say (an activation, a custom
    module). Known: linear, convolution, normalization and embedding layers."""
    if isinstance(layer, nn.Linear) and layer.in_features:  # LazyLinear: 0 until it runs
        return f"(..., {layer.in_features}) (in_features={layer.in_features})"
    if isinstance(layer, nn.modules.conv._ConvNd) and layer.in_channels:
        return f"(N, {layer.in_channels}, ...) (in_channels={layer.in_channels})"
    if isinstance(layer, (nn.LayerNorm, nn.RMSNorm)) and layer.normalized_shape:
        last = ", ".join(map(str, layer.normalized_shape))
        return f"(..., {last}) (normalized_shape={tuple(layer.normalized_shape)})"
    if isinstance(layer, nn.modules.batchnorm._NormBase) and layer.num_features:
        return f"(N, {layer.num_features}, ...) (num_features={layer.num_features})"
    if isinstance(layer, nn.GroupNorm):
        return f"(N, {layer.num_channels}, ...) (num_channels={layer.num_channels})"
    if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        return (f"integer indices in 0..{layer.num_embeddings - 1} "
                f"(num_embeddings={layer.num_embeddings})")
    return None


def call_layer(layer: nn.Module, x: torch.Tensor, index: int, name: str = "") -> torch.Tensor:
    """``layer(x)``, for child ``index`` (named ``name`` in its ``nn.Sequential``, if not
    its index) of a model: its output, checked to be one tensor.

    Raises:
        LayerInputError: the layer failed on ``x`` (torch's RuntimeError, ValueError or
            IndexError: a shape, dtype or index it cannot take), raised without torch's
            chain of internals.
        TypeError: its output is not a single tensor (naming the layer).
        NotImplementedError: an operator with no kernel for ``x``'s device (on meta:
            the caller may run the layer for real instead).
    """
    kind = type(layer).__name__
    what = f"layer {index}" + (f" {name!r}" if name and name != str(index) else "") + f" ({kind})"
    try:
        y = layer(x)
    except NotImplementedError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        shape = tuple(x.shape)
        expected = expected_input(layer)
        source = "the batch's inputs" if index == 0 else f"layer {index - 1}'s output"
        dtype = str(x.dtype).removeprefix("torch.")
        raise LayerInputError(
            f"{what} cannot take its input, a {dtype} tensor of shape {shape} ({source})"
            + (f": it expects {expected}" if expected else "") + f"; torch says: {reason}. "
            f"Each child of the nn.Sequential takes the output of the one before it (the "
            f"first takes the batch's inputs, whose first dimension is the samples): check "
            f"this layer's sizes against what comes in.", index, shape, expected) from None
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{what} returned {type(y).__name__}, not a single tensor: each child "
                        "of the nn.Sequential must map one tensor to one tensor")
    return y
