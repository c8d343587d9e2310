"""The calibrated cost model, in process: the fit from fake reports, the host's shared
cores, the tracker's use of it for plans and replans, and what status shows of it."""
from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from fedpipe.observe.status import job_dict, job_renderable
from fedpipe.observe.views import plan_from_message
from fedpipe.planner import calibrate
from fedpipe.planner.costs import host_factors
from fedpipe.planner.protoio import cluster_view, model_profile, predicted_of, train_config
from fedpipe.planner.simulate import simulate, stage_costs
from fedpipe.planner.types import (ClusterView, LayerProfile, ModelProfile, NodeSpec, Overheads,
                                   Plan, ReplicaGroup, StagePlan, TrainConfig)
from fedpipe.proto import tracker_pb2
from fedpipe.spec import JobSpec, PlanView, StageKey, state_name
from fedpipe.tracker.calibration import Calibration
from fedpipe.tracker.stagetimes import STAGE_TIME_WINDOW
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)
R = tracker_pb2.StageReport
GF = 1e9


def two_stage(flops=(10 * GF, 10 * GF), host="", host_cores=0):
    profile = ModelProfile([LayerProfile(f"l{i}", 2e6, 4096, 1 << 20) for i in range(4)],
                           input_bytes=4096)
    nodes = [NodeSpec(f"n{i}", f, 2**33, f"node{i}", host=host, host_cores=host_cores)
             for i, f in enumerate(flops)]
    cluster = ClusterView(nodes, overheads=Overheads(1e-4, 5e-5, 2.5e-10))
    plan = Plan([ReplicaGroup([StagePlan("n0", 0, 2), StagePlan("n1", 2, 4)])], 0.0)
    return plan, cluster, profile, TrainConfig(batch_size=32, microbatches=8, schedule="1f1b")


def test_a_node_whose_stages_ran_three_times_slower_gets_correction_three():
    samples = [calibrate.StageSample("a", measured=3 * 0.02 + 0.001, flop=0.02, fixed=0.001),
               calibrate.StageSample("a", measured=3 * 0.06 + 0.002, flop=0.06, fixed=0.002),
               calibrate.StageSample("b", measured=0.5 * 0.04, flop=0.04, fixed=0.0)]
    assert calibrate.fit_corrections(samples) == pytest.approx({"a": 3.0, "b": 0.5})


def test_the_fit_is_a_ratio_of_sums_clamped_and_skips_nodes_without_flop():
    # a near-empty stage (its time all fixed cost) cannot swing the node's correction
    got = calibrate.fit_corrections([
        calibrate.StageSample("a", measured=0.2, flop=0.1, fixed=0.0),
        calibrate.StageSample("a", measured=0.01, flop=1e-6, fixed=0.0),
        calibrate.StageSample("slow", measured=1e3, flop=1e-3, fixed=0.0),
        calibrate.StageSample("fast", measured=0.0, flop=1.0, fixed=0.5),
        calibrate.StageSample("idle", measured=0.3, flop=0.0, fixed=0.1)])
    assert got["a"] == pytest.approx(0.21 / (0.1 + 1e-6))
    assert got["slow"] == calibrate.MAX_CORRECTION and got["fast"] == calibrate.MIN_CORRECTION
    assert "idle" not in got


def test_nodes_of_one_machine_and_device_share_one_correction():
    """Two nodes of one host, one given a small stage whose time is mostly fixed costs:
    fitted apart they would differ (3.5 against 2.1) and the next plan would shrink the
    small stage further; pooled they get one. Another device or a machine of its own
    is fitted apart."""
    box = "box/cpu/1"
    got = calibrate.fit_corrections([
        calibrate.StageSample("small", measured=0.007, flop=0.002, fixed=0.0, hardware=box),
        calibrate.StageSample("big", measured=0.021, flop=0.010, fixed=0.0, hardware=box),
        calibrate.StageSample("gpu", measured=0.002, flop=0.010, fixed=0.0,
                              hardware="box/cuda:0/1"),
        calibrate.StageSample("alone", measured=0.03, flop=0.010, fixed=0.0)])
    assert got == pytest.approx({"small": 28 / 12, "big": 28 / 12, "gpu": 0.2, "alone": 3.0})
    assert calibrate.hardware(NodeSpec("n", GF, 1, host="box")) == box
    assert calibrate.hardware(NodeSpec("n", GF, 1)) == ""
    # the tracker's samples carry it from the probed cluster
    plan, probed, profile, config = two_stage(host="box", host_cores=2)
    measured = {StageKey(0, 0): 0.01, StageKey(0, 1): 0.05}
    samples = calibrate.stage_samples(plan, probed, profile, config, measured)
    assert {s.hardware for s in samples} == {box}
    assert len(set(calibrate.fit_corrections(samples).values())) == 1


