"""Schedules: every microbatch runs forward then backward once; 1F1B bounds what is stashed."""
import pytest

import torch
from torch import nn

from fedpipe import spec as schedules
from fedpipe.planner.simulate import simulate_group
from fedpipe.runtime.stage import SyncStageRunner
from fedpipe.spec import Kind

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("name", sorted(schedules.SCHEDULES))
@pytest.mark.parametrize("n_stages,m", [(1, 1), (1, 4), (3, 1), (3, 4), (4, 8), (5, 3)])
def test_each_microbatch_forward_then_backward(name, n_stages, m):
    for stage in range(n_stages):
        acts = schedules.schedule_order(name, stage, n_stages, m)
        fwd = [a.microbatch for a in acts if a.kind == "F"]
        bwd = [a.microbatch for a in acts if a.kind == "B"]
        assert fwd == list(range(m)) and bwd == list(range(m))
        for mb in range(m):
            assert acts.index(schedules.Action("F", mb)) < acts.index(schedules.Action("B", mb))


def peak_stashed(acts):
    live = peak = 0
    for a in acts:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n_stages,m", [(4, 8), (3, 2), (6, 16)])
def test_1f1b_stashes_at_most_remaining_stages(n_stages, m):
    for stage in range(n_stages):
        assert peak_stashed(schedules.one_f_one_b(stage, n_stages, m)) == min(m, n_stages - stage)
        assert peak_stashed(schedules.gpipe(stage, n_stages, m)) == m


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="gpipe"):
        schedules.schedule_order("zigzag", 0, 1, 1)


class RecordingTransport:
    """Hands a stage whatever it asks for at once, and records its passes."""

    def __init__(self):
        self.passes = []

    def recv(self, kind, step, microbatch, timeout=None):
        if kind == Kind.GRADIENT:
            self.passes.append(schedules.Action("B", microbatch))
        else:
            self.passes.append(schedules.Action("F", microbatch))
        return torch.ones(2, 3), 2 * 8

    def send(self, kind, step, microbatch, tensor, batch_size):
        pass

    def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
        raise AssertionError("a pipeline stage alone sends to its neighbours only")


@pytest.mark.parametrize("name", schedules.SYNC_SCHEDULES)
@pytest.mark.parametrize("n_stages,m", [(1, 1), (2, 3), (3, 4), (4, 8)])
def test_runtime_and_simulator_run_the_same_order(name, n_stages, m):
    """The order a SyncStageRunner runs its passes in is the order the planner's simulator
    times them in, for every stage, microbatch count and synchronous schedule."""
    sim = simulate_group([1.0] * n_stages, [2.0] * n_stages, [0.1] * (n_stages - 1),
                         [0.05] * (n_stages - 1), [0.1] * (n_stages - 1),
                         [0.05] * (n_stages - 1), m, name)
    for stage in range(n_stages - 1):  # the last stage's recvs include targets; covered below
        transport = RecordingTransport()
        runner = SyncStageRunner(nn.Linear(3, 3), None, None, name, stage, n_stages, m,
                                 transport)
        runner.run_step(0)
        assert transport.passes == sim.order[stage], (stage, transport.passes)
    assert sim.order[-1] == schedules.schedule_order(name, n_stages - 1, n_stages, m)


@pytest.mark.parametrize("n_stages,m", [(1, 1), (3, 1), (3, 4), (4, 8)])
def test_async_without_staleness_is_1f1b_step_after_step(n_stages, m):
    steps = 3
    for stage in range(n_stages):
        got = list(schedules.async_stream(stage, n_stages, m, steps, max_staleness=0))
        want = [schedules.Action(a.kind, s * m + a.microbatch) for s in range(steps)
                for a in schedules.one_f_one_b(stage, n_stages, m)]
        assert got == want



def simulate_async(n_stages, m, steps, k):
    """Run every stage's async stream against the others' (an activation needs
    the previous stage's forward, a gradient the next stage's backward).

    Returns per stage: (step, updates applied) of each forward, the peak of
    microbatches in flight, and the peak of weight versions they use.
    """
    streams = [list(schedules.async_stream(s, n_stages, m, steps, k)) for s in range(n_stages)]
    pos, done = [0] * n_stages, [set() for _ in range(n_stages)]
    forwards = [[] for _ in range(n_stages)]
    peak, versions = [0] * n_stages, [0] * n_stages
    inflight = [{} for _ in range(n_stages)]  # microbatch -> weight version
    backwards = [0] * n_stages
    while any(p < len(st) for p, st in zip(pos, streams)):
        moved = False
        for s, st in enumerate(streams):
            while pos[s] < len(st):
                a = st[pos[s]]
                if a.kind == "F" and s > 0:
                    need = (s - 1, ("F", a.microbatch))
                elif a.kind == "B" and s < n_stages - 1:
                    need = (s + 1, ("B", a.microbatch))
                else:
                    need = None
                if need and need[1] not in done[need[0]]:
                    break
                if a.kind == "F":
                    applied = backwards[s] // m
                    forwards[s].append((a.microbatch // m, applied))
                    inflight[s][a.microbatch] = applied
                else:
                    del inflight[s][a.microbatch]
                    backwards[s] += 1
                done[s].add((a.kind, a.microbatch))
                pos[s] += 1
                moved = True
                peak[s] = max(peak[s], len(inflight[s]))
                versions[s] = max(versions[s], len(set(inflight[s].values())))
        assert moved, f"deadlock at {pos}"
    return forwards, peak, versions


@pytest.mark.parametrize("n_stages,m,k", [(3, 4, 1), (3, 4, 2), (4, 2, 1), (4, 1, 3),
                                          (5, 3, 0), (2, 8, 1), (6, 2, 5), (1, 3, 2)])
def test_async_stream_completes_within_its_bounds(n_stages, m, k):
    steps = 6
    forwards, peak, versions = simulate_async(n_stages, m, steps, k)
    for s in range(n_stages):
        acts = list(schedules.async_stream(s, n_stages, m, steps, k))
        assert [a.microbatch for a in acts if a.kind == "F"] == list(range(steps * m))
        assert [a.microbatch for a in acts if a.kind == "B"] == list(range(steps * m))
        assert peak[s] <= n_stages - s
        # a forward of step t runs after the updates of all steps <= t - 1 - k
        assert all(t - applied <= k for t, applied in forwards[s])
        assert versions[s] <= k + 1
    if k > 0 and n_stages > 1:  # steps overlap: a forward runs before its previous step's update
        assert any(t > applied for t, applied in forwards[0])


def test_async_stream_rejects_negative_staleness():
    with pytest.raises(ValueError, match="max_staleness"):
        list(schedules.async_stream(0, 3, 4, 2, -1))
