"""Pipeline schedules: the order in which a stage runs forward and backward passes.

A schedule maps (stage, number of stages, microbatches) to a list of actions
for one optimizer step. The synchronous schedules flush the pipeline at the
end of every step, so training equals single-process gradient accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class Action:
    """Run the forward ("F") or backward ("B") pass of one microbatch."""

    kind: Literal["F", "B"]
    microbatch: int


def gpipe(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward (Huang et al., NeurIPS 2019).

    Peak activation memory: all ``microbatches`` stashed per stage.
    """
    return ([Action("F", m) for m in range(microbatches)]
            + [Action("B", m) for m in range(microbatches)])


def one_f_one_b(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """1F1B with a flush (PipeDream-Flush; Narayanan et al., "Memory-Efficient
    Pipeline-Parallel DNN Training", ICML 2021).

    Stage ``s`` runs ``min(n_stages - s - 1, M)`` warm-up forwards, then
    alternates one forward and one backward, then drains the backwards; at most
    ``n_stages - s`` microbatches are stashed at once, against M under GPipe.
    """
    warmup = min(n_stages - stage - 1, microbatches)
    actions = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        actions += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    actions += [Action("B", m) for m in range(b, microbatches)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def get(name: str) -> Callable[[int, int, int], list[Action]]:
    """The schedule called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
