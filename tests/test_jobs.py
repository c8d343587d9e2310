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
    tracker.progress.report(R(job_id=job_id, replica=key.replica, stage=key.stage, node_id=node,
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


def lose(tracker, clock, node_id, lease=10.0):
    """Let ``node_id``'s lease run out while every other node heartbeats."""
    clock.advance(lease + 1)
    for n in tracker.store.nodes():
        if n.node_id != node_id:
            assert tracker.registry.heartbeat(n.node_id)
    tracker.registry.expire()


def ack_checkpoint(tracker, job, step):
    info = tracker.jobs.get(job)
    for key in PlanView(info.plan).stages:
        report(tracker, job, key, R.STATUS_CHECKPOINT, step=step, epoch=info.epoch)


def test_a_lost_node_moves_the_job_to_recovering_then_its_stages_to_a_spare():
    tracker, nodes, clock = make_tracker(lease=10.0)
    ids = join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=20, stages=2, checkpoint_every=5))
    tracker.tick()
    before = tracker.jobs.get(job).plan
    used = PlanView(before).node_ids()
    spare = (set(ids) - used).pop()
    lost = sorted(used)[0]
    for step in range(1, 8):
        report(tracker, job, StageKey(0, 1), R.STATUS_STEP, step=step, loss=1.0, samples=8,
               seconds=0.1)
    ack_checkpoint(tracker, job, 5)
    assert tracker.jobs.get(job).checkpoint_step == 5
    lose(tracker, clock, lost)
    info = tracker.jobs.get(job)
    name = next(n.name for n in tracker.store.nodes(include_lost=True) if n.node_id == lost)
    assert (state_name(info.state), info.reason) == (
        "RECOVERING", f"node(s) {name} lost (no heartbeat for 10 s); rewinding to checkpoint "
                      f"step 5")
    assert (info.epoch, info.resume_step) == (1, 5)
    nodes.loads.clear()
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING", info.reason
    assert info.step == 5 and info.plan.epoch == 1
    view, old = PlanView(info.plan), PlanView(before)
    moved = [k for k in view.stages if view[k].node_id != old[k].node_id]
    assert [view[k].node_id for k in moved] == [spare]  # only the lost node's stage moved
    assert all(old[k].node_id == lost for k in moved)
    assert {(r.resume_step, r.plan.epoch) for r in nodes.loads} == {(5, 1)}
    assert all(r.snapshot_sources for r in nodes.loads)
    rec = info.recoveries[0]
    assert (rec.lost, rec.checkpoint_step, rec.steps_recomputed, rec.epoch) == (name, 5, 2, 1)
    # reports of the old epoch are ignored; the new epoch's count
    report(tracker, job, StageKey(0, 1), R.STATUS_STEP, step=6, loss=1.0, samples=8,
           seconds=0.1, epoch=0)
    assert tracker.jobs.get(job).step == 5
    report(tracker, job, StageKey(0, 1), R.STATUS_STEP, step=6, loss=1.0, samples=8,
           seconds=0.1, epoch=1)
    assert tracker.jobs.get(job).step == 6


def test_before_a_recovery_loads_a_stage_every_snapshot_holder_learns_the_new_plans_nodes():
    """Under TLS a holder serves a job's snapshots only to nodes it knows are assigned:
    the tracker names the new plan's nodes (the spare among them) to every node of the
    old and new plans that a stage may fetch from, before any LoadStage of the epoch."""
    tracker, nodes, clock = make_tracker(lease=10.0)
    join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=20, stages=2, checkpoint_every=5))
    tracker.tick()
    before = PlanView(tracker.jobs.get(job).plan)
    assert not nodes.assigns  # a first deploy moves no state
    report(tracker, job, StageKey(0, 1), R.STATUS_STEP, step=5, loss=1.0, samples=8,
           seconds=0.1)
    ack_checkpoint(tracker, job, 5)
    lose(tracker, clock, before[StageKey(0, 0)].node_id)
    nodes.loads.clear()
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING", info.reason
    after = PlanView(info.plan)
    lost = before[StageKey(0, 0)].address  # a lost holder is not asked
    holders = (before.addresses() | after.addresses()) - {lost}
    assert {address for address, _, _ in nodes.assigns} == holders
    for _, request, loads_before in nodes.assigns:
        assert loads_before == 0
        assert (request.job_id, request.epoch, request.owner) == (
            job, 1, tracker.store.spec(job).owner)
        assert sorted(request.node_names) == sorted(a.node_name for a in info.plan.stages)
    assert before[StageKey(0, 0)].node_name not in nodes.assigns[0][1].node_names


