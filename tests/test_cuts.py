"""Pinned stage boundaries (``Placement(stages=..., cuts=...)``, :mod:`fedpipe.spec.cuts`),
in-process: the rule and its errors at each place it is checked (the knob group, the job
spec with the layer count, the tracker's submit, the planner), and every plan the planner
and the tracker make for a job with cuts holding exactly their layer ranges."""
from __future__ import annotations

import pytest

from fedpipe.planner import (ClusterView, NodeSpec, PlanError, SearchOptions, TrainConfig,
                             jsonio, make_plan)
from fedpipe.planner.exhaustive import exhaustive_plan
from fedpipe.planner.protoio import cluster_view, model_profile, plan_message, train_config
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import (JobSpec, JobSpecError, Knobs, Placement, PlanView, cuts_of,
                          cuts_problem, stage_ranges)
from fedpipe.tracker import errors
from fedpipe.tracker.migration import resplit
from fedpipe.tracker.planning import plan_job
from test_planner import TF, model
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(120)
FAST = SearchOptions(iterations=60, time_limit_s=10)


def ranges(plan) -> list[list[tuple[int, int]]]:
    """Each replica group's layer ranges, in stage order (a planner plan)."""
    return [[(s.layer_start, s.layer_end) for s in g.stages] for g in plan.groups]


def message_ranges(plan) -> list[list[tuple[int, int]]]:
    """Each replica group's layer ranges, in stage order (a plan message)."""
    view = PlanView(plan)
    return [[(a.layer_start, a.layer_end) for a in view.chain(r)] for r in view.replicas]


# --- the rule -------------------------------------------------------------------------

def test_cuts_are_the_child_index_each_stage_but_the_first_begins_at():
    assert stage_ranges((2, 3, 4), 6) == ((0, 2), (2, 3), (3, 4), (4, 6))
    assert cuts_of([(0, 2), (2, 3), (3, 4), (4, 6)]) == (2, 3, 4)
    assert stage_ranges((), 5) == ((0, 5),)
    assert cuts_problem((2, 3, 4), 4, 6) is None
    assert cuts_problem((), 0, 6) is None and cuts_problem((), 3) is None


@pytest.mark.parametrize("cuts, stages, n_layers, match", [
    ((2, 3), 4, 6, r"4 stages need 3 cut\(s\).*got 2: \(2, 3\)"),
    ((1, 2, 3, 4), 4, 6, r"4 stages need 3 cut\(s\).*got 4: \(1, 2, 3, 4\)"),
    ((2, 3, 4), 0, 6, r"pins 4 stages: pass stages=4"),
    ((3, 3, 4), 4, 6, r"strictly increase.*3 follows 3 in \(3, 3, 4\)"),
    ((2, 4, 3), 4, 6, r"3 follows 4 in \(2, 4, 3\)"),
    ((0, 3, 4), 4, 6, r"cut 0 leaves the first stage no layer"),
    ((2, 3, 6), 4, 6, r"cut 6 is out of range: the model has 6 layers .* 1\.\.5; got "
                      r"\(2, 3, 6\)"),
    ((2, 3.0, 4), 4, 6, r"each cut must be an int .* got float 3\.0"),
    ((True, 3, 4), 4, 6, r"got bool True"),
])
def test_bad_cuts_are_refused_naming_the_bad_value(cuts, stages, n_layers, match):
    assert cuts_problem(cuts, stages, n_layers) is not None
    with pytest.raises(JobSpecError, match=match) as err:
        JobSpec(steps=1, stages=stages, cuts=cuts, optimizer=b"o", loss_fn=b"l").validate(
            n_layers)
    assert err.value.field == "cuts" and str(err.value).startswith("cuts: ")


def test_the_knob_group_checks_the_cuts_before_the_model_is_known():
    knobs = Knobs.gather({"placement": Placement(stages=4, cuts=[2, 3, 4])}, {})
    assert knobs.placement.cuts == (2, 3, 4)  # a list is taken as a tuple
    spec = knobs.job_spec(steps=1, optimizer=b"o", loss_fn=b"l")
    assert spec.cuts == (2, 3, 4) and JobSpec.from_proto(spec.to_proto()) == spec
    with pytest.raises(JobSpecError, match=r"cuts: 3 stages need 2 cut\(s\)"):
        Knobs.gather({"placement": Placement(stages=3, cuts=(2, 3, 4))}, {})
    with pytest.raises(JobSpecError, match=r"cuts: \(2, 3, 4\) pins 4 stages"):
        Placement(cuts=(2, 3, 4)).validate()
    with pytest.raises(TypeError, match=r"cuts \(Placement.cuts\) must be a tuple of ints, "
                                        r"got int 3"):
        Placement(stages=2, cuts=3).validate()  # type: ignore[arg-type]
    # the upper bound needs the layer count: the client's JobSpec.validate(n_layers)
    Placement(stages=2, cuts=(99,)).validate()
    with pytest.raises(JobSpecError, match="cut 99 is out of range: the model has 5 layers"):
        Knobs.gather({"placement": Placement(stages=2, cuts=(99,))}, {}).job_spec(
            steps=1, optimizer=b"o", loss_fn=b"l").validate(5)


