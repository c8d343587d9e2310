"""The memory the plan keeps (issue 22, item 3): the planner's one memory model
(stage_memory_bytes) by optimizer, schedule, snapshots and codec buffers; nodes of one
host sharing its memory; a job that fits nowhere refused at submit with the bytes it
lacks. Every expected figure is worked out by hand in the test."""
from __future__ import annotations

import dataclasses

import pytest

from fedpipe.planner import (ClusterView, LayerProfile, ModelProfile, NodeSpec, PlanError,
                             SearchOptions, TrainConfig, make_plan, stage_memory_bytes)
from fedpipe.planner.costs import StageCodecs, host_memory_shares
from fedpipe.planner.memfit import shortfall
from fedpipe.planner.protoio import memory_shares, model_profile, train_config
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.runtime.optim import optimizer
from fedpipe.spec import JobSpec
from fedpipe.spec.optimizers import state_factor, step_scratch
from fedpipe.tracker import errors
from fedpipe.tracker.replan import substitute
from fedpipe.tracker.store import MemoryStore
from tracker_fakes import make_tracker, registration, submission

pytestmark = pytest.mark.timeout(60)

PROFILE = ModelProfile([LayerProfile("l0", 1e6, 10, 1000), LayerProfile("l1", 1e6, 20, 2000),
                        LayerProfile("l2", 1e6, 30, 3000)], input_bytes=5)


def test_optimizer_kinds_give_their_state_copies():
    import torch
    assert optimizer(torch.optim.AdamW, lr=1e-3).kind == "adamw"
    assert optimizer(torch.optim.SGD, lr=0.1).kind == "sgd"
    assert optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).kind == "sgd-momentum"
    # weights + gradients + the optimizer's copies
    assert [state_factor(k) for k in ("adamw", "adam", "sgd-momentum", "sgd")] == [4, 4, 3, 2]
    assert state_factor("") == state_factor("someoptimizer") == 4  # unknown: as AdamW
    spec = JobSpec(steps=1, microbatches=4, batch_size=8, optimizer=b"o", loss_fn=b"l",
                   optimizer_kind="sgd-momentum")
    assert JobSpec.from_proto(spec.to_proto()).optimizer_kind == "sgd-momentum"
    assert train_config(spec).state_factor == 3


def test_stage_memory_by_hand():
    """Stage 1 of 3 holds layer 1 (2000 parameter bytes), microbatches of 8 / 4 = 2 samples."""
    def cfg(kind: str, schedule: str = "1f1b") -> TrainConfig:
        return TrainConfig(batch_size=8, microbatches=4, schedule=schedule,
                           state_factor=state_factor(kind), snapshot_copies=2)

    codecs = StageCodecs(sent_activation="int8", sent_gradient="bf16")
    # state: 2000 × (3 + 2 snapshots × 2) = 14000 under SGD with momentum;
    # stash: (input 10 + output 20) × 2 samples = 60 a microbatch, 1F1B keeps 3 - 1 = 2: 120;
    # buffers: int8 of the 40-byte output: 0.27 × 40 = 10.8; bf16 of the 20-byte input
    # gradient: 10, and its error-feedback residuals, one per microbatch: 4 × 20 = 80.
    assert stage_memory_bytes(PROFILE, 1, 2, cfg("sgd-momentum"), 1, 3, None, codecs) \
        == pytest.approx(14000 + 120 + 10.8 + 10 + 80)
    # GPipe keeps all 4 microbatches' activations: 240
    assert stage_memory_bytes(PROFILE, 1, 2, cfg("sgd-momentum", "gpipe"), 1, 3, None, codecs) \
        == pytest.approx(14000 + 240 + 100.8)
    # AdamW: 2000 × (4 + 2 × 3) = 20000; plain SGD: 2000 × (2 + 2 × 1) = 8000; raw: no buffers
    assert stage_memory_bytes(PROFILE, 1, 2, cfg("adamw"), 1, 3) == 20000 + 120
    assert stage_memory_bytes(PROFILE, 1, 2, cfg("sgd"), 1, 3) == 8000 + 120
    # AdamW's step takes sqrt of its second moments into new tensors: 1 × 2000 bytes of
    # scratch, after the backward passes freed the 120 stashed (under "async", both, and
    # weight stashing's copies: one per version in use, max_staleness 1 -> 2 x 2000)
    scratch = dataclasses.replace(cfg("adamw"), step_scratch=step_scratch("adamw"))
    assert stage_memory_bytes(PROFILE, 1, 2, scratch, 1, 3) == 20000 + 2000
    assert stage_memory_bytes(PROFILE, 1, 2, dataclasses.replace(scratch, schedule="async"),
                              1, 3) == 20000 + 2000 + 120 + 2 * 2000
    assert step_scratch("sgd-momentum") == 0 and train_config(JobSpec(
        steps=1, optimizer=b"o", loss_fn=b"l", optimizer_kind="adamw")).step_scratch == 1
    # the first stage receives raw input from the data, sends nothing back: only its
    # output's int8 copy (0.27 × 10 × 2); its stash: (5 + 10) × 2 × min(4, 3) = 90
    assert stage_memory_bytes(PROFILE, 0, 1, cfg("sgd"), 0, 3, None, codecs) \
        == pytest.approx(1000 * 4 + 90 + 5.4)


