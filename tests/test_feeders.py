"""A job's client presence, in-process: feeders attach and leave, a job without one waits
for the client (its stages stopped), comes back, is taken over, or fails at its timeout."""
from __future__ import annotations

import time

import pytest

from fedpipe.net import timeouts
from fedpipe.proto import tracker_pb2
from fedpipe.spec import JobSpec, PlanView, state_name
from fedpipe.tracker import errors
from fedpipe.tracker.http import TrackerSource
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)
S = tracker_pb2
R = tracker_pb2.StageReport


def running_job(**spec):
    """A RUNNING 2-stage job of 10 steps whose checkpoint of step 4 is complete, fed by "A"."""
    tracker, nodes, clock = make_tracker(lease=3600.0)
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=10, stages=2, checkpoint_every=2, **spec))
    tracker.feeders.attach(job, "A", take_over=False)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING"
    for key, a in PlanView(info.plan).stages.items():
        tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                              node_id=a.node_id, status=R.STATUS_CHECKPOINT, step=4,
                              epoch=info.epoch))
    assert tracker.jobs.get(job).checkpoint_step == 4
    return tracker, nodes, clock, job


def stops_of_epochs_before(nodes, epoch: int, n: int) -> list:
    """The StopJob calls that stop the stages of epochs before ``epoch`` (sent on a
    thread: wait for ``n`` of them)."""
    deadline = time.monotonic() + 10
    while True:
        got = [r for _, r in nodes.stops if r.before_epoch == epoch]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_a_running_job_whose_client_left_waits_for_it_with_its_stages_stopped():
    tracker, nodes, clock, job = running_job()
    epoch = tracker.jobs.get(job).epoch
    tracker.feeders.detach(job, "A")
    clock.advance(timeouts.CLIENT_GRACE / 2)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"  # a redial may come back
    clock.advance(timeouts.CLIENT_GRACE)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "WAITING"
    assert info.reason.startswith("waiting for the client")
    assert (info.epoch, info.resume_step) == (epoch + 1, 4)
    # no node keeps a stage thread waiting for the gone client's inputs...
    stops = stops_of_epochs_before(nodes, epoch + 1, 2)
    assert len(stops) == 2 and not any(r.release for r in stops)
    # ...and the nodes keep the stopped stages' snapshots for the resume
    holds = [S.StageRef(job_id=job, replica=0, stage=s, epoch=epoch) for s in (0, 1)]
    for node_id in PlanView(info.plan).node_ids():
        assert tracker.retention.reconcile(node_id, holds) == ([], [])


def test_a_waiting_jobs_reason_counts_down_its_time_left_when_shown():
    tracker, nodes, clock, job = running_job()
    timeout = JobSpec.from_proto(tracker.store.spec(job).config).client_timeout
    tracker.feeders.detach(job, "A")
    clock.advance(timeouts.CLIENT_GRACE + 1)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "WAITING"
    assert "fails in" not in info.reason  # as stored (and in the job's events): no countdown
    source = TrackerSource(tracker.store, tracker.stage_times,
                           tracker.feeders)  # the dashboard's
    for waited in (timeouts.CLIENT_GRACE + 1, timeouts.CLIENT_GRACE + 101):
        for shown in (tracker.feeders.shown(tracker.jobs.get(job)), source.job(job)):
            assert shown.reason.endswith(f"; the job fails in {timeout - waited:.0f} s unless "
                                         f"a client resumes it"), shown.reason
        clock.advance(100)
    tracker.feeders.attach(job, "B", take_over=False)  # back: nothing counts down
    assert "fails in" not in tracker.feeders.shown(tracker.jobs.get(job)).reason


def test_the_client_coming_back_resumes_the_job_at_its_checkpoint():
    tracker, nodes, clock, job = running_job()
    tracker.feeders.detach(job, "A")
    clock.advance(timeouts.CLIENT_GRACE + 1)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "WAITING"
    loads = len(nodes.loads)
    tracker.feeders.attach(job, "A", take_over=False)
    assert state_name(tracker.jobs.get(job).state) == "RECOVERING"
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING", info.reason
    assert info.reason.startswith("recovered from the client's absence: resumed at checkpoint "
                                  "step 4")
    assert {r.resume_step for r in nodes.loads[loads:]} == {4}
    assert info.recoveries[-1].lost == "the client"
    assert tracker.feeders.feeder(job) == "A"


def test_a_job_whose_client_stays_away_fails_at_its_client_timeout_with_the_reason():
    tracker, nodes, clock, job = running_job(client_timeout=30.0)
    tracker.feeders.detach(job, "A")
    clock.advance(timeouts.CLIENT_GRACE + 1)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "WAITING"
    clock.advance(20)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "WAITING"
    clock.advance(10)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "FAILED"
    assert info.reason.startswith("the client did not come back within its client_timeout "
                                  "of 30 s")


def test_a_client_that_takes_over_rewinds_the_job_and_the_old_one_may_not_feed_it_again():
    tracker, nodes, clock, job = running_job()
    epoch = tracker.jobs.get(job).epoch
    tracker.feeders.attach(job, "B", take_over=True)
    info = tracker.jobs.get(job)
    assert (state_name(info.state), info.epoch, info.resume_step) == ("RECOVERING", epoch + 1, 4)
    assert tracker.feeders.feeder(job) == "B"
    tracker.feeders.detach(job, "A")  # the old client's stream ends: B stays the feeder
    assert tracker.feeders.feeder(job) == "B"
    with pytest.raises(errors.FailedPrecondition, match="fed by another client"):
        tracker.feeders.attach(job, "A", take_over=False)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    clock.advance(timeouts.CLIENT_GRACE + 1)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"  # B is there


def test_a_take_over_of_an_ended_job_is_refused_naming_its_state():
    tracker, nodes, clock, job = running_job()
    tracker.jobs.cancel(job, "stopped by its owner")
    with pytest.raises(errors.FailedPrecondition,
                       match=r"has ended CANCELLED \(stopped by its owner\); an ended job "
                             r"cannot be resumed"):
        tracker.feeders.attach(job, "B", take_over=True)
    assert tracker.feeders.feeder(job) == "A"  # nothing changed
    assert state_name(tracker.jobs.get(job).state) == "CANCELLED"
    tracker.feeders.detach(job, "A")
    tracker.feeders.attach(job, "C", take_over=False)  # a plain watch of it stays allowed


def test_a_job_no_client_ever_fed_is_never_parked():
    tracker, nodes, clock = make_tracker(lease=3600.0)
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=10, stages=2, client_timeout=5.0))
    tracker.tick()
    clock.advance(100)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"


def test_a_job_no_client_ever_watched_fails_at_its_client_timeout_after_submission():
    tracker, nodes, clock = make_tracker(lease=3600.0)
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=10, stages=2, client_timeout=30.0))
    tracker.feeders.submitted(job)  # as SubmitJob does; its client never watches it
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"  # not parked: never fed
    clock.advance(29.0)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    clock.advance(2.0)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "FAILED"
    assert "no client watched the job" in info.reason and "30 s" in info.reason
    # a job whose client does watch it in time is not failed for it
    other = tracker.jobs.submit(submission(steps=10, stages=2, client_timeout=30.0))
    tracker.feeders.submitted(other)
    tracker.feeders.attach(other, "B", take_over=False)
    clock.advance(60.0)
    tracker.tick()
    assert state_name(tracker.jobs.get(other).state) != "FAILED"
