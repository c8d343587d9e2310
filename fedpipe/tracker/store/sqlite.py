"""The tracker's state in one SQLite file (WAL), so a restarted tracker loses nothing.

The default store (``fedpipe tracker --db PATH``). Only the connection lives here;
the queries are :class:`~.sql.SqlStore`'s and the schema :mod:`.migrations`'.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any, Iterable, Sequence

from .base import Fence, StoreConfigError
from .connection import Connection, Cursor
from .sql import SqlStore

_TYPES = {"blob": "BLOB", "empty_blob": "x''", "real": "REAL",
          "serial_pk": "INTEGER PRIMARY KEY AUTOINCREMENT",
          "rowid": ""}  # every SQLite table has a rowid of its own


class SqliteConnection(Connection):
    """A connection to the SQLite file at ``path`` (":memory:" works too).

    Raises:
        StoreConfigError: the file cannot be opened or is not an SQLite database.
    """

    types = _TYPES

    def __init__(self, path: str):
        self.where = f"SQLite database {path}"
        try:
            # autocommit (isolation_level=None): the store says where transactions are
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            # a read that writes nothing: a file that is not a database is refused here;
            # WAL is set once the schema was checked (SqliteStore), as it rewrites the header
            self.db.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as exc:
            raise StoreConfigError(f"cannot open {self.where}: {exc}") from exc
        # a commit reaches the WAL at once and the file at checkpoints: a power cut may
        # lose the last commits but never corrupts the database
        self.db.execute("PRAGMA synchronous=NORMAL")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        return self.db.execute(sql, tuple(args))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.db.executemany(sql, rows)

    def begin(self) -> None:
        # IMMEDIATE: take the write lock now, so two writers never deadlock upgrading
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def lock_schema(self) -> None:
        pass  # BEGIN IMMEDIATE holds the file's only write lock already

    def tables(self) -> set[str]:
        return {row[0] for row in self.db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}

    def columns(self, table: str) -> set[str]:
        return {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}

    def member_of(self, column: str) -> str:
        return f"{column} IN (SELECT value FROM json_each(?))"

    def members(self, values: Iterable[str]) -> Any:
        return json.dumps(list(values))

    def close(self) -> None:
        self.db.close()


class SqliteStore(SqlStore):
    """The tracker's state in the SQLite file at ``path`` (WAL; ":memory:" works too).

    Attributes:
        db: the ``sqlite3`` connection (tests count its ``total_changes``).

    Args:
        fence: see :class:`~.sql.SqlStore` (several trackers on one file, one machine).

    Raises:
        StoreConfigError: the file cannot be opened or is not an SQLite database.
        SchemaTooNew: the file was written by a newer fedpipe.
    """

    def __init__(self, path: str, fence: Fence | None = None):
        conn = SqliteConnection(path)
        self.db = conn.db
        try:
            super().__init__(conn, fence)  # migrates, or refuses a newer schema writing nothing
            conn.db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreConfigError(f"cannot use {conn.where}: {exc}") from exc
