"""The leader lease, in-process: fake clocks drive the takeover and step-down rules
(:mod:`fedpipe.tracker.leader`), and the store itself refuses a deposed leader's writes
(SQLite, and PostgreSQL when the tests start a server)."""
from __future__ import annotations

import json

import pytest
from pg_server import postgres_server  # noqa: F401 — the session's PostgreSQL (a fixture)

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import PlanView, StageKey
from fedpipe.tracker.leader import RENEW_EVERY, STEP_DOWN, LeaderFence, Leadership
from fedpipe.tracker.replicas import ReplicaSet
from fedpipe.tracker.service import TrackerService
from fedpipe.tracker.store import Deposed, MemoryStore, PostgresStore, SqliteStore, Store
from fedpipe.tracker.store.sql import SqlStore
from tracker_fakes import Context, join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)
LEASE = 5.0
POSTGRES = pytest.param("postgres", marks=pytest.mark.processes)
R = tracker_pb2.StageReport


class Clocks:
    """One wall clock and one monotonic clock per tracker, moved by hand."""

    def __init__(self) -> None:
        self.wall = 1000.0
        self.mono = 50.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class Tracker:
    """A tracker's lease parts over a shared store, with its terms counted."""

    def __init__(self, name: str, store_for, clocks: Clocks):
        self.fence = LeaderFence(clocks.monotonic)
        self.store = store_for(self.fence)
        self.led: list[int] = []
        self.deposed: list[str] = []
        self.leadership = Leadership(self.store, self.fence, f"{name}:7070", lease=LEASE,
                                     on_lead=self.led.append, on_depose=self.deposed.append,
                                     clock=clocks.time, monotonic=clocks.monotonic,
                                     holder=name)


def _job() -> tracker_pb2.SubmitJobRequest:
    return tracker_pb2.SubmitJobRequest(name="j", layers=[b"x"],
                                        config=node_pb2.JobConfig(steps=3, microbatches=1))


def test_a_failed_takeover_gives_the_lease_back():
    clocks = Clocks()
    store = MemoryStore()
    fence = LeaderFence(clocks.monotonic)

    def broken(epoch: int) -> None:
        raise RuntimeError("cannot build")
    deposed: list[str] = []
    lead = Leadership(store, fence, "a:7070", lease=LEASE, on_lead=broken,
                      on_depose=deposed.append, clock=clocks.time, monotonic=clocks.monotonic)
    assert not lead.step()
    assert not fence.leading() and store.lease().expires == 0.0
    assert deposed == ["taking over failed: cannot build"]


def test_an_unfenced_store_writes_without_a_lease(tmp_path):
    s = SqliteStore(str(tmp_path / "alone.db"))
    assert isinstance(s, SqlStore) and s.fence is None
    s.add_job(_job(), "queued", 1.0)
    assert s.lease().epoch == 0 and s.lease().holder == ""
    s.close()


# -- what a takeover needs kept: replica-group membership and committed steps --------

def _groups(n: int) -> dict[int, frozenset[StageKey]]:
    return {g: frozenset({StageKey(g, 0), StageKey(g, 1)}) for g in range(n)}


def test_a_replica_set_restored_from_its_last_snapshot_answers_as_the_old_one_did():
    kept: list[dict] = []
    rs = ReplicaSet(_groups(3), 1, kept.append)
    assert rs.drop([2]) == 1
    for key in (StageKey(0, 0), StageKey(0, 1), StageKey(1, 0)):
        rs.ask(key, 4, 1, reduced=True)
    # step 4 commits; group 1's stage 1 applies it; the tracker dies before the others ask
    assert rs.ask(StageKey(1, 1), 4, 1, reduced=True).committed
    new = ReplicaSet.restore(_groups(3), 1, json.loads(json.dumps(kept[-1])))
    # the late askers hear "committed" from the new tracker, with the same members
    q = new.ask(StageKey(0, 0), 4, 1, reduced=True)
    assert q.committed and q.members == (0, 1) and q.version == 1
    assert new.dropped() == (2,) and new.version == 1  # the dropped group stays dropped
    assert new.ask(StageKey(2, 0), 5, 1, reduced=False).dropped