def test_nodes_of_one_host_share_its_memory():
    gib = 2**30
    nodes = [NodeSpec(f"n{i}", 1e12, 22 * gib, host="h", host_memory=24 * gib)
             for i in range(3)] + [NodeSpec("alone", 1e12, 22 * gib)]
    assert host_memory_shares(nodes) == {"n0": 8 * gib, "n1": 8 * gib, "n2": 8 * gib,
                                         "alone": 22 * gib}

    # two layers of 100 parameter bytes (AdamW: 400 a layer as a stage, 800 both)
    prof = ModelProfile([LayerProfile(f"l{i}", 1e9, 0, 100) for i in range(2)])
    cfg = TrainConfig(batch_size=1, compression="none")
    opts = SearchOptions(iterations=10, time_limit_s=5)

    def pair(host_memory: int) -> list[NodeSpec]:
        return [NodeSpec(n, 1e12, 1000, host="h", host_memory=host_memory) for n in "ab"]

    alone = make_plan(ClusterView([dataclasses.replace(n, host="") for n in pair(1000)]),
                      prof, cfg, opts)
    assert len(alone.groups[0].stages) == 1              # one node holds all 800 bytes
    shared = make_plan(ClusterView(pair(1000)), prof, cfg, opts)
    assert [(s.layer_start, s.layer_end) for s in shared.groups[0].stages] == [(0, 1), (1, 2)]
    with pytest.raises(PlanError, match="fits the nodes' memory"):
        make_plan(ClusterView(pair(700)), prof, cfg, opts)   # 350 a node < 400


def test_a_job_that_fits_nowhere_is_refused_at_submit_with_the_bytes_it_lacks():
    tracker, _, _ = make_tracker(MemoryStore())
    req = submission()             # 4 layers of 1000 parameter bytes, 1000 activation bytes
    prof, cfg = model_profile(req.profile), train_config(JobSpec.from_proto(req.config))
    whole = stage_memory_bytes(prof, 0, 4, cfg, 0, 1)
    layer = stage_memory_bytes(prof, 1, 2, cfg, 3, 4)   # layer 1 has the largest stash
    assert layer == max(stage_memory_bytes(prof, k, k + 1, cfg, 3, 4) for k in range(4))
    mem = int(layer) - 1000
    tracker.register(registration("small", 7000, memory=mem))
    with pytest.raises(errors.ResourceExhausted,
                       match=f"node\\(s\\) have .* \\({whole - mem:.0f} bytes\\) more are "
                             "needed; to fit, submit with recompute="):
        tracker.jobs.submit(req)
    more = int(whole // mem) + 1
    for i in range(more):
        tracker.register(registration(f"more{i}", 7001 + i, memory=mem))
    with pytest.raises(errors.ResourceExhausted,
                       match="layer 1 \\(l1\\) alone needs .* has [0-9.]+ KiB: 1000 B "
                             "\\(1000 bytes\\) more are needed; to fit"):
        tracker.jobs.submit(req)
    assert tracker.store.jobs_in(tracker_pb2.JOB_STATE_PENDING) == []


def test_a_lost_stage_moves_only_where_its_hosts_share_of_memory_holds_it():
    """Recovery's substitute counts a host's memory once among its nodes too: a stage
    of 600 bytes fits a node of 1000 alone, but not one of two sharing 1000."""
    def node(name: str, host: str) -> tracker_pb2.NodeInfo:
        return tracker_pb2.NodeInfo(node_id=name, name=name, address=f"{name}:1",
                                    resources=node_pb2.Resources(
                                        flops=1e12, memory_bytes=1000, host_id=host,
                                        host_memory_bytes=1000 if host else 0))
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(node_id="gone", layer_start=0,
                                                          layer_end=1)])
    moved = substitute(plan, {"gone"}, [node("a", ""), node("b", "")], lambda a: 600)
    assert moved.stages[0].node_id in ("a", "b")
    with pytest.raises(PlanError, match="needs 0.0 MiB but the 2 live node"):
        substitute(plan, {"gone"}, [node("a", "h"), node("b", "h")], lambda a: 600)
    assert memory_shares([node("a", "h"), node("b", "h"), node("c", "")]) == \
        {"a": 500, "b": 500, "c": 1000}


