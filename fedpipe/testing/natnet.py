"""A NAT test network of Linux network namespaces, for tests and benchmarks (issue 25).

Four namespaces::

    public (10.77.0.1) ──wan── router (10.77.0.254) ──lan1── home1 (192.168.1.2)
                                                    └─lan2── home2 (192.168.2.2)

* ``public``: the tracker, the reachable nodes, the relays and the client run here.
  It routes 192.168.0.0/16 to the router, so a connection to a home address really
  goes there (and is dropped), rather than failing at once for want of a route.
* ``router``: forwards, rewrites the homes' source addresses to its own wan address
  (``iptables -t nat ... MASQUERADE``), and forwards no new inbound connection: its
  FORWARD policy is DROP; a home's new connection out to the wan side is accepted, and
  inbound packets only when ESTABLISHED or RELATED. The two homes cannot reach each
  other either (as two houses behind two NATs).
* ``home1``, ``home2``: outbound-only hosts, default route via the router.

:meth:`NatNetwork.verify` checks this from the inside: a home dials out to a public
listener (and the public side sees the router's address, not the home's), and a public
connect to a listener in a home fails. Each leg can be shaped with ``tc ... tbf``
(``rate_mbit``), at both of its ends, so each direction of each leg carries at most that.

Needs root, ``ip`` (iproute2) and ``iptables``; :func:`missing` says what is missing.
Source: the namespace plumbing of ``ip-netns(8)``; the NAT rules are the usual
masquerading router's (``iptables-extensions(8)``: conntrack, MASQUERADE).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Self, Sequence

PUBLIC_IP, ROUTER_WAN_IP = "10.77.0.1", "10.77.0.254"
HOME_IPS = ("192.168.1.2", "192.168.2.2")
ROUTER_LAN_IPS = ("192.168.1.1", "192.168.2.1")
SETUP_TIMEOUT = 30.0
"""Seconds one ``ip``/``iptables``/``tc`` command may take."""
VERIFY_CONNECT = 2.0
"""Seconds :meth:`NatNetwork.verify`'s connects wait (a dropped SYN waits all of it)."""


class NatSetupError(RuntimeError):
    """The namespaces could not be built, or do not behave as a NAT (the message says how)."""


