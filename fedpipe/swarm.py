"""LocalSwarm: a tracker and N nodes as separate processes on 127.0.0.1.

``fedpipe demo`` runs one; tests and benchmarks use :class:`fedpipe.testing.LocalSwarm`,
this class with fault injection (kill, pause, restart at a step) added.
"""
from __future__ import annotations

import json
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Protocol, Sequence

from .client import Client
from .net import timeouts
from .proc import NODE_SERVICE, TRACKER_SERVICE, child_env, free_port, wait_serving
from .proto import tracker_pb2
from .security import TlsConfig, certs

_POLL = 0.05  # seconds between looks at a process that is starting


class Place(Protocol):
    """Where a node runs: an address it binds, and its command line run there
    (:class:`fedpipe.testing.natnet.Host`: ``ip netns exec NS ...``)."""

    ip: str

    def command(self, argv: Sequence[str]) -> list[str]: ...


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
        host: the address the tracker binds (and nodes without ``places`` bind): the
            processes must reach it from where they run.
        places: where node ``i`` runs (``places[i]``: its address and its command line
            there, e.g. a network namespace of :mod:`fedpipe.testing.stagenet`); the
            tracker and this process must reach every one. None: all on ``host``.
        store: the tracker's ``--store`` URL (e.g. ``postgresql://...``); None: the SQLite
            file ``workdir/tracker.db``.
        link_profile: emulated links for the whole swarm, as a dict in the format of
            :mod:`fedpipe.net.emulation` (nodes are named node0, node1, ...).
        timeout: seconds to wait for the tracker and every node to be up, and
            for the links between them to be measured.
        snapshot_dirs: each node keeps its checkpoint snapshots on disk, in
            ``workdir/snapshots-nodeI`` (``fedpipe node --snapshot-dir``).
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
                 store: str | None = None, snapshot_dirs: bool = False,
                 host: str = "127.0.0.1", places: Sequence[Place] | None = None):
        self.host, self.places = host, list(places or [])
        if places is not None and len(self.places) < n_nodes:
            raise ValueError(f"{n_nodes} nodes need as many places, not {len(self.places)}")
        self.n_nodes, self.lease, self.threads = n_nodes, lease, threads
        self.snapshot_dirs = snapshot_dirs
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
    def _spawn(self, name: str, args: list[str], place: Place | None = None) -> subprocess.Popen:
        # always from the same long-lived thread: a child's PR_SET_PDEATHSIG fires when
        # the *thread* that started it ends, so a process (re)started from a short-lived
        # thread (a fault injector's, say) would be killed with it
        return self._spawner.submit(self._popen, name, args, place).result()

    def _popen(self, name: str, args: list[str], place: Place | None = None) -> subprocess.Popen:
        log, n = self.workdir / f"{name}.log", 1
        while log.exists():  # a restarted process gets a log of its own
            n += 1
            log = self.workdir / f"{name}-{n}.log"
        with open(log, "wb") as out:
            argv = [sys.executable, "-m", "fedpipe", *args]
            proc = subprocess.Popen(place.command(argv) if place else argv, stdout=out,
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
            address = self.tracker if restart else f"{self.host}:{free_port(self.host)}"
            port = address.rsplit(":", 1)[1]
            self.tracker_proc = proc = self._spawn(
                "tracker", ["tracker", "--host", self.host, "--port", port,
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
        if self.snapshot_dirs:
            tls_args += ["--snapshot-dir", str(self.snapshot_dir(i))]
        place = self.places[i] if i < len(self.places) else None
        proc = self._spawn(f"node{i}", ["node", "--tracker", self.tracker,
                                        "--host", place.ip if place else self.host,
                                        "--port", "0", "--name", f"node{i}", "--device", "cpu",
                                        "--threads", str(self.threads), *tls_args,
                                        *self.node_args, *extra], place)
        self.nodes.append(proc)
        return proc

    def snapshot_dir(self, i: int) -> Path:
        """Node ``i``'s snapshot directory (with ``snapshot_dirs``)."""
        return self.workdir / f"snapshots-node{i}"

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
        from .planner.protoio import unmeasured

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

    def client(self, name: str = "client", *, sockets: bool = True) -> Client:
        """A client of this swarm's tracker; :meth:`close` closes it.

        Under TLS it shows the certificate ``name`` (role client), issued on first use.
        ``sockets``: feed over the socket data plane (:class:`~fedpipe.Client`; False:
        over gRPC).
        """
        tls = None
        if self.tls_dir is not None:
            if not (self.tls_dir / f"{name}.crt").exists():
                certs.issue(self.tls_dir, certs.Role.CLIENT, name)
            tls = TlsConfig.load(self.tls_dir, name)
        client = Client(self.tracker, tls=tls, sockets=sockets)
        self._clients.append(client)
        return client

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