def test_nodes_sharing_a_host_beyond_its_cores_compute_that_much_slower():
    nodes = [NodeSpec(f"n{i}", GF, 1, host="box", threads=1, host_cores=2) for i in range(4)]
    nodes += [NodeSpec("big", GF, 1, host="big", threads=8, host_cores=4),
              NodeSpec("alone", GF, 1), NodeSpec("unknown", GF, 1, host="box", host_cores=0)]
    f = host_factors(nodes)
    assert [f[f"n{i}"] for i in range(4)] == [2.0] * 4
    half = host_factors(nodes, busy={f"n{i}": 0.75 for i in range(4)})
    assert half["n0"] == 1.5  # 4 threads busy 3/4 of the time on 2 cores
    assert (f["big"], f["alone"], f["unknown"]) == (2.0, 1.0, 1.0)
    assert host_factors(nodes[:2])["n0"] == 1.0  # two 1-thread nodes fit 2 cores
    # the simulator prices it: the same plan on one 1-core host takes longer
    plan, cluster, profile, config = two_stage()
    shared = two_stage(host="box", host_cores=1)[1]
    assert simulate(plan, shared, profile, config).step_seconds > \
        1.5 * simulate(plan, cluster, profile, config).step_seconds


def test_fake_reports_in_corrections_and_message_cost_out():
    """Stages report what a cluster 4x and 2x slower than probed, with 1 ms per message,
    would take; the fit recovers both corrections and the message cost, and the
    calibrated prediction equals the 'measured' step."""
    plan, probed, profile, config = two_stage()
    truth = dataclasses.replace(calibrate.corrected(probed, {"n0": 4.0, "n1": 2.0}),
                                overheads=dataclasses.replace(probed.overheads, message=1e-3))
    measured = {k: c.compute for k, c in stage_costs(plan, truth, profile, config).items()}
    step = simulate(plan, truth, profile, config).step_seconds
    cal = Calibration(base=probed.overheads)
    assert not cal.calibrated
    cal.planned("job", 0, plan, probed, profile, config)
    assert cal.observe("job", 0, measured, step)
    assert cal.corrections() == pytest.approx({"n0": 4.0, "n1": 2.0})
    assert cal.overheads().message == pytest.approx(1e-3, rel=1e-3)
    assert cal.calibrated
    assert cal.predict(plan, probed, profile, config).predicted_step_seconds == \
        pytest.approx(step, rel=1e-3)
    assert not cal.observe("another job", 0, measured, step)  # a plan it never saw