def missing() -> str:
    """Why this machine cannot build a :class:`NatNetwork` ("" if it can): not root, or no
    ``ip``/``iptables``/``tc`` (``tools/setup-test-deps.sh`` installs iptables)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and NAT rules"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    absent = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool, path=path) is None]
    if absent:
        return (f"needs {', '.join(absent)} (iproute2, iptables; sh tools/setup-test-deps.sh "
                f"installs iptables)")
    return ""


@dataclass(frozen=True)
class Host:
    """One namespace a process runs in: its name and its address there."""

    ns: str
    ip: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


def _run(*cmd: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=SETUP_TIMEOUT)
    except subprocess.CalledProcessError as e:
        raise NatSetupError(f"{' '.join(cmd)} failed: {e.stderr.decode().strip()}") from None


class Namespaces:
    """Network namespaces made for a test or benchmark, one per :class:`Host`, each with
    its loopback up; a subclass wires them in :meth:`_build`. :meth:`close` (or the
    ``with`` block's end) deletes them, also when the build fails midway.

    Raises:
        NatSetupError: a command failed (the message quotes it and its error); whatever
            was made is deleted first.
    """

    def __init__(self, hosts: Sequence[Host]):
        self._made: list[str] = []
        try:
            for host in hosts:
                _run("ip", "netns", "add", host.ns)
                self._made.append(host.ns)
                _run("ip", "-n", host.ns, "link", "set", "lo", "up")
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """Wire the namespaces (links, addresses, routes, shaping)."""

    def close(self) -> None:
        """Delete the namespaces (their interfaces, rules and qdiscs go with them);
        idempotent."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=SETUP_TIMEOUT)
        self._made.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NatNetwork(Namespaces):
    """The namespaces above; :meth:`close` (or the ``with`` block's end) deletes them.

    Args:
        tag: a prefix for the namespace names, unique on this machine (two networks
            may exist at once: each namespace has its own addresses, so only names clash).
        rate_mbit: shape every leg (public-router, router-home) to this many Mbit/s each
            way with ``tc ... tbf`` (None: unshaped).

    Raises:
        NatSetupError: a command failed (the message quotes it and its error).
    """

    def __init__(self, tag: str | None = None, rate_mbit: float | None = None):
        tag = tag or f"nat{os.getpid() % 100000}"
        self.public = Host(f"{tag}pub", PUBLIC_IP)
        self.router = Host(f"{tag}rt", ROUTER_WAN_IP)
        self.homes = tuple(Host(f"{tag}h{i + 1}", ip) for i, ip in enumerate(HOME_IPS))
        self.rate_mbit = rate_mbit
        super().__init__((self.public, self.router, *self.homes))

    def _build(self) -> None:
        rt = self.router.ns
        self._leg(self.public, "wan0", PUBLIC_IP, "wan", ROUTER_WAN_IP, 24)
        _run("ip", "-n", self.public.ns, "route", "add", "192.168.0.0/16", "via", ROUTER_WAN_IP)
        for i, (home, lan_ip) in enumerate(zip(self.homes, ROUTER_LAN_IPS)):
            self._leg(home, "eth0", home.ip, f"lan{i + 1}", lan_ip, 24)
            _run("ip", "-n", home.ns, "route", "add", "default", "via", lan_ip)
        ipt = ["ip", "netns", "exec", rt, "iptables"]
        _run("ip", "netns", "exec", rt, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*ipt, "-P", "FORWARD", "DROP")
        _run(*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT")
        for i in range(len(self.homes)):  # out to the wan side only, not to the other home
            _run(*ipt, "-A", "FORWARD", "-i", f"lan{i + 1}", "-o", "wan", "-j", "ACCEPT")
        _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")

    def _leg(self, host: Host, dev: str, ip: str, router_dev: str, router_ip: str,
             prefix: int) -> None:
        """A veth pair between ``host`` and the router, made inside the two namespaces."""
        _run("ip", "link", "add", dev, "netns", host.ns, "type", "veth", "peer", "name",
             router_dev, "netns", self.router.ns)
        for ns, d, addr in ((host.ns, dev, ip), (self.router.ns, router_dev, router_ip)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", d)
            _run("ip", "-n", ns, "link", "set", d, "up")
            if self.rate_mbit:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", d, "root", "tbf",
                     "rate", f"{self.rate_mbit}mbit", "burst", "256kbit", "latency", "100ms")

    def forward(self, home: int, ports: Sequence[int]) -> str:
        """Forward ``ports`` of the router's public address to home ``home`` (0 or 1), as a
        home router's port forwarding does: that home is then reachable at
        ``ROUTER_WAN_IP:PORT``, from public and from the other home. Returns the host a
        node there advertises (``--advertise``).

        Raises:
            NatSetupError: a rule could not be added.
        """
        ipt = ["ip", "netns", "exec", self.router.ns, "iptables"]
        ip = self.homes[home].ip
        for port in ports:
            _run(*ipt, "-t", "nat", "-A", "PREROUTING", "-d", ROUTER_WAN_IP, "-p", "tcp",
                 "--dport", str(port), "-j", "DNAT", "--to-destination", f"{ip}:{port}")
            _run(*ipt, "-A", "FORWARD", "-d", ip, "-p", "tcp", "--dport", str(port),
                 "-j", "ACCEPT")
        return ROUTER_WAN_IP

    # -- checks -----------------------------------------------------------------
    def verify(self) -> None:
        """Check the network is a NAT: each home dials out to a listener in ``public``,
        which sees the router's address; a connect from ``public`` to a listener in a
        home fails; a home cannot reach the other home.

        Raises:
            NatSetupError: which of these did not hold.
        """
        for i, home in enumerate(self.homes):
            seen = self._connect(home, self.public, 7999)
            if seen != ROUTER_WAN_IP:
                raise NatSetupError(f"{home.ns} dialed out to public, but public saw {seen!r}, "
                                    f"not the router's {ROUTER_WAN_IP} (no MASQUERADE?)")
            for src in (self.public, self.homes[1 - i]):
                try:
                    self._connect(src, home, 7998)
                except NatSetupError:
                    continue
                raise NatSetupError(f"{src.ns} could dial {home.ns} at {home.ip}: the router "
                                    f"forwards new inbound connections")

    @staticmethod
    def _connect(src: Host, dst: Host, port: int) -> str:
        """Listen at ``dst``'s address and dial it from ``src``; the address the listener
        saw the connection come from.

        Raises:
            NatSetupError: the connection failed (the dialer's error).
        """
        listener = subprocess.Popen(dst.command([sys.executable, "-c", _LISTEN, dst.ip,
                                                 str(port), str(VERIFY_CONNECT + 3)]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert listener.stdout is not None
            listener.stdout.readline()  # "listening"
            dial = subprocess.run(src.command([sys.executable, "-c", _DIAL, dst.ip, str(port),
                                               str(VERIFY_CONNECT)]),
                                  capture_output=True, text=True, timeout=VERIFY_CONNECT + 10)
            if dial.returncode != 0:
                raise NatSetupError(f"{src.ns} cannot dial {dst.ip}:{port}: "
                                    f"{dial.stderr.strip().splitlines()[-1:]}")
            out, _ = listener.communicate(timeout=VERIFY_CONNECT + 10)
            return out.strip()
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.wait()


_LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
print("listening", flush=True)
try:
    c, (host, _) = s.accept()
    print(host, flush=True)
except OSError:
    pass
"""
_DIAL = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
"""
