"""A node's data-plane links through a relay are one per (peer, job), tagged (issue 25): the
relay bounds each by its job's share, the homed end learns the job from the relay's OPEN
and refuses frames of any other job on it, replies go back on it, and it resumes, tagged
again, when the relay comes back. A stage's sender and a restoring stage's snapshot fetch
take them.

In one process over real loopback sockets: a :class:`~fedpipe.net.relay.Relay`, a node
"b" (a :class:`DataPlane` homed there by a :class:`~fedpipe.net.relay.Homing`) and
dialers that reach it only at its relayed data address. The NAT network itself is
tests/test_nat.py's.
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from fedpipe.net import timeouts
from fedpipe.net.dataplane import DataPlane, LinkFailed, PeerRefused, Timeouts
from fedpipe.net.dataplane.caps import Sources
from fedpipe.net.dataplane.fetch import Server
from fedpipe.net.relay import Homing, Relay
from fedpipe.node.lifecycle import Stage, StageSlot
from fedpipe.node.peers import ChannelPool, StagePeers
from fedpipe.node.restore import Restorer
from fedpipe.node.snapshots import SnapshotStore
from fedpipe.proto import node_pb2
from fedpipe.spec import StageKey, peer_of
from test_fetch_socket import MODEL, serving_node

pytestmark = pytest.mark.timeout(90)
FAST = Timeouts(credit=20.0, resume=5.0, handshake=5.0, backoff_min=0.02, backoff_max=0.2)


class Inbox:
    """A Receiver that keeps what it is given: (peer name, the link's job, envelope job,
    tensor)."""

    def __init__(self):
        self.got: list[tuple[str, str, str, list[float]]] = []
        self.cond = threading.Condition()

    def admit(self, peer, header):
        return 1 << 20

    def deliver(self, peer, header, tensor):
        with self.cond:
            self.got.append((peer.name, peer.job, header.envelope.job_id, tensor.tolist()))
            self.cond.notify_all()

    def wait(self, n: int) -> list[tuple[str, str, str, list[float]]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, 20), self.got
            return list(self.got)


def env(job: str) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id=job, stage=1, step=0, kind=node_pb2.KIND_ACTIVATION,
                             batch_size=1)


@contextlib.contextmanager
def relayed_node(timeouts_: Timeouts = FAST, server: Server | None = None, **relay_args):
    """Node "b"'s plane homed at a relay (``relay_args``), serving fetches with ``server``:
    yields the relay, b's homing, plane and inbox, and its relayed data address."""
    relay = Relay(**relay_args)
    inbox, sources = Inbox(), Sources()
    plane = DataPlane("b", inbox, timeouts=timeouts_, sources=sources, server=server)
    homing = Homing([relay.address], "b", plane.port, plane.port, sources=sources)
    try:
        alloc = homing.home(timeout=20)
        yield relay, homing, plane, inbox, alloc.data_address
    finally:
        plane.close()
        homing.close()
        relay.close()


def test_links_through_a_relay_are_one_per_job_tagged_and_replies_go_back_on_them():
    with relayed_node() as (relay, _, b, b_in, address), \
            DataPlane("a", a_in := Inbox(), timeouts=FAST) as a:
        one = a.link("b", address, "job-1", relayed=True)
        one.send(torch.ones(2), envelope=env("job-1"), flush=True)
        assert b_in.wait(1) == [("a", "job-1", "job-1", [1.0, 1.0])]
        two = a.link("b", address, "job-2", relayed=True)
        assert two is not one and a.link("b", address, "job-1", relayed=True) is one
        two.send(torch.zeros(1), envelope=env("job-2"), flush=True)
        assert b_in.wait(2)[1] == ("a", "job-2", "job-2", [0.0])
        assert relay.tagged("b") == {"job-1": 1, "job-2": 1}  # what the relay bounds by
        # b answers job 1 on the link a dialed for it, whatever address it is given
        back = b.link("a", "127.0.0.1:1", "job-1")
        back.send(torch.full((1,), 3.0), envelope=env("job-1"), flush=True)
        assert a_in.wait(1) == [("b", "job-1", "job-1", [3.0])]
        assert back.dial is None and len(b.links()) == 2
        assert relay.tagged("b") == {"job-1": 1, "job-2": 1}, "b's reply dialed anew"


