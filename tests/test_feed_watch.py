"""The client's feed and its watch, in-process against a fake tracker and fake nodes: what
is sent each step, the replay after a rewind, back-pressure, and which tracker refusals the
watch retries and which it raises (a refused ``Job.resume`` raises before any thread)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from client_fakes import FakeNodes, FakeRpcError, FakeTracker, running_watch
from fedpipe.client import Client, feed as feed_mod, links, watch as watch_mod
from fedpipe.client.feed import Feed, KeptBatches, GroupFeed
from fedpipe.client.watch import Halted, JobWatch
from fedpipe.proto import node_pb2, tracker_pb2 as S
from fedpipe.spec import PlanView

pytestmark = pytest.mark.timeout(60)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(autouse=True)
def quick_rewatch(monkeypatch):
    monkeypatch.setattr(watch_mod.timeouts, "WATCH_RESUME", 0.05)
    # a fake tracker says nothing between a test's moves: never count it gone here
    # (test_outage_logic.py does)
    monkeypatch.setattr(watch_mod.timeouts, "TRACKER_SILENT", 3600.0)


def batches(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batch ``i`` holds the value ``i`` everywhere, so a sent tensor names its batch."""
    return [(torch.full((size, 3), float(i)), torch.full((size,), float(i))) for i in range(n)]


def start(tracker: FakeTracker, nodes: FakeNodes, data, **kw) -> tuple[Feed, JobWatch, list]:
    """A watch and a feed on their threads, as Job._start_feed runs them; the feed's
    error (if any) lands in the returned list."""
    watch = JobWatch(tracker, "j", "me", halted=threading.Event())
    watch.open()
    feed = Feed("j", tracker, nodes, watch, iter(data), **kw)
    errors: list[BaseException] = []

    def body():
        try:
            feed.run()
        except BaseException as e:  # noqa: BLE001 — the test reads it
            errors.append(e)

    threading.Thread(target=watch.run, daemon=True).start()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    feed.thread = t  # type: ignore[attr-defined]
    return feed, watch, errors


def wait_until(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def test_each_step_goes_to_each_groups_first_and_last_stage_in_its_share():
    tracker, nodes = FakeTracker(steps=3), FakeNodes()
    feed, watch, errors = start(tracker, nodes, batches(3))
    tracker.run(epoch=1, groups=2)
    wait_until(lambda: len(nodes.sent) == 3 * 4)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors and not feed.thread.is_alive()
    got = [(a, e.step, e.kind, e.batch_size, t.shape[0]) for a, e, t in nodes.sent]
    for step in range(3):
        assert [g for g in got if g[1] == step] == [
            ("r0-s0", step, node_pb2.KIND_INPUT, 4, 2), ("r0-s1", step, node_pb2.KIND_TARGET, 4, 2),
            ("r1-s0", step, node_pb2.KIND_INPUT, 4, 2), ("r1-s1", step, node_pb2.KIND_TARGET, 4, 2)]
    assert feed.fed == 3


def test_after_a_rewind_the_feed_sends_the_kept_batches_again_in_order():
    tracker = FakeTracker(steps=6, checkpoint_every=2)
    lost = threading.Event()

    def on_send(address, env):
        if env.epoch == 1 and env.step == 4 and not lost.is_set():
            lost.set()  # the first stage's node is lost; the job rewinds to step 2
            threading.Thread(target=tracker.run, kwargs=dict(epoch=2, resume_step=2)).start()
            raise FakeRpcError(UNAVAILABLE, "node gone")

    nodes = FakeNodes(on_send)
    feed, _, errors = start(tracker, nodes, batches(6))
    tracker.run(epoch=1)
    tracker.move(S.JOB_STATE_RUNNING, checkpoint_step=2)
    wait_until(lambda: [s for s, _ in nodes.inputs(2)] == [2, 3, 4, 5])
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors
    assert [s for s, _ in nodes.inputs(1)] == [0, 1, 2, 3]
    # the same batches, in the same order, and none drawn twice
    assert [(s, int(t[0, 0])) for s, t in nodes.inputs(2)] == [(2, 2), (3, 3), (4, 4), (5, 5)]
    assert feed.kept.drawn == 6


def test_a_rewind_past_the_kept_batches_is_an_error_not_a_silent_skip():
    kept = KeptBatches(iter(batches(8)), "j")
    groups = GroupFeed.of(PlanView(node_pb2.Plan(stages=[
        node_pb2.StageAssignment(replica=0, stage=0, address="a")])))
    for step in range(6):
        kept.get(step, groups)
    kept.forget_before(4)
    kept.check_rewind(4)  # still there
    with pytest.raises(RuntimeError, match="rewound to step 2, but the feed kept batches "
                                           "from step 4 only"):
        kept.check_rewind(2)


def test_a_busy_node_is_sent_to_again_until_it_takes_the_step(monkeypatch):
    refusals = {"left": 2}

    def on_send(address, env):
        if env.step == 1 and refusals["left"]:
            refusals["left"] -= 1
            raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "mailbox full")

    tracker, nodes = FakeTracker(steps=3), FakeNodes(on_send)
    feed, _, errors = start(tracker, nodes, batches(3))
    tracker.run(epoch=1)
    wait_until(lambda: len(nodes.inputs()) == 3)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors and [s for s, _ in nodes.inputs()] == [0, 1, 2]
    assert nodes.attempts == 3 * 2 + 2


