"""A job survives losing a node: kill -9 mid-job, measure the recovery and its exactness.

A LocalSwarm of 4 node processes (1 torch thread each) and a tracker (lease 5 s)
on 127.0.0.1. Every job is pinned to one replica group of 3 stages, so one node
is a spare; it runs the synchronous schedule "1f1b" with compression "none" and
a checkpoint every ``--every`` steps (default 5), on a fixed list of batches:
two jobs of a task see the same batches in the same order. Two tasks on real
data:

- ``digits``: the digits MLP 64-128-128-10 (:mod:`fedpipe.examples.digits`),
  AdamW lr 3e-3, batch 64 in 4 microbatches; held-out accuracy;
- ``text``: the character transformer (d=64, 4 heads, 2 blocks, context 64;
  :mod:`fedpipe.examples.text`) on Python's ``pydoc_data.topics``, AdamW
  lr 3e-3, batch 32 in 4 microbatches; loss on 256 held-out windows.

Per task, in this order:

1. **Checkpoint overhead.** Jobs of 200 (digits) or 60 (text) steps with
   checkpoints on (every ``--every`` steps) and off (every ``steps + 1``),
   alternated ``--repeats`` times. A job's step time is its mean over its
   steps from step 3 on (from the tracker's step events, so a slow
   checkpoint step counts). The overhead is the median over the pairs of
   on / off - 1 (a pair runs back to back, so a change in the machine's
   load between pairs cancels out), also given in ms per checkpoint.
   ``os.getloadavg()`` is printed with it: the machine is shared, and the
   ratio is only as good as the interleaving.
2. **An undisturbed run**: the reference for accuracy/loss and weights. It
   is also compared with single-process PyTorch on the same batches, with
   the gradient accumulated over the same microbatches (and, for scale,
   over whole batches: with AdamW a near-zero gradient's rounding flips the
   sign of its update, so that difference is not a fedpipe error).
3. **``--trials`` kill trials**: each picks a random stage of the plan and a
   random step, and ``kill -9``\\ s the node holding that stage once the job
   has completed that step (:meth:`fedpipe.testing.LocalSwarm.inject`).
4. **Two extra trials**: the tracker killed (``kill -9``) and restarted at a
   random step; a double loss (two kills at two steps of one job, the second
   after the first recovery).

After each trial a node is started for each one killed, so the next trial
has a spare again.

Per trial it prints: completed or not; for each recovery (the job's
``JobInfo.recoveries``) the checkpoint it rewound to and the steps
recomputed; seconds from the kill (taken here, just before the SIGKILL) to
the first step event recorded after the job is RUNNING again, split into
*detect* (first failure report to the node declared lost), *replan* (declared
lost to the new plan), *restore* (new plan to every stage loaded and
restored, from the tracker's Recovery record) and *other* (the rest: kill to
the first failure report, and RUNNING to the first replayed step); the final
held-out accuracy (digits) or loss (text) next to the undisturbed run's; and
the largest relative difference per tensor between its weights and the
undisturbed run's (``max |a - b| / max |b|``). For the tracker kill: seconds
from the kill to the next recorded step. A job that makes no progress (step,
state or epoch) for 60 s is cancelled and counted as STUCK, not completed.

Targets, printed with whether each is met: every kill trial completes;
steps recomputed <= checkpoint_every; kill to resumed training <= 10 s;
checkpoint overhead <= 5 % of step time; recovered jobs' weights equal the
undisturbed run's within 1e-5.

    python benchmarks/faults.py [--quick] [--trials N] [--tasks digits,text] [--seed S]
                                [--every K] [--repeats R] [--steps-digits N] [--steps-text N]
                                [--overhead-steps-digits N] [--overhead-steps-text N]
                                [--workdir DIR]

Full run: 10 trials per task, 50 digits steps and 30 text steps per job, 5
overhead repeats (about 10 minutes on a 2-core machine); ``--quick``: 2 trials
per task, 1 overhead repeat (about 3 minutes). The swarm's logs (tracker,
nodes) are kept in ``--workdir`` (default: a temporary directory, removed if
every trial completed).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import torch
from torch import nn

try:
    import fedpipe
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fedpipe
from fedpipe.examples import digits  # noqa: E402
from fedpipe.examples.text import char_transformer, lm_loss, pydoc_text, text_batches  # noqa: E402
from fedpipe.proto import tracker_pb2  # noqa: E402
from fedpipe.spec import TERMINAL, PlanView, StageKey, state_name  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

torch.set_num_threads(1)

NODES, STAGES = 4, 3
JOB_TIMEOUT = 300.0       # seconds a job may take before the trial counts as not completed
STALL = 60.0              # seconds without a new step, state or epoch: the job is stuck
POLL = 0.25               # seconds between looks at a running job
WARMUP_STEPS = 3          # steps left out of a job's step time
TARGET_RESUME_S = 10.0
TARGET_OVERHEAD = 0.05
TARGET_EXACT = 1e-5
S = tracker_pb2


class Warnings(logging.Handler):
    """Keeps this process's fedpipe warnings (the client's retries while the tracker
    restarts, say) so each trial prints how many it had instead of a screenful."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")

    def take(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


WARNINGS = Warnings()


# -- tasks -------------------------------------------------------------------
@dataclass
class Task:
    name: str
    describe: str
    make_model: Callable[[], nn.Sequential]
    batches: list                      # the same list for every job of the task
    loss_fn: Callable
    optimizer: object
    microbatches: int
    evaluate: Callable[[nn.Module], float]
    metric: str                        # what evaluate measures
    steps: int


def digits_task(steps: int) -> Task:
    x_train, y_train, x_test, y_test = digits.load()
    gen = digits.batches(x_train, y_train, 64)
    return Task("digits", "digits MLP 64-128-128-10, AdamW lr 3e-3, batch 64 in 4 microbatches",
                lambda: digits.make_model(hidden=128), [next(gen) for _ in range(steps)],
                nn.functional.cross_entropy, fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), 4,
                lambda m: digits.accuracy(m, x_test, y_test), "accuracy", steps)


