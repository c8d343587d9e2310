"""Replica groups as the unit of failure, with real processes: kill -9 a node of one
group; the other group goes on without rewinding and the lost group heals.

The digits MLP trains in two replica groups of one stage each (all-reduce or
DiLoCo, compression "none"), on a swarm of three nodes: the third is the spare
a lost group is rebuilt on. An undisturbed all-reduce job equals
single-process training on the same batches (``tests/test_recovery.py`` and
the equivalence tests hold it to 1e-5), so that is the undisturbed run its
final loss is compared with.

Under DiLoCo the disturbed run is held to an exact single-process replay of
DiLoCo over the groups that were there (1e-5): the survivor's log says which
outer steps it took alone and from which step it trained on the whole batch,
the job's events when the lost group joined again. Both runs are also held to
the issue's 2 % band of final loss, with an outer SGD of lr 1 and no momentum
(the mean of the groups' weights every 4 inner steps). With the DiLoCo paper's
outer Nesterov momentum (0.9, lr 0.7) this small MLP is chaotic: replayed in
one process over 4 data orders, a group lost for 8 steps moved the final loss
by 3-11 % at 64 steps and by 3-32 % at 256, and a 1e-6 change of the initial
weights alone moved an undisturbed run by up to 3.2 % at 96 steps; there the
band measures the setting, not the recovery. With lr 1 and no momentum the same replays moved it
by at most 0.8 % for a group lost up to 30 steps (6 data orders).
``benchmarks/elastic.py replica`` runs both settings.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.proto import node_pb2
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from fedpipe.wire import frames
from reference import (digit_batches, diloco_single_process, job_info,
                       max_relative_difference, single_process, wait_rebuilt)

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
# a setting in which a few half batches move the held-out loss by < 1 % (checked against
# single-process runs); with momentum 0.9 this small MLP's loss at step 64 moves by 4-30 %
# when any 12 steps see half their batch, undisturbed runs and disturbed ones alike
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.5)
LOSS = nn.functional.cross_entropy
STEPS, EVERY, KILL_AT = 64, 4, 10


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(n_nodes=3, lease=5.0) as s:
        yield s


@pytest.fixture(autouse=True)
def spare_again(swarm):
    """After each test (passed or not), start a node for each one killed."""
    yield
    alive = sum(p.poll() is None for p in swarm.nodes)
    for _ in range(3 - alive):
        swarm.add_node()
    swarm.wait_for_nodes(3)


DILOCO = fedpipe.DiLoCo(inner_steps=4, outer_lr=1.0, outer_momentum=0.0)  # see the docstring


def submit(client, data, min_replicas, sync="allreduce"):
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=STEPS, microbatches=2, stages=1,
                        replicas=2, replica_sync=sync, compression="none",
                        checkpoint_every=EVERY, min_replicas=min_replicas,
                        rebalance="never")  # no migration onto the spare: only the heal
    return model, job


def group_state(client, job, replica):
    """The weights of replica group ``replica`` (one stage), fetched from its node."""
    (a,) = PlanView(job_info(client, job).plan).chain(replica)
    stream = client.node(a.address).FetchState(
        node_pb2.FetchStateRequest(job_id=job.id, replica=a.replica, stage=a.stage), timeout=60)
    return {head.name: t for head, t in frames.read_tensors(stream)}


OUTER_ALONE = re.compile(r"replica group 0 stage 0: outer step (\d+) \(after step \d+\) over "
                         r"replica groups \[([\d, ]*)\] of 2")
SAMPLES = re.compile(r"replica group 0 stage 0: step (\d+) trains on (\d+) of the batch's (\d+) ")
JOINS = re.compile(r"replica group 1 joins at step (\d+)")


def diloco_replay(model, data, log: str, reasons: list[str], microbatches: int) -> dict:
    """Group 0's final weights by single-process DiLoCo over the groups that were there,
    as group 0's node ``log`` (of this job only) and the job's event ``reasons`` tell."""
    alone = {int(k): [int(g) for g in groups.split(",")]
             for k, groups in OUTER_ALONE.findall(log)}
    changes = [(int(step), int(n) < int(batch)) for step, n, batch in SAMPLES.findall(log)]
    joined = [int(m.group(1)) for r in reasons if (m := JOINS.search(r))]
    assert alone and len(joined) == 1, (alone, joined)  # disturbed, and healed once

    def fed(step: int) -> list[int]:
        shared = next((half for at, half in reversed(changes) if at <= step), True)
        return [0, 1] if shared else [0]

    return diloco_single_process(model, LOSS, SGD, data, DILOCO, microbatches=microbatches,
                                 fed=fed, members=lambda k: alone.get(k, [0, 1]),
                                 joins={1: joined[0]})[0]


def held_out_loss(model, state):
    _, _, x, y = digits.load()
    model = copy.deepcopy(model)
    model.load_state_dict(state)
    with torch.no_grad():
        return LOSS(model(x), y).item()


@pytest.mark.parametrize("sync", ["allreduce", "diloco"])
def test_a_lost_group_drops_out_the_other_loses_no_step_and_the_group_heals_exactly(swarm, sync):
    client, data = swarm.client(), digit_batches(STEPS)
    marks = [len(swarm.log(p)) for p in swarm.nodes]
    inj = swarm.inject().at_step(KILL_AT, "kill group 1", lambda: swarm.kill(
        PlanView(job_info(client, job).plan)[StageKey(1, 0)].address))
    inj.at_step(KILL_AT + 2, "group 1 rebuilt", lambda: wait_rebuilt(client, job))
    model, job = submit(client, inj.feed(data), min_replicas=1,
                        sync=DILOCO if sync == "diloco" else sync)
    inj.start(job.id)
    status = job.wait(timeout=240, progress=False)
    inj.stop()
    assert status.state == "SUCCEEDED"
    assert [f.name for f in inj.fired] == ["kill group 1", "group 1 rebuilt"]
    final = job_info(client, job)
    assert final.epoch == 0 and not final.recoveries  # never rewound
    reasons = [ev.reason for ev in job.events()]
    assert any("replica group(s) 1 dropped" in r for r in reasons), reasons
    assert any("replica group 1 joins at step" in r for r in reasons), reasons
    steps = [r.step for r in job.history()]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # no step went back or repeated
    # the rebuilt group took the donor's weights, optimizer (and outer) state: the two end
    # equal (all-reduce: every step; DiLoCo: the last step is an outer step)
    g0, g1 = group_state(client, job, 0), group_state(client, job, 1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    if sync == "allreduce":
        undisturbed = single_process(model, LOSS, SGD, data)
    else:
        # exactly DiLoCo over the groups present (module docstring)
        node = swarm.node_index(PlanView(final.plan)[StageKey(0, 0)].address)
        log = swarm.log(swarm.nodes[node])[marks[node]:]
        microbatches = PlanView(final.plan, 2).microbatches(0)
        replay = diloco_replay(model, data, log, reasons, microbatches)
        assert max_relative_difference(g0, replay) <= 1e-5
        undisturbed = diloco_single_process(model, LOSS, SGD, data, DILOCO,
                                            microbatches=microbatches)[0]
    got, want = held_out_loss(model, g0), held_out_loss(model, undisturbed)
    assert abs(got - want) <= 0.02 * want, (got, want)
    assert want < 0.9 * held_out_loss(model, model.state_dict())  # it trained
    job.release()


def test_below_min_replicas_the_job_rewinds_and_ends_exact(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(KILL_AT, "kill group 1", lambda: swarm.kill(
        PlanView(job_info(client, job).plan)[StageKey(1, 0)].address))
    model, job = submit(client, inj.feed(data), min_replicas=2)
    inj.start(job.id)
    status = job.wait(timeout=240, progress=False)
    inj.stop()
    assert status.state == "SUCCEEDED"
    final = job_info(client, job)
    assert final.epoch == 1 and len(final.recoveries) == 1
    assert final.recoveries[0].checkpoint_step % EVERY == 0
    want = single_process(model, LOSS, SGD, data)
    assert max_relative_difference(job.state_dict(), want) <= 1e-5
    job.release()
