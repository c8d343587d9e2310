"""What a client sends of a model: code to the tracker, weights straight to the nodes.

A job's layers go to the tracker as code only: each layer pickled with its
``state_dict`` tensors on the meta device, a few KiB a layer, whatever the model's
size (issue 22). Where the weights come from (:class:`~fedpipe.spec.WeightsSpec`):

- a model built under ``torch.device("meta")``: each node makes its own layers from
  the job's ``seed`` (and ``init_fn``), exactly as ``fedpipe.materialize(model, seed)``
  does in one process. A layer with a tensor nothing initializes is refused here,
  named (:func:`~fedpipe.runtime.materialize.check_initializable`);
- ``weights=PATH`` (a safetensors file or a Hugging Face sharded directory): names
  and shapes are checked against the model here, reading only headers; each node
  reads its own layers' tensors from PATH if it can, else the client streams them;
- a model with its weights (the API before meta jobs): the client streams each
  stage's layers to that stage's node (``PutWeights``: over the socket data plane to a
  node that offers a data port, :func:`fedpipe.runtime.weights_link.send_weights`;
  over gRPC otherwise, :class:`~.feed.ChannelNodes` chooses).

The job's config carries each layer's weight digest
(:func:`~fedpipe.runtime.weights.layer_digest`, signed with the job under TLS); a
node checks what it loads against it. :class:`WeightStreamer` streams every stage
of a plan epoch that starts from the job's start (the first deploy, and a recovery
before the first checkpoint: the client still holds the model or can read PATH, so
the tracker never needs a weight); a stage that has its weights answers
ALREADY_EXISTS and is skipped.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import torch
from torch import nn

from ..planner.types import ModelProfile
from ..proto import node_pb2, tracker_pb2
from ..runtime.layercall import LayerInputError
from ..runtime.materialize import (InitFn, MaterializeError, TiedGroup, check_initializable,
                                   meta_profile, shared_across_layers, uninitializable)
from ..runtime.weights import (KeyMap, WeightFiles, check_weights, layer_digest, layer_tensors,
                               sequential_keys)
from ..spec import PlanView, StageKey, WeightsSpec
from ..wire import frames
from .packaging import dumps
from .profile import profile_model

TensorsOf = Callable[[int], Mapping[str, torch.Tensor]]
"""Layer index -> its ``state_dict`` tensors (what a node loads)."""


@dataclass(frozen=True)
class ModelCode:
    """A model as a job sends it.

    Attributes:
        layers: each layer cloudpickled with its state_dict on the meta device.
        weights: where the nodes get the weights.
        profile: the planner's per-layer costs.
        tensors: a layer's tensors for streaming (None: every node makes its own).
    """

    layers: list[bytes]
    weights: WeightsSpec
    profile: tracker_pb2.ModelProfile
    tensors: TensorsOf | None


def _on_meta(layer: nn.Module) -> list[bool]:
    return [t.is_meta for t in (*layer.parameters(), *layer.buffers())]


def meta_copy(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` whose state_dict tensors are on the meta device (sharing kept);
    its other buffers keep their values. The layer itself is not touched."""
    memo: dict[int, object] = {}
    for t in layer.state_dict(keep_vars=True).values():
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(layer, memo)


def profile_message(p: ModelProfile) -> tracker_pb2.ModelProfile:
    """The planner's profile as the tracker takes it."""
    return tracker_pb2.ModelProfile(input_bytes=p.input_bytes, layers=[
        tracker_pb2.LayerProfile(name=x.name, flops=x.flops, activation_bytes=x.activation_bytes,
                                 parameter_bytes=x.parameter_bytes,
                                 activation_width=x.activation_width) for x in p.layers])


