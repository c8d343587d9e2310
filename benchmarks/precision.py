"""bf16 mixed precision and activation recomputation on the text task, against fp32.

Issue 22's target: "On the text task the loss after 200 steps is within 2 % of fp32
training's". A :class:`~fedpipe.testing.LocalSwarm` (a tracker and 2 node processes on
127.0.0.1, 1 torch thread each) trains the same small causal character transformer
(:func:`fedpipe.examples.text.char_transformer`) on byte-tokenized ``pydoc_data.topics``
text, same batches, 2 stages, 1F1B, AdamW, under

* ``fp32``: the baseline;
* ``bf16-mixed``: ``precision="bf16-mixed"`` (autocast to bfloat16, float32 weights);
* ``fp32+recompute``: ``recompute=True`` (its weights must equal fp32's bit for bit, so
  its losses equal fp32's; shown with its step time).

For each: the mean training loss of the last 20 steps (at the tracker), the held-out loss
of the trained weights (evaluated in float32 in this process, on the last 10 % of the
text), and the median step time. The ratios are against fp32 in the same run; the load
average is printed (a busy machine slows every run alike, not the losses).

    python benchmarks/precision.py [--steps 200] [--batch 16] [--seq 64] [--d 64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import fedpipe  # noqa: E402
from fedpipe.examples import text  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

TARGET = 0.02
"""bf16-mixed's final loss may differ from fp32's by this fraction (issue 22)."""
RUNS = {"fp32": {}, "bf16-mixed": {"precision": "bf16-mixed"},
        "fp32+recompute": {"recompute": True}}


def held_out_loss(model: torch.nn.Sequential, data: torch.Tensor, seq: int) -> float:
    """Mean next-character loss of ``model`` in float32 over 64 fixed windows of ``data``."""
    batch = next(text.text_batches(data, 64, seq, seed=123))
    with torch.no_grad():
        return float(text.lm_loss(model.eval()(batch[0]), batch[1]))


def train(swarm: LocalSwarm, args: argparse.Namespace, knobs: dict) -> dict:
    """One job of ``args.steps`` steps; its losses, held-out loss and step time."""
    train_data, held = text.pydoc_text()
    model = text.char_transformer(d=args.d, seq=args.seq, seed=0)
    gen = text.text_batches(train_data, args.batch, args.seq, seed=0)
    batches = [next(gen) for _ in range(args.steps)]
    opt = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
    t0 = time.perf_counter()
    job = swarm.client().submit(model, text.lm_loss, opt, batches, steps=args.steps,
                                microbatches=4, schedule="1f1b", stages=2,
                                compression="none", seed=1, **knobs)
    status = job.wait(timeout=1800, progress=False)
    if status.state != "SUCCEEDED":
        raise SystemExit(f"{knobs}: the job ended {status.state}: {status.reason}")
    wall = time.perf_counter() - t0
    records = job.history()
    trained = job.model()
    job.release()
    losses = [r.loss for r in records]
    times = sorted(r.time for r in records)
    gaps = [b - a for a, b in zip(times, times[1:])][5:] or [0.0]
    return {"final": statistics.fmean(losses[-20:]), "held_out": held_out_loss(trained, held,
                                                                                args.seq),
            "step": statistics.median(gaps), "wall": wall, "state": trained.state_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=64)
    args = p.parse_args()
    print(f"text task: char transformer d={args.d}, 2 blocks, batch {args.batch} x "
          f"{args.seq} tokens, {args.steps} steps, 2 stages, 1F1B, 4 microbatches, AdamW; "
          f"{os.cpu_count()} cores; load %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    results = {}
    with LocalSwarm(n_nodes=2, threads=1, timeout=120) as swarm:
        for name, knobs in RUNS.items():
            results[name] = r = train(swarm, args, knobs)
            print(f"{name:>15}: train loss (last 20 steps) {r['final']:.4f}, held-out "
                  f"{r['held_out']:.4f}, step {r['step'] * 1e3:.1f} ms, job {r['wall']:.1f} s; "
                  f"load %.2f" % os.getloadavg()[0], flush=True)
    base = results["fp32"]
    for name in ("bf16-mixed", "fp32+recompute"):
        r = results[name]
        print(f"{name} / fp32: train loss x{r['final'] / base['final']:.4f}, held-out "
              f"x{r['held_out'] / base['held_out']:.4f}, step time "
              f"x{r['step'] / base['step']:.2f}")
    gap = abs(results["bf16-mixed"]["final"] / base["final"] - 1)
    print(f"target: bf16-mixed's loss after {args.steps} steps within {TARGET:.0%} of fp32's: "
          f"{'met' if gap <= TARGET else 'MISSED'} ({gap:.2%} apart)")
    same = all(torch.equal(results["fp32+recompute"]["state"][k], v)
               for k, v in base["state"].items())
    print(f"recompute's weights bit-equal to fp32's: {same}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
