"""A real PostgreSQL server for the tests, started in a temporary directory and stopped at the end.

``postgres_server`` (session-scoped fixture; a test asks for it with
``request.getfixturevalue("postgres_server")``) runs Debian's ``initdb`` and
``pg_ctl`` (``/usr/lib/postgresql/<version>/bin``, or ``$FEDPIPE_PG_BIN``) as the
``postgres`` user when the tests run as root (``initdb`` refuses root), with trust
authentication for the role ``fedpipe``, on a free port of 127.0.0.1 and a unix
socket in the temporary directory. Durability is off (``fsync``): it is a scratch
server. :meth:`PgServer.new_database` gives each test a database of its own.

Without the server package the tests that need it FAIL, saying how to install it
(``sh tools/setup-test-deps.sh``); they never skip.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROLE = "fedpipe"
START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
_RUN_TIMEOUT = 120  # seconds for initdb or pg_ctl to finish


def pg_bin() -> Path:
    """The directory of ``initdb`` and ``pg_ctl`` (the newest installed version).

    Raises:
        FileNotFoundError: no PostgreSQL server is installed (the message says how to).
    """
    if os.environ.get("FEDPIPE_PG_BIN"):
        given = Path(os.environ["FEDPIPE_PG_BIN"])
        if not (given / "initdb").exists():
            raise FileNotFoundError(f"FEDPIPE_PG_BIN={given} holds no initdb")
        return given
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise FileNotFoundError(
        "no PostgreSQL server: /usr/lib/postgresql/*/bin/initdb is missing. Install it "
        "with `sh tools/setup-test-deps.sh` (apt-get install postgresql), or set "
        "FEDPIPE_PG_BIN to the directory holding initdb and pg_ctl")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """A scratch PostgreSQL server; :meth:`stop` removes it and its files.

    Raises:
        FileNotFoundError: the server package is missing.
        RuntimeError: ``initdb`` or ``pg_ctl`` failed (the message quotes its output).
    """

    def __init__(self, attempts: int = 3):
        self.bin = pg_bin()
        self.as_postgres = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="fedpipe-pg-"))
        self.data, self.log = self.dir / "data", self.dir / "server.log"
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")
        for attempt in range(attempts):
            self.port = _free_port()
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w",
                          "-t", str(START_TIMEOUT), "-o",
                          f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                          "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",
                          "start")
                return
            except RuntimeError:
                if attempt + 1 == attempts:  # most likely the port was taken: another one
                    self.stop()
                    raise

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_RUN_TIMEOUT,
                             cwd=self.dir)
        if out.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}:\n"
                               f"{out.stdout[-2000:]}{out.stderr[-2000:]}\n{log}")

    def url(self, dbname: str = "postgres") -> str:
        """The URL of database ``dbname`` over TCP."""
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{dbname}"

    def socket_url(self, dbname: str = "postgres") -> str:
        """The URL of database ``dbname`` over the unix socket in the temporary directory."""
        return f"postgresql://{ROLE}@/{dbname}?host={self.dir}&port={self.port}"

    def new_database(self) -> str:
        """Create an empty database; return its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server at once and remove its directory.

        By signal, not ``pg_ctl stop`` (what ``pg_ctl -m immediate`` sends): a session
        fixture is torn down after whichever test ran last, which may be an in-process
        one that the conftest guard would fail for starting a process.
        """
        pid_file = self.data / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid > 0:
            try:
                os.kill(pid, signal.SIGQUIT)  # PostgreSQL's immediate shutdown
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + _RUN_TIMEOUT
            while pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the postmaster removes its pid file as it exits
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    """One scratch PostgreSQL server for the whole session; fails (never skips) without
    the server package."""
    missing = None
    try:
        server = PgServer()
    except FileNotFoundError as exc:
        missing = str(exc)
    if missing is not None:
        pytest.fail(missing, pytrace=False)
    try:
        yield server
    finally:
        server.stop()
