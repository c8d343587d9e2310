"""Schedules as data: :func:`schedule_order` gives the list of :class:`Action` a stage
runs in one step.

The runtime runs that list and the planner's simulator times that same list (as
torch.distributed.pipelining's ``_Action`` lists drive both its runtime and its dry-run
simulator).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from .errors import SpecError


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


def async_stream(stage: int, n_stages: int, microbatches: int, steps: int,
                 max_staleness: int) -> Iterator[Action]:
    """PipeDream-style 1F1B without a flush, over all ``steps * microbatches`` microbatches.

    Yields ``Action(kind, i)`` where ``i = step * microbatches + microbatch``
    is the microbatch's place in the stream. Backwards run in stream order,
    and the stage steps its optimizer right after the last backward of each
    step, so it has applied ``b // microbatches`` updates after ``b``
    backwards. The next action is the forward of the next ``i`` if all three
    hold, else the oldest pending backward:

    - microbatches remain;
    - fewer than ``n_stages - stage`` microbatches are in flight (1F1B's stash
      bound; Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for
      DNN Training", SOSP 2019);
    - ``i``'s step ``s`` is at most ``max_staleness`` steps ahead of the
      updates applied, i.e. the updates of all steps ``<= s - 1 - max_staleness``
      are applied.

    ``max_staleness=0`` gives exactly :func:`one_f_one_b` step after step (a
    flush). A stage's microbatches in flight use at most ``max_staleness + 1``
    weight versions (PipeDream-2BW uses 2: Narayanan et al., "Memory-Efficient
    Pipeline-Parallel DNN Training", ICML 2021).

    No deadlock when every stage follows its stream and sends without
    waiting: if stage ``t`` waits for activation ``i`` while stage ``t - 1``
    waits for a gradient instead of running ``i``'s forward, what holds
    ``t - 1`` back is its stash bound (then its oldest pending backward is at
    least two behind ``t``'s) or the staleness bound (then that backward is in
    a step ``t`` has already updated); either way ``t`` has sent that gradient.

    Raises:
        SpecError: ``max_staleness < 0`` or a count below its minimum.
    """
    if max_staleness < 0 or steps < 0 or microbatches < 1 or not 0 <= stage < n_stages:
        raise SpecError(f"bad async stream: stage {stage} of {n_stages}, {microbatches} "
                        f"microbatches, {steps} steps, max_staleness {max_staleness}")
    total, limit = steps * microbatches, n_stages - stage
    f = b = 0
    while b < total:
        if (f < total and f - b < limit
                and f // microbatches - b // microbatches <= max_staleness):
            yield Action("F", f)
            f += 1
        else:
            yield Action("B", b)
            b += 1


SCHEDULES = ("gpipe", "1f1b", "async")
"""Every schedule a job may name."""
SYNC_SCHEDULES = ("gpipe", "1f1b")
"""Schedules that flush every step, so training equals single-process gradient accumulation."""
_ORDERS = {"gpipe": gpipe, "1f1b": one_f_one_b,
           # one step of "async" in isolation is 1F1B's order; the runner follows
           # async_stream, which lets steps overlap (and so does the planner's simulator)
           "async": one_f_one_b}


def check_schedule(name: str) -> str:
    """``name`` if it names a schedule.

    Raises:
        SpecError: unknown name (the message lists the known ones).
    """
    if name not in SCHEDULES:
        raise SpecError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    return name


def schedule_order(name: str, stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """The actions stage ``stage`` of ``n_stages`` runs in one step of schedule ``name``.

    Raises:
        SpecError: unknown schedule.
    """
    return _ORDERS[check_schedule(name)](stage, n_stages, microbatches)
