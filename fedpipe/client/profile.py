"""Per-layer profile of a model: FLOPs, activation and parameter bytes."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..planner.types import row_width
from ..proto import tracker_pb2
from ..runtime.layercall import call_layer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile_model(model: nn.Sequential, sample: torch.Tensor) -> tracker_pb2.ModelProfile:
    """Run ``sample`` (a batch, first dim = samples) through each layer once.

    FLOPs come from ``torch.utils.flop_counter`` over forward and backward;
    layers it does not count (activations, reshapes) get three FLOP per output
    element (forward and backward elementwise work). Per-sample figures divide
    by the sample's batch size. Runs on a copy, so the model's gradients and
    buffers (e.g. BatchNorm statistics) are left as they were.

    Returns:
        a ModelProfile: per layer forward+backward FLOP per sample, output
        activation bytes per sample and width (:func:`fedpipe.planner.types.row_width`),
        parameter bytes.

    Raises:
        LayerInputError: a layer cannot take its input (a shape that does not fit:
            the message names the layer, the shape it got and what it expects).
        TypeError: a layer's output is not a single tensor (the message names the layer).
    """
    n = sample.shape[0] if sample.dim() else 1
    prof = tracker_pb2.ModelProfile(input_bytes=_nbytes(sample) // n)
    x = sample
    for i, (name, layer) in enumerate(copy.deepcopy(model).named_children()):
        x = x.detach().requires_grad_(x.is_floating_point())
        counter = FlopCounterMode(display=False)
        with counter:
            y = call_layer(layer, x, i, name)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
        flops = max(counter.get_total_flops(), 3 * y.numel())
        prof.layers.append(tracker_pb2.LayerProfile(
            name=f"{i}:{type(layer).__name__}", flops=flops / n,
            activation_bytes=_nbytes(y) // n, activation_width=row_width(y.shape),
            parameter_bytes=sum(_nbytes(p) for p in layer.parameters())))
        x = y
    return prof


def profile_json(model: nn.Sequential, sample: torch.Tensor) -> dict:
    """The profile of :func:`profile_model` as the JSON object ``fedpipe plan --model`` reads."""
    prof = profile_model(model, sample)
    return {"input_bytes": prof.input_bytes,
            "layers": [{"name": la.name, "flops": la.flops, "activation_bytes": la.activation_bytes,
                        "parameter_bytes": la.parameter_bytes,
                        "activation_width": la.activation_width} for la in prof.layers]}
