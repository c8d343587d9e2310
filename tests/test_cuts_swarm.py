"""A job with pinned cuts on real processes (the session swarm: a tracker and 3 nodes on
127.0.0.1): its plan holds exactly the pinned layer ranges, and it trains to the weights of
single-process PyTorch; cuts out of the model's range are refused before submit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.spec import JobSpecError, PlanView
from reference import digit_batches, max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS = 4


def test_a_job_with_cuts_runs_at_them_and_equals_single_process(swarm):
    model = digits.make_model(hidden=32)  # 5 children: Linear, ReLU, Linear, ReLU, Linear
    batches = digit_batches(STEPS)
    expected = single_process(model, LOSS, SGD, batches)
    # (1, 4): an uneven split, three children in the middle stage
    job = swarm.client().submit(model, LOSS, SGD, batches, steps=STEPS, microbatches=4,
                                schedule="1f1b", compression="none", replicas=1,
                                placement=fedpipe.Placement(stages=3, cuts=(1, 4)))
    status = job.wait(timeout=120, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS, status
    view = PlanView(status.plan)
    assert [(a.layer_start, a.layer_end) for a in view.chain(0)] == [(0, 1), (1, 4), (4, 5)]
    assert len({a.node_id for a in status.plan.stages}) == 3
    got = job.state_dict()
    job.release()
    assert max_relative_difference(got, model.state_dict()) > 1e-3  # it trained
    diff = max_relative_difference(got, expected)
    assert diff <= 1e-5, f"max relative difference {diff:.2e}"


def test_cuts_out_of_the_models_range_are_refused_before_submit(swarm):
    with pytest.raises(JobSpecError, match=r"cuts: cut 5 is out of range: the model has 5 "
                                           r"layers"):
        swarm.client().submit(digits.make_model(hidden=32), LOSS, SGD, digit_batches(1),
                              steps=1, placement=fedpipe.Placement(stages=3, cuts=(2, 5)))
