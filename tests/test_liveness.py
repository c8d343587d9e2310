"""Liveness at scale, in-process: heartbeats in memory, persisted in batches, leases from a heap."""
from __future__ import annotations

import pytest

from fedpipe.tracker.registry import PERSIST_EVERY
from fedpipe.tracker.store import SqliteStore
from tracker_fakes import join, make_tracker, registration

pytestmark = pytest.mark.timeout(60)


def beats(tracker) -> dict[str, float]:
    return {n.node_id: n.last_heartbeat for n in tracker.store.nodes()}


def test_a_heartbeat_writes_nothing_until_a_batch_is_persisted(tmp_path):
    store = SqliteStore(str(tmp_path / "t.db"))
    tracker, _, clock = make_tracker(store, lease=10.0)
    ids = join(tracker, 3)
    registered = beats(tracker)
    writes = store.db.total_changes
    clock.advance(1.0)
    for _ in range(100):
        for i in ids:
            assert tracker.registry.heartbeat(i)
    tracker.tick()  # not yet due
    assert store.db.total_changes == writes and beats(tracker) == registered
    clock.advance(PERSIST_EVERY)
    for i in ids:
        tracker.registry.heartbeat(i)
    tracker.tick()
    assert beats(tracker) == {i: clock.now for i in ids}
    assert store.db.total_changes == writes + len(ids)  # one row per node, not per heartbeat


def test_heartbeats_taken_before_shutdown_survive_a_reopen_and_live_nodes_are_renewed(tmp_path):
    path = str(tmp_path / "t.db")
    store = SqliteStore(path)
    tracker, _, clock = make_tracker(store, lease=10.0)
    a, b = join(tracker, 2)
    clock.advance(2.0)
    tracker.registry.heartbeat(a)
    tracker.close()  # flushes
    store.close()
    store = SqliteStore(path)
    assert beats(type("T", (), {"store": store})) == {a: clock.now, b: clock.now - 2.0}
    # a tracker restarted long after (past every lease) renews the live nodes...
    clock.advance(60.0)
    tracker, _, _ = make_tracker(store, clock, lease=10.0)
    tracker.tick()
    assert set(beats(tracker)) == {a, b}
    # ...and loses them a lease later if they stay silent, except the one that heartbeats
    clock.advance(6.0)
    tracker.registry.heartbeat(b)
    clock.advance(6.0)
    tracker.tick()
    assert set(beats(tracker)) == {b}
    store.close()


def test_leases_expire_from_the_heap_exactly_when_they_run_out():
    tracker, _, clock = make_tracker(lease=10.0)
    ids = [tracker.register(registration(f"n{i}", 7000 + i)) for i in range(200)]
    quiet = set(ids[::3])
    for step in range(4):  # heartbeats at 3 s: a live node is re-queued, never lost
        clock.advance(3.0)
        for i in ids:
            if i not in quiet:
                assert tracker.registry.heartbeat(i)
        lost = tracker.registry.expire()
        assert lost == (quiet if step == 3 else set())  # 12 s > 10 s, 9 s is not
    assert {n.node_id for n in tracker.store.nodes()} == set(ids) - quiet
    assert tracker.registry.live_count() == len(ids) - len(quiet)
    # each live node has one entry in the heap, however often it heartbeat
    assert len(tracker.registry._heap) <= len(ids)


def test_a_lost_node_that_heartbeats_is_back_and_a_left_one_keeps_no_stale_deadline():
    tracker, _, clock = make_tracker(lease=10.0)
    a, b = join(tracker, 2)
    clock.advance(11.0)
    tracker.registry.heartbeat(b)
    assert tracker.registry.expire() == {a}
    assert tracker.registry.heartbeat(a)  # written through: listed alive at once
    assert {n.node_id for n in tracker.store.nodes()} == {a, b}
    assert tracker.registry.leave(b)
    clock.advance(5.0)
    assert tracker.registry.heartbeat(b)  # back after leaving, with a new deadline
    clock.advance(6.0)  # b's old deadline (from before it left) is past: it must not count
    assert tracker.registry.expire() == {a}
    assert [n.node_id for n in tracker.store.nodes()] == [b]
    assert not tracker.registry.heartbeat("nobody")


class FailingOnce(SqliteStore):
    """A store whose next batch write fails (a database that is briefly away)."""

    fail = False

    def set_heartbeats(self, beats):
        if self.fail:
            self.fail = False
            raise OSError("the database is away")
        super().set_heartbeats(beats)


def test_a_failed_batch_write_keeps_its_heartbeats_for_the_next_one(tmp_path):
    store = FailingOnce(str(tmp_path / "t.db"))
    tracker, _, clock = make_tracker(store, lease=10.0)
    a, b = join(tracker, 2)
    before = beats(tracker)
    clock.advance(1.0)
    tracker.registry.heartbeat(a)
    tracker.registry.heartbeat(b)
    store.fail = True
    with pytest.raises(OSError, match="away"):
        tracker.registry.flush()
    assert beats(tracker) == before  # nothing written
    clock.advance(1.0)
    tracker.registry.heartbeat(b)  # a newer beat of b meanwhile
    assert tracker.registry.flush() == 2
    assert beats(tracker) == {a: before[a] + 1.0, b: before[b] + 2.0}
