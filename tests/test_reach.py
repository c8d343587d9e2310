"""Reachability per link (issue 25), in one process over real sockets on 127.0.0.1: which side
of a link dials when one is outbound-only (behind NAT, homed at a relay), a reachable node
using the link its outbound-only peer dialed instead of the peer's relayed address, the
fallback to that address when the peer never dials, and how status shows such a node.

The NAT network itself (namespaces, a router that forwards no new inbound connection, a
relay) is tests/test_nat.py's.
"""
from __future__ import annotations

import socket
import threading

import pytest
import torch
from rich.console import Console

from fedpipe.net import timeouts
from fedpipe.net.dataplane import DataPlane, Timeouts
from fedpipe.node.peers import ChannelPool, StagePeers, dials, waits_for
from fedpipe.observe import status
from fedpipe.observe.views import swarm_view
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.runtime.stage import StageError

pytestmark = pytest.mark.timeout(60)
FAST = Timeouts(credit=20.0, resume=5.0, handshake=5.0, backoff_min=0.02, backoff_max=0.2)


class Inbox:
    """A Receiver that keeps what it is given, with who sent it."""

    def __init__(self):
        self.got: list[tuple[str, torch.Tensor]] = []
        self.cond = threading.Condition()

    def admit(self, peer, header):
        return 1 << 20

    def deliver(self, peer, header, tensor):
        with self.cond:
            self.got.append((peer.name, tensor))
            self.cond.notify_all()

    def wait(self, n: int) -> list[tuple[str, torch.Tensor]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, 10), self.got
            return list(self.got)


def closed_port() -> str:
    """A loopback address nothing listens on (a relayed address that must not be dialed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def assignment(name: str, stage: int, data_address: str, relay: str = ""
               ) -> node_pb2.StageAssignment:
    return node_pb2.StageAssignment(stage=stage, node_id=f"id-{name}", node_name=name,
                                    address=f"{name}:1", data_address=data_address, relay=relay)


def env(stage: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=stage, step=0, kind=node_pb2.KIND_ACTIVATION,
                             batch_size=1)


def test_where_one_side_is_reachable_the_other_dials_and_of_two_relayed_the_first_name():
    pub, home1, home2 = (assignment("pub", 0, "p:2"), assignment("home1", 1, "r:3", "r:1"),
                         assignment("home2", 2, "r:4", "r:1"))
    assert not dials(pub, home1) and waits_for(pub, home1)          # pub serves, home1 dials
    assert dials(home1, pub) and not waits_for(home1, pub)
    assert dials(home1, home2) and not waits_for(home1, home2)      # both behind NAT: one
    assert not dials(home2, home1) and waits_for(home2, home1)      # dials (through the relay)
    other = assignment("pub2", 2, "q:2")
    assert not dials(pub, other) and not waits_for(pub, other)      # both reachable: as before


def test_a_reachable_node_sends_over_the_link_its_outbound_only_peer_dialed():
    pub_in, home_in = Inbox(), Inbox()
    with DataPlane("pub", pub_in, timeouts=FAST) as pub_plane, \
            DataPlane("home", home_in, timeouts=FAST) as home_plane:
        pub = assignment("pub", 0, pub_plane.address)
        # the relayed address: nothing listens there, so a link the public side dialed fails
        home = assignment("home", 1, closed_port(), relay="127.0.0.1:1")
        home_peers = StagePeers(ChannelPool(), plane=home_plane)
        pub_peers = StagePeers(ChannelPool(), plane=pub_plane)
        try:
            for th in home_peers.connect(home, [pub, home]):
                th.join(10)
            pub_peers.connect(pub, [pub, home])
            sender = pub_peers.sender(home)  # the link home dialed: no wait, no relay
            sender.submit(env(1), torch.arange(4.0), "raw")
            sender.flush()
            assert [(n, t.tolist()) for n, t in home_in.wait(1)] == [("pub", [0, 1, 2, 3])]
            assert sender.link.dial is None, "the public side dialed instead of accepting"
            back = home_peers.sender(pub)  # and the other way over the same connection
            back.submit(env(0), torch.ones(2), "raw")
            back.flush()
            assert [n for n, _ in pub_in.wait(1)] == ["home"]
        finally:
            home_peers.close()
            pub_peers.close()


def test_a_peer_that_never_dials_is_reached_at_its_relayed_address(monkeypatch):
    monkeypatch.setattr(timeouts, "REVERSE_DIAL_WAIT", 0.2)
    pub_in, home_in = Inbox(), Inbox()
    with DataPlane("pub", pub_in, timeouts=FAST) as pub_plane, \
            DataPlane("home", home_in, timeouts=FAST) as home_plane:
        pub = assignment("pub", 0, pub_plane.address)
        # home's own port stands for its relayed one here; home never dials pub
        home = assignment("home", 1, home_plane.address, relay="127.0.0.1:1")
        pub_peers = StagePeers(ChannelPool(), plane=pub_plane)
        try:
            pub_peers.connect(pub, [pub, home])
            sender = pub_peers.sender(home)
            sender.submit(env(1), torch.zeros(3), "raw")
            sender.flush()
            assert [n for n, _ in home_in.wait(1)] == ["pub"]
            assert sender.link.dial is not None, "expected the dialed (relayed) link"
        finally:
            pub_peers.close()


def test_an_outbound_only_node_without_a_socket_data_plane_is_refused_by_name():
    peers = StagePeers(ChannelPool())
    peers.connect(assignment("home", 1, "", relay="127.0.0.1:1"), [])
    with pytest.raises(StageError, match="outbound-only.*this node has none"):
        peers.sender(assignment("pub", 0, "127.0.0.1:9"))
    peers.close()


def test_status_says_a_node_is_outbound_only_and_through_which_relay():
    res = node_pb2.Resources(device="cpu", flops=1e9, memory_bytes=1 << 30)
    nodes = [tracker_pb2.NodeInfo(node_id="n1", name="pub", address="10.0.0.2:5000",
                                  resources=res, alive=True, last_heartbeat=1.0),
             tracker_pb2.NodeInfo(node_id="n2", name="home", address="10.0.0.9:41000",
                                  resources=res, alive=True, last_heartbeat=1.0,
                                  relay="10.0.0.9:7000")]
    view = swarm_view(nodes, [], now=2.0)
    assert [n["reach"] for n in view["nodes"]] == ["direct", "outbound-only via 10.0.0.9:7000"]

    class Source:
        def nodes(self, include_lost=False):
            return nodes

        def links(self):
            return []
    console = Console(width=200, record=True, color_system=None)
    status.run_status(Source(), console=console)
    text = console.export_text()
    assert "outbound-only via 10.0.0.9:7000" in text and "direct" in text, text
