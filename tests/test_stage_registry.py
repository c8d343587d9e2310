"""The stage registry and a stage's thread, in process with fakes: lookup, load, restore,
run to the end, fail, stop, release, reconciliation and hand-over cuts, each checked on
the stage's recorded moves (its transition table) and the reports the tracker gets.

No process starts and no gRPC server runs: the stage's layers are a fake runner, its
peers and its restorer fakes; the registry, the stage loop, checkpoints, snapshot
store and mailbox are the real ones.
"""
from __future__ import annotations

import threading
from typing import Iterator

import pytest
from torch import nn

import torch

from fedpipe.node.errors import (MemoryTooSmall, NoSuchStage, StageExists, StageLoadError,
                                 Stopped)
from fedpipe.node.lifecycle import Stage, StageSlot, StageState
from fedpipe.node.mailbox import Mailbox
from fedpipe.node.memory import StageMemory, held_bytes
from fedpipe.node.peers import ChannelPool
from fedpipe.node.reports import StageReporter
from fedpipe.node.running import StageLoop
from fedpipe.node.snapshots import Checkpoints, SnapshotStore
from fedpipe.node.stages import StageRegistry
from fedpipe.planner.memfit import MEMORY_REMEDIES
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.runtime.stage import StepResult
from fedpipe.spec import PlanView, StageKey

pytestmark = pytest.mark.timeout(30)
S, R = StageState, tracker_pb2.StageReport
WAIT = 10.0


class Runner:
    """A stage's runner: one result per step, each step waiting for ``gate`` (if given);
    raises ``fail_at``'s step."""

    microbatches = 2

    def __init__(self, gate: threading.Semaphore | None = None, fail_at: int = -1):
        self.gate, self.fail_at = gate, fail_at
        self.stage: Stage | None = None

    def run(self, steps: int, start: int = 0) -> Iterator[StepResult]:
        for step in range(start, steps):
            while self.gate is not None and not self.gate.acquire(timeout=0.01):
                if self.stage is not None and not self.stage.live:  # as a transport's recv
                    raise Stopped("stopped while waiting")
            if step == self.fail_at:
                raise RuntimeError(f"layer blew up at step {step}")
            yield StepResult(step, 0.5, 4, 0.01)


class Peers:
    def __init__(self):
        self.closed = False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Restorer:
    def __init__(self, fail: int = 0):
        self.fail, self.calls = fail, 0

    def learn(self, request) -> None:
        """Where the sources are on the socket plane: nothing to fetch here."""

    def restore(self, stage, sources, pieces=()) -> None:
        self.calls += 1
        if self.calls <= self.fail:
            raise StageLoadError(f"no snapshot yet (try {self.calls})")


class Node:
    """A registry over fakes; ``runner`` makes each loaded stage's runner."""

    def __init__(self, runner=Runner, restorer: Restorer | None = None,
                 memory: StageMemory | None = None):
        self.reports: list[tracker_pb2.StageReport] = []
        self.cond = threading.Condition()
        self.peers: list[Peers] = []
        self.runner = runner
        self.restorer = restorer or Restorer()
        reporter = StageReporter(lambda: "n0", self._report, memory=memory)
        self.snapshots = SnapshotStore()
        mailbox = Mailbox(4, ())
        loop = StageLoop(reporter, Checkpoints(self.snapshots, ChannelPool(), reporter), mailbox,
                         self.restorer)  # type: ignore[arg-type]
        self.over: list[str] = []  # jobs the registry said are over here
        self.registry = StageRegistry(self._build, self._peers,
                                      self.restorer, loop, mailbox,  # type: ignore[arg-type]
                                      self.snapshots, reporter, memory,
                                      job_over=self.over.append)

    def _report(self, report):
        with self.cond:
            self.reports.append(report)
            self.cond.notify_all()

    def _peers(self):
        self.peers.append(Peers())
        return self.peers[-1]

    def _build(self, request: node_pb2.LoadStageRequest, peers) -> Stage:
        if not request.layers:
            raise StageLoadError("cannot load stage: no layers")
        module, runner = nn.Sequential(nn.Linear(2, 2)), self.runner()
        runner.stage = Stage(StageSlot(request.job_id, request.replica, request.stage), 2, 0,
                             module, request.config.steps, peers, runner=runner,
                             epoch=request.plan.epoch, start=request.resume_step,
                             checkpoint_every=request.config.checkpoint_every,
                             parts={"module": module})
        return runner.stage

    def load(self, job="j", stage=0, epoch=0, steps=4, **kw) -> Stage:
        return self.registry.load(node_pb2.LoadStageRequest(
            job_id=job, stage=stage, layers=[b"x"], plan=node_pb2.Plan(epoch=epoch),
            config=node_pb2.JobConfig(steps=steps, checkpoint_every=kw.pop("every", 0)), **kw))

    def wait_for(self, status, n: int = 1) -> list[tracker_pb2.StageReport]:
        with self.cond:
            assert self.cond.wait_for(
                lambda: sum(r.status == status for r in self.reports) >= n, WAIT), self.reports
            return [r for r in self.reports if r.status == status]


