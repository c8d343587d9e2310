"""The tracker's state behind one small interface: nodes with leases, links, jobs, events.

:class:`Store` is the interface the rest of the tracker uses;
:class:`SqliteStore` keeps everything in one SQLite file (WAL), so a restarted
tracker loses nothing, and :class:`MemoryStore` keeps it in dicts (for tests,
and for a tracker that need not survive a restart). ``tests/test_store.py``
runs one contract test against every implementation, so a further backend
can follow without touching the callers (as Flower's ``LinkState`` ABC has an
in-memory and an SQLite implementation under one test).

The store decides nothing: it never reads a clock (callers pass ``now``,
seconds since the epoch) and applies no rule beyond the one every backend
must keep, that a job in a terminal state never changes state again.
Protobuf messages are returned as fresh copies; changing them changes nothing
stored.
"""
from __future__ import annotations

import abc
import copy
import itertools
import json
import math
import sqlite3
import threading
import uuid
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..proto import node_pb2, tracker_pb2
from ..spec import TERMINAL


@dataclass(frozen=True)
class NodeRecord:
    """One registered node incarnation as the store keeps it.

    Attributes:
        info: what ``ListNodes`` shows of it.
        boot_id: the node process's boot id (new at every process start).
        versions: the versions it registered with.
        fenced: a newer incarnation registered at its address; this one
            never becomes alive again.
    """

    info: tracker_pb2.NodeInfo
    boot_id: str
    versions: tracker_pb2.Versions
    fenced: bool = False


def new_id() -> str:
    """A fresh 12-hex-digit id for a node or a job."""
    return uuid.uuid4().hex[:12]


