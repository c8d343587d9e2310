"""Time to a target loss with one replica group behind a slow link: sync, async, DiLoCo.

A LocalSwarm of 4 node processes on 127.0.0.1 with emulated links (fedpipe's
token bucket + per-message delay in its own channels, see
:mod:`fedpipe.net.emulation`):

- every link: 100 Mbit/s (12.5 MB/s), 5 ms one way (machines in one region);
- everything node3 sends: 10 Mbit/s, 50 ms one way, i.e. 10x less bandwidth
  and 10x the latency (node3 sits behind a slow uplink, far away).

(``--fast-mbps``, ``--fast-latency-ms`` and ``--slowdown`` change these; the
earlier default, 400 Mbit/s and 2 ms, makes links matter less than the 2
cores the 4 nodes share here.) Jobs are pinned to ``replicas=2, stages=2``:
two replica groups of two stages. The planner chooses the groups, which
layers node3 holds and each group's share of the batch (printed); node3's
group has the slow hop inside it and its side of every exchange between the
groups goes over the slow link. The configurations, with the same model,
optimizer, batches and number of steps:

- ``sync``: schedule "1f1b", gradients all-reduced across the groups every
  step: the synchronous baseline;
- ``async``: schedule "async" (PipeDream-style, ``max_staleness=1``) inside
  each group, gradients all-reduced every step;
- ``DiLoCo H=10`` / ``H=50``: schedule "1f1b" inside each group, a DiLoCo
  outer step every H inner steps;
- ``async+DiLoCo H=10`` / ``H=50``: both: no flush inside the groups, outer
  steps between them;
- ``elastic H=10``: ``async+DiLoCo H=10`` with elastic groups (``min_replicas=1``):
  each outer step is agreed with the tracker (:mod:`fedpipe.runtime.elastic`),
  and has no grace period (a group is in an outer step or out of it).

Each DiLoCo stage logs where its outer steps spent their time at the job's
last step (:class:`fedpipe.runtime.diloco.OuterTimes`); the tables print it:
inner steps and tracker round trips per outer step (independent of the
machine's load) and the wall-clock split (encode+send, waiting for the peers
and the tracker, applying).

DiLoCo here: outer lr 0.7, Nesterov momentum 0.5 (not DiLoCo's 0.9: in
in-process runs of these tasks, 0.9 ended 14-16% above sync's loss after
1,000 steps and 0.5 within 1%; 0.9 suits DiLoCo's H=500 runs of thousands of
steps), int8 pseudo-gradients with error feedback. Codecs inside the groups
are the planner's ("auto").

Two tasks: the digits MLP (:mod:`fedpipe.examples.digits`, AdamW lr 3e-3,
batch 64) and a small character-level transformer (d=64, 4 heads, 2 blocks,
context 64, AdamW lr 3e-3, batch 32) on Python's own documentation
(``pydoc_data.topics``, bundled with CPython; the last 10% of the text is
held out).

Measured per job from the tracker's step events (a step is recorded when
every group has reported it, so the slower group sets the pace): the
training loss smoothed by a trailing mean over 10 steps. The target is the
smoothed loss of the first ``sync`` run at 65% of its steps; time to target
is the wall time from the first step event to the first step whose smoothed
loss is at or below it. Final loss: the loss of the trained weights (group
0's; under DiLoCo the outer model after the last outer step, which waits for
every group) on held-out data, the model a user gets; the smoothed training
loss at the last step is printed too (under DiLoCo that of the groups' inner
models, on their own shards). Each configuration runs ``--repeats`` times,
interleaved, each task in a swarm of its own; the tables show the median
time and the mean loss, and which plan (A, B, ...) each run got (the tracker
re-measures links every 300 s, and the planner may then choose another
split). Benchmark target: time to target <= 0.5x sync and final (held-out)
loss within 2% of sync (a lower loss counts as within).

    python benchmarks/async.py [--quick] [--tasks digits,text] [--repeats N]
                               [--steps-digits N] [--steps-text N] [--configs ...]

Full run: 400 digits steps and 1,000 text steps per job, 2 runs per
configuration (20 minutes on this 2-core machine); ``--quick``: 150 steps, 1 run.

Where an outer step's time goes (2026-12-02, ``--configs "sync,async+DiLoCo
H=10,elastic H=10" --repeats 1 --steps-text 400``, load average 25-35 on the
2 shared cores, so the times are the load's, not fedpipe's: sync's steps were
77 ms (digits) and 240 ms (text) of waiting for tensors against 5-150 ms of
compute): a non-elastic DiLoCo job asks the tracker nothing per outer step
(0.00 round trips: its outer steps are peer to peer, with a grace period);
an elastic one asks once per outer step for its commit (1.02-1.45 with the
polls made while a peer's pseudo-gradient is more than QUORUM_POLL late; two
before this change). Encoding, sending and applying took 2-16 ms per outer
step; the rest of an outer step is waiting for the other group (0.1-0.6 s per
outer step, 0.2-25 s of a 35-100 s job): the groups' inner steps run at
different speeds, and the slower sets the job's pace. Results: digits
0.71x / +8.1 % (async+DiLoCo), 0.89x / +8.1 % (elastic, bit-equal weights:
no late pseudo-gradient in either); text 1.64x / +6.0 % and 1.44x / +5.7 %:
both targets missed under that load. Again at load 8-12 (same command):
digits async+DiLoCo 0.41x / -0.2 % (met), elastic 0.54x / -0.2 % (the same
weights); text 0.76x / +3.6 % and 0.59x / +3.6 % (again the same weights, no
late pseudo-gradient): text misses both at 400 steps. Elastic: 1.02 tracker
round trips per outer step; outer steps 0.9-8.5 s of 23-29 s, nearly all of
it one group waiting for the other (up to 204 ms per outer step). Text at
the full 1,000 steps (``--tasks text --configs "sync,async+DiLoCo H=10"
--repeats 1``, load 9-11): async+DiLoCo 0.58x, final loss -1.0 % (met), no
late pseudo-gradient; group 1 waited 204 ms per outer step for group 0,
whose first stage computed 50 ms of each inner step: the time is missed on
compute, not on the exchange (2-4 ms) or the tracker (0 round trips).

Where text's time goes (2026-12-02, ``--configs "sync,async+DiLoCo H=10"
--repeats 2``, load 10-25, and a py-spy profile of a 400-step run): the
planner gives the 1 microbatch of 8 samples to the group behind node3's link
(its first stage waits 57-61 ms a step for gradients over it: two
microbatches in flight, one round trip) and 3 microbatches of 8 to the other, whose first
stage computes 45-125 ms of each step on the shared cores and sets the
job's pace: the node3 group ends its H steps first and waits 190-310 ms per
outer step for it. Of that first stage's busy time, forward 36 %, backward
47 %, the optimizer 5 %, weight stashing (snapshot copy, moving gradients,
functional_call) 8 %, the outer steps 1 % (2-7 ms encode+send, 0.3-2.4 ms
applying, 0 tracker round trips; node3 holds only the head, so the outer
exchange over its link is small). So async+DiLoCo's time is the bigger
group's compute under the machine's load (time to target 57-62 s in 4 runs)
while sync's is its waiting for tensors (132-214 ms a step: the 1F1B flush
over node3's hop and the all-reduce), which depends on the plan drawn: sync's
time to target was 96-151 s in 4 runs, the ratio 0.41 and 0.62 in two
benchmark runs. The loss varied
more than the time: +2.9 % and -0.2 % in two runs of one plan (9 late
pseudo-gradients between them), +4.6 % at 400 steps with 3 late: a
late pseudo-gradient (a group over the 1 s grace period behind, at load
spikes) left the early group's outer step with its own shard alone and the
late one applied at half weight. The grace period's floor is 2 s since
(:class:`fedpipe.runtime.diloco.OuterSync`); the same command then, load
14-24: text 0.62x / -0.9 % (time missed: async+DiLoCo 58.6 and 61.7 s to
the target, sync 96.0 and 97.8 s), both async+DiLoCo runs 0 late and the
same final loss to the digit (1.4805: DiLoCo is deterministic when no
pseudo-gradient is late); digits 0.33x / -0.9 % (0 late). Not done: the
time. It would take the bigger group's compute or a split balanced for
async+DiLoCo (the planner's, made for sync, leaves the node3 group idle a
quarter of the time) or more microbatches in flight over node3's hop than
1F1B's bound of two.

The final loss: in one process, at equal steps, without the async schedule,
codecs or late pseudo-gradients (``OuterSync`` over an in-memory wire), 400
steps, held-out loss against sync's: text, shares 8/24: outer lr 0.7 with
Nesterov 0.5 (this benchmark's) +0.99 %, lr 1 without momentum +4.1 %, lr 1
with 0.5 +5.7 %, lr 0.7 with 0.9 +18 %; text, shares 16/16, lr 0.7 / 0.5:
+2.6 %; digits, shares 16/48: lr 0.7 / 0.5 -3.1 %, lr 1 / 0 +4.8 %, lr 0.7 / 0
-4.5 %; shares 32/32, lr 0.7 / 0.5: +2.0 %. So the defaults here are the best
of those tried, and DiLoCo H=10 itself costs up to ~2.6 % at 400 steps; the
rest of the swarm's gap is the async schedule inside the groups, the plan's
lossy codecs and (text) late pseudo-gradients. In the swarm (text, 400
steps, load 14-18): ``DiLoCo H=10`` (1f1b inside the groups) +1.0 % (4 late
pseudo-gradients), ``async+DiLoCo H=10`` +2.7 % (9 late): the async schedule
costs about 1.7 points; time 1.06x and 0.97x (the text task's steps are
compute-bound at that load).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

try:
    import fedpipe
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fedpipe
from fedpipe.examples import digits  # noqa: E402
from fedpipe.proto import tracker_pb2  # noqa: E402
from fedpipe.examples.text import char_transformer, lm_loss, pydoc_text, text_batches  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

torch.set_num_threads(1)

SLOW_NODE = "node3"
FAST_MBPS, FAST_LATENCY_MS, SLOWDOWN = 100.0, 5.0, 10.0


def links(fast_mbps: float = FAST_MBPS, fast_latency_ms: float = FAST_LATENCY_MS,
          slowdown: float = SLOWDOWN) -> dict:
    """The link profile: every link fast, except what the slow node sends."""
    return {"links": [  # the first match wins
        {"from": SLOW_NODE, "to": "*", "mbps": fast_mbps / slowdown,
         "latency_ms": fast_latency_ms * slowdown, "oneway": True},
        {"from": "*", "to": "*", "mbps": fast_mbps, "latency_ms": fast_latency_ms},
    ]}

SMOOTH = 10          # steps in the trailing mean of the loss
TARGET_AT = 0.65     # the target is sync's smoothed loss at this fraction of its steps
OUTER = dict(outer_lr=0.7, outer_momentum=0.5, compression="int8")
CONFIGS = {          # name -> submit() arguments
    "sync": dict(schedule="1f1b", replica_sync="allreduce"),
    "async": dict(schedule="async", max_staleness=1, replica_sync="allreduce"),
    "DiLoCo H=10": dict(schedule="1f1b", replica_sync=fedpipe.DiLoCo(10, **OUTER)),
    "DiLoCo H=50": dict(schedule="1f1b", replica_sync=fedpipe.DiLoCo(50, **OUTER)),
    "async+DiLoCo H=10": dict(schedule="async", max_staleness=1,
                              replica_sync=fedpipe.DiLoCo(10, **OUTER)),
    "async+DiLoCo H=50": dict(schedule="async", max_staleness=1,
                              replica_sync=fedpipe.DiLoCo(50, **OUTER)),
    "elastic H=10": dict(schedule="async", max_staleness=1, min_replicas=1,
                         replica_sync=fedpipe.DiLoCo(10, **OUTER)),
}


# -- tasks -------------------------------------------------------------------
@dataclass
class Task:
    name: str
    describe: str
    make_model: object          # () -> nn.Sequential
    make_batches: object        # () -> iterator of (x, y), the same for every configuration
    loss_fn: object
    optimizer: object
    microbatches: int
    held_out: tuple             # (x, y) for the held-out loss
    steps: int = 0
    classifier: bool = False    # also report held-out accuracy


def digits_task(steps: int) -> Task:
    x_train, y_train, x_test, y_test = digits.load()
    return Task("digits", "digits MLP 64-128-128-10, AdamW lr 3e-3, batch 64 in 4 microbatches",
                lambda: digits.make_model(hidden=128),
                lambda: digits.batches(x_train, y_train, 64),
                nn.functional.cross_entropy, fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                4, (x_test, y_test), steps, classifier=True)


def text_task(steps: int, seq: int = 64) -> Task:
    train, test = pydoc_text()
    held = next(text_batches(test, 512, seq, seed=1))
    return Task("text", f"char transformer d=64, 2 blocks, context {seq} on pydoc_data.topics "
                        f"({len(train) / 1e6:.2f} M chars), AdamW lr 3e-3, batch 32 in 4 "
                        f"microbatches",
                lambda: char_transformer(seq=seq), lambda: text_batches(train, 32, seq),
                lm_loss, fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), 4, held, steps)


# -- running and measuring ----------------------------------------------------
@dataclass
class Run:
    config: str
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    held_out: float = math.nan
    accuracy: float = math.nan
    plan: str = ""
    label: str = "A"
    missed: int = 0
    late: int = 0
    outer: dict = field(default_factory=dict)  # "group/stage" -> OuterTimes figures
    inner: dict = field(default_factory=dict)  # "group/stage" -> (compute, wait, send) ms/step
    load: float = math.nan                     # 1-minute load average at the run's end

    def smoothed(self) -> list[float]:
        """The trailing mean of the loss over ``SMOOTH`` steps (fewer at the start)."""
        out, acc = [], 0.0
        for i, x in enumerate(self.losses):
            acc += x
            if i >= SMOOTH:
                acc -= self.losses[i - SMOOTH]
            out.append(acc / min(i + 1, SMOOTH))
        return out

    def time_to(self, target: float) -> float:
        """Seconds from the first step event to the first step whose smoothed loss <= target."""
        for t, s in zip(self.times, self.smoothed()):
            if s <= target:
                return t - self.times[0]
        return math.inf

    @property
    def total(self) -> float:
        return self.times[-1] - self.times[0]

    @property
    def final(self) -> float:
        return self.smoothed()[-1]


def plan_of(job, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job.status()
        if status.plan.stages:
            return status.plan
        if status.state in ("FAILED", "CANCELLED"):
            raise RuntimeError(f"job {job.id}: {status}")
        time.sleep(0.1)
    raise TimeoutError(f"job {job.id} got no plan in {timeout:.0f} s")


def describe_plan(plan) -> str:
    """Which node holds which layers, each group's share of the batch, and the codecs."""
    out = []
    for r, rep in enumerate(plan.replicas):
        chain = sorted((a for a in plan.stages if a.replica == r), key=lambda a: a.stage)
        nodes = " -> ".join(
            f"{a.node_name}{' (slow)' if a.node_name == SLOW_NODE else ''} "
            f"[layers {a.layer_start}-{a.layer_end - 1}, act {a.activation_codec or 'raw'}, "
            f"grad {a.gradient_codec or 'raw'}]" for a in chain)
        out.append(f"group {r}: {rep.samples} samples in {rep.microbatches} microbatches: {nodes}")
    return "\n  ".join(out)


