"""Slow links, scored as the field scores them: T = steps to a target loss × steady step time.

The task: a causal character transformer (:func:`fedpipe.examples.text.char_transformer`,
4 blocks) in 4 stages on byte-level ``pydoc_data.topics`` text, the last 10 % held out.
Every stage boundary is a link of the command line's bandwidth and latency.

Two measurements per codec configuration, each where it can be made on 2 cores:

* **steps to target**, in this process (``benchmarks/wan_converge.py``): the model runs
  with the codec's own encode + decode at each of the 3 stage boundaries, activations
  forward and gradients backward, as the node's peers run them. The target is the
  held-out loss raw fp32 reaches at 80 % of the budget (median of the seeds); a seed's
  steps to target are interpolated between evaluations
  (:meth:`wan_converge.Curve.steps_to`), the table's the median of the seeds';
* **steady step time**, over a real swarm (:class:`fedpipe.testing.LocalSwarm`,
  4 nodes, 4 stages, every pair of nodes joined by an emulated link,
  :mod:`fedpipe.net.emulation`): the median gap between step events after
  warm-up.

Then T = steps × step time, against raw fp32's T; the unshaped floor is raw's
steps × its step time on the same swarm without shaping. Bytes/token are the
codec outputs' bytes (zstd included) that crossed one boundary, per token.

    python benchmarks/wan.py [--quick] [--mbps M] [--latency-ms L] [--budget N]
                             [--seeds S] [--configs a,b,...] [--swarm-steps N]
                             [--swarm-configs a,b,...] [--plot wan.png] [--no-swarm]
                             [--netns [--best NAME]] [--save-curves F] [--seed-list S]
                             [--load-curves F,...] [--swarm-only] [--save-times F]
                             [--load-times F] [--e2e [--best NAME]] [--jobs N]

``--jobs N`` (default 2) trains N (configuration, seed) runs at once, a process each
(``benchmarks/pool.py``); every run is seeded by itself, so the curves are the same for
any N.

On a loaded machine the two parts can run apart: ``--save-curves`` (with ``--configs``
and ``--seed-list``, a part per process) keeps each seed's curve as it is trained,
``--swarm-only --save-times`` the swarm's step times, and ``--load-curves ...
--load-times ...`` joins them into the report and the plot.

``--netns`` (root, iproute2): instead of the emulated swarm, the stages in network
namespaces over veths shaped with ``tc ... tbf`` at ``--mbps`` (bandwidth only: no
latency), fedpipe's raw and best configurations beside torch.distributed.pipelining, T
side by side (``benchmarks/wan_netns.py``).

``--e2e``: then one job each of raw and of the best configuration runs the whole way on the
shaped swarm, as its median seed ran in process, to that seed's first evaluated step at or
under the target (:meth:`wan_converge.Curve.evaluated_steps_to`: the step its curve shows
reached, not the interpolated count): its wall time against the predicted T, its trained
weights' held-out loss there against the target (``benchmarks/wan_e2e.py``).

Full run: a budget of 1,000 steps and 3 seeds of each of
:data:`wan_converge.DEFAULT`'s configurations (``--configs all``: every one), with
``--e2e --plot F`` the whole benchmark in one command. ``--quick``: a smoke run (a
small budget, 1 seed, few swarm steps) in under 2 minutes on an idle machine.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import fedpipe  # noqa: E402
from fedpipe.examples.text import lm_loss, pydoc_text, text_batches  # noqa: E402
from wan_converge import (CONFIGS, DEFAULT, TARGET_AT, Config, Convergence, Setup,  # noqa: E402
                          convergence, load_curves, train_all)

SCHEDULE = "1f1b"     # the pipeline schedule of every swarm job (and of torch's, --netns)
WARMUP_STEPS = 2     # steps left out of a steady step time
QUICK_SWARM = ("raw", "int8", "had4")  # --quick times these on the swarm (a swarm job costs
                                       # seconds of set-up on a loaded machine)


# -- step time, over a shaped swarm ----------------------------------------------

def link_profile(n_nodes: int, mbps: float, latency_ms: float) -> dict:
    """Every pair of nodes joined by the same emulated link, so any placement is shaped."""
    groups = {f"n{i}": [f"node{i}"] for i in range(n_nodes)}
    links = [{"from": f"n{i}", "to": f"n{j}", "mbps": mbps, "latency_ms": latency_ms}
             for i, j in itertools.combinations(range(n_nodes), 2)]
    return {"groups": groups, "links": links}


def steady(times: list[float]) -> float:
    """Median seconds between consecutive step times after :data:`WARMUP_STEPS` steps
    (nan: too few steps)."""
    gaps = [b - a for a, b in zip(times, times[1:])][WARMUP_STEPS:]
    return statistics.median(gaps) if gaps else math.nan


def timed_job(swarm: Any, setup: Setup, config: Config,
              steps: int) -> tuple[float, list[tuple[int, int]]]:
    """One 4-stage job of ``steps`` steps on ``swarm``: its steady step time, seconds, and
    its plan's layer range ``(start, end)`` per stage (children of :meth:`Setup.model`)."""
    job = submit(swarm, setup, config, steps, seed=0)
    times = [ev.time for ev in job.events() if ev.step > 0]
    status = job.wait(progress=False)
    job.release()
    return steady(times), plan_ranges(status.plan)


