"""The cost of mutual TLS: training step time over mTLS against plaintext, interleaved in one run.

Starts two LocalSwarms of the same size, one plaintext and one with
``tls=True``, and trains the digits MLP (one stage per node, 1F1B) on each in
turn, ``--rounds`` times, so both see the same machine load. A job's step time
is the median interval between the tracker's records of consecutive steps,
past the first ``WARMUP`` steps. Prints each round, then the median ratio
TLS / plaintext with the load average (target: within 1.15).

Usage: python benchmarks/tls.py [--nodes 2] [--steps 150] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.testing import LocalSwarm

WARMUP = 10
"""Steps left out of the median: planning, deployment and the first passes."""


def step_seconds(client, steps: int, stages: int) -> float:
    """Median seconds per training step of one digits job on ``client``'s swarm."""
    x, y, _, _ = digits.load()
    job = client.submit(digits.make_model(), nn.functional.cross_entropy,
                        fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                        digits.batches(x, y, 64), steps=steps, microbatches=4,
                        schedule="1f1b", stages=stages, name="tls-bench")
    job.wait(progress=False)
    times = [r.time for r in job.history()]
    job.release()
    gaps = [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1:])]
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with LocalSwarm(args.nodes) as plain, LocalSwarm(args.nodes, tls=True) as secure:
        clients = {"plaintext": plain.client(), "mutual TLS": secure.client()}
        results: dict[str, list[float]] = {k: [] for k in clients}
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                s = step_seconds(clients[name], args.steps, args.nodes)
                results[name].append(s)
                print(f"round {r + 1} {name:>10}: {s * 1e3:7.2f} ms/step", flush=True)
    ratios = [t / p for t, p in zip(results["mutual TLS"], results["plaintext"])]
    load = os.getloadavg()
    print(f"step time, median of {args.rounds} rounds: plaintext "
          f"{statistics.median(results['plaintext']) * 1e3:.2f} ms, mutual TLS "
          f"{statistics.median(results['mutual TLS']) * 1e3:.2f} ms; ratio TLS/plaintext "
          f"{statistics.median(ratios):.3f} (per round: "
          + ", ".join(f"{x:.3f}" for x in ratios)
          + f"); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} cores", flush=True)


if __name__ == "__main__":
    main()
