"""Drains, hand-over cuts and migrations decided by the tracker, in-process with fakes."""
from __future__ import annotations

import pytest

from fedpipe.observe.views import recovery_what
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import PlanView, StageKey, state_name
from fedpipe.tracker.migration import move_seconds
from fedpipe.planner.protoio import cluster_view, model_profile, train_config
from fedpipe.spec import JobSpec
from tracker_fakes import join, make_tracker, registration, submission

pytestmark = pytest.mark.timeout(60)
R = tracker_pb2.StageReport


def report(tracker, job_id, key: StageKey, status, **kw):
    info = tracker.jobs.get(job_id)
    node = PlanView(info.plan)[key].node_id
    tracker.progress.report(R(job_id=job_id, replica=key.replica, stage=key.stage, node_id=node,
                          status=status, epoch=info.epoch, **kw))


def running(n_nodes=3, **spec):
    tracker, nodes, clock = make_tracker()
    tracker.rebalancer.background = False
    ids = join(tracker, n_nodes)
    job = tracker.jobs.submit(submission(steps=20, stages=2, checkpoint_every=10, **spec))
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    return tracker, nodes, clock, ids, job


def priced(tracker, job):
    """The job's model profile and training config, as the tracker's planner prices them."""
    request = tracker.store.spec(job)
    return model_profile(request.profile), train_config(JobSpec.from_proto(request.config))


def steps(tracker, job, upto, start=1, **kw):
    for s in range(start, upto + 1):
        for key in PlanView(tracker.jobs.get(job).plan).stages:
            report(tracker, job, key, R.STATUS_STEP, step=s, samples=8, seconds=0.1, **kw)


def test_a_draining_node_takes_no_new_work_and_ListNodes_says_it_drains():
    tracker, nodes, clock = make_tracker()
    ids = join(tracker, 3)
    node, jobs = tracker.rebalancer.drain("node2")
    assert node.node_id == ids[2] and node.draining and jobs == []
    flags = {n.name: n.draining for n in tracker.drains.annotate(tracker.store.nodes())}
    assert flags == {"node0": False, "node1": False, "node2": True}
    job = tracker.jobs.submit(submission(steps=5, stages=2))
    tracker.tick()
    assert ids[2] not in PlanView(tracker.jobs.get(job).plan).node_ids()
    assert tracker.rebalancer.drained(ids[2])  # nothing needs it: it may exit
    with pytest.raises(Exception, match="no live node 'nodeX'"):
        tracker.rebalancer.drain("nodeX")


def test_a_drain_cuts_the_job_at_the_next_step_boundary_and_hands_over_from_there():
    tracker, nodes, clock, ids, job = running()
    steps(tracker, job, 3)
    plan = tracker.jobs.get(job).plan
    victim = PlanView(plan)[StageKey(0, 1)]
    tracker.rebalancer.drain(victim.node_name)
    # every node of the plan is asked to hold its stages after step 4
    cuts = {(a, r.step) for a, r in nodes.holds}
    assert cuts == {(address, 4) for address in PlanView(plan).addresses()}
    assert not tracker.rebalancer.drained(victim.node_id)
    steps(tracker, job, 4, start=4)
    for key in PlanView(plan).stages:
        report(tracker, job, key, R.STATUS_CHECKPOINT, step=4)
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RECOVERING" and info.resume_step == 4
    assert "drain of " + victim.node_name in info.reason
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING", info.reason
    assert victim.node_id not in PlanView(info.plan).node_ids()
    assert info.reason.startswith(f"handed over from draining {victim.node_name}: resumed at "
                                  f"checkpoint step 4 (0 steps to recompute)")
    (rec,) = info.recoveries
    assert (rec.cause, rec.checkpoint_step, rec.steps_recomputed) == ("drain", 4, 0)
    to = PlanView(info.plan)[StageKey(0, 1)].node_name
    assert (rec.lost, rec.moved_from, rec.moved_to) == (victim.node_name, victim.node_name, to)
    assert recovery_what(rec) == f"drained {victim.node_name}; moved {victim.node_name} -> {to}"
    # the new epoch's stages resume at the cut; the survivor kept its stage
    loads = [r for r in nodes.loads if r.plan.epoch == info.epoch]
    assert {r.resume_step for r in loads} == {4} and len(loads) == 2
    assert PlanView(info.plan)[StageKey(0, 0)].node_id == PlanView(plan)[StageKey(0, 0)].node_id
    assert tracker.rebalancer.drained(victim.node_id)


