"""LocalSwarm: a tracker and N nodes as separate processes on 127.0.0.1."""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..client import Client
from ..proto import tracker_pb2

_LISTEN = re.compile(r"tracker listening on (\S+)")


def die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent dies (Linux).

    Called at start-up by processes a LocalSwarm starts (``FEDPIPE_PARENT_PID``
    is set); not a ``preexec_fn``, since forking a process that runs gRPC
    threads and then running Python code before exec can abort the child.
    """
    parent = os.environ.get("FEDPIPE_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a swarm process: ``threads`` BLAS/OpenMP threads."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", FEDPIPE_PARENT_PID=str(os.getpid()))
    return env


class LocalSwarm:
    """Start a tracker and ``n_nodes`` node processes; stop them all on exit.

    Use as a context manager; every child is killed on exit, also when the
    body raised, and (on Linux) when this process dies.

    Args:
        n_nodes: node processes to start.
        workdir: where the SQLite file and the logs go (default: a temp dir).
        lease: the tracker's heartbeat lease, seconds.
        threads: torch threads per node.
        node_args: extra ``fedpipe node`` arguments, for all nodes.
        link_profile: emulated links for the whole swarm, as a dict in the format of
            :mod:`fedpipe.net.emulation` (nodes are named node0, node1, ...).
        timeout: seconds to wait for the tracker and every node to be up, and
            for the links between them to be measured.

    Raises:
        RuntimeError: a process exited or did not come up in time (the message
            quotes its log).
    """

    def __init__(self, n_nodes: int = 2, *, workdir: str | None = None, lease: float = 5.0,
                 threads: int = 1, node_args: list[str] | None = None,
                 link_profile: dict | None = None, timeout: float = 60.0):
        self.n_nodes, self.lease, self.threads = n_nodes, lease, threads
        self.node_args, self.timeout = list(node_args or []), timeout
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="fedpipe-")
        self.workdir = Path(workdir or self._tmp.name)
        if link_profile is not None:
            path = self.workdir / "links.json"
            path.write_text(json.dumps(link_profile, indent=1))
            self.node_args += ["--link-profile", str(path)]
        self.db = str(self.workdir / "tracker.db")
        self.tracker = ""
        self.tracker_proc: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self._logs: dict[subprocess.Popen, Path] = {}

    # -- processes ----------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log, n = self.workdir / f"{name}.log", 1
        while log.exists():  # a restarted process gets a log of its own
            n += 1
            log = self.workdir / f"{name}-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fedpipe", *args], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env(self.threads))
        self._logs[proc] = log
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        """The output of one of the swarm's processes so far."""
        return self._logs[proc].read_text(errors="replace")

    def start_tracker(self) -> str:
        """Start (or restart) the tracker on the same database; return its address."""
        port = self.tracker.rsplit(":", 1)[1] if self.tracker else "0"
        self.tracker_proc = self._spawn("tracker", ["tracker", "--host", "127.0.0.1",
                                                    "--port", port, "--db", self.db,
                                                    "--lease", str(self.lease)])
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            m = _LISTEN.findall(self.log(self.tracker_proc))
            if m:
                self.tracker = m[-1]
                return self.tracker
            self._check(self.tracker_proc, "tracker")
            time.sleep(0.05)
        raise RuntimeError(f"tracker did not start in {self.timeout} s:\n"
                           f"{self.log(self.tracker_proc)}")

    def add_node(self, *extra: str) -> subprocess.Popen:
        """Start one more node process with ``extra`` arguments."""
        i = len(self.nodes)
        proc = self._spawn(f"node{i}", ["node", "--tracker", self.tracker, "--host", "127.0.0.1",
                                        "--port", "0", "--name", f"node{i}", "--device", "cpu",
                                        "--threads", str(self.threads), *self.node_args, *extra])
        self.nodes.append(proc)
        return proc

    def _check(self, proc: subprocess.Popen, what: str) -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{self.log(proc)}")

    def wait_for_nodes(self, n: int) -> None:
        """Wait until ``n`` nodes are registered and alive."""
        client = self.client()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if len(client.nodes()) >= n:
                    return
            except Exception:  # noqa: BLE001 — tracker still starting
                pass
            for i, p in enumerate(self.nodes):
                self._check(p, f"node{i}")
            time.sleep(0.1)
        logs = "\n".join(f"--- node{i}\n{self.log(p)[-2000:]}" for i, p in enumerate(self.nodes))
        raise RuntimeError(f"{n} nodes did not register within {self.timeout} s\n{logs}")

    def wait_for_links(self) -> None:
        """Wait until the tracker has measured every link between live nodes."""
        from ..tracker.service import unmeasured

        client = self.client()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(), timeout=10)
            if not unmeasured(list(reply.nodes), list(reply.links)):
                return
            time.sleep(0.2)
        raise RuntimeError(f"links were not measured within {self.timeout} s:\n"
                           f"{self.log(self.tracker_proc)[-3000:]}")

    def client(self) -> Client:
        """A client of this swarm's tracker."""
        return Client(self.tracker)

    @staticmethod
    def stop_process(proc: subprocess.Popen, kill: bool = False) -> None:
        """Terminate (or kill) a process and wait for it."""
        if proc.poll() is None:
            proc.kill() if kill else proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    # -- context manager ----------------------------------------------------
    def __enter__(self) -> "LocalSwarm":
        try:
            self.start_tracker()
            for i in range(self.n_nodes):
                # one at a time: nodes started together would measure their
                # FLOP/s while the others import torch on the same cores
                self.add_node()
                self.wait_for_nodes(i + 1)
            self.wait_for_links()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process (nodes first) and remove the temp dir."""
        for proc in [*self.nodes, self.tracker_proc]:
            if proc is not None:
                self.stop_process(proc)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()
