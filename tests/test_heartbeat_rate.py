"""A tracker for large swarms: the heartbeat interval scales with the swarm, registrations are
admitted a few at a time, candidates are chosen in linear time."""
from __future__ import annotations

import threading

import grpc
import pytest

from fedpipe import net
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from fedpipe.tracker.registry import HEARTBEATS_PER_LEASE, Registry
from fedpipe.tracker.scheduler import Tracker
from fedpipe.tracker.store import MemoryStore, SqliteStore, Store
from tracker_fakes import FakeClock, FakeNodes, registration

pytestmark = pytest.mark.timeout(60)


def rated(rate: float, lease: float = 8.0, store: Store | None = None,
          clock: FakeClock | None = None) -> tuple[Tracker, FakeClock]:
    """A thread-less tracker over fake nodes that asks for at most ``rate`` heartbeats/s."""
    clock = clock or FakeClock()
    store = store or MemoryStore()
    tracker = Tracker(store, FakeNodes(clock, store), lease=lease, clock=clock,
                      background=False, heartbeat_rate=rate)
    return tracker, clock


def register(tracker: Tracker, n: int, first: int = 0) -> list[str]:
    return [tracker.register(registration(f"n{i}", 7000 + i)) for i in range(first, first + n)]


def test_a_small_swarm_heartbeats_at_a_quarter_of_the_base_lease():
    tracker, _ = rated(rate=10.0, lease=8.0)  # binds above 10 * 8 / 4 = 20 nodes
    register(tracker, 20)
    r = tracker.registry
    assert (r.lease_seconds, r.heartbeat_seconds) == (8.0, 2.0)


@pytest.mark.parametrize("n", [21, 100, 1000])
def test_a_large_swarm_is_told_a_longer_interval_so_all_its_heartbeats_fit_the_rate(n):
    tracker, _ = rated(rate=10.0, lease=8.0)
    register(tracker, n)
    r = tracker.registry
    assert r.heartbeat_seconds == pytest.approx(n / 10.0)
    assert r.lease_seconds == pytest.approx(HEARTBEATS_PER_LEASE * r.heartbeat_seconds)
    assert n / r.heartbeat_seconds == pytest.approx(10.0)  # the swarm's heartbeats per second


def test_a_node_is_held_to_the_longer_lease_it_was_told_after_the_swarm_shrinks():
    tracker, clock = rated(rate=1.0, lease=8.0)
    ids = register(tracker, 8)
    r = tracker.registry
    assert r.lease_seconds == 32.0
    slow = ids[0]
    assert r.heartbeat(slow)  # told: heartbeat every 8 s, lease 32 s
    for i in ids[1:]:
        assert r.leave(i)
    assert r.lease_seconds == 8.0  # the next heartbeat hears the base lease again
    clock.advance(31.0)  # the base lease has long run out, the one it was told has not
    assert r.expire() == set()
    assert r.heartbeat(slow)  # now held to 8 s
    clock.advance(8.5)
    assert r.expire() == {slow}
    assert tracker.store.nodes() == []


def test_a_node_told_a_short_lease_before_the_swarm_grew_is_lost_when_that_one_runs_out():
    tracker, clock = rated(rate=1.0, lease=8.0)
    first = register(tracker, 1)[0]  # told 8 s
    register(tracker, 7, first=1)  # the swarm now gets 32 s on its next heartbeats
    clock.advance(8.5)
    assert first in tracker.registry.expire()


def test_a_restarted_tracker_gives_every_live_node_the_lease_of_the_whole_swarm(tmp_path):
    path = str(tmp_path / "t.db")
    store = SqliteStore(path)
    tracker, clock = rated(rate=1.0, lease=8.0, store=store)
    ids = register(tracker, 8)  # lease 32 s
    tracker.close()
    store.close()
    store = SqliteStore(path)
    again, _ = rated(rate=1.0, lease=8.0, store=store, clock=clock)
    clock.advance(20.0)  # nodes heartbeat every 8 s; 20 s without one is within 32 s
    assert again.registry.expire() == set()
    assert {n.node_id for n in store.nodes()} == set(ids)
    store.close()


@pytest.mark.parametrize("lease,rate", [(0.0, 10.0), (8.0, 0.0), (8.0, -1.0)])
def test_a_lease_or_rate_that_is_not_positive_is_refused_naming_both(lease, rate):
    with pytest.raises(ValueError, match=rf"got lease {lease} s and rate {rate}/s"):
        Registry(MemoryStore(), lease, lambda ids, why: None, rate=rate)


class Pinged(node_pb2_grpc.NodeServicer):
    """A node address that answers the tracker's registration Ping, and nothing else."""

    def Ping(self, request, context):
        return node_pb2.PingReply()