def text_task(steps: int, seq: int = 64) -> Task:
    train, test = pydoc_text()
    x_held, y_held = next(text_batches(test, 256, seq, seed=1))
    gen = text_batches(train, 32, seq)

    def held_out_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return lm_loss(model(x_held), y_held).item()

    return Task("text", f"char transformer d=64, 2 blocks, context {seq} on pydoc_data.topics, "
                        f"AdamW lr 3e-3, batch 32 in 4 microbatches",
                lambda: char_transformer(seq=seq), [next(gen) for _ in range(steps)],
                lm_loss, fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), 4, held_out_loss,
                "loss", steps)


def max_relative_difference(a: dict, b: dict) -> float:
    """Per tensor ``max|a - b| / max|b|``, the worst over two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())}")
    return max((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() or 1.0) for k in b)


def single_process(task: Task, microbatches: int) -> dict:
    """The task's model trained in this process, one optimizer step per batch, the
    gradient accumulated over ``microbatches`` pieces of it, each loss scaled by its
    share of the batch (as the stages do, :class:`fedpipe.runtime.stage.StageRunnerBase`)."""
    model = task.make_model()
    opt = task.optimizer.build(model.parameters())
    for x, y in task.batches:
        opt.zero_grad()
        for xs, ys in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
            (task.loss_fn(model(xs), ys) * (xs.shape[0] / x.shape[0])).backward()
        opt.step()
    return model.state_dict()


# -- one job -------------------------------------------------------------------
@dataclass
class Kill:
    what: str            # "node2 (stage 1)" or "tracker"
    node: str            # the node's name ("" for the tracker)
    at_step: int         # the job's last completed step when it fired
    time: float          # seconds since the epoch, just before the SIGKILL


@dataclass
class Outcome:
    state: str
    reason: str
    info: tracker_pb2.JobInfo
    events: list
    weights: dict | None = None
    metric: float = math.nan
    kills: list[Kill] = field(default_factory=list)
    wall: float = 0.0          # seconds from submission to the weights fetched

    @property
    def completed(self) -> bool:
        return self.state == "SUCCEEDED"

    def step_seconds(self) -> float:
        """Mean seconds per step from step WARMUP_STEPS on (a run without recovery)."""
        steps = sorted((ev.step, ev.time) for ev in self.events if ev.step)
        steps = [(s, t) for s, t in steps if s >= WARMUP_STEPS]
        if len(steps) < 2:
            return math.nan
        return (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])


def is_transition(ev: tracker_pb2.JobEvent) -> bool:
    """A state change (not a step or checkpoint event)."""
    return not ev.step and not ev.checkpoint_step


def resumed_after(events: list, t_kill: float) -> float | None:
    """Seconds from ``t_kill`` to the first step event after the job went RECOVERING and
    then RUNNING again (events in seq order), or None if it never resumed."""
    phase = 0
    for ev in events:
        if ev.time < t_kill:
            continue
        if phase == 0 and is_transition(ev) and ev.state == S.JOB_STATE_RECOVERING:
            phase = 1
        elif phase == 1 and is_transition(ev) and ev.state == S.JOB_STATE_RUNNING:
            phase = 2
        elif phase == 2 and ev.step:
            return ev.time - t_kill
    return None


def next_step_after(events: list, t: float) -> float | None:
    """Seconds from ``t`` to the first step event recorded after it."""
    return next((ev.time - t for ev in events if ev.step and ev.time > t), None)


class Bench:
    """The swarm, its one client, and the jobs and faults of one benchmark run."""

    def __init__(self, swarm: LocalSwarm):
        self.swarm, self.client = swarm, swarm.client()

    def get(self, job_id: str) -> tracker_pb2.JobInfo:
        return self.client.stub.GetJob(S.GetJobRequest(job_id=job_id), timeout=10)

    def submit(self, task: Task, every: int, name: str, steps: int = 0):
        """Submit the task's job (``steps``: default the task's; the batches repeat)."""
        return self.client.submit(task.make_model(), task.loss_fn, task.optimizer,
                                  task.batches, steps=steps or task.steps,
                                  microbatches=task.microbatches, stages=STAGES, replicas=1,
                                  schedule="1f1b", compression="none", checkpoint_every=every,
                                  name=name)

    def wait_end(self, job_id: str) -> str:
        """Wait until the job ends; if it makes no progress (step, state, epoch) for
        :data:`STALL` seconds or runs past :data:`JOB_TIMEOUT`, cancel it and return why."""
        start = since = time.monotonic()
        last = None
        while True:
            try:
                info = self.get(job_id)
            except grpc.RpcError:  # the tracker is restarting
                time.sleep(POLL)
                continue
            if info.state in TERMINAL:
                return ""
            now = time.monotonic()
            if (info.state, info.step, info.epoch) != last:
                last, since = (info.state, info.step, info.epoch), now
            stuck = now - since > STALL
            if stuck or now - start > JOB_TIMEOUT:
                why = (f"no progress for {STALL:.0f} s" if stuck else
                       f"not done in {JOB_TIMEOUT:.0f} s") + \
                      f" at step {info.step} ({state_name(info.state)}: {info.reason})"
                self.client.stub.CancelJob(S.CancelJobRequest(job_id=job_id,
                                                              reason=f"benchmark: {why}"),
                                           timeout=10)
                return why
            time.sleep(POLL)

    def finish(self, task: Task, job, weights: bool = True) -> Outcome:
        """Wait for ``job`` to end; its state, events and (if it succeeded) weights."""
        stuck = self.wait_end(job.id)
        info = self.get(job.id)
        out = Outcome("STUCK" if stuck else state_name(info.state), stuck or info.reason,
                      info, list(job.events()))
        if out.completed and weights:
            out.weights = job.state_dict()
            model = task.make_model()
            model.load_state_dict(out.weights)
            out.metric = task.evaluate(model.eval())
        job.release()
        return out

    # -- faults --------------------------------------------------------------
    def kill_stage(self, job_id: str, stage: int, kills: list[Kill]) -> None:
        """``kill -9`` the node that holds ``stage`` (replica 0) of the job now."""
        info = self.get(job_id)
        a = PlanView(info.plan)[StageKey(0, stage)]
        index = self.swarm.node_index(a.node_name)
        kills.append(Kill(f"{a.node_name} (stage {stage})", a.node_name, info.step, time.time()))
        self.swarm.kill(index)

    def kill_tracker(self, job_id: str, kills: list[Kill]) -> None:
        kills.append(Kill("tracker", "", self.get(job_id).step, time.time()))
        self.swarm.restart_tracker()

    def replace_dead(self) -> None:
        """Start a node for each one that died, so the next job has a spare again."""
        alive = sum(p.poll() is None for p in self.swarm.nodes)
        for _ in range(NODES - alive):
            self.swarm.add_node()
        self.swarm.wait_for_nodes(NODES)
        self.swarm.wait_for_links()

    def trial(self, task: Task, every: int, name: str,
              faults: list[tuple[int, str, int]]) -> Outcome:
        """One job with ``faults``: (step, "stage" or "tracker", stage index) each."""
        t0 = time.monotonic()
        job = self.submit(task, every, name)
        kills: list[Kill] = []
        inj = self.swarm.inject(job.id)
        for step, kind, stage in faults:
            if kind == "tracker":
                inj.at_step(step, "kill the tracker",
                            lambda: self.kill_tracker(job.id, kills))
            else:
                inj.at_step(step, f"kill stage {stage}",
                            lambda stage=stage: self.kill_stage(job.id, stage, kills))
        inj.start()
        out = self.finish(task, job)
        try:
            inj.stop()
        except Exception as e:  # noqa: BLE001 — a fault that could not fire is reported
            out.reason += f"; a fault failed to fire: {type(e).__name__}: {e}"
        out.kills, out.wall = kills, time.monotonic() - t0
        return out


# -- reporting -----------------------------------------------------------------
@dataclass
class Row:
    """One trial's figures, for the summary and the targets."""

    kind: str                    # "kill", "tracker", "double"
    completed: bool
    recomputed: list[int]
    resume: list[float | None]   # kill to resumed training, per kill
    diff: float                  # max relative difference to the undisturbed run
    recoveries: int


