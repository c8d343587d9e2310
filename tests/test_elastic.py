"""Nodes drain and join mid-job without a rewind; weights stay exact.

Real processes on 127.0.0.1. Each job trains the digits MLP with a
synchronous schedule and compression "none", and must SUCCEED with the
weights single-process training on the same batches gives (1e-5 relative per
tensor): a hand-over restores each moved stage from its snapshot at the cut
the job stood at, and the client re-feeds from that step.
"""
from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.proto import tracker_pb2
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from reference import (digit_batches, gated, job_info, max_relative_difference, running_plan,
                       single_process)

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 24, 8
FETCHED = re.compile(r"fetched (?:layers? (\d+)(?:-(\d+))? of )?the step (\d+) snapshot of job "
                     r"(\S+) stage (\d+) \(replica (\d+)\) from \S+: (\d+) tensors, (\d+) bytes")
"""A fetched snapshot: a whole stage's, or (a re-split) some layers of one."""


@pytest.fixture(scope="module")
def swarm():
    """4 nodes: a 3-stage job and one spare; tests that drain a node start a new one."""
    with LocalSwarm(n_nodes=4, lease=5.0) as s:
        yield s


def holder(client, job, stage):
    """The assignment of ``stage`` of group 0 once the job runs."""
    return running_plan(client, job)[StageKey(0, stage)]


def submit(client, data, stages=3, rebalance="never", schedule="1f1b", steps=STEPS):
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=steps, microbatches=2, stages=stages,
                        replicas=1, schedule=schedule, compression="none",
                        checkpoint_every=EVERY, rebalance=rebalance)
    return model, job


def finish_exact(client, model, job, data) -> tracker_pb2.JobInfo:
    status = job.wait(timeout=240, progress=False)
    assert status.state == "SUCCEEDED", status.reason
    got = job.state_dict()
    want = single_process(model, LOSS, SGD, data)
    assert max_relative_difference(got, want) <= 1e-5
    job.release()
    return job_info(client, job)


def replace_gone(swarm, n=4):
    alive = sum(p.poll() is None for p in swarm.nodes)
    for _ in range(n - alive):
        swarm.add_node()
    swarm.wait_for_nodes(n)


def left_reason(client, node_id: str) -> str:
    """Why the tracker lists ``node_id`` as gone (its ListNodes ``lost_reason``)."""
    reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=True), timeout=10)
    [node] = [n for n in reply.nodes if n.node_id == node_id]
    assert not node.alive
    return node.lost_reason


def the_handover(final: tracker_pb2.JobInfo, cause: str) -> tracker_pb2.Recovery:
    """The job's one plan change, which must be a hand-over of ``cause``."""
    assert [r.cause for r in final.recoveries] == [cause], final.recoveries
    return final.recoveries[0]