def moves(stage: Stage) -> list[StageState]:
    return [t.after for t in stage.history]


def wait_state(stage: Stage, state: StageState) -> None:
    for _ in range(int(WAIT / 0.01)):
        if stage.state is state:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"stage is {stage.state}, not {state}: {stage.history}")


def test_a_loaded_stage_runs_every_step_reports_each_and_ends_done():
    node = Node()
    stage = node.load(steps=3)
    node.wait_for(R.STATUS_DONE)
    stage.thread.join(WAIT)
    assert moves(stage) == [S.RUNNING, S.DONE]
    assert [r.step for r in node.reports] == [1, 2, 3, 3]
    assert node.snapshots.steps("j", StageKey(0, 0)) == [3]  # the final state, for Job.save()
    assert node.peers[0].closed
    assert node.registry.get(StageSlot("j", 0, 0)) is stage  # kept for its weights
    assert node.registry.holds("j") and not node.registry.runs("j")


def test_lookup_of_a_stage_not_held_is_no_such_stage():
    node = Node()
    with pytest.raises(NoSuchStage, match="no stage 1 of job 'x'"):
        node.registry.get(StageSlot("x", 0, 1))
    assert not node.registry.runs("x") and not node.registry.holds("x")
    assert node.registry.holdings() == []


def test_a_live_stage_is_not_loaded_twice_and_a_newer_epoch_replaces_an_ended_one():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))
    first = node.load(epoch=1)
    with pytest.raises(StageExists):
        node.load(epoch=1)
    with pytest.raises(StageExists):
        node.load(epoch=0)
    node.registry.stop_job("j", release=False)
    wait_state(first, S.STOPPED)
    second = node.load(epoch=2)
    assert moves(first)[-2:] == [S.STOPPED, S.RELEASED]
    assert node.registry.get(StageSlot("j", 0, 0)) is second and second.live
    node.registry.stop_all()


def test_a_resumed_stage_is_restored_before_it_runs_and_a_failed_restore_loads_nothing():
    node = Node()
    stage = node.load(steps=4, resume_step=2)
    node.wait_for(R.STATUS_DONE)
    assert moves(stage) == [S.RESTORING, S.RUNNING, S.DONE]
    assert [r.step for r in node.reports if r.status == R.STATUS_STEP] == [3, 4]

    failing = Node(restorer=Restorer(fail=1))
    with pytest.raises(StageLoadError, match="no snapshot yet"):
        failing.load(resume_step=2)
    with pytest.raises(NoSuchStage):
        failing.registry.get(StageSlot("j", 0, 0))
    assert failing.peers[0].closed and failing.reports == []


def test_a_build_that_fails_leaves_no_stage_and_no_open_peers():
    node = Node()
    with pytest.raises(StageLoadError):
        node.registry.load(node_pb2.LoadStageRequest(job_id="j"))
    assert node.registry.holdings() == [] and node.peers[0].closed