def fmt(x: float | None, unit: str = " s") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}{unit}"


def describe(task: Task, label: str, out: Outcome, base: Outcome, kind: str) -> Row:
    """Print one trial; return its figures."""
    recs = list(out.info.recoveries)
    lines = [f"[{task.name} {label}] "
             + "; ".join(f"kill -9 {k.what} at step {k.at_step}" for k in out.kills)
             + f": {'completed' if out.completed else 'NOT completed'} ({out.state}"
             + (f": {out.reason}" if not out.completed else "") + f"; {out.wall:.0f} s)"]
    if len(out.kills) < (2 if kind == "double" else 1):
        lines.append(f"  only {len(out.kills)} fault(s) fired (the job ended first?)")
    row = Row(kind, out.completed, [r.steps_recomputed for r in recs], [], math.nan, len(recs))
    for k in out.kills:
        if k.node:
            total = resumed_after(out.events, k.time)
            rec = next((r for r in recs if k.node in r.lost.split(", ")), None)
            row.resume.append(total)
            if rec is None:
                lines.append(f"  {k.node}: no recovery recorded")
                continue
            parts = rec.detect_seconds + rec.replan_seconds + rec.restore_seconds
            lines.append(
                f"  {k.node} lost: rewound to checkpoint {rec.checkpoint_step}, "
                f"{rec.steps_recomputed} steps recomputed; kill -> resumed {fmt(total)} "
                f"(detect {fmt(rec.detect_seconds)}, replan {fmt(rec.replan_seconds)}, "
                f"restore {fmt(rec.restore_seconds)}, other "
                f"{fmt(None if total is None else total - parts)})")
        else:
            total = next_step_after(out.events, k.time)
            row.resume.append(total)
            lines.append(f"  tracker killed and restarted: kill -> next recorded step "
                         f"{fmt(total)}; {len(recs)} recoveries")
    said = WARNINGS.take()
    if said:
        lines.append(f"  client warnings: {len(said)}, the first: {said[0]}")
    if out.completed and out.weights is not None and base.weights is not None:
        row.diff = max_relative_difference(out.weights, base.weights)
        lines.append(f"  held-out {task.metric} {out.metric:.4f} (undisturbed "
                     f"{base.metric:.4f}); weights vs undisturbed: max relative "
                     f"difference {row.diff:.1e}")
    print("\n".join(lines), flush=True)
    return row


