"""What the SQL store needs of a database: one connection, its dialect, its failures.

:class:`~.sql.SqlStore` (every query, written once) and :mod:`.migrations` (the
schema, written once) talk to a :class:`Connection`; :mod:`.sqlite` and
:mod:`.postgres` each implement one. The differences between the two databases
live here and nowhere else:

- parameters are written in the qmark style (``?``) everywhere; a backend whose
  driver wants another style translates;
- column types in DDL are named by :data:`TYPE_NAMES` placeholders (``{blob}``,
  ``{real}``, ...), each backend maps them to its own (:attr:`Connection.types`);
- "is this column one of these values" with one parameter (:meth:`Connection.member_of`);
- which errors mean the connection broke (:meth:`Connection.is_disconnect`) and how to
  open it again (:meth:`Connection.reconnect`).

A connection is not thread-safe; :class:`~.sql.SqlStore` holds its lock around every use.
"""
from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping, Protocol, Sequence

TYPE_NAMES = ("blob", "empty_blob", "real", "serial_pk", "rowid")
"""The placeholders a migration's DDL may use for types:

- ``blob``: bytes; ``empty_blob``: the literal for empty bytes (a column default);
- ``real``: a 64-bit float that keeps NaN (SQLite stores it as NULL, see
  :func:`~.base.nan_if_none`);
- ``serial_pk``: an integer primary key the database assigns, growing;
- ``rowid``: a column clause giving a table an insertion-order ``rowid`` column where
  the database has none of its own (empty for SQLite, whose tables have one).
"""


class Cursor(Protocol):
    """The part of a DB-API cursor the store reads."""

    @property
    def rowcount(self) -> int: ...

    def fetchall(self) -> list[Any]: ...


class Connection(abc.ABC):
    """One open connection to a tracker database.

    Attributes:
        where: the database in words for error messages (with no password).
        types: the DDL type for each of :data:`TYPE_NAMES`.
    """

    where: str
    types: Mapping[str, str]

    @abc.abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        """Run one statement (qmark parameters) and return its cursor."""

    @abc.abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per row of parameters."""

    @abc.abstractmethod
    def begin(self) -> None:
        """Start a write transaction (the statements until :meth:`commit` are one)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Commit the transaction :meth:`begin` started."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """Undo the open transaction, if any; never raises for a broken connection."""

    @abc.abstractmethod
    def lock_schema(self) -> None:
        """Inside a transaction, wait until no other connection is migrating the schema
        (held until the transaction ends), so two trackers starting on one database
        migrate it once."""

    @abc.abstractmethod
    def tables(self) -> set[str]:
        """The names of the database's own tables (not the database's internal ones)."""

    @abc.abstractmethod
    def columns(self, table: str) -> set[str]:
        """The names of ``table``'s columns (empty if there is no such table)."""

    @abc.abstractmethod
    def member_of(self, column: str) -> str:
        """An SQL condition "``column`` is one of the values of one ``?`` parameter";
        pass that parameter as :meth:`members` makes it."""

    @abc.abstractmethod
    def members(self, values: Iterable[str]) -> Any:
        """The parameter value for :meth:`member_of`'s condition."""

    def share_lock(self) -> str:
        """The clause that makes a ``SELECT`` in a transaction hold its rows against
        writers until the transaction ends. This default: none (a file database whose
        write transaction holds the whole file already)."""
        return ""

    def is_disconnect(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection broke (the operation may be retried on
        a new one). This default: never (a file does not disconnect)."""
        return False

    def reconnect(self) -> None:  # noqa: B027 — optional: a file does not disconnect
        """Open the connection again after :meth:`is_disconnect`.

        Raises:
            StoreUnavailable: the database cannot be reached.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection."""

    def ddl(self, template: str) -> str:
        """``template`` with its :data:`TYPE_NAMES` placeholders filled for this database."""
        return template.format(**self.types)
