"""Optimizer specs: a ``torch.optim`` class and its arguments, built per stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """A ``torch.optim.Optimizer`` subclass and keyword arguments.

    Each stage builds its own optimizer over its own parameters with
    :meth:`build`, so per-parameter state (e.g. AdamW's moments) lives with
    the stage that owns the parameters.
    """

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

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
class DiLoCo:
    """DiLoCo replica sync: groups train alone for ``inner_steps`` steps, then an outer step.

    At an outer step each stage's pseudo-gradient (its weights at the last
    outer step minus its weights now) is averaged across the replica groups
    and applied by SGD with Nesterov momentum. Source: Douillard et al.,
    "DiLoCo: Distributed Low-Communication Training of Language Models"
    (2023), whose defaults (outer lr 0.7, momentum 0.9) these are.

    Attributes:
        inner_steps: H, optimizer steps between outer steps (>= 1).
        outer_lr: outer learning rate.
        outer_momentum: Nesterov momentum (0: plain SGD).
        compression: codec of the pseudo-gradients on the wire ("none" or a codec spec).
    """

    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"

    def __post_init__(self):
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"need outer_lr > 0 and 0 <= outer_momentum < 1, got "
                             f"{self.outer_lr}, {self.outer_momentum}")
