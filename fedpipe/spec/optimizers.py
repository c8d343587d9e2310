"""How much state a job's optimizer keeps per parameter: the one home of that fact.

The tracker never unpickles a job's optimizer, so the client names its kind
(:func:`optimizer_kind`, sent as ``JobConfig.optimizer_kind``) and the planner
prices the stage's memory from it (:func:`state_factor`).
"""
from __future__ import annotations

from typing import Any, Mapping

OPTIMIZER_STATES: dict[str, float] = {
    "adamw": 2.0, "adam": 2.0, "nadam": 2.0, "radam": 2.0, "adamax": 2.0, "adadelta": 2.0,
    "sgd": 0.0, "sgd-momentum": 1.0, "rmsprop": 1.0, "rmsprop-momentum": 2.0,
    "adagrad": 1.0, "rprop": 2.0,
}
"""Copies of the parameters an optimizer keeps as state, by kind (torch.optim): AdamW
and Adam keep two moments, SGD with momentum one buffer, plain SGD none."""
OPTIMIZER_SCRATCH: dict[str, float] = {
    "adamw": 1.0, "adam": 1.0, "nadam": 1.0, "radam": 1.0, "adamax": 1.0,
}
"""Copies of the parameters an optimizer allocates for the length of its step, by kind:
torch's multi-tensor (foreach) Adam family takes ``sqrt`` of the second moments into a
new tensor list; SGD and momentum update in place (weight decay and Nesterov aside)."""
UNKNOWN_OPTIMIZER_SCRATCH = 1.0
"""Scratch copies assumed for an optimizer not in :data:`OPTIMIZER_STATES` (or not named)."""
UNKNOWN_OPTIMIZER_STATE = 2.0
"""State copies assumed for an optimizer not in :data:`OPTIMIZER_STATES` (or not named):
as much as AdamW's, so an unknown optimizer is never priced below what it may keep."""


def optimizer_kind(class_name: str, kwargs: Mapping[str, Any]) -> str:
    """The kind of a ``torch.optim`` optimizer class named ``class_name`` built with
    ``kwargs``: its lower-cased name, with "-momentum" for SGD or RMSprop given a
    non-zero ``momentum`` (their state depends on it)."""
    kind = class_name.lower()
    if kind in ("sgd", "rmsprop") and float(kwargs.get("momentum", 0.0) or 0.0) != 0.0:
        kind += "-momentum"
    return kind


def state_factor(kind: str) -> float:
    """Bytes a stage keeps per parameter byte for optimizer ``kind``: the weights, their
    gradients, and the optimizer's state copies (:data:`OPTIMIZER_STATES`; AdamW 4, SGD
    with momentum 3, plain SGD 2; an unknown or empty kind: :data:`UNKNOWN_OPTIMIZER_STATE`)."""
    return 2.0 + OPTIMIZER_STATES.get(kind, UNKNOWN_OPTIMIZER_STATE)


def step_scratch(kind: str) -> float:
    """Bytes optimizer ``kind`` allocates during its step per parameter byte
    (:data:`OPTIMIZER_SCRATCH`; 0 for a known kind not listed there, e.g. SGD)."""
    if kind in OPTIMIZER_SCRATCH:
        return OPTIMIZER_SCRATCH[kind]
    return 0.0 if kind in OPTIMIZER_STATES else UNKNOWN_OPTIMIZER_SCRATCH