class Store(abc.ABC):
    """Everything the tracker knows. Every method is safe to call from several threads."""

    # -- nodes --------------------------------------------------------------
    @abc.abstractmethod
    def add_node(self, node_id: str, name: str, address: str, resources: node_pb2.Resources,
                 boot_id: str, versions: tracker_pb2.Versions, now: float) -> None:
        """Store a new live node incarnation registered at ``now``."""

    @abc.abstractmethod
    def renew_node(self, node_id: str, resources: node_pb2.Resources,
                   versions: tracker_pb2.Versions, now: float) -> None:
        """The same incarnation registered again: new resources, alive, heartbeat ``now``.

        Its ``registered`` time is kept, so its links stay measured.
        """

    @abc.abstractmethod
    def fence_node(self, node_id: str) -> None:
        """Mark a replaced incarnation lost for good (heartbeats no longer revive it)."""

    @abc.abstractmethod
    def heartbeat(self, node_id: str, now: float) -> bool:
        """Renew a node's lease (a lost node comes back alive); False if unknown or fenced."""

    @abc.abstractmethod
    def mark_lost(self, node_id: str) -> bool:
        """Mark a node lost now (it left, or was found gone); False if it was not a live
        node (unknown, or lost already)."""

    @abc.abstractmethod
    def mark_lost_many(self, node_ids: Iterable[str]) -> None:
        """Mark each of ``node_ids`` lost, in one transaction (unknown ids are skipped)."""

    @abc.abstractmethod
    def set_heartbeats(self, beats: Mapping[str, float]) -> None:
        """Record many nodes' last heartbeat times (seconds since the epoch) in one transaction.

        Only live, unfenced nodes are updated: a node marked lost since the
        heartbeat was taken stays lost (reviving a node is :meth:`heartbeat`'s
        work). This is how the registry persists liveness in batches.
        """

    @abc.abstractmethod
    def expire_nodes(self, cutoff: float) -> list[str]:
        """Mark live nodes whose last heartbeat is before ``cutoff`` lost; return their ids."""

    @abc.abstractmethod
    def renew_all(self, now: float) -> None:
        """Give every live node a heartbeat at ``now`` (at tracker start-up)."""

    @abc.abstractmethod
    def node_records(self, include_lost: bool = False) -> list[NodeRecord]:
        """Registered node incarnations, oldest registration first (ties by node id)."""

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        """:meth:`node_records`' ``NodeInfo`` messages."""
        return [r.info for r in self.node_records(include_lost)]

    # -- links --------------------------------------------------------------
    @abc.abstractmethod
    def set_links(self, links: Iterable[node_pb2.LinkMeasurement]) -> None:
        """Keep the latest measurement of each directed link (failed ones are skipped)."""

    @abc.abstractmethod
    def links(self) -> list[node_pb2.LinkMeasurement]:
        """The latest measurement of every directed link, ordered by (src, dst)."""

    def links_among(self, node_ids: Iterable[str]) -> list[node_pb2.LinkMeasurement]:
        """:meth:`links` whose both ends are in ``node_ids``, ordered by (src, dst): what a
        plan over those nodes needs, without reading a swarm's worth of links (80,000 at
        10,000 nodes) on every scheduler tick. This default filters :meth:`links`."""
        ids = set(node_ids)
        return [m for m in self.links() if m.src_id in ids and m.dst_id in ids]

    # -- jobs ---------------------------------------------------------------
    @abc.abstractmethod
    def add_job(self, spec: tracker_pb2.SubmitJobRequest, reason: str, now: float) -> str:
        """Store a new PENDING job with its layers and a first event; return its id."""

    @abc.abstractmethod
    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        """The job's submission without its layers. KeyError if unknown."""

    @abc.abstractmethod
    def layers(self, job_id: str, start: int, end: int) -> list[bytes]:
        """The pickled layers ``[start, end)`` of a job (none once it is terminal)."""

    @abc.abstractmethod
    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job's current state. KeyError if unknown."""

    @abc.abstractmethod
    def jobs_in(self, *states: int) -> list[str]:
        """Ids of jobs in any of ``states``, oldest first."""

    @abc.abstractmethod
    def set_state(self, job_id: str, state: int, reason: str, now: float, *,
                  only_from: set[int] | None = None) -> bool:
        """Move a job to ``state`` with ``reason`` and log the event.

        A terminal state drops the job's layers. Returns False (and changes
        nothing) if the job is unknown, terminal, or not in ``only_from``
        when that is given.
        """

    @abc.abstractmethod
    def set_plan(self, job_id: str, plan: node_pb2.Plan) -> None:
        """Store the job's plan and mark each of its stages not done."""

    @abc.abstractmethod
    def set_config(self, job_id: str, config: node_pb2.JobConfig) -> None:
        """Replace the job's config (its "auto" settings resolved when it was planned)."""

    @abc.abstractmethod
    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float,
                    now: float) -> None:
        """A step completed: keep its loss (NaN allowed) and log a step event.

        The log stays bounded: every :data:`COMPACT_EVERY` steps, once a job has
        more than :data:`MAX_STEP_EVENTS` step events, every other one of the
        older half is dropped (state, checkpoint and recovery events are kept), so
        the newest steps stay complete and older ones thin out geometrically."""

    @abc.abstractmethod
    def stage_done(self, job_id: str, replica: int, stage: int) -> bool:
        """Mark a stage done; True when every stage of the job's plan is done."""

    @abc.abstractmethod
    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        """The job's events with ``seq > after_seq``, in order; seqs grow across all jobs."""

    @abc.abstractmethod
    def set_recovery(self, job_id: str, fields: tracker_pb2.JobInfo, now: float, *,
                     rewind_to: int | None = None, event: tracker_pb2.JobEvent | None = None
                     ) -> None:
        """Keep the job's recovery fields (``epoch``, ``checkpoint_step``,
        ``resume_step``, ``recoveries``) as ``fields`` has them; with ``rewind_to``
        also set its step back to that; with ``event`` also log it (its ``seq``
        and ``time`` are assigned here). Unknown jobs are ignored."""

    def close(self) -> None:  # noqa: B027 — optional: a backend with nothing to release
        """Release the backend's resources."""


def _bare(spec: tracker_pb2.SubmitJobRequest) -> tracker_pb2.SubmitJobRequest:
    bare = tracker_pb2.SubmitJobRequest()
    bare.CopyFrom(spec)
    del bare.layers[:]
    return bare


# ---------------------------------------------------------------------------
# SQLite