def test_a_change_the_store_refuses_is_not_made():
    def refuse(snapshot: dict) -> None:
        raise Deposed("not the leader")
    rs = ReplicaSet(_groups(2), 1, refuse)
    with pytest.raises(Deposed):
        rs.drop([1])
    assert rs.live == (0, 1) and rs.version == 0
    for key in (StageKey(0, 0), StageKey(0, 1), StageKey(1, 0)):
        rs.ask(key, 0, 0, reduced=True)
    with pytest.raises(Deposed):
        rs.ask(StageKey(1, 1), 0, 0, reduced=True)
    assert not rs.committed(0)


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_the_store_keeps_a_jobs_replica_membership_until_the_job_ends(kind, tmp_path):
    s: Store = SqliteStore(str(tmp_path / "t.db")) if kind == "sqlite" else MemoryStore()
    job = s.add_job(_job(), "queued", 1.0)
    assert s.replicas(job) is None
    s.set_replicas(job, 0, b'{"a": 1}')
    s.set_replicas(job, 2, b'{"b": 2}')
    assert s.replicas(job) == (2, b'{"b": 2}')
    s.set_state(job, tracker_pb2.JOB_STATE_SUCCEEDED, "done", 2.0)
    assert s.replicas(job) is None
    s.close()


# -- one lease over a shared database (SQLite, and PostgreSQL) ----------------------

@pytest.fixture(params=["sqlite", POSTGRES])
def shared(request, tmp_path):
    """Opens one store per tracker, all on one database, each with its fence."""
    opened: list[Store] = []
    if request.param == "sqlite":
        path = str(tmp_path / "shared.db")

        def store_for(fence):
            opened.append(SqliteStore(path, fence))
            return opened[-1]
    else:
        url = request.getfixturevalue("postgres_server").new_database()

        def store_for(fence):
            opened.append(PostgresStore(url, fence=fence))
            return opened[-1]
    yield store_for
    for s in opened:
        s.close()


def test_one_tracker_leads_the_other_stands_by_and_names_it(shared):
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    assert a.leadership.step() and a.led == [1]
    assert not b.leadership.step() and b.led == []
    assert b.leadership.leader() == "a:7070" and a.leadership.leader() == "a:7070"
    clocks.advance(RENEW_EVERY * LEASE)
    assert a.leadership.step() and not b.leadership.step()  # renewed: b waits
    assert a.fence.epoch() == 1
    with pytest.raises(Deposed, match="standby"):
        b.fence.epoch()


def test_a_standby_takes_over_when_the_lease_lapses_with_the_next_epoch(shared):
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    a.leadership.step()
    b.leadership.step()
    clocks.advance(LEASE - 0.01)  # a stopped renewing (killed): not lapsed yet
    assert not b.leadership.step()
    clocks.advance(0.02)
    assert b.leadership.step() and b.led == [2]
    assert b.store.lease().holder == "b" and b.store.lease().epoch == 2


def test_a_leader_that_cannot_renew_stops_leading_before_its_lease_lapses(shared):
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    a.leadership.step()
    a.store.add_job(_job(), "queued", clocks.wall)  # a fenced write while it leads
    # a is stopped (SIGSTOP): no rounds run. Its own deadline comes before the lease lapses
    clocks.advance(STEP_DOWN * LEASE)
    with pytest.raises(Deposed, match="could not be renewed in time"):
        a.fence.epoch()
    with pytest.raises(Deposed):
        a.store.add_job(_job(), "late", clocks.wall)
    assert not b.leadership.step()  # the lease itself has not lapsed yet
    assert b.leadership.leader() == "a:7070"


