"""A swarm in a :class:`~fedpipe.testing.natnet.NatNetwork`: the tracker, relays, reachable
nodes and the client in its public namespace, outbound-only nodes in its homes.

Every process is started with ``ip netns exec`` and dies with this one (``child_env``);
:meth:`NatSwarm.close` stops them all. With ``tls`` every process gets a certificate of
one swarm CA, in a directory of its own, naming the addresses it is dialed at: its own,
and, for a node homed at a relay, the public address its relay allocates it.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..net import timeouts
from ..proc import child_env
from ..security import certs
from .natnet import PUBLIC_IP, Host, NatNetwork

TRACKER_PORT = 7070
START_TIMEOUT = 90.0
"""Seconds a process may take to come up (import torch on a loaded machine), and the nodes
to register and their links to be measured."""
POLL = 0.25


class NatSwarm:
    """Processes in ``net``; logs and certificates under ``workdir``.

    Args:
        net: the network.
        workdir: where the tracker's database, the logs and the certificates go.
        tls: mutual TLS everywhere (a CA in ``workdir/tls``).
        lease: the tracker's heartbeat lease, seconds.
        link_profile: emulated links (:mod:`fedpipe.net.emulation`'s format, by node name),
            given to every node.
    """

    def __init__(self, net: NatNetwork, workdir: Path, *, tls: bool = False,
                 lease: float = 5.0, link_profile: dict | None = None):
        self.net, self.workdir, self.lease = net, Path(workdir), lease
        self.tracker = f"{PUBLIC_IP}:{TRACKER_PORT}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ca: Path | None = None
        if tls:
            self.ca = self.workdir / "tls"
            certs.make_ca(self.ca)
            for role, name in ((certs.Role.CLIENT, "client"), (certs.Role.ADMIN, "admin")):
                certs.issue(self.ca, role, name)
        self.profile: Path | None = None
        if link_profile is not None:
            self.profile = self.workdir / "links.json"
            self.profile.write_text(json.dumps(link_profile))

    # -- certificates ---------------------------------------------------------------
    def _tls_dir(self, role: certs.Role | None, name: str, hosts: list[str]) -> list[str]:
        """``--tls-dir`` (and ``--name`` for a relay) of a process's own directory, with
        the CA's certificate and its own pair; [] without TLS (plaintext: ``--insecure``)."""
        if self.ca is None:
            return ["--insecure"]
        own = self.workdir / f"tls-{name}"
        if role is not None:
            certs.issue(self.ca, role, name, hosts=hosts)
            own.mkdir(mode=0o700)
            for f in (certs.CA_CERT, f"{name}.crt", f"{name}.key"):
                shutil.copy2(self.ca / f, own / f)
        return ["--tls-dir", str(own)] + (["--name", name] if role is certs.Role.RELAY else [])

    def client_args(self) -> list[str]:
        """The natclient's TLS arguments ([] without TLS)."""
        return ["--tls-dir", str(self.ca), "--tls-name", "client"] if self.ca else []

    # -- processes ------------------------------------------------------------------
    def _start(self, name: str, host: Host, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        proc = subprocess.Popen(host.command([sys.executable, "-m", "fedpipe", *args]),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env())
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        """What process ``name`` printed so far."""
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def logs(self, tail: int = 3000) -> str:
        """The end of every process's log, for an assertion's message."""
        return "\n".join(f"--- {n}\n{self.log(n)[-tail:]}" for n in self.procs)

    def _wait_log(self, name: str, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while text not in self.log(name):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not print {text!r}:\n{self.log(name)}")
            time.sleep(POLL)

    def start_tracker(self) -> None:
        self._start("tracker", self.net.public,
                    ["tracker", "--host", PUBLIC_IP, "--port", str(TRACKER_PORT),
                     "--db", str(self.workdir / "tracker.db"), "--lease", str(self.lease),
                     *self._tls_dir(certs.Role.TRACKER, "tracker", [PUBLIC_IP])])

    def start_relay(self, name: str = "relay0", port: int = 7100) -> str:
        """A `fedpipe relay` in the public namespace, once it listens; its address."""
        self._start(name, self.net.public,
                    ["relay", "--host", PUBLIC_IP, "--port", str(port),
                     *self._tls_dir(certs.Role.RELAY, name, [PUBLIC_IP])])
        self._wait_log(name, "fedpipe relay listening")
        return f"{PUBLIC_IP}:{port}"

    def add_node(self, name: str, host: Host, relay: str = "", *extra: str) -> None:
        """A node in ``host``'s namespace; homed at ``relay`` (outbound-only) if given;
        ``extra`` arguments (``--advertise``, fixed ports for a forwarded home) after the
        others."""
        hosts = [host.ip, "127.0.0.1"] + ([relay.rpartition(":")[0]] if relay else [])
        self._start(name, host,
                    ["node", "--tracker", self.tracker, "--host", host.ip, "--port", "0",
                     "--name", name, "--device", "cpu", "--threads", "1",
                     *(["--trust-code"] if self.ca is None else []),
                     *(["--relay", relay] if relay else []),
                     *(["--link-profile", str(self.profile)] if self.profile else []),
                     *self._tls_dir(certs.Role.NODE, name, hosts), *extra])

    def status(self, *args: str) -> subprocess.CompletedProcess:
        """``fedpipe status --tracker ... ARGS`` run in the public namespace (as admin under
        TLS), 200 columns wide."""
        tls = ["--tls-dir", str(self.ca), "--tls-name", "admin"] if self.ca else []
        env = dict(child_env(), COLUMNS="200")
        return subprocess.run(self.net.public.command(
            [sys.executable, "-m", "fedpipe", "status", "--tracker", self.tracker, *tls,
             *args]), capture_output=True, text=True, env=env, timeout=timeouts.CONTROL_RPC * 3)

    def wait_for_nodes(self, names: set[str]) -> dict[str, dict]:
        """Wait until the nodes ``names`` are alive and every link among them is measured
        (:func:`fedpipe.testing.natclient.wait_for_nodes`, run in the public namespace);
        each node's ``NodeInfo`` fields, by name.

        Raises:
            RuntimeError: they were not there in time (with the logs).
        """
        return self.run_client(self.workdir / "nodes.pt", "--nodes", ",".join(sorted(names)))

    def run_client(self, out: Path, *args: str, timeout: float = 300) -> dict:
        """Run :mod:`fedpipe.testing.natclient` in the public namespace; what it saved.

        Raises:
            RuntimeError: it failed (with its output and the logs).
        """
        import torch

        done = subprocess.run(self.net.public.command(
            [sys.executable, "-m", "fedpipe.testing.natclient", "--tracker", self.tracker,
             "--out", str(out), *self.client_args(), *args]),
            capture_output=True, text=True, env=child_env(), timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stdout}\n{done.stderr}\n"
                               f"{self.logs()}")
        return torch.load(out, weights_only=False)

    def close(self) -> None:
        """Stop every process (SIGINT, then SIGKILL after ``PROCESS_EXIT``)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeouts.PROCESS_EXIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "NatSwarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
