"""The SQL stores when things go wrong: broken connections, bad URLs; and a real
``fedpipe tracker --store postgresql://...`` training a job end to end.

The contract every store keeps is ``test_store.py``'s; this file checks what only an
SQL store over a connection can meet.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from typing import Any, Sequence

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
import torch
from pg_server import postgres_server  # noqa: F401 — the session's PostgreSQL (a fixture)
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.testing import LocalSwarm, child_env, free_port
from fedpipe.tracker.store import (SCHEMA_VERSION, MemoryStore, PostgresStore, SqliteStore,
                                   StoreConfigError, StoreUnavailable, open_store)
from fedpipe.tracker.store.connection import Cursor
from fedpipe.tracker.store.sql import SqlStore
from fedpipe.tracker.store.sqlite import SqliteConnection

pytestmark = pytest.mark.timeout(120)
S = tracker_pb2
V = tracker_pb2.Versions(fedpipe="0.1.0", protocol=2)
RES = node_pb2.Resources(flops=1e9, memory_bytes=2**30, device="cpu")


class Disconnected(Exception):
    """What a FlakyConnection raises: the connection broke."""


class FlakyConnection(SqliteConnection):
    """A SQLite connection that breaks when told: at the next statement or the next commit
    (the statement or commit then does not happen), a given number of times."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path
        self.break_statements = self.break_commits = self.reconnects = 0

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        if self.break_statements:
            self.break_statements -= 1
            raise Disconnected("server closed the connection unexpectedly")
        return super().execute(sql, args)

    def commit(self) -> None:
        if self.break_commits:
            self.break_commits -= 1
            self.db.execute("COMMIT")  # kept, but the caller never hears so
            raise Disconnected("server closed the connection unexpectedly")
        super().commit()

    def is_disconnect(self, exc: BaseException) -> bool:
        return isinstance(exc, Disconnected)

    def reconnect(self) -> None:
        self.reconnects += 1
        self.db.close()
        SqliteConnection.__init__(self, self.path)


@pytest.fixture
def flaky(tmp_path):
    conn = FlakyConnection(str(tmp_path / "flaky.db"))
    store = SqlStore(conn)
    yield store, conn
    store.close()


def test_a_call_on_a_broken_connection_runs_once_more_on_a_new_one(flaky):
    store, conn = flaky
    store.add_node("a", "na", "h:1", RES, "boot", V, now=1.0)
    conn.break_statements = 1  # broke before the write reached the database: safe to repeat
    job = store.add_job(S.SubmitJobRequest(name="j"), "queued", now=2.0)
    conn.break_statements = 1
    assert [n.node_id for n in store.nodes()] == ["a"]
    assert conn.reconnects == 2
    assert store.jobs_in(S.JOB_STATE_PENDING) == [job]  # kept once, not twice
    assert len(store.events(job, 0)) == 1


def test_a_connection_that_breaks_again_or_at_commit_is_a_clear_error(flaky):
    store, conn = flaky
    conn.break_statements = 2
    with pytest.raises(StoreUnavailable, match="lost the connection to SQLite database .* "
                                               "twice in a row"):
        store.heartbeat("a", now=1.0)
    conn.break_commits = 1  # the commit's answer lost: it may have been kept, so no repeat
    with pytest.raises(StoreUnavailable, match="while committing: the write may or may not "
                                               "have been kept"):
        store.add_node("a", "na", "h:1", RES, "boot", V, now=1.0)
    assert [n.node_id for n in store.nodes()] == ["a"]  # kept once, by the first try


def test_a_garbage_or_unreachable_store_is_refused_by_name_without_its_password():
    with pytest.raises(StoreConfigError, match="not a PostgreSQL URL"):
        open_store("postgresql://[bad")
    with pytest.raises(StoreConfigError, match="port 'http' is not a number"):
        open_store("postgresql://u@db.example:http/x")
    with pytest.raises(StoreConfigError, match="unknown store 'h/db'") as err:
        open_store("mysql://u:hunter2@h/db")
    assert "hunter2" not in str(err.value)
    port = free_port()
    with pytest.raises(StoreUnavailable) as err:
        open_store(f"postgresql://me:hunter2@127.0.0.1:{port}/jobs")
    assert f"cannot connect to PostgreSQL database jobs at me@127.0.0.1:{port}" in \
        str(err.value) and "refused" in str(err.value) and "hunter2" not in str(err.value)
    assert isinstance(open_store("memory:"), MemoryStore)


def test_open_store_picks_the_backend_from_the_argument(tmp_path):
    for target in (str(tmp_path / "a.db"), f"sqlite://{tmp_path / 'b.db'}"):
        s = open_store(target)
        assert isinstance(s, SqliteStore) and s.where.startswith("SQLite database /")
        s.close()
    assert (tmp_path / "a.db").exists() and (tmp_path / "b.db").exists()
    (tmp_path / "notes.txt").write_text("not a database, " * 512)
    with pytest.raises(StoreConfigError, match="cannot open SQLite database .*notes.txt: file "
                                               "is not a database"):
        open_store(str(tmp_path / "notes.txt"))
    with pytest.raises(StoreConfigError, match="cannot open SQLite database /nonexistent/"):
        open_store("/nonexistent/dir/t.db")


