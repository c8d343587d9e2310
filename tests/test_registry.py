"""Node registration: one node per address, compatible versions, incarnations, leases."""
from __future__ import annotations

import time

import pytest

from fedpipe.proto import tracker_pb2
from fedpipe.spec import PROTOCOL_VERSION, PlanView, state_name
from fedpipe.tracker import errors
from tracker_fakes import VERSIONS, join, make_tracker, registration, submission
from tracker_fakes import versions_with as versions

pytestmark = pytest.mark.timeout(60)


def test_a_second_node_at_a_live_nodes_address_is_refused_naming_it():
    tracker, _, clock = make_tracker(lease=10.0)
    first = tracker.register(registration("alpha", 7000))
    with pytest.raises(errors.AlreadyExists,
                       match=rf"127\.0\.0\.1:7000 is held by live node 'alpha' \({first}\)"):
        tracker.register(registration("beta", 7000, boot="other"))
    assert [n.name for n in tracker.store.nodes()] == ["alpha"]
    # once alpha's lease has run out the address is free
    clock.advance(11)
    tracker.tick()
    beta = tracker.register(registration("beta", 7000, boot="other"))
    assert [n.node_id for n in tracker.store.nodes()] == [beta]


def test_the_same_incarnation_registering_again_keeps_its_id_even_after_its_lease_ran_out():
    tracker, _, clock = make_tracker(lease=10.0)
    node = tracker.register(registration("alpha", 7000))
    assert tracker.register(registration("alpha", 7000)) == node
    clock.advance(11)
    tracker.tick()
    assert tracker.store.nodes() == []
    assert tracker.register(registration("alpha", 7000)) == node
    assert tracker.registry.heartbeat(node)


def test_a_node_with_another_protocol_is_refused_naming_both_versions():
    tracker, _, _ = make_tracker()
    with pytest.raises(errors.FailedPrecondition,
                       match=rf"speaks fedpipe protocol {PROTOCOL_VERSION + 1} \(fedpipe 9\.9\) "
                             rf"but this tracker speaks protocol {PROTOCOL_VERSION}"):
        tracker.register(registration("x", 7000, versions=versions(protocol=PROTOCOL_VERSION + 1,
                                                                    fedpipe="9.9")))
    with pytest.raises(errors.FailedPrecondition, match="protocol 0"):
        tracker.register(registration("old", 7001, versions=tracker_pb2.Versions()))
    assert tracker.store.nodes(include_lost=True) == []


@pytest.mark.parametrize("field,value", [("torch", "2.4.1"), ("python", "3.12"),
                                         ("cloudpickle", "2.2.1")])
def test_a_node_whose_pickles_differ_from_the_swarms_is_refused_naming_both(field, value):
    tracker, _, clock = make_tracker(lease=10.0)
    tracker.register(registration("first", 7000))
    odd = registration("odd", 7001, versions=versions(**{field: value}))
    with pytest.raises(errors.FailedPrecondition,
                       match=rf"node 'odd' runs {field} {value} but the swarm's nodes \(e\.g\. "
                             rf"'first'\) run {field} {getattr(VERSIONS, field)}"):
        tracker.register(odd)
    # another fedpipe release of the same protocol is fine
    tracker.register(registration("newer", 7002, versions=versions(fedpipe="0.1.1")))
    # the swarm's versions are those of its live nodes: once they are gone, odd may start one
    clock.advance(11)
    tracker.tick()
    assert tracker.register(odd)


def test_a_new_boot_id_at_the_same_address_is_a_new_incarnation_and_fences_the_old():
    tracker, nodes, _ = make_tracker()
    old_a, b = join(tracker, 2)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert PlanView(tracker.jobs.get(job).plan).node_ids() == {old_a, b}

    new_a = tracker.register(registration("node0", 7000, boot="second-boot"))
    assert new_a != old_a
    info = tracker.jobs.get(job)
    # the old incarnation's stages are fenced off: the job recovers without them
    assert state_name(info.state) == "RECOVERING" and info.epoch == 1
    assert info.reason.startswith("node(s) node0 restarted (a new process registered at "
                                  "127.0.0.1:7000")
    assert {n.node_id for n in tracker.store.nodes()} == {new_a, b}
    # the old incarnation is never merged back: its heartbeats are refused...
    assert not tracker.registry.heartbeat(old_a)
    assert old_a not in {n.node_id for n in tracker.store.nodes()}
    # ...and so is its registration
    with pytest.raises(errors.FailedPrecondition, match="was replaced by a newer process"):
        tracker.register(registration("node0", 7000, boot="boot"))
    # a report about the old job cannot revive it
    tracker.progress.report(tracker_pb2.StageReport(job_id=job, node_id=new_a,
                                                    status=tracker_pb2.StageReport.STATUS_DONE))
    assert state_name(tracker.jobs.get(job).state) == "RECOVERING"
    # the new incarnation takes new jobs once its links are measured
    tracker.measure_links()
    second = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    assert PlanView(tracker.jobs.get(second).plan).node_ids() == {new_a, b}