def test_a_checkpoint_is_complete_only_once_every_stage_acknowledged_it():
    tracker, _, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=20, stages=2, checkpoint_every=5))
    tracker.tick()
    report(tracker, job, StageKey(0, 0), R.STATUS_CHECKPOINT, step=5)
    assert tracker.jobs.get(job).checkpoint_step == 0
    report(tracker, job, StageKey(0, 1), R.STATUS_CHECKPOINT, step=5)
    assert tracker.jobs.get(job).checkpoint_step == 5
    assert any(e.checkpoint_step == 5 for e in tracker.store.events(job, 0))


def test_the_checkpoint_interval_defaults_to_about_30_s_of_predicted_steps():
    tracker, _, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=10**6, stages=2))
    tracker.tick()
    config = tracker.store.spec(job).config
    predicted = tracker.jobs.get(job).plan.predicted_step_seconds
    assert config.checkpoint_every == int(30.0 / predicted)


def test_a_node_that_leaves_makes_the_job_recover_at_once():
    tracker, _, _ = make_tracker()
    join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    leaving = sorted(PlanView(tracker.jobs.get(job).plan).node_ids())[-1]
    name = next(n.name for n in tracker.store.nodes() if n.node_id == leaving)
    assert tracker.registry.leave(leaving)
    assert tracker.jobs.get(job).reason == \
        f"node(s) {name} left the swarm; rewinding to checkpoint step 0"
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    assert leaving not in PlanView(tracker.jobs.get(job).plan).node_ids()


def test_with_no_spare_a_survivor_takes_the_lost_stage_and_too_little_memory_fails():
    tracker, _, clock = make_tracker()
    ids = join(tracker, 2)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    lose(tracker, clock, ids[1])
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING"
    assert PlanView(info.plan).node_ids() == {ids[0]}  # one node runs both stages
    # a node with too little memory left for the lost stage: FAILED with the figures
    tracker, _, clock = make_tracker()
    small = [tracker.register(registration(f"n{i}", 7100 + i, memory=70_000)) for i in range(2)]
    tracker.measure_links()
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING", tracker.jobs.get(job).reason
    lose(tracker, clock, small[1])
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "FAILED"
    assert "cannot recover" in info.reason and "MiB" in info.reason, info.reason


def test_a_second_loss_during_recovery_restarts_it_in_a_new_epoch():
    tracker, nodes, clock = make_tracker()
    ids = join(tracker, 4)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    used = sorted(PlanView(tracker.jobs.get(job).plan).node_ids())
    lose(tracker, clock, used[0])
    spares = sorted(set(ids) - set(used))
    # the replacement dies before it is loaded: the attempt waits for its loss
    for n in tracker.store.nodes():
        if n.node_id in spares:
            nodes.dead.add(n.address)
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RECOVERING"
    for s in spares:
        lose(tracker, clock, s)
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RECOVERING" and info.epoch == 2
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING" and PlanView(info.plan).node_ids() == {used[1]}
    assert info.plan.epoch == 2


def test_when_no_snapshot_of_the_checkpoint_survives_the_job_rewinds_further():
    tracker, nodes, clock = make_tracker()
    join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=30, stages=2, checkpoint_every=5))
    tracker.tick()
    ack_checkpoint(tracker, job, 5)
    ack_checkpoint(tracker, job, 10)
    used = sorted(PlanView(tracker.jobs.get(job).plan).node_ids())
    nodes.lost_snapshots.add(10)  # the node and its buddy were lost together, say
    lose(tracker, clock, used[0])
    tracker.tick()  # step 10 fails everywhere: rewind to 5
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RECOVERING" and info.resume_step == 5
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING" and info.step == 5


