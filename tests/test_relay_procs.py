"""Nodes homed at a `fedpipe relay` process serve the stages of a 3-stage job.

Real processes: a tracker, a relay and three nodes started with ``--relay``. On
loopback the nodes could be dialed directly, so the tests check that they are
not: the tracker lists them at the relay's allocated addresses and names the
relay, and the plan names those addresses, so every connection to a node (the
tracker's, the client's, the peers' gRPC and data-plane ones) is spliced through
the relay. (All three are relayed since the planner prefers direct links, and a
test must know that its stages sit behind the relay; the NAT namespace tests mix
direct and relayed nodes.) The job trains to weights equal to single-process
PyTorch's (sync, no compression), also under mutual TLS (end to end through the
relay) when the relay is killed mid-job and started again on its port: the nodes
re-home on the same ports, peers redial through it, and their data-plane links
resume without losing a tensor.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.net.relay import Homing, Relay
from fedpipe.proc import child_env, free_port
from fedpipe.testing import LocalSwarm
from reference import job_info, max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
BATCH, MICROBATCHES = 16, 4
OPT = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)


def start_relay(swarm: LocalSwarm, port: int):
    """A `fedpipe relay` process on ``port`` (with a certificate of role relay when the swarm
    runs TLS), once it says it listens."""
    tls = []
    if swarm.tls_dir is not None:
        if not (swarm.tls_dir / "relay.crt").exists():
            swarm.issue("relay", "relay")
        tls = ["--tls-dir", str(swarm.tls_dir), "--name", "relay"]
    proc = swarm._spawn("relay", ["relay", "--host", "127.0.0.1", "--port", str(port), *tls])
    deadline = time.monotonic() + 60
    while "fedpipe relay listening" not in swarm.log(proc):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"relay did not start:\n{swarm.log(proc)}")
        time.sleep(0.05)
    return proc


def relayed_swarm(swarm: LocalSwarm, relay: str, relays: str = "") -> dict:
    """Three nodes homed at ``relay`` (``--relay relays``, default ``relay``); return them as
    the tracker lists them, by name."""
    for i in range(3):
        swarm.add_node("--relay", relays or relay)
        swarm.wait_for_nodes(i + 1)
    swarm.wait_for_links()
    nodes = {n.name: n for n in swarm.client().nodes()}
    for i, proc in enumerate(swarm.nodes):
        own = swarm.log(proc).split(" listening on ")[1].split(";")[0]
        n = nodes[f"node{i}"]
        assert n.relay == relay and n.data_address, n
        assert n.address != own, "the node is listed at its relayed address, not its own"
    return nodes


def train(swarm: LocalSwarm, steps: int, at_step=None, moved: bool = False, jobs=None):
    """Train a 3-stage job over the swarm; check its weights against PyTorch's and that its
    plan names the nodes' relayed addresses (``moved``: their addresses when it ended;
    ``jobs``: a list the job is appended to once submitted)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    batches = [(torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,))) for _ in range(steps)]
    loss_fn = nn.CrossEntropyLoss()
    expected = single_process(model, loss_fn, OPT, batches)
    client = swarm.client()
    nodes = {n.node_id: n for n in client.nodes()}
    inj = swarm.inject()
    if at_step is not None:
        inj.at_step(*at_step)
    job = client.submit(model, loss_fn, OPT, inj.feed(batches), steps=steps,
                        microbatches=MICROBATCHES, schedule="1f1b", stages=3,
                        compression="none", rebalance="never")
    if jobs is not None:
        jobs.append(job)
    inj.start(job.id)
    status = job.wait(timeout=180, progress=False)
    inj.stop()
    assert len(inj.fired) == len(inj.plans), inj.fired
    assert status.state == "SUCCEEDED" and status.step == steps, status
    assert len(status.plan.stages) == 3, status.plan
    if moved:
        nodes = {n.node_id: n for n in client.nodes()}
    for a in status.plan.stages:  # each stage planned at its node's relayed addresses
        assert (a.address, a.data_address) == (nodes[a.node_id].address,
                                               nodes[a.node_id].data_address), a
    got = job.state_dict()
    job.release()
    assert max_relative_difference(got, model.state_dict()) > 1e-3
    assert max_relative_difference(got, expected) <= 1e-5
    return status


def test_a_job_whose_nodes_are_all_relayed_trains_exactly_as_pytorch():
    with LocalSwarm(n_nodes=0) as swarm:
        relay = f"127.0.0.1:{free_port()}"
        start_relay(swarm, int(relay.rpartition(':')[2]))
        relayed_swarm(swarm, relay)
        status = train(swarm, steps=3)
        assert not status.recoveries


