"""schedule="async": PipeDream-style 1F1B without a flush, with weight stashing.

Real processes: a tracker and 3 nodes on 127.0.0.1 (the session swarm), a
3-stage pipeline.

- ``max_staleness=0`` waits for each update before the next step's forwards,
  so the weights must equal single-process training (as in
  tests/test_equivalence.py: per tensor max|a - b| / max|b| <= 1e-5).
- ``max_staleness`` 1 and 2: the weights must equal an in-process reference of
  weight stashing — microbatch ``i`` runs forward *and* backward on stage
  ``s`` with the weight version that stage had applied when ``i``'s forward
  ran there, which :func:`fedpipe.runtime.schedules.async_stream` fixes.
- On digits, async reaches held-out accuracy within 1 point of 1F1B.
"""
from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe import spec as schedules
from fedpipe.runtime.async_stage import AsyncStageRunner
from fedpipe.runtime.stage import SyncStageRunner
from fedpipe.spec import Kind
from reference import max_relative_difference, single_process

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH, MICROBATCHES = 5, 32, 4
OPTIMIZERS = {
    "sgd": fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw": fedpipe.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
}


def digit_batches(n: int, batch: int = BATCH):
    x, y, _, _ = digits.load()
    gen = digits.batches(x, y, batch)
    return [next(gen) for _ in range(n)]


def weight_stashing(model, loss_fn, spec, batches, cuts, microbatches, k):
    """PipeDream-2BW semantics in one process: microbatch i uses on stage s the
    weight version (updates applied) the async stream gives its forward there."""
    model = copy.deepcopy(model)
    stages = [nn.Sequential(*list(model)[a:b]) for a, b in cuts]
    live = [dict(st.named_parameters()) for st in stages]
    opts = [spec.build(p.values()) if p else None for p in live]
    version = []  # per stage: microbatch -> updates applied when its forward ran
    for s in range(len(stages)):
        seen, v = {}, 0
        for a in schedules.async_stream(s, len(stages), microbatches, len(batches), k):
            if a.kind == "F":
                seen[a.microbatch] = v
            elif a.microbatch % microbatches == microbatches - 1:
                v += 1
        version.append(seen)
    history = [[{n: p.detach().clone() for n, p in ps.items()}] for ps in live]
    for t, (x, y) in enumerate(batches):
        for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, microbatches),
                                         torch.tensor_split(y, microbatches))):
            h, leaves = xm, []
            for s, st in enumerate(stages):
                w = {n: p.clone().requires_grad_(True)
                     for n, p in history[s][version[s][t * microbatches + m]].items()}
                leaves.append(w)
                h = torch.func.functional_call(st, w, (h,))
            (loss_fn(h, ym) * (len(xm) / len(x))).backward()
            for s, w in enumerate(leaves):
                for n, p in w.items():
                    g = live[s][n].grad
                    live[s][n].grad = p.grad if g is None else g + p.grad
        for s, opt in enumerate(opts):
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            history[s].append({n: p.detach().clone() for n, p in live[s].items()})
    return model.state_dict()


def submit(swarm, model, spec, batches, steps, schedule, max_staleness=1,
           microbatches=MICROBATCHES):
    return swarm.client().submit(model, nn.functional.cross_entropy, spec, batches, steps=steps,
                                 microbatches=microbatches, schedule=schedule, stages=3,
                                 compression="none", max_staleness=max_staleness)


def collect(job, steps):
    """The trained weights and the stages' layer ranges ``[(start, end), ...]``."""
    status = job.wait(timeout=240, progress=False)
    assert status.state == "SUCCEEDED" and status.step == steps, status
    assert len({a.node_id for a in status.plan.stages}) == 3, "expected a 3-stage pipeline"
    assert math.isfinite(status.loss)
    got = job.state_dict()
    job.release()
    cuts = [(a.layer_start, a.layer_end) for a in sorted(status.plan.stages, key=lambda a: a.stage)]
    return got, cuts


def run(swarm, model, spec, batches, steps, schedule, max_staleness=1,
        microbatches=MICROBATCHES):
    job = submit(swarm, model, spec, batches, steps, schedule, max_staleness, microbatches)
    return collect(job, steps)


class Wires:
    """In-process transport between stage threads: one dict of tensors."""

    def __init__(self):
        self.items, self.cond = {}, threading.Condition()

    def put(self, stage, kind, step, m, t, batch):
        with self.cond:
            self.items[(stage, kind, step, m)] = (t, batch)
            self.cond.notify_all()

    def for_stage(self, stage):
        wires = self

        class T:
            def recv(self, kind, step, m, timeout=None):
                with wires.cond:
                    assert wires.cond.wait_for(lambda: (stage, kind, step, m) in wires.items, 30)
                    return wires.items.pop((stage, kind, step, m))

            def send(self, kind, step, m, t, batch):
                wires.put(stage + (1 if kind == Kind.ACTIVATION else -1), kind, step, m,
                          t.detach().clone(), batch)

            def send_to(self, peer, kind, step, tag, t, batch_size=1, codec="raw"):
                raise AssertionError("one replica group: no sync messages")
        return T()


class Counting(AsyncStageRunner):
    """Records the most weight versions stashed at once."""

    peak = 0

    def _snapshot(self, version):
        out = super()._snapshot(version)
        self.peak = max(self.peak, len(self.snapshots))
        return out