def test_a_cut_some_stage_has_passed_moves_later():
    tracker, nodes, clock, ids, job = running()
    steps(tracker, job, 3)
    plan = tracker.jobs.get(job).plan
    first = PlanView(plan)[StageKey(0, 0)].address
    nodes.done[first] = 6  # the tracker's view lags: a stage is already past steps 4 and 5
    tracker.rebalancer.drain(PlanView(plan)[StageKey(0, 1)].node_name)
    asked = [r.step for a, r in nodes.holds if a == first]
    assert asked == [4, 7] and tracker.rebalancer.pending[job].cut == 7


def test_a_drain_whose_cut_never_completes_falls_back_to_a_rewind():
    tracker, nodes, clock, ids, job = running()
    steps(tracker, job, 3)
    victim = PlanView(tracker.jobs.get(job).plan)[StageKey(0, 1)]
    tracker.rebalancer.drain(victim.node_name)
    for _ in range(13):  # past the hand-over's deadline, the nodes heartbeating
        clock.advance(5)
        for n in ids:
            tracker.registry.heartbeat(n)
    tracker.tick()
    tracker.tick()
    info = tracker.jobs.get(job)
    assert [r.step for _, r in nodes.holds][-2:] == [0, 0]  # the holds are lifted
    assert victim.node_id not in PlanView(info.plan).node_ids()
    assert info.recoveries[-1].cause == "loss"


def test_a_migration_moves_only_the_state_of_the_stages_that_change_nodes():
    tracker, nodes, clock, ids, job = running(n_layers=6)
    profile, config = priced(tracker, job)
    before = tracker.jobs.get(job).plan
    after = node_pb2.Plan()
    after.CopyFrom(before)
    spare = next(n for n in tracker.store.nodes() if n.node_id not in PlanView(before).node_ids())
    moved = PlanView(after)[StageKey(0, 1)]
    moved.node_id, moved.address = spare.node_id, spare.address
    cluster = cluster_view(tracker.store.nodes(), tracker.store.links())
    seconds, nbytes = move_seconds(before, after, cluster, profile, config)
    layers = range(moved.layer_start, moved.layer_end)
    assert nbytes == sum(profile.layers[i].parameter_bytes for i in layers) * config.state_factor
    assert seconds > 0
    assert move_seconds(before, before, cluster, profile, config) == (0.0, 0)


def test_a_re_split_counts_only_the_layers_whose_node_changes():
    tracker, nodes, clock, ids, job = running(n_layers=6)
    profile, config = priced(tracker, job)
    before = tracker.jobs.get(job).plan
    old = PlanView(before)
    first, second = old[StageKey(0, 0)], old[StageKey(0, 1)]
    spare = next(n for n in tracker.store.nodes() if n.node_id not in old.node_ids())
    # 3 stages: the first keeps its node and a layer fewer, the second its node and the
    # layer the first gave up, less its own last layer, which goes to the spare
    cut1, cut2 = first.layer_end - 1, second.layer_end - 1
    after = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(stage=0, node_id=first.node_id, layer_start=0, layer_end=cut1),
        node_pb2.StageAssignment(stage=1, node_id=second.node_id, layer_start=cut1,
                                 layer_end=cut2),
        node_pb2.StageAssignment(stage=2, node_id=spare.node_id, layer_start=cut2,
                                 layer_end=second.layer_end)], replicas=before.replicas)
    cluster = cluster_view(tracker.store.nodes(), tracker.store.links())
    _, nbytes = move_seconds(before, after, cluster, profile, config)
    assert nbytes == (profile.layers[cut1].parameter_bytes
                      + profile.layers[cut2].parameter_bytes) * config.state_factor


