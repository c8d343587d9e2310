"""The tracker's state behind one small interface: nodes with leases, links, jobs, events.

- :mod:`.base`: the :class:`Store` interface, its records and errors, the rules every
  backend keeps;
- :mod:`.memory`: :class:`MemoryStore`, in dicts (tests; a tracker that need not
  survive a restart);
- :mod:`.sql`: :class:`~.sql.SqlStore`, every query once, over a
  :class:`~.connection.Connection` (:mod:`.connection` holds what differs between
  SQL databases);
- :mod:`.sqlite`: :class:`SqliteStore`, one local file (the default);
- :mod:`.postgres`: :class:`PostgresStore`, a PostgreSQL database (psycopg 3), loaded
  only when asked for;
- :mod:`.migrations`: the SQL schema as versioned steps.

:func:`open_store` picks the backend from a tracker's ``--db``/``--store`` argument.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

# the step log's bounds (MAX_STEP_EVENTS, COMPACT_EVERY) are base's: set them there
from .base import (NodeRecord, SchemaTooNew, Store, StoreConfigError, StoreError,
                   StoreUnavailable, new_id)
from .memory import MemoryStore
from .migrations import SCHEMA_VERSION
from .sqlite import SqliteStore

if TYPE_CHECKING:
    from .postgres import PostgresStore

__all__ = ["MemoryStore", "NodeRecord", "PostgresStore",
           "SCHEMA_VERSION", "SchemaTooNew", "SqliteStore", "Store", "StoreConfigError",
           "StoreError", "StoreUnavailable", "new_id", "open_store"]

POSTGRES_SCHEMES = ("postgresql", "postgres")
MEMORY = "memory:"
"""The ``--store`` value for a :class:`MemoryStore` (nothing survives the process)."""


def open_store(target: str) -> Store:
    """The store ``target`` names: ``postgresql://...`` (or ``postgres://...``) a
    :class:`PostgresStore`; ``sqlite://PATH`` (``sqlite:///abs/path``) or a plain path a
    :class:`SqliteStore`; ``memory:`` a :class:`MemoryStore`.

    Raises:
        StoreConfigError: an unknown scheme, or a malformed URL.
        StoreUnavailable: the database cannot be reached.
        SchemaTooNew: the database was written by a newer fedpipe.
    """
    if target == MEMORY:
        return MemoryStore()
    scheme, sep, rest = target.partition("://")
    if not sep:
        return SqliteStore(target)
    if scheme == "sqlite":
        return SqliteStore(rest)
    if scheme in POSTGRES_SCHEMES:
        from .postgres import PostgresStore

        return PostgresStore(target)
    raise StoreConfigError(
        f"unknown store {target.split('@')[-1]!r}: expected postgresql://USER@HOST:PORT/DBNAME, "
        f"sqlite://PATH, a file path or {MEMORY}")


def __getattr__(name: str) -> Any:
    # PostgresStore on first use: a SQLite tracker never loads psycopg
    if name == "PostgresStore":
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