def test_relayed_nodes_data_links_are_tagged_with_their_job_and_end_with_it():
    """The relay (in this process, to read its counts) splices the nodes' data-plane links
    as their job's (each dialed with a TAG naming it: one per peer and job, bounded by the
    job's share), and they end when the job is released."""
    relay = Relay()
    try:
        with LocalSwarm(n_nodes=0) as swarm:
            nodes = relayed_swarm(swarm, relay.address)
            seen: list[dict[str, dict[str, int]]] = []
            jobs: list = []
            train(swarm, steps=4, jobs=jobs, at_step=(2, "count the relay's tagged streams",
                                                      lambda: seen.append(
                                                          {n: relay.tagged(n) for n in nodes})))
            job = jobs[0].id
            tagged = [t for by_node in seen for t in by_node.values() if t]
            # the pipeline's two links, each dialed by the node whose name sorts first
            assert sum(t.get(job, 0) for t in tagged) >= 2, seen
            assert all(set(t) == {job} for t in tagged), seen
            deadline = time.monotonic() + 30
            while any(relay.tagged(n) for n in nodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(relay.tagged(n) for n in nodes), "a released job's links stayed"
    finally:
        relay.close()


def test_a_relay_killed_mid_job_and_restarted_loses_no_tensor_under_mutual_tls():
    with LocalSwarm(n_nodes=0, tls=True) as swarm:
        port = free_port()
        relay = f"127.0.0.1:{port}"
        proc = start_relay(swarm, port)
        before = relayed_swarm(swarm, relay)

        def kill_and_restart():
            swarm.stop_process(proc, kill=True)
            time.sleep(0.5)  # peers see their connections through it break
            start_relay(swarm, port)
        status = train(swarm, steps=8, at_step=(3, "kill the relay", kill_and_restart))
        assert not status.recoveries, "a relay back within the lease is no node loss"
        after = {n.name: n for n in swarm.client().nodes()}
        assert {n: (a.node_id, a.address, a.data_address) for n, a in after.items()} == \
            {n: (b.node_id, b.address, b.data_address) for n, b in before.items()}
        for proc in swarm.nodes:  # each re-homed once, on its old ports
            assert swarm.log(proc).count(f"homed at relay {relay}") == 2, swarm.log(proc)


def test_nodes_whose_relay_stays_away_move_to_the_next_and_the_job_recovers_exactly(
        monkeypatch):
    """Each node keeps its id at the next relay's addresses; the job's plan follows them in
    its epoch, the links redial there and resend what was cut: no recovery, no rewind."""
    monkeypatch.setenv("FEDPIPE_RELAY_FAILOVER", "1")  # the nodes' wait for their first relay
    with LocalSwarm(n_nodes=0) as swarm:
        first, second = free_port(), free_port()
        relays = f"127.0.0.1:{first},127.0.0.1:{second}"
        proc = start_relay(swarm, first)
        start_relay(swarm, second)
        before = relayed_swarm(swarm, relays.split(",")[0], relays)
        status = train(swarm, steps=8, at_step=(
            3, "kill the first relay", lambda: swarm.stop_process(proc, kill=True)),
            moved=True)
        assert not status.recoveries, "a node that moved relays is no node loss"
        assert status.plan.epoch == 0, status.plan
        after = {n.name: n for n in swarm.client().nodes()}
        assert sorted(after) == sorted(before)
        for name, n in after.items():
            assert n.relay == f"127.0.0.1:{second}" and n.node_id == before[name].node_id
            assert n.address.rpartition(":")[2] != before[name].address.rpartition(":")[2]


def test_a_node_whose_relays_all_refuse_it_exits_naming_each_reason():
    full = Relay(max_nodes=1)
    other = Homing([full.address], "n0", free_port(), None)  # takes the one place
    other.home(timeout=30)
    try:
        out = subprocess.run([sys.executable, "-m", "fedpipe", "node", "--tracker", "127.0.0.1:1",
                              "--host", "127.0.0.1", "--name", "n1", "--device", "cpu",
                              "--relay", full.address], capture_output=True, text=True,
                             timeout=120, env=child_env(1))
    finally:
        other.close()
        full.close()
    assert out.returncode == 1, out.stderr[-2000:]
    assert (f"RelayRefused: relay {full.address} refused node 'n1': relay {full.address} "
            "homes 1 nodes, its limit") in out.stderr, out.stderr[-2000:]


def test_a_relay_without_tls_on_a_public_address_is_refused_at_start():
    out = subprocess.run([sys.executable, "-m", "fedpipe", "relay", "--host", "0.0.0.0",
                          "--port", "0"], capture_output=True, text=True, timeout=60,
                         env=child_env(1))
    assert out.returncode == 1 and "without TLS" in out.stderr, out.stderr[-2000:]


def test_a_drained_relayed_nodes_stage_state_is_fetched_over_the_socket_plane_via_its_relay():
    """A drain hands a relayed node's stage over to the spare: the spare fetches the
    stage's state at the cut from the draining node through the relay's data port
    (FRAMES.md, "Fetches"), not its relayed gRPC port; the job ends exact, and the
    client fetches its weights over the socket plane too."""
    with LocalSwarm(n_nodes=0) as swarm:
        relay = f"127.0.0.1:{free_port()}"
        start_relay(swarm, int(relay.rpartition(":")[2]))
        for i in range(4):
            swarm.add_node("--relay", relay)
            swarm.wait_for_nodes(i + 1)
        swarm.wait_for_links()
        client = swarm.client()
        drained: list[str] = []
        jobs: list = []

        def drain() -> None:
            plan = job_info(client, jobs[0]).plan
            victim = next(a for a in plan.stages if a.stage == 1)
            drained.append(victim.address)
            client.drain(victim.node_name)
        status = train(swarm, steps=8, at_step=(3, "drain stage 1's node", drain), jobs=jobs)
        assert [r.cause for r in status.recoveries] == ["drain"], status.recoveries
        fetched = [line for p in swarm.nodes for line in swarm.log(p).splitlines()
                   if "fetched the step" in line]
        assert len(fetched) == 1, fetched
        # from the draining node (in no plan the spare was given but the old one), over
        # the socket plane: gRPC's FetchSnapshot would end the line "over gRPC"
        assert f"from {drained[0]}: " in fetched[0], fetched  # its relayed gRPC address
        assert fetched[0].endswith("over the socket data plane"), fetched
        # and the client's state_dict (train's check) came over it too, a stage each
        served = [line for p in swarm.nodes for line in swarm.log(p).splitlines()
                  if re.search(r"serving FetchState to \S+#\w+ ", line)]
        assert len(served) == 3 and all(line.endswith("over the socket data plane")
                                        for line in served), served