def test_a_step_that_raises_fails_the_stage_and_is_reported_with_its_reason():
    node = Node(runner=lambda: Runner(fail_at=1))
    stage = node.load(steps=3)
    failed = node.wait_for(R.STATUS_FAILED)
    assert "RuntimeError: layer blew up at step 1" in failed[0].error
    stage.thread.join(WAIT)
    assert moves(stage) == [S.RUNNING, S.FAILED]
    assert stage.history[-1].reason == "RuntimeError: layer blew up at step 1"


def test_stop_job_stops_a_running_stage_and_release_frees_it_and_its_snapshots():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))
    stage = node.load(steps=100)
    gate.release(2)
    node.wait_for(R.STATUS_STEP, 2)
    assert node.registry.runs("j")
    node.registry.stop_job("j", release=False)
    assert stage.state is S.STOPPED and not node.registry.runs("j")
    assert node.registry.holds("j")
    stage.thread.join(WAIT)
    node.snapshots.put("j", StageKey(0, 0), snapshot(1))
    node.registry.stop_job("j", release=True)
    assert moves(stage) == [S.RUNNING, S.STOPPED, S.RELEASED]
    assert not node.registry.holds("j") and node.snapshots.jobs() == set()
    assert node.over == ["j"], "the job's links through relays were not closed"
    assert not any(r.status in (R.STATUS_DONE, R.STATUS_FAILED) for r in node.reports)


def snapshot(step: int):
    from fedpipe.runtime.checkpoint import Snapshot
    return Snapshot(step, skeleton={}, tensors={})


def test_reconciliation_drops_the_named_stages_and_every_stage_of_gone_jobs():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))
    a, b = node.load(job="a", stage=0, epoch=3), node.load(job="a", stage=1, epoch=3)
    c = node.load(job="c")
    node.snapshots.put("old", StageKey(0, 0), snapshot(1))
    assert {(r.job_id, r.stage) for r in node.registry.holdings()} == \
        {("a", 0), ("a", 1), ("c", 0), ("old", -1)}
    node.registry.drop([tracker_pb2.StageRef(job_id="a", stage=1, epoch=3)], ["c", "old"])
    assert b.state is S.RELEASED and c.state is S.RELEASED and a.live
    assert sorted(node.over) == ["c", "old"], "job a still has a stage here: its links stay"
    assert [(r.job_id, r.stage) for r in node.registry.holdings()] == [("a", 0)]
    node.registry.stop_all()
    assert a.state is S.STOPPED


def test_a_stage_holds_at_its_cut_with_a_checkpoint_and_runs_on_when_the_cut_is_lifted():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))
    stage = node.load(steps=4)
    assert node.registry.hold("j", 0, 2) == (True, 0)
    gate.release(4)
    wait_state(stage, S.HELD)
    assert stage.done == 2
    assert [r.step for r in node.wait_for(R.STATUS_CHECKPOINT)] == [2]  # the cut's snapshot
    assert node.registry.hold("j", 0, 1) == (False, 2)  # a cut behind it cannot be taken
    assert node.registry.hold("j", 0, 0) == (True, 2)  # lifted: it runs on
    node.wait_for(R.STATUS_DONE)
    assert moves(stage) == [S.RUNNING, S.HELD, S.RUNNING, S.DONE]


def test_a_cut_for_a_job_epoch_with_no_live_stage_here_is_refused_and_lifting_it_is_not():
    # accepted, the tracker's hand-over would wait for this node's checkpoint at the cut
    node = Node(runner=lambda: Runner(threading.Semaphore(0)))
    node.load(steps=4)
    for job, epoch in (("other", 0), ("j", 1)):
        with pytest.raises(NoSuchStage, match=f"no live stage of job '{job}' at plan epoch "
                           f"{epoch} on this node to hold at step 2"):
            node.registry.hold(job, epoch, 2)
        assert node.registry.hold(job, epoch, 0) == (True, 0)
    node.registry.stop_job("j", release=False)
    with pytest.raises(NoSuchStage):
        node.registry.hold("j", 0, 2)  # stopped: no longer live


