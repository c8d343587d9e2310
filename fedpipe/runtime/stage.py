"""One pipeline stage's training loop, independent of how tensors travel.

A stage runner runs a schedule's actions: forward passes take a
microbatch's input (first stage) or the previous stage's activation, backward
passes take the next stage's gradient (or the loss, on the last stage).
Tensors move through a :class:`Transport`, which the node implements over
gRPC. :class:`StageRunnerBase` holds the passes and the optimizer update;
its two children are siblings: :class:`SyncStageRunner` runs the flushed
schedules ("gpipe", "1f1b") step by step from :func:`fedpipe.spec.schedule_order`,
:class:`fedpipe.runtime.async_stage.AsyncStageRunner` runs "async" over
the stream of :func:`fedpipe.spec.async_stream`. Both are driven by ``run(steps)``.
"""
from __future__ import annotations

import abc
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import spec
from ..spec import Kind, StageKey
from .rng import LayerSeeds


class StageError(RuntimeError):
    """A stage cannot go on: a layer misbehaved or a peer failed.

    Attributes:
        peer: the peer (``HOST:PORT``) a send to failed, when that is why; else "".
    """

    def __init__(self, message: str, peer: str = ""):
        super().__init__(message)
        self.peer = peer


class Transport(Protocol):
    """How a stage receives and sends tensors.

    A message is named by its kind, step and tag: the tag is the microbatch
    for pipeline tensors, and a sync's own numbering (ring chunk, segment and
    holder) for :data:`~fedpipe.spec.Kind.REDUCE` and :data:`~fedpipe.spec.Kind.OUTER`.
    """

    def recv(self, kind: Kind, step: int, tag: int,
             timeout: float | None = None) -> tuple[torch.Tensor, int]:
        """Block until the tensor ``(kind, step, tag)`` sent to this stage arrives;
        return it and the step's batch size (samples).

        Raises:
            TimeoutError: nothing came within ``timeout`` seconds (None: no limit).
            StageError: an earlier send failed (the peer will not answer what it never got).
        """

    def send(self, kind: Kind, step: int, microbatch: int, tensor: torch.Tensor,
             batch_size: int) -> None:
        """Queue the tensor for the pipeline neighbour: the next stage for an
        activation, the previous one for a gradient, with the plan's codec for
        that link. May return before it is delivered.

        Raises:
            StageError: an earlier send failed.
        """

    def send_to(self, peer: StageKey, kind: Kind, step: int, tag: int, tensor: torch.Tensor,
                batch_size: int = 1, codec: str = "raw") -> None:
        """Queue the tensor for stage ``peer`` of any replica group, encoded with
        ``codec`` (a :func:`fedpipe.spec.parse_codec` string). May return before
        it is delivered.

        Raises:
            StageError: an earlier send failed.
        """


class TimedTransport:
    """A :class:`Transport` that adds up the seconds spent in it.

    Time in ``recv`` is waiting for peers; time in ``send``/``send_to`` is
    handing tensors to the senders (encoding runs on the senders' threads, so
    this is mostly queueing). Give the same object to the runner and to the
    replica syncs, so their waiting counts too.
    """

    def __init__(self, inner: Transport):
        self.inner = inner
        self.wait_seconds = 0.0
        self.send_seconds = 0.0

    def recv(self, kind: Kind, step: int, tag: int,
             timeout: float | None = None) -> tuple[torch.Tensor, int]:
        t0 = time.perf_counter()
        try:
            return self.inner.recv(kind, step, tag, timeout)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def send(self, kind: Kind, step: int, microbatch: int, tensor: torch.Tensor,
             batch_size: int) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.send(kind, step, microbatch, tensor, batch_size)
        finally:
            self.send_seconds += time.perf_counter() - t0

    def send_to(self, peer: StageKey, kind: Kind, step: int, tag: int, tensor: torch.Tensor,
                batch_size: int = 1, codec: str = "raw") -> None:
        t0 = time.perf_counter()
        try:
            self.inner.send_to(peer, kind, step, tag, tensor, batch_size, codec)
        finally:
            self.send_seconds += time.perf_counter() - t0

    def lap(self) -> tuple[float, float]:
        """``(wait, send)`` seconds since the last lap (or the start); resets both."""
        out = (self.wait_seconds, self.send_seconds)
        self.wait_seconds = self.send_seconds = 0.0
        return out


StepHook = Callable[[int], None]
"""Called with the step index (0-based) around the optimizer update."""


@dataclass(frozen=True)
class StepResult:
    """What one step of a stage did.

    Attributes:
        step: the step index (0-based).
        loss: last stage only: the step's batch-mean loss (its group's share of it).
        samples: samples this stage processed in the step.
        seconds: wall time of the step (under "async", since the previous result).
        compute_seconds: of ``seconds``, neither waiting nor sending: forward,
            backward, the optimizer and the syncs' arithmetic.
        wait_seconds: of ``seconds``, waiting in ``Transport.recv`` for peers.
        send_seconds: of ``seconds``, handing tensors to ``Transport.send``/``send_to``.
        in_flight: the most microbatches run forward but not yet backward at
            once during the step (their activations stashed for backward).
        staleness: "async" only: the most weight versions the live weights ran
            ahead of those a backward of the step computed its gradients on.
    """

    step: int
    loss: float | None
    samples: int
    seconds: float
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    send_seconds: float = 0.0
    in_flight: int = 0
    staleness: int = 0