def package(model: nn.Sequential, sample: torch.Tensor, *, seed: int = 0,
            init_fn: InitFn | None = None, weights: str | os.PathLike | None = None,
            names: KeyMap | None = None, ties: Sequence[TiedGroup] = ()) -> ModelCode:
    """The job's code, weight source and profile for ``model`` (see the module docstring).

    Args:
        model: the layers; all on the meta device, or all with their weights.
        sample: a batch of inputs (its shape and dtype profile a meta model).
        seed, init_fn: a meta model's initialization (without ``weights``).
        weights: a safetensors file or sharded directory the weights start from.
        names: the file's names for each layer's tensors (default: ``"3.weight"``).
        ties: tied parameters, ``(layer, name)`` copies a group, the first the source
            (:attr:`fedpipe.hf.HFLayers.tied_parameters`).

    Raises:
        LayerInputError: a layer cannot take ``sample`` or the output of the layer before
            it (naming the layer, the shape it got and what it expects).
        TypeError: some layers on the meta device and others not (naming the first).
        MaterializeError: a meta layer's tensor nothing initializes, named; or a
            parameter shared by two layers that no tie names (naming both).
        WeightsError: the files lack a tensor of a layer, or hold another shape.
    """
    meta = [_on_meta(layer) for layer in model]
    on_meta = [any(m) for m in meta]
    if any(on_meta):  # then every layer with tensors must have them all on meta
        for i, m in enumerate(meta):
            if m and not all(m):
                raise TypeError(f"layer {i} ({type(model[i]).__name__}) has tensors off the "
                                "meta device while others are on it: build the whole model "
                                "under torch.device('meta'), or with its weights")
    tied = {member for group in ties for member in group}
    for first, later in shared_across_layers(list(model)):
        if first not in tied or later not in tied:
            raise MaterializeError(
                f"layer {first[0]}'s {first[1]!r} is also layer {later[0]}'s {later[1]!r}: "
                "one tensor cannot span two stages; keep a copy in each and name them a tie "
                "(ties=), as fedpipe.hf.sequential does")
    groups = tuple(tuple(sorted(group)) for group in ties)  # the source first
    keys = names or sequential_keys
    if weights is not None:
        path = Path(weights).resolve()
        code = [meta_copy(layer) for layer in model] if not any(on_meta) else list(model)
        if any(on_meta):
            _check_outside_files(code, init_fn, groups)
        with WeightFiles(path) as files:
            check_weights(files, code, keys)
        digests = tuple(_file_digest(path, i, layer, keys) for i, layer in enumerate(code))
        spec = WeightsSpec(source="files", path=str(path), digests=digests,
                           names=dumps(names) if names is not None else b"", seed=seed,
                           init_fn=dumps(init_fn) if init_fn is not None else b"",
                           ties=groups, tie_sources=_tie_sources(code, groups))

        def from_files(i: int) -> Mapping[str, torch.Tensor]:
            with WeightFiles(path) as files:
                return layer_tensors(files, i, code[i], keys)
        return ModelCode([dumps(layer) for layer in code], spec,
                         profile_message(meta_profile(_meta_only(code), sample, _names(model))),
                         from_files)
    if any(on_meta):
        check_initializable(list(model), init_fn, groups)
        spec = WeightsSpec(source="seed", seed=seed,
                           init_fn=dumps(init_fn) if init_fn is not None else b"",
                           ties=groups, tie_sources=_tie_sources(list(model), groups))
        return ModelCode([dumps(layer) for layer in model], spec,
                         profile_message(meta_profile(list(model), sample, _names(model))),
                         None)
    code = [meta_copy(layer) for layer in model]
    spec = WeightsSpec(source="stream", ties=groups, seed=seed,
                       digests=tuple(layer_digest(layer.state_dict()) for layer in model))
    return ModelCode([dumps(layer) for layer in code], spec, _profile(model, code, sample),
                     streamed(model))


def _file_digest(path: Path, index: int, layer: nn.Module, names: KeyMap) -> str:
    """Layer ``index``'s weight digest, read from the files at ``path`` with handles of its
    own: closing them unmaps the shards, so the client's memory holds one layer's tensors
    and pages at a time, not every shard it has read (a 300 M-parameter model's 1.2 GB)."""
    with WeightFiles(path) as files:
        return layer_digest(layer_tensors(files, index, layer, names))


def _check_outside_files(layers: Sequence[nn.Module], init_fn: InitFn | None,
                         ties: Sequence[TiedGroup]) -> None:
    """Refuse a meta model started from files that has tensors no file holds (buffers
    outside its ``state_dict``, as a rotary embedding's ``inv_freq``) and nothing
    initializes: a node would run them with the undefined contents of fresh storage.

    Raises:
        MaterializeError: naming the first such layer and tensors.
    """
    missing = [(i, name) for i, name in uninitializable(layers, init_fn, ties)
               if name not in layers[i].state_dict()]
    if missing:
        layer = missing[0][0]
        names = ", ".join(n for i, n in missing if i == layer)
        raise MaterializeError(
            f"layer {layer} ({type(layers[layer]).__name__}) has tensor(s) that no weights "
            f"file holds (not in its state_dict) and nothing initializes on the meta device: "
            f"{names}; pass init_fn= (fedpipe.hf.sequential(...).init_fn for a transformers "
            f"model), or give the module a reset_parameters()")


def streamed(model: nn.Sequential) -> TensorsOf:
    """A model's layers' tensors, as a :class:`WeightStreamer` streams them."""
    return lambda i: model[i].state_dict()