SCHEMA = """
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
"""
# columns added to ``nodes`` after its first release: a database written before
# them gets them (with their defaults) when it is opened
_ADDED_COLUMNS = {
    "nodes": {"boot_id": "TEXT NOT NULL DEFAULT ''", "versions": "BLOB NOT NULL DEFAULT x''",
              "fenced": "INTEGER NOT NULL DEFAULT 0"},
    "jobs": {"recovery": "BLOB NOT NULL DEFAULT x''"},  # JobInfo with the recovery fields only
    "job_events": {"checkpoint_step": "INTEGER NOT NULL DEFAULT 0",
                   "epoch": "INTEGER NOT NULL DEFAULT 0"},
}
_RECOVERY_FIELDS = ("epoch", "checkpoint_step", "resume_step", "recoveries")


def _recovery_only(info: tracker_pb2.JobInfo) -> tracker_pb2.JobInfo:
    out = tracker_pb2.JobInfo(epoch=info.epoch, checkpoint_step=info.checkpoint_step,
                              resume_step=info.resume_step)
    out.recoveries.extend(info.recoveries)
    return out


MAX_STEP_EVENTS = 4096
"""Step events a job's log keeps before it thins out its older half (see ``record_step``)."""
COMPACT_EVERY = 256
"""Steps between checks of a job's step-event count."""


def _nan(value: float | None) -> float:
    # SQLite stores NaN as NULL, its only way to keep a diverged step's loss
    return math.nan if value is None else value