class StageRunnerBase(abc.ABC):
    """Runs layers of a model as stage ``stage`` of ``n_stages``: the passes and the update.

    The loss of each microbatch of ``n`` samples in a batch of ``B`` is scaled
    by ``n / B`` before backward, so the accumulated gradient equals that of
    the batch-mean loss in one process (``loss_fn`` must average over the
    batch, as PyTorch losses do by default).

    Args:
        module: the stage's layers.
        optimizer: built over ``module``'s parameters; None for a stage without any.
        loss_fn: ``loss_fn(output, target) -> scalar``; used on the last stage only.
        microbatches: microbatches per step.
        transport: how tensors travel; wrapped in a :class:`TimedTransport`
            unless it is one, to split each step's time.
        before_update: called in order with the step after its last backward,
            before the optimizer step: where gradients are changed (all-reduce
            across replica groups, then clipping).
        after_update: called in order with the step after the optimizer step
            (a learning-rate scheduler, a DiLoCo outer step every H steps).
        recompute: keep only each in-flight microbatch's input and re-run the
            forward in its backward (activation recomputation; Chen et al., "Training
            Deep Nets with Sublinear Memory Cost", 2016): one more forward per backward,
            gradients bit-equal to the pass without it, dropout included.
        precision: "fp32", or "bf16-mixed": the forward under ``torch.autocast`` to
            bfloat16; the parameters, their gradients and the optimizer's state stay
            as they are (float32), and the loss is computed in float32.
        seeds: seeds each layer's forward (:class:`~fedpipe.runtime.rng.LayerSeeds`,
            built over ``module``), so dropout masks equal one process's; None: the
            layers draw from the process's RNG as it stands.

    Attributes:
        step_samples: ``(n, B)`` of the step being updated: samples this stage ran
            and the step's global batch size (set before the before-update hooks,
            which an elastic all-reduce scales by).

    Raises:
        ValueError: the last stage has no loss function, or ``precision`` is unknown.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 loss_fn: Callable | None, stage: int, n_stages: int, microbatches: int,
                 transport: Transport, *, before_update: Sequence[StepHook] = (),
                 after_update: Sequence[StepHook] = (), recompute: bool = False,
                 precision: str = "fp32", seeds: LayerSeeds | None = None):
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.stage, self.n_stages, self.microbatches = stage, n_stages, microbatches
        self.transport = transport if isinstance(transport, TimedTransport) \
            else TimedTransport(transport)
        self.before_update, self.after_update = list(before_update), list(after_update)
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.step_samples = (0, 1)
        if self.last and loss_fn is None:
            raise ValueError("the last stage needs a loss function")
        if precision not in spec.PRECISIONS:
            raise ValueError(f"precision must be one of {list(spec.PRECISIONS)}, "
                             f"got {precision!r}")
        self.recompute, self.mixed = recompute, precision == "bf16-mixed"
        self.seeds = seeds

    @abc.abstractmethod
    def run(self, steps: int, start: int = 0) -> Iterator[StepResult]:
        """Run steps ``start .. steps-1``, yielding each one's result after its update.

        ``start`` > 0 resumes a stage restored from the checkpoint of that step.

        Raises:
            StageError: a layer's output is not a single tensor, or the loss is not a scalar.
        """

    def _forward(self, step: int, m: int, params: dict[str, torch.Tensor] | None = None):
        """Receive microbatch ``m`` of ``step``, run the layers (with ``params``
        in place of the module's parameters, if given) and send the output on.

        With ``recompute`` the pass runs under ``torch.utils.checkpoint`` (non-reentrant,
        RNG state preserved): autograd keeps only the stage's input (and, on the last
        stage, the target), and backward re-runs the forward with the same dropout
        masks, so the gradients are those of the pass without it.

        Returns ``(input, output or scaled loss, batch size)``.
        """
        x, batch = self.transport.recv(Kind.INPUT if self.first else Kind.ACTIVATION, step, m)
        if not self.first and x.is_floating_point():
            x.requires_grad_(True)
        target = self.transport.recv(Kind.TARGET, step, m)[0] if self.last else None
        if self.recompute:
            out = checkpoint(self._compute, x, params, target, step, m, use_reentrant=False,
                             preserve_rng_state=True)
        else:
            out = self._compute(x, params, target, step, m)
        if self.last:
            n = x.shape[0] if x.dim() else 1
            return x, out * (n / batch), batch
        self.transport.send(Kind.ACTIVATION, step, m, out.detach(), batch)
        return x, out, batch

    def _compute(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None,
                 target: torch.Tensor | None, step: int, m: int) -> torch.Tensor:
        """The stage's layers on ``x``, microbatch ``m`` of ``step`` (under ``torch.autocast``
        to bfloat16 for "bf16-mixed", each layer seeded by ``seeds`` if given); on the last
        stage (``target`` given), the loss of their output, a float32 scalar under
        "bf16-mixed" (the output is cast up before the loss).

        Raises:
            StageError: a layer's output is not a single tensor, or the loss is not a scalar.
        """
        seeded = self.seeds.drawing(step, m, x.device) if self.seeds is not None else nullcontext()
        with seeded, torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.mixed):
            if params is None:
                out = self.module(x)
            else:
                out = torch.func.functional_call(self.module, params, (x,))
        if not isinstance(out, torch.Tensor):
            raise StageError(f"stage {self.stage}: a layer returned {type(out).__name__}, "
                             "not a single tensor")
        if target is None:
            return out
        if self.mixed and out.dtype == torch.bfloat16:
            out = out.float()
        assert self.loss_fn is not None  # __init__ refuses a last stage without one
        loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise StageError("the loss function must return a scalar tensor")
        return loss.reshape(())

    def _backward(self, step: int, m: int, x: torch.Tensor, out: torch.Tensor,
                  batch: int) -> None:
        """Backward of microbatch ``m``: from the loss (last stage) or the next
        stage's gradient; send the input's gradient to the previous stage."""
        grad = None if self.last else self.transport.recv(Kind.GRADIENT, step, m)[0]
        if out.requires_grad:  # False for a stage without parameters or input grad
            out.backward(grad)
        if not self.first and x.grad is not None:
            self.transport.send(Kind.GRADIENT, step, m, x.grad, batch)

    def _update(self, step: int) -> None:
        """After a step's last backward: the before-update hooks, the optimizer
        step, the after-update hooks."""
        for hook in self.before_update:
            hook(step)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for hook in self.after_update:
            hook(step)

    def _result(self, step: int, loss: float | None, samples: int, started: float, *,
                in_flight: int = 0, staleness: int = 0) -> StepResult:
        """The result of ``step``, timed from ``started`` (a ``time.perf_counter()``)
        with the transport's time since its last lap."""
        seconds = time.perf_counter() - started
        wait, send = self.transport.lap()
        return StepResult(step, loss, samples, seconds, max(0.0, seconds - wait - send),
                          wait, send, in_flight, staleness)


