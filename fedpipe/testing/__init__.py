"""LocalSwarm: a tracker and N nodes as separate processes on 127.0.0.1."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Callable

from .. import net
from ..client import Client
from ..net import timeouts
from ..proto import node_pb2, tracker_pb2
from ..security import TlsConfig, certs
from ..security.tls import TLS_DIR_ENV
from . import faults

TRACKER_SERVICE = tracker_pb2.DESCRIPTOR.services_by_name["Tracker"].full_name
NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
_POLL = 0.05  # seconds between looks at a process that is starting


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket holds now (the kernel's pick).

    Another process may take it before the caller binds it; callers retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_serving(address: str, service: str, timeout: float,
                 alive: Callable[[], None] = lambda: None, *,
                 tls: TlsConfig | None = None) -> None:
    """Wait until the server at ``address`` reports ``service`` SERVING over grpc.health.v1.

    Args:
        service: full service name, e.g. :data:`TRACKER_SERVICE`.
        timeout: seconds.
        alive: called between tries; raises if the server's process died.
        tls: the certificate to show a server that takes only mutual TLS.

    Raises:
        TimeoutError: not serving within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    ch = net.channel(address, tls=tls)
    try:
        while True:
            left = deadline - time.monotonic()
            if net.serving(ch, service, timeout=max(0.001, min(timeouts.HEALTH_RPC, left))):
                return
            alive()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{service} at {address} is not serving after {timeout} s")
            time.sleep(_POLL)
    finally:
        ch.close()


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
    """Environment for a swarm process: ``threads`` BLAS/OpenMP threads.

    ``$FEDPIPE_TLS_DIR`` is not passed on: a swarm process gets its TLS
    directory, if any, on its command line.
    """
    env = {k: v for k, v in os.environ.items() if k != TLS_DIR_ENV}
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
        tracker_args: extra ``fedpipe tracker`` arguments (e.g. ``--http-port``), also
            on a restart.
        store: the tracker's ``--store`` URL (e.g. ``postgresql://...``); None: the SQLite
            file ``workdir/tracker.db``.
        link_profile: emulated links for the whole swarm, as a dict in the format of
            :mod:`fedpipe.net.emulation` (nodes are named node0, node1, ...).
        timeout: seconds to wait for the tracker and every node to be up, and
            for the links between them to be measured.
        tls: run the whole swarm over mutual TLS: make a swarm CA in ``workdir/tls``
            and issue certificates there (tracker ``tracker``, nodes ``node0``...,
            client ``client``, admin ``admin``, all for 127.0.0.1); every process
            gets ``--tls-dir``, :meth:`client` uses ``client``'s and the swarm's
            own calls ``admin``'s. Each node gets a directory of its own
            (``workdir/tls-nodeI``: the CA's certificate and its own pair), as on a
            real machine, so it learns revocations (``certs.revoke(swarm.tls_dir, ...)``)
            from the tracker's heartbeat replies, not from the CA's ``revoked.json``.

    Raises:
        RuntimeError: a process exited or did not come up in time (the message
            quotes its log).
    """

    def __init__(self, n_nodes: int = 2, *, workdir: str | None = None, lease: float = 5.0,
                 threads: int = 1, node_args: list[str] | None = None,
                 tracker_args: list[str] | None = None,
                 link_profile: dict | None = None, timeout: float = 60.0, tls: bool = False,
                 store: str | None = None):
        self.n_nodes, self.lease, self.threads = n_nodes, lease, threads
        self.node_args, self.timeout = list(node_args or []), timeout
        self.tracker_args = list(tracker_args or [])
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="fedpipe-")
        self.workdir = Path(workdir or self._tmp.name)
        if link_profile is not None:
            path = self.workdir / "links.json"
            path.write_text(json.dumps(link_profile, indent=1))
            self.node_args += ["--link-profile", str(path)]
        self.db = str(self.workdir / "tracker.db")
        self.store = store
        self.tls_dir: Path | None = None
        """The swarm's CA and certificates (None: plaintext)."""
        self.admin_tls: TlsConfig | None = None
        if tls:
            self.tls_dir = self.workdir / "tls"
            certs.make_ca(self.tls_dir)
            certs.issue(self.tls_dir, certs.Role.TRACKER, "tracker")
            certs.issue(self.tls_dir, certs.Role.ADMIN, "admin")
            certs.issue(self.tls_dir, certs.Role.CLIENT, "client")
            self.admin_tls = TlsConfig.load(self.tls_dir, "admin")
        self.tracker = ""
        self.tracker_proc: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self._logs: dict[subprocess.Popen, Path] = {}
        self._clients: list[Client] = []
        self._spawner = futures.ThreadPoolExecutor(1, thread_name_prefix="swarm-spawner")
        self.faulted: set[subprocess.Popen] = set()
        """Node processes a fault injection killed or paused (their exit is no error)."""

    # -- processes ----------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        # always from the same long-lived thread: a child's PR_SET_PDEATHSIG fires when
        # the *thread* that started it ends, so a process (re)started from a short-lived
        # thread (a fault injector's, say) would be killed with it
        return self._spawner.submit(self._popen, name, args).result()

    def _popen(self, name: str, args: list[str]) -> subprocess.Popen:
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

    def start_tracker(self, attempts: int = 3) -> str:
        """Start (or restart) the tracker on the same database; return its address.

        It is up when its ``grpc.health.v1`` service says the tracker is
        SERVING. A first start picks a free port, and picks another if a
        process took that one first (up to ``attempts`` tries); a restart
        reuses the port.

        Raises:
            RuntimeError: the tracker exited or was not serving within the timeout.
        """
        restart = bool(self.tracker)
        for attempt in range(1 if restart else attempts):
            address = self.tracker if restart else f"127.0.0.1:{free_port()}"
            port = address.rsplit(":", 1)[1]
            self.tracker_proc = proc = self._spawn(
                "tracker", ["tracker", "--host", "127.0.0.1", "--port", port,
                            *(["--store", self.store] if self.store else ["--db", self.db]),
                            "--lease", str(self.lease), *self._tls_args(),
                            *self.tracker_args])
            try:
                wait_serving(address, TRACKER_SERVICE, self.timeout,
                             lambda proc=proc: self._check(proc, "tracker"), tls=self.admin_tls)
            except TimeoutError:
                raise RuntimeError(f"tracker did not start in {self.timeout} s:\n"
                                   f"{self.log(proc)}") from None
            except RuntimeError:
                if restart or attempt + 1 == attempts:
                    raise
                continue  # most likely the port was taken: another one
            self.tracker = address
            return address
        raise AssertionError("unreachable")

    def _tls_args(self) -> list[str]:
        return ["--tls-dir", str(self.tls_dir)] if self.tls_dir is not None else []

    def issue(self, role: str, name: str, **kwargs) -> TlsConfig:
        """Issue one more certificate of this swarm's CA (see :func:`fedpipe.security.certs.issue`
        for ``kwargs``) and return it as a :class:`TlsConfig` (unchecked, so tests can
        make expired ones).

        Raises:
            ValueError: the swarm runs without TLS.
        """
        if self.tls_dir is None:
            raise ValueError("this LocalSwarm runs without TLS (LocalSwarm(tls=True))")
        certs.issue(self.tls_dir, role, name, **kwargs)
        return TlsConfig.load(self.tls_dir, name, check=False)

    def add_node(self, *extra: str) -> subprocess.Popen:
        """Start one more node process with ``extra`` arguments."""
        i = len(self.nodes)
        tls_args: list[str] = []
        if self.tls_dir is not None:
            if not (self.tls_dir / f"node{i}.crt").exists():
                certs.issue(self.tls_dir, certs.Role.NODE, f"node{i}")
            own = self.workdir / f"tls-node{i}"
            if not own.exists():
                own.mkdir(mode=0o700)
                for name in (certs.CA_CERT, f"node{i}.crt", f"node{i}.key"):
                    shutil.copy2(self.tls_dir / name, own / name)
            tls_args = ["--tls-dir", str(own)]
        proc = self._spawn(f"node{i}", ["node", "--tracker", self.tracker, "--host", "127.0.0.1",
                                        "--port", "0", "--name", f"node{i}", "--device", "cpu",
                                        "--threads", str(self.threads), *tls_args,
                                        *self.node_args, *extra])
        self.nodes.append(proc)
        return proc

    def _check(self, proc: subprocess.Popen, what: str) -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{self.log(proc)}")

    def wait_for_nodes(self, n: int) -> None:
        """Wait until ``n`` nodes are registered and alive, and each says SERVING."""
        deadline = time.monotonic() + self.timeout
        with self._admin() as client:
            while time.monotonic() < deadline:
                try:
                    nodes = client.nodes()
                except Exception:  # noqa: BLE001 — tracker still starting
                    nodes = []
                if len(nodes) >= n:
                    try:  # a node registers once it serves; its health says so too
                        for x in nodes:
                            wait_serving(x.address, NODE_SERVICE,
                                         max(0.0, deadline - time.monotonic()),
                                         tls=self.admin_tls)
                    except TimeoutError:
                        break
                    return
                for i, p in enumerate(self.nodes):
                    if p not in self.faulted:
                        self._check(p, f"node{i}")
                time.sleep(2 * _POLL)
        logs = "\n".join(f"--- node{i}\n{self.log(p)[-2000:]}" for i, p in enumerate(self.nodes))
        raise RuntimeError(f"{n} nodes did not register and serve within {self.timeout} s\n{logs}")

    def wait_for_links(self) -> None:
        """Wait until the tracker has measured every link between live nodes."""
        from ..tracker.service import unmeasured

        deadline = time.monotonic() + self.timeout
        with self._admin() as client:
            while time.monotonic() < deadline:
                reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(),
                                              timeout=timeouts.CONTROL_RPC)
                if not unmeasured(list(reply.nodes), list(reply.links)):
                    return
                time.sleep(4 * _POLL)
        raise RuntimeError(f"links were not measured within {self.timeout} s:\n"
                           f"{self.log(self.tracker_proc)[-3000:]}")

    def _admin(self) -> Client:
        """A client for the swarm's own calls (the admin certificate under TLS)."""
        return Client(self.tracker, tls=self.admin_tls)

    def client(self, name: str = "client") -> Client:
        """A client of this swarm's tracker; :meth:`close` closes it.

        Under TLS it shows the certificate ``name`` (role client), issued on first use.
        """
        tls = None
        if self.tls_dir is not None:
            if not (self.tls_dir / f"{name}.crt").exists():
                certs.issue(self.tls_dir, certs.Role.CLIENT, name)
            tls = TlsConfig.load(self.tls_dir, name)
        client = Client(self.tracker, tls=tls)
        self._clients.append(client)
        return client

    # -- faults (tests and benchmarks) ----------------------------------------
    def node_index(self, name_or_address: str) -> int:
        """Which of :attr:`nodes` is called ``name_or_address`` ("node2", or its HOST:PORT).

        Raises:
            KeyError: no live node has that name or address.
        """
        if name_or_address.startswith("node") and name_or_address[4:].isdigit():
            return int(name_or_address[4:])
        with self._admin() as client:
            for n in client.nodes():
                if n.address == name_or_address:
                    return int(n.name[4:])
        raise KeyError(f"no node {name_or_address!r} in this swarm")

    def kill(self, node: int | str) -> None:
        """``kill -9`` node ``node`` (its index, name or address)."""
        proc = self.nodes[node if isinstance(node, int) else self.node_index(node)]
        self.faulted.add(proc)
        faults.kill(proc)

    def pause(self, node: int | str, seconds: float) -> None:
        """SIGSTOP node ``node`` now and SIGCONT it ``seconds`` later."""
        proc = self.nodes[node if isinstance(node, int) else self.node_index(node)]
        self.faulted.add(proc)
        faults.pause(proc, seconds)

    def restart_tracker(self, kill: bool = True) -> str:
        """Kill (``kill -9``, or terminate) the tracker and start it again on the same
        database and port; return its address once it serves."""
        if self.tracker_proc is not None:
            self.stop_process(self.tracker_proc, kill=kill)
        return self.start_tracker()

    def inject(self, job_id: str) -> "faults.FaultInjector":
        """A :class:`~fedpipe.testing.faults.FaultInjector` for ``job_id``: add faults
        with ``at_step(step, name, action)``, then ``start()`` it."""
        client = self._admin()
        self._clients.append(client)
        return faults.FaultInjector(lambda: client.stub.GetJob(
            tracker_pb2.GetJobRequest(job_id=job_id), timeout=timeouts.CONTROL_RPC))

    @staticmethod
    def stop_process(proc: subprocess.Popen, kill: bool = False, now: bool = False) -> None:
        """Terminate (or kill) a process and wait for it. With ``now``, SIGINT instead of
        SIGTERM: a node stops at once rather than draining."""
        if proc.poll() is None:
            if kill:
                proc.kill()
            elif now:
                proc.send_signal(signal.SIGINT)
            else:
                proc.terminate()
            try:
                proc.wait(timeouts.PROCESS_EXIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeouts.PROCESS_EXIT)

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
        """Close the clients it made, stop every process (nodes first), remove the temp dir."""
        for client in self._clients:
            client.close()
        self._clients.clear()
        for proc in [*self.nodes, self.tracker_proc]:
            if proc is not None:  # SIGINT: a node's SIGTERM would drain it (up to a minute)
                self.stop_process(proc, now=True)
        self._spawner.shutdown(wait=False)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()
