"""The :class:`~.base.Store` over SQL, written once for every SQL database.

:class:`SqlStore` holds every query; a backend (:mod:`.sqlite`, :mod:`.postgres`)
only opens a :class:`~.connection.Connection`. Opening a store migrates the
database's schema (:func:`~.migrations.migrate`).

Every method holds the store's lock, so one connection serves the tracker's
threads. A method that writes runs in one transaction (:func:`_writes`), so a
job's state and its event, or a plan and its stages, are kept together or not at
all. If the connection broke (the database restarted, a network cut), the
method runs once more on a new connection: a read, or a write that had not
reached its commit (the database dropped that transaction), is safe to repeat.
A write whose commit was cut off raises :class:`~.base.StoreUnavailable`: it
may or may not have been kept, and a blind repeat could apply it twice.

Every write goes through :meth:`SqlStore._once`, the one place the leader's fencing
check runs when several trackers share the database (a store given a
:class:`~.base.Fence`): inside the write's own transaction, before its first
statement, the fence's epoch must still be the lease row's, read with a share lock
(PostgreSQL's ``FOR SHARE``; SQLite's ``BEGIN IMMEDIATE`` holds the file's one
write lock already), so a takeover waits for a write in flight to end and no write
of the deposed leader commits after it. The lease's own methods are not fenced.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Concatenate, Iterable, Mapping, ParamSpec, Sequence, TypeVar

from ...proto import node_pb2, tracker_pb2
from ...spec import TERMINAL
from . import base
from .base import (Deposed, Fence, Lease, NodeRecord, Store, StoreUnavailable, bare, nan_if_none,
                   new_id, recovery_only)
from .connection import Connection
from .migrations import migrate

P = ParamSpec("P")
T = TypeVar("T")
_Method = Callable[Concatenate["SqlStore", P], T]


def _reads(method: _Method[P, T]) -> _Method[P, T]:
    """Run ``method`` under the store's lock, once more on a new connection if it broke."""
    @functools.wraps(method)
    def run(self: SqlStore, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(lambda: method(self, *args, **kwargs), write=False)
    return run


def _writes(method: _Method[P, T]) -> _Method[P, T]:
    """:func:`_reads`, in one transaction (joined by the writes it calls), fenced."""
    @functools.wraps(method)
    def run(self: SqlStore, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(lambda: method(self, *args, **kwargs), write=True)
    return run


def _lease_writes(method: _Method[P, T]) -> _Method[P, T]:
    """:func:`_writes` without the fencing check: the lease's own methods."""
    @functools.wraps(method)
    def run(self: SqlStore, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(lambda: method(self, *args, **kwargs), write=True, fenced=False)
    return run


_NODE_COLUMNS = ("node_id,name,address,resources,alive,last_heartbeat,registered,boot_id,"
                 "versions,fenced,data_address,relay")
_LINK_COLUMNS = "src,dst,bandwidth,latency,measured_at"
_EVENT_COLUMNS = ("time,state,reason,step,loss,samples_per_second,checkpoint_step,epoch")


def _node(row: Sequence[Any]) -> NodeRecord:
    nid, name, addr, res, alive, hb, reg, boot, ver, fenced, data, relay = row
    return NodeRecord(tracker_pb2.NodeInfo(
        node_id=nid, name=name, address=addr, resources=node_pb2.Resources.FromString(res),
        alive=bool(alive), last_heartbeat=hb, registered=reg, data_address=data, relay=relay),
        boot, tracker_pb2.Versions.FromString(ver), bool(fenced))


def _link(row: Sequence[Any]) -> node_pb2.LinkMeasurement:
    src, dst, bandwidth, latency, at = row
    return node_pb2.LinkMeasurement(src_id=src, dst_id=dst, bandwidth=bandwidth,
                                    latency=latency, measured_at=at)


class SqlStore(Store):
    """The tracker's state in an SQL database, through one connection.

    Args:
        conn: the open connection (the store closes it); its schema is migrated here.
        fence: asked before every write (not the lease's): its epoch must be the lease
            row's, or the write is refused with :class:`~.base.Deposed`. None: writes
            are not fenced (one tracker alone on its database).

    Raises:
        SchemaTooNew: the database was written by a newer fedpipe (the connection is
            closed).
        StoreUnavailable: the database cannot be reached.
    """

    def __init__(self, conn: Connection, fence: Fence | None = None):
        self.conn, self.where, self.fence = conn, conn.where, fence
        self.lock = threading.RLock()
        self._depth = 0  # methods of this store running now in this thread's call
        try:
            with self.lock:
                self._run(lambda: migrate(conn), write=False)
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    # -- running a method ---------------------------------------------------
    def _run(self, call: Callable[[], T], write: bool, fenced: bool = True) -> T:
        with self.lock:
            if self._depth:  # called by another method of this store: part of its work
                return call()
            fenced = write and fenced and self.fence is not None
            try:
                return self._once(call, write, fenced)
            except Exception as exc:  # noqa: BLE001 — only a broken connection is retried
                if not self.conn.is_disconnect(exc):
                    raise
            self.conn.reconnect()
            try:
                return self._once(call, write, fenced)
            except Exception as exc:
                if self.conn.is_disconnect(exc):
                    raise StoreUnavailable(f"lost the connection to {self.conn.where} "
                                           f"twice in a row: {exc}") from exc
                raise

    def _once(self, call: Callable[[], T], write: bool, fenced: bool = False) -> T:
        self._depth += 1
        try:
            if write:
                self.conn.begin()
            try:
                if fenced:
                    self._check_fence()
                out = call()
            except BaseException:
                if write:
                    self.conn.rollback()
                raise
            if write:
                self._commit()
            return out
        finally:
            self._depth -= 1

    def _check_fence(self) -> None:
        """Inside a write's transaction: refuse it unless the fence's epoch is the lease's.

        Raises:
            Deposed: the fence says this tracker does not lead, or the lease row holds
                another epoch (a standby took over).
        """
        assert self.fence is not None
        mine = self.fence.epoch()
        rows = self._x(f"SELECT epoch FROM leader WHERE id=1{self.conn.share_lock()}")
        if not rows or rows[0][0] != mine:
            raise Deposed(f"this tracker's writes are fenced at epoch {mine} but the leader "
                          f"lease in {self.where} is at epoch {rows[0][0] if rows else '?'}: "
                          f"another tracker took over; nothing was written")

    def _commit(self) -> None:
        try:
            self.conn.commit()
        except Exception as exc:
            if self.conn.is_disconnect(exc):
                raise StoreUnavailable(
                    f"lost the connection to {self.conn.where} while committing: the write "
                    f"may or may not have been kept ({exc})") from exc
            raise

    def _x(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return self.conn.execute(sql, args).fetchall()

    def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        """How many rows ``sql`` (an UPDATE or DELETE) changed."""
        return self.conn.execute(sql, args).rowcount

    # -- nodes --------------------------------------------------------------
    @_writes
    def add_node(self, node_id: str, name: str, address: str, resources: node_pb2.Resources,
                 boot_id: str, versions: tracker_pb2.Versions, now: float,
                 data_address: str = "", relay: str = "") -> None:
        self._x("INSERT INTO nodes (node_id,name,address,resources,registered,last_heartbeat,"
                "alive,boot_id,versions,fenced,data_address,relay) "
                "VALUES (?,?,?,?,?,?,1,?,?,0,?,?)",
                (node_id, name, address, resources.SerializeToString(), now, now, boot_id,
                 versions.SerializeToString(), data_address, relay))

    @_writes
    def renew_node(self, node_id: str, resources: node_pb2.Resources,
                   versions: tracker_pb2.Versions, now: float, address: str = "",
                   data_address: str = "", relay: str = "") -> None:
        self._x("UPDATE nodes SET resources=?, versions=?, last_heartbeat=?, alive=1, "
                "address=COALESCE(NULLIF(?, ''), address), data_address=?, relay=? "
                "WHERE node_id=? AND fenced=0",
                (resources.SerializeToString(), versions.SerializeToString(), now, address,
                 data_address, relay, node_id))

    @_writes
    def fence_node(self, node_id: str) -> None:
        self._x("UPDATE nodes SET alive=0, fenced=1 WHERE node_id=?", (node_id,))

    @_writes
    def heartbeat(self, node_id: str, now: float) -> bool:
        return self._count("UPDATE nodes SET last_heartbeat=?, alive=1 "
                           "WHERE node_id=? AND fenced=0", (now, node_id)) > 0

    @_writes
    def mark_lost(self, node_id: str) -> bool:
        return self._count("UPDATE nodes SET alive=0 WHERE node_id=? AND alive=1",
                           (node_id,)) > 0

    @_writes
    def mark_lost_many(self, node_ids: Iterable[str]) -> None:
        self.conn.executemany("UPDATE nodes SET alive=0 WHERE node_id=?",
                              [(i,) for i in node_ids])

    @_writes
    def set_heartbeats(self, beats: Mapping[str, float]) -> None:
        self.conn.executemany("UPDATE nodes SET last_heartbeat=? WHERE node_id=? AND alive=1 "
                              "AND fenced=0", [(t, i) for i, t in beats.items()])

    @_writes
    def expire_nodes(self, cutoff: float) -> list[str]:
        ids = [r[0] for r in self._x(
            "SELECT node_id FROM nodes WHERE alive=1 AND last_heartbeat<? "
            "ORDER BY registered, node_id",
            (cutoff,))]
        self._x("UPDATE nodes SET alive=0 WHERE alive=1 AND last_heartbeat<?", (cutoff,))
        return ids

    @_writes
    def renew_all(self, now: float) -> None:
        self._x("UPDATE nodes SET last_heartbeat=? WHERE alive=1", (now,))

    @_reads
    def node_records(self, include_lost: bool = False) -> list[NodeRecord]:
        where = "" if include_lost else " WHERE alive=1"
        return [_node(row) for row in self._x(
            f"SELECT {_NODE_COLUMNS} FROM nodes{where} ORDER BY registered, node_id")]

    # -- links --------------------------------------------------------------
    @_writes
    def set_links(self, links: Iterable[node_pb2.LinkMeasurement]) -> None:
        self.conn.executemany(
            f"INSERT INTO links ({_LINK_COLUMNS}) VALUES (?,?,?,?,?) ON CONFLICT (src, dst) "
            "DO UPDATE SET bandwidth=excluded.bandwidth, latency=excluded.latency, "
            "measured_at=excluded.measured_at",
            [(m.src_id, m.dst_id, m.bandwidth, m.latency, m.measured_at)
             for m in links if not m.error])

    @_reads
    def links(self) -> list[node_pb2.LinkMeasurement]:
        return [_link(row) for row in self._x(
            f"SELECT {_LINK_COLUMNS} FROM links ORDER BY src, dst")]

    @_reads
    def links_among(self, node_ids: Iterable[str]) -> list[node_pb2.LinkMeasurement]:
        # one lookup per source by the (src, dst) key, not a scan of every link
        ids = self.conn.members(sorted(set(node_ids)))
        return [_link(row) for row in self._x(
            f"SELECT {_LINK_COLUMNS} FROM links WHERE {self.conn.member_of('src')} "
            f"AND {self.conn.member_of('dst')} ORDER BY src, dst", (ids, ids))]

    # -- jobs ---------------------------------------------------------------
    def _event(self, job_id: str, now: float, event: tracker_pb2.JobEvent) -> None:
        self._x(f"INSERT INTO job_events (job_id,{_EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                (job_id, now, event.state, event.reason, event.step, event.loss,
                 event.samples_per_second, event.checkpoint_step, event.epoch))

    @_writes
    def add_job(self, spec: tracker_pb2.SubmitJobRequest, reason: str, now: float) -> str:
        job_id = new_id()
        self._x("INSERT INTO jobs (job_id,name,state,reason,spec,created,updated) "
                "VALUES (?,?,?,?,?,?,?)",
                (job_id, spec.name, tracker_pb2.JOB_STATE_PENDING, reason,
                 bare(spec).SerializeToString(), now, now))
        self.conn.executemany("INSERT INTO job_layers (job_id,idx,blob) VALUES (?,?,?)",
                              [(job_id, i, b) for i, b in enumerate(spec.layers)])
        self._event(job_id, now, tracker_pb2.JobEvent(state=tracker_pb2.JOB_STATE_PENDING,
                                                      reason=reason))
        return job_id

    @_reads
    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        rows = self._x("SELECT spec FROM jobs WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        return tracker_pb2.SubmitJobRequest.FromString(rows[0][0])

    @_reads
    def layers(self, job_id: str, start: int, end: int) -> list[bytes]:
        rows = self._x("SELECT blob FROM job_layers WHERE job_id=? AND idx>=? AND idx<? "
                       "ORDER BY idx", (job_id, start, end))
        return [bytes(r[0]) for r in rows]

    @_reads
    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        rows = self._x("SELECT job_id,name,state,reason,plan,step,loss,created,spec,recovery "
                       "FROM jobs WHERE job_id=?", (job_id,))
        if not rows:
            raise KeyError(job_id)
        jid, name, state, reason, plan, step, loss, created, spec, recovery = rows[0]
        info = tracker_pb2.JobInfo.FromString(recovery or b"")
        submitted = tracker_pb2.SubmitJobRequest.FromString(spec)
        config = submitted.config
        info.MergeFrom(tracker_pb2.JobInfo(
            job_id=jid, name=name, state=state, reason=reason, owner=submitted.owner, step=step,
            steps=config.steps, loss=nan_if_none(loss), created=created,
            checkpoint_every=config.checkpoint_every))
        if plan:
            info.plan.ParseFromString(plan)
        return info

    @_reads
    def jobs_in(self, *states: int) -> list[str]:
        if not states:
            return []
        marks = ",".join("?" * len(states))
        return [r[0] for r in self._x(
            f"SELECT job_id FROM jobs WHERE state IN ({marks}) ORDER BY created, rowid", states)]

    @_writes
    def set_state(self, job_id: str, state: int, reason: str, now: float, *,
                  only_from: set[int] | None = None) -> bool:
        cur = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))
        if not cur or cur[0][0] in TERMINAL or (only_from and cur[0][0] not in only_from):
            return False
        self._x("UPDATE jobs SET state=?, reason=?, updated=? WHERE job_id=?",
                (state, reason, now, job_id))
        self._event(job_id, now, tracker_pb2.JobEvent(state=base.job_state(state), reason=reason))
        if state in TERMINAL:
            self._x("DELETE FROM job_layers WHERE job_id=?", (job_id,))
            self._x("DELETE FROM replica_sets WHERE job_id=?", (job_id,))
        return True

    @_writes
    def set_plan(self, job_id: str, plan: node_pb2.Plan, readdressed: bool = False) -> None:
        self._x("UPDATE jobs SET plan=? WHERE job_id=?", (plan.SerializeToString(), job_id))
        if readdressed:
            return
        self._x("DELETE FROM job_stages WHERE job_id=?", (job_id,))
        self.conn.executemany("INSERT INTO job_stages (job_id,replica,stage) VALUES (?,?,?)",
                              [(job_id, a.replica, a.stage) for a in plan.stages])

    @_writes
    def set_config(self, job_id: str, config: node_pb2.JobConfig) -> None:
        spec = self.spec(job_id)
        spec.config.CopyFrom(config)
        self._x("UPDATE jobs SET spec=? WHERE job_id=?", (spec.SerializeToString(), job_id))

    @_writes
    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float,
                    now: float) -> None:
        self._x("UPDATE jobs SET step=?, loss=?, updated=? WHERE job_id=?",
                (step, loss, now, job_id))
        state = self._x("SELECT state FROM jobs WHERE job_id=?", (job_id,))[0][0]
        self._event(job_id, now, tracker_pb2.JobEvent(
            state=state, step=step, loss=loss, samples_per_second=samples_per_second))
        if base.compact_due(step):
            steps = self._x("SELECT seq FROM job_events WHERE job_id=? AND step>0 "
                            "AND checkpoint_step=0 AND reason='' ORDER BY seq", (job_id,))
            self.conn.executemany("DELETE FROM job_events WHERE seq=?",
                                  [(seq,) for seq in base.thinned([r[0] for r in steps])])

    @_writes
    def stage_done(self, job_id: str, replica: int, stage: int) -> bool:
        self._x("UPDATE job_stages SET done=1 WHERE job_id=? AND replica=? AND stage=?",
                (job_id, replica, stage))
        left = self._x("SELECT COUNT(*) FROM job_stages WHERE job_id=? AND done=0", (job_id,))
        return int(left[0][0]) == 0

    @_reads
    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        rows = self._x(f"SELECT seq,{_EVENT_COLUMNS} FROM job_events WHERE job_id=? AND seq>? "
                       "ORDER BY seq", (job_id, after_seq))
        return [tracker_pb2.JobEvent(seq=s, time=t, state=st, reason=r, step=step,
                                     loss=nan_if_none(loss), samples_per_second=sps,
                                     checkpoint_step=ck, epoch=ep)
                for s, t, st, r, step, loss, sps, ck, ep in rows]

    @_writes
    def set_recovery(self, job_id: str, fields: tracker_pb2.JobInfo, now: float, *,
                     rewind_to: int | None = None, event: tracker_pb2.JobEvent | None = None
                     ) -> None:
        if not self._count("UPDATE jobs SET recovery=?, updated=? WHERE job_id=?",
                           (recovery_only(fields).SerializeToString(), now, job_id)):
            return  # an unknown job: no event of no job
        if rewind_to is not None:
            self._x("UPDATE jobs SET step=? WHERE job_id=?", (rewind_to, job_id))
        if event is not None:
            self._event(job_id, now, event)

    @_writes
    def set_replicas(self, job_id: str, epoch: int, snapshot: bytes) -> None:
        self._x("INSERT INTO replica_sets (job_id,epoch,snapshot) VALUES (?,?,?) ON CONFLICT "
                "(job_id) DO UPDATE SET epoch=excluded.epoch, snapshot=excluded.snapshot",
                (job_id, epoch, snapshot))

    @_reads
    def replicas(self, job_id: str) -> tuple[int, bytes] | None:
        rows = self._x("SELECT epoch,snapshot FROM replica_sets WHERE job_id=?", (job_id,))
        return (int(rows[0][0]), bytes(rows[0][1])) if rows else None

    # -- the leader lease -----------------------------------------------------
    @_lease_writes
    def take_lease(self, holder: str, address: str, now: float, seconds: float) -> Lease:
        # one conditional UPDATE: of two standbys that race, the database lets one match
        self._x("UPDATE leader SET holder=?, address=?, epoch=epoch+1, expires=? "
                "WHERE id=1 AND (expires<=? OR holder=?)",
                (holder, address, now + seconds, now, holder))
        return self.lease()

    @_lease_writes
    def renew_lease(self, holder: str, epoch: int, now: float, seconds: float) -> bool:
        return self._count("UPDATE leader SET expires=? WHERE id=1 AND holder=? AND epoch=?",
                           (now + seconds, holder, epoch)) == 1

    @_lease_writes
    def release_lease(self, holder: str, epoch: int) -> None:
        self._x("UPDATE leader SET expires=0 WHERE id=1 AND holder=? AND epoch=?",
                (holder, epoch))

    @_reads
    def lease(self) -> Lease:
        holder, address, epoch, expires = self._x(
            "SELECT holder,address,epoch,expires FROM leader WHERE id=1")[0]
        return Lease(holder, address, int(epoch), float(expires))
