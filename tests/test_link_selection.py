"""Which links the tracker measures, incrementally, and what the planner assumes for the rest."""
from __future__ import annotations

import logging
import random

import pytest

from fedpipe.planner.protoio import (MEASURE_NEIGHBOURS, MEASURE_SITES, band, cluster_view,
                                     measurement_peers, site_of, unmeasured)
from fedpipe.planner.types import DEFAULT_LINK, Link
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import state_name
from fedpipe.tracker.nodes import NodeCallError
from fedpipe.tracker import scheduler
from fedpipe.tracker.scheduler import candidates
from tracker_fakes import make_tracker, registration, submission

pytestmark = pytest.mark.timeout(60)


def info(node_id: str, address: str, registered: float, flops: float = 1e9
         ) -> tracker_pb2.NodeInfo:
    return tracker_pb2.NodeInfo(node_id=node_id, name=node_id, address=address,
                                registered=registered, alive=True,
                                resources=node_pb2.Resources(flops=flops, memory_bytes=2**30))


def test_sites_are_ipv4_slash_24_ipv6_slash_64_or_the_host_name():
    assert site_of("10.1.2.3:7000") == site_of("10.1.2.200:1") == "10.1.2.0/24"
    assert site_of("[2001:db8::1]:7000") == "2001:db8::/64"
    assert site_of("GPU1.lab.example:7000") == "gpu1.lab.example"
    assert site_of(":7000") == ""