def test_a_correction_carries_over_to_a_plan_with_more_nodes_on_the_host():
    """Measured on 2 nodes of a 2-core host, predicted for 4 nodes on it: the host's
    slowdown is divided out of the correction, then priced again for the new plan."""
    plan, probed, profile, config = two_stage(host="box", host_cores=2)
    truth = calibrate.corrected(probed, {"n0": 3.0, "n1": 3.0})
    measured = {k: c.compute for k, c in stage_costs(plan, truth, profile, config).items()}
    cal = Calibration(base=probed.overheads)
    cal.planned("job", 0, plan, probed, profile, config)
    cal.observe("job", 0, measured, simulate(plan, truth, profile, config).step_seconds)
    assert cal.corrections() == pytest.approx({"n0": 3.0, "n1": 3.0})
    wide = dataclasses.replace(probed, nodes=probed.nodes + [
        NodeSpec(f"n{i}", 10 * GF, 2**33, host="box", host_cores=2) for i in (2, 3)])
    plan4 = Plan([ReplicaGroup([StagePlan(f"n{i}", i, i + 1) for i in range(4)])], 0.0)
    costs = stage_costs(plan4, cal.cluster(wide), profile, config)
    assert cal.covers(plan4, wide)  # n2 and n3 share the host of measured nodes
    # n0 runs layer 0 at 3x its probed speed's time, twice again for 4 threads on 2 cores
    flop0 = stage_costs(Plan([ReplicaGroup([StagePlan("n0", 0, 1)])], 0.0),
                        probed, profile, config)[StageKey(0, 0)].flop
    always = stage_costs(plan4, cal.cluster(wide), profile, config,
                         busy={f"n{i}": 1.0 for i in range(4)})
    assert always[StageKey(0, 0)].flop == pytest.approx(flop0 * 3.0 * 2.0)
    # as simulated, the 4 stages idle in their bubbles: they share the cores less
    assert flop0 * 3.0 < costs[StageKey(0, 0)].flop < flop0 * 3.0 * 2.0
    elsewhere = dataclasses.replace(wide, nodes=wide.nodes[:2] + [
        NodeSpec(f"n{i}", 10 * GF, 2**33, host="other", host_cores=2) for i in (2, 3)])
    assert not cal.covers(plan4, elsewhere)  # unmeasured nodes on an unmeasured host


def feed_steps(tracker, job, steps, compute, wait=0.002, send=0.001, epoch=0):
    """Every stage reports each step with the same split (the last stage's counts it)."""
    info = tracker.jobs.get(job)
    view = PlanView(info.plan)
    for step in steps:
        for key in sorted(view.stages):
            tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                                  node_id=view[key].node_id, status=R.STATUS_STEP, step=step,
                                  loss=1.0, samples=8, seconds=compute[key] + wait + send,
                                  compute_seconds=compute[key], wait_seconds=wait,
                                  send_seconds=send, epoch=epoch))


def heavy(**kw) -> tracker_pb2.SubmitJobRequest:
    """A submission whose layers take milliseconds on the fake 1 TFLOP/s nodes."""
    req = submission(**kw)
    for lp in req.profile.layers:
        lp.flops = 1e9
    return req


def compute_of(plan) -> dict[StageKey, float]:
    """Each stage's predicted compute seconds per step, as the plan carries it."""
    return {k: compute for k, (compute, _) in predicted_of(plan).items()}