def test_a_held_stage_that_is_stopped_ends_stopped():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))
    stage = node.load(steps=4)
    node.registry.hold("j", 0, 1)
    gate.release(4)
    wait_state(stage, S.HELD)
    node.registry.stop_job("j", release=True)
    assert moves(stage) == [S.RUNNING, S.HELD, S.STOPPED, S.RELEASED]
    assert not any(r.status == R.STATUS_DONE for r in node.reports)


def test_a_joining_groups_stage_restores_on_its_thread_asking_until_its_donor_has_it():
    node = Node(restorer=Restorer(fail=1))
    stage = node.load(steps=3, resume_step=1, snapshot_wait_seconds=5)
    assert node.restorer.calls <= 1  # not restored on the load call
    node.wait_for(R.STATUS_DONE)
    assert node.restorer.calls == 2
    assert moves(stage) == [S.RESTORING, S.RUNNING, S.DONE]


def test_a_joining_groups_stage_that_never_finds_its_snapshot_fails_and_says_why():
    node = Node(restorer=Restorer(fail=10**6))
    stage = node.load(steps=3, resume_step=1, snapshot_wait_seconds=0.01)
    failed = node.wait_for(R.STATUS_FAILED)
    assert "no snapshot yet" in failed[0].error
    assert moves(stage) == [S.RESTORING, S.FAILED] and node.peers[0].closed


def test_a_stop_job_that_comes_while_a_stage_is_built_releases_it_once_built():
    built, go = threading.Event(), threading.Event()
    node = Node()
    build = node._build

    def slow_build(request, peers):  # a node paused, or busy, in the middle of a load
        built.set()
        assert go.wait(WAIT)
        return build(request, peers)

    node.registry.build = slow_build
    outcome: list[object] = []

    def load():
        try:
            outcome.append(node.load(epoch=1))
        except Exception as e:  # noqa: BLE001 — what the load ended with is the point
            outcome.append(e)

    loader = threading.Thread(target=load)
    loader.start()
    assert built.wait(WAIT)
    assert node.registry.stop_job("j", release=True) == []  # nothing held yet
    go.set()
    loader.join(WAIT)
    assert isinstance(outcome[0], Stopped), outcome
    assert "was stopped while it loaded (StopJob)" in str(outcome[0])
    assert not node.registry.holds("j") and node.registry.holdings() == []
    assert node.peers[0].closed and node.reports == []
    # a stop of another job, or of older epochs only, leaves a load alone
    go.clear()
    built.clear()
    loader = threading.Thread(target=load)
    loader.start()
    assert built.wait(WAIT)
    node.registry.stop_job("other", release=True)
    node.registry.stop_job("j", release=True, before_epoch=1)
    go.set()
    loader.join(WAIT)
    assert isinstance(outcome[1], Stage) and S.RUNNING in moves(outcome[1]), outcome
    assert node.registry.holds("j")
    node.registry.stop_all()