class SqliteStore(Store):
    """The tracker's state in the SQLite file at ``path`` (WAL; ":memory:" works too).

    Raises:
        sqlite3.Error: the file cannot be opened or is not a tracker database.
    """

    def __init__(self, path: str):
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        for table, columns in _ADDED_COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for column, decl in columns.items():
                if column not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        self.lock = threading.RLock()

    def _x(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- nodes --------------------------------------------------------------
    def add_node(self, node_id, name, address, resources, boot_id, versions, now):
        self._x("INSERT INTO nodes (node_id,name,address,resources,registered,last_heartbeat,"
                "alive,boot_id,versions,fenced) VALUES (?,?,?,?,?,?,1,?,?,0)",
                (node_id, name, address, resources.SerializeToString(), now, now, boot_id,
                 versions.SerializeToString()))

    def renew_node(self, node_id, resources, versions, now):
        self._x("UPDATE nodes SET resources=?, versions=?, last_heartbeat=?, alive=1 "
                "WHERE node_id=? AND fenced=0",
                (resources.SerializeToString(), versions.SerializeToString(), now, node_id))

    def fence_node(self, node_id):
        self._x("UPDATE nodes SET alive=0, fenced=1 WHERE node_id=?", (node_id,))

    def heartbeat(self, node_id, now):
        with self.lock:
            return self.db.execute("UPDATE nodes SET last_heartbeat=?, alive=1 "
                                   "WHERE node_id=? AND fenced=0", (now, node_id)).rowcount > 0

    def mark_lost(self, node_id):
        with self.lock:
            return self.db.execute("UPDATE nodes SET alive=0 WHERE node_id=? AND alive=1",
                                   (node_id,)).rowcount > 0

    def _transaction(self, sql: str, rows: list[tuple]) -> None:
        with self.lock:
            self.db.execute("BEGIN")
            try:
                self.db.executemany(sql, rows)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def mark_lost_many(self, node_ids):
        self._transaction("UPDATE nodes SET alive=0 WHERE node_id=?", [(i,) for i in node_ids])

    def set_heartbeats(self, beats):
        self._transaction("UPDATE nodes SET last_heartbeat=? WHERE node_id=? AND alive=1 "
                          "AND fenced=0", [(t, i) for i, t in beats.items()])

    def expire_nodes(self, cutoff):
        with self.lock:
            ids = [r[0] for r in self._x(
                "SELECT node_id FROM nodes WHERE alive=1 AND last_heartbeat<?", (cutoff,))]
            self._x("UPDATE nodes SET alive=0 WHERE alive=1 AND last_heartbeat<?", (cutoff,))
        return ids

    def renew_all(self, now):
        self._x("UPDATE nodes SET last_heartbeat=? WHERE alive=1", (now,))

    def node_records(self, include_lost=False):
        sql = ("SELECT node_id,name,address,resources,alive,last_heartbeat,registered,boot_id,"
               "versions,fenced FROM nodes")
        if not include_lost:
            sql += " WHERE alive=1"
        return [NodeRecord(tracker_pb2.NodeInfo(
                    node_id=nid, name=name, address=addr,
                    resources=node_pb2.Resources.FromString(res), alive=bool(alive),
                    last_heartbeat=hb, registered=reg),
                    boot, tracker_pb2.Versions.FromString(ver), bool(fenced))
                for nid, name, addr, res, alive, hb, reg, boot, ver, fenced
                in self._x(sql + " ORDER BY registered, node_id")]

    # -- links --------------------------------------------------------------
    def set_links(self, links):
        with self.lock:
            for m in links:
                if not m.error:
                    self._x("INSERT OR REPLACE INTO links VALUES (?,?,?,?,?)",
                            (m.src_id, m.dst_id, m.bandwidth, m.latency, m.measured_at))

    def links(self):
        return [node_pb2.LinkMeasurement(src_id=s, dst_id=d, bandwidth=b, latency=lat,
                                         measured_at=at)
                for s, d, b, lat, at in self._x("SELECT * FROM links ORDER BY src, dst")]

    def links_among(self, node_ids):
        # one lookup per source by the (src, dst) key, not a scan of every link
        ids = json.dumps(sorted(set(node_ids)))
        return [node_pb2.LinkMeasurement(src_id=s, dst_id=d, bandwidth=b, latency=lat,
                                         measured_at=at)
                for s, d, b, lat, at in self._x(
                    "SELECT * FROM links WHERE src IN (SELECT value FROM json_each(?)) "
                    "AND dst IN (SELECT value FROM json_each(?)) ORDER BY src, dst",
                    (ids, ids))]

    # -- jobs ---------------------------------------------------------------
    def add_job(self, spec, reason, now):
        job_id = new_id()
        with self.lock:
            self.db.execute("BEGIN")
            try:
                self._x("INSERT INTO jobs (job_id,name,state,reason,spec,created,updated) "
                        "VALUES (?,?,?,?,?,?,?)",
                        (job_id, spec.name, tracker_pb2.JOB_STATE_PENDING, reason,
                         _bare(spec).SerializeToString(), now, now))
                self.db.executemany("INSERT INTO job_layers VALUES (?,?,?)",
                                    [(job_id, i, b) for i, b in enumerate(spec.layers)])
                self._x("INSERT INTO job_events (job_id,time,state,reason) VALUES (?,?,?,?)",
                        (job_id, now, tracker_pb2.JOB_STATE_PENDING, reason))
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        return job_id

    def spec(self, job_id):
        rows = self._x("SELECT spec FROM jobs WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        return tracker_pb2.SubmitJobRequest.FromString(rows[0][0])

    def layers(self, job_id, start, end):
        rows = self._x("SELECT blob FROM job_layers WHERE job_id=? AND idx>=? AND idx<? "
                       "ORDER BY idx", (job_id, start, end))
        return [r[0] for r in rows]

    def job(self, job_id):
        rows = self._x("SELECT job_id,name,state,reason,plan,step,loss,created,spec,recovery "
                       "FROM jobs WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        jid, name, state, reason, plan, step, loss, created, spec, recovery = rows[0]
        info = tracker_pb2.JobInfo.FromString(recovery or b"")
        submitted = tracker_pb2.SubmitJobRequest.FromString(spec)
        config = submitted.config
        info.MergeFrom(tracker_pb2.JobInfo(job_id=jid, name=name, state=state, reason=reason,
                                           owner=submitted.owner,
                                           step=step, steps=config.steps, loss=_nan(loss),
                                           created=created,
                                           checkpoint_every=config.checkpoint_every))
        if plan:
            info.plan.ParseFromString(plan)
        return info

    def jobs_in(self, *states):
        marks = ",".join("?" * len(states))
        return [r[0] for r in self._x(
            f"SELECT job_id FROM jobs WHERE state IN ({marks}) ORDER BY created, rowid", states)]

    def set_state(self, job_id, state, reason, now, *, only_from=None):
        with self.lock:
            cur = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))
            if not cur or cur[0][0] in TERMINAL or (only_from and cur[0][0] not in only_from):
                return False
            self._x("UPDATE jobs SET state=?, reason=?, updated=? WHERE job_id=?",
                    (state, reason, now, job_id))
            self._x("INSERT INTO job_events (job_id,time,state,reason) VALUES (?,?,?,?)",
                    (job_id, now, state, reason))
            if state in TERMINAL:
                self._x("DELETE FROM job_layers WHERE job_id=?", (job_id,))
            return True

    def set_plan(self, job_id, plan):
        with self.lock:
            self._x("UPDATE jobs SET plan=? WHERE job_id=?", (plan.SerializeToString(), job_id))
            self._x("DELETE FROM job_stages WHERE job_id=?", (job_id,))
            for a in plan.stages:
                self._x("INSERT INTO job_stages (job_id,replica,stage) VALUES (?,?,?)",
                        (job_id, a.replica, a.stage))

    def set_config(self, job_id, config):
        with self.lock:
            spec = self.spec(job_id)
            spec.config.CopyFrom(config)
            self._x("UPDATE jobs SET spec=? WHERE job_id=?", (spec.SerializeToString(), job_id))

    def record_step(self, job_id, step, loss, samples_per_second, now):
        with self.lock:
            self._x("UPDATE jobs SET step=?, loss=?, updated=? WHERE job_id=?",
                    (step, loss, now, job_id))
            state = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))[0][0]
            self._x("INSERT INTO job_events (job_id,time,state,reason,step,loss,samples_per_second)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (job_id, now, state, "", step, loss, samples_per_second))
            if step % COMPACT_EVERY == 0:
                self._compact(job_id)

    def _compact(self, job_id: str) -> None:
        steps = "job_id=? AND step>0 AND checkpoint_step=0 AND reason=''"
        n = self._x(f"SELECT COUNT(*) FROM job_events WHERE {steps}", (job_id,))[0][0]
        if n > MAX_STEP_EVENTS:
            older = self._x(f"SELECT seq FROM job_events WHERE {steps} ORDER BY seq LIMIT ?",
                            (job_id, n // 2))
            self.db.executemany("DELETE FROM job_events WHERE seq=?", older[1::2])

    def stage_done(self, job_id, replica, stage):
        with self.lock:
            self._x("UPDATE job_stages SET done=1 WHERE job_id=? AND replica=? AND stage=?",
                    (job_id, replica, stage))
            left = self._x("SELECT COUNT(*) FROM job_stages WHERE job_id=? AND done=0", (job_id,))
            return left[0][0] == 0

    def events(self, job_id, after_seq):
        rows = self._x("SELECT seq,time,state,reason,step,loss,samples_per_second,"
                       "checkpoint_step,epoch FROM job_events WHERE job_id=? AND seq>? "
                       "ORDER BY seq", (job_id, after_seq))
        return [tracker_pb2.JobEvent(seq=s, time=t, state=st, reason=r, step=step,
                                     loss=_nan(loss), samples_per_second=sps,
                                     checkpoint_step=ck, epoch=ep)
                for s, t, st, r, step, loss, sps, ck, ep in rows]

    def set_recovery(self, job_id, fields, now, *, rewind_to=None, event=None):
        with self.lock:
            self.db.execute("BEGIN")
            try:
                self._x("UPDATE jobs SET recovery=?, updated=? WHERE job_id=?",
                        (_recovery_only(fields).SerializeToString(), now, job_id))
                if rewind_to is not None:
                    self._x("UPDATE jobs SET step=? WHERE job_id=?", (rewind_to, job_id))
                if event is not None:
                    self._x("INSERT INTO job_events (job_id,time,state,reason,step,loss,"
                            "samples_per_second,checkpoint_step,epoch) VALUES (?,?,?,?,?,?,?,?,?)",
                            (job_id, now, event.state, event.reason, event.step, event.loss,
                             event.samples_per_second, event.checkpoint_step, event.epoch))
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")


# ---------------------------------------------------------------------------
# In memory


@dataclass
class _Job:
    spec: tracker_pb2.SubmitJobRequest
    info: tracker_pb2.JobInfo
    layers: list[bytes]
    stages: dict[tuple[int, int], bool]
    order: int


class MemoryStore(Store):
    """The tracker's state in dicts: fast, and gone when the process ends."""

    def __init__(self):
        self.lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._links: dict[tuple[str, str], node_pb2.LinkMeasurement] = {}
        self._jobs: dict[str, _Job] = {}
        self._events: list[tuple[str, tracker_pb2.JobEvent]] = []
        self._seq = itertools.count(1)
        self._order = itertools.count()

    # -- nodes --------------------------------------------------------------
    def _update(self, node_id: str, fenced: bool | None = None, **info) -> None:
        r = self._nodes[node_id]
        new = copy.deepcopy(r.info)
        for k, v in info.items():
            if k == "resources":
                new.resources.CopyFrom(v)
            else:
                setattr(new, k, v)
        self._nodes[node_id] = NodeRecord(new, r.boot_id, r.versions,
                                          r.fenced if fenced is None else fenced)

    def add_node(self, node_id, name, address, resources, boot_id, versions, now):
        with self.lock:
            if node_id in self._nodes:
                raise KeyError(f"node {node_id} exists")
            self._nodes[node_id] = NodeRecord(
                tracker_pb2.NodeInfo(node_id=node_id, name=name, address=address,
                                     resources=resources, alive=True, last_heartbeat=now,
                                     registered=now),
                boot_id, copy.deepcopy(versions))

    def renew_node(self, node_id, resources, versions, now):
        with self.lock:
            r = self._nodes.get(node_id)
            if r is None or r.fenced:
                return
            self._update(node_id, resources=resources, last_heartbeat=now, alive=True)
            r = self._nodes[node_id]
            self._nodes[node_id] = NodeRecord(r.info, r.boot_id, copy.deepcopy(versions))

    def fence_node(self, node_id):
        with self.lock:
            if node_id in self._nodes:
                self._update(node_id, fenced=True, alive=False)

    def heartbeat(self, node_id, now):
        with self.lock:
            r = self._nodes.get(node_id)
            if r is None or r.fenced:
                return False
            self._update(node_id, last_heartbeat=now, alive=True)
            return True

    def mark_lost(self, node_id):
        with self.lock:
            if node_id not in self._nodes or not self._nodes[node_id].info.alive:
                return False
            self._update(node_id, alive=False)
            return True

    def mark_lost_many(self, node_ids):
        with self.lock:
            for nid in node_ids:
                if nid in self._nodes:
                    self._update(nid, alive=False)

    def set_heartbeats(self, beats):
        with self.lock:
            for nid, now in beats.items():
                r = self._nodes.get(nid)
                if r is not None and r.info.alive and not r.fenced:
                    self._update(nid, last_heartbeat=now)

    def expire_nodes(self, cutoff):
        with self.lock:
            ids = [nid for nid, r in self._nodes.items()
                   if r.info.alive and r.info.last_heartbeat < cutoff]
            for nid in ids:
                self._update(nid, alive=False)
            return ids

    def renew_all(self, now):
        with self.lock:
            for nid, r in list(self._nodes.items()):
                if r.info.alive:
                    self._update(nid, last_heartbeat=now)

    def node_records(self, include_lost=False):
        with self.lock:
            records = [r for r in self._nodes.values() if include_lost or r.info.alive]
            records.sort(key=lambda r: (r.info.registered, r.info.node_id))
            return [copy.deepcopy(r) for r in records]

    # -- links --------------------------------------------------------------
    def set_links(self, links):
        with self.lock:
            for m in links:
                if not m.error:
                    self._links[(m.src_id, m.dst_id)] = node_pb2.LinkMeasurement(
                        src_id=m.src_id, dst_id=m.dst_id, bandwidth=m.bandwidth,
                        latency=m.latency, measured_at=m.measured_at)

    def links(self):
        with self.lock:
            return [copy.deepcopy(m) for _, m in sorted(self._links.items())]

    # -- jobs ---------------------------------------------------------------
    def _job(self, job_id: str) -> _Job:
        j = self._jobs.get(job_id)
        if j is None:
            raise KeyError(job_id)
        return j

    def _event(self, job_id: str, now: float, **fields) -> None:
        self._events.append((job_id, tracker_pb2.JobEvent(seq=next(self._seq), time=now,
                                                          **fields)))

    def add_job(self, spec, reason, now):
        job_id = new_id()
        with self.lock:
            info = tracker_pb2.JobInfo(job_id=job_id, name=spec.name, owner=spec.owner,
                                       state=tracker_pb2.JOB_STATE_PENDING, reason=reason,
                                       steps=spec.config.steps, created=now)
            self._jobs[job_id] = _Job(_bare(spec), info, list(spec.layers), {},
                                      next(self._order))
            self._event(job_id, now, state=tracker_pb2.JOB_STATE_PENDING, reason=reason)
        return job_id

    def spec(self, job_id):
        with self.lock:
            return copy.deepcopy(self._job(job_id).spec)

    def layers(self, job_id, start, end):
        with self.lock:
            j = self._jobs.get(job_id)
            return [] if j is None else j.layers[max(0, start):max(0, end)]

    def job(self, job_id):
        with self.lock:
            j = self._job(job_id)
            info = copy.deepcopy(j.info)
            info.checkpoint_every = j.spec.config.checkpoint_every
            return info

    def jobs_in(self, *states):
        with self.lock:
            found = [j for j in self._jobs.values() if j.info.state in states]
            return [j.info.job_id for j in sorted(found, key=lambda j: (j.info.created, j.order))]

    def set_state(self, job_id, state, reason, now, *, only_from=None):
        with self.lock:
            j = self._jobs.get(job_id)
            if j is None or j.info.state in TERMINAL or (only_from and
                                                         j.info.state not in only_from):
                return False
            j.info.state, j.info.reason = state, reason
            self._event(job_id, now, state=state, reason=reason)
            if state in TERMINAL:
                j.layers = []
            return True

    def set_plan(self, job_id, plan):
        with self.lock:
            j = self._job(job_id)
            j.info.plan.CopyFrom(plan)
            j.stages = {(a.replica, a.stage): False for a in plan.stages}

    def set_config(self, job_id, config):
        with self.lock:
            self._job(job_id).spec.config.CopyFrom(config)

    def record_step(self, job_id, step, loss, samples_per_second, now):
        with self.lock:
            j = self._job(job_id)
            j.info.step, j.info.loss = step, loss
            self._event(job_id, now, state=j.info.state, reason="", step=step, loss=loss,
                        samples_per_second=samples_per_second)
            if step % COMPACT_EVERY == 0:
                mine = [e.seq for jid, e in self._events if jid == job_id and e.step > 0
                        and not e.checkpoint_step and not e.reason]
                if len(mine) > MAX_STEP_EVENTS:
                    drop = set(mine[:len(mine) // 2][1::2])
                    self._events = [(jid, e) for jid, e in self._events if e.seq not in drop]

    def stage_done(self, job_id, replica, stage):
        with self.lock:
            j = self._job(job_id)
            if (replica, stage) in j.stages:
                j.stages[(replica, stage)] = True
            return all(j.stages.values())

    def events(self, job_id, after_seq):
        with self.lock:
            return [copy.deepcopy(e) for jid, e in self._events
                    if jid == job_id and e.seq > after_seq]

    def set_recovery(self, job_id, fields, now, *, rewind_to=None, event=None):
        with self.lock:
            j = self._jobs.get(job_id)
            if j is None:
                return
            for name in _RECOVERY_FIELDS:
                j.info.ClearField(name)
            j.info.MergeFrom(_recovery_only(fields))
            if rewind_to is not None:
                j.info.step = rewind_to
            if event is not None:
                ev = tracker_pb2.JobEvent()
                ev.CopyFrom(event)
                ev.seq, ev.time = next(self._seq), now
                self._events.append((job_id, ev))
