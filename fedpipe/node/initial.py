"""A stage's initial weights when its layers come without them (issue 22).

A job whose :class:`~fedpipe.spec.WeightsSpec` names a source ships its layers
pickled on the meta device: code, a few KiB a layer, which is all the tracker sees.
Each node gives its own layers their weights:

- ``"seed"``: :func:`~fedpipe.runtime.materialize.materialize_layers` from the
  job's seed and each layer's index (and its ``init_fn``), the same weights
  ``fedpipe.materialize(model, seed)`` makes in one process;
- ``"files"``: the layers' tensors read from the job's safetensors path, when this
  node can read it (:func:`~fedpipe.runtime.weights.load_layers`);
- ``"stream"``, or ``"files"`` on a node that cannot read the path: the stage waits
  (state AWAITING_WEIGHTS) for the client to stream them (``PutWeights``, straight
  from the client, never through the tracker).

Read or streamed tensors are checked against the job's signed per-layer digests
(:func:`~fedpipe.runtime.weights.layer_digest`) before the stage takes a step.

Only a stage that starts from the job's start needs them: one that restores a
snapshot (a recovery after a checkpoint, a migration, a rebuilt replica group)
gets its state from there. A recovery before the first checkpoint loads every
stage at step 0 again: a seeded or file-read stage makes its weights again, and
a streamed one waits for the client, which streams to every stage of a new plan
epoch that starts at step 0 (:mod:`fedpipe.client.weights`).
"""
from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import cloudpickle
import torch
from torch import nn

from ..proto import node_pb2
from ..runtime.materialize import materialize_layers
from ..runtime.weights import (WeightsError, layer_digest, load_layer, load_layers,
                               sequential_keys)
from ..spec import WeightsSpec
from ..wire import WireError, frames
from ..wire.format import peek_header
from .errors import HasWeights, StaleEpoch
from .lifecycle import Stage, StageSlot


class WeightsRefused(WeightsError):
    """Streamed or read weights that are not the job's: a digest that differs, a tensor
    of a layer the stage does not hold, or a name that is not ``LAYER.KEY``."""


@dataclass
class Pending:
    """A stage's layers that wait for their streamed weights.

    Attributes:
        layers: global layer index -> the stage's layer (materialized, storage only).
        digests: the job's digest of every layer (hex), by global index.
        arrived: set once every layer is loaded and checked.
        loaded: called once the weights are in, before :attr:`arrived` is set: what the
            stage derived from its weights when it was built takes them again (the
            DiLoCo outer weights, :meth:`~fedpipe.runtime.diloco.OuterSync.anchor`).
    """

    layers: dict[int, nn.Module]
    digests: Sequence[str]
    loaded: list[Callable[[], None]] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    _taking: threading.Lock = field(default_factory=threading.Lock)

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the named tensors (``"LAYER.KEY"``: global layer index and the layer's
        state_dict key) into the layers, check each layer's digest, and set
        :attr:`arrived`. One stream at a time; a refused stream leaves the stage waiting
        for another.

        Raises:
            WeightsRefused: as the class says, or another stream fills them now.
            WeightsError: a layer's tensor missing, unexpected or of another shape.
        """
        if not self._taking.acquire(blocking=False):
            raise WeightsRefused("another stream is loading this stage's weights")
        try:
            by_layer: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self.layers}
            for name, t in tensors:
                index, _, key = name.partition(".")
                if not index.isdigit() or not key:
                    raise WeightsRefused(f"a streamed tensor is named {name!r}, not LAYER.KEY")
                if int(index) not in by_layer:
                    raise WeightsRefused(f"layer {index} is not one of this stage's layers "
                                         f"{min(self.layers)}..{max(self.layers)}")
                by_layer[int(index)][key] = t
            for i, tensors_i in by_layer.items():
                check_digest(i, tensors_i, self.digests)
                load_layer(self.layers[i], i, tensors_i)
            for hook in self.loaded:
                hook()
            self.arrived.set()
        finally:
            self._taking.release()


def check_digest(index: int, tensors: Mapping[str, torch.Tensor],
                 digests: Sequence[str]) -> None:
    """Raise :class:`WeightsRefused` unless layer ``index``'s ``tensors`` (its
    state_dict) digest to the job's signed digest of that layer."""
    got = layer_digest(tensors)
    if index >= len(digests) or got != digests[index]:
        want = digests[index] if index < len(digests) else "none"
        raise WeightsRefused(f"layer {index}: its weights digest to {got[:16]}..., the job "
                             f"says {want[:16]}...")


def needs_initial(request: node_pb2.LoadStageRequest) -> bool:
    """Whether the stage starts from the job's initial weights (not from a snapshot)."""
    return (request.resume_step == 0 and request.snapshot_wait_seconds <= 0
            and not request.snapshot_pieces)


