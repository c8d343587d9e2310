"""Pipeline schedules: the order in which a stage runs forward and backward passes.

A schedule maps (stage, number of stages, microbatches) to a list of actions
for one optimizer step. The synchronous schedules flush the pipeline at the
end of every step, so training equals single-process gradient accumulation.
The asynchronous one does not flush: :func:`async_stream` orders a stage's
actions over the whole run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Literal


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


def async_one_f_one_b(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """The "async" schedule's order within one step: 1F1B's (:func:`one_f_one_b`).

    Only a view for per-step tools; the runner
    (:class:`fedpipe.runtime.async_stage.AsyncStageRunner`) follows
    :func:`async_stream`, which lets steps overlap.
    """
    return one_f_one_b(stage, n_stages, microbatches)


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
        ValueError: ``max_staleness < 0`` or a count below its minimum.
    """
    if max_staleness < 0 or steps < 0 or microbatches < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"bad async stream: stage {stage} of {n_stages}, {microbatches} "
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


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "async": async_one_f_one_b,
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
