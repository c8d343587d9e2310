"""A stage's snapshot cut into per-layer pieces, and a stage assembled from such pieces.

A stage snapshot (:mod:`fedpipe.runtime.checkpoint`) names its tensors by
*stage-local* paths (``module/0.weight``, ``optimizer/state/0/exp_avg``), so it
can only be restored into a stage of the same layers. When a new plan splits
the layers differently (a join that adds a stage, a boundary that moves, a
saved checkpoint resumed with another depth), each new stage covering layers
``[a, b)`` is assembled from the pieces of the old stages that held them.

**The rule.** Every stage snapshot carries the :class:`Layout` part
(``layers``): its first layer and, per layer, its parameters' names in
``named_parameters()`` order with their ``requires_grad``. From it a stage
index maps to a *global* layer and a parameter name:

- ``module``: key ``"i.rest"`` is ``rest`` of layer ``start + i`` (parameters
  and buffers alike);
- ``optimizer`` (a ``torch.optim`` state dict): state index ``k`` is the
  ``k``-th trainable parameter in layer order (the order
  :func:`~fedpipe.node.wiring.build_stage` gives the optimizer); each keeps its
  per-parameter state (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's
  ``momentum_buffer``) and the index of its param group. The groups'
  hyper-parameters are *shared*;
- ``outer`` (DiLoCo, :class:`~fedpipe.runtime.diloco.OuterSync`): its
  ``globals`` are segments of every parameter in layer order, the outer SGD's
  state index ``k`` is the ``k``-th of those, and a segment's error-feedback
  residual (1-D, the segment's parameters flattened in order) is cut at the
  parameters' sizes. ``outer_step`` and the outer groups are shared;
- ``lr_scheduler`` is shared whole;
- ``codec`` (the lowrank codecs' bases, :class:`~fedpipe.wire.lowrank.Subspace`) is
  state of the stage boundaries, not of layers: a plan that splits the layers otherwise
  moves the boundaries, so it is dropped and an assembled stage starts with no basis
  (its first activations make new ones, sent to both ends).
- ``gradient_feedback`` (:mod:`~fedpipe.runtime.gradfeedback`): the residuals of the
  gradients a stage sends back go with its first layer, the boundary they cross: a
  stage assembled from pieces takes those its own first layer carries (none if that
  layer was no stage's first: a new boundary starts afresh).

The *layer form* of a snapshot is itself a :class:`~.checkpoint.Snapshot`, so it
travels and is stored as any snapshot does: part ``layer/<L>`` holds layer
``L``'s ``{"module": {name: t}, "optimizer": {param: {"group": g, "state":
{...}}}, "outer": {param: {"global": t, "state": {...}, "residual": t}}}`` (a stage's
first layer also ``"gradient_feedback": {"replica": g, "residuals": [...]}``) and
part ``shared`` holds ``{"optimizer": {"param_groups": [...]}, "lr_scheduler":
{...}, "outer": {"outer_step": n, "param_groups": [...]}}``. Pieces of several
stages merge when their shared state agrees exactly (it does for the stages of
one job at one step: every stage steps the same schedule); a layer's tensors are
never touched, so a stage assembled from pieces is bit for bit the state its
layers had (the same exactness rule as :mod:`~.checkpoint`). Assembling takes
its structure from the new stage's own parts (its layout, its DiLoCo segments),
so the pieces need not know the new plan.

What cannot be split raises :class:`SplitError` naming the part: a part
without a rule here (async weight versions), a snapshot without a layout
(taken by an older fedpipe), state that does not fit its layout. The same
shape of rule as ``torch.distributed.checkpoint``'s resharding (state keyed by
fully-qualified names, loaded into whatever layout the new plan has).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .checkpoint import FEEDBACK, LAYOUT, Checkpointable, Snapshot, _flatten, _unflatten, \
    restore as _restore

SHARED = "shared"
"""Part of a layer-form snapshot that holds what every layer shares."""
LAYER = "layer/"
"""Prefix of a layer-form snapshot's per-layer parts: ``layer/<global index>``."""
SPLITTABLE = {"module", "optimizer", "lr_scheduler", "outer", "codec", FEEDBACK, LAYOUT}
"""The parts this module knows how to cut by layer (``codec``: by dropping it)."""


