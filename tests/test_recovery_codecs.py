"""A job with lossy codecs recovers exactly: kill -9 and a drain mid-job, int8 activations
and top-k gradients with error feedback.

Real processes on 127.0.0.1. The digits MLP trains in 3 stages, so two stages send
top-k'd gradients and keep error-feedback residuals. A recovery rewinds every stage to
the last complete checkpoint, a drain hands the drained node's stage over at a cut:
either way the job must end with the weights of the same job run undisturbed with the
same codecs (1e-5 relative per tensor), which needs the residuals of the checkpoint's
step in the checkpoint (:mod:`fedpipe.runtime.gradfeedback`): started afresh, the
replayed steps send other gradients. The codecs must matter: the undisturbed run's
weights differ from uncompressed training's.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from reference import (digit_batches, job_info, max_relative_difference, running_plan,
                       single_process)

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 18, 3
CODECS = {"activations": "int8", "gradients": "topk:0.05"}


@pytest.fixture(scope="module")
def swarm():
    """4 nodes (one spare for a 3-stage job); a test that loses a node starts a new one."""
    with LocalSwarm(n_nodes=4, lease=5.0) as s:
        yield s


@pytest.fixture(scope="module")
def data():
    return digit_batches(STEPS)


def make_model() -> nn.Sequential:
    """The digits MLP as three layers, so that 3 stages cut it one way only: which
    gradients are top-k'd depends on the cut, and the planner may cut a model of more
    layers otherwise in another run."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.ReLU()),
                         nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 10))


def submit(client, data):
    return client.submit(make_model(), LOSS, SGD, data, steps=STEPS, microbatches=2, stages=3,
                         replicas=1, schedule="1f1b", compression=CODECS,
                         checkpoint_every=EVERY, rebalance="never")


def finish(job):
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED", status.reason
    got = job.state_dict()
    job.release()
    return got


@pytest.fixture(scope="module")
def undisturbed(swarm, data):
    """The weights of the job run without a fault, with the same codecs."""
    job = submit(swarm.client(), data)
    got = finish(job)
    stages = sorted(job.status().plan.stages, key=lambda a: a.stage)
    assert [(a.activation_codec, a.gradient_codec) for a in stages] == [
        ("int8", "raw"), ("int8", "topk:0.05"), ("raw", "topk:0.05")]
    # the codecs change the training: exactness below is not that of raw training
    assert max_relative_difference(got, single_process(make_model(), LOSS, SGD, data)) > 1e-3
    return got


def holder(client, job, stage):
    """The assignment of ``stage`` of group 0 once the job runs."""
    return running_plan(client, job)[StageKey(0, stage)]


@pytest.fixture
def spare(swarm):
    """After the test, a new node for each one it lost (passed or not), so the next test
    has a spare again."""
    yield
    alive = sum(p.poll() is None for p in swarm.nodes)
    for _ in range(4 - alive):
        swarm.add_node()
    swarm.wait_for_nodes(4)


@pytest.mark.parametrize("stage", [1, 2])
def test_kill_9_mid_job_recovers_to_the_undisturbed_codec_run(swarm, data, undisturbed, spare,
                                                              stage):
    client = swarm.client()
    inj = swarm.inject().at_step(7, f"kill stage {stage}",
                                 lambda: swarm.kill(holder(client, job, stage).address))
    job = submit(client, inj.feed(data))
    inj.start(job.id)
    got = finish(job)
    inj.stop()
    assert [f.name for f in inj.fired] == [f"kill stage {stage}"]
    [rec] = job_info(client, job).recoveries
    assert rec.checkpoint_step % EVERY == 0 and rec.checkpoint_step < 7 + EVERY
    assert max_relative_difference(got, undisturbed) <= 1e-5


def test_a_drain_mid_job_hands_over_to_the_undisturbed_codec_run(swarm, data, undisturbed,
                                                                 spare):
    client = swarm.client()
    inj = swarm.inject().at_step(4, "drain", lambda: client.drain(victim.node_name))
    job = submit(client, inj.feed(data))
    victim = holder(client, job, 2)
    proc = swarm.nodes[swarm.node_index(victim.node_name)]
    swarm.faulted.add(proc)  # its exit is expected
    inj.start(job.id)
    got = finish(job)
    inj.stop()
    assert proc.wait(timeout=30) == 0  # the drained node leaves once no job needs it
    final = job_info(client, job)
    assert [r.cause for r in final.recoveries] == ["drain"], final.recoveries
    assert final.recoveries[0].steps_recomputed == 0
    assert victim.node_id not in PlanView(final.plan).node_ids()
    assert max_relative_difference(got, undisturbed) <= 1e-5