def verdict(ok: bool) -> str:
    return "MET    " if ok else "NOT MET"


# -- the benchmark -------------------------------------------------------------
def overhead(bench: Bench, task: Task, every: int, repeats: int, steps: int) -> float:
    """Checkpoint overhead as a fraction of step time over jobs of ``steps`` steps: the
    median over ``repeats`` pairs (checkpoints on, then off) of on / off - 1. Each pair
    runs back to back, so a change in the machine's load between pairs cancels out."""
    off_every = steps + 1
    times: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    load0 = os.getloadavg()
    for rep in range(repeats):
        pair = {}
        for mode, k in (("on", every), ("off", off_every)):
            out = bench.finish(task, bench.submit(task, k, f"{task.name}-ck-{mode}", steps),
                               weights=False)
            if out.completed:
                pair[mode] = out.step_seconds()
                times[mode].append(pair[mode])
            else:
                print(f"[{task.name} overhead #{rep + 1}] checkpoints {mode}: NOT completed "
                      f"({out.state}: {out.reason})", flush=True)
        if len(pair) == 2:
            ratios.append(pair["on"] / pair["off"])
            print(f"[{task.name} overhead #{rep + 1}] checkpoints on {pair['on'] * 1e3:.1f} "
                  f"ms/step, off {pair['off'] * 1e3:.1f} ms/step: ratio {ratios[-1]:.3f}",
                  flush=True)
    load1 = os.getloadavg()
    if not ratios:
        return math.nan
    ratio = statistics.median(ratios)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"[{task.name} overhead] checkpoints every {every} steps: median ratio {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f} % of step time, about {(ratio - 1) * off * every * 1e3:.0f}"
          f" ms per checkpoint; median step time on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms);"
          f" load average before {' '.join(f'{x:.2f}' for x in load0)}, after "
          f"{' '.join(f'{x:.2f}' for x in load1)}", flush=True)
    return ratio - 1


