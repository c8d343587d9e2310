"""Pinned stage boundaries: where a user fixes a job's pipeline to be cut
(``submit(..., placement=Placement(stages=4, cuts=(2, 3, 4)))``), as
``torch.distributed.pipelining``'s split points or Megatron-LM's layers per stage do.

The model is an ``nn.Sequential`` of top-level children ("layers") ``0 .. n_layers - 1``.
``cuts`` are the child indices at which a new stage begins: stage ``s`` holds the children
``[bounds[s], bounds[s + 1])`` with ``bounds = (0, *cuts, n_layers)``. So ``cuts[i]`` is
both stage ``i``'s ``layer_end`` (exclusive) and stage ``i + 1``'s ``layer_start``, and
``cuts = (2, 3, 4)`` over 6 children gives the ranges ``(0, 2), (2, 3), (3, 4), (4, 6)``:
the first stage ends after child 1, the next after child 2, then child 3, and the last
holds children 4 and 5.

A job with cuts gets exactly those layer ranges in every replica group of every plan the
tracker makes for it: the first, re-plans after a loss or drain, and rebalances (which
may move stages between nodes, never the cuts). ``()`` pins nothing: the planner splits.

This module is the one home of the rule (:func:`cuts_problem`); the knob group, the job
spec, the tracker at submit and the planner all check through it.
"""
from __future__ import annotations

import numbers
from typing import Sequence


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def cuts_problem(cuts: Sequence[object], stages: int, n_layers: int | None = None
                 ) -> str | None:
    """What is wrong with ``cuts`` for a job of ``stages`` stages over ``n_layers`` layers
    (None: the layer count is not known here, so only the upper bound is not checked);
    None when nothing is.

    The rules: ``()`` is always fine (nothing pinned); otherwise every cut is an int,
    there are ``stages - 1`` of them (``stages`` must be given: 0 lets the planner choose
    the depth, which the cuts fix), each is at least 1, they strictly increase, and the
    last is below ``n_layers`` (every stage holds at least one layer).
    """
    if not cuts:
        return None
    bad = next((c for c in cuts if not _is_int(c)), None)
    if bad is not None:
        return f"each cut must be an int (a child index), got {type(bad).__name__} {bad!r}"
    return _ints_problem(tuple(int(c) for c in cuts if isinstance(c, numbers.Integral)),
                         stages, n_layers)


def _ints_problem(cuts: tuple[int, ...], stages: int, n_layers: int | None) -> str | None:
    """:func:`cuts_problem` once every cut is an int."""
    if stages != len(cuts) + 1:
        if stages == 0:
            return (f"{cuts} pins {len(cuts) + 1} stages: pass stages={len(cuts) + 1} with "
                    f"them")
        return (f"{stages} stages need {stages - 1} cut(s), one after each stage but the "
                f"last; got {len(cuts)}: {cuts}")
    if cuts[0] < 1:
        return f"cut {cuts[0]} leaves the first stage no layer: each cut must be >= 1, got {cuts}"
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            return (f"cuts must strictly increase (each stage holds at least one layer); "
                    f"{b} follows {a} in {cuts}")
    if n_layers is not None and cuts[-1] >= n_layers:
        return (f"cut {cuts[-1]} is out of range: the model has {n_layers} layers (top-level "
                f"children 0..{n_layers - 1}), so each cut must be in 1..{n_layers - 1}; "
                f"got {cuts}")
    return None


def stage_ranges(cuts: Sequence[int], n_layers: int) -> tuple[tuple[int, int], ...]:
    """Each stage's layers ``(start, end)`` as ``cuts`` split ``n_layers`` layers (valid
    cuts: :func:`cuts_problem`); ``((0, n_layers),)`` for no cuts."""
    bounds = (0, *cuts, n_layers)
    return tuple(zip(bounds, bounds[1:]))


def cuts_of(ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The cuts of a pipeline's layer ranges in stage order (``[(0, 2), (2, 3), (3, 4),
    (4, 6)]`` -> ``(2, 3, 4)``): the inverse of :func:`stage_ranges`."""
    return tuple(start for start, _ in ranges[1:])