def test_a_deposed_leader_resumed_after_a_takeover_has_its_writes_refused_by_the_store(shared):
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    a.leadership.step()
    job = a.store.add_job(_job(), "queued", clocks.wall)
    clocks.advance(LEASE + 0.1)
    assert b.leadership.step() and b.led == [2]
    # a resumes and its fence still claims epoch 1 (as if its own clock had not moved):
    # the store refuses by the lease row's epoch, inside the write's transaction
    a.fence.grant(1, clocks.mono + 100)
    before = b.store.job(job)
    with pytest.raises(Deposed, match="epoch 1 but the leader lease .* is at epoch 2"):
        a.store.set_state(job, tracker_pb2.JOB_STATE_FAILED, "deposed write", clocks.wall)
    with pytest.raises(Deposed):
        a.store.set_plan(job, node_pb2.Plan(summary="deposed"))
    after = b.store.job(job)
    assert after == before  # nothing was written
    # the new leader writes
    assert b.store.set_state(job, tracker_pb2.JOB_STATE_CANCELLED, "by b", clocks.wall)
    # a's next round: it cannot renew, steps down, and closes what it built
    a.fence.grant(1, clocks.mono + 100)
    assert not a.leadership.step()
    assert a.deposed == ["another tracker took the lease over"]
    assert a.leadership.leader() == "b:7070"


def test_a_leader_resumed_before_anyone_took_over_steps_down_and_takes_a_new_epoch(shared):
    clocks = Clocks()
    a = Tracker("a", shared, clocks)
    a.leadership.step()
    clocks.advance(STEP_DOWN * LEASE + 0.1)  # past its own deadline, lease not lapsed
    assert a.leadership.step()  # steps down, gives the lease back, takes it again
    assert a.deposed and a.led == [1, 2] and a.fence.epoch() == 2


def test_a_renewal_the_store_cannot_answer_keeps_leading_until_the_deadline_only(shared):
    clocks = Clocks()
    a = Tracker("a", shared, clocks)
    a.leadership.step()
    real = a.store.renew_lease

    def unreachable(*args, **kw):
        from fedpipe.tracker.store import StoreUnavailable
        raise StoreUnavailable("cut off")
    a.store.renew_lease = unreachable  # type: ignore[method-assign]
    clocks.advance(RENEW_EVERY * LEASE)
    assert a.leadership.step() and a.fence.leading()
    clocks.advance(STEP_DOWN * LEASE)
    assert not a.fence.leading()
    a.store.renew_lease = real  # type: ignore[method-assign]


def test_a_stopping_leader_releases_the_lease_so_a_standby_takes_over_at_once(shared):
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    a.leadership.step()
    assert not b.leadership.step()
    a.leadership.close()
    assert a.deposed == ["this tracker is stopping"]
    assert b.leadership.step() and b.led == [2]


def test_a_checkpoint_half_acknowledged_to_a_leader_that_died_completes_under_the_next(
        shared):
    """The tallies live in memory: the new leader relearns the acknowledgements the dead
    one counted from the nodes' heartbeats (``StageRef.acked``)."""
    clocks = Clocks()
    a, b = Tracker("a", shared, clocks), Tracker("b", shared, clocks)
    assert a.leadership.step()
    first, _, clock = make_tracker(a.store)
    join(first, 3)
    job = first.jobs.submit(submission(steps=20, stages=2, checkpoint_every=10))
    first.tick()
    info = first.jobs.get(job)
    assert info.state == tracker_pb2.JOB_STATE_RUNNING
    plan = PlanView(info.plan)
    early, late = plan.stages

    def ack(tracker, key: StageKey) -> None:
        tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                                  node_id=plan[key].node_id, status=R.STATUS_CHECKPOINT,
                                  epoch=info.epoch, step=10))
    ack(first, early)
    assert first.jobs.get(job).checkpoint_step == 0
    clocks.advance(LEASE + 0.1)  # a is killed before the other stage acks: b takes over
    assert b.leadership.step() and b.led == [2]
    second, _, _ = make_tracker(b.store, clock)
    ack(second, late)
    assert second.jobs.get(job).checkpoint_step == 0  # one ack of two: not complete yet
    held = tracker_pb2.StageRef(job_id=job, replica=early.replica, stage=early.stage,
                                epoch=info.epoch, acked=[10])
    reply = TrackerService(second).Heartbeat(
        tracker_pb2.HeartbeatRequest(node_id=plan[early].node_id, holds=[held]), Context())
    assert reply.known
    assert second.jobs.get(job).checkpoint_step == 10
    assert dict(reply.checkpoints) == {job: 10}  # the node protects it from now on
    assert "checkpoint of step 10 complete" in [e.reason for e in b.store.events(job, 0)]