def test_the_tracker_fits_from_reports_and_a_replan_uses_the_calibrated_prediction():
    tracker, nodes, clock = make_tracker(lease=10.0)
    ids = join(tracker, 3)
    job = tracker.jobs.submit(heavy(steps=40, stages=2, checkpoint_every=5))
    tracker.tick()
    info = tracker.jobs.get(job)
    assert not info.plan.calibrated
    first = info.plan.predicted_step_seconds
    predicted = compute_of(info.plan)  # each stage's, as the plan carries it
    assert set(predicted) == {StageKey(0, 0), StageKey(0, 1)}
    # the stages take 5x the predicted compute: once a window past warm-up is in, the
    # tracker has fitted a correction for both nodes, and predicts what they measured
    slow = {k: 5 * v for k, v in predicted.items()}
    feed_steps(tracker, job, range(1, 2 * STAGE_TIME_WINDOW), slow)
    assert tracker.calibration.corrections() == {}  # the warm-up window is not fitted
    feed_steps(tracker, job, [2 * STAGE_TIME_WINDOW], slow)
    used = PlanView(info.plan).node_ids()
    corr = tracker.calibration.corrections()
    assert set(corr) == used and all(5.0 < c < 6.0 for c in corr.values()), corr
    request = tracker.store.spec(job)
    profile, config = model_profile(request.profile), train_config(
        JobSpec.from_proto(request.config))
    probed = cluster_view(tracker.store.nodes(), tracker.store.links())
    again = stage_costs(plan_from_message(info.plan), tracker.calibration.cluster(probed),
                        profile, config)
    assert {k: c.compute for k, c in again.items()} == pytest.approx(slow)
    # GetJob carries each stage's measured split; its plan, the predicted split
    timed = tracker.progress.info(job)
    assert {(t.replica, t.stage): t.compute_seconds for t in timed.stage_times} == \
        {tuple(k): slow[k] for k in slow}
    assert compute_of(timed.plan) == predicted
    # a node is lost; the replan moves its stage to the spare and predicts the step
    # with the calibrated model, not the first plan's figure
    for key in PlanView(info.plan).stages:
        tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                              node_id=PlanView(info.plan)[key].node_id,
                              status=R.STATUS_CHECKPOINT, step=10))
    lost = sorted(used)[0]
    clock.advance(11)
    for n in tracker.store.nodes():
        if n.node_id != lost:
            tracker.registry.heartbeat(n.node_id)
    tracker.registry.expire()
    tracker.tick()
    after = tracker.jobs.get(job)
    assert state_name(after.state) == "RUNNING", after.reason
    # the spare never ran: its correction is its peers' median, so the plan is not yet
    # called calibrated, but it is priced on the calibrated model
    assert not after.plan.calibrated and after.plan.epoch == 1
    want = tracker.calibration.predict(
        plan_from_message(after.plan), cluster_view(tracker.store.nodes(), tracker.store.links()),
        profile, config)
    assert after.plan.predicted_step_seconds == pytest.approx(want.predicted_step_seconds)
    # and each stage's prediction on the replanned plan is the calibrated model's
    priced = stage_costs(plan_from_message(after.plan), tracker.calibration.cluster(
        cluster_view(tracker.store.nodes(), tracker.store.links())), profile, config)
    got = predicted_of(after.plan)
    assert set(got) == set(priced)
    assert [x for k in sorted(got) for x in got[k]] == pytest.approx(
        [x for k in sorted(priced) for x in (priced[k].compute, priced[k].send)])
    assert after.plan.predicted_step_seconds > 2 * first
    assert set(ids) - used  # there was a spare to move to


def test_a_later_job_on_the_same_nodes_is_planned_on_the_calibrated_model():
    tracker, nodes, clock = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(heavy(steps=20, stages=2))
    tracker.tick()
    first = tracker.jobs.get(job).plan
    predicted = compute_of(tracker.jobs.get(job).plan)
    feed_steps(tracker, job, range(1, 2 * STAGE_TIME_WINDOW + 1),
               {k: 3 * v for k, v in predicted.items()})
    second = tracker.jobs.submit(heavy(steps=20, stages=2))
    tracker.tick()
    plan = tracker.jobs.get(second).plan
    assert plan.calibrated and not first.calibrated
    assert plan.predicted_step_seconds > 2 * first.predicted_step_seconds


def test_status_shows_each_stage_predicted_against_measured_and_the_step_error():
    tracker, nodes, clock = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(steps=20, stages=2))
    tracker.tick()
    predicted = compute_of(tracker.jobs.get(job).plan)
    measured = {k: 1.5 * v for k, v in predicted.items()}
    for step in range(1, 8):
        clock.advance(0.25)
        feed_steps(tracker, job, [step], measured)

    class Source:  # what GetJob serves, as fedpipe status reads it over gRPC
        def job(self, job_id):
            return tracker.progress.info(job_id)

        def events(self, job_id, after_seq):
            return tracker.store.events(job_id, after_seq)

    view = job_dict(Source(), job)
    stages = [st for g in view["plan"]["groups"] for st in g]
    assert [st["predicted_compute"] for st in stages] == \
        pytest.approx([predicted[StageKey(0, 0)], predicted[StageKey(0, 1)]])
    assert [st["measured"]["compute"] for st in stages] == \
        pytest.approx([measured[StageKey(0, 0)], measured[StageKey(0, 1)]])
    assert view["step_seconds"]["measured"] == pytest.approx(0.25)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(job_renderable(view))
    text = out.getvalue()
    assert "predicted compute" in text and "+50%" in text  # each stage's error
    err = 0.25 / view["step_seconds"]["predicted"] - 1
    assert f"({err * 100:+.0f}%)" in text
