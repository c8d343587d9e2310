"""A stage's snapshot: everything it needs to resume at a step boundary, as named tensors.

A snapshot is taken at a step boundary, on the stage thread, by copying (so
training goes on at once), and is shipped on another thread as wire-format
tensors named by their path, e.g. ``module/0.weight``, ``optimizer/state/0/exp_avg``.
The parts of a stage (its module, optimizer, LR schedule, DiLoCo outer state,
error-feedback residuals, async weight versions) each give a ``state_dict()``
and take ``load_state_dict()``, as torch's own objects do; the nested dicts
are flattened into tensors and one JSON *skeleton* of everything else
(hyper-parameters, step counters), carried as a uint8 tensor named
:data:`SKELETON`. A float survives JSON exactly (``repr`` round-trips), so a
restored stage continues bit for bit as the original would have: this is what
makes recovery of synchronous jobs exact (the same idea as torch.distributed's
``state_dict`` flattening in ``torch.distributed.checkpoint``).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, MutableMapping, Protocol

import torch
from torch import nn

from ..proto import node_pb2
from ..wire import codecs, frames
from ..wire.codecs import WireError

LAYOUT = "layers"
"""The part of a stage snapshot that says which layers it holds
(:class:`fedpipe.runtime.layerstate.Layout`); snapshots taken before it existed lack it."""
FEEDBACK = "gradient_feedback"
"""The part of a stage snapshot that holds its senders' gradient error-feedback residuals
(:class:`fedpipe.runtime.gradfeedback.GradientFeedbackPart`); snapshots taken before it
existed lack it (restored, the residuals start afresh)."""
OPTIONAL = frozenset({LAYOUT, FEEDBACK})
"""Parts :func:`restore` skips where a snapshot lacks them (an older fedpipe's)."""
SKELETON = "__skeleton__"
"""Name of the tensor (uint8, JSON text) that carries a snapshot's non-tensor state."""
MAX_SKELETON_BYTES = 64 * 2**20
"""Largest skeleton a decoder accepts, bytes."""
MAX_SKELETON_DEPTH = 256
"""Deepest nesting a decoder accepts in a skeleton (a state dict's tree takes about three
levels per dict level, :func:`_flatten`; real ones stay under 30)."""


class SnapshotTooLarge(WireError):
    """A snapshot's tensors would take more than the receiver's limit (refused on a header)."""


class Checkpointable(Protocol):
    """Anything with torch's ``state_dict`` / ``load_state_dict`` pair."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


@dataclass
class Snapshot:
    """One stage's state after ``step`` steps (the next step to run is ``step``).

    Attributes:
        step: steps completed when it was taken.
        tensors: every tensor, by path (``part/key/...``); CPU copies, or a
            :class:`~fedpipe.runtime.tensorfile.TensorFile` that reads each from disk
            when it is looked up (a node's disk snapshots).
        skeleton: the nested state with each tensor replaced by ``{"$t": path}``.
    """

    step: int
    tensors: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    skeleton: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes its tensors take (a file's from its header: nothing is read)."""
        return sum(self.sizes().values())

    def sizes(self) -> dict[str, int]:
        """Bytes of each tensor, by path (a file's from its header: nothing is read)."""
        sizes = getattr(self.tensors, "sizes", None)
        if callable(sizes):
            return dict(sizes())
        return {k: t.numel() * t.element_size() for k, t in self.tensors.items()}


class Sink(Protocol):
    """Where an :class:`Assembler` puts a snapshot's tensors as they come, instead of
    keeping them (a node's disk store: :meth:`fedpipe.node.snapshots.SnapshotStore.writer`)."""

    def add(self, name: str, t: torch.Tensor) -> None: ...

    def finish(self) -> Snapshot: ...

    def abort(self) -> None: ...


SinkFactory = Callable[[node_pb2.Frame, Snapshot], "Sink | None"]
"""``sink(first_frame, empty_snapshot)``: the sink of a snapshot whose skeleton (step and
state tree, no tensors yet) came in ``first_frame``, or None to keep it in memory; it
may raise to refuse the snapshot on its envelope."""


def _flatten(value: Any, path: str, tensors: MutableMapping[str, torch.Tensor],
             copy: bool = True) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().to("cpu", copy=True) if copy else value
        return {"$t": path}
    if isinstance(value, Mapping):
        # keys may be ints (optimizer state by parameter index): keep their type
        return {"$d": [[k, _flatten(v, f"{path}/{k}", tensors, copy)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", tensors, copy) for i, v in enumerate(value)]
        return {"$l" if isinstance(value, list) else "$u": items}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$f": repr(value)}
    raise TypeError(f"cannot snapshot {path}: a {type(value).__name__} is neither a tensor "
                    f"nor plain data")


def _unflatten(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "$t" in node:
            try:
                return tensors[node["$t"]]
            except KeyError:
                raise WireError(f"snapshot names tensor {node['$t']!r} but does not carry it"
                                ) from None
        if "$d" in node:
            return {k: _unflatten(v, tensors) for k, v in node["$d"]}
        if "$l" in node:
            return [_unflatten(v, tensors) for v in node["$l"]]
        if "$u" in node:
            return tuple(_unflatten(v, tensors) for v in node["$u"])
        if "$f" in node:
            return float(node["$f"])
        raise WireError(f"snapshot skeleton has an unknown node {sorted(node)}")
    return node


def take(parts: Mapping[str, Checkpointable | None], step: int, copy: bool = True) -> Snapshot:
    """Copy the state of every part (None parts are skipped) after ``step`` steps.

    Runs on the stage thread at a step boundary; costs one copy of each tensor. With
    ``copy`` False the snapshot holds the parts' own tensors (no copy): valid only until
    the stage goes on, for a caller that writes it out first (a disk store).

    Raises:
        TypeError: a part's state holds something that is neither a tensor
            nor plain data (numbers, strings, lists, dicts).
    """
    snap = Snapshot(step)
    for name, part in parts.items():
        if part is not None:
            snap.skeleton[name] = _flatten(part.state_dict(), name, snap.tensors, copy)
    return snap


def restore(parts: Mapping[str, Checkpointable | None], snap: Snapshot) -> None:
    """Load ``snap`` into ``parts`` (each part must be in the snapshot, but for the
    :data:`OPTIONAL` ones, which older snapshots lack).

    Tensors are moved to each part's device by its own ``load_state_dict``
    (modules and optimizers do so). ``snap`` stays as it was: a module copies the
    values into its parameters, and any other part is given copies (an optimizer keeps
    the tensors it is given as its state, on the same device and dtype, and trains them
    in place: the kept snapshot a second recovery to the same step restores, or a peer
    fetches, would hold a later momentum).

    Raises:
        WireError: the snapshot lacks a part, or its skeleton names a tensor it lacks.
        RuntimeError: a part refuses the state (torch's own error: shapes differ).
    """
    for name, part in parts.items():
        if part is None or (name in OPTIONAL and name not in snap.skeleton):
            continue
        if name not in snap.skeleton:
            raise WireError(f"the step {snap.step} snapshot has no {name!r} state; it has "
                            f"{sorted(snap.skeleton)}")
        state = _unflatten(snap.skeleton[name], snap.tensors)
        part.load_state_dict(state if isinstance(part, nn.Module) else copy.deepcopy(state))


def to_frames(snap: Snapshot, envelope: node_pb2.Envelope | None = None
              ) -> Iterator[bytes]:
    """The snapshot as a frame stream: its skeleton first, then each tensor by name.

    ``envelope`` rides on the first frame (who the snapshot is for).
    """
    for i, (name, t) in enumerate(to_tensors(snap)):
        yield from frames.encode_frames(t, name=name, envelope=envelope if i == 0 else None)


def to_tensors(snap: Snapshot) -> Iterator[tuple[str, torch.Tensor]]:
    """The snapshot as named tensors, in the order :class:`Assembler` takes them: its
    skeleton (``{"step", "skeleton"}`` as JSON in a uint8 tensor) first, then each tensor."""
    meta = json.dumps({"step": snap.step, "skeleton": snap.skeleton}).encode()
    yield SKELETON, torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    yield from snap.tensors.items()


class Assembler:
    """A snapshot put together from its tensors as they arrive, skeleton first
    (:func:`to_frames`' order), each checked on its header before its payload is read:
    what :func:`from_frames` does with a frame stream, for a transport that delivers
    tensors one by one (the socket data plane).

    Args:
        max_bytes: the most bytes the snapshot's tensors may take.
        sink: where its tensors go as they come (:data:`SinkFactory`), or None: kept.
        keep: without a sink, keep each tensor in :attr:`snap` (False: only check them,
            for a reader that passes each on as it comes, :func:`stream_frames`).
    """

    def __init__(self, max_bytes: int, sink: SinkFactory | None = None, *,
                 keep: bool = True):
        self.max_bytes = max_bytes
        self.keep = keep
        self.first: node_pb2.Frame | None = None
        self.snap: Snapshot | None = None
        self.named: set[str] = set()  # the tensors its skeleton names
        self.seen: set[str] = set()  # the tensors that came
        self.total = 0
        self._make_sink = sink
        self.sink: Sink | None = None

    def admit(self, head: node_pb2.Frame) -> int:
        """The size limit of the tensor ``head`` announces, bytes.

        Raises:
            SnapshotTooLarge: it would take the snapshot past ``max_bytes``.
            WireError: a malformed header.
        """
        if head.name == SKELETON:
            return MAX_SKELETON_BYTES
        need = codecs.check_header(head.tensor)
        if need > self.max_bytes - self.total:  # refused on its header, before its payload
            raise SnapshotTooLarge(f"snapshot tensor {head.name!r} of {need} bytes would take "
                                   f"the snapshot past its limit of {self.max_bytes} bytes "
                                   f"({self.total} bytes so far)")
        return self.max_bytes - self.total

    def add(self, head: node_pb2.Frame, t: torch.Tensor) -> None:
        """Take one tensor of the snapshot (the first must be its skeleton).

        Raises:
            WireError: no skeleton first, a bad skeleton, or a tensor sent twice.
        """
        if self.snap is None:
            if head.name != SKELETON or t.dtype != torch.uint8:
                raise WireError("a snapshot stream must start with its skeleton")
            snap = _read_skeleton(bytes(t.numpy()))
            named = _collect_paths(snap.skeleton)
            self.sink = self._make_sink(head, snap) if self._make_sink is not None else None
            self.first, self.snap, self.named = head, snap, named
            return
        if head.name in self.seen:
            raise WireError(f"snapshot tensor {head.name!r} sent twice")
        if self.sink is not None and head.name not in self.named:
            raise WireError(f"snapshot tensor {head.name!r} is not named by its skeleton")
        self.seen.add(head.name)
        self.total += t.numel() * t.element_size()
        if self.sink is not None:
            self.sink.add(head.name, t)  # written, not kept
        elif self.keep:
            self.snap.tensors[head.name] = t

    @property
    def complete(self) -> bool:
        """Whether every tensor its skeleton names has come."""
        return self.snap is not None and len(self.seen) >= len(self.named)

    def abort(self) -> None:
        """Give up: what a sink wrote so far is removed."""
        if self.sink is not None:
            self.sink.abort()

    def finish(self) -> tuple[node_pb2.Frame, Snapshot]:
        """The snapshot's first frame and the snapshot.

        Raises:
            WireError: nothing came, or not exactly the tensors the skeleton names.
        """
        if self.first is None or self.snap is None:
            raise WireError("empty snapshot stream")
        snap = self.snap
        if self.named != self.seen:
            self.abort()
            missing = sorted(self.named - self.seen)
            extra = sorted(self.seen - self.named)
            raise WireError(f"truncated or inconsistent snapshot of step {snap.step}: missing "
                            f"{missing[:5]}, unexpected {extra[:5]}")
        return self.first, self.sink.finish() if self.sink is not None else snap


def from_frames(stream: Iterable[bytes], max_bytes: int, sink: SinkFactory | None = None
                ) -> tuple[node_pb2.Frame, Snapshot]:
    """Decode a snapshot sent by :func:`to_frames`; returns its first frame and the snapshot.

    Every tensor is validated by the wire decoder before it is allocated; the
    whole snapshot may take at most ``max_bytes``. With ``sink``, each tensor goes to
    it as it comes (:class:`Assembler`), and the snapshot is the sink's.

    Raises:
        WireError: a malformed or truncated stream (no skeleton, a tensor the
            skeleton does not name or names twice, a tensor missing, bad JSON, a
            skeleton of another shape or nested deeper than :data:`MAX_SKELETON_DEPTH`).
        SnapshotTooLarge: a tensor's header would take the snapshot over ``max_bytes``.
    """
    assembler = Assembler(max_bytes, sink)
    try:
        for head, t in frames.read_tensors(stream, assembler.admit):
            assembler.add(head, t)
    except BaseException:
        assembler.abort()
        raise
    return assembler.finish()


@dataclass
class SnapshotStream:
    """A snapshot read as it arrives (:func:`stream_frames`): its skeleton, then its
    tensors one at a time, none kept.

    Attributes:
        step: steps completed when it was taken.
        skeleton: as :attr:`Snapshot.skeleton`.
        tensors: ``(path, tensor)`` pairs, to be iterated once; it raises ``WireError``
            at its end unless exactly the tensors the skeleton names came.
    """

    step: int
    skeleton: dict[str, Any]
    tensors: Iterator[tuple[str, torch.Tensor]]


def stream_frames(stream: Iterable[bytes], max_bytes: int, *, in_place: bool = False
                  ) -> tuple[node_pb2.Frame, SnapshotStream]:
    """Decode a snapshot sent by :func:`to_frames` a tensor at a time: its skeleton is read
    here (so a stream that fails at once fails here), each tensor when the returned
    :attr:`SnapshotStream.tensors` is advanced, with the checks of :func:`from_frames`.
    A reader that drops each tensor before it takes the next holds one at a time.

    ``in_place``: as :func:`fedpipe.wire.frames.read_tensors` (gRPC's messages).

    Raises:
        WireError, SnapshotTooLarge: as :func:`from_frames` (from the iterator, for a
            tensor or the stream's end).
    """
    assembler = Assembler(max_bytes, keep=False)
    return stream_tensors(assembler, frames.read_tensors(stream, assembler.admit,
                                                         in_place=in_place))


def stream_tensors(assembler: Assembler, pairs: Iterator[tuple[node_pb2.Frame, torch.Tensor]],
                   *, added: bool = False) -> tuple[node_pb2.Frame, SnapshotStream]:
    """A snapshot read a tensor at a time from ``pairs`` (each header already passed
    ``assembler.admit``, a :class:`Assembler` with ``keep=False``): its skeleton read here,
    each tensor taken by ``assembler`` as the returned stream's tensors are advanced,
    and at their end checked complete. The one assembly of :func:`stream_frames` (a gRPC
    stream) and of a fetch over the socket data plane
    (:func:`fedpipe.client.links.fetch_snapshot`).

    ``added``: each pair was already taken by ``assembler.add`` (a transport that checks
    them on its own thread, before they are handed on).

    Raises:
        WireError, SnapshotTooLarge: as :func:`from_frames` (from the iterator, for a
            tensor or the stream's end); what ``pairs`` raises.
    """
    take = (lambda head, t: None) if added else assembler.add
    for head, t in pairs:
        take(head, t)
        break
    if assembler.first is None or assembler.snap is None:
        raise WireError("empty snapshot stream")
    snap = assembler.snap

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for head, t in pairs:
            take(head, t)
            yield head.name, t
            del t  # the next tensor is read without this one held here
        assembler.finish()
    return assembler.first, SnapshotStream(snap.step, snap.skeleton, tensors())


def _read_skeleton(raw: bytes) -> Snapshot:
    """The empty snapshot a skeleton frame describes: ``{"step": int, "skeleton": {part: tree}}``.

    Raises:
        WireError: not JSON, another shape (a list of pairs is not a mapping), or
            nested deeper than :data:`MAX_SKELETON_DEPTH`.
    """
    try:
        meta = json.loads(raw.decode())
    except RecursionError:  # the C decoder's own depth limit, below ours only on odd builds
        raise WireError(f"bad snapshot skeleton: nested deeper than {MAX_SKELETON_DEPTH} "
                        "levels") from None
    except ValueError as e:
        raise WireError(f"bad snapshot skeleton: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("skeleton"), dict) \
            or type(meta.get("step")) is not int:
        raise WireError('bad snapshot skeleton: want {"step": int, "skeleton": {part: tree}}, '
                        f"got a {type(meta).__name__}"
                        + (f" with keys {sorted(map(str, meta))[:5]}" if isinstance(meta, dict)
                           else ""))
    snap = Snapshot(meta["step"], skeleton=meta["skeleton"])
    _collect_paths(snap.skeleton)  # depth and leaf checks now, before any tensor is read
    return snap


def tensor_paths(snap: Snapshot | SnapshotStream) -> set[str]:
    """The tensor paths ``snap``'s skeleton names (its tensors need not be there yet).

    Raises:
        WireError: a skeleton nested too deep, or with a malformed leaf.
    """
    return _collect_paths(snap.skeleton)


def _collect_paths(root: Any) -> set[str]:
    """The tensor names a skeleton refers to (its ``{"$t": name}`` leaves).

    Iterative, so a deep tree cannot exhaust the interpreter's stack.

    Raises:
        WireError: nested deeper than :data:`MAX_SKELETON_DEPTH`, or a ``$t`` leaf
            whose name is not a string.
    """
    out: set[str] = set()
    todo: list[tuple[Any, int]] = [(root, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SKELETON_DEPTH:
            raise WireError(f"bad snapshot skeleton: nested deeper than {MAX_SKELETON_DEPTH} "
                            "levels")
        if isinstance(node, dict):
            if "$t" in node:
                if not isinstance(node["$t"], str):
                    raise WireError(f"bad snapshot skeleton: a tensor leaf names "
                                    f"{type(node['$t']).__name__} {node['$t']!r}, not a string")
                out.add(node["$t"])
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return out
