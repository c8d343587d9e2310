"""A job whose weights never passed through the tracker recovers exactly from a loss before
its first checkpoint (issue 22): every stage of the new plan epoch starts from step 0 again,
a meta job's nodes making their layers from the seed again, a streamed job's client
streaming each stage's layers again to its (new) node.

Real processes on 127.0.0.1: 4 nodes (one spare for a 3-stage job); a node is killed
after step 2 of 10, before the first checkpoint (step 8).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from reference import digit_batches, job_info, microbatched, not_bit_equal

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY, KILL_AT, MICROBATCHES = 10, 8, 2, 2


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(n_nodes=4, lease=5.0) as s:
        yield s


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def _run_with_a_loss(swarm, model, **kw) -> dict:
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(KILL_AT, "kill stage 1", lambda: swarm.kill(
        PlanView(job_info(client, job).plan)[StageKey(0, 1)].address))
    job = client.submit(model, LOSS, SGD, inj.feed(data), steps=STEPS,
                        microbatches=MICROBATCHES, stages=3, replicas=1, schedule="1f1b",
                        compression="none", checkpoint_every=EVERY, rebalance="never", **kw)
    inj.start(job.id)
    status = job.wait(timeout=240, progress=False)
    inj.stop()
    assert status.state == "SUCCEEDED", status
    assert [f.name for f in inj.fired] == ["kill stage 1"]
    final = job_info(client, job)
    assert len(final.recoveries) == 1 and final.recoveries[0].checkpoint_step == 0
    got = job.state_dict()
    job.release()
    alive = sum(p.poll() is None for p in swarm.nodes)
    for _ in range(4 - alive):
        swarm.add_node()
    swarm.wait_for_nodes(4)
    return got



def test_a_streamed_job_that_loses_a_node_before_its_first_checkpoint_recovers_exactly(swarm):
    torch.manual_seed(5)
    model = mlp()
    want = microbatched(model, LOSS, SGD, digit_batches(STEPS), MICROBATCHES)
    assert not_bit_equal(_run_with_a_loss(swarm, model), want) == []


def test_a_meta_job_that_loses_a_node_before_its_first_checkpoint_recovers_exactly(swarm):
    with torch.device("meta"):
        model = mlp()
    want = microbatched(fedpipe.materialize(copy.deepcopy(model), 11), LOSS, SGD,
                        digit_batches(STEPS), MICROBATCHES)
    assert not_bit_equal(_run_with_a_loss(swarm, model, seed=11), want) == []