def test_a_relayed_nodes_failed_link_is_fed_again_at_the_address_its_plan_moved_it_to():
    """Its relay stayed away: the node re-homed at another relay (the tracker rewrote the
    plan in the same epoch), and the link to the old one failed; the tensor is sent again
    there, and one the node already took before the break (ALREADY_EXISTS) counts as
    delivered."""
    moved = {"done": False}

    def on_send(address, env):
        if env.step == 1 and env.kind == node_pb2.KIND_INPUT and not moved["done"]:
            moved["done"] = True
            with tracker.lock:
                first = next(a for a in tracker.info.plan.stages if a.stage == 0)
                first.address, first.data_address = "r0-s0-moved", "r0-s0-moved-data"
            raise links.LinkError(UNAVAILABLE, "cannot reach r0-s0 again within 10.0 s")
        if env.step == 2 and env.kind == node_pb2.KIND_TARGET and nodes.attempts == 7:
            raise links.LinkError(UNAVAILABLE, "the connection broke")
        if env.step == 2 and env.kind == node_pb2.KIND_TARGET and nodes.attempts == 8:
            raise FakeRpcError(grpc.StatusCode.ALREADY_EXISTS, "duplicate target for step 2")

    tracker, nodes = FakeTracker(steps=3), FakeNodes(on_send)
    feed, _, errors = start(tracker, nodes, batches(3))
    tracker.run(epoch=1, relay="relay:1")
    wait_until(lambda: nodes.attempts == 8)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors
    assert [(a, e.step) for a, e, _ in nodes.sent if e.kind == node_pb2.KIND_INPUT] == [
        ("r0-s0", 0), ("r0-s0-moved", 1), ("r0-s0-moved", 2)]
    assert [e.step for _, e, _ in nodes.sent if e.kind == node_pb2.KIND_TARGET] == [0, 1]


def test_a_direct_nodes_failed_link_waits_for_the_recovery():
    """A node dialed directly whose link failed is gone (its job recovers): not fed again."""
    def on_send(address, env):
        if env.step == 1:
            raise links.LinkError(UNAVAILABLE, "cannot reach r0-s0 again within 2.0 s")

    tracker, nodes = FakeTracker(steps=3), FakeNodes(on_send)
    feed, _, errors = start(tracker, nodes, batches(3))
    tracker.run(epoch=1)
    wait_until(lambda: nodes.attempts == 3)  # step 0's input and target, step 1's input
    time.sleep(0.3)
    assert nodes.attempts == 3  # not sent again within the epoch
    tracker.move(S.JOB_STATE_FAILED)
    feed.thread.join(5)


def test_a_node_busy_past_the_attempts_fails_the_feed(monkeypatch):
    monkeypatch.setattr(feed_mod, "FEED_BUSY_ATTEMPTS", 2)

    def on_send(address, env):
        raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "mailbox full")

    tracker, nodes = FakeTracker(steps=3), FakeNodes(on_send)
    feed, _, errors = start(tracker, nodes, batches(3))
    tracker.run(epoch=1)
    feed.thread.join(10)
    assert [e.code() for e in errors] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert nodes.attempts == 2