def node_logs(swarm: LocalSwarm) -> list[str]:
    return [swarm.log(p) for p in swarm.nodes]


def run_config(swarm: LocalSwarm, task: Task, config: str) -> Run:
    """Submit one job, follow its step events, evaluate its weights on held-out data."""
    before = [len(log) for log in node_logs(swarm)]
    job = swarm.client().submit(task.make_model(), task.loss_fn, task.optimizer,
                                task.make_batches(), steps=task.steps,
                                microbatches=task.microbatches, stages=2, replicas=2,
                                name=f"{task.name}-{config}", **CONFIGS[config])
    plan = plan_of(job)
    if len({a.replica for a in plan.stages}) != 2 or len(plan.stages) != 4:
        raise RuntimeError(f"expected 2 groups of 2 stages, got: {plan.summary}")
    run = Run(config, plan=describe_plan(plan))
    events = sorted((ev.step, ev.time, ev.loss) for ev in job.events() if ev.step)
    status = job.status()
    if status.state != "SUCCEEDED" or len(events) != task.steps:
        raise RuntimeError(f"{task.name}/{config}: {status} ({len(events)} step events)")
    run.steps, run.times, run.losses = (list(col) for col in zip(*events))
    info = job.client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=30)
    run.inner = {f"{t.replica}/{t.stage}": (t.compute_seconds * 1e3, t.wait_seconds * 1e3,
                                            t.send_seconds * 1e3) for t in info.stage_times}
    trained = job.model()
    job.release()
    with torch.no_grad():
        trained.eval()
        out = trained(task.held_out[0])
        run.held_out = task.loss_fn(out, task.held_out[1]).item()
        if task.classifier:
            run.accuracy = (out.argmax(-1) == task.held_out[1]).float().mean().item()
    new = "".join(log[n:] for log, n in zip(node_logs(swarm), before))
    run.missed = new.count("within the grace period")
    run.late = new.count("applied replica")
    run.outer = outer_times(new)
    run.load = os.getloadavg()[0]
    return run


