"""Relayed against direct, in a real NAT network shaped to 100 Mbit/s per leg (issue 25).

    sudo python benchmarks/relay.py [--mbit 100] [--megabytes 32] [--steps 8]

The network is :class:`fedpipe.testing.natnet.NatNetwork` (a public namespace, a masquerading
router that forwards no new inbound connection, two homes), every leg (public-router,
router-home) shaped with ``tc ... tbf`` to ``--mbit`` each way. Printed, each with its ratio
to its baseline measured in the same run, and the load average:

1. **A hop's throughput** over the socket data plane (:mod:`fedpipe.net.dataplane`): home1
   sends ``--megabytes`` in 1 MiB tensors to a data plane in the public namespace (direct:
   home1 dials out) and to one in home2 homed at a `fedpipe relay` in the public namespace
   (relayed: home1 dials home2's relayed address). Target: relayed >= 0.8x direct.
2. **The step time of a 3-stage sync job** (``fedpipe.testing.natclient``: 6 linear layers of
   ``--width``, batch ``--batch``, 4 microbatches, no compression) on pub0 (public), home1
   and home2, home1 the middle stage (an emulated slow pub0-home2 link makes the planner put
   it there):
   - ``direct``: both homes reachable through port forwards on the router (the baseline);
   - ``reverse-dialled``: home1 outbound-only (homed at the relay; it dials pub0 and home2);
   - ``relayed``: both homes outbound-only; home1-home2 goes through the relay.
   Each configuration runs ``--jobs`` jobs; the fastest one's step time counts.
3. **The tracker's heartbeat p99** (a Heartbeat call every 50 ms from the public namespace)
   while the direct jobs run (the baseline) and while the relayed jobs run (the relay carries
   its home1-home2 traffic and both homes' control calls).

Needs root, ``ip``, ``iptables`` and ``tc``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TENSOR_BYTES = 1 << 20
HEARTBEAT_EVERY = 0.05
RELAY_PORT = 7100


# -- child processes, run inside a namespace ---------------------------------------------
class _Count:
    """A Receiver that counts what arrives."""

    def __init__(self):
        self.bytes = 0

    def admit(self, peer, header):
        return 64 << 20

    def deliver(self, peer, header, tensor):
        self.bytes += tensor.numel() * tensor.element_size()


def sink(name: str, host: str, relay: str) -> None:
    """A data plane at ``host`` (homed at ``relay`` if given): print the address peers
    dial, then wait for stdin to close."""
    from fedpipe.net.dataplane import DataPlane
    from fedpipe.net.relay import Homing

    plane = DataPlane(name, _Count(), host=host, port=0)
    address, homing = plane.address, None
    if relay:
        homing = Homing([relay], name, plane.port, plane.port, local_host=host)
        address = homing.home().data_address
    print(json.dumps({"address": address}), flush=True)
    sys.stdin.read()
    if homing is not None:
        homing.close()
    plane.close()


def source(name: str, peer: str, address: str, megabytes: int) -> None:
    """Send ``megabytes`` MiB to ``peer`` at ``address`` in 1 MiB tensors; print the seconds
    from the first byte to the peer's acknowledgement of the last."""
    import torch

    from fedpipe.net.dataplane import DataPlane
    from fedpipe.proto import node_pb2

    plane = DataPlane(name, _Count(), host="0.0.0.0", port=0)
    link = plane.link(peer, address)
    t = torch.zeros(TENSOR_BYTES // 4)
    env = node_pb2.Envelope(job_id="bench", kind=node_pb2.KIND_ACTIVATION)
    link.send(t, envelope=env)  # the connection's slow start, off the clock
    link.flush(60)
    t0 = time.perf_counter()
    for _ in range(megabytes * (1 << 20) // TENSOR_BYTES):
        link.send(t, envelope=env)
    link.flush(300)
    print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": megabytes << 20}),
          flush=True)
    plane.close()


def probe(tracker: str) -> None:
    """Call the tracker's Heartbeat every ``HEARTBEAT_EVERY`` s until stdin closes; print
    each call's seconds."""
    from fedpipe import net
    from fedpipe.proto import tracker_pb2, tracker_pb2_grpc

    stub = tracker_pb2_grpc.TrackerStub(net.channel(tracker))
    times: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id="bench-probe"), timeout=10)
                times.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 — a failed call counts as its timeout
                times.append(10.0)
            stop.wait(HEARTBEAT_EVERY)
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    sys.stdin.read()
    stop.set()
    th.join()
    print(json.dumps({"seconds": times}), flush=True)


# -- the parent ------------------------------------------------------------------------
def _child(host, *args: str, stdin=subprocess.PIPE) -> subprocess.Popen:
    from fedpipe.proc import child_env

    return subprocess.Popen(host.command([sys.executable, __file__, *args]), stdin=stdin,
                            stdout=subprocess.PIPE, text=True, env=child_env())


