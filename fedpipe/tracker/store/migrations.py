"""The tracker database's schema as ordered, versioned steps, for every SQL backend.

A database records the steps applied to it in ``schema_version`` (one row per
step: its version, summary and when it was applied, seconds since the epoch).
:func:`migrate` runs when a store opens a database: in one transaction, holding
the schema lock (:meth:`~.connection.Connection.lock_schema`), it reads the
newest version applied, refuses a database newer than :data:`MIGRATIONS` knows
(:class:`~.base.SchemaTooNew`, nothing written) and applies the missing steps in
order. A step that fails leaves the database as it was.

Steps 1 and 2 also adopt a database written before versions were recorded (a
SQLite file of fedpipe 0.1, with no ``schema_version`` table): such a database
reads as version 0, and both steps are written to be no-ops on whatever part of
the schema it already has (``IF NOT EXISTS``, columns added only where missing).
Later steps run exactly once each, so they need no such care.

To change the schema, append a :class:`Migration` (never edit an applied one); a
tracker that has it refuses nothing older, and an older tracker refuses the
upgraded database by name and version.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .base import SchemaTooNew, StoreConfigError
from .connection import Connection


class NotFedpipe(StoreConfigError):
    """The database holds tables, but not a fedpipe tracker's: another application's."""


@dataclass(frozen=True)
class Migration:
    """One step of the schema.

    Attributes:
        version: the schema version after this step (steps are numbered 1, 2, ...).
        summary: what it changes, in words (kept in ``schema_version``).
        apply: runs the step's statements on the connection, inside the migration's
            transaction.
    """

    version: int
    summary: str
    apply: Callable[[Connection], None]


def _statements(*templates: str) -> Callable[[Connection], None]:
    """A step that runs each DDL template (with the backend's types filled in)."""
    def apply(conn: Connection) -> None:
        for template in templates:
            conn.execute(conn.ddl(template))
    return apply


def _columns(added: dict[str, dict[str, str]]) -> Callable[[Connection], None]:
    """A step that adds each ``{table: {column: declaration}}`` a table lacks."""
    def apply(conn: Connection) -> None:
        for table, columns in added.items():
            have = conn.columns(table)
            for column, decl in columns.items():
                if column not in have:
                    conn.execute(conn.ddl(f"ALTER TABLE {table} ADD COLUMN {column} {decl}"))
    return apply


_ADDED_IN_2: dict[str, dict[str, str]] = {
    "nodes": {"boot_id": "TEXT NOT NULL DEFAULT ''",
              "versions": "{blob} NOT NULL DEFAULT {empty_blob}",
              "fenced": "INTEGER NOT NULL DEFAULT 0"},
    # a JobInfo with only the recovery fields set (base.recovery_only)
    "jobs": {"recovery": "{blob} NOT NULL DEFAULT {empty_blob}"},
    "job_events": {"checkpoint_step": "INTEGER NOT NULL DEFAULT 0",
                   "epoch": "INTEGER NOT NULL DEFAULT 0"},
}
"""The columns step 2 adds, by table (a database of fedpipe 0.1 may have some already)."""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "nodes, jobs with their layers, stages and events, links", _statements(
        "CREATE TABLE IF NOT EXISTS nodes ("
        " node_id TEXT PRIMARY KEY, name TEXT NOT NULL, address TEXT NOT NULL,"
        " resources {blob} NOT NULL, registered {real} NOT NULL,"
        " last_heartbeat {real} NOT NULL, alive INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS jobs ("
        " job_id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL,"
        " reason TEXT NOT NULL, spec {blob} NOT NULL, plan {blob},"
        " step INTEGER NOT NULL DEFAULT 0, loss {real} DEFAULT 0,"
        " created {real} NOT NULL, updated {real} NOT NULL{rowid})",
        "CREATE TABLE IF NOT EXISTS job_layers ("
        " job_id TEXT NOT NULL, idx INTEGER NOT NULL, blob {blob} NOT NULL,"
        " PRIMARY KEY (job_id, idx))",
        "CREATE TABLE IF NOT EXISTS job_stages ("
        " job_id TEXT NOT NULL, replica INTEGER NOT NULL, stage INTEGER NOT NULL,"
        " done INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, replica, stage))",
        "CREATE TABLE IF NOT EXISTS job_events ("
        " seq {serial_pk}, job_id TEXT NOT NULL, time {real} NOT NULL,"
        " state INTEGER NOT NULL, reason TEXT NOT NULL, step INTEGER NOT NULL DEFAULT 0,"
        " loss {real} DEFAULT 0, samples_per_second {real} NOT NULL DEFAULT 0)",
        "CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events (job_id, seq)",
        "CREATE TABLE IF NOT EXISTS links ("
        " src TEXT NOT NULL, dst TEXT NOT NULL, bandwidth {real} NOT NULL,"
        " latency {real} NOT NULL, measured_at {real} NOT NULL, PRIMARY KEY (src, dst))",
    )),
    Migration(2, "node incarnations (boot id, versions, fencing); job recovery; "
                 "checkpoint and epoch on events", _columns(_ADDED_IN_2)),
    Migration(3, "the leader lease (which tracker leads, its address and fencing epoch); "
                 "replica-group membership", _statements(
                  "CREATE TABLE leader ("
                  " id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL,"
                  " address TEXT NOT NULL, epoch INTEGER NOT NULL, expires {real} NOT NULL)",
                  # the one row, never held: take_lease only ever updates it
                  "INSERT INTO leader (id, holder, address, epoch, expires) "
                  "VALUES (1, '', '', 0, 0)",
                  "CREATE TABLE replica_sets ("
                  " job_id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, snapshot {blob} NOT NULL)")),
    Migration(4, "nodes' data-plane address and relay (a tracker that takes over knows "
                 "them)", _columns({"nodes": {"data_address": "TEXT NOT NULL DEFAULT ''",
                                              "relay": "TEXT NOT NULL DEFAULT ''"}})),
)
"""Every step of the schema, in order; the last one's version is :data:`SCHEMA_VERSION`."""

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The newest schema this fedpipe knows."""

UNVERSIONED: dict[str, frozenset[str]] = {
    "nodes": frozenset({"node_id", "name", "address", "resources", "registered",
                        "last_heartbeat", "alive"}),
    "jobs": frozenset({"job_id", "name", "state", "reason", "spec", "plan", "step", "loss",
                       "created", "updated"}),
    "job_layers": frozenset({"job_id", "idx", "blob"}),
    "job_stages": frozenset({"job_id", "replica", "stage", "done"}),
    "job_events": frozenset({"seq", "job_id", "time", "state", "reason", "step", "loss",
                             "samples_per_second"}),
    "links": frozenset({"src", "dst", "bandwidth", "latency", "measured_at"}),
}
"""The tables a fedpipe database had before versions were recorded (no ``schema_version``;
the earliest had only ``nodes``) and the columns each had from the first; each may also
have some of the columns step 2 adds (:data:`_ADDED_IN_2`), and no others. Step 1's tables
have these same columns."""


def foreign(conn: Connection) -> str | None:
    """What makes a database with no ``schema_version`` other than an empty one or an
    unversioned fedpipe one (some of :data:`UNVERSIONED`'s tables, each with its columns),
    in words; None if it is either.

    Reads only.
    """
    tables = conn.tables()
    odd_tables = tables - set(UNVERSIONED)
    if odd_tables:
        return (f"table(s) {', '.join(sorted(tables))} and no schema_version (a fedpipe "
                f"database has {', '.join(sorted(UNVERSIONED))})")
    for table in sorted(tables):
        first, have = UNVERSIONED[table], conn.columns(table)
        missing, odd = first - have, have - first - set(_ADDED_IN_2.get(table, ()))
        if missing or odd:
            return (f"a table {table} with column(s) {', '.join(sorted(have))} and no "
                    f"schema_version (fedpipe's has {', '.join(sorted(first))})")
    return None


_VERSION_TABLE = ("CREATE TABLE IF NOT EXISTS schema_version ("
                  " version INTEGER PRIMARY KEY, summary TEXT NOT NULL, applied {real} NOT NULL)")


def version(conn: Connection) -> int:
    """The newest schema version applied to the database (0: none recorded)."""
    if not conn.columns("schema_version"):
        return 0
    found = conn.execute("SELECT MAX(version) FROM schema_version").fetchall()[0][0]
    return int(found or 0)


def migrate(conn: Connection, steps: Sequence[Migration] = MIGRATIONS) -> int:
    """Bring the database up to the last of ``steps``, in one transaction; return the
    version it was at.

    Raises:
        SchemaTooNew: the database's version is newer than the last step's (nothing
            is written).
        NotFedpipe: it has no ``schema_version`` and tables other than a fedpipe 0.1
            database's (:func:`foreign`; nothing is written).
        ValueError: ``steps`` are not numbered 1, 2, ... in order.
    """
    if [s.version for s in steps] != list(range(1, len(steps) + 1)):
        raise ValueError(f"migration steps must be numbered 1, 2, ... in order, got "
                         f"{[s.version for s in steps]}")
    conn.begin()
    try:
        conn.lock_schema()
        found = version(conn)
        if found > len(steps):
            raise SchemaTooNew(conn.where, found, len(steps))
        if found == 0:
            what = foreign(conn)
            if what is not None:
                raise NotFedpipe(f"{conn.where} is not a fedpipe tracker database: it has "
                                 f"{what}; nothing was written to it. Give the tracker a new "
                                 f"file or an empty database")
        if found < len(steps):
            conn.execute(conn.ddl(_VERSION_TABLE))
        for step in steps[found:]:
            step.apply(conn)
            conn.execute("INSERT INTO schema_version (version, summary, applied) VALUES (?,?,?)",
                         (step.version, step.summary, time.time()))
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return found
