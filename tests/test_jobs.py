"""The job life cycle, in-process: a fake clock, fake nodes, no gRPC and no processes."""
from __future__ import annotations

import pytest

from fedpipe.proto import tracker_pb2
from fedpipe.spec import PlanView, StageKey, state_name
from fedpipe.tracker import errors
from fedpipe.tracker.jobs import RESTARTED
from fedpipe.tracker.store import MemoryStore, SqliteStore
from tracker_fakes import FakeClock, join, make_tracker, registration, submission

pytestmark = pytest.mark.timeout(60)
S = tracker_pb2
R = tracker_pb2.StageReport


def states(tracker, job_id) -> list[str]:
    return [state_name(e.state) for e in tracker.store.events(job_id, 0) if e.step == 0]


def report(tracker, job_id, key: StageKey, status, **kw):
    node = PlanView(tracker.jobs.get(job_id).plan)[key].node_id
    tracker.jobs.report(R(job_id=job_id, replica=key.replica, stage=key.stage, node_id=node,
                          status=status, **kw))


def test_a_job_goes_pending_planning_deploying_running_and_succeeds_after_its_steps():
    tracker, nodes, clock = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=2, stages=2))
    assert tracker.jobs.get(job).reason == "queued for planning"
    tracker.tick()
    info = tracker.jobs.get(job)
    assert (state_name(info.state), info.reason) == ("RUNNING", "all stages loaded")
    assert states(tracker, job) == ["PENDING", "PLANNING", "DEPLOYING", "RUNNING"]
    # each stage got exactly its layers, and the job's spec with "auto" resolved
    loads = {StageKey(r.replica, r.stage): r for r in nodes.loads}
    view = PlanView(info.plan)
    assert set(loads) == set(view.stages) == {StageKey(0, 0), StageKey(0, 1)}
    for key, req in loads.items():
        a = view[key]
        assert list(req.layers) == [b"layer%d" % i for i in range(a.layer_start, a.layer_end)]
        assert req.config.replica_sync == "allreduce" and req.plan == info.plan

    last = StageKey(0, 1)
    for step in (1, 2):
        clock.advance(1)
        report(tracker, job, last, R.STATUS_STEP, step=step, loss=1.0 / step, samples=8,
               seconds=0.5)
    assert tracker.jobs.get(job).step == 2 and tracker.jobs.get(job).loss == 0.5
    steps = [e for e in tracker.store.events(job, 0) if e.step]
    assert [(e.step, e.samples_per_second) for e in steps] == [(1, 16.0), (2, 16.0)]
    report(tracker, job, StageKey(0, 0), R.STATUS_DONE, step=2)
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"  # one stage is still working
    report(tracker, job, last, R.STATUS_DONE, step=2)
    info = tracker.jobs.get(job)
    assert (state_name(info.state), info.reason) == ("SUCCEEDED", "all 2 steps done")
    assert tracker.store.layers(job, 0, 4) == []
    # a late report about an ended job is ignored, not an error
    report(tracker, job, last, R.STATUS_FAILED, step=2, error="late")
    assert state_name(tracker.jobs.get(job).state) == "SUCCEEDED"


def test_a_job_waits_for_new_nodes_links_until_link_wait_then_plans_anyway():
    tracker, nodes, clock = make_tracker(link_wait=30.0, lease=60.0)
    for i in range(2):
        tracker.register(registration(f"node{i}", 7000 + i))
    job = tracker.jobs.submit(submission())
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "PENDING"  # links not measured yet
    clock.advance(31)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"


@pytest.mark.parametrize("failing_group", [0, 1])
def test_with_two_replica_groups_a_load_failure_in_either_group_fails_the_job(failing_group):
    """Stage 0 of group 0 and stage 0 of group 1 are different stages: neither's failure hides."""
    tracker, nodes, clock = make_tracker()
    join(tracker, 4)
    nodes.fail_load[StageKey(failing_group, 0)] = "out of memory"
    job = tracker.jobs.submit(submission(stages=2, replicas=2))
    tracker.tick()
    info = tracker.jobs.get(job)
    view = PlanView(info.plan)
    assert view.replicas == [0, 1] and len(view.stages) == 4
    assert len(nodes.loads) == 4  # every stage of every group was asked to load
    assert state_name(info.state) == "FAILED", info.reason
    name = view[StageKey(failing_group, 0)].node_name
    assert info.reason == (f"stage 0 (replica {failing_group}) on {name} could not be loaded: "
                           f"out of memory")
    assert "RUNNING" not in states(tracker, job)
    # every node of the plan is told to stop the job, keeping what it loaded
    assert sorted(a for a, _ in nodes.stops) == sorted(view.addresses())
    assert all(r.job_id == job and not r.release for _, r in nodes.stops)


def test_a_failed_stage_fails_the_job_with_its_error_and_stops_the_others():
    tracker, nodes, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission())
    tracker.tick()
    report(tracker, job, StageKey(0, 1), R.STATUS_FAILED, step=1, error="RuntimeError: nan")
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "FAILED"
    assert info.reason.startswith("stage 1 (replica 0) on node ") and \
        info.reason.endswith("failed: RuntimeError: nan")
    assert len(nodes.stops) == 2


def test_a_node_that_misses_its_lease_fails_its_active_jobs_only():
    tracker, nodes, clock = make_tracker(lease=10.0)
    ids = join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    used = PlanView(tracker.jobs.get(job).plan).node_ids()
    lost = sorted(used)[0]
    clock.advance(11)
    for i in ids:
        if i != lost:
            assert tracker.registry.heartbeat(i)
    tracker.tick()
    info = tracker.jobs.get(job)
    name = next(n.name for n in tracker.store.nodes(include_lost=True) if n.node_id == lost)
    assert (state_name(info.state), info.reason) == \
        ("FAILED", f"node(s) {name} lost (no heartbeat for 10 s)")
    assert {n.node_id for n in tracker.store.nodes()} == set(ids) - {lost}
    # a later job plans over the nodes still alive
    second = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert state_name(tracker.jobs.get(second).state) == "RUNNING"
    assert lost not in PlanView(tracker.jobs.get(second).plan).node_ids()


