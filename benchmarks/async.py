"""Time to a target loss with one replica group behind a slow link: sync, async, DiLoCo.

A LocalSwarm of 4 node processes on 127.0.0.1 with emulated links (fedpipe's
token bucket + delay, see :mod:`fedpipe.net.emulation`):

- every link: 400 Mbit/s (50 MB/s), 2 ms one way;
- everything node3 sends: 40 Mbit/s (5 MB/s), 20 ms one way, i.e. 10x less
  bandwidth and 10x the latency (node3 sits behind a slow uplink).

Jobs are pinned to ``replicas=2, stages=2``: two replica groups of two
stages; the group that holds node3 has a slow hop inside it and sends over
the slow link in every exchange between the groups. Four configurations, the
same optimizer, batches and number of steps:

- ``sync``: schedule "1f1b", gradients all-reduced across the groups every step;
- ``async``: schedule "async" (PipeDream-style, ``max_staleness=1``) inside
  each group, gradients all-reduced every step;
- ``DiLoCo H=10`` / ``DiLoCo H=50``: schedule "1f1b" inside each group, a
  DiLoCo outer step every H inner steps (outer lr 0.7, Nesterov momentum 0.9,
  pseudo-gradients uncompressed).

Two tasks: the digits MLP (:mod:`fedpipe.examples.digits`) and a small
character-level transformer (d=64, 4 heads, 2 blocks, context 64) on Python's
own documentation (``pydoc_data.topics``, bundled with CPython; the last 10%
of the text is held out). Activation/gradient codecs inside the groups are the
planner's ("auto"), the same plan for all configurations.

Measured per job, from the tracker's step events (a step is recorded when
every group has reported it): the loss smoothed by a trailing mean over 10
steps; the target is the smoothed loss ``sync`` has reached at 65% of its
steps; time to target is the wall time from the first step event to the first
step whose smoothed loss is at or below the target. Final loss: the smoothed
training loss of the last step, and the loss of the trained weights (group
0's) on held-out data. Benchmark target: time to target <= 0.5x sync and final
loss within 2% of sync.

    python benchmarks/async.py [--quick] [--tasks digits,text] [--steps-digits N] [--steps-text N]
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

try:
    import fedpipe  # noqa: F401
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fedpipe  # noqa: E402
from fedpipe.examples import digits  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

torch.set_num_threads(1)

SLOW_NODE = "node3"
LINKS = {
    "links": [  # the first match wins
        {"from": SLOW_NODE, "to": "*", "mbps": 40, "latency_ms": 20, "oneway": True},
        {"from": "*", "to": "*", "mbps": 400, "latency_ms": 2},
    ],
}
SMOOTH = 10          # steps in the trailing mean of the loss
TARGET_AT = 0.65     # the target is sync's smoothed loss at this fraction of its steps
CONFIGS = {          # name -> submit() arguments
    "sync": dict(schedule="1f1b", replica_sync="allreduce"),
    "async": dict(schedule="async", max_staleness=1, replica_sync="allreduce"),
    "DiLoCo H=10": dict(schedule="1f1b", replica_sync=fedpipe.DiLoCo(inner_steps=10)),
    "DiLoCo H=50": dict(schedule="1f1b", replica_sync=fedpipe.DiLoCo(inner_steps=50)),
}


# -- the text task: a character-level transformer on pydoc_data.topics ---------
VOCAB = 128  # ASCII; other characters become "?"


def pydoc_text() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) character codes of Python's documentation topics (90/10)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")
    data = torch.tensor(list(text), dtype=torch.int64).clamp_(max=VOCAB - 1)
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def text_batches(data: torch.Tensor, batch: int, seq: int, seed: int = 0):
    """Endless (input, next-character target) batches of random windows."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g).tolist()
        chunk = torch.stack([data[s:s + seq + 1] for s in starts])
        yield chunk[:, :-1], chunk[:, 1:]


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.proj(self.ln(x))


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def char_transformer(d: int = 64, heads: int = 4, blocks: int = 2, seq: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(VOCAB, d, seq), *[Block(d, heads) for _ in range(blocks)],
                         Head(d, VOCAB))


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


def digits_task(steps: int) -> Task:
    x_train, y_train, x_test, y_test = digits.load()
    return Task("digits", "digits MLP 64-128-128-10, AdamW lr 3e-3, batch 64 in 4 microbatches",
                lambda: digits.make_model(hidden=128),
                lambda: digits.batches(x_train, y_train, 64),
                nn.functional.cross_entropy, fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                4, (x_test, y_test), steps)


def text_task(steps: int, seq: int = 64) -> Task:
    train, test = pydoc_text()
    held = next(text_batches(test, 128, seq, seed=1))
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
    plan: str = ""
    slow_group: int = -1
    missed: int = 0
    late: int = 0

    def smoothed(self) -> list[float]:
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
            raise fedpipe.client.JobFailed(str(status))
        time.sleep(0.1)
    raise TimeoutError("no plan")


def node_logs(swarm: LocalSwarm) -> str:
    return "".join(swarm.log(p) for p in swarm.nodes)


