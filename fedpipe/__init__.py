"""fedpipe: pipeline-parallel training of one PyTorch model across unlike machines.

Public API (imported lazily, so ``fedpipe.planner`` and ``fedpipe.wire`` stay light):
``Client``, ``Job``, ``OptimizerSpec``, ``optimizer``, ``LRSchedulerSpec``, ``lr_scheduler``,
``DiLoCo``, ``JobSpec``, ``LocalSwarm``, ``materialize``, and ``submit``'s knob groups
``Training``, ``Compression``, ``Replicas``, ``Placement``, ``Lifetime``.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Client": "fedpipe.client",
    "Job": "fedpipe.client",
    "OptimizerSpec": "fedpipe.runtime.optim",
    "DiLoCo": "fedpipe.spec",
    "JobSpec": "fedpipe.spec",
    "Training": "fedpipe.spec",
    "Compression": "fedpipe.spec",
    "Replicas": "fedpipe.spec",
    "Placement": "fedpipe.spec",
    "Lifetime": "fedpipe.spec",
    "optimizer": "fedpipe.runtime.optim",
    "LRSchedulerSpec": "fedpipe.runtime.optim",
    "lr_scheduler": "fedpipe.runtime.optim",
    "LocalSwarm": "fedpipe.testing",
    "materialize": "fedpipe.runtime.materialize",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedpipe' has no attribute {name!r}")


__all__ = list(_LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
