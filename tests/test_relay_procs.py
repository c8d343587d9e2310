"""A node homed at a `fedpipe relay` process serves a stage of a 3-stage job.

Real processes: a tracker, a relay and three nodes, node1 started with
``--relay``. On loopback node1 could be dialed directly, so the tests check that
it is not: the tracker lists it at the relay's allocated addresses and names the
relay, and every plan names those addresses. The job trains to weights equal to
single-process PyTorch's (sync, no compression), also when the relay is killed
mid-job and started again on its port: node1 re-homes on the same ports, peers
redial through it and their data-plane links resume without losing a tensor.
(The namespace test with real NAT is ``tests/test_nat.py``'s.)
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.proc import free_port
from fedpipe.testing import LocalSwarm
from reference import max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
BATCH, MICROBATCHES = 16, 4
OPT = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)


def start_relay(swarm: LocalSwarm, port: int):
    """A `fedpipe relay` process on ``port``, once it says it listens."""
    proc = swarm._spawn("relay", ["relay", "--host", "127.0.0.1", "--port", str(port),
                                  *swarm._tls_args()])
    deadline = time.monotonic() + 60
    while "fedpipe relay listening" not in swarm.log(proc):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"relay did not start:\n{swarm.log(proc)}")
        time.sleep(0.05)
    return proc


def relayed_swarm(swarm: LocalSwarm, relay: str) -> None:
    """Three nodes, the middle one homed at ``relay``."""
    for i in range(3):
        swarm.add_node(*(["--relay", relay] if i == 1 else []))
        swarm.wait_for_nodes(i + 1)
    swarm.wait_for_links()


def check_relayed(swarm: LocalSwarm, relay: str) -> None:
    nodes = {n.name: n for n in swarm.client().nodes()}
    host = relay.rpartition(":")[0]
    assert nodes["node1"].relay == relay, nodes["node1"]
    assert nodes["node1"].address.startswith(host + ":") and nodes["node1"].data_address
    assert nodes["node0"].relay == "" and nodes["node2"].relay == ""
    log = swarm.log(swarm.nodes[1])
    assert f"homed at relay {relay}" in log, log[-3000:]


def train(swarm: LocalSwarm, steps: int, at_step=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    batches = [(torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,))) for _ in range(steps)]
    loss_fn = nn.CrossEntropyLoss()
    expected = single_process(model, loss_fn, OPT, batches)
    client = swarm.client()
    middle = {n.name: n for n in client.nodes()}["node1"]
    job = client.submit(model, loss_fn, OPT, batches, steps=steps, microbatches=MICROBATCHES,
                        schedule="1f1b", stages=3, compression="none")
    inj = None
    if at_step is not None:
        inj = swarm.inject(job.id)
        inj.at_step(*at_step).start()
    status = job.wait(timeout=180, progress=False)
    if inj is not None:
        inj.stop()
        assert len(inj.fired) == 1, inj.fired
    assert status.state == "SUCCEEDED" and status.step == steps, status
    relayed = [a for a in status.plan.stages if a.node_id == middle.node_id]
    assert len(relayed) == 1 and len(status.plan.stages) == 3, status.plan
    assert (relayed[0].address, relayed[0].data_address) == \
        (middle.address, middle.data_address), "its stage is planned at the relay's addresses"
    got = job.state_dict()
    job.release()
    assert max_relative_difference(got, model.state_dict()) > 1e-3
    assert max_relative_difference(got, expected) <= 1e-5
    return status


def test_a_job_with_a_relayed_stage_trains_exactly_as_pytorch():
    with LocalSwarm(n_nodes=0) as swarm:
        relay = f"127.0.0.1:{free_port()}"
        start_relay(swarm, int(relay.rpartition(':')[2]))
        relayed_swarm(swarm, relay)
        check_relayed(swarm, relay)
        status = train(swarm, steps=3)
        assert not status.recoveries


def test_a_relay_killed_mid_job_and_restarted_loses_no_tensor():
    with LocalSwarm(n_nodes=0) as swarm:
        port = free_port()
        relay = f"127.0.0.1:{port}"
        proc = start_relay(swarm, port)
        relayed_swarm(swarm, relay)
        before = {n.name: n for n in swarm.client().nodes()}["node1"]

        def kill_and_restart():
            swarm.stop_process(proc, kill=True)
            time.sleep(0.5)  # peers see their connections through it break
            start_relay(swarm, port)
        status = train(swarm, steps=8, at_step=(3, "kill the relay", kill_and_restart))
        assert not status.recoveries, "a relay back within the lease is no node loss"
        after = {n.name: n for n in swarm.client().nodes()}["node1"]
        assert (after.node_id, after.address, after.data_address) == \
            (before.node_id, before.address, before.data_address)
        assert swarm.log(swarm.nodes[1]).count(f"homed at relay {relay}") == 2