def test_fedpipe_drain_mid_job_moves_the_stage_with_no_step_recomputed(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    inj = swarm.inject().at_step(3, "drain", lambda: client.drain(victim.node_name))
    model, job = submit(client, inj.feed(data))
    victim = holder(client, job, 1)
    proc = swarm.nodes[swarm.node_index(victim.node_name)]
    swarm.faulted.add(proc)  # its exit is expected
    inj.start(job.id)
    final = finish_exact(client, model, job, data)
    inj.stop()
    h = the_handover(final, "drain")
    assert h.steps_recomputed == 0
    assert 3 <= h.checkpoint_step < STEPS  # the cut: a step boundary just after the drain
    assert victim.node_id not in PlanView(final.plan).node_ids()
    # the drained node exits on its own once no job needs it
    assert proc.wait(timeout=30) == 0
    assert left_reason(client, victim.node_id) == "left the swarm after its drain"
    replace_gone(swarm)


def draining(client, name: str, done: threading.Event, timeout: float = 120.0) -> None:
    """Set ``done`` once the tracker lists node ``name`` as draining (or gone), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flags = {n.name: n.draining for n in client.nodes()}
        if flags.get(name, True):
            break
        time.sleep(0.05)
    done.set()


def test_sigterm_drains_a_node_which_then_exits(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    # fed past step 12 only once the tracker knows of the drain: was, at times, the job
    # (faster since this round's data-plane cuts) ended before the drain's cut
    noticed = threading.Event()
    model, job = submit(client, gated(data, 12, noticed), schedule="gpipe")
    victim = holder(client, job, 2)
    proc = swarm.nodes[swarm.node_index(victim.node_name)]
    swarm.faulted.add(proc)
    inj = swarm.inject(job.id).at_step(4, "SIGTERM", proc.terminate)
    inj.start()
    threading.Thread(target=draining, args=(client, victim.node_name, noticed),
                     daemon=True).start()
    final = finish_exact(client, model, job, data)
    inj.stop()
    assert the_handover(final, "drain").steps_recomputed == 0
    assert victim.node_id not in PlanView(final.plan).node_ids()
    assert proc.wait(timeout=30) == 0
    assert "drained: no job needs this node" in swarm.log(proc)
    assert left_reason(client, victim.node_id) == "left the swarm after its drain"
    replace_gone(swarm)


def test_a_draining_node_takes_no_new_work(swarm):
    client, data = swarm.client(), digit_batches(STEPS)
    idle = client.nodes()[-1]
    proc = swarm.nodes[swarm.node_index(idle.name)]
    swarm.faulted.add(proc)
    # a long job keeps the drained node needed by nothing: it leaves at once, so look
    # at the flag while its heartbeat has not come yet
    client.drain(idle.name)
    flags = {n.name: n.draining for n in client.nodes()}
    assert flags.get(idle.name, True)  # listed as draining, or already gone
    assert not any(v for k, v in flags.items() if k != idle.name)
    model, job = submit(client, data)
    holder(client, job, 0)
    assert idle.node_id not in PlanView(job_info(client, job).plan).node_ids()
    job.cancel()
    assert proc.wait(timeout=30) == 0  # it ran nothing: it leaves at its next heartbeat
    replace_gone(swarm)


SLOW = {"links": [{"from": "node1", "to": "*", "bandwidth": 100_000, "latency_ms": 100}]}
"""node1 sits behind a slow link; node2, which joins mid-job, does not."""
JOIN_STEPS = 80
"""Enough slow steps for node2 to start, register and have its links measured mid-job."""


def test_a_node_joining_mid_job_takes_a_stage_when_it_pays_and_weights_stay_exact():
    with LocalSwarm(n_nodes=2, lease=5.0, link_profile=SLOW) as swarm:
        client, data = swarm.client(), digit_batches(JOIN_STEPS)
        model, job = submit(client, data, stages=2, rebalance="auto", steps=JOIN_STEPS)
        slow = holder(client, job, 1) if holder(client, job, 1).node_name == "node1" \
            else holder(client, job, 0)
        assert slow.node_name == "node1"
        before = PlanView(job_info(client, job).plan)
        inj = swarm.inject(job.id).at_step(2, "join", lambda: swarm.add_node())
        inj.start()
        final = finish_exact(client, model, job, data)
        inj.stop()
        h = the_handover(final, "rebalance")
        assert h.steps_recomputed == 0
        after = PlanView(final.plan)
        assert {a.node_name for a in after.stages.values()} == {"node0", "node2"}
        moved = next(a for a in after.stages.values() if a.node_name == "node2")
        # only the state of the layers node2 took changed hands, fetched by node2 (node0
        # kept both stages' snapshots, its own and as buddy): a whole stage (the slow
        # node's, or node0's when node0 takes the slow node's layers from its buddy copy),
        # or the layers of a re-split (the planner may move the boundary too), each with
        # its layers' weights and SGD momentum buffers, nothing else
        by = [[m.groups() for m in FETCHED.finditer(swarm.log(p)) if m.group(4) == job.id]
              for p in swarm.nodes]
        fetched = by[2]
        assert fetched and not by[0] and not by[1], by
        whole = {k.stage: (a.layer_start, a.layer_end) for k, a in before.stages.items()}
        spans = sorted((int(f[0]), int(f[1] or f[0]) + 1) if f[0] is not None  # "layer 3"
                       else whole[int(f[4])] for f in fetched)
        assert (spans[0][0], spans[-1][1]) == (moved.layer_start, moved.layer_end)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        layers = list(model)[moved.layer_start:moved.layer_end]
        params = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
        assert sum(int(f[7]) for f in fetched) == 2 * params  # weights + momentum
        assert h.bytes_moved > 0


def test_the_drained_node_exits_before_its_timeout():
    """A drained node that runs nothing exits at its next heartbeat, long before
    --drain-timeout; SIGINT stops a node at once (LocalSwarm.close relies on it)."""
    with LocalSwarm(n_nodes=1, lease=5.0) as swarm:
        proc = swarm.nodes[0]
        swarm.faulted.add(proc)
        t0 = time.monotonic()
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 20
        extra = swarm.add_node()
        swarm.wait_for_nodes(1)
        extra.send_signal(2)
        try:
            assert extra.wait(timeout=15) == 0
        except subprocess.TimeoutExpired:
            pytest.fail("SIGINT did not stop the node at once")