def slow_stage_times(tracker, job, key, compute):
    for s in range(1, 6):
        for k in PlanView(tracker.jobs.get(job).plan).stages:
            report(tracker, job, k, R.STATUS_STEP, step=s, samples=8, seconds=compute,
                   compute_seconds=compute if k == key else 1e-6)


def test_a_node_slower_than_it_said_is_remeasured_and_its_stage_moves_to_a_spare():
    tracker, nodes, clock, ids, job = running()
    plan = tracker.jobs.get(job).plan
    slow = PlanView(plan)[StageKey(0, 1)]
    slow_stage_times(tracker, job, StageKey(0, 1), compute=5.0)  # it advertised 1 TFLOP/s
    assert tracker.rebalancer.consider(job)
    assert tracker.rebalancer.speed[slow.node_id] < 1e12 / 1.5
    h = tracker.rebalancer.pending[job]
    assert h.cause == "rebalance" and h.cut == 6
    # the slow node leaves the plan: its stage moves to the spare, or the planner's
    # re-split over the fast nodes predicts a shorter step still
    assert slow.node_id not in PlanView(h.target).node_ids()
    for key in PlanView(plan).stages:
        report(tracker, job, key, R.STATUS_CHECKPOINT, step=6)
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING"
    assert info.plan.stages == h.target.stages or \
        PlanView(info.plan)[StageKey(0, 1)].node_id == PlanView(h.target)[StageKey(0, 1)].node_id
    (rec,) = info.recoveries
    assert (rec.cause, rec.steps_recomputed) == ("rebalance", 0) and rec.bytes_moved > 0
    # the record says what happened: nothing was lost, the slow node's stage moved
    # (the target may be a stage moved to the spare or a re-split over the others)
    assert rec.lost == "" and slow.node_name in rec.moved_from.split(", ")
    assert slow.node_name not in rec.moved_to.split(", ")
    assert recovery_what(rec) == f"moved {rec.moved_from} -> {rec.moved_to}"
    assert info.reason.startswith(f"migrated from {rec.moved_from} to {rec.moved_to}: ")


def test_rebalance_never_keeps_the_plan_and_a_small_gain_does_not_move():
    tracker, nodes, clock, ids, job = running(rebalance="never")
    slow_stage_times(tracker, job, StageKey(0, 1), compute=5.0)
    assert not tracker.rebalancer.consider(job) and not nodes.holds
    # equal nodes and links: no re-assignment predicts a gain
    tracker, nodes, clock, ids, job = running()
    steps(tracker, job, 5)
    assert not tracker.rebalancer.consider(job) and not nodes.holds


def test_with_no_spare_node_the_boundary_moves_layers_off_a_slow_node():
    tracker, nodes, clock, ids, job = running(n_nodes=2)
    plan = tracker.jobs.get(job).plan
    slow = PlanView(plan)[StageKey(0, 1)]
    slow_stage_times(tracker, job, StageKey(0, 1), compute=5.0)
    assert tracker.rebalancer.consider(job)  # a re-split: the same two nodes, 2 stages asked
    target = PlanView(tracker.rebalancer.pending[job].target)
    assert target.node_ids() == PlanView(plan).node_ids() and len(target.stages) == 2
    mine = next(a for a in target.stages.values() if a.node_id == slow.node_id)
    assert mine.layer_end - mine.layer_start < slow.layer_end - slow.layer_start
    # the hand-over names the nodes whose layers change (both: was empty, "rebalance of :")
    assert tracker.rebalancer.pending[job].names == {a.node_name for a in plan.stages}


def test_a_node_that_joins_is_considered_once_its_links_are_measured():
    for measured in (False, True):
        tracker, nodes, clock, ids, job = running(n_nodes=2)
        plan = tracker.jobs.get(job).plan
        slow_stage_times(tracker, job, StageKey(0, 1), compute=5.0)
        tracker.register(registration("node9", 7009))  # its links are not measured yet
        if measured:
            tracker.measure_links()
        assert tracker.rebalancer.consider(job)
        names = {a.node_name for a in tracker.rebalancer.pending[job].target.stages}
        assert ("node9" in names) == measured, names
        assert PlanView(plan).node_ids() == PlanView(tracker.jobs.get(job).plan).node_ids()
