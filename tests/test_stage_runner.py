"""Stage runners in process: the update's hooks, and each step's time split."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fedpipe.runtime.async_stage import AsyncStageRunner
from fedpipe.runtime.stage import StageRunnerBase, SyncStageRunner, TimedTransport
from fedpipe.spec import Kind

pytestmark = pytest.mark.timeout(30)
RECV_DELAY, SEND_DELAY = 0.02, 0.01


class SlowTransport:
    """A middle stage's neighbours: every recv waits RECV_DELAY, every send SEND_DELAY."""

    def __init__(self):
        self.recvs = self.sends = 0

    def recv(self, kind, step, tag, timeout=None):
        time.sleep(RECV_DELAY)
        self.recvs += 1
        shape = (2, 3)
        return (torch.randn(shape) if kind == Kind.ACTIVATION else torch.ones(shape)), 4

    def send(self, kind, step, microbatch, tensor, batch_size):
        time.sleep(SEND_DELAY)
        self.sends += 1

    def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
        raise AssertionError("no replica groups here")


def middle(runner_cls, hooks=None, **kw):
    module = nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    transport = SlowTransport()
    args = (module, opt, None) + (("1f1b",) if runner_cls is SyncStageRunner else ()) \
        + (1, 3, 2, transport)
    return runner_cls(*args, **(hooks or {}), **kw), transport


@pytest.mark.parametrize("runner_cls,kw", [(SyncStageRunner, {}),
                                           (AsyncStageRunner, {"max_staleness": 1})])
def test_each_step_is_split_into_compute_waiting_and_sending(runner_cls, kw):
    runner, transport = middle(runner_cls, **kw)
    results = list(runner.run(3))
    assert [r.step for r in results] == [0, 1, 2]
    assert transport.recvs == transport.sends == 3 * 2 * 2  # per microbatch: F and B
    total_wait = sum(r.wait_seconds for r in results)
    total_send = sum(r.send_seconds for r in results)
    assert total_wait >= transport.recvs * RECV_DELAY
    assert total_send >= transport.sends * SEND_DELAY
    for r in results:
        assert r.samples == 4 and r.loss is None
        assert r.compute_seconds > 0 and r.wait_seconds > 0 and r.send_seconds > 0
        assert r.compute_seconds + r.wait_seconds + r.send_seconds == pytest.approx(
            r.seconds, abs=1e-6)
    if runner_cls is SyncStageRunner:  # flushed steps: each waits for its own 4 tensors
        assert all(r.wait_seconds >= 4 * RECV_DELAY for r in results)


def test_update_runs_before_hooks_then_the_optimizer_then_after_hooks():
    calls = []
    holder = {}

    def before(name):
        def hook(step):
            p = holder["runner"].module[0].weight
            calls.append((name, step, p.grad is not None, p.detach().clone()))
        return hook

    def after(name):
        def hook(step):
            calls.append((name, step, holder["runner"].module[0].weight.grad is None,
                          holder["runner"].module[0].weight.detach().clone()))
        return hook

    runner, _ = middle(SyncStageRunner, {"before_update": [before("sync"), before("clip")],
                                         "after_update": [after("lr"), after("outer")]})
    holder["runner"] = runner
    start = runner.module[0].weight.detach().clone()
    runner.run_step(0)
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("sync", 0, True), ("clip", 0, True), ("lr", 0, True), ("outer", 0, True)]
    assert torch.equal(calls[0][3], start) and torch.equal(calls[1][3], start)  # not stepped yet
    assert not torch.equal(calls[2][3], start)  # the optimizer stepped in between
    assert torch.equal(calls[2][3], calls[3][3])


def test_runners_are_siblings_and_share_one_timed_transport():
    assert issubclass(SyncStageRunner, StageRunnerBase)
    assert issubclass(AsyncStageRunner, StageRunnerBase)
    assert not issubclass(AsyncStageRunner, SyncStageRunner)
    timed = TimedTransport(SlowTransport())
    runner = SyncStageRunner(nn.Sequential(nn.Linear(3, 3)), None, None, "gpipe", 1, 3, 1, timed)
    assert runner.transport is timed  # the syncs given ``timed`` count into the same split
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncStageRunner(nn.Sequential(), None, None, 0, 2, 1, timed, max_staleness=-1)
    with pytest.raises(ValueError, match="loss function"):
        SyncStageRunner(nn.Sequential(), None, None, "gpipe", 1, 2, 1, timed)