class SyncStageRunner(StageRunnerBase):
    """A stage under a flushed schedule ("gpipe" or "1f1b"): each step runs its
    forwards and backwards in :func:`fedpipe.spec.schedule_order`, then updates.

    Arguments are those of :class:`StageRunnerBase`, plus ``schedule``, a
    name in :data:`fedpipe.spec.SYNC_SCHEDULES`.

    Raises:
        ValueError: ``schedule`` is unknown or "async" (which runs on
            :class:`~fedpipe.runtime.async_stage.AsyncStageRunner`); the last
            stage has no loss function.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 loss_fn: Callable | None, schedule: str, stage: int, n_stages: int,
                 microbatches: int, transport: Transport, *,
                 before_update: Sequence[StepHook] = (), after_update: Sequence[StepHook] = (),
                 recompute: bool = False, precision: str = "fp32",
                 seeds: LayerSeeds | None = None):
        if spec.check_schedule(schedule) not in spec.SYNC_SCHEDULES:
            raise ValueError(f"schedule {schedule!r} runs on "
                             "fedpipe.runtime.async_stage.AsyncStageRunner")
        super().__init__(module, optimizer, loss_fn, stage, n_stages, microbatches, transport,
                         before_update=before_update, after_update=after_update,
                         recompute=recompute, precision=precision, seeds=seeds)
        self.actions = spec.schedule_order(schedule, stage, n_stages, microbatches)

    def run(self, steps: int, start: int = 0) -> Iterator[StepResult]:
        for step in range(start, steps):
            yield self.run_step(step)

    def run_step(self, step: int) -> StepResult:
        """Run one step: the schedule's forwards and backwards, then the update.

        Raises:
            StageError: a layer's output is not a single tensor, or the loss is not a scalar.
        """
        t0 = time.perf_counter()
        self.transport.lap()  # the step's split starts now
        stash: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        loss_sum, samples, batch, peak = 0.0, 0, 1, 0
        for action in self.actions:
            m = action.microbatch
            if action.kind == "F":
                x, out, batch = self._forward(step, m)
                samples += x.shape[0] if x.dim() else 1
                if self.last:
                    loss_sum += out.item()
                stash[m] = (x, out, batch)
                peak = max(peak, len(stash))
            else:
                self._backward(step, m, *stash.pop(m))
        self.step_samples = (samples, batch)
        self._update(step)
        return self._result(step, loss_sum if self.last else None, samples, t0,
                            in_flight=peak)