def test_async_runner_in_process():
    """Three AsyncStageRunner threads, no network: weight stashing at max_staleness 2."""
    k, m, spec, loss_fn = 2, 1, OPTIMIZERS["adamw"], nn.functional.cross_entropy
    model, batches = digits.make_model(hidden=64), digit_batches(STEPS)
    cuts = [(0, 2), (2, 4), (4, 5)]
    wires, copy_ = Wires(), copy.deepcopy(model)
    for t, (x, y) in enumerate(batches):
        wires.put(0, Kind.INPUT, t, 0, x, len(x))
        wires.put(2, Kind.TARGET, t, 0, y, len(x))
    runners, results = [], []
    for s, (a, b) in enumerate(cuts):
        layers = nn.Sequential(*list(copy_)[a:b])
        params = [p for p in layers.parameters()]
        runners.append(Counting(layers, spec.build(params) if params else None,
                                loss_fn if s == 2 else None, s, 3, m,
                                wires.for_stage(s), max_staleness=k))
    threads = [threading.Thread(target=lambda r=r: results.extend(r.run(STEPS)))
               for r in runners]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(results) == 3 * STEPS and not wires.items
    assert all(math.isfinite(r.loss) for r in results if r.loss is not None)
    diff = max_relative_difference(copy_.state_dict(),
                                   weight_stashing(model, loss_fn, spec, batches, cuts, m, k))
    assert diff <= 1e-5, f"max relative difference {diff:.2e}"
    assert [r.peak for r in runners] == [k + 1, 2, 1]  # stage 0 reaches the bound
    # steps overlap: the async runner has no step-at-a-time entry, and the
    # synchronous one refuses "async", naming the runner to use
    assert not hasattr(runners[0], "run_step")
    with pytest.raises(ValueError, match="AsyncStageRunner"):
        SyncStageRunner(nn.Sequential(), None, None, "async", 0, 2, 1, wires.for_stage(0))


@pytest.mark.processes
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_async_without_staleness_equals_single_process(swarm, opt):
    model, batches = digits.make_model(hidden=64), digit_batches(STEPS)
    got, _ = run(swarm, model, OPTIMIZERS[opt], batches, STEPS, "async", max_staleness=0)
    assert max_relative_difference(got, model.state_dict()) > 1e-3  # the weights moved
    diff = max_relative_difference(got, single_process(model, nn.functional.cross_entropy,
                                                       OPTIMIZERS[opt], batches))
    assert diff <= 1e-5, f"async/{opt}, max_staleness=0: max relative difference {diff:.2e}"


@pytest.mark.processes
@pytest.mark.parametrize("k,microbatches", [(1, 4), (2, 1)])
def test_async_stashes_weights(swarm, k, microbatches):
    """With 3 stages, 4 microbatches keep a stage within 1 version (at most 3
    in flight); 1 microbatch lets stage 0 run 2 versions ahead."""
    spec = OPTIMIZERS["sgd"]
    model, batches = digits.make_model(hidden=64), digit_batches(STEPS)
    got, cuts = run(swarm, model, spec, batches, STEPS, "async", k, microbatches)
    loss_fn = nn.functional.cross_entropy
    expected = weight_stashing(model, loss_fn, spec, batches, cuts, microbatches, k)
    diff = max_relative_difference(got, expected)
    assert diff <= 1e-5, f"max_staleness={k}: max relative difference {diff:.2e}"
    # and the staleness made a difference: these are not the synchronous weights
    sync = single_process(model, loss_fn, spec, batches)
    assert max_relative_difference(got, sync) > 1e-4


@pytest.mark.processes
def test_async_digits_accuracy_within_a_point_of_sync(swarm):
    """AdamW lr 3e-3, batch 64, 4 microbatches; the two jobs run side by side.

    450 steps, because in single-process replays of both (the
    ``weight_stashing`` reference, which the swarm matches) over 8 data/model
    seeds, async trailed 1F1B after 300 steps by 0.85 points on average (3 of
    8 seeds by more than 1 point); after 450 and 600 steps the mean gap was
    about 0, though async's accuracy swings more from step to step (one seed
    and layer split: 3.3 points behind at step 450, level at 470). One test
    sample is 0.28 points. This test's seed passes at 450 steps for every
    3-stage split of the 5 layers. max_staleness >= 1 all behave alike here:
    with 3 stages and 4 microbatches at most 3 are in flight, one version apart.
    """
    steps, batch = 450, 64
    x_train, y_train, x_test, y_test = digits.load()
    spec = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3)
    jobs = {schedule: submit(swarm, digits.make_model(), spec,
                             digits.batches(x_train, y_train, batch), steps, schedule,
                             max_staleness=1)
            for schedule in ("1f1b", "async")}
    acc = {}
    for schedule, job in jobs.items():
        model = digits.make_model()
        model.load_state_dict(collect(job, steps)[0])
        acc[schedule] = digits.accuracy(model, x_test, y_test)
    print(f"held-out accuracy after {steps} steps: {acc}")
    assert acc["1f1b"] >= 0.97, acc
    assert acc["async"] >= acc["1f1b"] - 0.01, acc
