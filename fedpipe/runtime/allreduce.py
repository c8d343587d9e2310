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

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Holder:
    """The stage of replica group ``replica`` that holds a segment."""

    replica: int
    stage: int


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, end)``, held in replica group r by ``holders[r]``."""

    index: int
    start: int
    end: int
    holders: tuple[Holder, ...]


def segments(stages: Sequence[tuple[int, int, int, int]]) -> list[Segment]:
    """Cut the layers into segments of constant holders.

    Args:
        stages: ``(replica, stage, layer_start, layer_end)`` for every stage of
            every replica group; each group must cover the same layers.

    Raises:
        ValueError: the groups do not cover the same layers contiguously.
    """
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for r, s, a, b in stages:
        groups.setdefault(r, []).append((a, b, s))
    spans = set()
    for r, ranges in groups.items():
        ranges.sort()
        if ranges[0][0] != 0 or any(x[1] != y[0] for x, y in zip(ranges, ranges[1:])):
            raise ValueError(f"replica group {r} does not cover the layers contiguously: {ranges}")
        spans.add(ranges[-1][1])
    if len(spans) != 1:
        raise ValueError(f"replica groups cover different numbers of layers: {sorted(spans)}")
    cuts = sorted({a for ranges in groups.values() for a, _, _ in ranges} | spans)
    replicas = sorted(groups)
    out = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        holders = tuple(Holder(r, next(s for lo, hi, s in groups[r] if lo <= a < hi))
                        for r in replicas)
        out.append(Segment(i, a, b, holders))
    return out


def held_segments(module: torch.nn.Module, layer_start: int, replica: int, stage: int,
                  all_stages: Sequence[tuple[int, int, int, int]]
                  ) -> list[tuple[Segment, int, list[torch.nn.Parameter]]]:
    """The segments with parameters that stage ``stage`` of group ``replica`` holds.

    Returns ``(segment, rank, params)`` in layer order: ``rank`` is this
    stage's index in ``segment.holders``, ``params`` the segment's parameters
    in ``module`` (global layers ``[layer_start, layer_start + len(module))``).
    Segments without parameters are left out: they need no sync, for any holder.

    Raises:
        ValueError: as :func:`segments`.
    """
    out = []
    for seg in segments(all_stages):
        ranks = [i for i, h in enumerate(seg.holders) if h == Holder(replica, stage)]
        params = [p for layer in range(seg.start, seg.end)
                  for p in module[layer - layer_start].parameters()] if ranks else []
        if params:
            out.append((seg, ranks[0], params))
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

    Args:
        module: the stage's layers (an ``nn.Sequential``), global layers
            ``[layer_start, layer_start + len(module))``.
        replica, stage: this stage's place in the plan.
        all_stages: ``(replica, stage, layer_start, layer_end)`` of the whole plan.
        send: ``send(to_replica, to_stage, step, tag, tensor)``: queue a tensor.
        recv: ``recv(step, tag) -> tensor``: take one sent to this stage.

    Each microbatch's loss is scaled by its share of the *global* batch, so the
    sum across groups is the full batch's gradient.
    """

    def __init__(self, module: torch.nn.Module, layer_start: int, replica: int, stage: int,
                 all_stages: Sequence[tuple[int, int, int, int]],
                 send: Callable[[int, int, int, int, torch.Tensor], None],
                 recv: Callable[[int, int], torch.Tensor]):
        self.send, self.recv = send, recv
        self.mine = held_segments(module, layer_start, replica, stage, all_stages)

    def __call__(self, step: int) -> None:
        """All-reduce this step's gradients in place."""
        for seg, rank, params in self.mine:
            world = len(seg.holders)
            nxt = seg.holders[(rank + 1) % world]
            base = seg.index * 2 * world
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in params])
            total = ring_allreduce(
                flat, rank, world,
                lambda tag, t: self.send(nxt.replica, nxt.stage, step, base + tag, t),
                lambda tag: self.recv(step, base + tag))
            offset = 0
            for p in params:
                p.grad = total[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