def hop(net, relay: str, megabytes: int, relayed: bool) -> float:
    """Throughput home1 -> sink (in public, or in home2 through ``relay``), bytes/s."""
    where = net.homes[1] if relayed else net.public
    snk = _child(where, "_sink", "sink", where.ip, relay if relayed else "")
    try:
        assert snk.stdout is not None
        address = json.loads(snk.stdout.readline())["address"]
        out = subprocess.run(net.homes[0].command(
            [sys.executable, __file__, "_source", "src", "sink", address, str(megabytes)]),
            capture_output=True, text=True, timeout=600, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        return r["bytes"] / r["seconds"]
    finally:
        snk.communicate(timeout=30)


def job(net, workdir: Path, mode: str, args) -> tuple[float, list[float]]:
    """The 3-stage job in ``mode``; its step seconds and the heartbeat probe's seconds."""
    from fedpipe.testing.natswarm import NatSwarm

    profile = {"links": [{"from": "pub0", "to": "home2", "mbps": 5, "latency_ms": 150}]}
    run = workdir / mode
    run.mkdir()
    with NatSwarm(net, run, link_profile=profile) as swarm:
        swarm.start_tracker()
        relay = swarm.start_relay(port=RELAY_PORT)
        swarm.add_node("pub0", net.public)
        for i, name in enumerate(("home1", "home2")):
            outbound = mode == "relayed" or (mode == "reverse-dialled" and i == 0)
            if outbound:
                swarm.add_node(name, net.homes[i], relay)
            else:
                grpc_port, data_port = 9101 + 10 * i, 9102 + 10 * i
                swarm.add_node(name, net.homes[i], "", "--advertise", FORWARDED,
                               "--port", str(grpc_port), "--data-port", str(data_port))
        swarm.wait_for_nodes({"pub0", "home1", "home2"})
        prober = _child(net.public, "_probe", swarm.tracker)
        times = []
        try:
            for i in range(args.jobs):
                got = swarm.run_client(run / f"result{i}.pt", "--steps", str(args.steps),
                                       "--width", str(args.width), "--batch", str(args.batch),
                                       timeout=900)
                if got["state"] != "SUCCEEDED":
                    raise RuntimeError(f"{mode}: {got['state']} {got['reason']}\n"
                                       f"{swarm.logs()}")
                if got["plan"][1] != "home1":
                    print(f"  ({mode}: the planner put {got['plan'][1]} in the middle)")
                times.append(got["step_seconds"])
        finally:
            out, _ = prober.communicate(timeout=60)
        print(f"  [{mode}: s/step of each job {[round(t, 3) for t in times]}; load average "
              f"{os.getloadavg()}]", flush=True)
        return min(times), json.loads(out.strip().splitlines()[-1])["seconds"]


FORWARDED = ""  # the router's public address, once its port forwards exist


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else math.nan


def main() -> int:
    global FORWARDED
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbit", type=float, default=100.0)
    p.add_argument("--megabytes", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=3,
                   help="jobs per configuration, one after the other; the fastest's step "
                        "time counts (the others met more of the machine's other load)")
    args = p.parse_args()
    from fedpipe.proc import child_env
    from fedpipe.testing.natnet import NatNetwork, missing

    why = missing()
    if why:
        print(f"relay benchmark: {why}", file=sys.stderr)
        return 1
    print(f"load average before: {os.getloadavg()}")
    with NatNetwork(rate_mbit=args.mbit) as net, tempfile.TemporaryDirectory() as tmp:
        net.verify()
        FORWARDED = net.forward(0, [9101, 9102])
        net.forward(1, [9111, 9112])
        # 1. a hop
        relay = subprocess.Popen(net.public.command(
            [sys.executable, "-m", "fedpipe", "relay", "--host", net.public.ip, "--port",
             str(RELAY_PORT), "--insecure"]), stdout=subprocess.PIPE, text=True,
            env=child_env())
        try:
            assert relay.stdout is not None
            relay.stdout.readline()  # listening
            rates: dict[str, list[float]] = {"direct": [], "relayed": []}
            for _ in range(args.repeat):  # interleaved
                for kind in rates:
                    rates[kind].append(hop(net, f"{net.public.ip}:{RELAY_PORT}",
                                           args.megabytes, kind == "relayed"))
        finally:
            relay.terminate()
            relay.wait(10)
        direct, relayed = (statistics.median(rates[k]) for k in ("direct", "relayed"))
        print(f"\nhop throughput, {args.megabytes} MiB in 1 MiB tensors, {args.mbit:g} Mbit/s "
              f"per leg (median of {args.repeat}):")
        each = {k: [round(r * 8 / 1e6, 1) for r in v] for k, v in rates.items()}
        print(f"  direct   {direct * 8 / 1e6:7.1f} Mbit/s  {each['direct']}")
        print(f"  relayed  {relayed * 8 / 1e6:7.1f} Mbit/s  {each['relayed']}"
              f"  = {relayed / direct:.2f}x direct (target >= 0.8x)")
        print(f"  load average: {os.getloadavg()}")
        # 2 and 3. the job
        steps: dict[str, float] = {}
        beats: dict[str, list[float]] = {}
        for mode in ("direct", "reverse-dialled", "relayed"):
            steps[mode], beats[mode] = job(net, Path(tmp), mode, args)
        print(f"\n3-stage sync job (width {args.width}, batch {args.batch}, 4 microbatches, "
              f"{args.steps} steps), step time (fastest of {args.jobs} jobs):")
        for mode, s in steps.items():
            print(f"  {mode:16s} {s:7.3f} s  = {s / steps['direct']:.2f}x direct")
        print("\ntracker heartbeat latency (a call every 50 ms during the job):")
        for mode in ("direct", "relayed"):
            xs = beats[mode]
            print(f"  during {mode:8s} p50 {statistics.median(xs) * 1e3:6.1f} ms  p99 "
                  f"{p99(xs) * 1e3:6.1f} ms  ({len(xs)} calls)")
        print(f"  p99 relayed / direct: {p99(beats['relayed']) / p99(beats['direct']):.2f}x")
        print(f"\nload average after: {os.getloadavg()} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_sink":
        sink(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "_source":
        source(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_probe":
        probe(sys.argv[2])
    else:
        raise SystemExit(main())
