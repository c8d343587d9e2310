"""The tracker while its store cannot be reached: a node lost meanwhile is recovered once
the store is back, and the outage is logged once, not on every tick. In-process, over a
store in memory that can be switched off."""
from __future__ import annotations

import logging

import pytest

from fedpipe.spec import PlanView, state_name
from fedpipe.tracker.store import MemoryStore, StoreUnavailable
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)


class FlakyStore(MemoryStore):
    """A store in memory whose every call raises StoreUnavailable while ``down``."""

    down = False

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if callable(attr) and not name.startswith("_") and \
                super().__getattribute__("down"):
            def unavailable(*args, **kwargs):
                raise StoreUnavailable("cannot connect to the test database")
            return unavailable
        return attr


def test_a_node_lost_while_the_store_is_down_is_recovered_once_it_is_back():
    store = FlakyStore()
    tracker, _, clock = make_tracker(store, lease=10.0)
    a, b, c = join(tracker, 3)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    used = PlanView(tracker.jobs.get(job).plan).node_ids()
    lost = sorted(used)[0]
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    store.down = True
    for node in {a, b, c} - {lost}:  # the others keep beating; ``lost`` was killed
        clock.advance(5)
        assert tracker.registry.heartbeat(node)
        clock.advance(4)
        assert tracker.registry.heartbeat(node)
    for _ in range(3):
        tracker.guarded_tick()  # fails at the store: the loss is not acted on yet
    assert tracker.registry.alive(lost)  # still queued, to be expired again
    store.down = False
    tracker.guarded_tick()
    assert not tracker.registry.alive(lost)
    assert lost not in {n.node_id for n in store.nodes()}
    info = tracker.jobs.get(job)
    assert info.epoch == 1 and info.reason.startswith("recovered from the loss of node")


def test_a_node_that_leaves_while_the_store_is_down_can_leave_again():
    store = FlakyStore()
    tracker, _, _ = make_tracker(store, lease=10.0)
    node, = join(tracker, 1)
    store.down = True
    with pytest.raises(StoreUnavailable):
        tracker.registry.leave(node)
    assert tracker.registry.alive(node)  # not acted on: the loss was not written
    store.down = False
    assert tracker.registry.leave(node)
    assert store.nodes() == []


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    store = FlakyStore()
    tracker, _, _ = make_tracker(store, lease=10.0)
    join(tracker, 2)
    tracker.jobs.submit(submission(stages=2))
    with caplog.at_level(logging.INFO, logger="fedpipe.tracker"):
        store.down = True
        for _ in range(5):
            tracker.guarded_tick()
        store.down = False
        tracker.guarded_tick()
        tracker.guarded_tick()
    lines = [r for r in caplog.records if "store" in r.getMessage()]
    assert [r.getMessage() for r in lines] == [
        "the store is unavailable (cannot connect to the test database); retrying every tick",
        "the store is available again"]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_lost_node_is_revived_only_once_the_store_says_so():
    store = FlakyStore()
    tracker, _, clock = make_tracker(store, lease=10.0)
    node, = join(tracker, 1)
    clock.advance(11)
    tracker.tick()
    assert not tracker.registry.alive(node)
    store.down = True
    with pytest.raises(StoreUnavailable):
        tracker.registry.heartbeat(node)
    assert not tracker.registry.alive(node) and tracker.registry.nodes() == []
    store.down = False
    assert tracker.registry.heartbeat(node)
    assert [n.node_id for n in store.nodes()] == [node] == \
        [n.node_id for n in tracker.registry.nodes()]


def test_a_migration_not_considered_for_want_of_the_store_is_one_line(caplog):
    store = FlakyStore()
    tracker, _, _ = make_tracker(store, lease=10.0)
    join(tracker, 2)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    store.down = True
    with caplog.at_level(logging.INFO, logger="fedpipe.tracker"):
        assert not tracker.rebalancer.consider(job)
    line, = [r for r in caplog.records if "migration" in r.getMessage()]
    assert line.getMessage() == (f"job {job}: a migration was not considered: cannot connect "
                                 f"to the test database") and line.exc_info is None