def test_a_frame_of_another_job_on_a_jobs_relayed_link_is_refused_naming_both_jobs():
    with relayed_node() as (_, _, b, b_in, address), DataPlane("a", Inbox(),
                                                               timeouts=FAST) as a:
        one = a.link("b", address, "job-1", relayed=True)
        one.send(torch.ones(1), envelope=env("job-2"))
        with pytest.raises(PeerRefused, match="PERMISSION_DENIED.*job 'job-2'.*"
                                              "carries job 'job-1' alone"):
            one.flush()
        one.send(torch.ones(1), envelope=env("job-1"), flush=True)  # the link goes on
        assert b_in.wait(1) == [("a", "job-1", "job-1", [1.0])]
        # and b refuses to smuggle job 2 to a on it too
        back = b.link("a", "127.0.0.1:1", "job-1")
        back.send(torch.ones(1), envelope=env("job-2"))
        with pytest.raises(PeerRefused, match="job 'job-2'.*carries job 'job-1' alone"):
            back.flush()


def test_a_job_past_its_share_of_streams_is_refused_naming_it_and_another_job_flows():
    with relayed_node(max_streams=8, job_streams=1) as (relay, _, _, b_in, address), \
            DataPlane("a", Inbox(), timeouts=FAST) as a, \
            DataPlane("c", Inbox(), timeouts=FAST) as c:
        a.link("b", address, "job-1", relayed=True).send(torch.ones(1), envelope=env("job-1"),
                                                         flush=True)
        with pytest.raises(LinkFailed, match="refused a stream of job 'job-1'.*job 'job-1' "
                                             "has 1 streams spliced"):
            c.link("b", address, "job-1", relayed=True)
        c.link("b", address, "job-2", relayed=True).send(torch.zeros(1), envelope=env("job-2"),
                                                         flush=True)
        assert sorted(g[:3] for g in b_in.wait(2)) == [("a", "job-1", "job-1"),
                                                       ("c", "job-2", "job-2")]
        assert relay.tagged("b") == {"job-1": 1, "job-2": 1}


def test_a_stages_sender_to_a_relayed_peer_dials_its_jobs_own_tagged_link(monkeypatch):
    monkeypatch.setattr(timeouts, "REVERSE_DIAL_WAIT", 0.2)  # b never dials: through its relay
    with relayed_node() as (relay, homing, _, b_in, address), \
            DataPlane("a", Inbox(), timeouts=FAST) as a:
        me = node_pb2.StageAssignment(stage=0, node_id="id-a", node_name="a",
                                      address="a:1", data_address=a.address)
        peer = node_pb2.StageAssignment(stage=1, node_id="id-b", node_name="b", address="b:1",
                                        data_address=address, relay=homing.relay)
        peers = StagePeers(ChannelPool(), plane=a)
        try:
            peers.connect(me, [me, peer], "job-1")
            sender = peers.sender(peer)
            sender.submit(env("job-1"), torch.arange(3.0), "raw")
            sender.flush()
            assert b_in.wait(1) == [("a", "job-1", "job-1", [0.0, 1.0, 2.0])]
            assert relay.tagged("b") == {"job-1": 1}
        finally:
            peers.close()


def test_a_jobs_relayed_link_resumes_tagged_when_the_relay_comes_back():
    slow = Timeouts(credit=60.0, resume=60.0, handshake=10.0, backoff_min=0.05,
                    backoff_max=0.5)
    with relayed_node(slow) as (relay, homing, _, b_in, address), \
            DataPlane("a", Inbox(), timeouts=slow) as a:
        one = a.link("b", address, "job-1", relayed=True)
        one.send(torch.ones(1), envelope=env("job-1"), flush=True)
        relay.close()
        back = Relay(port=relay.port)  # the same relay, restarted: b homes there again
        try:
            deadline = time.monotonic() + 45  # generous: a loaded machine
            while homing.homings < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert homing.homings == 2 and homing.allocation.data_address == address
            one.send(torch.full((1,), 2.0), envelope=env("job-1"), flush=True)
            got = b_in.wait(2)
            assert [g[3] for g in got] == [[1.0], [2.0]], "a tensor lost or repeated"
            assert got[1][:3] == ("a", "job-1", "job-1")
            assert back.tagged("b") == {"job-1": 1}, "the redial was not tagged"
        finally:
            back.close()