def readable(path: str) -> bool:
    """Whether this node can read the weights at ``path`` (a file or a directory)."""
    return bool(path) and os.access(path, os.R_OK) and os.path.exists(path)


def allocate(layer: nn.Module, device: torch.device) -> nn.Module:
    """Give ``layer``'s meta parameters and buffers storage on ``device`` (contents
    undefined: a stream fills them), keeping the others (a non-persistent buffer the
    client pickled with its value) and each tensor's sharing within the layer; in place."""
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for module in layer.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    slots[name] = real(t)  # type: ignore[assignment]
    return layer


def make_layers(request: node_pb2.LoadStageRequest, weights: WeightsSpec, first: int,
                device: torch.device, unpickled: Callable[[], None] | None = None
                ) -> tuple[list[nn.Module], Pending | None]:
    """The stage's layers (global indices ``first``, ``first + 1``, ...) on ``device``,
    with their weights where this node can make or read them; else a :class:`Pending`
    for the client's stream.

    ``unpickled()`` is called once the layers' code is unpickled (the modules it imports
    loaded) and before any weight is made, for layers pickled on meta (the measured peak
    starts there, :meth:`fedpipe.node.memory.StageMemory.rebase`); layers that carry
    their weights have them once unpickled, so it is not called for them.

    Raises:
        WeightsError: the files do not fit the layers, or their digests differ.
        MaterializeError: a meta layer cannot be made.
    """
    layers = [cloudpickle.loads(blob) for blob in request.layers]
    if not weights.on_meta:  # the layers carry their weights
        return [layer.to(device) for layer in layers], None
    if unpickled is not None:
        unpickled()
    indices = list(range(first, first + len(layers)))
    if weights.source == "stream":  # a model the client holds: only its state_dict is meta
        made = [allocate(layer, device) for layer in layers]
    else:
        # storage made from the seed for "files" too: the files then overwrite the
        # state_dict, and a buffer outside it is what the layer's own init makes
        init_fn = cloudpickle.loads(weights.init_fn) if weights.init_fn else None
        known = {i: cloudpickle.loads(code) for i, code in weights.tie_sources
                 if i not in indices}  # the sources of tied copies held here
        known.update(zip(indices, layers))
        made = materialize_layers(known, indices, weights.seed, device, init_fn,
                                  weights.ties)
    if weights.source == "seed" or not needs_initial(request):
        return made, None
    mine = dict(zip(indices, made))
    if not any(layer.state_dict() for layer in made):  # nothing to stream (activations only)
        return made, None
    if weights.source == "files" and readable(weights.path):
        names = cloudpickle.loads(weights.names) if weights.names else sequential_keys
        load_layers(weights.path, mine, names)
        for i, layer in mine.items():
            check_digest(i, layer.state_dict(), weights.digests)
        return made, None
    return made, Pending(mine, weights.digests)


class WeightsDesk:
    """Takes a stage's streamed initial weights in (``PutWeights``).

    Args:
        stage_of: the loaded stage of a slot (raises NoSuchStage).
    """

    def __init__(self, stage_of: Callable[[StageSlot], Stage]):
        self.stage_of = stage_of

    def receive(self, stream: Iterator[node_pb2.Frame],
                check: Callable[[node_pb2.Envelope], None]) -> None:
        """Load the weights ``stream`` carries into the stage its first frame's envelope
        names, once ``check`` passed that envelope (before a payload byte is buffered).

        Raises:
            WireError: a malformed stream, or an envelope that is not KIND_WEIGHTS.
            NoSuchStage: no such stage here.
            StaleEpoch: the stage is of another plan epoch than the stream.
            HasWeights: the stage does not wait for weights.
            WeightsError: as :meth:`Pending.fill`.
            SecurityError: as ``check`` raises.
        """
        first = next(stream, None)
        head = None if first is None else peek_header(first)
        if first is None or head is None or not head.HasField("envelope"):
            raise WireError("a weights stream must start with a header frame and its envelope")
        env = head.envelope
        if env.kind != node_pb2.KIND_WEIGHTS:
            raise WireError(f"a weights stream needs a KIND_WEIGHTS envelope, got kind {env.kind}")
        check(env)
        stage = self.stage_of(StageSlot(env.job_id, env.replica, env.stage))
        if stage.epoch != env.epoch:
            raise StaleEpoch(f"stage {env.stage} of job {env.job_id!r} here is of plan epoch "
                             f"{stage.epoch}, the weights of epoch {env.epoch}")
        pending = stage.pending
        if pending is None or pending.arrived.is_set():
            raise HasWeights(f"stage {env.stage} of job {env.job_id!r} (replica {env.replica}) "
                             f"has its weights already ({stage.state.value})")
        tensors = frames.read_tensors(itertools.chain([first], stream), in_place=True)
        pending.fill((h.name, t) for h, t in tensors)
