"""Dropout masks that do not depend on where a layer runs: each layer's forward draws from
the global RNG seeded from (job seed, step, replica group, microbatch, layer index).

A stage's node has its own random state, which other jobs and stages advance, so without
this a pipeline's dropout masks differ from one process's and from one run to the next.
Seeding per layer (not per stage) keeps the masks when a replan moves layer boundaries,
when a recovery replays steps, and when activation recomputation re-runs a forward in
backward; a single process gets the same masks with :class:`LayerSeeds` over the whole
model. Stages that share a process draw from one global generator: two of them computing
at once may interleave their draws (as without seeding).
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn


def layer_seed(seed: int, step: int, replica: int, microbatch: int, layer: int) -> int:
    """The seed of layer ``layer``'s forward on microbatch ``microbatch`` of ``step`` in
    replica group ``replica``: a 63-bit hash of the five (BLAKE2b, so neighbouring keys
    give unrelated streams)."""
    key = f"{seed}/{step}/{replica}/{microbatch}/{layer}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class LayerSeeds:
    """Seeds the global RNG before each child of ``module`` runs forward, inside
    :meth:`drawing` (outside it the layers draw as usual).

    Args:
        module: the stage's layers (an ``nn.Sequential``); a forward pre-hook is
            registered on each child.
        first_layer: the model's index of ``module``'s first child.
        seed: the job's seed.
        replica: the replica group the stage belongs to.
    """

    def __init__(self, module: nn.Module, first_layer: int, seed: int, replica: int = 0):
        self.seed, self.replica = seed, replica
        self.key: tuple[int, int] | None = None  # (step, microbatch) while drawing
        self._generators: list[torch.Generator] = []  # what the layers draw from, then
        for i, layer in enumerate(module.children()):
            layer.register_forward_pre_hook(self._hook(first_layer + i))

    def _hook(self, index: int) -> Any:
        def seed_layer(_module: nn.Module, _args: Any) -> None:
            if self.key is not None:
                seed = layer_seed(self.seed, self.key[0], self.replica, self.key[1], index)
                for generator in self._generators:
                    generator.manual_seed(seed)
        return seed_layer

    @contextmanager
    def drawing(self, step: int, microbatch: int, device: torch.device) -> Iterator[None]:
        """Run the layers of ``(step, microbatch)`` with their seeds; the global RNG state
        of the CPU (and of ``device`` when it is a GPU) is restored after."""
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self.key, self._generators = (step, microbatch), generators(device)
            try:
                yield
            finally:
                self.key = None


def generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a layer on ``device`` draws from: the CPU's, and the GPU's
    when ``device`` is one.

    Seeded directly, not with ``torch.manual_seed``, which also queues a seed for every
    uninitialised accelerator type (CUDA, MTIA, ...) and records a formatted stack with
    each: once per layer and microbatch, that was a third of a CPU stage's step.
    """
    if device.type != "cuda":
        return [torch.default_generator]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.default_generator, torch.cuda.default_generators[index]]
