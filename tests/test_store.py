"""One contract for every tracker Store backend: the same test runs against each
(SQLite, memory, and a real PostgreSQL server the tests start, see ``pg_server.py``);
then the SQL backends' schema migrations."""
from __future__ import annotations

import math
import sqlite3

import pytest
from pg_server import postgres_server  # noqa: F401 — the session's PostgreSQL (a fixture)

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.tracker.store import (SCHEMA_VERSION, MemoryStore, PostgresStore, SchemaTooNew,
                                   SqliteStore, Store, StoreConfigError, migrations)
from fedpipe.tracker.store.connection import Connection
from fedpipe.tracker.store.migrations import Migration, migrate
from fedpipe.tracker.store.postgres import PostgresConnection
from fedpipe.tracker.store.sqlite import SqliteConnection

pytestmark = pytest.mark.timeout(60)
S = tracker_pb2
V = tracker_pb2.Versions(fedpipe="0.1.0", protocol=2, python="3.11", torch="2.3.0",
                         cloudpickle="3.0.0")
# the PostgreSQL cases start a server (once per session): they are process tests
POSTGRES = pytest.param("postgres", marks=pytest.mark.processes)


def open_backend(kind: str, request, tmp_path) -> Store:
    if kind == "sqlite":
        return SqliteStore(str(tmp_path / "tracker.db"))
    if kind == "postgres":
        return PostgresStore(request.getfixturevalue("postgres_server").new_database())
    return MemoryStore()


@pytest.fixture(params=["sqlite", "memory", POSTGRES])
def store(request, tmp_path) -> Store:
    s = open_backend(request.param, request, tmp_path)
    yield s
    s.close()


def res(flops: float = 1e9) -> node_pb2.Resources:
    return node_pb2.Resources(flops=flops, memory_bytes=2**30, device="cpu")


def submission(n_layers: int = 3, steps: int = 5) -> tracker_pb2.SubmitJobRequest:
    return S.SubmitJobRequest(name="j", layers=[bytes([i]) * 4 for i in range(n_layers)],
                              config=node_pb2.JobConfig(steps=steps, microbatches=1),
                              pending_timeout=7.0)


def plan(*keys: tuple[int, int]) -> node_pb2.Plan:
    return node_pb2.Plan(stages=[node_pb2.StageAssignment(replica=r, stage=s, node_id=f"n{r}{s}")
                                 for r, s in keys], summary="p")


def test_nodes_register_renew_expire_and_come_back_with_their_registration_time(store):
    store.add_node("b", "nb", "h:2", res(), "boot-b", V, now=20.0)
    store.add_node("a", "na", "h:1", res(), "boot-a", V, now=10.0)
    recs = store.node_records()
    assert [r.info.node_id for r in recs] == ["a", "b"]  # oldest registration first
    assert recs[0].boot_id == "boot-a" and recs[0].versions == V and not recs[0].fenced
    assert recs[0].info.registered == 10.0 and recs[0].info.alive

    store.renew_node("a", res(5e9), V, now=30.0)
    a = store.node_records()[0].info
    assert (a.registered, a.last_heartbeat, a.resources.flops) == (10.0, 30.0, 5e9)

    assert store.expire_nodes(cutoff=25.0) == ["b"]
    assert [n.node_id for n in store.nodes()] == ["a"]
    assert [n.alive for n in store.nodes(include_lost=True)] == [True, False]
    assert store.heartbeat("b", now=40.0)  # a lost node that heartbeats again is alive
    assert store.mark_lost("a") and not store.mark_lost("nobody")
    assert not store.heartbeat("nobody", now=41.0)
    store.renew_all(now=50.0)
    assert [(n.node_id, n.last_heartbeat) for n in store.nodes()] == [("b", 50.0)]


def test_a_nodes_data_address_and_relay_are_kept_and_follow_its_moves(store):
    # a tracker that restarts or takes over reads them here (they were one tracker's memory)
    store.add_node("a", "na", "r1:7000", res(), "boot-a", V, now=10.0,
                   data_address="r1:7001", relay="r1:1")
    store.add_node("b", "nb", "h:2", res(), "boot-b", V, now=11.0)
    a, b = (r.info for r in store.node_records())
    assert (a.data_address, a.relay, b.data_address, b.relay) == ("r1:7001", "r1:1", "", "")
    store.renew_node("a", res(), V, now=20.0, address="r2:7100", data_address="r2:7101",
                     relay="r2:1")  # it moved to another relay
    a = store.node_records()[0].info
    assert (a.address, a.data_address, a.relay) == ("r2:7100", "r2:7101", "r2:1")