def test_a_node_that_leaves_fails_the_job_at_once():
    tracker, _, _ = make_tracker()
    ids = join(tracker, 2)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert tracker.registry.leave(ids[1])
    assert tracker.jobs.get(job).reason == "node(s) node1 left the swarm"
    assert not tracker.registry.leave("nobody")


def test_cancel_stops_and_releases_the_stages_and_is_final():
    tracker, nodes, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission())
    tracker.tick()
    info = tracker.jobs.cancel(job)
    assert (state_name(info.state), info.reason) == ("CANCELLED", "cancelled by the client")
    assert len(nodes.stops) == 2 and all(r.release and r.reason == "cancelled"
                                         for _, r in nodes.stops)
    assert tracker.jobs.cancel(job, "again").reason == "cancelled by the client"
    assert len(nodes.stops) == 2
    with pytest.raises(errors.NotFound, match="no job 'nope'"):
        tracker.jobs.cancel("nope")


def test_a_pending_job_fails_when_no_node_registers_within_its_timeout():
    tracker, _, clock = make_tracker()
    job = tracker.jobs.submit(submission(pending_timeout=5.0))
    assert tracker.jobs.get(job).reason == "waiting for a node to register"
    clock.advance(4)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "PENDING"
    clock.advance(2)
    tracker.tick()
    assert tracker.jobs.get(job).reason == "no node registered within 5 s"
    forever = tracker.jobs.submit(submission())
    clock.advance(10_000)
    tracker.tick()
    assert state_name(tracker.jobs.get(forever).state) == "PENDING"


def test_a_tracker_restart_fails_the_jobs_it_cut_short_and_keeps_the_running_ones(tmp_path):
    path = str(tmp_path / "tracker.db")
    clock = FakeClock()
    tracker, _, _ = make_tracker(SqliteStore(path), clock)
    join(tracker, 2)
    running = tracker.jobs.submit(submission())
    tracker.tick()
    cut = tracker.jobs.submit(submission())
    tracker.store.set_state(cut, S.JOB_STATE_DEPLOYING, "loading stages", clock())
    tracker.store.close()

    again, _, _ = make_tracker(SqliteStore(path), clock)
    assert (state_name(again.jobs.get(cut).state), again.jobs.get(cut).reason) == \
        ("FAILED", RESTARTED)
    assert state_name(again.jobs.get(running).state) == "RUNNING"
    assert len(again.store.nodes()) == 2  # the nodes keep their lease across the restart
    again.store.close()


def test_a_step_counts_when_every_group_reported_it_and_a_repeated_report_counts_once():
    tracker, _, _ = make_tracker()
    join(tracker, 4)
    job = tracker.jobs.submit(submission(stages=2, replicas=2))
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    for _ in range(2):  # a retried report
        report(tracker, job, StageKey(0, 1), R.STATUS_STEP, step=1, loss=0.25, samples=4,
               seconds=0.5)
    assert tracker.jobs.get(job).step == 0
    report(tracker, job, StageKey(1, 1), R.STATUS_STEP, step=1, loss=0.5, samples=4, seconds=1.0)
    info = tracker.jobs.get(job)
    assert (info.step, info.loss) == (1, 0.75)  # each group's loss is its part of the mean
    ev = [e for e in tracker.store.events(job, 0) if e.step][0]
    assert ev.samples_per_second == 8 / 1.0  # all samples over the slowest group's time


def test_reports_that_cannot_be_true_are_refused_with_the_right_error():
    tracker, _, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=3))
    tracker.tick()
    node = PlanView(tracker.jobs.get(job).plan)[StageKey(0, 0)].node_id
    with pytest.raises(errors.NotFound):
        tracker.jobs.report(R(job_id="nope", status=R.STATUS_DONE))
    with pytest.raises(errors.PermissionDenied, match="does not run stage 1 "):
        tracker.jobs.report(R(job_id=job, replica=0, stage=1, node_id=node,
                              status=R.STATUS_DONE))
    with pytest.raises(errors.FailedPrecondition, match="report of step 4 refused"):
        tracker.jobs.report(R(job_id=job, stage=0, node_id=node, status=R.STATUS_STEP, step=4))
    with pytest.raises(errors.InvalidArgument, match="unknown report status"):
        tracker.jobs.report(R(job_id=job, stage=0, node_id=node, status=9))
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"


def test_bad_or_oversized_submissions_are_refused_naming_the_problem():
    tracker, _, _ = make_tracker(MemoryStore())
    bad = submission()
    bad.config.activation_compression = "topk:0.1"
    with pytest.raises(errors.InvalidArgument, match="activation_compression"):
        tracker.jobs.submit(bad)
    with pytest.raises(errors.InvalidArgument, match="no layers"):
        tracker.jobs.submit(tracker_pb2.SubmitJobRequest())
    short = submission()
    del short.profile.layers[-1]
    with pytest.raises(errors.InvalidArgument, match="the profile has 3 layers but the job 4"):
        tracker.jobs.submit(short)
    tracker.register(registration("tiny", 7000, memory=2**10))
    with pytest.raises(errors.ResourceExhausted, match=r"needs about [\d.]+ MiB .* have 0\.0 MiB"):
        tracker.jobs.submit(submission())
    assert tracker.store.jobs_in(S.JOB_STATE_PENDING) == []
