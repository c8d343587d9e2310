"""Synchronous gradient all-reduce across replica groups, for any layer split.

Replica groups may split the layers differently (a fast group in two stages,
a slow one in four). The layers are cut into *segments* where the set of
holders — one stage per replica group — is the same; each segment's
gradients are summed by a ring all-reduce among its holders (reduce-scatter
then all-gather: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009; as in Horovod and NCCL). Every
holder processes its segments in layer order and sends without waiting, so
the rings cannot deadlock. All replicas end with bit-identical sums: each
chunk is reduced on one holder and then copied.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, cast

import torch

from ..spec import Kind, StageKey
from .stage import Transport


@dataclass(frozen=True)
class StageSpan:
    """Stage ``key`` of a plan holds the global layers ``[start, end)``."""

    key: StageKey
    start: int
    end: int


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, end)``, held in replica group r by ``holders[r]``."""

    index: int
    start: int
    end: int
    holders: tuple[StageKey, ...]


class Held(NamedTuple):
    """A segment a stage holds: ``rank`` is the stage's index in ``segment.holders``,
    ``params`` the segment's parameters in the stage's module."""

    segment: Segment
    rank: int
    params: list[torch.nn.Parameter]


def segments(stages: Sequence[StageSpan]) -> list[Segment]:
    """Cut the layers into segments of constant holders.

    Args:
        stages: every stage of every replica group; each group must cover the same layers.

    Raises:
        ValueError: the groups do not cover the same layers contiguously.
    """
    groups: dict[int, list[StageSpan]] = {}
    for span in stages:
        groups.setdefault(span.key.replica, []).append(span)
    ends = set()
    for r, spans in groups.items():
        spans.sort(key=lambda x: (x.start, x.end))
        if spans[0].start != 0 or any(x.end != y.start for x, y in zip(spans, spans[1:])):
            raise ValueError(f"replica group {r} does not cover the layers contiguously: "
                             f"{[(x.start, x.end) for x in spans]}")
        ends.add(spans[-1].end)
    if len(ends) != 1:
        raise ValueError(f"replica groups cover different numbers of layers: {sorted(ends)}")
    cuts = sorted({x.start for spans in groups.values() for x in spans} | ends)
    out = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        holders = tuple(next(x.key for x in groups[r] if x.start <= a < x.end)
                        for r in sorted(groups))
        out.append(Segment(i, a, b, holders))
    return out


def held_segments(module: torch.nn.Module, me: StageKey, stages: Sequence[StageSpan]
                  ) -> list[Held]:
    """The segments with parameters that stage ``me`` holds, in layer order.

    ``module`` holds ``me``'s layers, as ``stages`` gives them.
    Segments without parameters are left out: they need no sync, for any holder.

    Raises:
        ValueError: as :func:`segments`, or ``me`` is not in ``stages``.
    """
    mine = [x for x in stages if x.key == me]
    if len(mine) != 1:
        raise ValueError(f"stage {me} appears {len(mine)} times in the plan, not once")
    layer_start = mine[0].start
    layers = cast(torch.nn.Sequential, module)  # one child per layer
    out = []
    for seg in segments(stages):
        ranks = [i for i, h in enumerate(seg.holders) if h == me]
        params = [p for layer in range(seg.start, seg.end)
                  for p in layers[layer - layer_start].parameters()] if ranks else []
        if params:
            out.append(Held(seg, ranks[0], params))
    return out


def ring_allreduce(flat: torch.Tensor, rank: int, world: int,
                   send: Callable[[int, torch.Tensor], None],
                   recv: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Sum ``flat`` (1-D) across ``world`` ring members; returns the sum.

    ``send(tag, tensor)`` goes to member ``rank + 1`` and ``recv(tag)`` takes
    what member ``rank - 1`` sent with that tag; tags run 0 … 2·(world-1)-1.
    Each member sends and receives 2·(world-1)/world of the vector.
    """
    if world == 1:
        return flat
    chunks = list(torch.tensor_split(flat.clone(), world))
    for i in range(world - 1):  # reduce-scatter
        send(i, chunks[(rank - i) % world])
        j = (rank - i - 1) % world
        chunks[j] = chunks[j] + recv(i)
    for i in range(world - 1):  # all-gather
        send(world - 1 + i, chunks[(rank + 1 - i) % world])
        chunks[(rank - i) % world] = recv(world - 1 + i)
    return torch.cat(chunks)


class GradientSync:
    """Sums a stage's gradients with the other replica groups after each step's backward passes.

    Use it as a runner's ``before_update`` hook. Messages are
    :data:`~fedpipe.spec.Kind.REDUCE` tensors, sent raw.

    Args:
        module: the stage's layers (an ``nn.Sequential``).
        me: this stage's place in the plan.
        stages: every stage of the plan with its layers.
        transport: how ring messages travel (``send_to`` the next holder,
            ``recv`` from the previous one).

    Each microbatch's loss is scaled by its share of the *global* batch, so the
    sum across groups is the full batch's gradient.

    Raises:
        ValueError: as :func:`held_segments`.
    """

    def __init__(self, module: torch.nn.Module, me: StageKey, stages: Sequence[StageSpan],
                 transport: Transport):
        self.transport = transport
        self.mine = held_segments(module, me, stages)

    def _send(self, nxt: StageKey, step: int, base: int, tag: int, t: torch.Tensor) -> None:
        """Ring message ``tag`` of a segment whose tags start at ``base``, to ``nxt``."""
        self.transport.send_to(nxt, Kind.REDUCE, step, base + tag, t)

    def _recv(self, step: int, base: int, tag: int) -> torch.Tensor:
        """Ring message ``tag`` of a segment whose tags start at ``base``, from the previous
        holder."""
        return self.transport.recv(Kind.REDUCE, step, base + tag)[0]

    def __call__(self, step: int) -> None:
        """All-reduce this step's gradients in place.

        Raises:
            StageError: a send failed (whatever the transport raises).
        """
        for seg, rank, params in self.mine:
            world = len(seg.holders)
            nxt = seg.holders[(rank + 1) % world]
            base = seg.index * 2 * world
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in params])
            total = ring_allreduce(flat, rank, world,
                                   functools.partial(self._send, nxt, step, base),
                                   functools.partial(self._recv, step, base))
            offset = 0
            for p in params:
                p.grad = total[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