def test_heartbeats_and_losses_are_written_in_batches_and_never_revive_a_node(store):
    for i, nid in enumerate("abcd"):
        store.add_node(nid, "n" + nid, f"h:{i + 1}", res(), "boot", V, now=1.0)
    store.fence_node("d")
    store.mark_lost_many(["c", "nobody"])
    store.set_heartbeats({"a": 5.0, "b": 6.0, "c": 7.0, "d": 8.0, "nobody": 9.0})
    assert [(n.node_id, n.alive, n.last_heartbeat) for n in store.nodes(include_lost=True)] == \
        [("a", True, 5.0), ("b", True, 6.0), ("c", False, 1.0), ("d", False, 1.0)]
    store.mark_lost_many(["a", "b"])
    assert store.nodes() == []


def test_a_fenced_incarnation_never_comes_back(store):
    store.add_node("old", "n", "h:1", res(), "boot-1", V, now=1.0)
    store.fence_node("old")
    assert not store.heartbeat("old", now=2.0)
    store.renew_node("old", res(), V, now=3.0)
    rec, = store.node_records(include_lost=True)
    assert rec.fenced and not rec.info.alive and store.nodes() == []


def test_changing_a_returned_message_changes_nothing_stored(store):
    store.add_node("a", "na", "h:1", res(), "boot", V, now=1.0)
    store.nodes()[0].name = "changed"
    job = store.add_job(submission(), "queued", now=1.0)
    store.job(job).state = S.JOB_STATE_FAILED
    store.spec(job).config.steps = 99
    assert store.nodes()[0].name == "na"
    assert store.job(job).state == S.JOB_STATE_PENDING and store.spec(job).config.steps == 5


def test_links_keep_the_latest_successful_measurement_of_each_direction(store):
    m = node_pb2.LinkMeasurement
    store.set_links([m(src_id="b", dst_id="a", bandwidth=1e6, latency=0.1, measured_at=1.0),
                     m(src_id="a", dst_id="b", bandwidth=2e6, latency=0.2, measured_at=1.0)])
    store.set_links([m(src_id="a", dst_id="b", bandwidth=3e6, latency=0.3, measured_at=2.0),
                     m(src_id="b", dst_id="a", error="unreachable", measured_at=2.0)])
    assert [(x.src_id, x.dst_id, x.bandwidth, x.measured_at) for x in store.links()] == \
        [("a", "b", 3e6, 2.0), ("b", "a", 1e6, 1.0)]


def test_a_job_is_stored_without_its_layers_which_are_served_by_range(store):
    job = store.add_job(submission(4), "queued for planning", now=5.0)
    assert store.spec(job).layers == [] and store.spec(job).pending_timeout == 7.0
    assert store.layers(job, 1, 3) == [b"\1" * 4, b"\2" * 4]
    info = store.job(job)
    assert (info.state, info.reason, info.steps, info.created, info.step) == \
        (S.JOB_STATE_PENDING, "queued for planning", 5, 5.0, 0)
    ev, = store.events(job, 0)
    assert (ev.state, ev.reason, ev.time) == (S.JOB_STATE_PENDING, "queued for planning", 5.0)
    with pytest.raises(KeyError):
        store.job("nope")
    with pytest.raises(KeyError):
        store.spec("nope")


