"""``benchmarks/wan.py --e2e``: one end-to-end run each of raw fp32 and of the best
configuration over the shaped swarm, the check that wan's T predicts the product (issue 23).

wan.py's T is two measurements joined: steps to target counted in one process
(:class:`wan_converge.Convergence`) times a steady step time from a short job on the shaped
swarm. Here a job runs the whole way instead, for each of raw and the best configuration
(:func:`wan_netns.best_config`, or ``--best``), on a :class:`fedpipe.testing.LocalSwarm` whose
every pair of nodes is joined by wan's emulated link (:func:`wan.link_profile`):

* the job (:func:`job_of`): the configuration's median seed
  (:meth:`wan_converge.Convergence.median_seed`: the seed whose steps to target are the
  median of the seeds', the run the table's step count stands for), its model and data, to
  that seed's first evaluated step at or under the target
  (:meth:`wan_converge.Curve.evaluated_steps_to`): the same run as that seed's in-process
  curve, stopped where that curve shows the target reached, and judged there. Not the
  table's count: that is interpolated between evaluations 25 steps apart
  (:meth:`wan_converge.Curve.steps_to`), a step no evaluation scored (had2 seed 1: 620.3,
  and at step 621 its loss is 1.4633 against a target of 1.4495; at 625, 1.4438); nor seed
  0 at the median's count (had2's seeds need 693.6, 620.3 and 616.9 steps). 4 stages cut
  where the in-process steps were counted (``Setup.cuts``, pinned), 1F1B, as
  :func:`wan.submit` submits every wan job;
* its wall time: seconds from its first step event to its last (so ``steps - 1`` step gaps;
  the swarm's start and the job's set-up are left out, as T leaves them out);
* its trained weights (:meth:`fedpipe.client.Job.state_dict`), scored on wan's held-out
  windows as the in-process trainer's deployed evaluation scores them
  (:func:`wan_converge.evaluate`: the activations through the configuration's codecs, at the
  job plan's stage boundaries), and, to tell the training from the codecs' cost at
  evaluation, without codecs.

Printed per configuration: steps run (the seed's first evaluated step at or under the
target), the seed that ran, its interpolated steps to target and the table's (the median of
the seeds' interpolated), the wall time, the predicted T (steps run × the table's steady step
time; without one, e.g. ``--no-swarm``, the job's own), their ratio, the held-out loss against
the target, whether the job reached it (at or under), and that seed's in-process held-out
loss at the same evaluated step. The swarm's nodes do not hand out a lowrank codec's bases, so a
lowrank configuration is scored with bases made afresh from the trained model's activations
on the job's last batch (an approximation of the nodes' bases, which the trainer refreshed
every ``@N`` steps).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import fedpipe.spec  # noqa: E402
import wan  # noqa: E402
import wan_converge  # noqa: E402
from fedpipe.examples.text import pydoc_text, text_batches  # noqa: E402

SWARM_TIMEOUT = 180.0
"""Seconds the swarm's tracker and 4 nodes may take to come up (a loaded machine)."""


@dataclass(frozen=True)
class Run:
    """One end-to-end job and what its trained weights score."""

    config: str
    seed: int                  # the seed whose model and data it ran (wan_converge.Curve.seed)
    steps: int                 # steps the job ran
    wall: float                # seconds, first step event to last
    steady: float              # the job's own steady step time, seconds (:func:`wan.steady`)
    loss: float                # held-out loss of its weights, as deployed
    plain: float               # ... and without codecs (the weights alone)
    cuts: tuple[int, ...]      # its plan's stage boundaries (fedpipe.spec.cuts)


cuts_of = fedpipe.spec.cuts_of
"""The stage boundaries of a plan's layer ranges (``[(0, 2), (2, 3), ...]`` -> ``(2, 3, ...)``),
as :func:`wan_converge.staged_forward` takes them and ``fedpipe.Placement(cuts=...)`` pins them."""


def deployed_loss(setup: wan_converge.Setup, config: wan_converge.Config,
                  state: dict[str, torch.Tensor], cuts: tuple[int, ...],
                  held: tuple[torch.Tensor, torch.Tensor], last_batch: torch.Tensor) -> float:
    """The held-out loss of ``state`` (the model's state_dict) with ``config``'s codecs at
    ``cuts``, as :func:`wan_converge.evaluate` scores the in-process trainer's model. A lowrank
    codec's bases are first made from the activations of ``last_batch``'s first
    microbatch (``(batch, seq)`` byte ids: the job's last inputs)."""
    model = setup.model(0)
    model.load_state_dict(state)
    links = [wan_converge.Link(i, config) for i in range(len(cuts))]
    if "lowrank" in config.activations:
        with torch.no_grad():
            for link in links:
                link.step = 0
            wan_converge.staged_forward(model, links, cuts, last_batch.chunk(setup.microbatches)[0])
            for link in links:
                link.step = None
    return wan_converge.evaluate(model, links, cuts, held)


def last_batch(setup: wan_converge.Setup, steps: int, *, seed: int) -> torch.Tensor:
    """The inputs of step ``steps`` of ``seed``'s data (as :func:`wan.submit` feeds them)."""
    batches = text_batches(pydoc_text()[0], setup.batch, setup.seq, seed=seed)
    for _ in range(steps - 1):
        next(batches)
    return next(batches)[0]


