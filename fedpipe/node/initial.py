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
  (state AWAITING_WEIGHTS) for the client to stream them (``PutWeights``, over the
  node's socket data port or gRPC, straight from the client, never through the tracker).

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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import cloudpickle
import torch
from torch import nn

from ..net import timeouts
from ..proto import node_pb2
from ..runtime import weights_link
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
class _Fill:
    """One stream's fill of a :class:`Pending` under way: its layers' tensors so far."""

    owner: object
    partial: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


@dataclass
class Pending:
    """A stage's layers that wait for their streamed weights: the one home of how a
    stream fills them, whether it comes over gRPC (``PutWeights``, :meth:`fill`) or a
    socket link (:class:`WeightsDesk`: :meth:`begin`, :meth:`expect`, :meth:`take`,
    :meth:`end`, a tensor at a time).

    A stream names each tensor ``"LAYER.KEY"`` (global layer index and the layer's
    state_dict key); a layer is checked against its digest and loaded as soon as its
    last tensor is in (so a stream holds at most one layer's tensors here), and the
    stage has its weights once every layer is. One stream at a time: another is
    refused while one is under way and has taken a tensor within
    :data:`~fedpipe.net.timeouts.WEIGHTS_IDLE` (a client gone mid-stream does not keep
    the stage for ever); a refused stream leaves the stage waiting for another.

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
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _fill: _Fill | None = None
    _last: float = 0.0  # monotonic time of the fill's last tensor

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a whole stream's named tensors (gRPC's ``PutWeights``): :meth:`begin`,
        :meth:`take` each, :meth:`end`.

        Raises:
            As :meth:`begin`, :meth:`take` and :meth:`end`.
        """
        owner = object()
        self.begin(owner)
        try:
            for name, t in tensors:
                self.take(owner, name, t)
            self.end(owner)
        finally:
            self.abort(owner)

    def begin(self, owner: object) -> None:
        """Start ``owner``'s stream (one it started before starts over).

        Raises:
            HasWeights: the stage has its weights.
            WeightsRefused: another stream fills them now.
        """
        with self._lock:
            if self.arrived.is_set():
                raise HasWeights("the stage has its weights already")
            busy = self._fill is not None and self._fill.owner != owner \
                and time.monotonic() - self._last < timeouts.WEIGHTS_IDLE
            if busy:
                raise WeightsRefused("another stream is loading this stage's weights")
            self._fill, self._last = _Fill(owner), time.monotonic()

    def expect(self, owner: object, name: str, shape: Sequence[int]) -> int:
        """Check a tensor's name and ``shape`` (from its header, before its payload is
        read) for ``owner``'s stream; the bytes its layer's tensor takes (its size limit).

        Raises:
            WeightsRefused: not ``owner``'s stream now (none started, or another's), a
                name that is not ``LAYER.KEY`` of a layer here, or a tensor it sent already.
            WeightsError: a key the layer lacks, or another shape.
            A refusal ends the stream (the stage waits for another).
        """
        with self._lock:
            fill = self._current(owner)
            try:
                index, key = self._place(fill, name)
                target = self.layers[index].state_dict(keep_vars=True).get(key)
                if target is None:
                    raise WeightsError(f"layer {index}: unexpected tensor {key!r}")
                if tuple(shape) != tuple(target.shape):
                    raise WeightsError(f"layer {index}: {key!r} is {tuple(shape)}, the "
                                       f"layer's is {tuple(target.shape)}")
            except WeightsError:
                self._fill = None  # the stream is refused: the stage waits for another
                raise
        return target.numel() * target.element_size()

    def take(self, owner: object, name: str, tensor: torch.Tensor) -> None:
        """Take one tensor of ``owner``'s stream; check and load its layer once that has
        all its tensors. A refusal ends the stream (the stage waits for another).

        Raises:
            WeightsRefused: as :meth:`expect`, or its layer's digest differs.
            WeightsError: a layer's tensor unexpected or of another shape.
        """
        with self._lock:
            fill = self._current(owner)
            try:
                index, key = self._place(fill, name)
                got = fill.partial.setdefault(index, {})
                got[key] = tensor
                self._last = time.monotonic()
                if got.keys() >= self.layers[index].state_dict().keys():
                    del fill.partial[index]
                    check_digest(index, got, self.digests)
                    load_layer(self.layers[index], index, got)
                    fill.done.add(index)
            except WeightsError:
                self._fill = None
                raise

    def end(self, owner: object) -> None:
        """End ``owner``'s stream: the stage has its weights (:attr:`loaded` called,
        :attr:`arrived` set) if every layer is loaded.

        Raises:
            WeightsRefused: not ``owner``'s stream now.
            WeightsError: a layer's tensor missing (the stream is refused).
        """
        with self._lock:
            fill = self._current(owner)
            self._fill = None
            missing = sorted(i for i, layer in self.layers.items()
                             if i not in fill.done and layer.state_dict())  # not ReLU's
            if missing:
                i = missing[0]
                keys = sorted(set(self.layers[i].state_dict()) - set(fill.partial.get(i, {})))
                raise WeightsError(f"layer {i}: no tensor for {', '.join(map(repr, keys))} "
                                   f"(the stream ended without layer(s) {missing})")
            for hook in self.loaded:
                hook()
            self.arrived.set()

    def abort(self, owner: object) -> None:
        """Drop ``owner``'s stream if it is under way (the stage waits for another)."""
        with self._lock:
            if self._fill is not None and self._fill.owner == owner:
                self._fill = None

    def _current(self, owner: object) -> _Fill:
        if self._fill is None or self._fill.owner != owner:
            raise WeightsRefused("a weights tensor of no stream started here (refused "
                                 "already, or taken over by another stream)")
        return self._fill

    def _place(self, fill: _Fill, name: str) -> tuple[int, str]:
        """``name``'s layer index and key; refused unless a layer here still needs it."""
        index, _, key = name.partition(".")
        if not index.isdigit() or not key:
            raise WeightsRefused(f"a streamed tensor is named {name!r}, not LAYER.KEY")
        i = int(index)
        if i not in self.layers:
            raise WeightsRefused(f"layer {index} is not one of this stage's layers "
                                 f"{min(self.layers)}..{max(self.layers)}")
        if i in fill.done or key in fill.partial.get(i, {}):
            raise WeightsRefused(f"tensor {name!r} came twice in one stream")
        return i, key


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
    """Takes stages' streamed initial weights in: a gRPC ``PutWeights`` stream
    (:meth:`receive`) or a socket link's tensors (:meth:`admit_part`, :meth:`add_part`;
    :mod:`fedpipe.runtime.weights_link`), both into the stage's :class:`Pending`.

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
            NoSuchStage, StaleEpoch, HasWeights: as :meth:`pending`.
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
        pending = self.pending(env)
        tensors = frames.read_tensors(itertools.chain([first], stream), in_place=True)
        pending.fill((h.name, t) for h, t in tensors)

    def pending(self, env: node_pb2.Envelope) -> Pending:
        """The :class:`Pending` of the stage ``env`` names, which waits for its weights.

        Raises:
            NoSuchStage: no such stage here.
            StaleEpoch: the stage is of another plan epoch than ``env``.
            HasWeights: the stage does not wait for weights.
        """
        stage = self.stage_of(StageSlot(env.job_id, env.replica, env.stage))
        if stage.epoch != env.epoch:
            raise StaleEpoch(f"stage {env.stage} of job {env.job_id!r} here is of plan epoch "
                             f"{stage.epoch}, the weights of epoch {env.epoch}")
        pending = stage.pending
        if pending is None or pending.arrived.is_set():
            raise HasWeights(f"stage {env.stage} of job {env.job_id!r} (replica {env.replica}) "
                             f"has its weights already ({stage.state.value})")
        return pending

    def admit_part(self, sender: str, head: node_pb2.Frame,
                   check: Callable[[node_pb2.Envelope], None]) -> int:
        """Check one tensor of a weights stream coming over a socket link from ``sender``
        (``PutWeights``' checks: ``check``, then :meth:`pending`, then the tensor's name and
        shape against the stage's layer) before its payload is read; its size limit,
        bytes. A :data:`~fedpipe.runtime.weights_link.BEGIN` starts ``sender``'s stream.

        Raises:
            SecurityError: as ``check`` raises.
            NoSuchStage, StaleEpoch, HasWeights: as :meth:`pending`.
            WeightsError: as :meth:`Pending.begin` and :meth:`Pending.expect`.
        """
        check(head.envelope)
        pending = self.pending(head.envelope)
        if head.name == weights_link.BEGIN:
            pending.begin(sender)
            return 0
        if head.name == weights_link.END:
            return 0
        return pending.expect(sender, head.name, head.tensor.shape)

    def add_part(self, sender: str, head: node_pb2.Frame, tensor: torch.Tensor) -> bool:
        """Take one tensor :meth:`admit_part` admitted into the stage's :class:`Pending`;
        whether the stage has its weights now (the stream's
        :data:`~fedpipe.runtime.weights_link.END`).

        Raises:
            NoSuchStage, StaleEpoch, HasWeights: as :meth:`pending` (the stage went
                meanwhile).
            WeightsError: as :meth:`Pending.take` and :meth:`Pending.end`.
        """
        pending = self.pending(head.envelope)
        if head.name == weights_link.BEGIN:
            return False  # begun on admission
        if head.name == weights_link.END:
            pending.end(sender)
            return True
        pending.take(sender, head.name, tensor)
        return False