def test_a_moved_stage_takes_its_new_nodes_snapshot_keeping_and_drops_its_old_price():
    # found by review: a moved stage kept the lost node's predicted split (status and the
    # dashboard showed it on the new node) and its snapshots_on_disk flag
    def node(name: str, disk: bool) -> tracker_pb2.NodeInfo:
        return tracker_pb2.NodeInfo(node_id=name, name=name, address=f"{name}:1",
                                    resources=node_pb2.Resources(
                                        flops=1e12, memory_bytes=1000, snapshots_on_disk=disk))
    plan = node_pb2.Plan(stages=[
        node_pb2.StageAssignment(stage=0, node_id="a", node_name="a", layer_start=0,
                                 layer_end=1, predicted_compute_seconds=1.0),
        node_pb2.StageAssignment(stage=1, node_id="gone", node_name="gone", layer_start=1,
                                 layer_end=3, predicted_compute_seconds=2.0,
                                 predicted_send_seconds=0.5)])
    moved = substitute(plan, {"gone"}, [node("a", False), node("b", True)], lambda a: 100)
    kept, new = moved.stages
    assert (kept.node_id, kept.predicted_compute_seconds) == ("a", 1.0)
    assert (new.node_id, new.snapshots_on_disk) == ("b", True)
    assert (new.predicted_compute_seconds, new.predicted_send_seconds) == (0.0, 0.0)
    assert moved.summary == "a: layer 0; b: layers 1-2"


def test_a_node_that_keeps_snapshots_on_disk_is_priced_without_them_and_gets_the_stage():
    """``fedpipe node --snapshot-dir``: the stage's snapshots (2 own + 2 a buddy's, each
    weights and momentum) are not in memory; only the tensor in flight, at most its
    largest layer's parameter bytes."""
    cfg = TrainConfig(batch_size=8, microbatches=4, schedule="1f1b",
                      state_factor=state_factor("sgd-momentum"), snapshot_copies=4)
    # layers 1-2 (2000 + 3000 parameter bytes): in memory 5000 × (3 + 4 × 2) = 55000;
    # on disk 5000 × 3 + the largest layer's 3000 = 18000; stash (10 + 20 + 30) × 2 × 2 = 240
    assert stage_memory_bytes(PROFILE, 1, 3, cfg, 1, 3) == 55000 + 240
    assert stage_memory_bytes(PROFILE, 1, 3, cfg, 1, 3, snapshots_on_disk=True) == 18000 + 240
    off = dataclasses.replace(cfg, snapshot_copies=0)  # checkpoints off: no tensor in flight
    assert stage_memory_bytes(PROFILE, 1, 3, off, 1, 3, snapshots_on_disk=True) == 15000 + 240

    # the whole model, 6000 parameter bytes: 66000 + stash in memory, 21000 + stash on disk
    opts = SearchOptions(iterations=10, time_limit_s=5)
    ram, disk = NodeSpec("ram", 1e12, 30000), NodeSpec("disk", 1e12, 30000,
                                                         snapshots_on_disk=True)
    one = dataclasses.replace(cfg, stages=1, microbatches=1, batch_size=1)
    plan = make_plan(ClusterView([disk]), PROFILE, one, opts)
    assert [s.node_id for s in plan.groups[0].stages] == ["disk"]
    with pytest.raises(PlanError, match="fits the nodes' memory"):
        make_plan(ClusterView([ram]), PROFILE, one, opts)
    from fedpipe.planner.context import PlanContext
    ctx = PlanContext(ClusterView([ram, disk]), PROFILE, one)  # side by side, each its own
    assert [bool(ctx.memory_fit(i, 1)[0][0, 3]) for i in (0, 1)] == [False, True]

    # the node advertises it; the plan message carries it; the tracker's prediction uses it
    from fedpipe.planner.protoio import assignment_memory_bytes, cluster_view, plan_message
    infos = {n.node_id: tracker_pb2.NodeInfo(
        node_id=n.node_id, name=n.node_id, address=f"127.0.0.1:{9000 + i}",
        resources=node_pb2.Resources(memory_bytes=n.memory_bytes, flops=n.flops,
                                     snapshots_on_disk=n.snapshots_on_disk))
        for i, n in enumerate((ram, disk))}
    assert [n.snapshots_on_disk for n in cluster_view(list(infos.values()), []).nodes] \
        == [False, True]
    msg = plan_message(plan, infos)
    assert [a.snapshots_on_disk for a in msg.stages] == [True]
    assert assignment_memory_bytes(msg, msg.stages[0], PROFILE, one) == \
        stage_memory_bytes(PROFILE, 0, 3, one, 0, 1, snapshots_on_disk=True)


def test_a_refusal_at_submit_lists_snapshots_only_where_they_take_memory():
    # the new user saw "snapshots" named among what a job needs on nodes that keep them
    # on disk, where a tensor in flight is all they take
    cfg = TrainConfig(batch_size=8, microbatches=4, schedule="1f1b",
                      state_factor=state_factor("sgd-momentum"), snapshot_copies=4)
    for disk, what in ((False, "optimizer state, snapshots, activations"),
                       (True, "optimizer state, a snapshot tensor in flight, activations")):
        lack, why = shortfall(PROFILE, cfg, [NodeSpec("n", 1e12, 1000, snapshots_on_disk=disk)])
        assert lack > 0 and f"({'weights, gradients, ' + what})" in why, why