OUTER_LINE = re.compile(
    r"outer steps of stage (\d+/\d+): (\d+) outer steps in ([\d.]+) s, inner steps ([\d.]+) "
    r"s; per outer step: send ([\d.]+) ms, wait ([\d.]+) ms, apply ([\d.]+) ms, "
    r"tracker asks ([\d.]+)")


def outer_times(log: str) -> dict:
    """Each stage's outer-step figures from its node's log line (fedpipe.runtime.diloco.
    OuterTimes.line): {"group/stage": {outer, outer_s, inner_s, send_ms, wait_ms,
    apply_ms, asks}}."""
    names = ("outer", "outer_s", "inner_s", "send_ms", "wait_ms", "apply_ms", "asks")
    return {m.group(1): dict(zip(names, map(float, m.groups()[1:])))
            for m in OUTER_LINE.finditer(log)}


def report_outer(name: str, runs: list[Run], steps: int) -> None:
    """Where a DiLoCo configuration's outer steps spent their time, per stage (mean of
    the runs): the CPU-independent counts (inner steps and tracker asks per outer step)
    and the wall-clock split."""
    keys = sorted({k for r in runs for k in r.outer})
    if not keys:
        print(f"  {name}: no outer-step figures in the node logs")
        return
    mean = statistics.fmean
    for k in keys:
        got = [r.outer[k] for r in runs if k in r.outer]
        outer = mean(g["outer"] for g in got)
        ms = {f: mean(g[f] for g in got) for f in ("send_ms", "wait_ms", "apply_ms", "asks")}
        print(f"  {name:<18} stage {k}: {outer:.0f} outer steps, {steps / outer:.1f} inner "
              f"steps and {ms['asks']:.2f} tracker round trips per outer step; per outer "
              f"step {ms['send_ms']:.1f} ms encode+send, {ms['wait_ms']:.1f} ms waiting "
              f"(peers, tracker), {ms['apply_ms']:.1f} ms applying; outer steps "
              f"{mean(g['outer_s'] for g in got):.1f} s of "
              f"{mean(g['outer_s'] + g['inner_s'] for g in got):.1f} s")


