"""``submit``'s knobs in groups (fedpipe.spec: Training, Compression, Replicas, Placement,
Lifetime), the flat keywords still accepted, and one knob given both ways refused; all
in-process (the checks run before the client calls the tracker)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client import Client
from fedpipe.spec import (FLAT_KNOBS, GROUPS, Compression, DiLoCo, JobSpec, JobSpecError, Knobs,
                          Lifetime, Placement, Replicas, Training)

SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1)
STEP_LR = fedpipe.lr_scheduler(torch.optim.lr_scheduler.StepLR, step_size=2)


def spec(knobs: Knobs) -> JobSpec:
    return knobs.job_spec(steps=10, optimizer=b"o", loss_fn=b"l").validate()


def test_the_groups_and_the_flat_keywords_make_the_same_job_spec():
    flat = Knobs.gather({"replicas": 2, "compression": {"activations": "int8"}},
                        dict(microbatches=4, schedule="1f1b", clip_grad_norm=1.0,
                             checkpoint_every=5, replica_sync="diloco", min_replicas=1,
                             stages=3, rebalance="never", client_timeout=30.0,
                             pending_timeout=9.0, max_staleness=0))
    grouped = Knobs.gather({
        "training": Training(microbatches=4, schedule="1f1b", clip_grad_norm=1.0,
                             checkpoint_every=5, max_staleness=0),
        "compression": Compression(activations="int8"),
        "replicas": Replicas(groups=2, sync="diloco", min_groups=1),
        "placement": Placement(stages=3, rebalance="never"),
        "lifetime": Lifetime(pending_timeout=9.0, client_timeout=30.0)}, {})
    assert flat == grouped
    s = spec(grouped)
    assert (s.microbatches, s.schedule, s.clip_grad_norm, s.checkpoint_every, s.replicas,
            s.replica_sync, s.min_replicas, s.stages, s.rebalance, s.client_timeout,
            s.activation_compression, s.gradient_compression, s.max_staleness) == (
        4, "1f1b", 1.0, 5, 2, "diloco", 1, 3, "never", 30.0, "int8", "auto", 0)


def test_no_knobs_give_the_job_spec_defaults():
    assert spec(Knobs.gather({}, {})) == JobSpec(steps=10, optimizer=b"o", loss_fn=b"l")


def test_a_diloco_group_sync_sets_the_outer_settings():
    outer = DiLoCo(inner_steps=4, outer_lr=1.0, outer_momentum=0.0)
    s = spec(Knobs.gather({"replicas": Replicas(groups=2, sync=outer)}, {"microbatches": 2}))
    assert s.replica_sync == "diloco" and s.diloco == outer


def test_every_flat_keyword_names_a_field_of_its_group():
    for key, (group, attr) in FLAT_KNOBS.items():
        assert attr in {f.name for f in dataclasses.fields(GROUPS[group])}, key


@pytest.mark.parametrize("group,value,flat", [
    ("training", Training(microbatches=4), {"microbatches": 2}),
    ("training", Training(), {"lr_scheduler": None}),
    ("replicas", Replicas(groups=2), {"replica_sync": "allreduce"}),
    ("placement", Placement(), {"stages": 2}),
    ("lifetime", Lifetime(), {"client_timeout": 5.0}),
])
def test_a_knob_in_its_group_and_as_a_flat_keyword_is_refused(group, value, flat):
    key = next(iter(flat))
    with pytest.raises(TypeError, match=f"{key}= sets .* and {group}= is given too"):
        Knobs.gather({group: value}, flat)


def test_a_flat_group_keyword_leaves_the_other_flat_keywords_free():
    k = Knobs.gather({"replicas": 2, "compression": "none"}, {"replica_sync": "allreduce"})
    assert k.replicas == Replicas(groups=2, sync="allreduce")
    assert k.compression == Compression("none", "none")


@pytest.mark.parametrize("groups,flat,error,match", [
    ({}, {"microbatch": 2}, TypeError, "unexpected keyword argument 'microbatch'"),
    ({"training": {"microbatches": 2}}, {}, TypeError, "training= must be a fedpipe.Training"),
    ({"replicas": True}, {}, TypeError, "replicas= must be a fedpipe.Replicas or an int"),
    ({"compression": {"weights": "int8"}}, {}, JobSpecError, "keys must be 'activations'"),
    ({"training": Training(microbatches=0)}, {}, JobSpecError, "microbatches: must be in"),
    ({"training": Training(schedule="zigzag")}, {}, JobSpecError, "unknown schedule"),
    ({}, {"clip_grad_norm": float("nan")}, JobSpecError, "clip_grad_norm"),
    ({"compression": Compression(activations="topk")}, {}, JobSpecError, "gradients only"),
    ({"replicas": Replicas(sync="ring")}, {}, JobSpecError, "replica_sync: must be one of"),
    ({"replicas": Replicas(sync=3)}, {}, TypeError, "replica_sync must be a string"),
    ({"replicas": Replicas(min_groups=-1)}, {}, JobSpecError, "min_replicas: must be >= 0"),
    ({"placement": Placement(rebalance="often")}, {}, JobSpecError, "rebalance"),
    ({"lifetime": Lifetime(client_timeout=0)}, {}, JobSpecError, "client_timeout"),
    ({}, {"pending_timeout": -1.0}, JobSpecError, "pending_timeout"),
    # each knob's type, named with the type expected (a bool is not a number)
    ({"training": Training(microbatches=2.5)}, {}, TypeError,
     r"microbatches \(Training.microbatches\) must be an int, got float 2.5"),
    ({}, {"microbatches": True}, TypeError, "microbatches .* must be an int, got bool True"),
    ({"training": Training(schedule=1)}, {}, TypeError, r"schedule .* must be a str, got int"),
    ({}, {"max_staleness": None}, TypeError, "max_staleness .* must be an int, got NoneType"),
    ({"training": Training(lr_scheduler="cosine")}, {}, TypeError,
     r"lr_scheduler must come from fedpipe.lr_scheduler\(.*or be None, got str 'cosine'"),
    ({}, {"clip_grad_norm": "1"}, TypeError, r"clip_grad_norm .* must be a number \(int or "
                                             r"float\), got str"),
    ({}, {"checkpoint_every": 2.5}, TypeError, "checkpoint_every .* must be an int, got float"),
    ({"compression": Compression(activations=None)}, {}, TypeError,
     r"activation_compression \(Compression.activations\) must be a str, got NoneType"),
    ({"compression": {"gradients": 5}}, {}, TypeError, "gradient_compression .* must be a str"),
    ({"replicas": Replicas(groups=2.0)}, {}, TypeError,
     r"replicas \(Replicas.groups\) must be an int, got float 2.0"),
    ({}, {"min_replicas": 1.5}, TypeError, r"min_replicas \(Replicas.min_groups\) must be an"),
    ({"placement": Placement(stages=1.5)}, {}, TypeError,
     r"stages \(Placement.stages\) must be an int, got float 1.5"),
    ({}, {"rebalance": False}, TypeError, "rebalance .* must be a str, got bool"),
    ({"lifetime": Lifetime(pending_timeout=True)}, {}, TypeError,
     r"pending_timeout \(Lifetime.pending_timeout\) must be a number \(int or float\), got "
     r"bool True"),
    ({}, {"client_timeout": "60"}, TypeError, "client_timeout .* must be a number"),
])
def test_a_bad_knob_is_named(groups, flat, error, match):
    with pytest.raises(error, match=match):
        Knobs.gather(groups, flat)


def test_min_replicas_above_the_groups_is_refused_by_the_job_spec():
    with pytest.raises(JobSpecError, match="min_replicas: 3 is more than the 2"):
        spec(Knobs.gather({"replicas": Replicas(groups=2, min_groups=3)},
                          {"microbatches": 2}))


def test_the_groups_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Training().microbatches = 3  # type: ignore[misc]


def test_submit_refuses_a_knob_given_twice_before_calling_the_tracker():
    model = nn.Sequential(nn.Linear(4, 2))
    data = [(torch.randn(8, 4), torch.randn(8, 2))]
    with Client("127.0.0.1:1") as client:  # never dialled
        with pytest.raises(TypeError, match="schedule= sets Training.schedule"):
            client.submit(model, nn.functional.mse_loss, SGD, data, steps=2,
                          training=Training(microbatches=2), schedule="1f1b")
        with pytest.raises(TypeError, match="lr_scheduler must come from"):
            client.submit(model, nn.functional.mse_loss, SGD, data, steps=2,
                          training=Training(lr_scheduler="step"))
        with pytest.raises(TypeError, match="unexpected keyword argument 'schedul'"):
            client.submit(model, nn.functional.mse_loss, SGD, data, steps=2, schedul="1f1b")
