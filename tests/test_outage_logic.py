"""Training goes on while no tracker leads, in-process: the feed passes its kept-batch bound
while the tracker is silent; the client says once that the tracker is unreachable and
once that it is back; a node's reports wait (bounded, in order) for the next tracker; a
tracker that did not run (SIGSTOP) judges no node by the time it missed; a draining node
waits out a window with no leader before its drain's timeout runs.

The processes' side is ``tests/test_outage.py``.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import grpc
import pytest
import torch

import fedpipe
from client_fakes import FakeNodes, FakeRpcError, FakeTracker, running_watch
from fedpipe.client import feed as feed_mod, watch as watch_mod
from fedpipe.client.feed import Feed
from fedpipe.client.reach import TrackerReach
from fedpipe.client.watch import JobWatch, NoLeader
from fedpipe.net import timeouts
from fedpipe.node.draining import DrainClock
from fedpipe.node.reports import ReportQueue
from fedpipe.proto import tracker_pb2 as S
from tracker_fakes import make_tracker, registration

pytestmark = pytest.mark.timeout(60)
R = S.StageReport
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def wait_until(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def reach_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fedpipe.client" and "tracker" in r.getMessage()]


# -- the client: one line when the tracker goes, one when it is back ---------------
def test_many_failed_calls_make_one_unreachable_line_and_one_back_line(caplog):
    caplog.set_level(logging.INFO)
    reach = TrackerReach()
    for _ in range(5):
        reach.lost(FakeRpcError(UNAVAILABLE, "connection refused"))
    assert reach.unreachable
    for _ in range(3):
        reach.reached()
    assert not reach.unreachable
    lines = reach_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("no tracker leads now (UNAVAILABLE: connection refused); the "
                               "job trains on, and this client waits up to LEADER_WAIT=")
    assert lines[1].startswith("the tracker is back (unreachable for ")
    reach.lost(FakeRpcError(UNAVAILABLE, "again"))  # a second outage is said again
    assert len(reach_lines(caplog)) == 3


def test_a_watch_retried_through_an_outage_says_so_once_and_once_back(monkeypatch, caplog):
    monkeypatch.setattr(watch_mod.timeouts, "WATCH_RESUME", 0.01)
    caplog.set_level(logging.INFO)
    tracker = FakeTracker(steps=3, watch_errors=[FakeRpcError(UNAVAILABLE, "down")] * 4)
    watch, runner = running_watch(tracker)
    assert len(tracker.watch_requests) == 5
    watch.halt()
    runner.join(5)
    lines = reach_lines(caplog)
    assert len(lines) == 2 and "no tracker leads" in lines[0] and "back" in lines[1], lines


class StoppedTracker(FakeTracker):
    """A tracker that is SIGSTOPped while ``stopped`` is set: its watch stream says nothing,
    and a GetJob hangs until its deadline, then fails as gRPC fails it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stopped = threading.Event()

    def GetJob(self, request, timeout=None):
        if self.stopped.is_set():
            time.sleep(timeout)
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return super().GetJob(request, timeout)


def test_a_tracker_that_stops_answering_is_said_once_as_a_refused_one_is_and_once_back(
        monkeypatch, caplog):
    monkeypatch.setattr(timeouts, "TRACKER_SILENT", 0.2)
    monkeypatch.setattr(timeouts, "TRACKER_PROBE_RPC", 0.1)
    caplog.set_level(logging.INFO)
    tracker = StoppedTracker(steps=3)
    watch, runner = running_watch(tracker)
    tracker.stopped.set()  # the stream stays open and silent; a question hangs
    wait_until(lambda: len(reach_lines(caplog)) == 1)
    time.sleep(1.0)  # silent on: nothing more is said
    lines = reach_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("no tracker leads now (DEADLINE_EXCEEDED: Deadline Exceeded); "
                               "the job trains on"), lines
    assert watch.live  # the stream was never refused
    tracker.stopped.clear()  # resumed: the next question is answered
    wait_until(lambda: len(reach_lines(caplog)) == 2)
    assert reach_lines(caplog)[1].startswith("the tracker is back (unreachable for ")
    watch.halt()
    runner.join(5)


# -- the feed: past its bound while the tracker is silent ---------------------------
def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((4, 3), float(i)), torch.full((4,), float(i))) for i in range(n)]