def test_states_move_only_from_the_given_states_and_never_out_of_a_terminal_one(store):
    first = store.add_job(submission(), "q", now=1.0)
    second = store.add_job(submission(), "q", now=2.0)
    assert store.jobs_in(S.JOB_STATE_PENDING) == [first, second]
    assert not store.set_state(first, S.JOB_STATE_DEPLOYING, "x", now=3.0,
                               only_from={S.JOB_STATE_PLANNING})
    assert store.set_state(first, S.JOB_STATE_PLANNING, "planning", now=3.0,
                           only_from={S.JOB_STATE_PENDING})
    assert store.jobs_in(S.JOB_STATE_PLANNING, S.JOB_STATE_DEPLOYING) == [first]
    assert store.set_state(first, S.JOB_STATE_FAILED, "boom", now=4.0)
    assert store.layers(first, 0, 3) == []  # a terminal job's layers are dropped
    assert not store.set_state(first, S.JOB_STATE_RUNNING, "again", now=5.0)
    assert not store.set_state("nope", S.JOB_STATE_RUNNING, "x", now=5.0)
    assert (store.job(first).state, store.job(first).reason) == (S.JOB_STATE_FAILED, "boom")
    assert [e.state for e in store.events(first, 0)] == \
        [S.JOB_STATE_PENDING, S.JOB_STATE_PLANNING, S.JOB_STATE_FAILED]


def test_the_job_succeeds_only_when_every_stage_of_every_group_is_done(store):
    job = store.add_job(submission(), "q", now=1.0)
    store.set_plan(job, plan((0, 0), (0, 1), (1, 0), (1, 1)))
    assert store.job(job).plan.summary == "p"
    assert not store.stage_done(job, 0, 0)
    assert not store.stage_done(job, 0, 0)  # twice counts once
    assert not store.stage_done(job, 1, 1)
    assert not store.stage_done(job, 0, 1)
    assert store.stage_done(job, 1, 0)
    store.set_plan(job, plan((0, 0)))  # a new plan starts its stages afresh
    assert store.stage_done(job, 0, 0)


def test_steps_keep_their_loss_even_nan_and_events_are_ordered_across_jobs(store):
    a = store.add_job(submission(), "q", now=1.0)
    b = store.add_job(submission(), "q", now=1.0)
    store.record_step(a, 1, 0.5, 100.0, now=2.0)
    store.record_step(b, 1, 0.7, 50.0, now=2.0)
    store.record_step(a, 2, math.nan, 90.0, now=3.0)
    info = store.job(a)
    assert info.step == 2 and math.isnan(info.loss)
    evs = store.events(a, 0)
    assert [e.step for e in evs] == [0, 1, 2] and evs[1].loss == 0.5
    assert evs[1].samples_per_second == 100.0 and math.isnan(evs[2].loss)
    assert all(x.seq < y.seq for x, y in zip(evs, evs[1:]))
    assert [e.step for e in store.events(a, evs[1].seq)] == [2]
    assert store.events("nope", 0) == []
    assert {e.seq for e in store.events(a, 0)}.isdisjoint(e.seq for e in store.events(b, 0))


def test_recovery_fields_are_replaced_the_step_rewound_and_the_event_logged(store):
    job = store.add_job(submission(), "q", now=1.0)
    store.record_step(job, 7, 0.5, 10.0, now=2.0)
    first = S.JobInfo(epoch=1, checkpoint_step=4, resume_step=4)
    first.recoveries.add().CopyFrom(S.Recovery(epoch=1, lost="node b"))
    store.set_recovery(job, first, now=3.0, rewind_to=4, event=S.JobEvent(
        state=S.JOB_STATE_RECOVERING, reason="recovering", epoch=1, seq=99, time=99.0))
    info = store.job(job)
    assert (info.epoch, info.checkpoint_step, info.resume_step, info.step) == (1, 4, 4, 4)
    assert [r.lost for r in info.recoveries] == ["node b"]
    ev = store.events(job, 0)[-1]
    assert (ev.reason, ev.epoch, ev.time) == ("recovering", 1, 3.0) and ev.seq != 99
    store.set_recovery(job, S.JobInfo(epoch=2, checkpoint_step=6), now=4.0)
    info = store.job(job)
    assert (info.epoch, info.checkpoint_step, info.resume_step, list(info.recoveries)) == \
        (2, 6, 0, [])  # replaced, not merged
    assert info.step == 4 and len(store.events(job, 0)) == 3
    store.set_recovery("nope", first, now=5.0, event=S.JobEvent(reason="x"))
    assert store.events("nope", 0) == []  # an unknown job is ignored