def test_a_job_over_closes_its_links_through_the_relay_and_no_others():
    with relayed_node() as (relay, _, _, b_in, address), \
            DataPlane("a", Inbox(), timeouts=FAST) as a:
        for job in ("job-1", "job-2"):
            a.link("b", address, job, relayed=True).send(torch.ones(1), envelope=env(job),
                                                         flush=True)
        two = a.link("b", address, "job-2", relayed=True)
        assert relay.tagged("b") == {"job-1": 1, "job-2": 1}
        assert a.end_job("job-1") == 1 and a.end_job("job-3") == 0
        deadline = time.monotonic() + 20
        while relay.tagged("b") != {"job-2": 1} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.tagged("b") == {"job-2": 1}, "job 1's stream outlived the job"
        two.send(torch.zeros(1), envelope=env("job-2"), flush=True)  # job 2's goes on
        assert [g[2] for g in b_in.wait(3)] == ["job-1", "job-2", "job-2"]


def test_of_two_outbound_only_nodes_the_one_dialed_through_its_relay_uses_that_jobs_link(
        monkeypatch):
    monkeypatch.setattr(timeouts, "REVERSE_DIAL_WAIT", 30.0)  # waited out: the test times out
    with relayed_node() as (relay, homing, b, _, address), \
            DataPlane("a", a_in := Inbox(), timeouts=FAST) as a:
        # a sorts first: it dials b through b's relay; its own relayed address is never used
        pa = node_pb2.StageAssignment(stage=0, node_id="id-a", node_name="a", address="a:1",
                                      data_address="127.0.0.1:1", relay="127.0.0.1:2")
        pb = node_pb2.StageAssignment(stage=1, node_id="id-b", node_name="b", address="b:1",
                                      data_address=address, relay=homing.relay)
        a_peers, b_peers = StagePeers(ChannelPool(), plane=a), StagePeers(ChannelPool(), plane=b)
        try:
            for th in a_peers.connect(pa, [pa, pb], "job-1"):
                th.join(10)
            b_peers.connect(pb, [pa, pb], "job-1")
            started = time.monotonic()
            back = b_peers.sender(pa)  # the link a dialed for job 1: no wait, no dial
            assert time.monotonic() - started < 10 and back.link.dial is None
            back.submit(env("job-1"), torch.ones(2), "raw")
            back.flush()
            assert a_in.wait(1) == [("b", "job-1", "job-1", [1.0, 1.0])]
            assert relay.tagged("b") == {"job-1": 1}
        finally:
            a_peers.close()
            b_peers.close()


@pytest.mark.parametrize("learned_from", ["plan", "snapshot_peers"])
def test_a_restoring_stage_fetches_a_relayed_holders_snapshot_on_its_jobs_tagged_link(
        learned_from):
    receiver, _ = serving_node()  # b keeps job j's stage (0, 1) snapshot of step 3
    with relayed_node(server=receiver) as (relay, homing, _, _, address), \
            DataPlane("node0", Inbox(), timeouts=FAST) as a:
        # no gRPC port at b's address: a failed socket fetch fails the restore at once
        holder = node_pb2.StageAssignment(replica=0, stage=1, node_id="id-b", node_name="b",
                                          address="127.0.0.1:1", data_address=address,
                                          relay=homing.relay)
        load = node_pb2.LoadStageRequest(plan=node_pb2.Plan(stages=[holder])) \
            if learned_from == "plan" else \
            node_pb2.LoadStageRequest(snapshot_peers=[peer_of(holder)])  # the tracker's
        store = SnapshotStore()
        restorer = Restorer(store, ChannelPool(), lambda: a)
        restorer.learn(load)
        module = torch.nn.Sequential(torch.nn.Linear(4, 3))
        stage = Stage(slot=StageSlot("j", 0, 1), n_stages=2, layer_start=0, module=module,
                      steps=10, peers=StagePeers(ChannelPool()), start=3,
                      parts={"module": module[0]})
        restorer.restore(stage, [holder.address])
        assert torch.equal(module[0].weight, MODEL.weight)
        assert store.get("j", StageKey(0, 1), 3) is not None  # kept here, as fetched
        assert relay.tagged("b") == {"j": 1}, "the fetch rode an untagged link"