def fmt_s(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f} s"


def fmt_ratio(x: float) -> str:
    return "-" if math.isinf(x) or math.isnan(x) else f"{x:.2f}"


def report(task: Task, runs: dict[str, list[Run]], target: float) -> list[bool]:
    """Print the task's table and the verdicts; return whether each non-sync config met both."""
    med = statistics.median
    t_of = {name: med(r.time_to(target) for r in rs) for name, rs in runs.items()}
    train = {name: statistics.fmean(r.final for r in rs) for name, rs in runs.items()}
    held = {name: statistics.fmean(r.held_out for r in rs) for name, rs in runs.items()}
    total = {name: med(r.total for r in rs) for name, rs in runs.items()}
    acc = {name: statistics.fmean(r.accuracy for r in rs) for name, rs in runs.items()}
    n = len(runs["sync"])
    print(f"\n== {task.name}: {task.describe}; {task.steps} steps, "
          f"{n} run{'s' if n > 1 else ''} per config" + (" (median time, mean loss)" if n > 1
                                                          else ""))
    print(f"target loss {target:.4f} = sync's smoothed training loss at step "
          f"{round(TARGET_AT * task.steps)} of {task.steps}")
    head = (f"{'config':<18} {'time to target':>14} {'vs sync':>7} {'all steps':>9}   "
            f"{'final loss':>10} {'vs sync':>7}   {'train loss':>10} {'vs sync':>7}"
            + ("   accuracy" if task.classifier else ""))
    print(head)
    print("-" * len(head))
    for name in runs:
        late = "  plan " + "".join(r.label for r in runs[name])
        if "DiLoCo" in name or "elastic" in name:
            late += (f"; late pseudo-gradients {sum(r.missed for r in runs[name])}, "
                     f"applied late {sum(r.late for r in runs[name])}")
        late += f"; load {statistics.fmean(r.load for r in runs[name]):.1f}"
        print(f"{name:<18} {fmt_s(t_of[name]):>14} {fmt_ratio(t_of[name] / t_of['sync']):>7} "
              f"{total[name]:>7.1f} s   {held[name]:>10.4f} {held[name] / held['sync']:>7.3f}"
              f"   {train[name]:>10.4f} {train[name] / train['sync']:>7.3f}"
              + (f"   {acc[name]:>8.4f}" if task.classifier else "") + late)
    print("a step's split per stage (the tracker's median of recent steps, ms: compute, "
          "waiting for tensors, sending), mean of the runs:")
    for name in runs:
        keys = sorted({k for r in runs[name] for k in r.inner})
        split = {k: [statistics.fmean(r.inner[k][j] for r in runs[name] if k in r.inner)
                     for j in range(3)] for k in keys}
        print(f"  {name:<18} " + "; ".join(
            f"{k} " + "/".join(f"{x:.0f}" for x in split[k]) for k in keys))
    print("outer steps (from each stage's log line at the job's last step):")
    for name in runs:
        if "DiLoCo" in name or "elastic" in name:
            report_outer(name, runs[name], task.steps)
    print("targets: time to target <= 0.5x sync, final loss (held-out, of the trained "
          "weights) at most 2% above sync's")
    met = []
    for name in runs:
        if name == "sync":
            continue
        ratio, dloss = t_of[name] / t_of["sync"], held[name] / held["sync"] - 1
        misses = [w for w, bad in (("time", not ratio <= 0.5), ("loss", not dloss <= 0.02))
                  if bad]
        met.append(not misses)
        print(f"  {name:<18} {'MET' if not misses else 'NOT MET':<8} time {fmt_ratio(ratio)}x, "
              f"final loss {dloss * 100:+.1f}%, training loss "
              f"{(train[name] / train['sync'] - 1) * 100:+.1f}%"
              + (f"  [misses: {', '.join(misses)}]" if misses else ""))
    return met


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="150 steps per job, one run per config (a few minutes)")
    ap.add_argument("--tasks", default="digits,text", help="comma-separated: digits, text")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, sync first: {', '.join(CONFIGS)}")
    ap.add_argument("--steps-digits", type=int, default=0, help="default 400 (--quick: 150)")
    ap.add_argument("--steps-text", type=int, default=0, help="default 1000 (--quick: 150)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="runs per config, interleaved (default 2; --quick: 1)")
    ap.add_argument("--fast-mbps", type=float, default=FAST_MBPS)
    ap.add_argument("--fast-latency-ms", type=float, default=FAST_LATENCY_MS)
    ap.add_argument("--slowdown", type=float, default=SLOWDOWN,
                    help="node3's link: this many times less bandwidth and more latency")
    args = ap.parse_args()
    steps = {"digits": args.steps_digits or (150 if args.quick else 400),
             "text": args.steps_text or (150 if args.quick else 1000)}
    repeats = args.repeats or (1 if args.quick else 2)
    makers = {"digits": digits_task, "text": text_task}
    tasks = [makers[t](steps[t]) for t in args.tasks.split(",")]
    configs = args.configs.split(",")
    if configs[0] != "sync" or any(c not in CONFIGS for c in configs):
        ap.error(f"configs must start with sync and be among {list(CONFIGS)}")
    profile = links(args.fast_mbps, args.fast_latency_ms, args.slowdown)
    slow = profile["links"][0]
    print(f"links: every link {args.fast_mbps:g} Mbit/s, {args.fast_latency_ms:g} ms one way; "
          f"everything {SLOW_NODE} sends {slow['mbps']:g} Mbit/s, {slow['latency_ms']:g} ms "
          f"({args.slowdown:g}x slower); jobs pinned to replicas=2, stages=2")
    t0 = time.monotonic()
    verdicts = []
    for task in tasks:
        # a swarm per task: the tracker re-measures links every 300 s, and the
        # planner may then choose another plan; plans are labelled A, B, ...
        with LocalSwarm(n_nodes=4, link_profile=profile, timeout=180) as swarm:
            print(f"\n[{task.name}] nodes: " + ", ".join(
                f"{n.name} {n.resources.flops / 1e9:.1f} GFLOP/s"
                for n in swarm.client().nodes()), flush=True)
            runs: dict[str, list[Run]] = {c: [] for c in configs}
            target, plans = None, {}
            for rep in range(repeats):
                for config in configs:
                    r = run_config(swarm, task, config)
                    runs[config].append(r)
                    if target is None:  # the first sync run sets the target
                        target = r.smoothed()[max(0, round(TARGET_AT * task.steps) - 1)]
                    if r.plan not in plans:
                        plans[r.plan] = chr(ord("A") + len(plans))
                        print(f"[{task.name}] plan {plans[r.plan]}:\n  {r.plan}")
                    r.label = plans[r.plan]
                    print(f"[{task.name}/{config} #{rep + 1}, plan {r.label}] {r.total:.1f} s "
                          f"for {task.steps} steps, time to target {fmt_s(r.time_to(target))}, "
                          f"final (held-out) loss {r.held_out:.4f}, training loss {r.final:.4f}"
                          + (f" (accuracy {r.accuracy:.4f})" if task.classifier else "")
                          + (f", late pseudo-gradients {r.missed} (applied late {r.late})"
                             if r.outer else "")
                          + f", load average {r.load:.1f}", flush=True)
        verdicts += [(task.name, ok) for ok in report(task, runs, target)]
    met = sum(ok for _, ok in verdicts)
    print(f"\n{met} of {len(verdicts)} (task, config) pairs met both targets; "
          f"wall time {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
