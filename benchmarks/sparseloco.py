"""SparseLoCo against uncompressed DiLoCo: bytes per outer step and final loss at equal steps.

In-process emulation of the replica groups (a real swarm of 2+ groups is too
slow on this shared 2-core machine for 3 seeds of each setting): 2 replica
groups, each one stage holding the whole model, each in a thread of its own,
run fedpipe's own :class:`fedpipe.runtime.diloco.OuterSync` (the code a stage
runs) over an in-memory transport that encodes every pseudo-gradient with the
wire codec (:func:`fedpipe.wire.codecs.encode`) and delivers what the peer
decodes. The bytes counted are those messages' payloads, as a node would send
them.

Task: the character transformer of :mod:`fedpipe.examples.text` (d=64, 4
heads, 2 blocks, context 64) on Python's documentation (``pydoc_data``), batch
32 split evenly between the groups, AdamW lr 3e-3 inside the groups, H = 5.
Seed s draws the initial weights and the batches.

Configurations, the same steps each:

- ``DiLoCo``: uncompressed (fp32) pseudo-gradients, outer SGD lr 0.7 with
  Nesterov momentum 0.5 (``benchmarks/async.py``'s setting for runs this short);
- ``SparseLoCo``: :meth:`fedpipe.spec.DiLoCo.sparseloco` with the top 2 % of
  each 4096-chunk, 2-bit values, error feedback decayed by 0.95, no momentum,
  outer lr 2.

Why these settings (seed 0, one run each, 300 steps unless said; held-out loss,
uncompressed DiLoCo H=10: 2.011, H=5: 1.993, H=5 at 600 steps: 1.591): the
paper's SparseLoCo (1.56 %, β 0.95, outer lr 1) at H=10 ended at 2.213 (+10 %);
outer lr 2: 2.159, lr 3: 2.182, β 1: 2.221, β 0.9: 2.157; at H=5, outer lr 2:
2.111 (1.56 %) and 2.073 (2.2 %, but 97x fewer bytes only), 1.663 at 600 steps
(+4.5 %); at H=2: 2.081 against 1.990. With DiLoCo's Nesterov momentum
instead of the decayed feedback, 1.56 % ended at 2.174 (H=5). What costs the
loss is the sparsity: 2-bit values of every entry (``sparseloco:1.0``) with
DiLoCo's outer step ended at 1.983, below fp32's 1.993. The inner AdamW makes
pseudo-gradients of near-equal magnitude everywhere, so a top 2 % moves few of
them per outer step; SparseLoCo's gains were measured on 512 M-parameter LLMs.

Printed per configuration and seed: the held-out loss of the final outer
model (the groups are bit-identical after the last outer step) on 512
held-out windows; per configuration: the mean, the spread across seeds
((max - min) / mean), bytes each holder sends per outer step, and the load
average. Targets: SparseLoCo >= 100x fewer bytes per outer step than a dense
fp32 all-reduce (with 2 groups a ring all-reduce sends each holder's 4 bytes
per parameter once: DiLoCo's own message here), its mean final loss within 2 %
of DiLoCo's, on a setting where DiLoCo's 3-seed spread is < 1 %.

    python benchmarks/sparseloco.py [--steps N] [--seeds 0,1,2] [--cosine] [--jobs N] [--quick]

``--quick``: 60 steps, one seed (a smoke run). Default: 3,000 steps, 3 seeds, 2 runs at
once (the setting of the targets: about 15 minutes here). ``--cosine``: the inner lr
decays from 3e-3 to 3e-4 over the run (both configurations alike), to take the final
model out of constant-lr noise, which the 3-seed spread measures too. ``--jobs N``: N
runs at once, each in a forked process (the results are the same, bit for bit: each run
is seeded; the run times are not).

Measured (300 steps, 2026-12-02, load average 10.6 at the start, 12.4 at the end):
SparseLoCo 4,440 B per outer step per holder against DiLoCo's 482,816 (109x fewer);
mean held-out loss 2.1043 against 1.9935 (+5.6 %: the 2 % target is missed); DiLoCo's
3-seed spread 1.34 % (the < 1 % target is missed too: 300 steps is still early in
training; SparseLoCo's spread 1.71 %). ``--steps 600`` (load 9.2 -> 5.4): 109x fewer
bytes, 1.7041 against 1.6041 (+6.2 %), DiLoCo's spread 2.05 %, SparseLoCo's 2.15 %.
``--steps 1500`` (load 15.3 -> 7.3, 22 minutes): 109x fewer bytes, 1.3763 against
1.3568 (+1.44 %: within 2 %), DiLoCo's spread 1.17 % (still over 1 %), SparseLoCo's
1.14 %. The gap closes with training: +5.6 % at 300 steps, +6.2 % at 600, +1.4 % at 1,500.
``--steps 1200 --cosine`` (2026-12-02, load 11.6 -> 21, cut after 4 of its 6 runs: over
20 minutes at that load): DiLoCo 1.4539 (seed 0), 1.4674 (seed 1): 0.93 % apart (the
third seed not run); SparseLoCo 1.5105, 1.5433 (+3.9 %, +5.2 %): the decayed lr widens
SparseLoCo's gap against the constant lr's +1.4 % at 1,500 steps.
``--steps 1500 --cosine --jobs 6`` (2026-12-02 21:03-21:22 UTC, 19 minutes, load average
15.7 at the start, 14.0 at the end): 109x fewer bytes (4,440 against 482,816); DiLoCo
1.3852, 1.3988, 1.3863 (mean 1.3901, 3-seed spread 0.98 %: under 1 %); SparseLoCo
1.4176, 1.4470, 1.4476 (mean 1.4374, +3.40 %: the 2 % target is missed; spread 2.09 %).
Up to 1,500 steps no setting met both: constant lr closes the gap (+1.44 % at 1,500
steps) but leaves DiLoCo's spread over 1 % (1.17 %); the cosine decay brings the spread
under 1 % but leaves SparseLoCo 3.4 % behind.
``--steps 3000 --jobs 6`` (2026-12-03 07:00-07:15 UTC, 15 minutes, load average 2.8 at
the start, 11.4 at the end; ``benchmarks/results/sparseloco-3000.txt``), now the default:
109x fewer bytes (4,440 against 482,816); DiLoCo 1.2790, 1.2872, 1.2889 (mean 1.2850,
3-seed spread 0.77 %: under 1 %); SparseLoCo 1.2910, 1.2957, 1.3098 (mean 1.2988,
+1.07 %: within 2 %; spread 1.45 %). All three targets met in one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

try:
    import fedpipe
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fedpipe
from fedpipe.examples.text import char_transformer, lm_loss, pydoc_text, text_batches
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.diloco import OuterSync
from fedpipe.spec import DiLoCo, StageKey
from fedpipe.testing.outer import OuterWire
from pool import imap  # benchmarks/, beside this script

GROUPS, BATCH, SEQ, H = 2, 32, 64, 5
LR, LR_FLOOR = 3e-3, 3e-4
"""The groups' inner AdamW learning rate, and where ``--cosine`` takes it by the last step."""
CONFIGS = {
    "DiLoCo": DiLoCo(inner_steps=H, outer_lr=0.7, outer_momentum=0.5),
    "SparseLoCo": DiLoCo.sparseloco(inner_steps=H, outer_lr=2.0, fraction=0.02),
}


