"""Plain single-process PyTorch training, the yardstick of the equivalence tests."""
from __future__ import annotations

import copy
import threading

import torch
from torch import nn


def single_process(model, loss_fn, spec, batches) -> dict:
    """A copy of ``model`` trained one optimizer step per batch; its state_dict."""
    model = copy.deepcopy(model)
    opt = spec.build(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def microbatched(model, loss_fn, spec, batches, microbatches: int, seed: int = 0) -> dict:
    """A copy of ``model`` trained as a synchronous pipeline computes, op for op: each
    batch split in ``microbatches`` (``tensor_split``), each microbatch's loss scaled by
    ``n / B`` and its gradients accumulated in order, then one optimizer step. Equal bit
    for bit to a pipeline's weights (the stages run the same ops in the same order), with
    dropout masks drawn as the job of ``seed`` draws them (each layer seeded:
    :class:`fedpipe.runtime.rng.LayerSeeds`)."""
    from fedpipe.runtime.rng import LayerSeeds

    model = copy.deepcopy(model)
    seeds = LayerSeeds(model, 0, seed)
    opt = spec.build(model.parameters())
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        for m, (xm, ym) in enumerate(zip(x.tensor_split(microbatches),
                                         y.tensor_split(microbatches))):
            with seeds.drawing(step, m, xm.device):
                out = model(xm)
            (loss_fn(out, ym).reshape(()) * (xm.shape[0] / x.shape[0])).backward()
        opt.step()
    return model.state_dict()


def max_relative_difference(a: dict, b: dict) -> float:
    """Per tensor max|a - b| / max|b|, the worst over the state dicts (same keys)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() or 1.0) for k in b)


def digit_batches(n: int, batch: int = 32) -> list:
    """The first ``n`` batches of scikit-learn's digits (training split), ``batch`` rows
    each: ``x`` (batch, 64) float32, ``y`` (batch,) int64."""
    from fedpipe.examples import digits
    x, y, _, _ = digits.load()
    gen = digits.batches(x, y, batch)
    return [next(gen) for _ in range(n)]


def job_info(client, job):
    """The tracker's JobInfo of ``job`` now."""
    from fedpipe.proto import tracker_pb2
    return client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)


def wait_rebuilt(client, job, timeout: float = 120.0) -> None:
    """Wait until the tracker has rebuilt a dropped replica group of ``job`` on spare nodes
    (``JobInfo.replica_ready``; the client's feed then has it join at its next step), or
    the job has ended, or ``timeout`` seconds passed. A heal test holds its feed on this,
    so the job cannot run out of steps before the group is back, however fast it trains."""
    import time

    from fedpipe.spec import TERMINAL

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(client, job)
        if info.replica_ready or info.state in TERMINAL:
            return
        time.sleep(0.05)


def running_plan(client, job, timeout: float = 120.0):
    """The job's plan (a :class:`~fedpipe.spec.PlanView`) once it runs; fails if it ends or
    does not run within ``timeout`` seconds."""
    import time

    from fedpipe.proto import tracker_pb2
    from fedpipe.spec import PlanView
    starting = (tracker_pb2.JOB_STATE_PENDING, tracker_pb2.JOB_STATE_PLANNING,
                tracker_pb2.JOB_STATE_DEPLOYING)
    deadline = time.monotonic() + timeout
    while (now := job_info(client, job)).state != tracker_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline and now.state in starting, now.reason
        time.sleep(0.1)
    return PlanView(now.plan)


