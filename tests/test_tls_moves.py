"""State moves to nodes no earlier plan named, under mutual TLS; weights stay exact.

Under TLS a node serves a job's snapshots and state only to the job's client
and to nodes assigned to the job (``fedpipe.security.policy.require_owner_or_assigned``),
and it learns who is assigned from the tracker. A recovery onto a spare node,
a drain's hand-over and a replica group's heal each move state to a node that
was in no plan the holder had seen: the tracker must tell the holder first.

Real processes on 127.0.0.1 (``LocalSwarm(tls=True)``), one swarm for the
module. Each job trains the digits MLP with a synchronous schedule and
compression "none", and must SUCCEED with the weights single-process training
on the same batches gives (1e-5 relative per tensor), as the plaintext tests
(``test_recovery.py``, ``test_elastic.py``, ``test_elastic_replicas.py``) do; the
state each moved stage restores must have been fetched from a holder at the
cut, not rebuilt from an older checkpoint or from the start.
"""
from __future__ import annotations

import re

import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.client import Client
from fedpipe.examples import digits
from fedpipe.net import timeouts
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2
from fedpipe.security import TlsConfig
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from fedpipe.wire import frames
from reference import (digit_batches, job_info, max_relative_difference, running_plan,
                       single_process, wait_rebuilt)

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 18, 3
HEAL_STEPS = 64
"""Steps of the heal test (its feed waits at step 10 until the lost group is rebuilt)."""
NODES = 4
"""A 3-stage job and one spare (two 1-stage replica groups and two spares)."""
FETCHED = re.compile(r"fetched the step (\d+) snapshot of job (\S+) stage (\d+) \(replica (\d+)\) "
                     r"from (\S+): \d+ tensors, \d+ bytes, over (.+)$", re.M)


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(n_nodes=NODES, lease=5.0, tls=True) as s:
        yield s


@pytest.fixture(autouse=True)
def spare_again(swarm):
    """After each test (passed or not), start a node for each one killed or drained."""
    yield
    # a drained node that a failed test left running is on its way out: not a spare
    alive = sum(p.poll() is None and p not in swarm.faulted for p in swarm.nodes)
    for _ in range(NODES - alive):
        swarm.add_node()
    swarm.wait_for_nodes(NODES)


def submit(client, data, **kw):
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=STEPS, microbatches=2,
                        compression="none", checkpoint_every=EVERY, rebalance="never", **kw)
    # rebalance="never": these tests follow one state move each (a re-split over the
    # survivors afterwards is a rebalance, tests/test_resplit.py)
    return model, job


def finish_exact(client, model, job, data) -> tracker_pb2.JobInfo:
    status = job.wait(timeout=240, progress=False)
    assert status.state == "SUCCEEDED", status.reason
    want = single_process(model, LOSS, SGD, data)
    assert max_relative_difference(job.state_dict(), want) <= 1e-5
    job.release()
    return job_info(client, job)


def refusals(swarm, job_id: str) -> list[str]:
    """Every snapshot fetch of the job that a holder refused for want of an assignment."""
    return [line for p in swarm.nodes for line in swarm.log(p).splitlines()
            if f"is not assigned to job {job_id}" in line]


def fetches(swarm, job_id: str) -> list[tuple[int, int, int, str]]:
    """(step, stage, replica, source address) of every snapshot any node fetched for the job;
    each over the socket data plane (every node has a data port), its TLS checked as
    gRPC's."""
    found = [m for p in swarm.nodes for m in FETCHED.finditer(swarm.log(p)) if m[2] == job_id]
    assert {m[6] for m in found} <= {"the socket data plane"}, [m[0] for m in found]
    return [(int(m[1]), int(m[3]), int(m[4]), m[5]) for m in found]


