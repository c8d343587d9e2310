"""Tied parameters across stages: each copy's gradient becomes the sum of every copy's.

A language model whose head reuses its input embedding's weight (GPT-2, any
``tie_word_embeddings`` model) cannot share one tensor between two stages. As
Megatron-LM does (``_allreduce_word_embedding_grads``), the stage holding the
embedding and the stage holding the head each keep a copy; both start equal
(:func:`fedpipe.runtime.materialize.materialize_layers`) and, after each step's
backward passes and before the optimizer step, every copy's gradient is replaced
by the sum of all the copies' gradients, so each copy moves as the one tied
parameter would (equal to single-process training of the tied model up to the
order of the summation: 1e-5 in float64).

Messages: a :data:`~fedpipe.spec.Kind.TIED` tensor per step from each holding stage
to each other one of its replica group, tagged ``group * TAG_STRIDE + sender stage``.
Every holder adds the parts in stage order, so the copies stay bit-for-bit equal.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..spec import Kind, StageKey
from .allreduce import StageSpan
from .stage import Transport

TAG_STRIDE = 1 << 16
"""Tags of one tie group's messages: ``group * TAG_STRIDE + sender stage`` (stages < 65536)."""

TiedCopies = Sequence[tuple[int, str]]


def _param(layer: nn.Module, name: str, index: int) -> nn.Parameter:
    found = dict(layer.named_parameters()).get(name)
    if found is None:
        raise ValueError(f"layer {index} has no parameter {name!r} (named in a tie)")
    return found


class TiedGradients:
    """A runner's ``before_update`` hook that sums tied copies' gradients (module docstring).

    Args:
        layers: this stage's layers by global index.
        me: this stage's place in the plan.
        ties: the job's tie groups, ``(layer index, parameter name)`` each.
        spans: every stage of the plan with its layers.
        transport: how the parts travel (``send_to`` a stage, ``recv`` by tag).

    Raises:
        ValueError: a tie names a parameter its layer does not have, or a layer no stage
            of this replica group holds.
    """

    def __init__(self, layers: Mapping[int, nn.Module], me: StageKey,
                 ties: Sequence[TiedCopies], spans: Sequence[StageSpan], transport: Transport):
        self.me, self.transport = me, transport
        mine = [s for s in spans if s.key.replica == me.replica]

        def holder(index: int) -> StageKey:
            for s in mine:
                if s.start <= index < s.end:
                    return s.key
            raise ValueError(f"no stage of replica group {me.replica} holds layer {index}")

        self.groups: list[tuple[int, list[nn.Parameter], list[StageKey]]] = []
        for g, group in enumerate(ties):
            params = [_param(layers[i], name, i) for i, name in group if i in layers]
            if params:
                holders = sorted({holder(i) for i, _ in group}, key=lambda k: k.stage)
                self.groups.append((g, params, holders))

    def __call__(self, step: int) -> None:
        """Give every copy this stage holds the sum of all copies' gradients.

        Raises:
            StageError: a send or receive failed (whatever the transport raises).
        """
        for g, params, holders in self.groups:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            part = grads[0].clone()
            for extra in grads[1:]:
                part += extra
            parts = {self.me.stage: part}
            for peer in holders:
                if peer != self.me:
                    self.transport.send_to(peer, Kind.TIED, step,
                                           g * TAG_STRIDE + self.me.stage, part)
            for peer in holders:
                if peer != self.me:
                    parts[peer.stage] = self.transport.recv(
                        Kind.TIED, step, g * TAG_STRIDE + peer.stage)[0]
            order = sorted(parts)
            total = parts[order[0]].clone()
            for s in order[1:]:
                total += parts[s].to(total.device)
            for p in params:
                p.grad = total.clone()