def test_the_tracker_sets_the_heartbeat_interval_from_its_lease():
    tracker, _, _ = make_tracker(lease=8.0)
    assert tracker.registry.heartbeat_seconds == 2.0


def test_malformed_registrations_are_invalid_arguments():
    tracker, _, _ = make_tracker()
    for req in (registration("x", 0), registration("x" * 300, 7000)):
        with pytest.raises(errors.InvalidArgument):
            tracker.register(req)
    bad = registration("x", 7000)
    bad.resources.flops = float("nan")
    with pytest.raises(errors.InvalidArgument, match="finite flops"):
        tracker.register(bad)


def relayed(name: str, port: int, relay: str, node_id: str = "", boot: str = "boot"
            ) -> tracker_pb2.RegisterNodeRequest:
    """``name``'s registration at port ``port`` of relay ``relay`` (no data port: the
    tracker would dial it)."""
    r = registration(name, port, boot=boot)
    r.relay, r.node_id = relay, node_id
    return r


def wait_for(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_relayed_node_that_moves_to_another_relay_keeps_its_id_and_its_jobs_follow_it():
    tracker, nodes, _ = make_tracker()
    a = tracker.register(relayed("node0", 7000, "relay1:1"))
    b = tracker.register(relayed("node1", 7010, "relay1:1"))
    tracker.measure_links()
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING" and PlanView(info.plan).node_ids() == {a, b}
    epoch, assigned = info.epoch, len(nodes.assigns)

    assert tracker.register(relayed("node0", 7100, "relay2:1", node_id=a)) == a
    wait_for(lambda: len(nodes.assigns) == assigned + 2)
    info = tracker.jobs.get(job)
    assert state_name(info.state) == "RUNNING" and info.epoch == epoch and not info.recoveries
    moved = next(s for s in info.plan.stages if s.node_id == a)
    assert (moved.address, moved.relay) == ("127.0.0.1:7100", "relay2:1")
    # both nodes are told the plan's assignments at their addresses now, at the new ones
    told = {address: request for address, request, _ in nodes.assigns[assigned:]}
    assert sorted(told) == ["127.0.0.1:7010", "127.0.0.1:7100"]
    assert all(r.stages == info.plan.stages and r.epoch == epoch for r in told.values())
    assert {n.node_id: n.address for n in tracker.store.nodes()} == {
        a: "127.0.0.1:7100", b: "127.0.0.1:7010"}
    # its old address is free again
    c = tracker.register(relayed("node2", 7000, "relay1:1"))
    assert c not in (a, b)


@pytest.mark.parametrize("who", ["another boot", "another name", "not relayed"])
def test_a_registration_naming_an_id_it_may_not_keep_is_a_new_incarnation(who):
    tracker, _, _ = make_tracker()
    a = tracker.register(relayed("node0", 7000, "relay1:1"))
    move = relayed("node0", 7100, "relay2:1", node_id=a)
    if who == "another boot":
        move.boot_id = "other"
    elif who == "another name":
        move.name = "node9"
    else:
        move.relay = ""
    assert tracker.register(move) != a


def test_a_relayed_node_moving_after_a_tracker_takeover_keeps_its_id():
    tracker, _, clock = make_tracker()
    a = tracker.register(relayed("node0", 7000, "relay1:1"))
    successor, _, _ = make_tracker(tracker.store, clock)  # the same store, a new leader
    # the store keeps the node's relay and data address (they were in one tracker's memory
    # only, found by the adversarial helper: new plans then used gRPC for the node, and its
    # next move between relays made a new incarnation, its jobs rewinding)
    assert {n.node_id: n for n in successor.registry.nodes()}[a].relay == "relay1:1"
    assert successor.registry.heartbeat(a)  # live: it goes on heartbeating, no new register
    assert successor.register(relayed("node0", 7100, "relay2:1", node_id=a)) == a
