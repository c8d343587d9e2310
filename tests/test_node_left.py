"""Why a lost node is lost, in-process: a node that left on purpose (drained, or stopped)
is listed as having left, not as one that missed its heartbeats; one that missed its
lease still says how long ago its last heartbeat came."""
from __future__ import annotations

import re
import time

import pytest
from rich.console import Console

from fedpipe.observe import status
from fedpipe.observe.views import swarm_view
from fedpipe.proto import tracker_pb2 as S
from fedpipe.tracker.service import TrackerService
from tracker_fakes import Context, join, make_tracker

pytestmark = pytest.mark.timeout(60)


def listed(svc: TrackerService) -> dict[str, S.NodeInfo]:
    reply = svc.ListNodes(S.ListNodesRequest(include_lost=True), Context())
    return {n.node_id: n for n in reply.nodes}


def test_a_drained_node_that_leaves_is_listed_as_left_after_its_drain_not_lost():
    tracker, _, clock = make_tracker(lease=10.0)
    svc = TrackerService(tracker)
    drained, stopped, silent, alive = join(tracker, 4)
    tracker.rebalancer.drain(drained)  # fedpipe drain: the node learns it in a reply
    for node_id in (drained, stopped):
        assert svc.Heartbeat(S.HeartbeatRequest(node_id=node_id, leaving=True), Context()).known
    clock.advance(11.0)  # silent misses its lease
    tracker.registry.heartbeat(alive)
    assert tracker.registry.expire() == {silent}
    nodes = listed(svc)
    assert nodes[drained].lost_reason == "left the swarm after its drain"
    assert nodes[stopped].lost_reason == "left the swarm"
    assert nodes[silent].lost_reason == "" and nodes[alive].lost_reason == ""
    assert not any(nodes[i].alive for i in (drained, stopped, silent))

    view = swarm_view(list(nodes.values()), [], now=time.time() + 60)
    why = {n["id"]: n["why"] for n in view["nodes"]}
    assert re.fullmatch(r"left the swarm after its drain \(last heartbeat \d\d:\d\d:\d\d\)",
                        why[drained])
    assert re.fullmatch(r"left the swarm \(last heartbeat \d\d:\d\d:\d\d\)", why[stopped])
    assert re.fullmatch(r"lost: no heartbeat for \d+ s \(last \d\d:\d\d:\d\d\)", why[silent])
    assert why[alive] == ""


def test_a_node_that_says_it_drains_as_it_leaves_left_drained_and_a_return_clears_it():
    tracker, _, clock = make_tracker(lease=10.0)
    svc = TrackerService(tracker)
    a, b = join(tracker, 2)
    svc.Heartbeat(S.HeartbeatRequest(node_id=a, leaving=True, draining=True), Context())
    assert listed(svc)[a].lost_reason == "left the swarm after its drain"
    assert tracker.registry.heartbeat(a)  # back (same process, a redial): alive, no reason
    assert listed(svc)[a].alive and listed(svc)[a].lost_reason == ""
    tracker.registry.declare_lost(a, "stopped answering (a peer could not reach it)")
    assert listed(svc)[a].lost_reason == "stopped answering (a peer could not reach it)"
    view = swarm_view(list(listed(svc).values()), [])
    [why] = [n["why"] for n in view["nodes"] if n["id"] == a]
    assert why.startswith("lost: stopped answering (a peer could not reach it) (last heartbeat")


def test_status_shows_a_drained_node_as_left():
    tracker, _, _ = make_tracker(lease=10.0)
    svc = TrackerService(tracker)
    a, _b = join(tracker, 2)
    tracker.rebalancer.drain(a)
    svc.Heartbeat(S.HeartbeatRequest(node_id=a, leaving=True), Context())

    class Source:  # what run_status reads: the ListNodes view
        def nodes(self, include_lost=False):
            return [n for n in listed(svc).values() if include_lost or n.alive]

        def links(self):
            return []

        def jobs(self, *a, **k):
            return []

    console = Console(width=200, record=True, color_system=None)
    status.run_status(Source(), console=console)
    text = console.export_text()
    assert "left the swarm after its drain" in text and "no heartbeat" not in text
    assert "1 node(s) alive, 1 left, 0 lost;" in text  # was: "1 node(s) alive, 1 lost"


def test_the_dashboards_nodes_say_a_drained_node_left():
    from fedpipe.tracker.http import Dashboard, TrackerSource

    tracker, _, _ = make_tracker(lease=10.0)
    svc = TrackerService(tracker)
    a, _b = join(tracker, 2)
    tracker.rebalancer.drain(a)
    svc.Heartbeat(S.HeartbeatRequest(node_id=a, leaving=True), Context())
    source = TrackerSource(tracker.store, tracker.stage_times,
                           tracker.feeders, tracker.registry)
    [why] = [n["why"] for n in Dashboard(source).nodes()["nodes"] if n["id"] == a]
    assert why.startswith("left the swarm after its drain (last heartbeat ")
