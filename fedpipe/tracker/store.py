"""The tracker's state in SQLite (WAL): nodes with leases, jobs, plans, events.

Everything the tracker knows is here, so a restarted tracker loses nothing.
Protobuf messages are stored serialised; the columns the tracker queries by
are columns of their own.

A loss that is not a number (a diverged step) is kept as NULL, SQLite's only
way to store NaN, and read back as NaN.
"""
from __future__ import annotations

import math
import sqlite3
import threading
import time
import uuid
from typing import Iterable

from ..proto import node_pb2, tracker_pb2
from ..spec import TERMINAL

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, name TEXT NOT NULL, address TEXT NOT NULL,
    resources BLOB NOT NULL, registered REAL NOT NULL, last_heartbeat REAL NOT NULL,
    alive INTEGER NOT NULL);
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
    loss REAL DEFAULT 0, samples_per_second REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events (job_id, seq);
CREATE TABLE IF NOT EXISTS links (
    src TEXT NOT NULL, dst TEXT NOT NULL, bandwidth REAL NOT NULL, latency REAL NOT NULL,
    measured_at REAL NOT NULL, PRIMARY KEY (src, dst));
"""



def _nan(value: float | None) -> float:
    return math.nan if value is None else value


class Store:
    """Thread-safe access to the tracker's SQLite file at ``path``."""

    def __init__(self, path: str):
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.lock = threading.RLock()

    def _x(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- nodes --------------------------------------------------------------
    def upsert_node(self, name: str, address: str, resources: node_pb2.Resources) -> str:
        """Register a node; a node that comes back with the same name and address keeps its id."""
        now = time.time()
        with self.lock:
            row = self._x("SELECT node_id FROM nodes WHERE name=? AND address=?", (name, address))
            node_id = row[0][0] if row else uuid.uuid4().hex[:12]
            self._x("INSERT INTO nodes VALUES (?,?,?,?,?,?,1) ON CONFLICT(node_id) DO UPDATE "
                    "SET resources=excluded.resources, last_heartbeat=excluded.last_heartbeat, "
                    "alive=1", (node_id, name, address, resources.SerializeToString(), now, now))
        return node_id

    def heartbeat(self, node_id: str) -> bool:
        """Renew a node's lease; False if the node is unknown."""
        with self.lock:
            cur = self.db.execute("UPDATE nodes SET last_heartbeat=?, alive=1 WHERE node_id=?",
                                  (time.time(), node_id))
            return cur.rowcount > 0

    def mark_lost(self, node_id: str) -> bool:
        """Mark a node lost now (it said it is leaving); False if unknown."""
        with self.lock:
            return self.db.execute("UPDATE nodes SET alive=0 WHERE node_id=?",
                                   (node_id,)).rowcount > 0

    def expire_nodes(self, lease: float) -> list[str]:
        """Mark nodes whose last heartbeat is older than ``lease`` seconds lost; return their ids."""
        cutoff = time.time() - lease
        with self.lock:
            ids = [r[0] for r in self._x(
                "SELECT node_id FROM nodes WHERE alive=1 AND last_heartbeat<?", (cutoff,))]
            self._x("UPDATE nodes SET alive=0 WHERE alive=1 AND last_heartbeat<?", (cutoff,))
        return ids

    def renew_all(self) -> None:
        """Give every live node a fresh lease (at tracker start-up)."""
        self._x("UPDATE nodes SET last_heartbeat=? WHERE alive=1", (time.time(),))

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        """Registered nodes in registration order."""
        sql = "SELECT node_id,name,address,resources,alive,last_heartbeat,registered FROM nodes"
        if not include_lost:
            sql += " WHERE alive=1"
        out = []
        for nid, name, addr, res, alive, hb, reg in self._x(sql + " ORDER BY registered, node_id"):
            out.append(tracker_pb2.NodeInfo(node_id=nid, name=name, address=addr,
                                            resources=node_pb2.Resources.FromString(res),
                                            alive=bool(alive), last_heartbeat=hb, registered=reg))
        return out

    # -- links --------------------------------------------------------------
    def set_links(self, links: Iterable[node_pb2.LinkMeasurement]) -> None:
        """Keep the latest measurement of each directed link (failed ones are skipped)."""
        with self.lock:
            for m in links:
                if not m.error:
                    self._x("INSERT OR REPLACE INTO links VALUES (?,?,?,?,?)",
                            (m.src_id, m.dst_id, m.bandwidth, m.latency, m.measured_at))

    def links(self) -> list[node_pb2.LinkMeasurement]:
        """The latest measurement of every directed link."""
        return [node_pb2.LinkMeasurement(src_id=s, dst_id=d, bandwidth=b, latency=lat,
                                         measured_at=at)
                for s, d, b, lat, at in self._x("SELECT * FROM links ORDER BY src, dst")]

    # -- jobs ---------------------------------------------------------------
    def add_job(self, spec: tracker_pb2.SubmitJobRequest, reason: str) -> str:
        """Store a new PENDING job with its layers; return its id."""
        job_id = uuid.uuid4().hex[:12]
        layers = list(spec.layers)
        bare = tracker_pb2.SubmitJobRequest()
        bare.CopyFrom(spec)
        del bare.layers[:]
        now = time.time()
        with self.lock:
            self.db.execute("BEGIN")
            self._x("INSERT INTO jobs (job_id,name,state,reason,spec,created,updated) "
                    "VALUES (?,?,?,?,?,?,?)", (job_id, spec.name, tracker_pb2.JOB_STATE_PENDING,
                                               reason, bare.SerializeToString(), now, now))
            self.db.executemany("INSERT INTO job_layers VALUES (?,?,?)",
                                [(job_id, i, b) for i, b in enumerate(layers)])
            self._x("INSERT INTO job_events (job_id,time,state,reason) VALUES (?,?,?,?)",
                    (job_id, now, tracker_pb2.JOB_STATE_PENDING, reason))
            self.db.execute("COMMIT")
        return job_id

    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        """The job's submission without its layers. KeyError if unknown."""
        rows = self._x("SELECT spec FROM jobs WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        return tracker_pb2.SubmitJobRequest.FromString(rows[0][0])

    def layers(self, job_id: str, start: int, end: int) -> list[bytes]:
        """The pickled layers ``[start, end)`` of a job."""
        rows = self._x("SELECT blob FROM job_layers WHERE job_id=? AND idx>=? AND idx<? "
                       "ORDER BY idx", (job_id, start, end))
        return [r[0] for r in rows]

    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job's current state. KeyError if unknown."""
        rows = self._x("SELECT job_id,name,state,reason,plan,step,loss,created,spec FROM jobs "
                       "WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        jid, name, state, reason, plan, step, loss, created, spec = rows[0]
        steps = tracker_pb2.SubmitJobRequest.FromString(spec).config.steps
        info = tracker_pb2.JobInfo(job_id=jid, name=name, state=state, reason=reason, step=step,
                                   steps=steps, loss=_nan(loss), created=created)
        if plan:
            info.plan.ParseFromString(plan)
        return info

    def jobs_in(self, *states: int) -> list[str]:
        """Ids of jobs in any of ``states``, oldest first."""
        marks = ",".join("?" * len(states))
        return [r[0] for r in self._x(
            f"SELECT job_id FROM jobs WHERE state IN ({marks}) ORDER BY created", states)]

    def set_state(self, job_id: str, state: int, reason: str, *, only_from: set[int] | None = None
                  ) -> bool:
        """Move a job to ``state`` with ``reason`` and log the event.

        Returns False (and changes nothing) if the job is terminal, or not in
        ``only_from`` when that is given.
        """
        with self.lock:
            cur = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))
            if not cur or cur[0][0] in TERMINAL or (only_from and cur[0][0] not in only_from):
                return False
            now = time.time()
            self._x("UPDATE jobs SET state=?, reason=?, updated=? WHERE job_id=?",
                    (state, reason, now, job_id))
            self._x("INSERT INTO job_events (job_id,time,state,reason) VALUES (?,?,?,?)",
                    (job_id, now, state, reason))
            if state in TERMINAL:
                self._x("DELETE FROM job_layers WHERE job_id=?", (job_id,))
            return True

    def set_plan(self, job_id: str, plan: node_pb2.Plan) -> None:
        """Store the job's plan and one not-done row per stage."""
        with self.lock:
            self._x("UPDATE jobs SET plan=? WHERE job_id=?", (plan.SerializeToString(), job_id))
            self._x("DELETE FROM job_stages WHERE job_id=?", (job_id,))
            for a in plan.stages:
                self._x("INSERT INTO job_stages (job_id,replica,stage) VALUES (?,?,?)",
                        (job_id, a.replica, a.stage))

    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float) -> None:
        """A step completed: keep its loss and log a step event."""
        with self.lock:
            self._x("UPDATE jobs SET step=?, loss=?, updated=? WHERE job_id=?",
                    (step, loss, time.time(), job_id))
            state = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))[0][0]
            self._x("INSERT INTO job_events (job_id,time,state,reason,step,loss,samples_per_second)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (job_id, time.time(), state, "", step, loss, samples_per_second))

    def stage_done(self, job_id: str, replica: int, stage: int) -> bool:
        """Mark a stage done; True when every stage of the job is done."""
        with self.lock:
            self._x("UPDATE job_stages SET done=1 WHERE job_id=? AND replica=? AND stage=?",
                    (job_id, replica, stage))
            left = self._x("SELECT COUNT(*) FROM job_stages WHERE job_id=? AND done=0", (job_id,))
            return left[0][0] == 0

    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        """The job's events with ``seq > after_seq``, in order."""
        rows = self._x("SELECT seq,time,state,reason,step,loss,samples_per_second FROM job_events "
                       "WHERE job_id=? AND seq>? ORDER BY seq", (job_id, after_seq))
        return [tracker_pb2.JobEvent(seq=s, time=t, state=st, reason=r, step=step,
                                     loss=_nan(loss), samples_per_second=sps)
                for s, t, st, r, step, loss, sps in rows]
