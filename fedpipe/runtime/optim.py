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