def feed_of(tracker: FakeTracker, nodes: FakeNodes, n: int) -> Feed:
    watch = JobWatch(tracker, "j", "me", halted=threading.Event())
    watch.open()
    feed = Feed("j", tracker, nodes, watch, iter(batches(n)))
    threading.Thread(target=watch.run, daemon=True).start()
    threading.Thread(target=feed.run, daemon=True).start()
    return feed


def test_while_the_tracker_is_silent_the_feed_keeps_every_batch_and_goes_on(monkeypatch):
    monkeypatch.setattr(timeouts, "TRACKER_SILENT", 0.2)
    tracker, nodes = FakeTracker(steps=10, checkpoint_every=1), FakeNodes()
    feed = feed_of(tracker, nodes, 10)
    tracker.run(epoch=1)
    # no checkpoint completes (none can be known without the tracker): the feed goes past
    # its bound of FEED_KEEP_CHECKPOINTS batches and keeps them all for a rewind
    wait_until(lambda: len(nodes.inputs()) == 10)
    assert sorted(feed.kept.kept) == list(range(10))
    assert feed.kept.nbytes == 10 * (4 * 3 + 4) * 4
    tracker.move(S.JOB_STATE_SUCCEEDED)


def test_the_feed_waits_at_its_outage_byte_bound(monkeypatch):
    monkeypatch.setattr(timeouts, "TRACKER_SILENT", 0.2)
    monkeypatch.setattr(feed_mod, "FEED_OUTAGE_KEEP_BYTES", 6 * (4 * 3 + 4) * 4)
    tracker, nodes = FakeTracker(steps=10, checkpoint_every=1), FakeNodes()
    feed = feed_of(tracker, nodes, 10)
    tracker.run(epoch=1)
    wait_until(lambda: len(nodes.inputs()) == 6)
    time.sleep(0.5)
    assert len(nodes.inputs()) == 6 and len(feed.kept) == 6
    tracker.move(S.JOB_STATE_RUNNING, checkpoint_step=9)  # the tracker is back
    wait_until(lambda: len(nodes.inputs()) == 10)
    tracker.move(S.JOB_STATE_SUCCEEDED)


# -- a node's reports: kept while no tracker takes them ----------------------------
class Tracker:
    """Takes ReportStage calls, or refuses them as unreachable while ``down`` is set."""

    def __init__(self):
        self.down, self.got = threading.Event(), []

    def send(self, report: R) -> None:
        if self.down.is_set():
            raise FakeRpcError(UNAVAILABLE, "no tracker leads")
        if report.job_id == "ended":
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "job ended")
        self.got.append((report.status, report.step))


def test_reports_wait_for_the_tracker_in_order_and_only_step_reports_are_dropped(
        monkeypatch, caplog):
    monkeypatch.setattr(timeouts, "RECONNECT_BACKOFF_MAX", 0.05)
    caplog.set_level(logging.INFO)
    tracker = Tracker()
    tracker.down.set()
    queue = ReportQueue(tracker.send, limit=4)
    try:
        queue.put(R(job_id="j", status=R.STATUS_STEP, step=1))
        wait_until(lambda: "unreachable" in caplog.text)
        for step in range(2, 7):
            queue.put(R(job_id="j", status=R.STATUS_STEP, step=step))
            if step == 3:
                queue.put(R(job_id="j", status=R.STATUS_CHECKPOINT, step=3))
        queue.put(R(job_id="ended", status=R.STATUS_STEP, step=7))
        assert len(queue) == 4 and tracker.got == []
        tracker.down.clear()
        assert queue.flush(10)
    finally:
        queue.close()
    # the checkpoint's report is kept; the oldest step reports made room for the newest
    assert tracker.got == [(R.STATUS_CHECKPOINT, 3), (R.STATUS_STEP, 5), (R.STATUS_STEP, 6)]
    assert caplog.text.count("the tracker is unreachable") == 1
    assert caplog.text.count("the tracker takes reports again") == 1
    assert "4 step reports dropped" in caplog.text
    assert "refused a report of job ended" in caplog.text


# -- the tracker: a pause is not the nodes' fault -----------------------------------
def test_a_tracker_that_did_not_run_past_the_lease_loses_no_node():
    tracker, _, clock = make_tracker(lease=5.0)
    node = tracker.register(registration("alpha", 7000))
    clock.advance(8)  # SIGSTOPped: no heartbeat could be taken
    assert tracker.pardon_pause(8.0)
    tracker.tick()
    assert tracker.registry.alive(node)
    clock.advance(6)  # running again: a node that misses its lease now is lost
    assert not tracker.pardon_pause(1.0)
    tracker.tick()
    assert not tracker.registry.alive(node)