def test_the_feed_pauses_at_its_kept_batch_bound_until_a_checkpoint_completes():
    tracker, nodes = FakeTracker(steps=10, checkpoint_every=1), FakeNodes()
    feed, _, errors = start(tracker, nodes, batches(10))
    tracker.run(epoch=1)
    wait_until(lambda: len(nodes.inputs()) == feed_mod.FEED_KEEP_CHECKPOINTS)
    time.sleep(0.3)
    assert len(nodes.inputs()) == feed_mod.FEED_KEEP_CHECKPOINTS  # paused: no checkpoint yet
    tracker.move(S.JOB_STATE_RUNNING, checkpoint_step=2)  # frees step 0: one more batch
    wait_until(lambda: len(nodes.inputs()) == feed_mod.FEED_KEEP_CHECKPOINTS + 1)
    time.sleep(0.3)
    assert len(nodes.inputs()) == feed_mod.FEED_KEEP_CHECKPOINTS + 1
    tracker.move(S.JOB_STATE_RUNNING, checkpoint_step=9)
    wait_until(lambda: len(nodes.inputs()) == 10)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors and sorted(feed.kept.kept) == [8, 9]


def test_a_resumed_feed_skips_the_steps_done_and_restores_a_saved_checkpoint():
    class Saved:
        step = 3

        def for_stage(self, key, start, end):
            return {"key": key}

    tracker, nodes = FakeTracker(steps=5), FakeNodes()
    feed, _, errors = start(tracker, nodes, batches(5), restore=Saved())
    tracker.run(epoch=1)
    wait_until(lambda: len(nodes.inputs()) == 2)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    feed.thread.join(5)
    assert not errors and tracker.restored == [3]
    assert [a for a, _ in nodes.snapshots] == ["r0-s0", "r0-s1"]
    assert [(s, int(t[0, 0])) for s, t in nodes.inputs()] == [(3, 3), (4, 4)]


def test_data_that_runs_out_ends_the_feed_with_stop_iteration():
    tracker, nodes = FakeTracker(steps=5), FakeNodes()
    feed, _, errors = start(tracker, nodes, batches(2))
    tracker.run(epoch=1)
    feed.thread.join(5)
    assert [type(e) for e in errors] == [StopIteration] and feed.fed == 2


# -- the watch ---------------------------------------------------------------


def test_the_watch_wakes_the_feed_on_events_instead_of_polling_the_tracker():
    tracker = FakeTracker(steps=3)
    watch = JobWatch(tracker, "j", "me")
    watch.open()
    threading.Thread(target=watch.run, daemon=True).start()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(watch.await_epoch(-1, 0.05)))
    waiter.start()
    time.sleep(0.6)  # PENDING: no event for a while
    assert waiter.is_alive() and tracker.get_calls <= 2  # not every 50 ms
    for step in range(1, 30):  # steps' events (of an epoch it does not wait for) wake nobody
        tracker.move(S.JOB_STATE_PENDING, step=step)
    time.sleep(0.1)
    assert waiter.is_alive() and tracker.get_calls <= 2
    tracker.run(epoch=1)
    waiter.join(5)
    assert got[0].epoch == 1 and got[0].state == S.JOB_STATE_RUNNING
    watch.halt()


def test_while_the_stream_is_down_the_watch_polls_and_watches_again():
    tracker = FakeTracker(steps=3)
    watch, runner = running_watch(tracker)
    tracker.drop_streams(FakeRpcError(UNAVAILABLE, "tracker restarting"))
    wait_until(lambda: len(tracker.watch_requests) == 2)  # watched again, after the last event
    assert tracker.watch_requests[1].after_seq == len(tracker.events)
    assert not tracker.watch_requests[1].take_over
    tracker.move(S.JOB_STATE_SUCCEEDED)
    runner.join(5)
    assert not runner.is_alive() and watch.error is None