def run_config(swarm: LocalSwarm, task: Task, config: str) -> Run:
    model = task.make_model()
    job = swarm.client().submit(model, task.loss_fn, task.optimizer, task.make_batches(),
                                steps=task.steps, microbatches=task.microbatches, stages=2,
                                replicas=2, name=f"{task.name}-{config}", **CONFIGS[config])
    before = node_logs(swarm)
    plan = plan_of(job)
    run = Run(config)
    groups = sorted({a.replica for a in plan.stages})
    if len(groups) != 2 or len(plan.stages) != 4:
        raise RuntimeError(f"expected 2 groups of 2 stages, got: {plan.summary}")
    run.slow_group = next((a.replica for a in plan.stages if a.node_name == SLOW_NODE), -1)
    codecs = ", ".join(f"g{a.replica}s{a.stage} {a.node_name} act {a.activation_codec or 'raw'}"
                       f"/grad {a.gradient_codec or 'raw'}"
                       for a in sorted(plan.stages, key=lambda a: (a.replica, a.stage)))
    shares = ", ".join(f"g{i}: {r.samples} samples in {r.microbatches} mb"
                       for i, r in enumerate(plan.replicas))
    run.plan = f"{plan.summary} [{shares}] [{codecs}]"
    for ev in job.events():
        if ev.step:
            run.steps.append(ev.step)
            run.times.append(ev.time)
            run.losses.append(ev.loss)
    status = job.status()
    order = sorted(range(len(run.steps)), key=run.steps.__getitem__)
    run.steps = [run.steps[i] for i in order]
    run.times = [run.times[i] for i in order]
    run.losses = [run.losses[i] for i in order]
    if status.state != "SUCCEEDED" or len(run.steps) != task.steps:
        raise RuntimeError(f"{config}: {status} ({len(run.steps)} step events)")
    trained = job.model()
    job.release()
    with torch.no_grad():
        trained.eval()
        run.held_out = task.loss_fn(trained(task.held_out[0]), task.held_out[1]).item()
    new = node_logs(swarm)[len(before):] if node_logs(swarm).startswith(before) else ""
    run.missed = len(re.findall("within the grace period", new))
    run.late = len(re.findall("applied replica", new))
    return run


def fmt_s(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f} s"


def fmt_ratio(x: float) -> str:
    return "-" if math.isinf(x) or math.isnan(x) else f"{x:.2f}"


def report(task: Task, runs: dict[str, Run]) -> list[tuple[str, str, bool, bool]]:
    sync = runs["sync"]
    target = sync.smoothed()[max(0, round(TARGET_AT * task.steps) - 1)]
    t_sync = sync.time_to(target)
    print(f"\n== {task.name}: {task.describe}; {task.steps} steps")
    print(f"target loss {target:.4f} (sync's smoothed loss at step "
          f"{round(TARGET_AT * task.steps)} of {task.steps})")
    head = (f"{'config':<12} {'time to target':>14} {'vs sync':>7} {'total':>8} "
            f"{'final loss':>10} {'vs sync':>7} {'held-out':>9} {'vs sync':>7}  notes")
    print(head)
    print("-" * len(head))
    verdicts = []
    for name, r in runs.items():
        t = r.time_to(target)
        notes = f"slow node in group {r.slow_group}"
        if name.startswith("DiLoCo"):
            notes += f"; pseudo-gradients late {r.missed}, applied late {r.late}"
        print(f"{name:<12} {fmt_s(t):>14} {fmt_ratio(t / t_sync):>7} {r.total:>6.1f} s "
              f"{r.final:>10.4f} {r.final / sync.final:>7.3f} {r.held_out:>9.4f} "
              f"{r.held_out / sync.held_out:>7.3f}  {notes}")
        if name != "sync":
            fast = t / t_sync <= 0.5
            close = abs(r.final / sync.final - 1) <= 0.02
            verdicts.append((name, f"time {fmt_ratio(t / t_sync)}x, final loss "
                                   f"{(r.final / sync.final - 1) * 100:+.1f}% (held-out "
                                   f"{(r.held_out / sync.held_out - 1) * 100:+.1f}%)", fast, close))
    print("targets (time to target <= 0.5x sync, final loss within 2% of sync):")
    for name, what, fast, close in verdicts:
        ok = "MET" if fast and close else "NOT MET"
        why = [] if fast and close else [w for w, bad in (("time", not fast), ("loss", not close))
                                         if bad]
        print(f"  {name:<12} {ok:<8} {what}" + (f"  [misses: {', '.join(why)}]" if why else ""))
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 2 minutes)")
    ap.add_argument("--tasks", default="digits,text")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps-digits", type=int, default=0)
    ap.add_argument("--steps-text", type=int, default=0)
    args = ap.parse_args()
    steps = {"digits": args.steps_digits or (100 if args.quick else 300),
             "text": args.steps_text or (100 if args.quick else 300)}
    makers = {"digits": digits_task, "text": text_task}
    tasks = [makers[t](steps[t]) for t in args.tasks.split(",")]
    configs = args.configs.split(",")
    if configs[0] != "sync":
        ap.error("the first configuration must be sync (it sets the target)")
    print("links: every link 400 Mbit/s, 2 ms; everything node3 sends 40 Mbit/s, 20 ms "
          "(10x slower); replicas=2, stages=2")
    t0 = time.monotonic()
    with LocalSwarm(n_nodes=4, link_profile=LINKS, timeout=180) as swarm:
        client = swarm.client()
        print("nodes: " + ", ".join(f"{n.name} {n.resources.flops / 1e9:.1f} GFLOP/s"
                                    for n in client.nodes()))
        for task in tasks:
            runs = {}
            for config in configs:
                runs[config] = run_config(swarm, task, config)
                r = runs[config]
                print(f"[{task.name}/{config}] {r.total:.1f} s for {task.steps} steps, final "
                      f"loss {r.final:.4f}; plan: {r.plan}", flush=True)
            report(task, runs)
    print(f"\nwall time {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