def _profile(model: nn.Sequential, code: list[nn.Module], sample: torch.Tensor
             ) -> tracker_pb2.ModelProfile:
    """A model's profile, on meta tensors where its layers run there (no copy of the
    weights: the same FLOP and bytes, shapes being all they depend on), else on a copy."""
    try:
        return profile_message(meta_profile(_meta_only(code), sample, _names(model)))
    except (RuntimeError, NotImplementedError, MaterializeError, LayerInputError):
        pass  # a layer makes a CPU tensor of its own, say: run it for real, whose error
        # (a LayerInputError of the real tensors) is then the one to show, unchained
    return profile_model(model, sample)


def _names(model: nn.Sequential) -> list[str]:
    """The names of ``model``'s children ("0", "1", ... unless it was built from a dict)."""
    return [name for name, _ in model.named_children()]


def _tie_sources(layers: Sequence[nn.Module], ties: Sequence[TiedGroup]
                 ) -> tuple[tuple[int, bytes], ...]:
    """Each tie's source layer as code, for the nodes that make a copy of it."""
    sources = sorted({group[0][0] for group in ties})
    return tuple((i, dumps(layers[i] if all(_on_meta(layers[i])) else meta_copy(layers[i])))
                 for i in sources)


def _meta_only(layers: list[nn.Module]) -> list[nn.Module]:
    """The layers with every tensor on meta (what meta_profile takes)."""
    return [layer if all(_on_meta(layer)) else copy.deepcopy(layer).to("meta")
            for layer in layers]


def weight_tensors(start: int, end: int, tensors: TensorsOf
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Layers ``[start, end)``'s tensors as a stage's weights stream names them
    (``"LAYER.KEY"``), on the CPU, one layer read at a time."""
    for i in range(start, end):
        for key, t in tensors(i).items():
            yield f"{i}.{key}", t.detach().to("cpu").contiguous()


def weight_frames(envelope: node_pb2.Envelope, tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[bytes]:
    """gRPC's PutWeights stream of ``tensors`` (:func:`weight_tensors`): the envelope on
    the first frame, each tensor with its name."""
    env: node_pb2.Envelope | None = envelope
    for name, t in tensors:
        yield from frames.encode_frames(t, name=name, envelope=env)
        env = None


class WeightLink(Protocol):
    """How a :class:`WeightStreamer` reaches a node (:class:`~.feed.ChannelNodes`)."""

    def put_weights(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
                    tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put a stage's initial weights on the node that runs it; return once the stage
        has them.

        Raises:
            grpc.RpcError: the node refused them with PutWeights' status code
                (ALREADY_EXISTS: the stage has its weights; INVALID_ARGUMENT: a digest
                that differs), or is unreachable.
        """


class WeightStreamer:
    """Streams each stage's initial weights to its node (``PutWeights``).

    Args:
        job_id: the job.
        tensors: a layer's state_dict tensors.
        link: how the weights reach a node (socket data plane or gRPC).
    """

    def __init__(self, job_id: str, tensors: TensorsOf, link: WeightLink):
        self.job_id, self.tensors, self.link = job_id, tensors, link

    def stream(self, info: tracker_pb2.JobInfo) -> list[StageKey]:
        """Stream every stage of ``info``'s plan its layers, all at once, if the epoch
        starts from the job's start (``resume_step`` 0); returns the stages that took
        them (one that has its weights answers ALREADY_EXISTS and is skipped).

        Raises:
            grpc.RpcError: a node refused them (a digest that differs: INVALID_ARGUMENT),
                or is gone (the feed then waits for the job's recovery).
        """
        if info.resume_step != 0:
            return []
        view = PlanView(info.plan)

        def put(key: StageKey) -> bool:
            a = view[key]
            if a.layer_end <= a.layer_start or \
                    not any(self.tensors(i) for i in range(a.layer_start, a.layer_end)):
                return False
            env = node_pb2.Envelope(job_id=self.job_id, replica=key.replica, stage=key.stage,
                                    kind=node_pb2.KIND_WEIGHTS, epoch=info.epoch)
            try:
                self.link.put_weights(a, env, weight_tensors(a.layer_start, a.layer_end,
                                                             self.tensors))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return False
                raise
            return True

        keys = sorted(view.stages)
        with futures.ThreadPoolExecutor(max(1, len(keys))) as pool:
            done = list(pool.map(put, keys))
        return [k for k, took in zip(keys, done) if took]


__all__ = ["ModelCode", "WeightStreamer", "meta_copy", "package", "MaterializeError"]