@pytest.mark.processes  # serve() starts the tracker's planner worker process
def test_registration_and_heartbeat_replies_over_grpc_carry_the_scaled_interval(tmp_path):
    from fedpipe.tracker.service import serve

    nodes = net.server(max_workers=4)
    node_pb2_grpc.add_NodeServicer_to_server(Pinged(), nodes)
    ports = [net.bind(nodes, "127.0.0.1", 0) for _ in range(3)]
    nodes.start()
    srv, service, port = serve("127.0.0.1", 0, str(tmp_path / "tracker.db"), lease=8.0,
                               heartbeat_rate=1.0)
    channel = net.channel(f"127.0.0.1:{port}")
    try:
        stub = tracker_pb2_grpc.TrackerStub(channel)
        replies = [stub.RegisterNode(registration(f"n{i}", p), timeout=30)
                   for i, p in enumerate(ports)]
        # the first two joined a swarm within the base lease; the third one above it
        assert [(r.lease_seconds, r.heartbeat_seconds) for r in replies] == \
            [(8.0, 2.0), (8.0, 2.0), (12.0, 3.0)]
        hb = stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=replies[0].node_id), timeout=10)
        assert hb.known and (hb.lease_seconds, hb.heartbeat_seconds) == (12.0, 3.0)
    finally:
        channel.close()
        service.close()
        srv.stop(grace=0).wait()
        service.store.close()
        nodes.stop(grace=0).wait()



def test_candidates_are_the_fastest_nodes_ties_to_the_oldest_in_registration_order():
    import random

    from fedpipe.tracker.scheduler import candidates

    rng = random.Random(7)
    nodes = [tracker_pb2.NodeInfo(node_id=f"n{i}", resources=node_pb2.Resources(
        flops=rng.choice([1e9, 2e9, 3e9]), memory_bytes=rng.choice([2**30, 2**31])))
        for i in range(1000)]
    chosen = candidates(nodes, limit=50)
    # the rule, spelled out as a full sort
    rank = sorted(range(len(nodes)), key=lambda i: (-nodes[i].resources.flops,
                                                    -nodes[i].resources.memory_bytes, i))
    assert [n.node_id for n in chosen] == [nodes[i].node_id for i in sorted(rank[:50])]
    assert candidates(nodes[:50], limit=50) == nodes[:50]


class GatedPing(node_pb2_grpc.NodeServicer):
    """Node addresses whose Ping answers only once ``gate`` is set (after ``opened`` first
    pings it answers at once)."""

    def __init__(self, opened: int):
        self.gate, self.opened, self.lock = threading.Event(), opened, threading.Lock()
        self.waiting = threading.Semaphore(0)

    def Ping(self, request, context):
        with self.lock:
            self.opened -= 1
            free = self.opened >= 0
        if not free:
            self.waiting.release()
            self.gate.wait(10)
        return node_pb2.PingReply()


