"""Learning-rate schedules and global-norm gradient clipping keep pipelines equal to one process.

The yardstick is plain PyTorch on the whole model: ``loss.backward()``,
``torch.nn.utils.clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``
per batch. In-process, StageRunner threads of one pipeline (2 and 3 stages, one
of them without parameters; and two replica groups under all-reduce, split
differently) talk through a dict of tensors; end to end, a real swarm runs the
job over gRPC. Every comparison also checks that clipping did trigger (the
unclipped norm exceeded ``max_norm`` at some step) and that the schedule
changed the result, so neither knob can silently be a no-op.
"""
from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client import Client
from fedpipe.examples import digits
from fedpipe.runtime.allreduce import GradientSync, StageSpan
from fedpipe.runtime.async_stage import AsyncStageRunner
from fedpipe.runtime.clip import GlobalNormClip, scale_gradients, squared_norm
from fedpipe.runtime.stage import SyncStageRunner
from fedpipe.spec import JobSpecError, Kind, StageKey
from reference import max_relative_difference

pytestmark = pytest.mark.timeout(120)
STEPS, BATCH, MICROBATCHES = 6, 32, 4
MAX_NORM = 0.3
LOSS = nn.functional.cross_entropy
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
STEP_LR = fedpipe.lr_scheduler(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
ONE_CYCLE = fedpipe.lr_scheduler(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.2,
                                 total_steps=STEPS)


def digit_batches(n: int = STEPS, batch: int = BATCH, dtype=torch.float32):
    x, y, _, _ = digits.load()
    gen = digits.batches(x.to(dtype), y, batch)
    return [next(gen) for _ in range(n)]


def reference(model, opt_spec, sched_spec, max_norm, batches):
    """One process: the trained state_dict and each step's unclipped global norm."""
    model = copy.deepcopy(model)
    opt = opt_spec.build(model.parameters())
    sched = sched_spec.build(opt) if sched_spec else None
    norms = []
    for x, y in batches:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        if max_norm:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        if sched:
            sched.step()
    return model.state_dict(), norms


class Wires:
    """In-process transport between stage threads: tensors keyed by
    ``(replica, stage, kind, step, tag)``."""

    def __init__(self):
        self.items, self.cond = {}, threading.Condition()

    def put(self, key, tensor, batch):
        with self.cond:
            assert key not in self.items, f"sent twice: {key}"
            self.items[key] = (tensor.detach().clone(), batch)
            self.cond.notify_all()

    def take(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.items, 30):
                raise TimeoutError(f"nothing arrived for {key}")
            return self.items.pop(key)

    def transport(self, replica, stage):
        return StageWires(self, replica, stage)


class StageWires:
    """One stage's view of :class:`Wires`: the runner's Transport and the clip's PeerTransport."""

    def __init__(self, wires, replica, stage):
        self.wires, self.replica, self.stage = wires, replica, stage

    def recv(self, kind, step, m, timeout=None):
        return self.wires.take((self.replica, self.stage, kind, step, m))

    def send(self, kind, step, m, t, batch):
        to = self.stage + (1 if kind == Kind.ACTIVATION else -1)
        self.wires.put((self.replica, to, kind, step, m), t, batch)

    def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
        self.wires.put((*peer, kind, step, tag), tensor, batch_size)


class Recording(GlobalNormClip):
    """Keeps every step's unclipped global norm."""

    def __init__(self, *args):
        super().__init__(*args)
        self.norms = []

    def __call__(self, step):
        super().__call__(step)
        self.norms.append(self.last_norm)


def run_threads(runners, steps):
    """Run every runner's ``run(steps)`` in a thread; re-raise the first failure."""
    errors, done = [], []

    def work(r):
        try:
            done.extend(r.run(steps))
        except BaseException as e:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in runners]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    if errors:
        raise errors[0]
    assert not any(th.is_alive() for th in threads), "a stage hung"
    assert len(done) == len(runners) * steps