def kill_steps(rng: random.Random, steps: int, every: int, n: int) -> list[int]:
    """``n`` increasing kill steps, each at least ``every + 2`` after the one before (so
    the job has recovered and passed a new checkpoint), in [1, steps - 5]."""
    hi = steps - 5
    gap = every + 2
    if n == 1:
        return [rng.randint(1, hi)]
    first = rng.randint(1, max(1, hi - gap * (n - 1)))
    out = [first]
    for i in range(1, n):
        out.append(rng.randint(out[-1] + gap, max(out[-1] + gap, hi - gap * (n - 1 - i))))
    return out


def run_task(bench: Bench, task: Task, args, rng: random.Random) -> dict:
    """Everything for one task; returns its figures for the targets."""
    print(f"\n== {task.name}: {task.describe}; {task.steps} steps, {STAGES} stages on "
          f"{NODES} nodes, 1f1b, compression none, checkpoint every {args.every} steps",
          flush=True)
    ratio = overhead(bench, task, args.every, args.repeats,
                     {"digits": args.overhead_steps_digits,
                      "text": args.overhead_steps_text}[task.name])

    base = bench.finish(task, bench.submit(task, args.every, f"{task.name}-undisturbed"))
    if not base.completed:
        raise RuntimeError(f"the undisturbed {task.name} run did not complete: {base.state}: "
                           f"{base.reason}")
    ref = max_relative_difference(base.weights, single_process(task, task.microbatches))
    whole = max_relative_difference(base.weights, single_process(task, 1))
    print(f"[{task.name} undisturbed] held-out {task.metric} {base.metric:.4f}; weights vs "
          f"single-process PyTorch on the same batches and microbatches: max relative "
          f"difference {ref:.1e} (vs whole batches, no accumulation: {whole:.1e})", flush=True)

    rows = []
    for i in range(args.trials):
        stage, step = rng.randrange(STAGES), kill_steps(rng, task.steps, args.every, 1)[0]
        out = bench.trial(task, args.every, f"{task.name}-kill-{i + 1}", [(step, "stage", stage)])
        rows.append(describe(task, f"trial {i + 1}/{args.trials}", out, base, "kill"))
        bench.replace_dead()
    step = kill_steps(rng, task.steps, args.every, 1)[0]
    out = bench.trial(task, args.every, f"{task.name}-tracker", [(step, "tracker", 0)])
    rows.append(describe(task, "tracker kill", out, base, "tracker"))
    bench.replace_dead()
    s1, s2 = kill_steps(rng, task.steps, args.every, 2)
    out = bench.trial(task, args.every, f"{task.name}-double",
                      [(s1, "stage", rng.randrange(STAGES)), (s2, "stage", rng.randrange(STAGES))])
    rows.append(describe(task, "double loss", out, base, "double"))
    bench.replace_dead()
    return {"rows": rows, "overhead": ratio, "reference": ref}