def run(config: DiLoCo, seed: int, steps: int, train, held,
        cosine: bool = False) -> tuple[float, float, int]:
    """One DiLoCo run: (held-out loss of the final model, seconds, bytes per outer step
    per holder). ``cosine``: the inner lr decays from :data:`LR` to :data:`LR_FLOOR` over
    the ``steps`` (``CosineAnnealingLR``, stepped after each inner step), else stays at LR."""
    model = char_transformer(seq=SEQ, seed=seed)
    batches = text_batches(train, BATCH, SEQ, seed=seed)
    data = [next(batches) for _ in range(steps)]
    spans = [StageSpan(StageKey(r, 0), 0, len(model)) for r in range(GROUPS)]
    wire = OuterWire()
    replicas = [char_transformer(seq=SEQ, seed=seed) for _ in range(GROUPS)]
    syncs = [OuterSync(m, StageKey(r, 0), spans, config, [1] * GROUPS,
                       wire.transport(StageKey(r, 0)), last_step=steps - 1, grace_floor=1e9)
             for r, m in enumerate(replicas)]
    errors: list[Exception] = []

    def group(r: int) -> None:
        try:
            m, sync = replicas[r], syncs[r]
            opt = fedpipe.optimizer(torch.optim.AdamW, lr=LR).build(m.parameters())
            schedule = (fedpipe.lr_scheduler(torch.optim.lr_scheduler.CosineAnnealingLR,
                                             T_max=steps, eta_min=LR_FLOOR).build(opt)
                        if cosine else None)
            for step, (x, y) in enumerate(data):
                xs, ys = x.chunk(GROUPS)[r], y.chunk(GROUPS)[r]
                (lm_loss(m(xs), ys) * (len(xs) / len(x))).backward()
                sync.rescale_gradients(step)
                opt.step()
                opt.zero_grad()
                if schedule is not None:
                    schedule.step()
                sync(step)
        except Exception as e:  # noqa: BLE001 — raised below, once both threads ended
            errors.append(e)
            wire.fail(e)  # the other group stops waiting for this one's outer messages

    t0 = time.perf_counter()
    threads = [threading.Thread(target=group, args=(r,)) for r in range(GROUPS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    assert all(torch.equal(a, b) for a, b in zip(replicas[0].parameters(),
                                                 replicas[1].parameters()))
    with torch.no_grad():
        loss = lm_loss(replicas[0](held[0]), held[1]).item()
    return loss, seconds, wire.sent_bytes[0] // syncs[0].outer_step


_DATA: dict[str, object] = {}
"""The text and held-out batch, set before a pool forks (its workers inherit them)."""


def _task(task: tuple[str, int, int, bool]) -> tuple[float, float, int]:
    name, seed, steps, cosine = task
    return run(CONFIGS[name], seed, steps, _DATA["train"], _DATA["held"], cosine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="60 steps, seed 0: a smoke run")
    parser.add_argument("--cosine", action="store_true",
                        help="decay the inner lr from 3e-3 to 3e-4 over the run (cosine)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at once, each in a process of its own (default 2)")
    args = parser.parse_args()
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    steps = 60 if args.quick else args.steps
    torch.set_num_threads(1)
    train, test = pydoc_text()
    held = next(text_batches(test, 512, SEQ, seed=1000))
    _DATA.update(train=train, held=held)
    params = sum(p.numel() for p in char_transformer(seq=SEQ).parameters())
    load0 = os.getloadavg()
    print(f"in-process emulation: {GROUPS} replica groups (threads) running OuterSync over "
          f"wire-encoded messages; char transformer ({params:,} parameters), batch {BATCH}, "
          f"H={H}, {steps} steps, inner AdamW lr {LR:g}"
          f"{f' cosine to {LR_FLOOR:g}' if args.cosine else ' constant'}, seeds {seeds}, "
          f"{args.jobs} run(s) at once; "
          f"load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}")
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in CONFIGS}
    tasks = [(name, seed, steps, args.cosine)  # interleaved, so load changes hit both alike
             for seed in seeds for name in CONFIGS]
    for (name, seed, _, _), (loss, seconds, nbytes) in zip(tasks, imap(_task, tasks,
                                                                       args.jobs)):
        results[name].append((loss, seconds, nbytes))
        print(f"  {name:<11} seed {seed}: held-out loss {loss:.4f}  ({seconds:.0f} s, "
              f"{nbytes:,} B per outer step per holder)", flush=True)
    print()
    dense_bytes = results["DiLoCo"][0][2]
    base = sum(r[0] for r in results["DiLoCo"]) / len(seeds)
    print(f"{'config':<11} {'mean loss':>9} {'spread':>7} {'vs DiLoCo':>9} "
          f"{'B/outer step':>12} {'fewer B':>8}")
    for name, rs in results.items():
        losses = [r[0] for r in rs]
        mean = sum(losses) / len(losses)
        spread = (max(losses) - min(losses)) / mean
        print(f"{name:<11} {mean:9.4f} {spread:7.2%} {mean / base - 1:+9.2%} "
              f"{rs[0][2]:12,} {dense_bytes / rs[0][2]:7.1f}x")
    load1 = os.getloadavg()
    sparse = results["SparseLoCo"]
    ratio = dense_bytes / sparse[0][2]
    gap = sum(r[0] for r in sparse) / len(sparse) / base - 1
    dense_losses = [r[0] for r in results["DiLoCo"]]
    spread = (max(dense_losses) - min(dense_losses)) / base
    print(f"\ntargets: bytes {ratio:.0f}x fewer (>= 100x: {'met' if ratio >= 100 else 'MISSED'}); "
          f"loss {gap:+.2%} vs DiLoCo (within 2 %: {'met' if gap <= 0.02 else 'MISSED'}); "
          f"DiLoCo {len(seeds)}-seed spread {spread:.2%} (< 1 %: "
          f"{'met' if spread < 0.01 else 'MISSED'})")
    print(f"load average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")


if __name__ == "__main__":
    main()
