"""One job on a local swarm whose nodes run on the given devices; weights checked against
single-process training. Run by tools/gpu-smoke.sh (``run``: CUDA nodes; ``check-cpu``).

A tracker and one node process per entry of ``--devices`` (``fedpipe node --device D``)
on 127.0.0.1 train a 2-stage MLP (float32, SGD with momentum, 1F1B, 4 microbatches) for a
few steps; the gathered weights must be within ``--tol`` (per tensor, max|a - b| / max|b|)
of the same model trained in this process on the CPU. On a GPU, cuBLAS's kernels sum in
another order than the CPU's, so bit equality is not expected; with TF32 off the float32
differences stay near 1e-6, far below 1e-4 (with TF32 on they reach about 1e-3).

Prints one line per job and exits non-zero on the first failure.

``--measure DEVICES [DEVICES ...]`` measures instead: for each entry (``cuda,cuda``,
``cpu,cpu``) a 2-stage 1F1B job whose stage boundary carries wide activations (a
``Linear(64, --width)``, ``Tanh``, ``Linear(--width, 10)``: little compute, ``--batch`` /
4 rows of ``--width`` float32 each way per microbatch, 8 MiB by default) trains
``--steps`` steps on the socket data plane, raw; its steady step time is the median of
``batch / samples_per_second`` over the steps after ``--warmup`` (the tracker's
per-step records, :meth:`fedpipe.Job.history`). One line per entry, then the entries
side by side.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import fedpipe  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

STEPS, BATCH, MICROBATCHES = 4, 32, 4
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(STEPS)]


def single_process(model: nn.Sequential, batches) -> dict[str, torch.Tensor]:
    """The reference: one optimizer step per batch, in this process, on the CPU."""
    model = copy.deepcopy(model)
    opt = SGD.build(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def max_relative_difference(a: dict, b: dict) -> float:
    """Per tensor max|a - b| / max|b|, the worst over the state dicts (same keys)."""
    if a.keys() != b.keys():
        raise AssertionError(f"weights differ in names: {sorted(a)} vs {sorted(b)}")
    return max((a[k].cpu() - b[k]).abs().max().item() / (b[k].abs().max().item() or 1.0)
               for k in b)


def train_on(devices: list[str], model: nn.Module, batches: list, steps: int,
             timeout: float) -> tuple[dict, list]:
    """Train ``model`` on ``batches`` for ``steps`` in a 2-stage 1F1B job (``compression
    "none"``) on a fresh swarm of one node per entry of ``devices``
    (``fedpipe node --device D``): its trained weights and its step records.

    Raises:
        AssertionError: the nodes are not on ``devices``, or the job did not succeed with
            one stage on each node within ``timeout`` seconds.
    """
    with LocalSwarm(n_nodes=0, timeout=180) as swarm:
        for i, device in enumerate(devices):
            swarm.add_node("--device", device)  # the last --device wins over LocalSwarm's
            swarm.wait_for_nodes(i + 1)
        swarm.wait_for_links()
        client = swarm.client()
        seen = sorted(n.resources.device.split(":")[0] for n in client.nodes())
        assert seen == sorted(d.split(":")[0] for d in devices), \
            f"nodes report devices {seen}, asked for {devices}"
        job = client.submit(model, nn.functional.cross_entropy, SGD, batches, steps=steps,
                            microbatches=MICROBATCHES, schedule="1f1b", stages=len(devices),
                            compression="none")
        status = job.wait(timeout=timeout, progress=False)
        assert status.state == "SUCCEEDED" and status.step == steps, \
            f"job ended {status.state} at step {status.step}"
        assert len({a.node_id for a in status.plan.stages}) == len(devices), \
            "expected one stage on each node"
        got, records = job.state_dict(), job.history()
        job.release()
    return got, records


def run(devices: list[str], tol: float) -> float:
    """Train on a swarm of nodes on ``devices``; the max relative difference to the reference.

    Raises:
        AssertionError: the nodes are not on ``devices``, the job did not succeed on two
            stages on distinct nodes, or the weights are off by more than ``tol``.
    """
    model, batches = make_model(), make_batches()
    want = single_process(model, batches)
    start = time.monotonic()
    got, _ = train_on(devices, model, batches, STEPS, timeout=300)
    seconds = time.monotonic() - start
    moved = max_relative_difference(got, model.state_dict())
    assert moved > 1e-3, f"the weights barely moved ({moved:.1e}): nothing was trained"
    diff = max_relative_difference(got, want)
    print(f"devices {','.join(devices)}: swarm and job done in {seconds:.1f} s, max relative "
          f"difference to single-process CPU training {diff:.2e} (tolerance {tol:g})",
          flush=True)
    assert diff <= tol, f"max relative difference {diff:.2e} exceeds {tol:g}"
    return diff


def wide_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 10))


def measure(devices: list[str], width: int, batch: int, steps: int, warmup: int) -> float:
    """The steady step time, ms, of a 2-stage 1F1B job on nodes on ``devices`` (module
    docstring); prints one line.

    Raises:
        AssertionError: the nodes are not on ``devices``, the job did not succeed with
            one stage on each node, or fewer than one step was recorded after ``warmup``.
    """
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(steps)]
    _, records = train_on(devices, wide_model(width), batches, steps, timeout=600)
    ms = [1000.0 * batch / r.samples_per_second for r in records
          if r.step > warmup and r.samples_per_second > 0]
    assert ms, f"no step recorded after the first {warmup} (records: {len(records)})"
    step = statistics.median(ms)
    mib = batch // MICROBATCHES * width * 4 / 2**20
    print(f"step {','.join(devices)}: {step:.1f} ms steady (median of {len(ms)} steps after "
          f"{warmup}; 2-stage 1F1B, {MICROBATCHES} microbatches of {batch // MICROBATCHES} "
          f"rows, {mib:.1f} MiB of activations per microbatch each way, raw)", flush=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cuda,cuda",
                    help="one node per comma-separated device (cpu, cuda, cuda:N)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative difference allowed")
    ap.add_argument("--measure", nargs="+", metavar="DEVICES",
                    help="measure the steady step time on each DEVICES (e.g. cuda,cuda "
                         "cpu,cpu) instead of checking the weights")
    ap.add_argument("--width", type=int, default=8192,
                    help="--measure: features of the activations between the stages")
    ap.add_argument("--batch", type=int, default=1024, help="--measure: rows per step")
    ap.add_argument("--steps", type=int, default=30, help="--measure: steps of the job")
    ap.add_argument("--warmup", type=int, default=5,
                    help="--measure: first steps left out of the median")
    args = ap.parse_args()
    if args.measure:
        if args.steps <= args.warmup:
            ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
        times = {d: measure(d.split(","), args.width, args.batch, args.steps, args.warmup)
                 for d in args.measure}
        print("steady step time: " + ", ".join(f"{d} {ms:.1f} ms" for d, ms in times.items()),
              flush=True)
        return
    # the reference stays in full float32 too
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    run(args.devices.split(","), args.tol)


if __name__ == "__main__":
    main()
