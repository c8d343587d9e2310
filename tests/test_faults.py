"""The fault injector in-process, against a fake job whose step a test moves: a fault fires
once the job reached its step, and a feed through the injector holds the batch of each
fault's step until that fault fired (so a fast job cannot end before its fault lands)."""
from __future__ import annotations

import threading

import pytest

from fedpipe.proto import tracker_pb2
from fedpipe.testing.faults import FaultInjector

pytestmark = pytest.mark.timeout(60)


class FakeJob:
    """GetJob's answer for job "j": its step and state, moved by the test."""

    def __init__(self):
        self.info = tracker_pb2.JobInfo(job_id="j", state=tracker_pb2.JOB_STATE_RUNNING)

    def get(self, job_id: str) -> tracker_pb2.JobInfo:
        assert job_id == "j"
        out = tracker_pb2.JobInfo()
        out.CopyFrom(self.info)
        return out


def test_the_feed_holds_the_faults_step_until_it_fired_then_goes_on():
    job, fired = FakeJob(), threading.Event()
    inj = FaultInjector(job.get, poll=0.005).at_step(2, "kill", fired.set)
    fed = inj.feed(range(5))
    assert [next(fed), next(fed)] == [0, 1]  # the job may take steps 0 and 1
    taken: list[int] = []
    taker = threading.Thread(target=lambda: taken.extend(fed), daemon=True)
    taker.start()
    taker.join(0.3)
    assert taken == [] and not fired.is_set()  # batch 2 waits for the fault
    inj.start("j")
    job.info.step = 2  # the tracker learns the job completed 2 steps: the fault fires
    taker.join(10)
    assert taken == [2, 3, 4] and fired.is_set()
    inj.stop()
    assert [(f.name, f.step) for f in inj.fired] == [("kill", 2)]


def test_a_job_that_ended_before_its_fault_releases_the_held_feed():
    job = FakeJob()
    inj = FaultInjector(job.get, poll=0.005).at_step(3, "never", lambda: None)
    fed = inj.feed(range(5))
    job.info.state = tracker_pb2.JOB_STATE_FAILED
    inj.start("j")
    assert list(fed) == [0, 1, 2, 3, 4]  # not held for the wait's 120 s
    inj.stop()
    assert inj.fired == []


def test_faults_the_feed_cannot_hold_are_refused():
    job = FakeJob()
    with pytest.raises(ValueError, match="faults at step 0 cannot hold a feed: first"):
        FaultInjector(job.get).at_step(0, "first", lambda: None).feed([1, 2])
    inj = FaultInjector(job.get).at_step(1, "a", lambda: None)
    with pytest.raises(ValueError, match="no job to watch"):
        inj.start()
    inj.start("j")
    with pytest.raises(RuntimeError, match="fault 'b' planned after the injector started"):
        inj.at_step(2, "b", lambda: None)
    job.info.state = tracker_pb2.JOB_STATE_SUCCEEDED
    inj.stop()
