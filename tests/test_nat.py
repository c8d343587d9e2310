"""Nodes behind a real NAT (issue 25): network namespaces, a router that masquerades its homes
and forwards no new inbound connection (fedpipe.testing.natnet, checked by its verify()), a
`fedpipe relay` in the public namespace, and 3-stage sync jobs trained to weights equal to
single-process PyTorch's (1e-5, no compression):

* an outbound-only node as the middle stage: it dials its reachable neighbours' data ports
  itself (a reverse, direct connection), and the tracker reaches it through its relay;
* two outbound-only nodes in two homes, joined through the relay (plaintext, and under mutual
  TLS, which runs end to end through the relay).

An emulated slow link (--link-profile) between the two nodes that must not be neighbours
makes the planner put the intended node in the middle. Needs root, ip and iptables
(``sh tools/setup-test-deps.sh``); skipped otherwise, saying which.
"""
from __future__ import annotations

import pytest

from fedpipe.testing import natclient
from fedpipe.testing.natnet import NatNetwork, missing
from fedpipe.testing.natswarm import NatSwarm
from reference import max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
SLOW = {"mbps": 5, "latency_ms": 150}
"""The emulated link between the two nodes the planner must not make neighbours."""


@pytest.fixture(scope="module")
def network():
    why = missing()
    if why:
        pytest.skip(why)
    with NatNetwork() as net:
        net.verify()  # a home dials out, and cannot be dialed from public or the other home
        yield net


def expected() -> dict:
    model, loss_fn, data = natclient.job()
    return single_process(model, loss_fn, natclient.OPT, data)


def trained(swarm: NatSwarm, tmp_path, middle: str) -> dict:
    """Run the job; check it succeeded with ``middle`` as stage 1 and exact weights."""
    got = swarm.run_client(tmp_path / "result.pt")
    assert got["state"] == "SUCCEEDED", f"{got['state']}: {got['reason']}\n{swarm.logs()}"
    assert got["plan"][1] == middle, got["plan"]
    model, _, _ = natclient.job()
    assert max_relative_difference(got["weights"], model.state_dict()) > 1e-3  # it trained
    assert max_relative_difference(got["weights"], expected()) <= 1e-5
    return got


def test_an_outbound_only_middle_stage_dials_its_neighbours_directly(network, tmp_path):
    pub, (home1, _) = network.public, network.homes
    profile = {"links": [{"from": "pub0", "to": "pub2", **SLOW}]}
    with NatSwarm(network, tmp_path, link_profile=profile) as swarm:
        swarm.start_tracker()
        relay = swarm.start_relay()
        swarm.add_node("pub0", pub)
        swarm.add_node("home1", home1, relay=relay)
        swarm.add_node("pub2", pub)
        nodes = swarm.wait_for_nodes({"pub0", "home1", "pub2"})
        assert nodes["home1"]["relay"] == relay and nodes["home1"]["address"].startswith(
            pub.ip + ":"), nodes["home1"]
        assert "relay" not in nodes["pub0"]  # empty: not listed
        shown = swarm.status()
        assert f"outbound-only via {relay}" in shown.stdout, shown.stdout + shown.stderr
        trained(swarm, tmp_path, "home1")
        for name in ("pub0", "pub2"):  # the reverse connection, not the relay, carried it
            log = swarm.log(name)
            assert "data link to home1: it dialed this node" in log, swarm.logs()
            assert "did not dial this node" not in log, log[-3000:]


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_two_outbound_only_nodes_train_through_a_relay(network, tmp_path, tls):
    pub, (home1, home2) = network.public, network.homes
    profile = {"links": [{"from": "pub0", "to": "home2", **SLOW}]}
    with NatSwarm(network, tmp_path, tls=tls, link_profile=profile) as swarm:
        swarm.start_tracker()
        relay = swarm.start_relay()
        swarm.add_node("pub0", pub)
        swarm.add_node("home1", home1, relay=relay)
        swarm.add_node("home2", home2, relay=relay)
        nodes = swarm.wait_for_nodes({"pub0", "home1", "home2"})
        assert nodes["home1"]["relay"] == nodes["home2"]["relay"] == relay
        trained(swarm, tmp_path, "home1")
        # home1 and home2 cannot reach each other: home1 (the first name) dialed home2
        # through the relay, and home2 took that link rather than dialing back
        assert "data link to home1: it dialed this node" in swarm.log("home2"), swarm.logs()
        assert "data link to home1: it dialed this node" in swarm.log("pub0"), swarm.logs()