def test_each_node_measures_a_symmetric_band_of_its_site_and_reps_a_band_of_sites():
    nodes = [info(f"a{i:02d}", f"10.0.0.{i + 1}:7000", i) for i in range(20)]
    nodes += [info(f"s{j}", f"10.0.{j + 1}.1:7000", 100 + j) for j in range(12)]
    peers = measurement_peers(nodes)
    assert peers["a05"] == ["a01", "a02", "a03", "a04", "a06", "a07", "a08", "a09"]
    for a, ps in peers.items():
        assert a not in ps and len(ps) <= MEASURE_NEIGHBOURS + MEASURE_SITES
        for b in ps:
            assert a in peers[b]  # symmetric: both directions are measured
    # the oldest node of each site represents it among the 13 sites' representatives
    assert peers["a00"] == ["a01", "a02", "a03", "a04", "s0", "s1", "s2", "s3"]
    assert peers["s5"] == ["s1", "s2", "s3", "s4", "s6", "s7", "s8", "s9"]
    assert sum(map(len, peers.values())) < 32 * 16  # not n²
    # a small site is measured in full
    small = measurement_peers(nodes[:MEASURE_NEIGHBOURS // 2 + 1])
    assert all(len(ps) == MEASURE_NEIGHBOURS // 2 for ps in small.values())
    assert band(["x"], 0, 8) == []


def test_the_measurer_applies_the_rule_incrementally_through_joins_and_losses():
    tracker, _, clock = make_tracker(lease=1e9)
    rng = random.Random(7)
    live = []
    for step in range(150):
        if live and rng.random() < 0.3:
            tracker.registry.leave(live.pop(rng.randrange(len(live))))
        else:
            req = registration(f"n{step}", 7000)
            req.address = f"10.0.{rng.randrange(3)}.{step % 250 + 1}:7000"  # three sites
            live.append(tracker.register(req))
        clock.advance(1.0)
    expected = measurement_peers(tracker.store.nodes())
    assert {i: tracker.links.peers(i) for i in live} == expected


def test_a_join_measures_only_the_new_nodes_neighbourhood_and_leaves_nothing_unmeasured():
    tracker, nodes, clock = make_tracker(lease=1e9)
    for i in range(30):
        tracker.register(registration(f"n{i}", 7000 + i))
        clock.advance(0.01)
    tracker.measure_links()
    assert unmeasured(tracker.store.nodes(), tracker.store.links()) == []
    before = len(nodes.measured)
    clock.advance(1.0)
    tracker.register(registration("late", 8000))
    assert tracker.links.pending_count() == 1 + MEASURE_NEIGHBOURS // 2
    tracker.measure_links()
    # the newcomer and the 4 older nodes whose band now holds it: one call each, not 31
    assert len(nodes.measured) - before == 1 + MEASURE_NEIGHBOURS // 2
    assert unmeasured(tracker.store.nodes(), tracker.store.links()) == []
    assert tracker.links.pending_count() == 0


class UnreachableNodes:
    """Fake node calls where the node at ``bad`` cannot be reached."""

    def __init__(self, inner, bad: str):
        self.inner, self.bad = inner, bad

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def measure_links(self, address, request):
        if address == self.bad:
            raise NodeCallError("failed to connect to all addresses")
        return self.inner.measure_links(address, request)


def test_an_unreachable_node_holds_back_no_job_and_is_named_in_one_warning(caplog):
    tracker, nodes, clock = make_tracker(lease=1e9, link_wait=1e9)
    tracker.links.nodes = UnreachableNodes(nodes, "127.0.0.1:7002")
    for i in range(3):
        tracker.register(registration(f"node{i}", 7000 + i))
    with caplog.at_level(logging.WARNING, "fedpipe.tracker"):
        for _ in range(3):
            tracker.measure_links(refresh=True)
    assert len([r for r in caplog.records if "could not measure its links" in r.message]) == 1
    assert len([r for r in caplog.records if "failed this round" in r.message]) == 3
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()  # no link_wait: the unreachable node's attempt counts
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"


def test_a_job_waits_only_for_its_candidates_links(monkeypatch):
    monkeypatch.setattr(scheduler, "PLAN_CANDIDATES", 4)
    tracker, _, clock = make_tracker(lease=1e9, link_wait=1e9)
    fast = []
    for i in range(8):
        fast.append(tracker.register(registration(f"fast{i}", 7000 + i)))
        clock.advance(0.01)  # registration order is the band's order
    tracker.measure_links()
    slow = registration("slow", 7100)
    slow.resources.flops = 1.0
    tracker.register(slow)
    assert [n.node_id for n in candidates(tracker.store.nodes())] == fast[:4]
    # the slow newcomer's band (4 on each side) reaches fast4..7, not the candidates
    assert tracker.links.waiting(fast[4:]) and not tracker.links.waiting(fast[:4])
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    monkeypatch.setattr(scheduler, "PLAN_CANDIDATES", 256)  # now every node is a candidate
    tracker.register(registration("another", 7200))
    second = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert state_name(tracker.jobs.get(second).state) == "PENDING"
    tracker.measure_links()
    tracker.tick()
    assert state_name(tracker.jobs.get(second).state) == "RUNNING"


def test_the_planner_takes_an_unmeasured_pair_to_be_like_its_sites_measured_links():
    nodes = [info("a", "10.0.0.1:1", 1), info("b", "10.0.0.2:1", 2), info("c", "10.0.0.3:1", 3),
             info("x", "10.9.0.1:1", 4), info("h", "myhost:1", 5)]
    m = node_pb2.LinkMeasurement
    links = [m(src_id="a", dst_id="b", bandwidth=1e8, latency=1e-3),
             m(src_id="b", dst_id="a", bandwidth=3e8, latency=3e-3),
             m(src_id="c", dst_id="a", bandwidth=2e8, latency=2e-3),
             m(src_id="a", dst_id="x", bandwidth=1e6, latency=0.05),
             m(src_id="a", dst_id="gone", bandwidth=1.0, latency=9.0)]
    view = cluster_view(nodes, links)
    assert view.link("a", "b") == Link(1e8, 1e-3)  # measured
    assert view.link("b", "c") == Link(2e8, 2e-3)  # the site's median
    assert view.link("x", "c") == Link(1e6, 0.05)  # the reverse direction between sites
    assert view.link("h", "a") == DEFAULT_LINK  # nothing measured from or to its site
    assert ("a", "gone") not in view.links
