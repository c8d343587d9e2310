"""Trackers replicated on PostgreSQL: kill -9 the leader mid-job and measure the takeover.

A scratch PostgreSQL server (``tests/pg_server.py``: ``initdb`` and ``pg_ctl`` in a
temporary directory) and, on it, two tracker processes (``--leader-lease``, default
5 s) and 4 node processes (1 torch thread each) on 127.0.0.1; nodes and the client are
given both trackers' addresses and follow the leader (:mod:`fedpipe.net.trackers`).
The digits MLP (64-32-32-10), SGD with momentum, a fixed list of batches, checkpoints
every 4 steps, compression "none": two runs of a job see the same batches.

Sections, each job mode first run once undisturbed (the reference weights):

1. **kill -9 of the leader**, ``--trials`` times per mode: a sync job (3 stages, one
   group) and a 2-group all-reduce job (1 stage per group, ``min_replicas=1``). Each
   trial kills the leading tracker once the job has completed a random step, then
   starts it again as a standby (so the next trial has one). Per trial: seconds from
   the kill until the standby answers as the leader; the steps trained in that gap
   (the client's feed count, ``fedpipe.Job.fed``: the first stage's bounded inbox
   holds the feed to the pipeline's pace); steps lost (recomputed by a recovery:
   target 0); the largest relative difference per tensor from the undisturbed
   run's weights (target: 0, exact).
2. **A node lost during the gap**, ``--node-trials`` times: the leader and the node of
   stage 1 killed at once; the new leader must recover the job (steps recomputed:
   those since the last checkpoint it knows complete) and the weights must still
   equal the undisturbed run's.
3. **A 30 s outage with no standby** (``--outage`` seconds): one tracker, killed and
   started again ``--outage`` s later on the same address. The step rate through the
   outage (the client's feed count over the outage) against the rate before the kill
   (the same count over as long a span just before; target >= 0.8: the data plane
   trains on without a tracker), and the weights against the undisturbed run's.

Targets (printed with whether each is met): a standby leads within 10 s of the kill in
every trial; 0 steps lost; weights equal (max relative difference 0; 1e-6 is
printed as the bound); >= 0.8x the step rate through the outage.

    python benchmarks/failover.py [--trials N] [--steps N] [--seed S] [--lease S]
                                  [--outage S] [--modes sync,allreduce] [--workdir DIR]

Full run: 10 trials per mode of 40-step jobs, 3 of a node lost, a 30 s outage (about
25 minutes on a shared 2-core machine); ``--quick``: 2 trials per mode, 1 of a node
lost, a 10 s outage.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # pg_server, failover_swarm, reference

import fedpipe  # noqa: E402
from failover_swarm import Trackers, leader_of  # noqa: E402
from fedpipe import net  # noqa: E402
from fedpipe.examples import digits  # noqa: E402
from fedpipe.proto import tracker_pb2  # noqa: E402
from fedpipe.spec import PlanView, StageKey  # noqa: E402
from pg_server import PgServer  # noqa: E402
from reference import digit_batches, max_relative_difference  # noqa: E402

LOSS = nn.functional.cross_entropy
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
EVERY = 4
LEAD_TARGET = 10.0  # seconds from the kill until a standby leads
RATE_TARGET = 0.8  # the step rate through an outage, of the rate before
EXACT = 1e-6  # the largest relative difference counted as equal weights
POLL = 0.05
BEFORE = 10.0  # seconds just before the outage over which the step rate before is taken


@dataclass
class Trial:
    mode: str
    kill_step: int
    lead_s: float = float("nan")
    gap_steps: int = 0
    lost: int = 0
    recoveries: int = 0
    state: str = ""
    diff: float = float("nan")


def submit(client: fedpipe.Client, mode: str, batches: list, steps: int):
    model = digits.make_model(hidden=32, seed=0)
    if mode == "sync":
        kw = dict(stages=3, replicas=1, schedule="1f1b")
    else:
        kw = dict(stages=1, replicas=2, replica_sync="allreduce", min_replicas=1)
    return client.submit(model, LOSS, SGD, batches, steps=steps, microbatches=2,
                         compression="none", checkpoint_every=EVERY, rebalance="never", **kw)


def finish(client: fedpipe.Client, job, ref: dict | None, trial: Trial) -> dict:
    status = job.wait(timeout=600, progress=False)
    trial.state = status.state
    info = job_info(client, job.id)
    trial.recoveries = len(info.recoveries)
    trial.lost = sum(r.steps_recomputed for r in info.recoveries)
    weights = job.state_dict() if status.state == "SUCCEEDED" else {}
    if ref is not None and weights:
        trial.diff = max_relative_difference(weights, ref)
    job.release()
    return weights


def current_leader(addresses: list[str]) -> str | None:
    for a in addresses:
        if leader_of(a, timeout=2) == a:
            return a
    return None


def wait_leader(addresses: list[str], not_this: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in addresses:
            if a != not_this and leader_of(a, timeout=1) == a:
                return a
        time.sleep(POLL)
    raise RuntimeError(f"no tracker led within {timeout} s of the kill")


def job_info(client: fedpipe.Client, job_id: str) -> tracker_pb2.JobInfo:
    """The job's info, asked again while the client's belief of the leader catches up."""
    return net.retry(lambda: client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job_id),
                                                timeout=10), "GetJob", attempts=20,
                     first_delay=0.1, max_delay=1.0)


def step_of(client: fedpipe.Client, job_id: str) -> int:
    return job_info(client, job_id).step


def kill_trial(two: Trackers, client: fedpipe.Client, mode: str, batches: list, steps: int,
               ref: dict, rng: random.Random, lose_node: bool = False) -> Trial:
    trial = Trial(mode, rng.randint(3, steps - 8))
    job = submit(client, mode, batches, steps)
    killed: dict[str, float] = {}
    leader = current_leader(two.addresses) or two.addresses[0]

    def kill() -> None:
        if lose_node:
            plan = job_info(client, job.id).plan
            victim = PlanView(plan)[StageKey(0, min(1, len(plan.stages) - 1))].address
            two.swarm.kill(victim)
        two.procs[leader].kill()
        killed["at"] = time.monotonic()
    inj = two.swarm.inject(job.id)
    inj.at_step(trial.kill_step, "kill -9 the leader", kill).start()
    while "at" not in killed:
        time.sleep(POLL)
    fed = job.fed
    new = wait_leader(two.addresses, leader)
    trial.lead_s = time.monotonic() - killed["at"]
    trial.gap_steps = job.fed - fed
    two.start(leader, f"tracker-restart-{int(time.time() * 1000)}")  # the next standby
    finish(client, job, ref, trial)
    inj.stop()
    if lose_node:
        alive = sum(p.poll() is None for p in two.swarm.nodes)
        for _ in range(two.swarm.n_nodes - alive):
            two.swarm.add_node()
        two.swarm.wait_for_nodes(two.swarm.n_nodes)
    del new
    return trial


def outage(url: str, workdir: str, batches: list, seconds: float, lease: float) -> None:
    with Trackers(url, workdir, n_nodes=3, standbys=0, leader_lease=lease) as one:
        client = one.swarm.client()
        # the job must outlast the span measured before and the outage: its length from
        # a short run's step rate (its steps' times as the tracker recorded them), 5
        # times over: the short run's rate is below the long one's (the pipeline fills),
        # and the load changes; whether the job ran out during the outage is printed
        short = submit(client, "sync", batches, len(batches))
        short.wait(timeout=600, progress=False)
        times = [r.time for r in short.history()]
        short.release()
        rate = (len(times) - 1) / max(1e-3, times[-1] - times[0])
        steps = max(len(batches), int(5 * rate * (BEFORE + seconds + 10)))
        long = [batches[i % len(batches)] for i in range(steps)]
        ref = finish(client, submit(client, "sync", long, steps), None, Trial("sync", 0))
        job = submit(client, "sync", long, steps)
        while step_of(client, job.id) < max(3, steps // 10):
            time.sleep(POLL)
        t0, f0 = time.monotonic(), job.fed  # the rate before: the feed's, just before
        time.sleep(BEFORE)
        t1, f1 = time.monotonic(), job.fed
        before = (f1 - f0) / (t1 - t0)
        address = one.addresses[0]
        one.procs[address].kill()
        killed = time.monotonic()
        time.sleep(seconds)
        fed = job.fed
        through = (fed - f1) / (time.monotonic() - killed)
        one.start(address, "tracker-after-outage")
        trial = Trial("sync", f1)
        finish(client, job, ref, trial)
        ratio = through / before if before else float("nan")
        print(f"\n== a {seconds:g} s outage with no standby (sync job, {steps} steps)")
        print(f"  load {os.getloadavg()[0]:.1f}; step rate before {before:.2f}/s, "
              f"through the outage {through:.2f}/s: "
              f"{ratio:.2f}x "
              f"[target >= {RATE_TARGET}: {'met' if ratio >= RATE_TARGET else 'NOT met'}]")
        print(f"  fed steps {f0}..{f1} in the {t1 - t0:.0f} s before the kill, {f1}..{fed} "
              f"in the outage" + (" (the job ran out of steps: a lower bound)"
                                   if fed >= steps else ""))
        print(f"  {trial.state}; steps lost {trial.lost} ({trial.recoveries} recoveries); "
              f"weights vs undisturbed: max rel diff {trial.diff:.2e} "
              f"[{'equal' if trial.diff <= EXACT else 'DIFFER'}]")


HEADER = (f"  {'mode':>9} {'kill@':>5} {'lead s':>7} {'gap steps':>9} {'lost':>4} "
          f"{'recov':>5} {'state':>9} {'max rel diff':>12}")


def row(t: Trial) -> str:
    return (f"  {t.mode:>9} {t.kill_step:>5} {t.lead_s:>7.2f} {t.gap_steps:>9} {t.lost:>4} "
            f"{t.recoveries:>5} {t.state:>9} {t.diff:>12.2e}")


def trials_of(n: int, run, title: str) -> list[Trial]:
    """``n`` runs of ``run()``, each trial's row printed as it ends (a run cut short still
    shows what it measured)."""
    print(f"\n-- {title}: {n} trials (load {os.getloadavg()[0]:.1f})\n{HEADER}", flush=True)
    out = []
    for _ in range(n):
        out.append(run())
        print(row(out[-1]), flush=True)
    return out


def report(trials: list[Trial], title: str) -> None:
    print(f"\n== {title}")
    print(HEADER)
    for t in trials:
        print(row(t))
    led = sum(t.lead_s <= LEAD_TARGET for t in trials)
    print(f"  a standby led within {LEAD_TARGET:g} s in {led} of {len(trials)} trials "
          f"[{'met' if led == len(trials) else 'NOT met'}]; steps lost: "
          f"{sum(t.lost for t in trials)} [target 0]; weights equal in "
          f"{sum(t.diff <= EXACT for t in trials)} of {len(trials)}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lease", type=float, default=5.0, help="the trackers' --leader-lease")
    p.add_argument("--node-trials", type=int, default=3,
                   help="trials of a node lost during the gap")
    p.add_argument("--outage", type=float, default=30.0)
    p.add_argument("--modes", default="sync,allreduce")
    p.add_argument("--quick", action="store_true",
                   help="2 trials per mode, 1 of a node lost, a 10 s outage")
    p.add_argument("--skip", default="", help="sections to skip: kill,node,outage")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.quick:
        args.trials, args.outage = min(args.trials, 2), min(args.outage, 10.0)
        args.node_trials = min(args.node_trials, 1)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    batches = digit_batches(args.steps)
    skip = set(filter(None, args.skip.split(",")))
    print(f"failover: {args.trials} trials per mode, {args.steps}-step jobs, leader lease "
          f"{args.lease:g} s, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    pg = PgServer()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedpipe-failover-"))
    for part in ("two", "one"):
        (work / part).mkdir(parents=True, exist_ok=True)
    try:
        with Trackers(pg.new_database(), str(work / "two"), n_nodes=4,
                      leader_lease=args.lease) as two:
            client = two.swarm.client()
            trials: list[Trial] = []
            for mode in args.modes.split(","):
                ref = finish(client, submit(client, mode, batches, args.steps), None,
                             Trial(mode, 0))
                if "kill" not in skip:
                    trials += trials_of(args.trials, functools.partial(
                        kill_trial, two, client, mode, batches, args.steps, ref, rng),
                        f"{mode}: kill -9")
                if "node" not in skip and mode == "sync":
                    node = trials_of(args.node_trials, functools.partial(
                        kill_trial, two, client, mode, batches, args.steps, ref, rng,
                        lose_node=True), f"{mode}: kill -9 of the leader and a node")
                    report(node, "the leader and a stage's node killed at once (sync job)")
            if trials:
                report(trials, "kill -9 of the leading tracker")
        if "outage" not in skip:
            outage(pg.new_database(), str(work / "one"), batches, args.outage, args.lease)
    finally:
        pg.stop()
    print(f"\nlogs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
