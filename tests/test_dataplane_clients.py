"""Clients on the socket data plane under mutual TLS, in one process over real sockets on
127.0.0.1: two clients holding one certificate (two ``Client`` objects of one user, in one
process or several) each get a link of their own at a node, so neither replaces the other's
connection nor resets where the other's tensors resume, and each tensor is delivered once;
a ``Client`` feeds over the socket plane unless told not to; and a client may put
snapshots (restoring a saved checkpoint) of its own jobs only, by its certificate."""
from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.client import Client
from fedpipe.client.links import NoInbound
from fedpipe.net.dataplane import DataPlane, Timeouts, client_name
from fedpipe.proto import node_pb2
from fedpipe.security import TlsConfig

pytestmark = pytest.mark.timeout(60)
FAST = Timeouts(credit=20.0, resume=5.0, handshake=5.0, backoff_min=0.02, backoff_max=0.2)
STEPS = 40


class Kept:
    """A node's Receiver: every delivered target as (the sender's name, its step)."""

    def __init__(self):
        self.got: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def admit(self, peer, header):
        return 1 << 20

    def deliver(self, peer, header, tensor):
        with self.lock:
            self.got.append((peer.name, header.envelope.step))


class Breaks:
    """A client's LinkEvents: the connections that broke under it."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def lost(self, peer, why):
        self.seen.append((peer, why))

    def failed(self, peer, why):
        self.seen.append((peer, why))


def target(step: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=1, step=step, kind=node_pb2.KIND_TARGET,
                             batch_size=2)


def test_two_clients_of_one_certificate_get_a_link_each_and_every_tensor_arrives_once(ca_dir):
    kept = Kept()
    alice = TlsConfig.load(ca_dir, "alice")
    breaks = [Breaks(), Breaks()]
    with DataPlane("node0", kept, tls=TlsConfig.load(ca_dir, "node0"), timeouts=FAST) as node:
        clients = [DataPlane(client_name("alice"), NoInbound(), role="client", listen=False,
                             tls=alice, events=b, timeouts=FAST) for b in breaks]
        try:
            links = [c.link("node0", node.address) for c in clients]
            for step in range(STEPS):  # interleaved, each answered as the feed's sends are
                for link in links:
                    link.send(torch.zeros(2), envelope=target(step), flush=True)
            names = [c.name for c in clients]
            # a link each at the node, named as each client's preface names it
            assert sorted(link.peer_name for link in node.links()) == sorted(names)
            assert all(link.conn is not None for link in node.links())
        finally:
            for c in clients:
                c.close()
    # neither client's connection was replaced by the other's (each redial would reset
    # where its tensors resume at the node, and deliver a tensor twice)
    assert breaks[0].seen == [] and breaks[1].seen == []
    for name in names:
        assert [step for who, step in kept.got if who == name] == list(range(STEPS))
    assert len(kept.got) == 2 * STEPS


def test_a_client_feeds_over_sockets_unless_told_not_to():
    with Client("127.0.0.1:1", tls=None) as default, \
            Client("127.0.0.1:1", tls=None, sockets=False) as grpc_only:
        plane = default.data_plane()
        assert plane is not None and plane.role == "client" and plane.port == 0  # dials only
        assert grpc_only.data_plane() is None


def test_a_client_puts_snapshots_of_its_own_job_only_by_its_certificate(ca_dir):
    import grpc

    from fedpipe.client import links
    from fedpipe.node.access import JobAccessBook
    from fedpipe.node.dataplane import NodeReceiver
    from fedpipe.node.snapshots import SnapshotDesk, SnapshotStore
    from fedpipe.runtime import checkpoint
    from fedpipe.spec import StageKey
    access = JobAccessBook()
    access.learn("j", "alice", ["node0"], [StageKey(0, 1)])  # alice's job
    store = SnapshotStore()
    r = NodeReceiver(access, None, None, desk=SnapshotDesk(  # type: ignore[arg-type]
        store, lambda job: job == "j", 1 << 30))
    snap = checkpoint.take({"module": torch.nn.Linear(4, 3)}, 5)
    env = node_pb2.Envelope(job_id="j", replica=0, stage=1, kind=node_pb2.KIND_SNAPSHOT,
                            step=5, batch_size=1)
    with DataPlane("node0", r, tls=TlsConfig.load(ca_dir, "node0"), timeouts=FAST) as node:
        a = node_pb2.StageAssignment(replica=0, stage=1, node_name="node0",
                                     data_address=node.address)
        with links.client_plane(TlsConfig.load(ca_dir, "bob")) as bob:
            with pytest.raises(links.LinkError) as e:
                links.put_snapshot(bob, a, env, snap)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
        assert "client 'bob' is not the owner of job j" in e.value.details()
        assert store.get("j", StageKey(0, 1), 5) is None
        with links.client_plane(TlsConfig.load(ca_dir, "alice")) as alice:
            links.put_snapshot(alice, a, env, snap)
    kept = store.get("j", StageKey(0, 1), 5)
    assert kept is not None and torch.equal(kept.tensors["module/weight"],
                                            snap.tensors["module/weight"])