def report(results: dict[str, dict], every: int) -> bool:
    """Print the summary and the targets; return whether every target is met."""
    print("\n== summary")
    head = (f"{'task':<7} {'trials':<8} {'completed':>9} {'recoveries':>10} "
            f"{'recomputed max':>14} {'resume median':>13} {'resume max':>10} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    every_row = []
    for name, res in results.items():
        for kind in ("kill", "tracker", "double"):
            rows = [r for r in res["rows"] if r.kind == kind]
            every_row += rows
            resumes = [x for r in rows for x in r.resume if x is not None]
            recomputed = [x for r in rows for x in r.recomputed]
            diffs = [r.diff for r in rows if not math.isnan(r.diff)]
            print(f"{name:<7} {kind:<8} {sum(r.completed for r in rows):>4} of {len(rows):<2} "
                  f"{sum(r.recoveries for r in rows):>10} "
                  f"{max(recomputed) if recomputed else '-':>14} "
                  f"{fmt(statistics.median(resumes) if resumes else None):>13} "
                  f"{fmt(max(resumes) if resumes else None):>10} "
                  f"{f'{max(diffs):.1e}' if diffs else '-':>9}")
    kills = [r for r in every_row if r.kind == "kill"]
    node_losses = [r for r in every_row if r.kind != "tracker"]
    resumes = [x for r in node_losses for x in r.resume]
    recomputed = [x for r in every_row for x in r.recomputed]
    diffs = [r.diff for r in every_row]
    overheads = {name: res["overhead"] for name, res in results.items()}
    checks = [
        (all(r.completed for r in kills),
         f"kill trials complete: {sum(r.completed for r in kills)} of {len(kills)} "
         f"(extras: {sum(r.completed for r in every_row if r.kind != 'kill')} of "
         f"{sum(r.kind != 'kill' for r in every_row)})"),
        (bool(recomputed) and max(recomputed) <= every,
         f"steps recomputed <= checkpoint_every ({every}): max "
         f"{max(recomputed) if recomputed else '-'} over {len(recomputed)} recoveries"),
        (bool(resumes) and all(x is not None and x <= TARGET_RESUME_S for x in resumes),
         f"kill to resumed training <= {TARGET_RESUME_S:g} s: max "
         f"{fmt(max((x for x in resumes if x is not None), default=None))}"
         + (f", {sum(x is None for x in resumes)} never resumed"
            if any(x is None for x in resumes) else "")),
        (all(x <= TARGET_OVERHEAD for x in overheads.values()),
         f"checkpoint overhead <= {TARGET_OVERHEAD:.0%} of step time: "
         + ", ".join(f"{n} {x * 100:+.1f} %" for n, x in overheads.items())),
        (any(r.completed for r in every_row)
         and all(r.diff <= TARGET_EXACT for r in every_row if r.completed),
         f"recovered sync jobs equal uninterrupted training within {TARGET_EXACT:g}: max "
         f"relative difference {max((d for d in diffs if not math.isnan(d)), default=math.nan):.1e}"
         f" over {sum(not math.isnan(d) for d in diffs)} completed jobs"),
    ]
    print("\ntargets:")
    for ok, text in checks:
        print(f"  {verdict(ok)} {text}")
    return all(ok for ok, _ in checks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 trials per task, 1 overhead repeat")
    ap.add_argument("--trials", type=int, default=0, help="kill trials per task (default 10)")
    ap.add_argument("--tasks", default="digits,text", help="comma-separated: digits, text")
    ap.add_argument("--seed", type=int, default=0, help="picks the kill steps and stages")
    ap.add_argument("--every", type=int, default=5, help="checkpoint_every (steps)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="checkpoint on/off pairs for the overhead (default 5; --quick 1)")
    ap.add_argument("--steps-digits", type=int, default=50)
    ap.add_argument("--steps-text", type=int, default=30)
    ap.add_argument("--overhead-steps-digits", type=int, default=200)
    ap.add_argument("--overhead-steps-text", type=int, default=60)
    ap.add_argument("--workdir", default="", help="keep the swarm's logs here")
    args = ap.parse_args()
    args.trials = args.trials or (2 if args.quick else 10)
    args.repeats = args.repeats or (1 if args.quick else 5)
    makers = {"digits": lambda: digits_task(args.steps_digits),
              "text": lambda: text_task(args.steps_text)}
    names = args.tasks.split(",")
    if any(n not in makers for n in names):
        ap.error(f"tasks must be among {list(makers)}")
    if min(args.steps_digits, args.steps_text) < 2 * args.every + 12:
        ap.error(f"jobs need at least {2 * args.every + 12} steps for a double loss")
    log = logging.getLogger("fedpipe")
    log.addHandler(WARNINGS)
    log.propagate = False
    workdir = args.workdir or tempfile.mkdtemp(prefix="fedpipe-faults-")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    print(f"{NODES} nodes (1 torch thread each), lease 5 s, seed {args.seed}, "
          f"{args.trials} kill trials per task; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {workdir}", flush=True)
    results = {}
    with LocalSwarm(n_nodes=NODES, workdir=workdir, timeout=180) as swarm:
        bench = Bench(swarm)
        for name in names:
            results[name] = run_task(bench, makers[name](), args, rng)
    report(results, args.every)
    print(f"\nwall time {time.monotonic() - t0:.0f} s; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if all(r.completed for res in results.values() for r in res["rows"]) and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir}")


if __name__ == "__main__":
    main()