def test_a_jobs_step_log_stays_bounded_keeping_the_newest_steps_and_other_events(
        store, monkeypatch):
    from fedpipe.tracker.store import base as module

    monkeypatch.setattr(module, "MAX_STEP_EVENTS", 64)
    monkeypatch.setattr(module, "COMPACT_EVERY", 16)
    job = store.add_job(submission(steps=2000), "queued", now=1.0)
    for step in range(1, 2001):
        store.record_step(job, step, 1.0 / step, 10.0, now=1.0 + step)
        if step == 500:
            fields = tracker_pb2.JobInfo(checkpoint_step=500)
            store.set_recovery(job, fields, now=600.0, event=tracker_pb2.JobEvent(
                state=tracker_pb2.JOB_STATE_PENDING, reason="checkpoint of step 500 complete",
                checkpoint_step=500))
    events = store.events(job, 0)
    steps = [e.step for e in events if e.step and not e.checkpoint_step]
    assert len(steps) <= 64 + 16, len(steps)
    assert steps == sorted(steps) and steps[-16:] == list(range(1985, 2001))
    assert events[0].reason == "queued"  # state events are never thinned
    assert any(e.checkpoint_step == 500 for e in events)
    assert store.job(job).step == 2000


def test_sqlite_keeps_everything_across_a_reopen(tmp_path):
    path = str(tmp_path / "t.db")
    s = SqliteStore(path)
    s.add_node("a", "na", "h:1", res(), "boot-a", V, now=1.0)
    s.fence_node("a")
    job = s.add_job(submission(), "q", now=1.0)
    s.set_plan(job, plan((0, 0)))
    s.close()
    s = SqliteStore(path)
    rec, = s.node_records(include_lost=True)
    assert (rec.boot_id, rec.versions, rec.fenced) == ("boot-a", V, True)
    assert s.job(job).plan.stages[0].node_id == "n00" and s.layers(job, 0, 3)
    s.close()


def test_sqlite_opens_a_database_written_before_boot_ids_and_versions(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE nodes (node_id TEXT PRIMARY KEY, name TEXT NOT NULL, address TEXT "
               "NOT NULL, resources BLOB NOT NULL, registered REAL NOT NULL, last_heartbeat "
               "REAL NOT NULL, alive INTEGER NOT NULL)")
    db.execute("INSERT INTO nodes VALUES ('a','na','h:1',?,1.0,1.0,1)",
               (res().SerializeToString(),))
    db.commit()
    db.close()
    s = SqliteStore(path)
    rec, = s.node_records()
    assert (rec.info.name, rec.boot_id, rec.versions.protocol, rec.fenced) == ("na", "", 0, False)
    s.close()


# -- schema migrations ---------------------------------------------------------

# The schema exactly as main's SqliteStore wrote it before versions were recorded: its
# SCHEMA script, then the one column it added to a table of that script.
MAIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, name TEXT NOT NULL, address TEXT NOT NULL,
    resources BLOB NOT NULL, registered REAL NOT NULL, last_heartbeat REAL NOT NULL,
    alive INTEGER NOT NULL, boot_id TEXT NOT NULL DEFAULT '',
    versions BLOB NOT NULL DEFAULT x'', fenced INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL, reason TEXT NOT NULL,
    spec BLOB NOT NULL, plan BLOB, step INTEGER NOT NULL DEFAULT 0, loss REAL DEFAULT 0,
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS job_layers (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, blob BLOB NOT NULL, PRIMARY KEY (job_id, idx));
CREATE TABLE IF NOT EXISTS job_stages (
    job_id TEXT NOT NULL, replica INTEGER NOT NULL, stage INTEGER NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, replica, stage));
CREATE TABLE IF NOT EXISTS job_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, time REAL NOT NULL,
    state INTEGER NOT NULL, reason TEXT NOT NULL, step INTEGER NOT NULL DEFAULT 0,
    loss REAL DEFAULT 0, samples_per_second REAL NOT NULL DEFAULT 0,
    checkpoint_step INTEGER NOT NULL DEFAULT 0, epoch INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events (job_id, seq);
CREATE TABLE IF NOT EXISTS links (
    src TEXT NOT NULL, dst TEXT NOT NULL, bandwidth REAL NOT NULL, latency REAL NOT NULL,
    measured_at REAL NOT NULL, PRIMARY KEY (src, dst));
