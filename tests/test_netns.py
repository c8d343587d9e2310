"""A real slow link: two network namespaces joined by a veth pair shaped with `tc ... tbf`.

The tracker and node0 run in one namespace, node1 in the other; the kernel
limits the veth to 20 Mbit/s, and fedpipe's own link emulation adds 20 ms of
one-way delay (this kernel has no netem). The tracker's measured matrix must
show both within ±20%. Needs root and iproute2; skipped otherwise, saying so.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from fedpipe.testing import child_env

pytestmark = [pytest.mark.timeout(150), pytest.mark.processes]
RATE_BPS = 20e6 / 8  # bytes/s
DELAY = 0.020


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and shape them with tc")
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs iproute2 (ip, tc)")
    tag = f"fp{os.getpid() % 100000}"
    ns_a, ns_b, va, vb = f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb"
    subnet = f"10.213.{os.getpid() % 250}"
    try:
        for ns in (ns_a, ns_b):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, ip in ((ns_a, va, f"{subnet}.1"), (ns_b, vb, f"{subnet}.2")):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", "20mbit", "burst", "32kbit", "latency", "400ms")
    except subprocess.CalledProcessError as e:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot set up network namespaces here: {e.stderr.decode().strip()}")
    yield (ns_a, f"{subnet}.1"), (ns_b, f"{subnet}.2")
    for ns in (ns_a, ns_b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_measured_links_over_a_tbf_shaped_veth(namespaces, tmp_path):
    (ns_a, ip_a), (ns_b, ip_b) = namespaces
    profile = tmp_path / "links.json"
    profile.write_text(json.dumps({"links": [{"from": "node0", "to": "node1",
                                              "latency_ms": DELAY * 1e3}]}))
    tracker = f"{ip_a}:7070"
    fedpipe = [sys.executable, "-m", "fedpipe"]
    procs = []

    def start(ns, *args):
        log = open(tmp_path / f"{len(procs)}.log", "wb")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *fedpipe, *args], stdout=log,
                                      stderr=subprocess.STDOUT, env=child_env()))

    try:
        start(ns_a, "tracker", "--host", ip_a, "--port", "7070", "--db", str(tmp_path / "t.db"),
              "--insecure")
        for i, (ns, ip) in enumerate(((ns_a, ip_a), (ns_b, ip_b))):
            start(ns, "node", "--tracker", tracker, "--host", ip, "--port", "0",
                  "--name", f"node{i}", "--device", "cpu", "--threads", "1", "--trust-code",
                  "--insecure", "--link-profile", str(profile))
        deadline, links = time.monotonic() + 90, []
        while time.monotonic() < deadline and len(links) < 2:
            time.sleep(1)
            out = subprocess.run(["ip", "netns", "exec", ns_a, *fedpipe, "status", "--tracker",
                                  tracker, "--json"], capture_output=True, text=True,
                                 env=child_env(), timeout=30)
            if out.returncode == 0:
                reply = json.loads(out.stdout)  # the dashboard API's /api/nodes shape
                links = [(m["src_name"], m["dst_name"], m) for m in reply["links"]]
        logs = "\n".join((tmp_path / f"{i}.log").read_text() for i in range(len(procs)))
        assert len(links) == 2, f"links were not measured:\n{logs}"
        for src, dst, m in links:
            assert 0.8 * RATE_BPS <= m["bandwidth"] <= 1.2 * RATE_BPS, (src, dst, m)
            assert 0.8 * DELAY <= m["latency"] <= 1.2 * DELAY, (src, dst, m)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