def test_kill_9_of_a_stage_node_recovers_onto_the_spare_from_the_buddys_snapshot(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(7, "kill stage 1", lambda: swarm.kill(victim.address))
    model, job = submit(client, inj.feed(data), stages=3, replicas=1, schedule="1f1b")
    before = running_plan(client, job)
    spare = {n.name for n in client.nodes()} - {a.node_name for a in before.stages.values()}
    victim = before[StageKey(0, 1)]
    inj.start(job.id)
    final = finish_exact(client, model, job, data)
    inj.stop()
    assert [f.name for f in inj.fired] == ["kill stage 1"]
    assert [r.cause for r in final.recoveries] == ["loss"], final.recoveries
    rec = final.recoveries[0]
    assert rec.checkpoint_step > 0 and rec.checkpoint_step % EVERY == 0
    assert rec.steps_recomputed <= EVERY + 2
    after = PlanView(final.plan)
    assert after[StageKey(0, 1)].node_name in spare
    # the spare restored stage 1 from a surviving holder (the stage's buddy), at the cut
    got = [(step, src) for step, stage, _, src in fetches(swarm, job.id) if stage == 1]
    assert [step for step, _ in got] == [rec.checkpoint_step], got
    assert got[0][1] != victim.address
    assert not refusals(swarm, job.id)


def test_a_drain_hands_the_stage_over_to_a_node_no_plan_named(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    admin = Client(swarm.tracker, tls=swarm.admin_tls)  # only the operator drains others
    inj = swarm.inject().at_step(3, "drain", lambda: admin.drain(victim.node_name))
    model, job = submit(client, inj.feed(data), stages=3, replicas=1, schedule="gpipe")
    before = running_plan(client, job)
    victim = before[StageKey(0, 1)]
    proc = swarm.nodes[swarm.node_index(victim.node_name)]
    swarm.faulted.add(proc)  # its exit is expected
    inj.start(job.id)
    try:
        final = finish_exact(client, model, job, data)
    finally:
        admin.close()
    inj.stop()
    assert [r.cause for r in final.recoveries] == ["drain"], final.recoveries
    h = final.recoveries[0]
    assert h.steps_recomputed == 0 and 3 <= h.checkpoint_step < STEPS
    after = PlanView(final.plan)
    new = after[StageKey(0, 1)]
    assert new.node_name not in {a.node_name for a in before.stages.values()}
    # the new node took the stage's state at the cut from the draining node itself
    # (or its buddy), which never saw a plan naming the new node
    got = [(step, src) for step, stage, _, src in fetches(swarm, job.id) if stage == 1]
    assert [step for step, _ in got] == [h.checkpoint_step], got
    assert not refusals(swarm, job.id)
    assert proc.wait(timeout=30) == 0


def test_a_lost_replica_group_heals_on_a_spare_from_its_donor(swarm):
    client, data = swarm.client(), digit_batches(HEAL_STEPS)
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    inj = swarm.inject().at_step(8, "kill group 1", lambda: swarm.kill(lost.address))
    inj.at_step(10, "group 1 rebuilt", lambda: wait_rebuilt(client, job))
    job = client.submit(model, LOSS, SGD, inj.feed(data), steps=HEAL_STEPS, microbatches=2,
                        stages=1, replicas=2, replica_sync="allreduce", compression="none",
                        checkpoint_every=4, min_replicas=1)
    before = running_plan(client, job)
    donor, lost = before[StageKey(0, 0)], before[StageKey(1, 0)]
    inj.start(job.id)
    status = job.wait(timeout=240, progress=False)
    inj.stop()
    assert status.state == "SUCCEEDED", status.reason
    assert [f.name for f in inj.fired] == ["kill group 1", "group 1 rebuilt"]
    reasons = [ev.reason for ev in job.events()]
    assert any("replica group 1 joins at step" in r for r in reasons), reasons
    final = job_info(client, job)
    assert final.epoch == 0 and not final.recoveries  # healed, never rewound
    healed = PlanView(final.plan)[StageKey(1, 0)]
    assert healed.node_name not in {a.node_name for a in before.stages.values()}
    # the rebuilt group took its state from the donor, a node whose plans never named it
    got = [(stage, replica, src) for _, stage, replica, src in fetches(swarm, job.id)]
    assert got == [(0, 1, donor.address)], got
    assert not refusals(swarm, job.id)
    # all-reduce after the join: the rebuilt group ends with exactly the donor's weights
    g0, g1 = (group_state(client, job, final, g) for g in (0, 1))
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    job.release()


def group_state(client, job, final: tracker_pb2.JobInfo, replica: int) -> dict:
    """The weights of replica group ``replica`` (one stage), fetched by the job's client."""
    (a,) = PlanView(final.plan).chain(replica)
    stream = client.node(a.address).FetchState(
        node_pb2.FetchStateRequest(job_id=job.id, replica=a.replica, stage=a.stage), timeout=60)
    return {head.name: t for head, t in frames.read_tensors(stream)}


def test_only_the_tracker_may_tell_a_node_who_is_assigned_to_a_job(swarm):
    """A node cannot assign itself (or a peer) to a job to be served its state."""
    node = swarm.client().nodes()[0]
    request = node_pb2.AssignJobRequest(job_id="j-any", epoch=1, owner="client",
                                        node_names=["rogue"])
    for tls in (swarm.issue("node", "rogue"), TlsConfig.load(swarm.tls_dir, "client")):
        with net.channel(node.address, tls=tls) as ch:
            with pytest.raises(grpc.RpcError) as e:
                node_pb2_grpc.NodeStub(ch).AssignJob(request, timeout=timeouts.CONTROL_RPC)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
        assert "wrong role for /fedpipe.v1.Node/AssignJob" in e.value.details()
        assert "(allowed: tracker)" in e.value.details()
    with net.channel(node.address, tls=TlsConfig.load(swarm.tls_dir, "tracker")) as ch:
        with pytest.raises(grpc.RpcError) as e:  # the tracker is heard, and bad input named
            node_pb2_grpc.NodeStub(ch).AssignJob(node_pb2.AssignJobRequest(),
                                                 timeout=timeouts.CONTROL_RPC)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "AssignJob names no job"