# -- a draining node: its timeout runs only while a tracker leads ------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_drain_waits_out_a_window_with_no_leader_and_times_out_only_on_led_time():
    clock = Clock()
    drain = DrainClock(timeout=10.0, leader_wait=60.0, clock=clock)
    assert drain.over() is None  # not draining
    drain.unreachable()  # the tracker went before the drain began
    clock.now += 5
    drain.start()
    clock.now += 30  # no tracker leads: 30 s past the drain's start, more than its timeout
    assert drain.over() is None
    drain.unreachable()  # more failed calls change nothing
    drain.reached()  # a tracker leads again
    clock.now += 9
    assert drain.over() is None  # 9 s counted of 10
    drain.unreachable()
    clock.now += 20
    assert drain.over() is None
    drain.reached()
    clock.now += 1.5  # 10.5 s counted
    assert drain.over() == "the drain timed out after 10 s; exiting anyway"


def test_a_drain_with_no_leader_for_leader_wait_exits_saying_so():
    clock = Clock()
    drain = DrainClock(timeout=10.0, leader_wait=60.0, clock=clock)
    drain.start()
    clock.now += 2
    drain.unreachable()
    clock.now += 59.9
    assert drain.over() is None
    clock.now += 0.2
    why = drain.over()
    assert why is not None and why.startswith("no tracker led within LEADER_WAIT=60 s"), why
    assert "FEDPIPE_LEADER_WAIT" in why


def test_fedpipe_drain_with_no_tracker_leading_asks_again_then_says_none_led(monkeypatch,
                                                                              caplog):
    monkeypatch.setattr(timeouts, "LEADER_WAIT", 1.0)
    monkeypatch.setattr(timeouts, "RECONNECT_BACKOFF_MAX", 0.1)
    caplog.set_level(logging.INFO)
    with socket.socket() as s:  # a port nothing listens on: no tracker there
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with fedpipe.Client(address) as client:
        t0 = time.monotonic()
        with pytest.raises(NoLeader, match=r"no tracker led within LEADER_WAIT=1 s to drain "
                                           r"node node3 \(UNAVAILABLE"):
            client.drain("node3")
    assert time.monotonic() - t0 >= 1.0  # asked again for LEADER_WAIT, not failed at once
    assert len(reach_lines(caplog)) == 1, reach_lines(caplog)


def test_a_pause_is_the_process_stopping_not_a_round_that_waited():
    from fedpipe.tracker.pauses import PauseWatch

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock, stop = Clock(), threading.Event()
    watch = PauseWatch(stop, clock)
    clock.t = 0.25
    watch.note()
    clock.t = 8.25  # SIGSTOPped: the watch's thread did not wake for 8 s
    watch.note()
    clock.t = 8.5
    assert watch.take() == 8.0
    assert watch.take() == 0.0  # counted once
    # a scheduler round that waits 3 s on the network is no pause: the watch runs on
    live = PauseWatch(stop)
    thread = threading.Thread(target=live.run, daemon=True)
    thread.start()
    try:
        time.sleep(3.0)
        assert live.take() < 2.0
    finally:
        stop.set()
        thread.join(2)


def test_a_scheduler_round_that_waits_on_the_nodes_is_no_pause(caplog, monkeypatch):
    """A round that waits 4 s (a recovery's LoadStage while the restorer fetches a large
    snapshot) is past TRACKER_PAUSED, but the process ran all along: no pardon."""
    tracker, _, _ = make_tracker(lease=5.0)
    rounds: list[int] = []

    def slow_tick():
        rounds.append(1)
        if len(rounds) == 1:
            time.sleep(4.0)
        else:
            tracker.stop_event.set()

    monkeypatch.setattr(tracker, "guarded_tick", slow_tick)
    watch = threading.Thread(target=tracker.pauses.run, daemon=True)
    watch.start()
    caplog.set_level(logging.WARNING)
    try:
        tracker._scheduler()  # returns once stopped
    finally:
        tracker.stop_event.set()
        watch.join(2)
    assert len(rounds) == 2
    assert "did not run" not in caplog.text