def submit(swarm: Any, setup: Setup, config: Config, steps: int, *, seed: int) -> Any:
    """A 4-stage job of ``steps`` steps on ``swarm`` with ``config``'s codecs, ``seed``'s
    model and data, cut at :attr:`Setup.cuts` (as :func:`wan_converge.train` trains
    ``seed``; a codec's cost in steps depends on where the boundaries are): the
    :class:`fedpipe.client.Job`."""
    return swarm.client().submit(
        setup.model(seed), lm_loss, fedpipe.optimizer(torch.optim.AdamW, lr=setup.lr),
        text_batches(pydoc_text()[0], setup.batch, setup.seq, seed=seed), steps=steps,
        microbatches=setup.microbatches, schedule=SCHEDULE,
        placement=fedpipe.Placement(stages=setup.blocks, cuts=setup.cuts),
        replicas=1, compression=config.compression())


def plan_ranges(plan: Any) -> list[tuple[int, int]]:
    """A job plan's layer range ``(start, end)`` per stage, in stage order."""
    ranges = sorted((a.stage, a.layer_start, a.layer_end) for a in plan.stages)
    return [(start, end) for _, start, end in ranges]


def step_time(swarm: Any, setup: Setup, config: Config, steps: int) -> float:
    """Median seconds between consecutive steps of a 4-stage job, after
    :data:`WARMUP_STEPS` warm-up steps."""
    return timed_job(swarm, setup, config, steps)[0]


def step_times(setup: Setup, configs: list[Config], steps: int, profile: dict | None,
               log=print) -> dict[str, float]:
    from fedpipe.testing import LocalSwarm

    out = {}
    with LocalSwarm(n_nodes=setup.blocks, link_profile=profile, timeout=180) as swarm:
        for config in configs:
            out[config.name] = step_time(swarm, setup, config, steps)
            log(f"  {'shaped' if profile else 'unshaped':<8} {config.name:<10} step "
                f"{out[config.name] * 1e3:8.1f} ms; load {os.getloadavg()[0]:.2f}")
    return out


# -- the ratio the defaults are chosen by ----------------------------------------

def stage_compute_seconds(setup: Setup, reps: int = 10) -> float:
    """Median seconds of one middle stage's forward + backward over a whole step's batch."""
    block = setup.model(0)[2]
    x = torch.randn(setup.batch, setup.seq, setup.d, requires_grad=True)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for xm in x.detach().chunk(setup.microbatches):
            xm.requires_grad_(True)
            block(xm).sum().backward()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def link_seconds(setup: Setup, mbps: float, latency_ms: float) -> float:
    """Seconds raw fp32 activations of one step keep one boundary busy, one way."""
    nbytes = setup.batch * setup.seq * setup.d * 4
    return nbytes / (mbps * 1e6 / 8) + setup.microbatches * latency_ms / 1e3


# -- the report ------------------------------------------------------------------

def report(conv: Convergence, shaped: dict[str, float], floor: float, tokens: int) -> None:
    raw_t = conv.steps("raw") * shaped["raw"]  # nan without a swarm: T/T_raw then nan
    print(f"\ntarget held-out loss {conv.target:.4f} (raw fp32 at {TARGET_AT:.0%} of "
          f"{conv.budget} steps); T = steps to target (interpolated between evaluations, median "
          f"of the seeds) x steady step time")
    print(f"{'config':<11} {'act B/tok':>9} {'grad B/tok':>10} {'steps':>7} {'step ms':>8} "
          f"{'T s':>8} {'T/T_raw':>8} {'final loss':>10} {'vs raw':>7}")
    for name in conv.curves:
        fwd, bwd = conv.bytes_per_token(name)
        steps, st = conv.steps(name), shaped.get(name, math.nan)
        t = steps * st
        final = conv.final(name)
        print(f"{name:<11} {fwd:9.1f} {bwd:10.1f} {steps:7.0f} {st * 1e3:8.1f} {t:8.1f} "
              f"{t / raw_t:8.3f} {final:10.4f} {(final / conv.final('raw') - 1) * 100:+6.1f}%")
    if math.isfinite(floor):  # not measured with --no-swarm or --netns
        print(f"unshaped floor: raw steps x unshaped step time = {conv.steps('raw'):.0f} x "
              f"{floor * 1e3:.1f} ms = {conv.steps('raw') * floor:.1f} s "
              f"({conv.steps('raw') * floor / raw_t:.3f} of shaped raw's T)")
    print(f"({tokens} tokens per step; bytes/token are per boundary, each of the 3)")


