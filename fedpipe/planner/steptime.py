"""How a schedule turns a pipeline's stage and link times into a step: microbatches and
steps in flight, the analytic ``(sigma, period)`` of 1F1B and GPipe (and of an "async"
stream), and the seconds per optimizer step.

Seconds and microbatches only, no model or cluster: :mod:`.costs` prices the stages and
links, the search (:mod:`.partition`, :mod:`.evaluate`) and the rebalancer estimate steps
with these, and :mod:`.simulate` replays the same schedules event by event.
"""
from __future__ import annotations

from typing import Sequence


def in_flight(schedule: str, stage: int, n_stages: int, microbatches: int,
              overlap: int = 1) -> int:
    """Microbatches a stage stashes at once: all of them under GPipe, at most
    ``n_stages - stage`` under 1F1B (Narayanan et al., ICML 2021), of the ``overlap``
    steps in the pipeline at once (:func:`steps_in_flight`: "async" takes the next
    step's microbatches before a step ends)."""
    if schedule == "gpipe":
        return microbatches
    return min(overlap * microbatches, n_stages - stage)


def steps_in_flight(schedule: str, max_staleness: int) -> int:
    """Optimizer steps whose microbatches a pipeline may run at once: 1 under a schedule
    that flushes every step ("gpipe", "1f1b"); under "async", ``max_staleness + 1`` (a
    forward of step ``s`` waits only for the update of step ``s - 1 - max_staleness``:
    :func:`fedpipe.spec.async_stream`)."""
    return max_staleness + 1 if schedule == "async" else 1


def useful_overlap(overlap: int, microbatches: int, n_stages: int) -> int:
    """Of ``overlap`` steps allowed to share a pipeline of ``n_stages`` stages running
    ``microbatches`` per step, those that can: a stage keeps at most ``n_stages - stage``
    microbatches in flight, so a staleness beyond ``(microbatches + n_stages - 2) //
    microbatches`` never holds a forward back (:func:`fedpipe.spec.async_stream`)."""
    return min(overlap, 1 + (microbatches + n_stages - 2) // microbatches)


def step_estimate(sigma: float, period: float, microbatches: int, n_stages: int,
                  overlap: int = 1) -> float:
    """Analytic seconds per optimizer step of one pipeline of ``n_stages`` stages
    (:func:`pipeline_estimate`'s ``sigma`` and ``period``, the latter for the same
    ``overlap``).

    A flushed step takes ``sigma + (microbatches - 1) · period``: one microbatch's way
    through and back, then one period per further microbatch. Under PipeDream-style
    asynchronous training ``overlap`` steps share the pipeline (:func:`steps_in_flight`;
    Narayanan et al., "PipeDream", SOSP 2019): in the steady state of the stream a step
    takes the larger of its microbatches' periods, ``microbatches · period`` (the
    busiest stage or link, and 1F1B's round-trip bound over its stash depth), and a
    flushed step's time over the steps that can overlap (:func:`useful_overlap`; step
    ``s + overlap`` starts only once step ``s`` updated). With ``overlap`` 1 that is the
    flushed step (``sigma >= period``). A slow hop's latency inside a group then costs a
    fraction of a step, not a whole round trip each step.
    """
    flushed = sigma + (microbatches - 1) * period
    return max(microbatches * period,
               flushed / useful_overlap(overlap, microbatches, n_stages))


def pipeline_estimate(forward: Sequence[float], backward: Sequence[float],
                      act_busy: Sequence[float], act_total: Sequence[float],
                      grad_busy: Sequence[float], grad_total: Sequence[float],
                      microbatches: int, schedule: str, overlap: int = 1
                      ) -> tuple[float, float]:
    """Analytic ``(sigma, period)`` of one pipeline; its step takes about
    ``sigma + (microbatches - 1) · period`` seconds.

    ``sigma`` is one microbatch's way through and back: every stage's forward
    and backward plus every transfer with its latency. ``period`` is the
    steady-state seconds per microbatch: the busiest resource (a stage's
    compute, a link's sends; GPipe pays its forward and backward phases'
    bottlenecks one after the other). Under 1F1B a stage ``s`` runs the
    backward of microbatch j only after the forward of j + w_s (its warm-up
    depth w_s = n - s - 1), so every window of stages ``s..t`` bounds the period
    by its round trip (compute of s..t plus the transfers between them) over
    ``w_s + 1 - w_t = t - s + 1`` microbatches: the cycles of the schedule's
    event graph, whose largest ratio is the steady-state period (max-plus
    theory; Baccelli et al., "Synchronization and Linearity", 1992). These
    bounds make 1F1B slow over slow links. When steps overlap (``overlap`` > 1: "async"
    with staleness, :func:`steps_in_flight`) the stages run one stream of microbatches
    across steps (:func:`fedpipe.spec.async_stream`), so every window bounds the period
    whatever a step's ``microbatches`` (a flushed step with fewer microbatches than a
    window's depth never reaches its steady state).

    Args:
        forward, backward: per stage, seconds per microbatch.
        act_busy, act_total: per link i -> i+1, seconds the activation keeps
            the link busy, and busy + latency.
        grad_busy, grad_total: the same for the gradient i+1 -> i.
        microbatches: microbatches per step.
        schedule: "gpipe", else priced as 1F1B ("1f1b", "async").
        overlap: steps in the pipeline at once (:func:`steps_in_flight`).
    """
    n = len(forward)
    work = [f + b for f, b in zip(forward, backward)]
    hops = [a + g for a, g in zip(act_total, grad_total)]
    sigma = sum(work) + sum(hops)
    if schedule == "gpipe":
        period = (max([*forward, *act_busy]) + max([*backward, *grad_busy]))
        return sigma, period
    period = max([*work, *act_busy, *grad_busy])
    # microbatches each stage keeps in flight: 1F1B's warm-up plus one within a step; over
    # a stream of overlapping steps, as many as the staleness lets in: between
    # ``(overlap - 1) · m + 1`` and ``overlap · m`` as the oldest moves through its step,
    # the fewer taken, so the period is never below the stream's (up to 2x above where
    # the staleness, not the stash, bounds a deep pipeline; the simulator times it)
    depth = [min(n - s, (overlap - 1) * microbatches + 1 if overlap > 1
                 else microbatches + 1) for s in range(n)]
    for s in range(n):
        if overlap == 1 and depth[s] > microbatches:
            continue            # stage s never alternates: no steady state to bound
        trip = 0.0
        for t in range(s, n):
            trip += work[t] + (hops[t - 1] if t > s else 0.0)
            period = max(period, trip / (depth[s] + 1 - depth[t]))
    return sigma, period
