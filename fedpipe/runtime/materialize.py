"""Layers built on the meta device: make their weights, check them, profile them.

A model too big for the client is built under ``torch.device("meta")``: every
parameter and buffer has a shape and a dtype but no storage. Each node then
makes only its own layers, the PyTorch idiom that FSDP2 and
``torch.distributed.pipelining`` use: ``to_empty(device)`` (storage, contents
undefined) and then ``reset_parameters()`` on every submodule that has one.

What is fedpipe's own is the seeding. Layer ``i`` of a job seeded ``s`` is
initialized from :func:`layer_seed` ``(s, i)`` alone, with the global RNG forked
so nothing outside sees it, and always on the CPU (a CUDA generator draws other
numbers), then moved. So a node that makes layers 2..3 alone makes exactly the
weights that :func:`materialize` makes for the whole model in one process, and
training can be compared with single-process training bit for bit.

Order within a layer: submodules children-first (as Hugging Face's
``initialize_weights`` does), so a parent's reset (``nn.MultiheadAttention``
zeroes its ``out_proj.bias``) has the last word, as it has in eager construction;
then the job's ``init_fn(layer, index, generator)`` if any, for other schemes
(GPT-2's scaled init: :func:`fedpipe.hf.init_fn`).

Tied copies (the input embedding and the head of a language model on two stages,
as Megatron-LM keeps them): a later copy is made equal to its source by
initializing the source's layer with the source's seed and copying, so the head's
node needs no message from the embedding's node.

:func:`uninitializable` runs the same initialization on the meta device and
records which tensors it writes: a parameter or buffer that nothing writes (an
``nn.Parameter`` registered directly on a custom module without a
``reset_parameters``) would train from uninitialized memory, and is refused at
submit. :func:`meta_profile` gives the planner its per-layer costs without one
weight allocated, with ``torch.utils.flop_counter`` on meta tensors.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..planner.types import LayerProfile, ModelProfile, row_width
from .layercall import call_layer

InitFn = Callable[[nn.Module, int, torch.Generator], None]
"""``init_fn(layer, layer_index, generator)``: initializes ``layer`` in place (its tensors
already have storage; run under ``torch.no_grad()``), drawing from ``generator`` (a CPU
generator seeded from the job's seed and ``layer_index``) or from the global RNG, which
is forked and seeded the same way."""

TiedGroup = Sequence[tuple[int, str]]
"""Copies of one tied parameter: ``(layer index, parameter name in that layer)``; the
first (lowest layer) is the source the others are initialized from."""
TIES_ATTRIBUTE = "fedpipe_ties"
"""The attribute of an ``nn.Sequential`` that records its ties (:data:`TiedGroup` list), as
:func:`fedpipe.hf.sequential` sets it: ``submit`` keeps them tied when not told otherwise."""

# torch modules whose initializer is private: without it their own parameters
# (``in_proj_weight``) would stay uninitialized on a meta model.
_PRIVATE_RESETS: dict[type, str] = {nn.MultiheadAttention: "_reset_parameters"}

# Layers the FLOP counter sees no work in (activations, reshapes) still touch every
# output element forward and backward: the floor :func:`meta_profile` charges,
# FLOP per output element (fedpipe.client.profile uses the same rule).
ELEMENTWISE_FLOPS = 3


class MaterializeError(ValueError):
    """A meta layer cannot be made: the message names the layer and the tensor."""


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index`` in a job seeded ``seed``: 63 bits of
    sha256("fedpipe-layer:{seed}:{index}"), the same on every machine and Python."""
    digest = hashlib.sha256(f"fedpipe-layer:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def children_first(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules, each after its children (post-order)."""
    for child in module.children():
        yield from children_first(child)
    yield module


def _reset_module(module: nn.Module) -> None:
    private = _PRIVATE_RESETS.get(type(module))
    reset = getattr(module, private or "reset_parameters", None)
    if callable(reset):
        reset()
    elif callable(getattr(module, "reset_running_stats", None)):
        module.reset_running_stats()  # type: ignore[operator]


def initialize(layer: nn.Module, index: int, seed: int, init_fn: InitFn | None = None) -> None:
    """Initialize ``layer`` (layer ``index`` of a job seeded ``seed``) in place, on the
    device its tensors are on: every submodule's ``reset_parameters()`` children first,
    then ``init_fn``. The global RNG is forked (CPU only) and seeded with
    :func:`layer_seed`; ``init_fn`` gets a CPU generator seeded the same. Equal
    arguments give equal weights on the CPU; elsewhere the device's own RNG may be
    drawn, which is why :func:`materialize_layer` initializes on the CPU."""
    s = layer_seed(seed, index)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(s)
        for module in children_first(layer):
            _reset_module(module)
        if init_fn is not None:
            init_fn(layer, index, torch.Generator().manual_seed(s))


def _tensor_names(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from layer.named_parameters()
    yield from layer.named_buffers()


def _source_tensor(layer: nn.Module, name: str, index: int) -> torch.Tensor:
    found = dict(_tensor_names(layer)).get(name)
    if found is None:
        raise MaterializeError(f"layer {index} has no parameter or buffer {name!r} "
                               "(named in a tied group)")
    return found


def _tie_sources(ties: Sequence[TiedGroup]) -> dict[tuple[int, str], tuple[int, str]]:
    """Each tied copy after the first -> the first of its group."""
    out: dict[tuple[int, str], tuple[int, str]] = {}
    for group in ties:
        first, *rest = sorted(group)
        out.update((member, first) for member in rest)
    return out


def materialize_layer(layer: nn.Module, index: int, seed: int, device: torch.device | str = "cpu",
                      init_fn: InitFn | None = None) -> nn.Module:
    """Give meta layer ``index`` storage on ``device`` and initialize it from
    ``(seed, index)``: ``to_empty`` on the CPU, :func:`initialize`, then moved to
    ``device``. Works in place on ``layer`` and returns it (a layer already off the
    meta device is left alone and returned: it has its weights)."""
    if not any(t.is_meta for _, t in _tensor_names(layer)):
        return layer.to(device)
    layer.to_empty(device="cpu")
    initialize(layer, index, seed, init_fn)
    return layer.to(device)


Layers = Mapping[int, nn.Module] | Sequence[nn.Module]
"""Meta layers by global layer index: the whole model, or a node's own layers plus the
sources of its tied copies (``{index: layer}``)."""


def materialize_layers(layers: Layers, indices: Sequence[int], seed: int,
                       device: torch.device | str = "cpu", init_fn: InitFn | None = None,
                       ties: Sequence[TiedGroup] = ()) -> list[nn.Module]:
    """What a node calls for its stage: layers ``indices`` of the meta model ``layers``
    (the whole model, or a mapping holding at least ``indices`` and the sources of their
    tied copies), made on ``device`` (:func:`materialize_layer`), in place, returned in
    order.

    A tied copy whose source is in another layer is set to the source's value: the
    source's layer is initialized with its own seed (a temporary copy when it is not
    among ``indices``), so every copy starts equal wherever it lives.

    Raises:
        MaterializeError: a tied group names a tensor a layer does not have.
    """
    made = {i: materialize_layer(layers[i], i, seed, device, init_fn) for i in indices}
    scratch: dict[int, nn.Module] = {}
    for (layer, name), (src_layer, src_name) in _tie_sources(ties).items():
        if layer not in made:
            continue
        if src_layer not in made and src_layer not in scratch:
            scratch[src_layer] = materialize_layer(copy.deepcopy(layers[src_layer]), src_layer,
                                                   seed, "cpu", init_fn)
        source = made.get(src_layer, scratch.get(src_layer))
        assert source is not None
        with torch.no_grad():
            _source_tensor(made[layer], name, layer).copy_(
                _source_tensor(source, src_name, src_layer))
    return [made[i] for i in indices]


def materialize(model: nn.Sequential, seed: int, init_fn: InitFn | None = None,
                device: torch.device | str = "cpu", ties: Sequence[TiedGroup] = ()
                ) -> nn.Sequential:
    """``fedpipe.materialize``: the whole meta model made in one process, in place and
    returned, with exactly the weights each node makes for its own layers (the
    single-process reference for a meta job).

    Raises:
        MaterializeError: as :func:`materialize_layers`.
    """
    materialize_layers(list(model), range(len(model)), seed, device, init_fn, ties)
    return model


class _WriteRecorder(TorchDispatchMode):
    """Records the storages every mutating aten op writes (``uniform_``, ``copy_``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for arg in (*args[:1], kwargs.get("out")):
                if isinstance(arg, torch.Tensor):
                    self.written.add(arg.untyped_storage()._cdata)
        return func(*args, **kwargs)


def uninitializable(model: Sequence[nn.Module], init_fn: InitFn | None = None,
                    ties: Sequence[TiedGroup] = ()) -> list[tuple[int, str]]:
    """Parameters and buffers of a meta model that materialization would leave
    uninitialized: ``(layer index, qualified name)`` in order, empty when all are made.

    Runs :func:`initialize` on a meta copy of each layer (no storage: cheap) and
    records which tensors it writes. Tied copies after the first are covered by
    their source. Layers already off the meta device are skipped (they have weights).

    Raises:
        MaterializeError: the initialization itself fails on the meta device (a
            data-dependent ``reset_parameters``), naming the layer.
    """
    covered_by_tie = set(_tie_sources(ties))
    missing: list[tuple[int, str]] = []
    for i, layer in enumerate(model):
        if not any(t.is_meta for _, t in _tensor_names(layer)):
            continue
        probe = copy.deepcopy(layer)
        recorder = _WriteRecorder()
        try:
            with recorder:
                initialize(probe, i, 0, init_fn)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            raise MaterializeError(f"layer {i} ({type(layer).__name__}) cannot be initialized "
                                   f"on the meta device: {e}") from e
        missing.extend((i, name) for name, t in _tensor_names(probe)
                       if t.untyped_storage()._cdata not in recorder.written
                       and (i, name) not in covered_by_tie)
    return missing


def check_initializable(model: Sequence[nn.Module], init_fn: InitFn | None = None,
                        ties: Sequence[TiedGroup] = ()) -> None:
    """Raise :class:`MaterializeError` naming the first layer whose tensors nothing
    initializes (all of that layer's, and how many more there are): the submit check."""
    missing = uninitializable(model, init_fn, ties)
    if not missing:
        return
    layer = missing[0][0]
    names = [n for i, n in missing if i == layer]
    raise MaterializeError(
        f"layer {layer} ({type(model[layer]).__name__}) has {len(names)} tensor(s) that "
        f"nothing initializes on the meta device: {', '.join(names)}"
        + (f" (and {len(missing) - len(names)} in later layers)" if len(missing) > len(names)
           else "")
        + "; give the module a reset_parameters(), pass init_fn=, or build it with weights")


def shared_across_layers(model: Sequence[nn.Module]
                         ) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Parameters registered in two different layers (one tensor, two stages):
    ``((first layer, name), (later layer, name))`` pairs. Such sharing cannot span
    stages; a supported tie keeps two copies instead (:mod:`fedpipe.hf`)."""
    first_seen: dict[int, tuple[int, str]] = {}
    pairs = []
    for i, layer in enumerate(model):
        for name, p in layer.named_parameters():
            seen = first_seen.setdefault(id(p), (i, name))
            if seen[0] != i:
                pairs.append((seen, (i, name)))
    return pairs


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _layer_flops(layer: nn.Module, x: torch.Tensor, i: int, name: str
                 ) -> tuple[torch.Tensor, float]:
    """Forward + backward FLOP of one layer (child ``i``, named ``name``) on meta input
    ``x`` and its output. Runs a copy (cheap on meta), so no ``.grad`` is left on the
    model."""
    layer = copy.deepcopy(layer)
    counter = FlopCounterMode(display=False)
    with counter:
        y = call_layer(layer, x, i, name)
        if y.requires_grad:
            y.backward(torch.ones_like(y))
    return y, float(max(counter.get_total_flops(), ELEMENTWISE_FLOPS * y.numel()))


def meta_profile(model: Sequence[nn.Module], sample: torch.Tensor,
                 names: Sequence[str] = ()) -> ModelProfile:
    """The planner's per-layer costs of a meta model, allocating no weights.

    Args:
        model: the layers, on the meta device.
        sample: a batch (first dim = samples), on any device: only its shape and
            dtype are used (token ids' values do not matter on meta).
        names: the layers' names in their ``nn.Sequential`` (for errors; default: those
            of ``model`` if it is one, else their indices).

    Returns:
        a :class:`~fedpipe.planner.types.ModelProfile`: per layer forward + backward
        FLOP per sample (at least :data:`ELEMENTWISE_FLOPS` per output element),
        output activation bytes per sample and width (its last dimension,
        :func:`~fedpipe.planner.types.row_width`) and parameter bytes; ``element_bytes``
        of the last floating-point activation.

    Raises:
        LayerInputError: a layer cannot take its input (a shape that does not fit:
            the message names the layer, the shape it got and what it expects).
        TypeError: a layer's output is not a single tensor (naming the layer).
        MaterializeError: a layer has tensors off the meta device.
        NotImplementedError: an operator with no meta kernel.
    """
    if not names and isinstance(model, nn.Sequential):
        names = [name for name, _ in model.named_children()]
    n = sample.shape[0] if sample.dim() else 1
    x = torch.empty_like(sample, device="meta")
    layers, element_bytes = [], 4
    for i, layer in enumerate(model):
        off_meta = [name for name, t in _tensor_names(layer) if not t.is_meta]
        if off_meta:
            raise MaterializeError(f"layer {i} has tensors off the meta device: {off_meta[0]}")
        x = x.detach().requires_grad_(x.is_floating_point())
        y, flops = _layer_flops(layer, x, i, names[i] if names else "")
        if y.is_floating_point():
            element_bytes = y.element_size()
        layers.append(LayerProfile(name=f"{i}:{type(layer).__name__}", flops=flops / n,
                                   activation_bytes=_nbytes(y) // n,
                                   parameter_bytes=sum(_nbytes(p) for p in layer.parameters()),
                                   activation_width=row_width(y.shape)))
        x = y
    return ModelProfile(layers=layers, input_bytes=_nbytes(sample) // n,
                        element_bytes=element_bytes)


def sum_tied_gradients(layers: Layers, ties: Sequence[TiedGroup]) -> None:
    """Give every copy of a tied parameter the sum of the copies' gradients (a copy
    without a gradient counts as zero), in place, before the optimizer step: each copy
    then moves as the one tied parameter would, so the copies stay equal (Megatron-LM's
    embedding all-reduce, here in one process; across stages it is an all-reduce of
    these gradients between the copies' nodes). A gradient clip must count a group
    once."""
    for group in ties:
        params = [_source_tensor(layers[i], name, i) for i, name in group]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            continue
        total = torch.stack(grads).sum(0)
        for p in params:
            p.grad = total.clone()


def norm_parameters(layers: Mapping[int, nn.Module], ties: Sequence[TiedGroup]
                    ) -> list[nn.Parameter]:
    """The parameters of ``layers`` (a stage's, by global index) that count in a global
    gradient norm: a tied group counts once, at its source (the copies' gradients are
    equal after :func:`sum_tied_gradients`), so the stages' sums of squares add up to
    the tied model's norm."""
    copies = set(_tie_sources(ties))
    return [p for i, layer in layers.items() for name, p in layer.named_parameters()
            if (i, name) not in copies]