def test_a_peer_reported_unreachable_is_pinged_and_declared_lost_within_the_lease():
    tracker, nodes, clock = make_tracker(lease=60.0)
    join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    view = PlanView(tracker.jobs.get(job).plan)
    victim = view[StageKey(0, 1)]
    # a failed send to a live peer: the ping answers, the stage's failure fails the job
    report(tracker, job, StageKey(0, 0), R.STATUS_SUSPECT, peer=victim.address)
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    nodes.dead.add(victim.address)  # killed: refuses connections
    report(tracker, job, StageKey(0, 0), R.STATUS_FAILED, peer=victim.address,
           error="StageError: sending to it failed")
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RECOVERING", info.reason
    assert victim.node_name in info.reason and "Ping" in info.reason
    assert victim.node_id not in {n.node_id for n in tracker.store.nodes()}


def test_reconcile_drops_stale_epochs_moved_stages_and_ended_jobs_after_retention():
    tracker, _, clock = make_tracker()
    ids = join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    view = PlanView(tracker.jobs.get(job).plan)
    holder = view[StageKey(0, 0)].node_id
    ref = tracker_pb2.StageRef(job_id=job, replica=0, stage=0, epoch=0)
    assert tracker.retention.reconcile(holder, [ref]) == ([], [])
    other = next(i for i in ids if i != holder)
    assert tracker.retention.reconcile(other, [ref]) == ([ref], [])  # not planned there
    stale = tracker_pb2.StageRef(job_id=job, replica=0, stage=0, epoch=-5)
    assert tracker.retention.reconcile(holder, [stale]) == ([stale], [])
    gone = tracker_pb2.StageRef(job_id="nosuchjob", replica=0, stage=0, epoch=0)
    assert tracker.retention.reconcile(holder, [gone]) == ([], ["nosuchjob"])
    report(tracker, job, StageKey(0, 0), R.STATUS_FAILED, error="boom")
    assert tracker.retention.reconcile(holder, [ref]) == ([], [])  # kept for state_dict()
    clock.advance(tracker.retention.seconds + 1)
    assert tracker.retention.reconcile(holder, [ref]) == ([], [job])


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
        tracker.progress.report(R(job_id="nope", status=R.STATUS_DONE))
    with pytest.raises(errors.PermissionDenied, match="does not run stage 1 "):
        tracker.progress.report(R(job_id=job, replica=0, stage=1, node_id=node,
                              status=R.STATUS_DONE))
    with pytest.raises(errors.FailedPrecondition, match="report of step 4 refused"):
        tracker.progress.report(R(job_id=job, stage=0, node_id=node, status=R.STATUS_STEP, step=4))
    with pytest.raises(errors.InvalidArgument, match="unknown report status"):
        tracker.progress.report(R(job_id=job, stage=0, node_id=node, status=9))
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
    with pytest.raises(errors.ResourceExhausted, match=r"needs about [\d.]+ KiB .* have 1\.0 KiB"):
        tracker.jobs.submit(submission())
    assert tracker.store.jobs_in(S.JOB_STATE_PENDING) == []


def test_a_node_lost_while_the_job_deploys_makes_it_recover_not_fail():
    tracker, nodes, _ = make_tracker()
    ids = join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    gone = []

    def load_and_lose(address, request, load=nodes.load_stage):
        if not gone:  # the first LoadStage: another node of the plan leaves meanwhile
            info = tracker.jobs.get(request.job_id)
            other = next(a for a in info.plan.stages if a.address != address)
            gone.append(other.node_id)
            tracker.registry.leave(other.node_id)
        load(address, request)

    nodes.load_stage = load_and_lose
    tracker.tick()  # plans, deploys (a node leaves mid-deploy), resumes
    info = tracker.jobs.get(job)
    assert state_name(info.state) in ("RECOVERING", "RUNNING"), info.reason
    nodes.load_stage = nodes.__class__.load_stage.__get__(nodes)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING", info.reason
    assert gone[0] not in PlanView(info.plan).node_ids() and info.epoch == 1
    assert "left the swarm" in [e.reason for e in tracker.store.events(job, 0)
                                if e.state == tracker_pb2.JOB_STATE_RECOVERING][0]
    assert set(ids) - {gone[0]} >= PlanView(info.plan).node_ids()