def plot(conv: Convergence, shaped: dict[str, float], path: str) -> None:
    """Held-out loss against modelled wall time (step x steady step time), every
    configuration's first seed, in one figure at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curves in conv.curves.items():
        if math.isfinite(shaped.get(name, math.nan)):
            c = curves[0]
            ax.plot([s * shaped[name] for s in c.steps], c.losses, label=name)
    ax.axhline(conv.target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("wall time, s (steps x steady step time over the shaped links)")
    ax.set_ylabel("held-out loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 2 min when idle)")
    ap.add_argument("--mbps", type=float, default=0.0, help="link bandwidth, Mbit/s (default "
                    "12: raw fp32 activations take ~10x a stage's compute; --quick 2)")
    ap.add_argument("--latency-ms", type=float, default=5.0, help="one-way link latency, ms")
    ap.add_argument("--budget", type=int, default=0, help="training steps (default 1000; "
                    "--quick 50)")
    ap.add_argument("--seeds", type=int, default=0, help="seeds (default 3; --quick 1)")
    ap.add_argument("--swarm-steps", type=int, default=0, help="steps per swarm job "
                    "(default 20; --quick 7)")
    ap.add_argument("--swarm-configs", default="", help="configurations whose step time the "
                    f"swarm measures (default: --configs; --quick {','.join(QUICK_SWARM)})")
    ap.add_argument("--configs", default=",".join(DEFAULT),
                    help=f"comma-separated, raw first, or all (default {','.join(DEFAULT)}): "
                    f"{', '.join(CONFIGS)}")
    ap.add_argument("--jobs", type=int, default=2, help="training runs (configuration, "
                    "seed) at once, a process each (default 2: this machine's 2 cores)")
    ap.add_argument("--no-swarm", action="store_true", help="steps to target only")
    ap.add_argument("--netns", action="store_true", help="instead of the emulated swarm: "
                    "fedpipe (raw, then its best) beside torch.distributed.pipelining, the "
                    "stages in network namespaces over veths shaped with tc tbf at --mbps, "
                    "no latency (benchmarks/wan_netns.py; needs root and iproute2)")
    ap.add_argument("--best", default="", help="--netns, --e2e: fedpipe's best configuration "
                    "(default: among those within 1.3x raw's steps to target and 2%% of its "
                    "final loss, the least T; without step times, the fewest bytes/token)")
    ap.add_argument("--e2e", action="store_true", help="after the table: a job each of raw "
                    "and the best configuration on the shaped swarm, its median seed's model "
                    "and data to that seed's first evaluated step at or under the target, "
                    "wall time against T, held-out loss there against the target "
                    "(benchmarks/wan_e2e.py)")
    ap.add_argument("--plot", default="", help="write the loss-against-wall-time plot here (PNG)")
    ap.add_argument("--save-curves", default="", help="write the trained curves here (JSON), "
                    "after each configuration")
    ap.add_argument("--seed-list", default="", help="comma-separated seeds to train "
                    "(default 0 to --seeds - 1), to split a run over processes with "
                    "--save-curves and join them with --load-curves")
    ap.add_argument("--load-curves", default="", help="comma-separated JSON files of "
                    "--save-curves: train nothing, take steps to target from them (the "
                    "configurations are theirs; --configs then only picks the swarm's)")
    ap.add_argument("--swarm-only", action="store_true", help="train nothing: time the "
                    "swarm configurations on the shaped swarm and write the step times to "
                    "--save-times")
    ap.add_argument("--save-times", default="", help="write the swarm's step times here (JSON)")
    ap.add_argument("--load-times", default="", help="take the step times from this JSON file "
                    "of --save-times instead of measuring them")
    args = ap.parse_args(argv)
    if args.configs == "all":
        args.configs = ",".join(CONFIGS)
    return args


def setup_of(args: argparse.Namespace) -> Setup:
    if args.quick:
        return Setup(d=32, seq=32, batch=16, budget=args.budget or 50, eval_every=10,
                     seeds=args.seeds or 1, held_windows=64)
    return Setup(budget=args.budget or 1000, seeds=args.seeds or 3)


def swarm(setup: Setup, args: argparse.Namespace, wire: float) -> tuple[dict[str, float], float]:
    """Steady step times over the shaped swarm of ``args``' swarm configurations, and the
    unshaped floor: raw's step time without shaping."""
    steps = args.swarm_steps or (7 if args.quick else 20)
    names = args.swarm_configs or (",".join(QUICK_SWARM) if args.quick else args.configs)
    timed = [CONFIGS[n] for n in names.split(",")]
    t0 = time.monotonic()
    shaped = step_times(setup, timed, steps, link_profile(setup.blocks, args.mbps,
                                                          args.latency_ms))
    floor = step_times(setup, [CONFIGS["raw"]], steps, None)["raw"]
    print(f"  swarm measurements took {time.monotonic() - t0:.0f} s; raw fp32's link time "
          f"is {wire / floor:.1f}x the unshaped swarm's step time", flush=True)
    return shaped, floor


