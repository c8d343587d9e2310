"""A pipeline step under fedpipe beside torch.distributed.pipelining, on one machine.

The same model, split, microbatches and optimizer run under:

* ``torch``: torch.distributed.pipelining (``Schedule1F1B`` or ``ScheduleGPipe``),
  one process per stage started with ``torch.multiprocessing`` spawn, gloo over
  127.0.0.1;
* ``fedpipe``: a :class:`~fedpipe.testing.LocalSwarm` (a tracker and one node
  process per stage over 127.0.0.1: gRPC for control, tensors over the socket
  data plane), the job submitted with ``stages=N`` and no compression; torch
  uses fedpipe's plan's layer ranges, so the split is the same;
* ``grpc``: the same on a second swarm whose nodes offer no data port
  (``--no-data-port``), so tensors travel over the gRPC data plane: the A/B of
  the two planes (``--no-grpc`` leaves it out);
* ``floor``: one process, gradient accumulation over the same microbatches.

Every process runs 1 torch thread. Rounds interleave the three, so a busy
machine slows them alike. A step time is the median gap between consecutive
steps after warm-up (fedpipe: at the tracker; torch: at stage 0, whose
``step()`` returns once its last backward is done, with the optimizer step
after it); a figure is the median over rounds. Configurations: an MLP
(8 × Linear(512, 512) with ReLU, batch 64) and a small transformer (4 encoder
layers, d_model 128, batch 16 × 32 tokens), each over 2 and 4 stages, 8
microbatches, SGD.

Each row also gives fedpipe's predicted step time and its error against the
measured one: the first job on a fresh swarm is planned with the probed
figures alone; later jobs on the same nodes with the tracker's calibrated
corrections (``fedpipe.planner.calibrate``).

4 stages on a 2-core machine oversubscribe it: both systems then measure the
OS scheduler as much as themselves.

    python benchmarks/vs_torch.py [--rounds 3] [--steps 30] [--schedule 1f1b] [--no-grpc]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import fedpipe  # noqa: E402
from fedpipe.testing import LocalSwarm  # noqa: E402

WARMUP = 5
"""Steps left out of each median (allocator, first messages, thread start)."""


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


@dataclass(frozen=True)
class Config:
    """One comparison: a model, its data and the pipeline depth."""

    name: str
    stages: int
    build: Callable[[], nn.Sequential]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    microbatches: int = 8
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn
    optimizer: Callable[[list], torch.optim.Optimizer] = sgd


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers)


def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)


def transformer() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 128)]
    layers += [nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
               for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(128, 64))


def transformer_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, 64, generator=g), torch.randn(16, 32, 64, generator=g)


CONFIGS = [Config(f"{model} {n} stages", n, build, batch)
           for n in (2, 4)
           for model, build, batch in (("mlp", mlp, mlp_batch),
                                       ("transformer", transformer, transformer_batch))]


def steady(times: list[float]) -> float:
    """Median gap between consecutive times after :data:`WARMUP` steps, seconds."""
    gaps = [b - a for a, b in zip(times, times[1:])][WARMUP:]
    return statistics.median(gaps)


# -- floor: one process --------------------------------------------------------------
def floor_step(cfg: Config, steps: int) -> float:
    """Single-process gradient accumulation over ``cfg.microbatches``, seconds per step."""
    model = cfg.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = cfg.batch()
    xs, ys = x.chunk(cfg.microbatches), y.chunk(cfg.microbatches)
    times = []
    for _ in range(steps):
        for xm, ym in zip(xs, ys):
            (loss_fn(model(xm), ym) * (xm.shape[0] / x.shape[0])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return steady(times)


# -- torch.distributed.pipelining ----------------------------------------------------
def _torch_worker(rank: int, cfg: Config, ranges: list[tuple[int, int]], steps: int,
                  schedule: str, port: int, out: str) -> None:
    torch_stage(rank, cfg, ranges, steps, schedule, f"tcp://127.0.0.1:{port}", out)


def torch_stage(rank: int, cfg: Config, ranges: list[tuple[int, int]], steps: int,
                schedule: str, init_method: str, out: str) -> None:
    """Stage ``rank`` of ``cfg`` under torch.distributed.pipelining: the children
    ``ranges[rank]`` of ``cfg.build()``, a gloo group of ``len(ranges)`` ranks rendezvousing at
    ``init_method`` (``tcp://HOST:PORT``, rank 0's), ``steps`` steps of ``schedule``
    (``1f1b`` or ``gpipe``) over ``cfg.microbatches``, then ``cfg.optimizer``'s step. Rank 0
    writes the ``time.perf_counter()`` after each step, a JSON list, to ``out``.
    Every process of the group runs this; gloo picks its interface from ``GLOO_SOCKET_IFNAME``
    if set."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    n = len(ranges)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n)
    model = cfg.build()
    start, end = ranges[rank]
    part = nn.Sequential(*list(model.children())[start:end])
    params = list(part.parameters())  # a stage of ReLUs alone has none
    opt = cfg.optimizer(params) if params else None
    stage = PipelineStage(part, rank, n, torch.device("cpu"))
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = kind(stage, cfg.microbatches, loss_fn=cfg.loss)
    x, y = cfg.batch()
    times = []
    for _ in range(steps):
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=y)
        else:
            sched.step()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def torch_step(cfg: Config, ranges: list[tuple[int, int]], steps: int, schedule: str) -> float:
    """Seconds per step under torch.distributed.pipelining with ``ranges`` per stage."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.json")
        mp.spawn(_torch_worker, args=(cfg, ranges, steps, schedule, _free_port(), out),
                 nprocs=len(ranges), join=True)
        return steady(json.loads(Path(out).read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- fedpipe -------------------------------------------------------------------------
def fedpipe_step(swarm: LocalSwarm, cfg: Config, steps: int, schedule: str) -> dict:
    """One job on the swarm: measured and predicted seconds per step, and its split."""
    x, y = cfg.batch()
    job = swarm.client().submit(cfg.build(), loss_fn,
                                fedpipe.optimizer(torch.optim.SGD, lr=0.01), [(x, y)],
                                steps=steps, microbatches=cfg.microbatches, schedule=schedule,
                                stages=cfg.stages, compression="none")
    times = [ev.time for ev in job.events() if ev.step > 0]
    status = job.wait(progress=False)
    job.release()
    plan = status.plan
    ranges = sorted((a.stage, a.layer_start, a.layer_end) for a in plan.stages)
    return {"measured": steady(times), "predicted": plan.predicted_step_seconds,
            "ranges": [(s, e) for _, s, e in ranges], "summary": plan.summary}


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    ap.add_argument("--only", default="", help="run only configurations whose name has this")
    ap.add_argument("--no-grpc", action="store_true",
                    help="leave out the gRPC data plane's swarm (the A/B of the planes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} cores; {load()}; schedule {args.schedule}; "
          f"{args.steps} steps per run, {args.rounds} interleaved rounds\n", flush=True)
    rows = []
    for n in (2, 4):
        cfgs = [c for c in CONFIGS if c.stages == n and args.only in c.name]
        if not cfgs:
            continue
        with contextlib.ExitStack() as stack:
            swarm = stack.enter_context(LocalSwarm(n_nodes=n, threads=1, timeout=120))
            grpc_swarm = None if args.no_grpc else stack.enter_context(
                LocalSwarm(n_nodes=n, threads=1, timeout=120, node_args=["--no-data-port"]))
            for cfg in cfgs:
                runs: dict[str, list] = {"torch": [], "fedpipe": [], "floor": [], "fp": [],
                                         "grpc": []}
                for r in range(args.rounds):
                    fp = fedpipe_step(swarm, cfg, args.steps, args.schedule)
                    runs["fp"].append(fp)
                    runs["fedpipe"].append(fp["measured"])
                    if grpc_swarm is not None:
                        runs["grpc"].append(fedpipe_step(grpc_swarm, cfg, args.steps,
                                                         args.schedule)["measured"])
                    runs["torch"].append(torch_step(cfg, fp["ranges"], args.steps,
                                                    args.schedule))
                    runs["floor"].append(floor_step(cfg, args.steps))
                    over_grpc = (f", over gRPC {runs['grpc'][-1] * 1e3:.1f} ms"
                                 if runs["grpc"] else "")
                    print(f"  {cfg.name} round {r}: fedpipe {fp['measured'] * 1e3:.1f} ms "
                          f"(predicted {fp['predicted'] * 1e3:.1f}){over_grpc}, torch "
                          f"{runs['torch'][-1] * 1e3:.1f} ms, floor "
                          f"{runs['floor'][-1] * 1e3:.1f} ms; {load()}", flush=True)
                rows.append((cfg, runs))
    print(f"\n{'config':<24}{'fedpipe ms':>11}{'torch ms':>10}{'floor ms':>10}"
          f"{'fp/torch':>10}{'(range)':>14}{'fp/floor':>10}   predicted vs measured "
          "(first job; later jobs)")
    verdicts = []
    for cfg, runs in rows:
        f, t, fl = (statistics.median(runs[k]) for k in ("fedpipe", "torch", "floor"))
        # the ratio of each round (its two runs were side by side), then the median
        ratios = [a / b for a, b in zip(runs["fedpipe"], runs["torch"])]
        ratio = statistics.median(ratios)
        errs = [fp["measured"] / fp["predicted"] - 1 for fp in runs["fp"]]
        later = ", ".join(f"{e * 100:+.0f}%" for e in errs[1:])
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{cfg.name:<24}{f * 1e3:>11.1f}{t * 1e3:>10.1f}{fl * 1e3:>10.1f}"
              f"{ratio:>10.2f}{spread:>14}{f / fl:>10.2f}   {errs[0] * 100:+.0f}%; {later}")
        if runs["grpc"]:
            g = statistics.median(runs["grpc"])
            planes = [a / b for a, b in zip(runs["fedpipe"], runs["grpc"])]
            vs_torch = statistics.median(a / b for a, b in zip(runs["grpc"], runs["torch"]))
            print(f"{'':<24}over gRPC {g * 1e3:.1f} ms: socket/grpc "
                  f"{statistics.median(planes):.2f} ({min(planes):.2f}-{max(planes):.2f}), "
                  f"grpc/torch {vs_torch:.2f}")
        if cfg.stages == 2:
            verdicts.append(("MET" if ratio <= 0.9 else "NOT MET",
                             f"{cfg.name}: fedpipe/torch {ratio:.2f} (median of {len(ratios)} "
                             f"rounds) <= 0.9"))
        worst = max((abs(e) for e in errs[1:]), default=float("nan"))
        verdicts.append(("MET" if worst <= 0.10 else "NOT MET",
                         f"{cfg.name}: later jobs within 10% of predicted: worst "
                         f"{worst * 100:.0f}% (first, uncalibrated job {errs[0] * 100:+.0f}%)"))
    print(f"\ntargets ({load()}; shared machine: other sessions run on these "
          f"{os.cpu_count()} cores):")
    for verdict, text in verdicts:
        print(f"  {verdict:<8}{text}")
    if any(cfg.stages > (os.cpu_count() or 1) for cfg, _ in rows):
        print(f"caveat: {max(c.stages for c, _ in rows)} stages on {os.cpu_count()} cores "
              "oversubscribe the machine: both systems measure the OS scheduler as much as "
              "themselves.")


if __name__ == "__main__":
    main()