def test_a_stage_predicted_past_the_nodes_memory_limit_is_refused_with_both_figures():
    """A node of 1000 bytes holds a stage predicted at 600: one predicted at 500 more is
    refused before anything is built, naming both figures; once the first is released,
    it loads. Each step reports the stage's prediction and its measured peak."""
    gate = threading.Semaphore(0)

    class Hungry(Runner):  # touches 64 MiB in its step: the node's peak RSS grows by it
        def run(self, steps, start=0):  # (less what others free meanwhile: the test's
            for result in super().run(steps, start):  # process is shared, so 16 MiB is asked)
                held = bytearray(64 * 2**20)
                held[::4096] = b"x" * len(held[::4096])
                yield result

    node = Node(runner=lambda: Hungry(gate), memory=StageMemory(torch.device("cpu"), 1000))
    first = node.load(job="a", predicted_memory_bytes=600)
    with pytest.raises(MemoryTooSmall) as err:
        node.load(job="b", predicted_memory_bytes=500)
    assert str(err.value) == (
        "stage 0 (replica 0) of job 'b' is predicted to need 500 B, but this node's memory "
        "limit is 1000 B and its other stages are predicted to hold 600 B of it: 100 B "
        "(100 bytes) too many" + MEMORY_REMEDIES)
    assert len(node.peers) == 1 and not node.registry.holds("b")  # nothing was built
    node.registry.stop_job("a", release=True)
    wait_state(first, S.RELEASED)
    second = node.load(job="b", predicted_memory_bytes=500, steps=1)
    assert second.live
    gate.release()
    node.wait_for(R.STATUS_STEP)
    step = next(r for r in node.reports if r.job_id == "b" and r.status == R.STATUS_STEP)
    assert step.predicted_memory_bytes == 500 and step.peak_memory_bytes >= 16 * 2**20
    node.registry.stop_all()


def test_a_stopped_stage_of_a_failed_job_does_not_hold_its_whole_prediction():
    """A stopped stage kept for the retention period (an ended job's; a job that failed at
    DEPLOYING because another node refused its stage is one) counts only what its tensors
    hold, not its whole prediction (activations and stash included): the tracker's planner
    counts none of an ended job, so the resubmitted job planned onto this node must fit."""
    gate = threading.Semaphore(0)  # no step ends: a loaded stage stays live
    node = Node(runner=lambda: Runner(gate), memory=StageMemory(torch.device("cpu"), 1000))
    first = node.load(job="a", predicted_memory_bytes=600)
    with pytest.raises(MemoryTooSmall):  # while it is live, its whole prediction counts
        node.load(job="b", predicted_memory_bytes=500, steps=1)
    node.registry.stop_job("a", release=False)  # what the tracker's Jobs.fail asks
    wait_state(first, S.STOPPED)
    assert held_bytes(first.parts) == 2 * 2 * 4 + 2 * 4  # its Linear(2, 2): weight, bias
    second = node.load(job="b", predicted_memory_bytes=500, steps=1)
    assert second.live
    # what it still holds counts: 24 + 500 + 477 is over the limit by a byte
    with pytest.raises(MemoryTooSmall, match=r"predicted to hold 524 B of it: 1 B \(1 bytes\)"):
        node.load(job="c", predicted_memory_bytes=477, steps=1)
    node.registry.stop_all()


def test_readdress_points_a_jobs_stages_of_that_epoch_at_a_moved_nodes_new_addresses():
    gate = threading.Semaphore(0)
    node = Node(runner=lambda: Runner(gate))

    def plan(epoch: int, where: str) -> node_pb2.Plan:
        return node_pb2.Plan(epoch=epoch, stages=[
            node_pb2.StageAssignment(stage=0, node_id="a", node_name="node0",
                                     address="r1:10", data_address="r1:11", relay="r1:1"),
            node_pb2.StageAssignment(stage=1, node_id="b", node_name="node1",
                                     address=f"{where}:20", data_address=f"{where}:21",
                                     relay=f"{where}:1")])
    mine, other = node.load(job="j", epoch=3), node.load(job="k", epoch=3)
    mine.plan, other.plan = PlanView(plan(3, "r1")), PlanView(plan(3, "r1"))
    now = plan(3, "r2").stages
    assert node.registry.readdress("j", 2, now) == {}  # another epoch: nothing
    assert node.registry.readdress("j", 3, now) == {"node1": ("r1:21", "r2:21")}
    assert mine.plan.plan == plan(3, "r2")  # in place: its senders and reports follow
    assert other.plan.plan == plan(3, "r1")  # another job's stage is its own
    assert node.registry.readdress("j", 3, now) == {}  # told again: nothing moves
    node.registry.stop_job("j", release=True)
    node.registry.stop_job("k", release=True)