def pipeline(model, opt_spec, sched_spec, max_norm, batches, groups, schedule="gpipe",
             microbatches=MICROBATCHES, max_staleness=None):
    """Train ``model`` in place as StageRunner threads.

    ``groups``: per replica group, its stages' layer ranges ``[(start, end), ...]``;
    each group gets a contiguous share of every batch and, with several
    groups, their gradients are summed by :class:`GradientSync`.
    Returns each group's per-stage :class:`Recording` clips (None: no clipping).
    """
    wires = Wires()
    spans = [StageSpan(StageKey(g, s), a, b) for g, cuts in enumerate(groups)
             for s, (a, b) in enumerate(cuts)]
    for t, (x, y) in enumerate(batches):
        shards = zip(torch.tensor_split(x, len(groups)), torch.tensor_split(y, len(groups)))
        for g, (xs, ys) in enumerate(shards):
            last = len(groups[g]) - 1
            for m, (xm, ym) in enumerate(zip(torch.tensor_split(xs, microbatches),
                                             torch.tensor_split(ys, microbatches))):
                wires.put((g, 0, Kind.INPUT, t, m), xm, len(x))  # loss scaled by the global batch
                wires.put((g, last, Kind.TARGET, t, m), ym, len(x))
    copies = [model] + [copy.deepcopy(model) for _ in groups[1:]]
    runners, clips = [], []
    for g, cuts in enumerate(groups):
        clips.append([])
        for s, (a, b) in enumerate(cuts):
            layers = nn.Sequential(*list(copies[g])[a:b])
            params = [p for p in layers.parameters() if p.requires_grad]
            opt = opt_spec.build(params) if params else None
            transport = wires.transport(g, s)
            clip = None
            if max_norm:
                peers = {o: StageKey(g, o) for o in range(len(cuts)) if o != s}
                clip = Recording(params, max_norm, s, peers, transport)
            clips[g].append(clip)
            before, after = [], []
            if len(groups) > 1:
                before.append(GradientSync(layers, StageKey(g, s), spans, transport))
            if clip is not None:
                before.append(clip)
            if sched_spec and opt:
                sched = sched_spec.build(opt)
                after.append(lambda step, sched=sched: sched.step())
            loss = LOSS if s == len(cuts) - 1 else None
            if max_staleness is not None:
                runners.append(AsyncStageRunner(layers, opt, loss, s, len(cuts), microbatches,
                                                transport, max_staleness=max_staleness,
                                                before_update=before, after_update=after))
            else:
                runners.append(SyncStageRunner(layers, opt, loss, schedule, s, len(cuts),
                                               microbatches, transport, before_update=before,
                                               after_update=after))
    run_threads(runners, len(batches))
    assert not wires.items, f"left over: {sorted(wires.items)[:5]}"
    return copies, clips


def assert_clipping_triggered(norms, max_norm=MAX_NORM):
    assert max(norms) > max_norm, f"clipping never triggered: norms {norms}"


