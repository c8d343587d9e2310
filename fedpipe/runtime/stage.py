"""One pipeline stage's training loop, independent of how tensors travel.

A :class:`StageRunner` runs a schedule's actions for each step: forward passes
take a microbatch's input (first stage) or the previous stage's activation,
backward passes take the next stage's gradient (or the loss, on the last
stage). Tensors move through a :class:`Transport`, which the node implements
over gRPC. The asynchronous schedule has its own runner,
:class:`fedpipe.runtime.async_stage.AsyncStageRunner`; both are driven by
``run(steps)``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from .. import spec

INPUT, TARGET, ACTIVATION, GRADIENT, REDUCE = "input", "target", "activation", "gradient", "reduce"


class StageError(RuntimeError):
    """A stage cannot go on: a layer misbehaved or a peer failed."""


class Transport(Protocol):
    """How a stage receives and sends tensors."""

    def recv(self, kind: str, step: int, microbatch: int) -> tuple[torch.Tensor, int]:
        """Block until that tensor arrives; return it and the step's batch size (samples)."""

    def send(self, kind: str, step: int, microbatch: int, tensor: torch.Tensor,
             batch_size: int) -> None:
        """Queue the tensor for the peer (next stage for activations, previous for
        gradients); may return before it is delivered. Raises StageError for an
        earlier send that failed."""


@dataclass
class StepResult:
    """What one step of a stage did: the loss (last stage only; mean over the
    batch), samples processed and wall time in seconds."""

    step: int
    loss: float | None
    samples: int
    seconds: float


class StageRunner:
    """Runs layers of a model as stage ``stage`` of ``n_stages``.

    The loss of each microbatch of ``n`` samples in a batch of ``B`` is scaled
    by ``n / B`` before backward, so the accumulated gradient equals that of
    the batch-mean loss in one process (``loss_fn`` must average over the
    batch, as PyTorch losses do by default).

    Args:
        module: the stage's layers.
        optimizer: built over ``module``'s parameters; None for a stage without any.
        loss_fn: ``loss_fn(output, target) -> scalar``; used on the last stage only.
        schedule: a synchronous name in :data:`fedpipe.spec.SYNC_SCHEDULES`
            ("async" runs on :class:`~fedpipe.runtime.async_stage.AsyncStageRunner`).
        microbatches: microbatches per step.
        grad_sync: called with the step after the backward passes, before the
            optimizer step (e.g. :class:`~fedpipe.runtime.allreduce.GradientSync`).
        after_step: called with the step after the optimizer step (e.g. a
            DiLoCo outer step every H steps).
        clip: called with the step after ``grad_sync``, before the optimizer
            step (:class:`~fedpipe.runtime.clip.GlobalNormClip`).
        lr_scheduler: stepped after every optimizer step (needs ``optimizer``).

    Raises:
        ValueError: unknown or asynchronous schedule; the last stage has no loss function.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 loss_fn: Callable | None, schedule: str, stage: int, n_stages: int,
                 microbatches: int, transport: Transport,
                 grad_sync: Callable[[int], None] | None = None,
                 after_step: Callable[[int], None] | None = None, *,
                 clip: Callable[[int], None] | None = None,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.clip, self.lr_scheduler = clip, lr_scheduler
        self.stage, self.n_stages, self.microbatches = stage, n_stages, microbatches
        if schedule == "async" and type(self) is StageRunner:
            raise ValueError("schedule 'async' runs on fedpipe.runtime.async_stage.AsyncStageRunner")
        self.actions = spec.schedule_order(schedule, stage, n_stages, microbatches)
        self.transport, self.grad_sync, self.after_step = transport, grad_sync, after_step
        self.first, self.last = stage == 0, stage == n_stages - 1
        if self.last and loss_fn is None:
            raise ValueError("the last stage needs a loss function")

    def run(self, steps: int) -> Iterator[StepResult]:
        """Run steps ``0 .. steps-1``, yielding each one's result after its optimizer step.

        Raises:
            StageError: as :meth:`run_step`.
        """
        for step in range(steps):
            yield self.run_step(step)

    def run_step(self, step: int) -> StepResult:
        """Run one step: the schedule's forwards and backwards, then the optimizer step.

        Raises:
            StageError: a layer's output is not a single tensor, or the loss is not a scalar.
        """
        t0 = time.perf_counter()
        stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum, samples = 0.0, 0
        for action in self.actions:
            m = action.microbatch
            if action.kind == "F":
                x, out, batch = self._forward(step, m)
                samples += x.shape[0] if x.dim() else 1
                if self.last:
                    loss_sum += out.item()
                stash[m] = (x, out, batch)
            else:
                self._backward(step, m, *stash.pop(m))
        self._update(step)
        return StepResult(step, loss_sum if self.last else None, samples,
                          time.perf_counter() - t0)

    def _backward(self, step: int, m: int, x: torch.Tensor, out: torch.Tensor,
                  batch: int) -> None:
        """Backward of microbatch ``m``: from the loss (last stage) or the next
        stage's gradient; send the input's gradient to the previous stage."""
        grad = None if self.last else self.transport.recv(GRADIENT, step, m)[0]
        if out.requires_grad:  # False for a stage without parameters or input grad
            out.backward(grad)
        if not self.first and x.grad is not None:
            self.transport.send(GRADIENT, step, m, x.grad, batch)

    def _update(self, step: int) -> None:
        """After a step's backwards: sync across replica groups, clip, optimizer and
        schedule step, after-step hook."""
        if self.grad_sync is not None:
            self.grad_sync(step)
        if self.clip is not None:
            self.clip(step)
        if self.optimizer is not None:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            self.after_step(step)

    def _forward(self, step: int, m: int, params: dict[str, torch.Tensor] | None = None):
        """Receive microbatch ``m`` of ``step``, run the layers (with ``params``
        in place of the module's parameters, if given) and send the output on.

        Returns ``(input, output or scaled loss, batch size)``.
        """
        x, batch = self.transport.recv(INPUT if self.first else ACTIVATION, step, m)
        if not self.first and x.is_floating_point():
            x.requires_grad_(True)
        if params is None:
            out = self.module(x)
        else:
            out = torch.func.functional_call(self.module, params, (x,))
        if not isinstance(out, torch.Tensor):
            raise StageError(f"stage {self.stage}: a layer returned {type(out).__name__}, "
                             "not a single tensor")
        if self.last:
            target, _ = self.transport.recv(TARGET, step, m)
            loss = self.loss_fn(out, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise StageError("the loss function must return a scalar tensor")
            n = x.shape[0] if x.dim() else 1
            return x, loss.reshape(()) * (n / batch), batch
        self.transport.send(ACTIVATION, step, m, out.detach(), batch)
        return x, out, batch