def test_the_tracker_refuses_bad_cuts_at_submit_naming_them():
    tracker, _, _ = make_tracker()
    bad = submission(stages=2, n_layers=4)
    bad.config.cuts.extend([4])
    with pytest.raises(errors.InvalidArgument, match=r"cuts: cut 4 is out of range: the model "
                                                     r"has 4 layers"):
        tracker.jobs.submit(bad)
    bad = submission(stages=3, n_layers=4)
    bad.config.cuts.extend([2])
    with pytest.raises(errors.InvalidArgument, match=r"cuts: 3 stages need 2 cut\(s\)"):
        tracker.jobs.submit(bad)


def test_the_planner_refuses_bad_cuts_naming_them():
    nodes = [NodeSpec(f"n{i}", TF, 10**12) for i in range(4)]
    with pytest.raises(PlanError, match=r"cuts: .*3 follows 5 in \(5, 3\)"):
        make_plan(ClusterView(nodes), model(8), TrainConfig(batch_size=8, stages=3,
                                                            cuts=(5, 3)))
    with pytest.raises(PlanError, match=r"cuts: cut 8 is out of range"):
        make_plan(ClusterView(nodes), model(8), TrainConfig(batch_size=8, stages=2, cuts=(8,)))


# --- the planner honours them ---------------------------------------------------------

def uneven_nodes() -> list[NodeSpec]:
    """Six nodes of speeds 1..6 TFLOP/s: a free split gives the fast ones more layers."""
    return [NodeSpec(f"n{i}", TF * (1 + i), 10**12) for i in range(6)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_group_of_the_plan_has_exactly_the_pinned_ranges(replicas):
    cfg = TrainConfig(batch_size=16, microbatches=8, stages=3, replicas=replicas)
    free = make_plan(ClusterView(uneven_nodes()), model(8), cfg, FAST)
    assert any(r != [(0, 1), (1, 7), (7, 8)] for r in ranges(free))  # not what it would pick
    pinned = TrainConfig(batch_size=16, microbatches=8, stages=3, replicas=replicas,
                         cuts=(1, 7))
    for plan in (make_plan(ClusterView(uneven_nodes()), model(8), pinned, FAST),
                 exhaustive_plan(ClusterView(uneven_nodes()), model(8), pinned)):
        assert ranges(plan) == [[(0, 1), (1, 7), (7, 8)]] * replicas
        # the nodes are still chosen: the long middle stage goes to a fast node
        middles = {g.stages[1].node_id for g in plan.groups}
        assert middles <= {"n3", "n4", "n5"}, middles


def test_with_pinned_cuts_that_fit_no_node_the_error_names_them():
    nodes = [NodeSpec(f"n{i}", TF, 40 * 10**6) for i in range(4)]
    with pytest.raises(PlanError, match=r"3 stages per group at the pinned cuts \(1, 7\)"):
        make_plan(ClusterView(nodes), model(8, params=10**6),
                  TrainConfig(batch_size=8, microbatches=2, stages=3, cuts=(1, 7)), FAST)


def test_a_config_with_cuts_survives_json():
    cfg = TrainConfig(batch_size=16, microbatches=4, stages=3, cuts=(2, 5))
    assert jsonio.config_from_json(jsonio.config_to_json(cfg)) == cfg


# --- the tracker's plans: the first, and a rebalance's re-split -------------------------

def test_the_tracker_plans_a_job_with_cuts_at_them():
    tracker, _, _ = make_tracker()
    join(tracker, 3)
    free = tracker.jobs.submit(submission(stages=2, n_layers=4))
    pinned = tracker.jobs.submit(submission(stages=2, n_layers=4, cuts=(3,)))
    tracker.tick()
    assert message_ranges(tracker.jobs.get(pinned).plan) == [[(0, 3), (3, 4)]]
    assert message_ranges(tracker.jobs.get(free).plan) != [[(0, 3), (3, 4)]]  # not by chance


def test_plan_job_and_a_rebalances_resplit_keep_the_cuts():
    """plan_job (the first plan, and the DiLoCo re-plan) and resplit (the re-split a
    rebalance weighs when a node joins) both plan through the job's spec."""
    request = submission(stages=2, n_layers=6, replicas=0, cuts=(5,))
    spec = JobSpec.from_proto(request.config).validate(6)
    assert train_config(spec).cuts == (5,)
    profile = model_profile(request.profile)
    infos = [tracker_pb2.NodeInfo(node_id=f"n{i}", name=f"node{i}",
                                  address=f"127.0.0.1:{7000 + i}",
                                  resources=node_pb2.Resources(flops=TF * (1 + i),
                                                               memory_bytes=2**33))
             for i in range(4)]
    cluster = cluster_view(infos, [])
    plan, _ = plan_job(cluster, profile, spec)
    assert ranges(plan) == [[(0, 5), (5, 6)]] * len(plan.groups)
    first = plan_message(plan, {n.node_id: n for n in infos})
    one = plan_job(cluster, profile, spec.with_(replicas=1))[0]
    split = resplit(plan_message(one, {n.node_id: n for n in infos}), spec, cluster, profile,
                    infos)
    assert split is not None and message_ranges(split) == [[(0, 5), (5, 6)]]
    assert message_ranges(first)[0] == [(0, 5), (5, 6)]
