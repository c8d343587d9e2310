"""Asynchronous pipeline stage: PipeDream-style 1F1B without a flush, with weight stashing.

The stage runs 1F1B over the stream of all ``steps * microbatches``
microbatches (:func:`fedpipe.spec.async_stream`): forwards of step
``s + 1`` may start before the backwards of step ``s`` end. It accumulates the
gradients of a step's microbatches and steps its optimizer after the step's
last backward, as PipeDream-2BW does (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021).

Weight stashing (Narayanan et al., "PipeDream: Generalized Pipeline
Parallelism for DNN Training", SOSP 2019): a microbatch's backward computes
gradients against the weights its forward used, though the optimizer may have
updated the live weights since. Each weight version in use is a snapshot —
detached copies of the trainable parameters — that forwards run on through
``torch.func.functional_call``; after a backward the snapshot's gradients are
added to the live parameters' ``.grad``.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .. import spec
from .rng import LayerSeeds
from .stage import StageRunnerBase, StepHook, StepResult, Transport


class AsyncStageRunner(StageRunnerBase):
    """Runs layers of a model as stage ``stage`` of ``n_stages`` under ``schedule="async"``.

    Arguments are those of :class:`~fedpipe.runtime.stage.StageRunnerBase`,
    plus ``max_staleness``: how many steps a forward may run ahead of the
    optimizer updates applied (a forward of step ``s`` waits until the updates
    of steps ``<= s - 1 - max_staleness`` are applied). With
    ``max_staleness=0`` training equals "1f1b" (and single-process training).
    Steps overlap, so there is no ``run_step``: drive it with :meth:`run`.

    Memory: besides the live parameters, up to ``max_staleness + 1`` stashed
    copies of the stage's trainable parameters (each the size of the
    parameters; their gradients are moved to the live ones after each
    backward), and at most ``n_stages - stage`` microbatches' activations, as
    under 1F1B.

    Raises:
        ValueError: ``max_staleness < 0``, or the last stage has no loss function.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 loss_fn: Callable | None, stage: int, n_stages: int, microbatches: int,
                 transport: Transport, *, max_staleness: int = 1,
                 before_update: Sequence[StepHook] = (), after_update: Sequence[StepHook] = (),
                 recompute: bool = False, precision: str = "fp32",
                 seeds: LayerSeeds | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        super().__init__(module, optimizer, loss_fn, stage, n_stages, microbatches, transport,
                         before_update=before_update, after_update=after_update,
                         recompute=recompute, precision=precision, seeds=seeds)
        self.max_staleness = max_staleness
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # weight version -> params

    def run(self, steps: int, start: int = 0) -> Iterator[StepResult]:
        """Run steps ``start .. steps-1``, yielding each step's result right after its update.

        A stage resumed at ``start`` (from a checkpoint) begins with an empty
        pipeline: what was in flight before it was dropped, not replayed.

        ``seconds`` of a result (and its split) is the wall time since the
        previous one (or the start); ``loss`` (last stage only) is the step's
        batch-mean loss.

        Raises:
            StageError: a layer's output is not a single tensor, or the loss is not a scalar.
        """
        M = self.microbatches
        applied = 0  # optimizer updates applied: the live weights' version
        users: dict[int, int] = defaultdict(int)  # version -> microbatches in flight on it
        stash: dict[int, tuple] = {}
        loss: dict[int, float] = defaultdict(float)
        samples: dict[int, int] = defaultdict(int)
        peak = stale = 0  # since the last result: most in flight, most versions behind
        t0 = time.perf_counter()
        self.transport.lap()
        for action in spec.async_stream(self.stage, self.n_stages, M, steps - start,
                                        self.max_staleness):
            i = action.microbatch
            step, m = divmod(i, M)
            step += start
            if action.kind == "F":
                x, out, batch = self._forward(step, m, self._snapshot(applied))
                users[applied] += 1
                samples[step] += x.shape[0] if x.dim() else 1
                if self.last:
                    loss[step] += out.item()
                stash[i] = (x, out, batch, applied)
                peak = max(peak, len(stash))
                continue
            x, out, batch, version = stash.pop(i)
            stale = max(stale, applied - version)
            self._backward(step, m, x, out, batch)
            self._collect(self.snapshots[version])
            users[version] -= 1
            if m == M - 1:  # the step's last backward: update
                self.step_samples = (samples[step], batch)
                self._update(step)
                applied += 1
            for v in [v for v in self.snapshots if v != applied and users[v] == 0]:
                del self.snapshots[v], users[v]
            if m == M - 1:
                result = self._result(step, loss.pop(step) if self.last else None,
                                      samples.pop(step), t0, in_flight=peak, staleness=stale)
                peak, stale = len(stash), 0
                t0 += result.seconds
                yield result

    def _snapshot(self, version: int) -> dict[str, torch.Tensor]:
        """The stashed parameters of ``version``, copied from the live ones on first use."""
        if version not in self.snapshots:
            self.snapshots[version] = {n: p.detach().clone().requires_grad_(True)
                                       for n, p in self.params.items()}
        return self.snapshots[version]

    def _collect(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Move the snapshot's gradients into the live parameters' ``.grad``."""
        for name, s in snapshot.items():
            if s.grad is None:
                continue
            p = self.params[name]
            if p.grad is None:
                p.grad = s.grad
            else:
                p.grad.add_(s.grad)
            s.grad = None