@pytest.mark.processes  # serve() starts the tracker's planner worker process
def test_registrations_beyond_the_limit_are_refused_unavailable_and_heartbeats_go_on(tmp_path):
    from fedpipe.tracker.service import MAX_REGISTERING, serve

    pinged = GatedPing(opened=1)
    nodes = net.server(max_workers=MAX_REGISTERING + 8)
    node_pb2_grpc.add_NodeServicer_to_server(pinged, nodes)
    ports = [net.bind(nodes, "127.0.0.1", 0) for _ in range(MAX_REGISTERING + 2)]
    nodes.start()
    srv, service, port = serve("127.0.0.1", 0, str(tmp_path / "tracker.db"), lease=8.0)
    channel = net.channel(f"127.0.0.1:{port}")
    stub = tracker_pb2_grpc.TrackerStub(channel)
    try:
        first = stub.RegisterNode(registration("n0", ports[0]), timeout=10).node_id
        held = [stub.RegisterNode.future(registration(f"n{i}", ports[i]), timeout=30)
                for i in range(1, MAX_REGISTERING + 1)]
        for _ in held:  # every admitted registration is dialling its node
            assert pinged.waiting.acquire(timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterNode(registration("late", ports[-1]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"registering {MAX_REGISTERING} nodes already" in refused.value.details()
        assert stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=first), timeout=5).known
        pinged.gate.set()
        assert len({f.result().node_id for f in held}) == MAX_REGISTERING
        assert stub.RegisterNode(registration("late", ports[-1]), timeout=10).node_id
    finally:
        pinged.gate.set()
        channel.close()
        service.close()
        srv.stop(grace=0).wait()
        service.store.close()
        nodes.stop(grace=0).wait()


def test_a_refresh_round_is_paced_and_a_node_that_joins_is_measured_between_two_paces():
    tracker, clock = rated(rate=500.0, lease=8.0)
    register(tracker, 6)
    tracker.measure_links()
    nodes = tracker.nodes
    links = tracker.links
    links.refresh_all()
    waits: list[tuple[float, int]] = []
    late = {}

    def wait(gap: float) -> bool:
        waits.append((gap, len(nodes.measured)))
        if len(waits) == 2:  # a node joins mid-round: measured next, not after the round
            late["id"] = tracker.register(registration("late", 7100))
            late["before"] = len(nodes.measured)
        return False

    before = len(nodes.measured)
    taken, errors = links.run(gap=0.5, wait=wait)
    assert errors == []
    assert [gap for gap, _ in waits] == [0.5] * 6  # one pace after each of the 6 re-measurements
    assert [n for _, n in waits][:2] == [before + 1, before + 2]  # one call per pace
    # the newcomer (and the neighbours it changed) went next, with no pace between them
    pending = taken - 6
    assert pending >= 1 and waits[2][1] == late["before"] + pending + 1
    assert "127.0.0.1:7100" in nodes.measured[late["before"]:late["before"] + pending]
    assert not links.waiting([late["id"]])


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_links_among_some_nodes_are_those_with_both_ends_among_them_latest_first_ordered(
        kind, tmp_path):
    store = MemoryStore() if kind == "memory" else SqliteStore(str(tmp_path / "t.db"))
    ids = [f"n{i}" for i in range(6)]
    store.set_links([node_pb2.LinkMeasurement(src_id=a, dst_id=b, bandwidth=1e6 * (i + 1),
                                              latency=1e-3, measured_at=1.0)
                     for i, (a, b) in enumerate((a, b) for a in ids for b in ids if a != b)])
    store.set_links([node_pb2.LinkMeasurement(src_id="n2", dst_id="n1", bandwidth=5.0,
                                              latency=2e-3, measured_at=2.0)])
    among = store.links_among(iter(["n2", "n1", "n4", "nobody"]))
    assert [(m.src_id, m.dst_id) for m in among] == [
        ("n1", "n2"), ("n1", "n4"), ("n2", "n1"), ("n2", "n4"), ("n4", "n1"), ("n4", "n2")]
    assert among == [m for m in store.links() if {m.src_id, m.dst_id} <= {"n1", "n2", "n4"}]
    assert next(m for m in among if m.src_id == "n2" and m.dst_id == "n1").bandwidth == 5.0
    assert store.links_among([]) == []


def _bare(nodes: list[tracker_pb2.NodeInfo]) -> list[bytes]:
    """The messages without last_heartbeat (the registry's copy does not keep it)."""
    out = []
    for n in nodes:
        m = tracker_pb2.NodeInfo()
        m.CopyFrom(n)
        m.last_heartbeat = 0.0
        out.append(m.SerializeToString())
    return out


def test_the_registrys_live_nodes_are_the_stores_through_joins_losses_renewals_and_a_restart(
        tmp_path):
    path = str(tmp_path / "t.db")
    store = SqliteStore(path)
    tracker, clock = rated(rate=100.0, lease=8.0, store=store)
    ids = register(tracker, 6)
    r = tracker.registry
    assert _bare(r.nodes()) == _bare(store.nodes())
    assert r.leave(ids[2])
    assert _bare(r.nodes()) == _bare(store.nodes())
    # the same incarnation registers again with more memory: the copy follows
    again = registration("n4", 7004, memory=2**34)
    assert tracker.register(again) == ids[4]
    assert [n.resources.memory_bytes for n in r.nodes() if n.node_id == ids[4]] == [2**34]
    clock.advance(9.0)
    for i in ids[:2]:
        assert r.heartbeat(i)
    assert r.expire() == {ids[3], ids[4], ids[5]}
    assert _bare(r.nodes()) == _bare(store.nodes())
    tracker.close()
    store.close()
    store = SqliteStore(path)
    restarted, _ = rated(rate=100.0, lease=8.0, store=store, clock=clock)
    assert _bare(restarted.registry.nodes()) == _bare(store.nodes())
    store.close()


class CountingStore(MemoryStore):
    """A store that counts the reads of every node (O(n) each)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def node_records(self, include_lost=False):
        self.reads += 1
        return super().node_records(include_lost)


def test_a_scheduler_tick_reads_no_node_list_from_the_store_with_or_without_a_pending_job():
    from tracker_fakes import submission

    store = CountingStore()
    tracker, clock = rated(rate=100.0, store=store)
    register(tracker, 20)
    tracker.measure_links()
    store.reads = 0
    for _ in range(3):  # nothing pending: O(due leases), no node list
        tracker.tick()
        clock.advance(1.0)
    assert store.reads == 0
    job_id = tracker.jobs.submit(submission())
    tracker.tick()  # plans and deploys the job over the registry's nodes
    assert tracker.jobs.get(job_id).state == tracker_pb2.JOB_STATE_RUNNING
    assert store.reads == 0


def test_the_heap_is_frozen_as_the_swarm_grows_by_a_quarter_not_on_every_tick():
    import gc

    from fedpipe.tracker.scheduler import FREEZE_LEAST

    tracker, _ = rated(rate=100.0)
    try:
        register(tracker, FREEZE_LEAST - 1)
        assert not tracker.freeze_heap()  # fewer than FREEZE_LEAST new nodes
        register(tracker, 1, first=FREEZE_LEAST - 1)
        assert tracker.freeze_heap()
        assert gc.get_freeze_count() > 0
        register(tracker, 20, first=FREEZE_LEAST)  # 120 live: not 1.25x the 100 frozen at
        assert not tracker.freeze_heap()
        register(tracker, 130, first=FREEZE_LEAST + 20)
        assert tracker.freeze_heap()
        assert tracker.freeze_heap(force=True)
    finally:
        gc.unfreeze()  # the test process's heap is not a tracker's