ALTER TABLE jobs ADD COLUMN recovery BLOB NOT NULL DEFAULT x'';
"""


def test_a_database_made_by_mains_unversioned_code_is_upgraded_in_place(tmp_path):
    path = str(tmp_path / "main.db")
    db = sqlite3.connect(path)
    db.executescript(MAIN_SCHEMA)
    spec = S.SubmitJobRequest(name="old", config=node_pb2.JobConfig(steps=9, microbatches=1))
    recovery = S.JobInfo(epoch=3, checkpoint_step=4, resume_step=4)
    db.execute("INSERT INTO nodes VALUES ('a','na','h:1',?,1.0,2.0,1,'boot-a',?,0)",
               (res().SerializeToString(), V.SerializeToString()))
    db.execute("INSERT INTO jobs (job_id,name,state,reason,spec,plan,step,loss,created,updated,"
               "recovery) VALUES ('j1','old',?,'running',?,?,6,0.25,1.0,2.0,?)",
               (S.JOB_STATE_RUNNING, spec.SerializeToString(), plan((0, 0)).SerializeToString(),
                recovery.SerializeToString()))
    db.execute("INSERT INTO job_layers VALUES ('j1',0,x'00ff')")
    db.execute("INSERT INTO job_events (job_id,time,state,reason,step,checkpoint_step,epoch) "
               "VALUES ('j1',1.5,?,'checkpoint',4,4,3)", (S.JOB_STATE_RUNNING,))
    db.execute("INSERT INTO links VALUES ('a','b',1e6,0.1,1.0)")
    db.commit()
    db.close()

    s = SqliteStore(path)
    assert migrations.version(s.conn) == SCHEMA_VERSION
    rec, = s.node_records()
    assert (rec.info.name, rec.info.last_heartbeat, rec.boot_id, rec.versions) == \
        ("na", 2.0, "boot-a", V)
    job = s.job("j1")
    assert (job.name, job.step, job.loss, job.steps, job.epoch, job.checkpoint_step) == \
        ("old", 6, 0.25, 9, 3, 4)
    assert job.plan.stages[0].node_id == "n00" and s.layers("j1", 0, 1) == [b"\0\xff"]
    ev, = s.events("j1", 0)
    assert (ev.reason, ev.checkpoint_step, ev.epoch) == ("checkpoint", 4, 3)
    assert [(m.src_id, m.bandwidth) for m in s.links()] == [("a", 1e6)]
    newer = s.add_job(submission(), "q", now=1.0)  # the same created time: submission order
    s.set_state(newer, S.JOB_STATE_RUNNING, "r", now=2.0)
    assert s.jobs_in(S.JOB_STATE_RUNNING) == ["j1", newer]
    assert s.events(newer, ev.seq)[0].seq > ev.seq
    s.close()
    s = SqliteStore(path)  # a second open finds it current and applies nothing again
    assert s.conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == \
        [(v,) for v in range(1, SCHEMA_VERSION + 1)]
    s.close()


@pytest.mark.parametrize("script,found", [
    ("CREATE TABLE jobs (id INTEGER, what TEXT)",
     r"a table jobs with column\(s\) id, what and no schema_version \(fedpipe's has "
     r"created, job_id, "),
    ("CREATE TABLE notes (body TEXT)", r"table\(s\) notes and no schema_version \(a fedpipe "
                                       r"database has job_events, "),
    (MAIN_SCHEMA + "CREATE TABLE notes (body TEXT);", r"table\(s\) job_events, .*notes"),
    (MAIN_SCHEMA + "ALTER TABLE links ADD COLUMN colour TEXT;",
     r"a table links with column\(s\) bandwidth, colour, dst, latency, measured_at, src and "
     r"no schema_version"),
    (MAIN_SCHEMA.replace("alive INTEGER NOT NULL, ", ""), r"a table nodes with column"),
])
def test_another_applications_database_is_refused_by_name_without_a_byte_written(
        tmp_path, script, found):
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.executescript(script)
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreConfigError, match=rf"SQLite database {path} is not a fedpipe "
                                               rf"tracker database: it has {found}"):
        SqliteStore(str(path))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


def sql_target(kind: str, request, tmp_path) -> str:
    """A fresh database: a SQLite path, or the URL of a new PostgreSQL database."""
    if kind == "sqlite":
        return str(tmp_path / "m.db")
    return request.getfixturevalue("postgres_server").new_database()


def connect(kind: str, target: str) -> Connection:
    return SqliteConnection(target) if kind == "sqlite" else PostgresConnection(target)


def open_sql(kind: str, target: str) -> Store:
    return SqliteStore(target) if kind == "sqlite" else PostgresStore(target)


@pytest.fixture(params=["sqlite", POSTGRES])
def sql_kind(request) -> str:
    return request.param


def test_a_database_newer_than_this_fedpipe_is_refused_naming_both_versions(
        sql_kind, request, tmp_path):
    target = sql_target(sql_kind, request, tmp_path)
    store = open_sql(sql_kind, target)
    store.add_node("a", "na", "h:1", res(), "boot", V, now=1.0)
    store.conn.execute("INSERT INTO schema_version (version, summary, applied) "
                       "VALUES (?, 'from the future', 0)", (SCHEMA_VERSION + 7,))
    store.close()
    with pytest.raises(SchemaTooNew) as err:
        open_sql(sql_kind, target)
    assert (err.value.found, err.value.supported) == (SCHEMA_VERSION + 7, SCHEMA_VERSION)
    assert f"schema version {SCHEMA_VERSION + 7}, newer than this fedpipe's {SCHEMA_VERSION}" \
        in str(err.value)
    assert ("SQLite database" if sql_kind == "sqlite" else "PostgreSQL database") \
        in str(err.value)
    # refused before anything was written: the newer tracker's data is as it left it
    conn = connect(sql_kind, target)
    assert migrations.version(conn) == SCHEMA_VERSION + 7
    assert conn.execute("SELECT COUNT(*) FROM nodes").fetchall()[0][0] == 1
    conn.close()


def test_a_newer_sqlite_file_is_refused_without_a_byte_written(tmp_path):
    path = tmp_path / "newer.db"
    db = sqlite3.connect(path)  # rollback-journal mode, as a later release might leave it
    db.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, summary TEXT NOT "
               "NULL, applied REAL NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (?, 'from the future', 0)",
               (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(SchemaTooNew):
        SqliteStore(str(path))
    assert path.read_bytes() == before  # not even switched to WAL (header bytes 18, 19)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer.db"]


def test_another_applications_tables_are_refused_on_every_sql_backend(sql_kind, request,
                                                                      tmp_path):
    target = sql_target(sql_kind, request, tmp_path)
    conn = connect(sql_kind, target)
    conn.execute("CREATE TABLE jobs (id INTEGER, what TEXT)")
    conn.close()
    with pytest.raises(StoreConfigError, match=r"is not a fedpipe tracker database: it has a "
                                               r"table jobs with column\(s\) id, what"):
        open_sql(sql_kind, target)
    conn = connect(sql_kind, target)
    assert conn.tables() == {"jobs"} and conn.columns("jobs") == {"id", "what"}
    conn.close()


def _step(version: int, *statements: str) -> Migration:
    def apply(conn: Connection) -> None:
        for sql in statements:
            conn.execute(conn.ddl(sql))
    return Migration(version, f"step {version}", apply)


def test_migration_steps_apply_in_order_once_each_and_a_failing_one_changes_nothing(
        sql_kind, request, tmp_path):
    conn = connect(sql_kind, sql_target(sql_kind, request, tmp_path))
    steps = [_step(1, "CREATE TABLE t (a INTEGER)"),
             _step(2, "ALTER TABLE t ADD COLUMN b {blob}", "INSERT INTO t (a) VALUES (2)")]
    assert migrate(conn, steps) == 0
    assert migrate(conn, steps) == 2  # nothing left to apply: nothing applied twice
    assert conn.execute("SELECT a FROM t").fetchall() == [(2,)]
    assert conn.columns("t") == {"a", "b"}

    broken = [*steps, _step(3, "INSERT INTO t (a) VALUES (3)", "ALTER TABLE t ADD COLUMN c"
                                                               " INTEGER", "NOT SQL AT ALL")]
    with pytest.raises(Exception, match="(?i)syntax"):
        migrate(conn, broken)
    assert migrations.version(conn) == 2  # the whole step undone, with its version row
    assert conn.execute("SELECT a FROM t").fetchall() == [(2,)]
    assert conn.columns("t") == {"a", "b"}
    with pytest.raises(ValueError, match="numbered 1, 2"):
        migrate(conn, [steps[1], steps[0]])
    conn.close()
