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

import re
from typing import TYPE_CHECKING, Any

# the step log's bounds (MAX_STEP_EVENTS, COMPACT_EVERY) are base's: set them there
from .base import (Deposed, Fence, Lease, NodeRecord, SchemaTooNew, Store, StoreConfigError,
                   StoreError, StoreUnavailable, new_id)
from .memory import MemoryStore
from .migrations import SCHEMA_VERSION
from .sqlite import SqliteStore

if TYPE_CHECKING:
    from .postgres import PostgresStore

__all__ = ["Deposed", "Fence", "Lease", "MemoryStore", "NodeRecord", "PostgresStore",
           "SCHEMA_VERSION", "SchemaTooNew", "SqliteStore", "Store", "StoreConfigError",
           "StoreError", "StoreUnavailable", "new_id", "open_store"]

POSTGRES_SCHEMES = ("postgresql", "postgres")
MEMORY = "memory:"
"""The ``--store`` value for a :class:`MemoryStore` (nothing survives the process)."""


_FORMS = f"postgresql://USER@HOST:PORT/DBNAME, sqlite://PATH, a file path or {MEMORY}"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
"""What starts a value meant as a URL (two letters at least: ``C:`` is a drive)."""
_MEANT = {"memory": MEMORY, "postgres": "postgresql://USER@HOST:PORT/DBNAME",
          "postgresql": "postgresql://USER@HOST:PORT/DBNAME", "sqlite": "sqlite://PATH"}
"""A bare word that names a store kind, and the form it lacks."""


def _refuse_a_url_taken_for_a_path(target: str) -> None:
    """A plain path means a SQLite file; refuse one that was meant as a URL
    (``postgres:localhost``, ``memory``) rather than create a file of that name.

    Raises:
        StoreConfigError: ``target`` starts with ``SCHEME:`` or is the name of a store kind.
    """
    meant = _MEANT.get(target.lower())
    if meant is not None:
        raise StoreConfigError(f"store {target!r} is not a file path or URL: for that store "
                               f"write {meant} (or ./{target} for a SQLite file of that name)")
    if _SCHEME.match(target):
        scheme = target.split(":", 1)[0]
        raise StoreConfigError(f"unknown store scheme {scheme + ':'!r}: expected {_FORMS} "
                               f"(./{scheme}:... for a file path with a colon)")


def open_store(target: str, fence: Fence | None = None) -> Store:
    """The store ``target`` names: ``postgresql://...`` (or ``postgres://...``) a
    :class:`PostgresStore`; ``sqlite://PATH`` (``sqlite:///abs/path``) or a plain path a
    :class:`SqliteStore`; ``memory:`` a :class:`MemoryStore`.

    ``fence``: every write is fenced by it (see :class:`~.sql.SqlStore`): for trackers
    that share the database. A memory store is one process's: it takes no fence.

    Raises:
        StoreConfigError: an unknown scheme (``SCHEME://`` or ``SCHEME:``), a malformed
            URL, ``sqlite://`` with no path, or a bare ``memory``, ``postgres``,
            ``postgresql`` or ``sqlite`` (the form it lacks is named).
        StoreUnavailable: the database cannot be reached.
        SchemaTooNew: the database was written by a newer fedpipe.
    """
    if target == MEMORY:
        if fence is not None:
            raise StoreConfigError(f"{MEMORY} is one process's store: trackers cannot share "
                                   f"it; give a postgresql:// URL")
        return MemoryStore()
    scheme, sep, rest = target.partition("://")
    if not sep:
        _refuse_a_url_taken_for_a_path(target)
        return SqliteStore(target, fence)
    if scheme == "sqlite":
        if not rest:
            raise StoreConfigError(f"store {target!r} names no file: expected sqlite://PATH "
                                   f"(sqlite:///abs/path) or a file path")
        return SqliteStore(rest, fence)
    if scheme in POSTGRES_SCHEMES:
        from .postgres import PostgresStore

        return PostgresStore(target, fence=fence)
    raise StoreConfigError(
        f"unknown store {target.split('@')[-1]!r}: expected {_FORMS}")


def __getattr__(name: str) -> Any:
    # PostgresStore on first use: a SQLite tracker never loads psycopg
    if name == "PostgresStore":
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
