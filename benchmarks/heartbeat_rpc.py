"""The server CPU of one Heartbeat call: fedpipe's server against a bare sync and an asyncio one.

    python benchmarks/heartbeat_rpc.py --rate 800 --seconds 8

Why the tracker bounds its heartbeat rate (:data:`fedpipe.tracker.registry.HEARTBEAT_RATE`)
instead of serving heartbeats on ``grpc.aio``: each server below answers a Heartbeat with a
fixed reply and no domain work, so what is measured is gRPC Python's own cost per unary call.
A load process (``grpc.aio`` client) sends ``--rate`` calls a second for ``--seconds``; the
server's CPU (psutil, user + system) is divided by the calls. Servers:

- ``bare-sync``: ``grpc.server`` over a 64-thread pool, no interceptor (the baseline);
- ``fedpipe``: :func:`fedpipe.net.server`, the tracker's (auth interceptor, data-call limit,
  health service), without TLS;
- ``aio``: ``grpc.aio.server``, an ``async def`` servicer.

Each is measured ``--repeat`` times, interleaved; printed: CPU per call, p50/p99 latency,
each against the baseline, and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout's fedpipe, not an installed one

KINDS = ("bare-sync", "fedpipe", "aio")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(kind: str, port: int, ready) -> None:
    """Serve a Tracker whose Heartbeat answers at once, on ``port``, until terminated."""
    import grpc

    from fedpipe.proto import tracker_pb2, tracker_pb2_grpc

    reply = tracker_pb2.HeartbeatReply(known=True, lease_seconds=10.0, heartbeat_seconds=2.5)
    if kind == "aio":
        class Aio(tracker_pb2_grpc.TrackerServicer):
            async def Heartbeat(self, request, context):
                return reply

        async def main():
            srv = grpc.aio.server()
            tracker_pb2_grpc.add_TrackerServicer_to_server(Aio(), srv)
            srv.add_insecure_port(f"127.0.0.1:{port}")
            await srv.start()
            ready.set()
            await srv.wait_for_termination()
        asyncio.run(main())
        return

    from concurrent import futures

    from fedpipe import net

    class Sync(tracker_pb2_grpc.TrackerServicer):
        def Heartbeat(self, request, context):
            return reply

    srv = net.server() if kind == "fedpipe" else grpc.server(futures.ThreadPoolExecutor(64))
    tracker_pb2_grpc.add_TrackerServicer_to_server(Sync(), srv)
    srv.add_insecure_port(f"127.0.0.1:{port}")
    srv.start()
    ready.set()
    srv.wait_for_termination()


async def load(port: int, rate: float, seconds: float) -> tuple[int, list[float]]:
    """Send ``rate`` Heartbeats a second for ``seconds``; return (calls, latencies in s)."""
    import grpc

    from fedpipe.proto import tracker_pb2, tracker_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = tracker_pb2_grpc.TrackerStub(ch)
        await stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id="warm"), timeout=10)
        latencies: list[float] = []

        async def one() -> None:
            t = time.perf_counter()
            await stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id="x" * 12), timeout=10)
            latencies.append(time.perf_counter() - t)

        tasks, n, t0 = [], 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            n += 1
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(max(0.0, t0 + n / rate - time.monotonic()))
        await asyncio.gather(*tasks)
    return n, sorted(latencies)


def measure(kind: str, rate: float, seconds: float) -> tuple[float, float, float]:
    """(server CPU s per call, p50 s, p99 s) of one server of ``kind``."""
    import psutil

    ctx = mp.get_context("spawn")
    ready, port = ctx.Event(), free_port()
    proc = ctx.Process(target=serve, args=(kind, port, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {kind} server did not start")
        ps = psutil.Process(proc.pid)
        c0 = ps.cpu_times()
        n, lat = asyncio.run(load(port, rate, seconds))
        c1 = ps.cpu_times()
    finally:
        proc.terminate()
        proc.join(10)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return cpu / n, lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=800.0, help="calls per second")
    ap.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    ap.add_argument("--repeat", type=int, default=2, help="measurements of each server")
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
    for _ in range(args.repeat):
        for kind in KINDS:
            got[kind].append(measure(kind, args.rate, args.seconds))
    base = statistics.median(c for c, _, _ in got["bare-sync"])
    print(f"{args.rate:.0f} Heartbeat calls/s for {args.seconds:.0f} s, {args.repeat} runs "
          f"each (medians)")
    for kind in KINDS:
        cpu = statistics.median(c for c, _, _ in got[kind])
        p50 = statistics.median(p for _, p, _ in got[kind])
        p99 = statistics.median(p for _, _, p in got[kind])
        print(f"{kind:>9}: {cpu * 1e3:.3f} ms server CPU per call ({cpu / base:.2f}x bare-sync), "
              f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