def diloco_single_process(model, loss_fn, spec, batches, config, *, groups: int = 2,
                          microbatches: int = 1, fed=None, members=None, joins=None,
                          lr_scheduler=None) -> list[dict]:
    """DiLoCo over ``groups`` replica groups of equal share, in one process, as an elastic
    job runs it (:class:`fedpipe.runtime.elastic.ElasticOuterSync`); each group's final
    state_dict.

    Args:
        fed: ``fed(step)``: the groups the client fed at ``step`` (it shards the batch over
            them in equal parts, group order); default: all.
        members: ``members(k)``: the groups outer step ``k`` averages over; default: all.
        joins: ``{group: step}``: before ``step`` the group takes group 0's whole state
            (weights, inner optimizer and schedule, outer weights and momentum).
        lr_scheduler: a :func:`fedpipe.lr_scheduler` of the inner optimizer, or None.

    Each group's microbatch losses are scaled by ``n_m / B`` and its summed gradient by
    ``B / n`` (the mean loss over its shard), as the runner and ``rescale_gradients`` do;
    the outer gradient is the members' equally weighted mean pseudo-gradient, applied by
    SGD with Nesterov momentum; an outer step follows every H-th inner step and the last.
    """
    import torch
    from fedpipe.client.job import _shard

    every = range(groups)
    fed = fed or (lambda step: list(every))
    members = members or (lambda k: list(every))
    joins = joins or {}
    models = [copy.deepcopy(model) for _ in every]
    opts = [spec.build(m.parameters()) for m in models]
    scheds = [lr_scheduler.build(o) if lr_scheduler else None for o in opts]
    outer_weights = [p.detach().clone() for p in model.parameters()]
    momentum = config.outer_momentum
    outer = torch.optim.SGD(outer_weights, lr=config.outer_lr, momentum=momentum,
                            nesterov=momentum > 0)
    k = 0
    for step, (x, y) in enumerate(batches):
        for g, at in joins.items():
            if at == step:
                _take_group_0(g, models, opts, scheds)
        now = fed(step)
        for g, (xs, ys) in zip(now, _shard(x, y, [1] * len(now))):
            opts[g].zero_grad()
            for xm, ym in zip(xs.tensor_split(microbatches), ys.tensor_split(microbatches)):
                (loss_fn(models[g](xm), ym) * (xm.shape[0] / x.shape[0])).backward()
            for p in models[g].parameters():
                p.grad.mul_(x.shape[0] / xs.shape[0])
            opts[g].step()
            if scheds[g] is not None:
                scheds[g].step()
        if (step + 1) % config.inner_steps and step != len(batches) - 1:
            continue
        _outer_step(models, sorted(members(k)), groups, outer_weights, outer)
        k += 1
    return [m.state_dict() for m in models]


def _take_group_0(g, models, opts, scheds) -> None:
    """Group ``g`` joins: it takes group 0's weights, inner optimizer and schedule."""
    models[g].load_state_dict(models[0].state_dict())
    opts[g].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    if scheds[g] is not None:
        scheds[g].load_state_dict(scheds[0].state_dict())


def _outer_step(models, who, groups, outer_weights, outer) -> None:
    """One outer step over member groups ``who``: their equally weighted mean
    pseudo-gradient into ``outer`` (SGD on ``outer_weights``), then the new weights to
    each member."""
    import torch

    with torch.no_grad():
        for i, glob in enumerate(outer_weights):
            total = torch.zeros_like(glob)
            for g in who:
                total.add_(glob - list(models[g].parameters())[i], alpha=1 / groups)
            glob.grad = total.div_(len(who) / groups)
    outer.step()
    outer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for g in who:
            for p, glob in zip(models[g].parameters(), outer_weights):
                p.copy_(glob)


def not_bit_equal(got: dict, want: dict) -> list[str]:
    """The names of ``want``'s tensors that ``got`` lacks or holds with another value (and
    those ``got`` has beyond them): ``[]`` when the two state dicts are bit-equal."""
    extra = sorted(set(got) - set(want))
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])] + extra


def toy_stage(optimizer: str = "sgd"):
    """A small stage with a buffer (BatchNorm) and its optimizer, seeded: ``sgd`` (momentum
    0.9) alone, or ``adamw`` with a StepLR scheduler, returned as a third item."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_toy(model, opt, steps: int, seed: int, sched=None) -> None:
    """``steps`` steps of :func:`toy_stage`'s model on seeded random (8, 5) -> (8, 3) batches."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def gated(batches: list, until: int, gate: threading.Event, wait: float = 120.0):
    """``batches`` one by one, those from step ``until`` on only once ``gate`` is set: a job
    fed so cannot complete step ``until`` before the fault that sets the gate fires (a
    kill at the tracker's step 7 of a 12-step job once landed after the job had ended)."""
    yield from batches[:until]
    gate.wait(wait)
    yield from batches[until:]