def run(swarm: Any, setup: wan_converge.Setup, config: wan_converge.Config, steps: int, seed: int,
        held: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """A job of ``steps`` steps of ``config`` on ``swarm``, ``seed``'s model and data,
    timed and scored. Raises RuntimeError when the job ends short of ``steps``."""
    job = wan.submit(swarm, setup, config, steps, seed=seed)
    times = [ev.time for ev in job.events() if ev.step > 0]
    status = job.wait(progress=False)
    if status.step < steps:
        raise RuntimeError(f"the {config.name} job ended at step {status.step} of {steps}: "
                           f"{status}")
    state = job.state_dict()
    job.release()
    cuts = cuts_of(wan.plan_ranges(status.plan))
    batch = last_batch(setup, steps, seed=seed)
    loss = deployed_loss(setup, config, state, cuts, held, batch)
    plain = deployed_loss(setup, wan_converge.CONFIGS["raw"], state, cuts, held, batch)
    return Run(config.name, seed, steps, times[-1] - times[0], wan.steady(times), loss, plain,
               cuts)


def job_of(conv: wan_converge.Convergence, name: str) -> tuple[wan_converge.Curve, int]:
    """The run an end-to-end job of ``name`` repeats and how far: its median seed's curve
    (:meth:`wan_converge.Convergence.median_seed`) and that curve's first evaluated step at or under
    ``conv.target`` (:meth:`wan_converge.Curve.evaluated_steps_to`), where the job is judged. Raises
    SystemExit when ``conv`` has no curves of ``name`` or its median seed never reached the
    target in process (no step count to run)."""
    if name not in conv.curves:
        raise SystemExit(f"--e2e: no curves of {name!r} (have {', '.join(conv.curves)})")
    curve = conv.median_seed(name)
    steps = curve.evaluated_steps_to(conv.target)
    if not math.isfinite(steps):
        raise SystemExit(f"--e2e: {name}'s median seed {curve.seed} never reached the "
                         f"target {conv.target:.4f} in process, so there is no step count "
                         "to run end to end")
    return curve, int(steps)


def line(r: Run, conv: wan_converge.Convergence, step_time: float,
         setup: wan_converge.Setup) -> str:
    """The report of ``r``: against T predicted with ``step_time`` (nan: the job's own),
    beside its seed's in-process curve in ``conv``: the first evaluated step at or under the
    target (what the job ran, :func:`job_of`) and the interpolated steps to target (the
    seed's and the median of the seeds', the table's)."""
    told = math.isfinite(step_time)
    st = step_time if told else r.steady
    predicted = r.steps * st
    curve = next(c for c in conv.curves[r.config] if c.seed == r.seed)
    return (f"e2e {r.config:<10} {r.steps:5d} steps, seed {r.seed} (its first evaluated step "
            f"at or under the target {curve.evaluated_steps_to(conv.target):.0f}; its "
            f"interpolated steps to target {curve.steps_to(conv.target):.1f}, the median of "
            f"{len(conv.curves[r.config])} seeds' {conv.steps(r.config):.1f}, the table's); "
            f"wall {r.wall:7.1f} s; predicted T "
            f"{predicted:7.1f} s ({r.steps} x {st * 1e3:.1f} ms, "
            f"{'the table' if told else 'this job'}'s step); wall/T {r.wall / predicted:.3f}; "
            f"held-out loss {r.loss:.4f} vs target {conv.target:.4f}: "
            f"{'reached' if r.loss <= conv.target else 'NOT reached'} "
            f"(without codecs {r.plain:.4f}; in-process seed {r.seed} at its last evaluation "
            f"<= step {r.steps}: {curve.at(r.steps):.4f}; "
            f"the job's own step {r.steady * 1e3:.1f} ms"
            + ("" if r.cuts == setup.cuts else f"; its plan cut at {r.cuts}") + ")")


def check(setup: wan_converge.Setup, conv: wan_converge.Convergence, shaped: dict[str, float],
          profile: dict, best: str, log: Callable[[str], None] = print) -> list[Run]:
    """Raw's and ``best``'s end-to-end jobs on one swarm shaped by ``profile``, each its
    median seed's to that seed's first evaluated step at or under the target
    (:func:`job_of`), reported by ``log`` against its T from ``shaped`` (seconds per step;
    nan or absent: the job's own steady step time). Raises SystemExit (before any swarm
    starts) when a configuration has no curves or its median seed never reached the target
    in process."""
    names = ["raw"] + ([best] if best != "raw" else [])
    jobs = {name: job_of(conv, name) for name in names}
    from fedpipe.testing import LocalSwarm

    held = wan_converge.held_out(setup)
    runs = []
    with LocalSwarm(n_nodes=setup.blocks, link_profile=profile, timeout=SWARM_TIMEOUT) as swarm:
        for name, (curve, steps) in jobs.items():
            r = run(swarm, setup, wan_converge.CONFIGS[name], steps, curve.seed, held)
            log(line(r, conv, shaped.get(name, math.nan), setup)
                + f"; load {os.getloadavg()[0]:.2f}")
            runs.append(r)
    return runs


def main(setup: wan_converge.Setup, conv: wan_converge.Convergence, shaped: dict[str, float],
         args: argparse.Namespace) -> list[Run]:
    """``wan.py --e2e``: raw's and the best configuration's (``--best``, or
    :func:`wan_netns.best_config` by ``shaped``'s step times) jobs, on links of ``args``'
    bandwidth and latency."""
    import wan_netns

    best = args.best or wan_netns.best_config(conv, shaped)
    print(f"\nend to end on the shaped swarm: raw and the best configuration, {best}",
          flush=True)
    return check(setup, conv, shaped, wan.link_profile(setup.blocks, args.mbps,
                                                       args.latency_ms),
                 best, log=lambda s: print(s, flush=True))
