"""A model larger than any node's memory limit, trained over 4 local nodes (issue 22).

The model: a ``transformers`` Llama (``LlamaConfig``: 24 layers, hidden 1024, MLP 2816,
byte vocabulary; 309 M parameters) built under ``torch.device("meta")`` and split by
:func:`fedpipe.hf.sequential`. The client holds no weight. Two runs, each on a fresh
:class:`fedpipe.swarm.LocalSwarm` of 4 node processes (1 torch thread each) with
checkpoints on:

1. **from a seed**: each node makes its own layers (``seed``, the model's own init);
2. **from real weights**: a sharded safetensors directory that a subprocess writes with
   ``save_pretrained`` (several shards); each node reads only its layers' tensors.

Both train on byte-tokenized ``pydoc_data.topics`` text. The single-process reference of
each run is a subprocess (this file with ``--reference``), which trains the same weights
the same way (the batch split into the pipeline's microbatches) and reports its losses and
its peak RSS after one step (``VmHWM``). Every node keeps its checkpoint snapshots on
disk (``--snapshot-dir``, a directory of its own in the swarm's temp dir), so the planner
prices no snapshot copy in its memory. Each node's ``--memory-limit`` is set below a
third of that peak (computed from it, 1 MiB under), unless the planner's prediction for a
stage (:func:`fedpipe.planner.stage_memory_bytes`) needs more: then the limit is 5 % above
what the plan needs and the target is reported missed, by how much. Each stage's measured
peak is set against what the tracker predicted for it
(:func:`fedpipe.planner.protoio.assignment_memory_bytes` with the job's optimizer), and the
prediction is broken down (weights, gradients and optimizer state; the snapshot tensor in
flight; activations and buffers).

Printed, each target MET or MISSED (by how much), with ``os.getloadavg()``:

- the first 3 losses against the single-process run's (relative 1e-4);
- the client's RSS growth over its baseline (<= 300 MB) and the tracker's peak RSS
  (< 250 MB);
- each stage's measured peak: its node's ``VmHWM`` minus its ``VmRSS`` before the job was
  submitted (one stage per node), against the planner's prediction (+-20 %) and the
  node's limit;
- deploy time: submit until every stage runs.

    python benchmarks/bigmodel.py [--quick] [--steps N] [--checkpoint-every K] [--seed-only]

``--quick``: a 4-layer model of hidden 64, the same path end to end (two references, two
swarms of 4 nodes): about 4 minutes at a load average of 20 on 2 cores, so no test runs it.
The full run took 28 minutes at a load average of 13 to 30 (2026-12-02, nodes with
``--snapshot-dir``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fedpipe  # noqa: E402
from fedpipe.hf import lm_loss, sequential  # noqa: E402

SEED, MB = 7, 2**20
LOSS_RTOL, CLIENT_MB, TRACKER_MB, PREDICTION_TOL = 1e-4, 300, 250, 0.20


@dataclass(frozen=True)
class Setup:
    """The model and the run: ``LlamaConfig`` sizes and the batches."""

    layers: int
    hidden: int
    mlp: int
    heads: int
    seq: int = 32
    batch: int = 2
    microbatches: int = 2
    steps: int = 3
    lr: float = 1e-3
    shard: str = "200MB"
    checkpoint_every: int = 2

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=self.layers, hidden_size=self.hidden,
                           intermediate_size=self.mlp, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, vocab_size=256,
                           max_position_embeddings=self.seq, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, tie_word_embeddings=False)


FULL = Setup(layers=24, hidden=1024, mlp=2816, heads=16, seq=16, checkpoint_every=3)
QUICK = Setup(layers=4, hidden=64, mlp=128, heads=4, seq=16, shard="40KB")
OPTIMIZER = dict(lr=1e-3, momentum=0.9)


def optimizer():
    """SGD with momentum: a stage keeps weights, gradients and one buffer."""
    return fedpipe.optimizer(torch.optim.SGD, **OPTIMIZER)


def batches(setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``setup.steps`` (input, next-byte target) batches of Python's own documentation."""
    from pydoc_data.topics import topics

    data = torch.tensor(list("".join(topics[k] for k in sorted(topics)).encode()),
                        dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(setup.steps):
        starts = torch.randint(0, len(data) - setup.seq - 1, (setup.batch,), generator=g)
        chunk = torch.stack([data[s:s + setup.seq + 1] for s in starts.tolist()])
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process, bytes (from /proc/PID/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def meta_model(setup: Setup):
    """The Llama on the meta device, as fedpipe layers."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sequential(LlamaForCausalLM(setup.config()))


# -- the single-process reference (a subprocess) ------------------------------------
def reference(setup: Setup, weights: str | None) -> dict:
    """Train in this process as the pipeline does; the losses and the peak RSS after one
    step. ``weights``: write a ``save_pretrained`` directory there first and start from
    it; None: start from the seed's weights, as the nodes make them."""
    torch.set_num_threads(2)
    if weights is None:
        adapted = meta_model(setup)
        fedpipe.materialize(adapted.layers, SEED, adapted.init_fn, ties=adapted.tied_parameters)
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(SEED)
        model = LlamaForCausalLM(setup.config())
        model.save_pretrained(weights, max_shard_size=setup.shard)
        adapted = sequential(model)
    model = adapted.layers
    opt = optimizer().build(model.parameters())
    losses, peak = [], 0
    for x, y in batches(setup):
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for xm, ym in zip(x.tensor_split(setup.microbatches), y.tensor_split(setup.microbatches)):
            scaled = lm_loss(model(xm), ym).reshape(()) * (xm.shape[0] / x.shape[0])
            scaled.backward()
            loss += scaled.item()
        opt.step()
        losses.append(loss)
        peak = peak or proc_status()["VmHWM"]  # after the first step
    params = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "peak": peak, "params": params}


def run_reference(setup: Setup, weights: str | None) -> dict:
    """:func:`reference` in a subprocess (its peak RSS is its own)."""
    args = [sys.executable, __file__, "--reference", json.dumps(asdict(setup))]
    if weights is not None:
        args += ["--weights", weights]
    done = subprocess.run(args, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"the single-process reference failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the planner's prediction ----------------------------------------------------------
def planner_inputs(setup: Setup, adapted):
    """The planner's profile of the model and its training config for the job."""
    from fedpipe.planner.protoio import train_config
    from fedpipe.runtime.materialize import meta_profile
    from fedpipe.spec import JobSpec

    x, _ = batches(setup)[0]
    return meta_profile(list(adapted.layers), x), train_config(
        JobSpec(steps=setup.steps, microbatches=setup.microbatches, batch_size=setup.batch,
                schedule="1f1b", stages=4, checkpoint_every=setup.checkpoint_every,
                optimizer_kind=optimizer().kind))


def predictions(inputs, bounds: list[int]) -> list[float]:
    """The planner's memory model for stages ``[bounds[k], bounds[k+1])`` on nodes that
    keep snapshots on disk, bytes."""
    from fedpipe.planner import stage_memory_bytes

    profile, config = inputs
    n = len(bounds) - 1
    return [stage_memory_bytes(profile, bounds[k], bounds[k + 1], config, k, n,
                               snapshots_on_disk=True)
            for k in range(n)]


def breakdown(inputs, a, total: float) -> str:
    """What the planner's prediction ``total`` for stage assignment ``a`` holds, in MB."""
    from fedpipe.planner.costs import disk_snapshot_bytes

    profile, config = inputs
    params = sum(layer.parameter_bytes for layer in profile.layers[a.layer_start:a.layer_end])
    state = params * config.state_factor
    snaps = disk_snapshot_bytes(profile, a.layer_start, a.layer_end, config) \
        if a.snapshots_on_disk else total - state  # in memory: the copies
    return (f"weights+grads+momentum {state / MB:.0f} MB, snapshot tensor in flight "
            f"{snaps / MB:.0f} MB, activations and buffers {(total - state - snaps) / MB:.0f} MB")


def plan_predictions(inputs, plan) -> dict[int, float]:
    """What the tracker sent each stage of the job's ``plan`` message as its prediction
    (:func:`fedpipe.planner.protoio.assignment_memory_bytes`), bytes by stage."""
    from fedpipe.planner.protoio import assignment_memory_bytes

    profile, config = inputs
    return {a.stage: assignment_memory_bytes(plan, a, profile, config) for a in plan.stages}


def needed_limit(inputs, n_layers: int) -> float:
    """The least per-node memory with which some 4-stage split fits the planner's model
    (the largest stage of the split that makes it smallest), bytes."""
    best = float("inf")
    for a in range(1, n_layers - 2):
        for b in range(a + 1, n_layers - 1):
            for c in range(b + 1, n_layers):
                best = min(best, max(predictions(inputs, [0, a, b, c, n_layers])))
    return best


# -- one run over a swarm ----------------------------------------------------------------
def verdict(ok: bool, missed: str) -> str:
    return "MET" if ok else f"MISSED ({missed})"


def deploy(client, adapted, setup: Setup, **kw):
    """Submit; return the job and the seconds until every stage ran (RUNNING)."""
    t0 = time.monotonic()
    job = client.submit(adapted.layers, lm_loss, optimizer(), batches(setup),
                        steps=setup.steps, microbatches=setup.microbatches, schedule="1f1b",
                        stages=4, compression="none", checkpoint_every=setup.checkpoint_every,
                        pending_timeout=300, ties=adapted.tied_parameters, **kw)
    while True:
        status = job.status()
        if status.state in ("RUNNING", "SUCCEEDED") or status.step > 0:
            return job, time.monotonic() - t0
        if status.state in ("FAILED", "CANCELLED"):
            raise RuntimeError(f"the job {status.state}: {status.reason}")
        time.sleep(0.1)


def save(job, path: str) -> str:
    """``job.save(path)``, a stage at a time; what it wrote and the client's peak RSS
    growth while it did (its peak is reset first: /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = proc_status()["VmRSS"]
    t0 = time.monotonic()
    job.save(path)
    growth = proc_status()["VmHWM"] - before
    files = sorted(Path(path).glob("*.safetensors"))
    shards = [f for f in files if f.name.startswith("model")]
    biggest = max(f.stat().st_size for f in files)
    total = sum(f.stat().st_size for f in files)
    return (f"job.save: {len(shards)} model shards + {len(files) - len(shards)} state files, "
            f"{total / MB:.0f} MB in {time.monotonic() - t0:.0f} s; client peak RSS growth "
            f"{growth / MB:.0f} MB (largest file, one stage: {biggest / MB:.0f} MB)")


def swarm_run(setup: Setup, ref: dict, limit: int, title: str, baseline: int,
              save_to: str | None = None, **kw) -> None:
    """Train over a fresh 4-node swarm; print the figures against ``ref`` (and, with
    ``save_to``, save the job there and print what the save cost)."""
    from fedpipe.swarm import LocalSwarm

    adapted = meta_model(setup)
    with LocalSwarm(4, threads=1, node_args=["--memory-limit", str(limit)],
                    timeout=120, snapshot_dirs=True) as swarm:
        before = {f"node{i}": proc_status(p.pid)["VmRSS"] for i, p in enumerate(swarm.nodes)}
        pids = {f"node{i}": p.pid for i, p in enumerate(swarm.nodes)}
        with swarm.client() as client:
            job, deploy_s = deploy(client, adapted, setup, **kw)
            status = job.wait(timeout=3600, progress=False)
            losses = [r.loss for r in job.history()][:3]
            peaks = {name: proc_status(pid)["VmHWM"] - before[name]
                     for name, pid in pids.items()}
            tracker = proc_status(swarm.tracker_proc.pid)["VmHWM"]
            client_growth = proc_status()["VmHWM"] - baseline
            on_disk = [f.stat().st_size for i in range(4)
                       for f in swarm.snapshot_dir(i).glob("*.safetensors")]
            if save_to is not None:
                saved = save(job, save_to)
            job.release()
        plan = sorted(status.plan.stages, key=lambda a: a.stage)
        inputs = planner_inputs(setup, adapted)
        predicted = plan_predictions(inputs, status.plan)
    print(f"\n== {title}: {status.state} after {status.step} steps; deploy {deploy_s:.1f} s; "
          f"load {os.getloadavg()}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    print(f"losses    fedpipe {[f'{v:.6f}' for v in losses]}")
    print(f"          1 proc  {[f'{v:.6f}' for v in ref['losses'][:3]]}  "
          f"max rel diff {worst:.2e}: {verdict(worst <= LOSS_RTOL, f'{worst / LOSS_RTOL:.1f}x')}")
    over = client_growth / MB - CLIENT_MB
    print(f"client RSS growth {client_growth / MB:.0f} MB (<= {CLIENT_MB}): "
          f"{verdict(over <= 0, f'+{over:.0f} MB')}")
    print(f"tracker peak RSS  {tracker / MB:.0f} MB (< {TRACKER_MB}): "
          f"{verdict(tracker < TRACKER_MB * MB, f'+{tracker / MB - TRACKER_MB:.0f} MB')}")
    for a in plan:
        got, want = peaks[a.node_name], predicted[a.stage]
        off = got / want - 1
        print(f"stage {a.stage} (layers {a.layer_start}-{a.layer_end - 1}, {a.node_name}): "
              f"measured {got / MB:.0f} MB, predicted {want / MB:.0f} MB ({off:+.0%}): "
              f"{verdict(abs(off) <= PREDICTION_TOL, f'{abs(off) - PREDICTION_TOL:.0%} past')}; "
              f"limit {limit / MB:.0f} MB: "
              f"{verdict(got < limit, f'+{(got - limit) / MB:.0f} MB')}")
        print(f"  predicted: {breakdown(inputs, a, want)}; snapshots on disk: "
              f"{a.snapshots_on_disk}")
    print(f"snapshot files on the nodes' disks at the end: {len(on_disk)}, "
          f"{sum(on_disk) / MB:.0f} MB")
    print(f"deploy time {deploy_s:.1f} s (submit until every stage runs)")
    if save_to is not None:
        print(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="steps between checkpoints (default: 3, or 2 with --quick); 1 "
                             "with --steps 5 or more lets the nodes' snapshots, their own "
                             "and as buddies, reach their steady state")
    parser.add_argument("--seed-only", action="store_true",
                        help="only the run from the seed, not the one from real weights")
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference:
        print(json.dumps(reference(Setup(**json.loads(args.reference)), args.weights)))
        return
    import transformers  # noqa: F401 — imported before the baseline, as a user's script would

    baseline = proc_status()["VmRSS"]
    setup = (QUICK if args.quick else FULL)
    setup = Setup(**{**asdict(setup), "steps": args.steps,
                     "checkpoint_every": args.checkpoint_every or setup.checkpoint_every})
    print(f"load {os.getloadavg()}; Llama {setup.layers} layers, hidden {setup.hidden}; "
          f"batch {setup.batch} x {setup.seq} tokens in {setup.microbatches} microbatches; "
          f"{setup.steps} steps, a checkpoint every {setup.checkpoint_every}")
    ref = run_reference(setup, None)
    target = int(ref["peak"] / 3) - MB
    adapted = meta_model(setup)
    need = needed_limit(planner_inputs(setup, adapted), len(adapted.layers))
    limit = max(target, int(need * 1.05))
    third = ref["peak"] / 3
    print(f"{ref['params'] / 1e6:.1f} M parameters; single-process peak RSS for one step "
          f"{ref['peak'] / MB:.0f} MB; a third: {ref['peak'] / 3 / MB:.0f} MB")
    print(f"node --memory-limit {limit / MB:.0f} MB, --snapshot-dir (the planner needs "
          f"{need / MB:.0f} MB for a stage with snapshots on disk): below a third of the peak: "
          f"{verdict(limit < third, f'+{(limit - third) / MB:.0f} MB')}")
    swarm_run(setup, ref, limit, "from the seed (meta model, nodes make their layers)",
              baseline, seed=SEED, init_fn=meta_model(setup).init_fn)
    if args.seed_only:
        print(f"\nload {os.getloadavg()}")
        return
    with tempfile.TemporaryDirectory(prefix="bigmodel-") as tmp:
        weights = str(Path(tmp) / "llama")
        real = run_reference(setup, weights)
        shards = sorted(p.name for p in Path(weights).glob("*.safetensors"))
        print(f"\nsave_pretrained wrote {len(shards)} shards to {weights}; its single-process "
              f"run peaked at {real['peak'] / MB:.0f} MB")
        files = meta_model(setup)  # init_fn: the rotary buffers, which no file holds
        swarm_run(setup, real, limit, "from real weights (weights=DIR, each node reads its "
                  "layers)", baseline, save_to=str(Path(tmp) / "saved"), weights=weights,
                  weight_names=files.names, init_fn=files.init_fn)
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