@pytest.mark.parametrize("code", [UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_the_watch_retries_what_can_pass(code):
    tracker = FakeTracker(steps=3, watch_errors=[FakeRpcError(code, "x"),
                                                 FakeRpcError(code, "x")])
    watch = JobWatch(tracker, "j", "me", take_over=True)
    watch.open()  # left to run()
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    tracker.run(epoch=1)
    watch.wait_started()
    assert len(tracker.watch_requests) == 3
    assert all(r.take_over for r in tracker.watch_requests)  # not attached until it took over
    watch.halt()
    runner.join(5)
    assert watch.error is None


@pytest.mark.parametrize("code", [DENIED, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAUTHENTICATED])
def test_the_watch_raises_a_refusal_at_once_and_never_retries_it(code):
    tracker = FakeTracker(watch_errors=[FakeRpcError(code, "no")])
    watch = JobWatch(tracker, "j", "me", take_over=True)
    with pytest.raises(grpc.RpcError) as e:
        watch.open()
    assert e.value.code() == code and watch.error is e.value
    assert watch.halted.is_set() and len(tracker.watch_requests) == 1
    with pytest.raises(Halted):
        watch.wait_started()


def test_a_refusal_on_a_rewatch_ends_the_watch_and_halts_the_feed():
    tracker = FakeTracker(steps=3, watch_errors=[None, FakeRpcError(DENIED, "revoked")])
    watch = JobWatch(tracker, "j", "me")
    watch.open()
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    tracker.drop_streams(FakeRpcError(UNAVAILABLE, "tracker restarting"))
    runner.join(5)
    assert not runner.is_alive() and watch.error.code() == DENIED
    assert watch.halted.is_set() and len(tracker.watch_requests) == 2


def test_a_job_taken_over_by_another_client_ends_the_watch_as_superseded():
    tracker = FakeTracker(steps=3, watch_errors=[None, FakeRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, "fed by another client now")])
    watch = JobWatch(tracker, "j", "me")
    watch.open()
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    tracker.drop_streams(FakeRpcError(UNAVAILABLE, "x"))
    runner.join(5)
    assert watch.superseded and watch.error is None and watch.halted.is_set()


def test_the_feed_stops_when_another_feeder_is_named():
    tracker, nodes = FakeTracker(steps=3), FakeNodes()
    feed, watch, errors = start(tracker, nodes, batches(3))
    tracker.info.feeder = "someone else"
    tracker.run(epoch=1)
    feed.thread.join(5)
    assert [type(e) for e in errors] == [Halted] and watch.superseded and not nodes.sent


def test_a_refused_resume_raises_before_any_thread_starts():
    client = Client("127.0.0.1:1")  # never dialled: the fake answers
    tracker = FakeTracker(watch_errors=[FakeRpcError(DENIED, "job j is not yours")])
    client.stub = tracker
    try:
        before = {t.name for t in threading.enumerate()}
        job = client.job("j")
        with pytest.raises(grpc.RpcError) as e:
            job.resume(batches(3))
        assert e.value.code() == DENIED and "not yours" in e.value.details()
        assert job._feeder is None and job._follower is None
        assert {t.name for t in threading.enumerate()} - before == set()
        assert job not in client._feeding
        assert len(tracker.watch_requests) == 1 and tracker.watch_requests[0].take_over
    finally:
        client.close()


def test_a_submit_whose_watch_is_refused_raises_and_cancels_the_job():
    from torch import nn

    import fedpipe

    client = Client("127.0.0.1:1")
    tracker = FakeTracker(watch_errors=[FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                     "too many watches")])
    client.stub = tracker
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.submit(nn.Sequential(nn.Linear(3, 2)), nn.functional.mse_loss,
                          fedpipe.optimizer(torch.optim.SGD, lr=0.1),
                          [(torch.randn(4, 3), torch.randn(4, 2))], steps=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert tracker.submitted.config.steps == 2
        assert [c.reason for c in tracker.cancelled] == [
            "the client could not start feeding it: RESOURCE_EXHAUSTED: too many watches"]
        assert not client._feeding
    finally:
        client.close()


def test_a_watch_of_a_job_that_ended_reads_its_events_once_and_stops():
    tracker = FakeTracker(steps=3)
    tracker.move(S.JOB_STATE_SUCCEEDED)
    seen: list = []
    watch = JobWatch(tracker, "j", "me", on_event=seen.append)
    watch.open()
    watch.run()
    assert [e.state for e in seen] == [S.JOB_STATE_PENDING, S.JOB_STATE_SUCCEEDED]
    assert len(tracker.watch_requests) == 1
    assert watch.await_epoch(-1, 0.05) is None  # it ended: nothing to feed
