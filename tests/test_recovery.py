"""A job survives losing nodes: kill -9 mid-job, twice, and a tracker kill; exact recovery.

Real processes on 127.0.0.1. Each test trains the digits MLP in 3 stages with
compression "none" and a synchronous schedule, kills nodes at given steps of
the job (``LocalSwarm.inject``), and requires the job to SUCCEED with the
weights single-process training on the same batches gives (1e-5 relative per
tensor): recovery replays the same batches from a consistent cut.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from reference import digit_batches, job_info, max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 18, 3


@pytest.fixture(scope="module")
def swarm():
    """4 nodes (one spare for a 3-stage job); tests that kill nodes start new ones."""
    with LocalSwarm(n_nodes=4, lease=5.0) as s:
        yield s


def holder(client, job, stage):
    """The address of the node running ``stage`` of group 0 now."""
    return PlanView(job_info(client, job).plan)[StageKey(0, stage)].address


def submit(client, data, schedule="1f1b"):
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=STEPS, microbatches=2, stages=3,
                        replicas=1, schedule=schedule, compression="none",
                        checkpoint_every=EVERY, rebalance="never")
    # rebalance="never": these tests count recoveries and epochs from losses alone (a
    # re-split over the survivors afterwards is a rebalance, tests/test_resplit.py)
    return model, job


def replace_dead(swarm):
    """Start a node for each one that died, so the next test has a spare again."""
    alive = sum(p.poll() is None for p in swarm.nodes)
    for _ in range(4 - alive):
        swarm.add_node()
    swarm.wait_for_nodes(4)


def check_exact(client, model, job, data):
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED"
    got = job.state_dict()
    want = single_process(model, LOSS, SGD, data)
    assert max_relative_difference(got, want) <= 1e-5
    job.release()
    return job_info(client, job)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_kill_9_of_a_middle_stage_node_recovers_exactly(swarm, schedule):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(7, "kill stage 1", lambda: swarm.kill(holder(client, job, 1)))
    model, job = submit(client, inj.feed(data), schedule)
    inj.start(job.id)
    final = check_exact(client, model, job, data)
    inj.stop()
    assert [f.name for f in inj.fired] == ["kill stage 1"]
    assert len(final.recoveries) == 1 and len(job.status().recoveries) == 1
    rec = final.recoveries[0]
    assert rec.checkpoint_step % EVERY == 0 and rec.steps_recomputed <= EVERY + 2
    assert final.epoch == 1
    replace_dead(swarm)


def test_two_losses_in_one_job_recover_exactly(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject()
    inj.at_step(4, "kill stage 1", lambda: swarm.kill(holder(client, job, 1)))
    inj.at_step(11, "kill stage 2", lambda: swarm.kill(holder(client, job, 2)))
    model, job = submit(client, inj.feed(data))
    inj.start(job.id)
    final = check_exact(client, model, job, data)
    inj.stop()
    assert len(inj.fired) == 2 and len(final.recoveries) == 2
    replace_dead(swarm)


def test_a_tracker_killed_mid_job_restarts_and_the_job_succeeds(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(5, "kill the tracker", swarm.restart_tracker)
    model, job = submit(client, inj.feed(data))
    inj.start(job.id)
    check_exact(client, model, job, data)
    inj.stop()
    assert [f.name for f in inj.fired] == ["kill the tracker"]