class SplitError(ValueError):
    """A snapshot's state cannot be cut by layer, or pieces do not fit together."""


class Layout:
    """The :data:`LAYOUT` part of a stage: which layers it holds and their parameters.

    ``state_dict()`` is ``{"start": first global layer, "params": [[[name,
    requires_grad], ...] per layer]}`` (JSON only, no tensor). Loading checks
    that a snapshot is of these very layers.

    Args:
        module: the stage's layers (an ``nn.Sequential``, one child per layer).
        start: the global index of its first layer.
    """

    def __init__(self, module: nn.Module, start: int):
        self.module, self.start = module, start

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start,
                "params": [[[n, p.requires_grad] for n, p in layer.named_parameters()]
                           for layer in self.module.children()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises:
            SplitError: the snapshot holds other layers or parameters."""
        mine = self.state_dict()
        params = [[list(p) for p in layer] for layer in state.get("params", [])]
        theirs = {"start": state.get("start"), "params": params}
        if theirs != mine:
            raise SplitError(f"the snapshot holds layers from {theirs['start']} "
                             f"({len(params)} layers), this stage layers from "
                             f"{self.start} ({len(mine['params'])} layers) or other parameters")


def is_layered(snap: Snapshot) -> bool:
    """Whether ``snap`` is in layer form (see the module docstring)."""
    return SHARED in snap.skeleton


def layers(snap: Snapshot) -> list[int]:
    """The global layers a layer-form snapshot holds, in order."""
    return sorted(int(k[len(LAYER):]) for k in snap.skeleton if k.startswith(LAYER))


def _build(step: int, state: Mapping[str, Any]) -> Snapshot:
    """A snapshot of ``state`` (part -> tree) that shares its tensors (no copy)."""
    snap = Snapshot(step)
    for name, tree in state.items():
        snap.skeleton[name] = _flatten(tree, name, snap.tensors, copy=False)
    return snap


def _order(layout: Mapping[str, Any]) -> tuple[int, list[list[tuple[str, bool]]]]:
    try:
        start = int(layout["start"])
        params = [[(str(n), bool(g)) for n, g in layer] for layer in layout["params"]]
    except (KeyError, TypeError, ValueError) as e:
        raise SplitError(f"the snapshot's layer layout is malformed: {e}") from None
    return start, params


def split(snap: Snapshot, start: int = 0, end: int | None = None) -> Snapshot:
    """The layer form of stage snapshot ``snap``, keeping only the layers in ``[start, end)``
    (``end`` None: every layer). Tensors are shared with ``snap``, not copied.

    Raises:
        SplitError: ``snap`` has no layout, a part without a rule here, or state that
            does not fit its layout (the message names the part).
    """
    if is_layered(snap):
        keep = [k for k in snap.skeleton if k == SHARED or (
            k.startswith(LAYER) and start <= int(k[len(LAYER):]) < (end if end is not None
                                                                   else 1 << 62))]
        return _build(snap.step, {k: _unflatten(snap.skeleton[k], snap.tensors) for k in keep})
    if LAYOUT not in snap.skeleton:
        raise SplitError(f"the step {snap.step} snapshot has no layer layout (taken by an older "
                         f"fedpipe?): it restores only into the same layers")
    unknown = sorted(set(snap.skeleton) - SPLITTABLE)
    if unknown:
        raise SplitError(f"the snapshot's part(s) {unknown} cannot be split by layer")
    state = {k: _unflatten(v, snap.tensors) for k, v in snap.skeleton.items()}
    first, params = _order(state[LAYOUT])
    held = range(first, first + len(params))
    per: dict[int, dict[str, Any]] = {L: {"module": {}, "optimizer": {}, "outer": {}}
                                      for L in held}
    shared: dict[str, Any] = {}
    for key, t in state.get("module", {}).items():
        i, _, rest = str(key).partition(".")
        if not i.isdigit() or int(i) >= len(params):
            raise SplitError(f"module: key {key!r} is of no layer of the layout")
        per[first + int(i)]["module"][rest] = t
    trainable = [(first + i, n) for i, layer in enumerate(params) for n, g in layer if g]
    everyone = [(first + i, n) for i, layer in enumerate(params) for n, _ in layer]
    opt = state.get("optimizer")
    if opt is not None:
        shared["optimizer"] = _split_optimizer(opt, trainable, per)
    if state.get("lr_scheduler") is not None:
        shared["lr_scheduler"] = state["lr_scheduler"]
    outer = state.get("outer")
    if outer is not None:
        shared["outer"] = _split_outer(outer, everyone, per)
    feedback = state.get(FEEDBACK)
    if feedback is not None and feedback.get("residuals") and params:
        if feedback.get("boundary") != first:
            raise SplitError(f"{FEEDBACK}: residuals of boundary {feedback.get('boundary')}, "
                             f"the stage's first layer is {first}")
        per[first][FEEDBACK] = {"replica": feedback.get("replica"),
                                "residuals": feedback["residuals"]}
    stop = end if end is not None else held.stop
    return _build(snap.step, {SHARED: shared, **{f"{LAYER}{L}": per[L] for L in held
                                                   if start <= L < stop}})


def _split_optimizer(opt: Mapping[str, Any], trainable: Sequence[tuple[int, str]],
                     per: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """File a ``torch.optim`` state dict's per-parameter state under ``per[L]["optimizer"]``
    (``trainable``: the ``(layer, name)`` of each state index); return the shared part."""
    groups = opt["param_groups"]
    owner = {k: g for g, group in enumerate(groups) for k in group["params"]}
    if sorted(owner) != list(range(len(trainable))):
        raise SplitError(f"optimizer: its groups hold parameters {sorted(owner)[:8]}, the "
                         f"layout {len(trainable)} trainable ones")
    for k, (L, name) in enumerate(trainable):
        per[L]["optimizer"][name] = {"group": owner[k], "state": opt["state"].get(k, {})}
    return {"param_groups": [{h: v for h, v in group.items() if h != "params"}
                             for group in groups]}


def _split_outer(outer: Mapping[str, Any], everyone: Sequence[tuple[int, str]],
                 per: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """File DiLoCo's outer state (globals, outer SGD state, residuals cut at the parameters'
    sizes) under ``per[L]["outer"]`` (``everyone``: the ``(layer, name)`` of every
    parameter in order); return the shared part."""
    flat = [t for seg in outer["globals"] for t in seg]
    if len(flat) != len(everyone):
        raise SplitError(f"outer: {len(flat)} DiLoCo global weights, the layout has "
                         f"{len(everyone)} parameters")
    residual: dict[int, torch.Tensor] = {}
    k = 0
    for i, seg in enumerate(outer["globals"]):
        r = outer["residuals"].get(i)
        if r is not None:
            sizes = [t.numel() for t in seg]
            if r.numel() != sum(sizes):
                raise SplitError(f"outer: residual {i} has {r.numel()} elements, its "
                                 f"segment {sum(sizes)}")
            residual.update(zip(range(k, k + len(seg)), r.reshape(-1).split(sizes)))
        k += len(seg)
    o_opt = outer["optimizer"]
    for k, ((L, name), t) in enumerate(zip(everyone, flat)):
        piece = {"global": t,
                 "state": o_opt["state"].get(k, {}) if o_opt is not None else {}}
        if k in residual:
            piece["residual"] = residual[k]
        per[L]["outer"][name] = piece
    return {"outer_step": outer["outer_step"],
            "param_groups": None if o_opt is None else [
                {h: v for h, v in g.items() if h != "params"} for g in o_opt["param_groups"]]}


def _same(a: Any, b: Any) -> bool:
    """Exact equality of two state trees (tensors: same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN is NaN here


def merge(pieces: Sequence[Snapshot]) -> Snapshot:
    """One layer-form snapshot holding every layer of ``pieces`` (layer-form snapshots
    of one step); tensors are shared, not copied.

    Raises:
        SplitError: no pieces, pieces of different steps, a layer in two pieces, or
            shared state (optimizer hyper-parameters, LR schedule, DiLoCo outer step)
            that differs between pieces (the message names the part).
    """
    if not pieces:
        raise SplitError("no snapshot pieces to merge")
    steps = {p.step for p in pieces}
    if len(steps) != 1:
        raise SplitError(f"snapshot pieces of different steps {sorted(steps)}")
    shared: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for p in pieces:
        if not is_layered(p):
            raise SplitError("merge takes layer-form snapshots (layerstate.split)")
        for part, tree in _unflatten(p.skeleton[SHARED], p.tensors).items():
            if part in shared and not _same(shared[part], tree):
                raise SplitError(f"shared state {part!r} differs between the snapshot pieces")
            shared.setdefault(part, tree)
        for k in p.skeleton:
            if k.startswith(LAYER):
                if k in state:
                    raise SplitError(f"layer {k[len(LAYER):]} is in two snapshot pieces")
                state[k] = _unflatten(p.skeleton[k], p.tensors)
    return _build(steps.pop(), {SHARED: shared, **state})


def assemble(snap: Snapshot, parts: Mapping[str, Checkpointable | None]) -> Snapshot:
    """The stage snapshot of ``parts`` (a stage's parts, with its :class:`Layout`) built
    from layer-form ``snap``; tensors are shared, not copied.

    Raises:
        SplitError: ``parts`` has no layout or a part without a rule here, ``snap``
            lacks a layer or a parameter the stage needs, or shared state the stage's
            optimizer, LR schedule or DiLoCo state needs (the message names it).
    """
    layout = parts.get(LAYOUT)
    if layout is None:
        raise SplitError("the stage has no layer layout to assemble its snapshot into")
    unknown = sorted(k for k, v in parts.items() if v is not None and k not in SPLITTABLE)
    if unknown:
        raise SplitError(f"the stage's part(s) {unknown} cannot be assembled from layers")
    first, params = _order(layout.state_dict())
    shared = _unflatten(snap.skeleton[SHARED], snap.tensors)
    per = _pieces(snap, range(first, first + len(params)))

    def need(part: str, key: str) -> Any:
        if part not in shared:
            raise SplitError(f"{part}: the snapshot pieces carry no shared {part} state")
        return shared[part][key] if key else shared[part]

    def param(L: int, part: str, name: str) -> dict:
        try:
            return per[L][part][name]
        except KeyError:
            raise SplitError(f"{part}: the snapshot pieces have no state of parameter "
                             f"{name!r} of layer {L}") from None

    out: dict[str, Any] = {LAYOUT: layout.state_dict(), "module": {
        f"{i}.{n}": t for i in range(len(params)) for n, t in per[first + i]["module"].items()}}
    if parts.get("optimizer") is not None:
        trainable = [(first + i, n) for i, layer in enumerate(params) for n, g in layer if g]
        out["optimizer"] = _assemble_optimizer(
            need("optimizer", "param_groups"),
            [param(L, "optimizer", name) for L, name in trainable])
    if parts.get("lr_scheduler") is not None:
        out["lr_scheduler"] = need("lr_scheduler", "")
    out.update(_boundary_state(parts, per, first, bool(params)))
    outer = parts.get("outer")
    if outer is not None:
        everyone = [(first + i, n) for i, layer in enumerate(params) for n, _ in layer]
        shape = [len(seg) for seg in outer.state_dict()["globals"]]
        if sum(shape) != len(everyone):
            raise SplitError(f"outer: the stage's DiLoCo state has {sum(shape)} parameters, "
                             f"its layout {len(everyone)}")
        out["outer"] = _assemble_outer(
            shape, [param(L, "outer", name) for L, name in everyone],
            need("outer", "param_groups"), need("outer", "outer_step"))
    return _build(snap.step, out)


def _boundary_state(parts: Mapping[str, Checkpointable | None], per: dict[int, Any],
                    first: int, has_layers: bool) -> dict[str, Any]:
    """The assembled stage's state of its boundaries: no lowrank basis (the boundaries
    moved), and the gradient residuals its first layer carries, if any."""
    out: dict[str, Any] = {}
    if parts.get("codec") is not None:
        out["codec"] = {"bases": {}}
    if parts.get(FEEDBACK) is not None:
        piece = per[first].get(FEEDBACK, {}) if has_layers else {}
        out[FEEDBACK] = {"boundary": first, "replica": piece.get("replica"),
                         "residuals": piece.get("residuals", [])}
    return out


def _pieces(snap: Snapshot, held: range) -> dict[int, Any]:
    """Layer-form ``snap``'s piece of each layer in ``held``, by global layer."""
    per = {}
    for L in held:
        name = f"{LAYER}{L}"
        if name not in snap.skeleton:
            raise SplitError(f"the snapshot pieces lack layer {L} (they hold {layers(snap)})")
        per[L] = _unflatten(snap.skeleton[name], snap.tensors)
    return per

def _assemble_optimizer(groups: Sequence[Mapping[str, Any]],
                        pieces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A ``torch.optim`` state dict from the shared ``groups`` and one filed piece per
    trainable parameter, in state-index order."""
    out_groups: list[dict[str, Any]] = [dict(g, params=[]) for g in groups]
    st = {}
    for k, piece in enumerate(pieces):
        out_groups[piece["group"]]["params"].append(k)
        if piece["state"]:
            st[k] = piece["state"]
    return {"state": st, "param_groups": out_groups}


def _assemble_outer(shape: Sequence[int], pieces: Sequence[Mapping[str, Any]],
                    o_groups: Sequence[Mapping[str, Any]] | None,
                    outer_step: Any) -> dict[str, Any]:
    """DiLoCo's outer state for segments of ``shape`` parameters each, from one filed
    piece per parameter in order (a segment's residual is its pieces' concatenated)."""
    globs, residuals, k = [], {}, 0
    for i, n in enumerate(shape):
        seg = pieces[k:k + n]
        globs.append([p["global"] for p in seg])
        have = [p.get("residual") for p in seg]
        if any(r is not None for r in have):  # none owed is a residual of zeros
            dtype = next(r for r in have if r is not None).dtype
            residuals[i] = torch.cat([r if r is not None else
                                      torch.zeros(p["global"].numel(), dtype=dtype)
                                      for r, p in zip(have, seg)])
        k += n
    return {"globals": globs, "outer_step": outer_step, "residuals": residuals,
            "optimizer": None if o_groups is None else {
                "state": {k: p["state"] for k, p in enumerate(pieces) if p["state"]},
                "param_groups": [dict(g, params=list(range(len(pieces)))) for g in o_groups]}}


def restore(parts: Mapping[str, Checkpointable | None], snap: Snapshot) -> None:
    """As :func:`.checkpoint.restore`, for a stage snapshot or a layer-form one (assembled
    into ``parts`` first).

    Raises:
        SplitError: as :func:`assemble`.
        WireError, RuntimeError: as :func:`.checkpoint.restore`.
    """
    _restore(parts, assemble(snap, parts) if is_layered(snap) else snap)
