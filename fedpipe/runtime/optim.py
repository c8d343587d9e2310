"""Optimizer and learning-rate schedule specs: a ``torch.optim`` class and its
arguments, built per stage over the stage's own parameters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.optim import lr_scheduler as _schedulers

from ..spec.optimizers import optimizer_kind


@dataclass(frozen=True)
class OptimizerSpec:
    """A ``torch.optim.Optimizer`` subclass and keyword arguments.

    Each stage builds its own optimizer over its own parameters with
    :meth:`build`, so per-parameter state (e.g. AdamW's moments) lives with
    the stage that owns the parameters.
    """

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """What the planner prices the optimizer's state by
        (:func:`fedpipe.spec.optimizers.optimizer_kind`), e.g. "adamw" or "sgd-momentum"."""
        return optimizer_kind(self.cls.__name__, self.kwargs)

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``.

        Raises:
            TypeError: ``kwargs`` do not fit the class.
        """
        return self.cls(list(params), **self.kwargs)


def optimizer(cls: type, **kwargs: Any) -> OptimizerSpec:
    """Name an optimizer for a job: ``fedpipe.optimizer(torch.optim.AdamW, lr=1e-3)``.

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer subclass, got {cls!r}")
    return OptimizerSpec(cls, dict(kwargs))


@dataclass(frozen=True)
class LRSchedulerSpec:
    """A ``torch.optim.lr_scheduler.LRScheduler`` subclass and keyword arguments.

    Each stage that has an optimizer builds the schedule over it with
    :meth:`build` and steps it once after every optimizer step (every inner
    step under DiLoCo), so all stages follow the same learning rates in
    lockstep, as one process stepping ``scheduler.step()`` after each
    ``optimizer.step()`` would. Its counters are in optimizer steps, not
    epochs: e.g. ``StepLR(step_size=100)`` decays every 100 steps, and
    ``OneCycleLR`` needs ``total_steps`` equal to the job's ``steps``.
    """

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, opt: torch.optim.Optimizer) -> _schedulers.LRScheduler:
        """The schedule over ``opt``; sets the optimizer's initial learning rates as torch does.

        Raises:
            TypeError, ValueError: ``kwargs`` do not fit the class or the optimizer
                (e.g. ``OneCycleLR`` with momentum cycling over an optimizer without momentum).
        """
        return self.cls(opt, **self.kwargs)

    def check(self, opt: OptimizerSpec) -> None:
        """Build the schedule over ``opt`` on a dummy parameter, so a bad setting
        fails at submission rather than on the nodes.

        Raises:
            ValueError: naming the schedule, when :meth:`build` fails.
            TypeError: ``opt``'s own arguments do not fit its class.
        """
        built = opt.build([torch.nn.Parameter(torch.zeros(1))])
        try:
            self.build(built)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"lr_scheduler {self.cls.__name__}({self.kwargs}) does not fit "
                             f"optimizer {opt.cls.__name__}: {type(e).__name__}: {e}") from e


def lr_scheduler(cls: type, **kwargs: Any) -> LRSchedulerSpec:
    """Name a learning-rate schedule for a job:
    ``fedpipe.lr_scheduler(torch.optim.lr_scheduler.StepLR, step_size=100, gamma=0.5)``.

    The schedule is stepped after every optimizer step (see :class:`LRSchedulerSpec`).

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.lr_scheduler.LRScheduler``
            subclass, or is ``ReduceLROnPlateau`` (it needs a metric each step,
            which the stages do not have).
    """
    if isinstance(cls, type) and issubclass(cls, _schedulers.ReduceLROnPlateau):
        raise TypeError("lr_scheduler ReduceLROnPlateau needs a metric at every step, which "
                        "the stages do not have; use a schedule over steps")
    if not (isinstance(cls, type) and issubclass(cls, _schedulers.LRScheduler)):
        raise TypeError(f"lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler "
                        f"subclass, got {cls!r}")
    return LRSchedulerSpec(cls, dict(kwargs))