# name: (layer ranges per stage, optimizer, schedule, runner schedule, dtype). AdamW
# runs in float64: in float32 its normalised update turns the rounding noise of
# summing 4 microbatches' gradients instead of one batch's (there without any knob)
# into relative differences of ~1e-5, which would hide what clipping does.
CASES = {
    "2 stages, SGD, StepLR, gpipe": ([(0, 3), (3, 5)], SGD, STEP_LR, "gpipe", torch.float32),
    "3 stages (one without parameters), AdamW, OneCycleLR, 1f1b":
        ([(0, 1), (1, 2), (2, 5)], ADAMW, ONE_CYCLE, "1f1b", torch.float64),
    "3 stages, SGD, OneCycleLR, gpipe":
        ([(0, 2), (2, 3), (3, 5)], SGD, ONE_CYCLE, "gpipe", torch.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_with_clipping_and_schedule_equals_single_process(case):
    cuts, opt, sched, schedule, dtype = CASES[case]
    model, batches = digits.make_model(hidden=64).to(dtype), digit_batches(dtype=dtype)
    expected, norms = reference(model, opt, sched, MAX_NORM, batches)
    assert_clipping_triggered(norms)
    trained = copy.deepcopy(model)
    _, clips = pipeline(trained, opt, sched, MAX_NORM, batches, [cuts], schedule)
    got = trained.state_dict()
    for clip in clips[0]:  # every stage saw the global norm, not its own part's
        assert clip.norms == pytest.approx(norms, rel=1e-6)
    diff = max_relative_difference(got, expected)
    assert diff <= 1e-6, f"{case}: max relative difference {diff:.2e}"
    # both knobs mattered: without either, the weights differ
    for knobs in ((opt, None, MAX_NORM), (opt, sched, 0)):
        other, _ = reference(model, *knobs, batches)
        assert max_relative_difference(got, other) > 1e-3, f"{knobs} made no difference"


def test_async_without_staleness_clips_and_schedules_like_single_process():
    model, batches = digits.make_model(hidden=64), digit_batches()
    expected, norms = reference(model, SGD, ONE_CYCLE, MAX_NORM, batches)
    assert_clipping_triggered(norms)
    trained = copy.deepcopy(model)
    _, clips = pipeline(trained, SGD, ONE_CYCLE, MAX_NORM, batches, [[(0, 2), (2, 3), (3, 5)]],
                        "async", max_staleness=0)
    assert clips[0][0].norms == pytest.approx(norms, rel=1e-6)
    diff = max_relative_difference(trained.state_dict(), expected)
    assert diff <= 1e-6, f"max relative difference {diff:.2e}"


def test_async_with_staleness_clips_every_step_without_deadlock():
    """Stages run ahead of each other; each step's norm exchange still pairs up."""
    model, batches = digits.make_model(hidden=64), digit_batches()
    _, clips = pipeline(model, SGD, STEP_LR, MAX_NORM, batches, [[(0, 2), (2, 3), (3, 5)]],
                        "async", microbatches=1, max_staleness=2)
    per_stage = [c.norms for c in clips[0]]
    assert all(len(n) == STEPS for n in per_stage)
    assert per_stage[0] == per_stage[1] == per_stage[2]  # the same bits on every stage
    assert_clipping_triggered(per_stage[0])


def test_allreduce_clips_the_full_batch_gradient_on_every_group():
    """Two replica groups split differently; clipping after the sum equals one process
    clipping the full batch's gradient, and both groups end bit-identical."""
    model, batches = digits.make_model(hidden=64), digit_batches()
    expected, norms = reference(model, SGD, STEP_LR, MAX_NORM, batches)
    assert_clipping_triggered(norms)
    trained = copy.deepcopy(model)
    copies, clips = pipeline(trained, SGD, STEP_LR, MAX_NORM, batches,
                             [[(0, 2), (2, 5)], [(0, 3), (3, 4), (4, 5)]], microbatches=2)
    for group in clips:
        for clip in group:
            assert clip.norms == pytest.approx(norms, rel=1e-6)
    for c in copies[1:]:
        assert max_relative_difference(c.state_dict(), copies[0].state_dict()) == 0.0
    diff = max_relative_difference(trained.state_dict(), expected)
    assert diff <= 1e-6, f"max relative difference {diff:.2e}"


@pytest.mark.parametrize("fill", [None, math.inf, math.nan])
def test_one_stage_clip_matches_torch_clip_grad_norm(fill):
    """Also for non-finite gradients, where torch neither raises nor skips."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4)),
              nn.Parameter(torch.randn(2))]
    grads = [torch.randn(5, 3) * 3, torch.randn(4), None]
    if fill is not None:
        grads[1][2] = fill
    mine = [copy.deepcopy(p) for p in params]
    for p, q, g in zip(params, mine, grads):
        p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
    total = nn.utils.clip_grad_norm_(params, 1.5)
    clip = GlobalNormClip(mine, 1.5, 0, {}, transport=None)
    clip(0)
    assert clip.last_norm == pytest.approx(float(total), rel=1e-6, nan_ok=True)
    assert mine[2].grad is None
    for p, q in zip(params[:2], mine[:2]):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0, equal_nan=True)
    if fill is None:
        assert clip.last_scale < 1  # it clipped


def test_norm_helpers_follow_torch():
    ps = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3))]
    assert squared_norm(ps) == 0.0  # no gradients yet
    for p in ps:
        p.grad = torch.full_like(p, 2.0)
    assert squared_norm(ps) == pytest.approx(28.0)
    assert scale_gradients(ps, 100.0, math.sqrt(28.0)) == 1.0  # below max_norm: untouched
    assert torch.equal(ps[0].grad, torch.full((4,), 2.0))
    assert scale_gradients(ps, 1.0, 4.0) == pytest.approx(1 / (4 + 1e-6))


def test_bad_clip_settings_are_refused():
    with pytest.raises(ValueError, match="max_norm"):
        GlobalNormClip([], 0.0, 0, {}, None)
    with pytest.raises(ValueError, match="max_norm"):
        GlobalNormClip([], math.inf, 0, {}, None)
    with pytest.raises(ValueError, match="other stages"):
        GlobalNormClip([], 1.0, 1, {0: "a", 1: "b"}, None)


def test_bad_lr_schedulers_are_refused():
    with pytest.raises(TypeError, match="LRScheduler subclass"):
        fedpipe.lr_scheduler(torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        fedpipe.lr_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau)
    with pytest.raises(ValueError, match="StepLR.*step_sizes"):
        fedpipe.lr_scheduler(torch.optim.lr_scheduler.StepLR, step_sizes=3).check(SGD)
    # OneCycleLR cycles momentum or beta1: Adagrad has neither
    with pytest.raises(ValueError, match="OneCycleLR.*Adagrad"):
        ONE_CYCLE.check(fedpipe.optimizer(torch.optim.Adagrad, lr=0.1))


def test_submit_refuses_bad_knobs_before_calling_the_tracker():
    client = Client("127.0.0.1:9")  # nothing listens: the checks must come first
    model, batches = digits.make_model(hidden=8), digit_batches(1)
    try:
        with pytest.raises(TypeError, match="fedpipe.lr_scheduler"):
            client.submit(model, LOSS, SGD, batches, steps=1,
                          lr_scheduler=torch.optim.lr_scheduler.StepLR)
        with pytest.raises(ValueError, match="OneCycleLR"):
            client.submit(model, LOSS, fedpipe.optimizer(torch.optim.Adagrad, lr=0.1),
                          batches, steps=1, lr_scheduler=ONE_CYCLE)
        with pytest.raises(JobSpecError, match="clip_grad_norm"):
            client.submit(model, LOSS, SGD, batches, steps=1, clip_grad_norm=-1.0)
    finally:
        client.channel.close()


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_swarm_with_clipping_and_schedule_equals_single_process(swarm):
    """Two nodes over gRPC, 1F1B, raw tensors: within 1e-5 of one process."""
    model, batches = digits.make_model(hidden=64), digit_batches()
    expected, norms = reference(model, SGD, ONE_CYCLE, MAX_NORM, batches)
    assert_clipping_triggered(norms)
    job = swarm.client().submit(model, LOSS, SGD, batches, steps=STEPS,
                                microbatches=MICROBATCHES, schedule="1f1b", stages=2, replicas=1,
                                compression="none", lr_scheduler=ONE_CYCLE,
                                clip_grad_norm=MAX_NORM)
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS, status
    assert len({a.node_id for a in status.plan.stages}) == 2, "expected a 2-stage pipeline"
    got = job.state_dict()
    job.release()
    diff = max_relative_difference(got, expected)
    assert diff <= 1e-5, f"max relative difference {diff:.2e}"
    unclipped, _ = reference(model, SGD, ONE_CYCLE, 0, batches)
    assert max_relative_difference(got, unclipped) > 1e-3  # clipping shaped the result