@pytest.mark.processes
def test_a_postgres_store_survives_its_server_dropping_the_connection(request):
    server = request.getfixturevalue("postgres_server")
    url = server.new_database()
    store = PostgresStore(url)
    store.add_node("a", "na", "h:1", RES, "boot", V, now=1.0)
    for _ in range(2):  # once before a read, once before a write
        pid = store.conn.pg.info.backend_pid
        with psycopg.connect(server.url(), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        if _ == 0:
            assert [n.node_id for n in store.nodes()] == ["a"]
        else:
            assert store.heartbeat("a", now=5.0)
        assert store.conn.pg.info.backend_pid != pid
    assert store.nodes()[0].last_heartbeat == 5.0
    store.close()
    store = PostgresStore(url + "?keepalives_idle=7")  # the URL's own settings win
    given = conninfo_to_dict(store.conn.conninfo)
    assert (given["keepalives_idle"], given["tcp_user_timeout"]) == ("7", "10000")
    store.close()
    with pytest.raises(StoreUnavailable, match='database "nope" does not exist'):
        PostgresStore(server.url("nope"))


@pytest.mark.processes
def test_trackers_opening_one_new_database_together_migrate_it_once(request):
    url = request.getfixturevalue("postgres_server").new_database()
    with futures.ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresStore(url), range(4)))
    rows = stores[0].conn.execute("SELECT version FROM schema_version ORDER BY version")
    assert rows.fetchall() == [(v,) for v in range(1, SCHEMA_VERSION + 1)]
    for s in stores:
        s.close()


@pytest.mark.processes
def test_the_tracker_command_refuses_a_bad_store_with_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedpipe", "tracker", "--port", "0",
                          "--host", "127.0.0.1", "--store", "postgresql://x@127.0.0.1:1/db"],
                         capture_output=True, text=True, timeout=60, env=child_env(),
                         cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("fedpipe tracker: cannot connect to PostgreSQL database db "
                                 "at x@127.0.0.1:1:"), out.stderr
    assert "Traceback" not in out.stderr and list(tmp_path.iterdir()) == []
    both = subprocess.run([sys.executable, "-m", "fedpipe", "tracker", "--db", "t.db",
                           "--store", "memory:"], capture_output=True, text=True, timeout=60,
                          env=child_env(), cwd=tmp_path)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.processes
def test_a_tracker_on_postgres_trains_a_job_and_a_restarted_one_still_knows_it(
        request, tmp_path):
    url = request.getfixturevalue("postgres_server").new_database()
    x, y, _, _ = digits.load()
    adamw = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3)
    with LocalSwarm(n_nodes=2, workdir=str(tmp_path), store=url) as swarm:
        client = swarm.client()
        job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy, adamw,
                            digits.batches(x, y, 32), steps=5, microbatches=2, stages=2)
        assert job.wait(timeout=90, progress=False).state == "SUCCEEDED"
        ids = {n.node_id for n in client.nodes()}
        assert "PostgreSQL database" in swarm.log(swarm.tracker_proc)

        swarm.stop_process(swarm.tracker_proc, kill=True)
        swarm.start_tracker()
        client = swarm.client()
        assert client.job(job.id).status().state == "SUCCEEDED"
        assert {n.node_id for n in client.nodes()} == ids
    assert not (tmp_path / "tracker.db").exists()  # the state went to PostgreSQL only
    store = PostgresStore(url)
    info = store.job(job.id)
    assert (info.state, info.step) == (S.JOB_STATE_SUCCEEDED, 5)
    assert [e.step for e in store.events(job.id, 0) if e.step][-1] == 5
    store.close()


@pytest.mark.parametrize("target,message", [
    ("postgres:localhost", r"unknown store scheme 'postgres:': expected postgresql://"),
    ("memory", r"store 'memory' is not a file path or URL: for that store write memory:"),
    ("Postgres", r"write postgresql://USER@HOST:PORT/DBNAME"),
    ("postgresql", r"write postgresql://USER@HOST:PORT/DBNAME"),
    ("sqlite://", r"store 'sqlite://' names no file: expected sqlite://PATH"),
    ("sqlite:t.db", r"unknown store scheme 'sqlite:'"),
])
def test_a_store_meant_as_a_url_is_refused_not_taken_for_a_file(tmp_path, monkeypatch, target,
                                                                 message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreConfigError, match=message):
        open_store(target)
    assert list(tmp_path.iterdir()) == []  # no file of that name was made


def test_a_plain_relative_path_still_means_a_sqlite_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for target in ("tracker.db", "./memory", "state/../t2.db"):
        (tmp_path / "state").mkdir(exist_ok=True)
        s = open_store(target)
        assert isinstance(s, SqliteStore)
        s.close()
    assert (tmp_path / "tracker.db").exists() and (tmp_path / "memory").exists()
