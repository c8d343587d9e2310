"""Pipeline stages on real shaped links: one network namespace per stage, joined by a bridge.

::

    stage0 (10.78.0.1) ─eth0══p0─┐
    stage1 (10.78.0.2) ─eth0══p1─┤ br0 (10.78.0.254) in the hub namespace
    ...                          │ (the tracker and the client run there)
    stageN (10.78.0.N+1) ─eth0══pN┘

Every veth pair is shaped with ``tc ... tbf`` at both of its ends (``rate_mbit`` each way),
so whatever a stage sends leaves at most at that rate and whatever it receives arrives at
most at it: each stage boundary (stage i to stage i+1, two shaped hops at the same rate)
carries ``rate_mbit`` each way, and a stage's sends to both of its neighbours share its own
link, as on a host with one uplink. Every pair of stages is alike, so a planner's placement
of stages on namespaces changes nothing. No delay: this kernel has no ``netem``.

Needs root and ``ip``/``tc`` (iproute2); :func:`missing` says what is missing.
:meth:`StageNetwork.close` (or the ``with`` block's end) deletes every namespace; the
caller stops the processes it started in them first (a namespace lives on while a process
is inside it). Source: ``ip-netns(8)``, ``ip-link(8)`` (veth, bridge), ``tc-tbf(8)``.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from .natnet import SETUP_TIMEOUT, Host, Namespaces, NatSetupError, _run

SUBNET = "10.78.0"
HUB_IP = f"{SUBNET}.254"
DEV = "eth0"
"""The stage's end of its veth pair, in every stage's namespace (gloo's
``GLOO_SOCKET_IFNAME``)."""


def missing() -> str:
    """Why this machine cannot build a :class:`StageNetwork` ("" if it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and shape them with tc"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    absent = [tool for tool in ("ip", "tc") if shutil.which(tool, path=path) is None]
    return f"needs {', '.join(absent)} (iproute2)" if absent else ""


def tbf_burst_kbit(rate_mbit: float) -> int:
    """The tbf bucket, kbit: at least 32, and at least 10 ms of the rate (a bucket under one
    timer tick's worth of bytes cannot reach the rate; ``tc-tbf(8)``)."""
    return max(32, int(rate_mbit * 10))


class StageNetwork(Namespaces):
    """``n`` stage namespaces and a hub, as above.

    Args:
        n: stages (namespaces ``TAGs0`` ... ``TAGs{n-1}``, addresses ``10.78.0.1`` ...).
        rate_mbit: each way of each veth, Mbit/s (None: unshaped).
        tag: a prefix for the namespace names, unique on this machine (addresses live
            inside the namespaces, so two networks only clash by name).

    Raises:
        NatSetupError: a command failed (the message quotes it and its error); whatever
            was made is deleted first.
    """

    def __init__(self, n: int, rate_mbit: float | None, tag: str | None = None):
        if not 1 <= n <= 250:
            raise ValueError(f"a StageNetwork has 1 to 250 stages, not {n}")
        tag = tag or f"sn{os.getpid() % 100000}"
        self.rate_mbit = rate_mbit
        self.hub = Host(f"{tag}hub", HUB_IP)
        self.stages = tuple(Host(f"{tag}s{i}", f"{SUBNET}.{i + 1}") for i in range(n))
        super().__init__((self.hub, *self.stages))

    def _build(self) -> None:
        hub = self.hub.ns
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for i, stage in enumerate(self.stages):
            port = f"p{i}"
            _run("ip", "link", "add", DEV, "netns", stage.ns, "type", "veth", "peer", "name",
                 port, "netns", hub)
            _run("ip", "-n", stage.ns, "addr", "add", f"{stage.ip}/24", "dev", DEV)
            _run("ip", "-n", stage.ns, "link", "set", DEV, "up")
            _run("ip", "-n", hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", hub, "link", "set", port, "up")
            if self.rate_mbit:
                for ns, dev in ((stage.ns, DEV), (hub, port)):
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", f"{self.rate_mbit}mbit", "burst",
                         f"{tbf_burst_kbit(self.rate_mbit)}kbit", "latency", "400ms")

    def shaping(self) -> str:
        """What ``tc qdisc show`` says of stage 0's link, for a report."""
        out = subprocess.run(["ip", "netns", "exec", self.stages[0].ns, "tc", "qdisc", "show",
                              "dev", DEV], capture_output=True, text=True, timeout=SETUP_TIMEOUT)
        return out.stdout.strip()

    def exists(self) -> list[str]:
        """The namespaces of this network that exist now (all of them until :meth:`close`)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=SETUP_TIMEOUT).stdout.split()
        return [h.ns for h in (self.hub, *self.stages) if h.ns in listed]



__all__ = ["HUB_IP", "DEV", "StageNetwork", "NatSetupError", "missing", "tbf_burst_kbit"]