def save_times(path: str, shaped: dict[str, float], floor: float) -> None:
    """Write the swarm's step times (seconds) and the unshaped floor to ``path`` (JSON)."""
    import json

    Path(path).write_text(json.dumps({"shaped": shaped, "floor": floor}))


def load_times(path: str) -> tuple[dict[str, float], float]:
    """The step times and floor :func:`save_times` wrote to ``path``."""
    import json

    doc = json.loads(Path(path).read_text())
    return {k: float(v) for k, v in doc["shaped"].items()}, float(doc["floor"])


def steps_to_target(setup: Setup, args: argparse.Namespace,
                    configs: list[Config]) -> Convergence | None:
    """The configurations' convergence: trained here, or loaded (``--load-curves``); None
    when this process trained only a part of them, without raw's (``--save-curves``)."""
    if args.load_curves:
        conv = convergence(setup, load_curves(args.load_curves.split(","), setup))
        print(f"curves of {', '.join(conv.curves)} from {args.load_curves}", flush=True)
        return conv
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else None
    curves = train_all(setup, configs, log=lambda s: print(s, flush=True),
                       save=args.save_curves, seeds=seeds, jobs=args.jobs)
    if "raw" not in curves:  # a part of the configurations, raw's curves elsewhere
        print(f"curves saved to {args.save_curves}; no target without raw's")
        return None
    return convergence(setup, curves)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup = setup_of(args)
    args.mbps = args.mbps or (2.0 if args.quick else 12.0)
    configs = [CONFIGS[n] for n in args.configs.split(",")]
    if configs[0].name != "raw" and not (args.save_curves or args.swarm_only):
        raise SystemExit("--configs must start with raw: it sets the target")
    if args.swarm_only and not args.save_times:
        raise SystemExit("--swarm-only needs --save-times: where its step times go")
    if args.e2e and (args.netns or args.swarm_only):
        raise SystemExit("--e2e runs on the emulated swarm: not with --netns or --swarm-only")
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} cores; load %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    compute = stage_compute_seconds(setup)
    wire = link_seconds(setup, args.mbps, 0.0 if args.netns else args.latency_ms)
    print(f"model: char transformer d={setup.d}, {setup.blocks} blocks, context {setup.seq}, "
          f"batch {setup.batch} in {setup.microbatches} microbatches, 4 stages; link "
          f"{args.mbps:g} Mbit/s, "
          + ("no latency (--netns: tbf shapes bandwidth only)" if args.netns
             else f"{args.latency_ms:g} ms one way"))
    print(f"raw fp32 activations per step and boundary: {wire * 1e3:.1f} ms on the link, "
          f"a stage's compute {compute * 1e3:.1f} ms: ratio {wire / compute:.1f}x", flush=True)
    if args.swarm_only:
        save_times(args.save_times, *swarm(setup, args, wire))
        print(f"step times saved to {args.save_times}")
        return
    conv = steps_to_target(setup, args, configs)
    if conv is None:
        return
    shaped, floor = {name: math.nan for name in conv.curves}, math.nan
    if args.load_times:
        measured, floor = load_times(args.load_times)
        shaped |= measured
        print(f"step times from {args.load_times}", flush=True)
    elif args.netns:
        import wan_netns

        best = args.best or wan_netns.best_config(conv, {})
        print(f"fedpipe's best configuration: {best}", flush=True)
        shaped |= wan_netns.compare(setup, conv, args.mbps, args.swarm_steps or
                                    (7 if args.quick else 20), best,
                                    log=lambda s: print(s, flush=True))
    elif not args.no_swarm:
        measured, floor = swarm(setup, args, wire)
        shaped |= measured
        if args.save_times:
            save_times(args.save_times, measured, floor)
    report(conv, shaped, floor, setup.batch * setup.seq)
    if args.plot:
        plot(conv, shaped, args.plot)
    if args.e2e:
        import wan_e2e

        wan_e2e.main(setup, conv, shaped, args)
    print("load %.2f %.2f %.2f (a shared machine: other sessions run on these cores)"
          % os.getloadavg())


if __name__ == "__main__":
    main()
