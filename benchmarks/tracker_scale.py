"""A tracker under 1,000 or 10,000 nodes: heartbeat latency, tracker CPU, a job among them.

    python benchmarks/tracker_scale.py --nodes 1000 10000 --seconds 60

One run (a fresh tracker) per ``--nodes`` value; a table at the end, with ratios against
the first. The tracker sets the heartbeat interval (it grows with the swarm, see
:mod:`fedpipe.tracker.registry`); ``--heartbeat-rate`` passes the tracker's budget.

Starts a real tracker (``python -m fedpipe tracker``), then ``--generators``
load-generator processes (multiprocessing). Each runs its share of fake nodes
on one asyncio loop with one gRPC channel to the tracker: it registers them,
then each fake heartbeats at the interval the tracker's replies set
(``heartbeat_seconds``), with a random phase so they do not beat in step.

Fake nodes need reachable, distinct addresses (the tracker refuses a second
live node at one address, and measures links by calling the nodes). Each
generator runs one small gRPC Node server on one port, answering Ping,
MeasureLinks (loopback-like figures) and Send (a bandwidth probe: drained) for
all its fakes; fake ``i`` of generator ``g`` advertises
``127.<g+1>.<i // 250>.<i % 250 + 1>:<port>``. Every 127.x.y.z reaches the
loopback interface on Linux, so the server listens on the wildcard address,
for the benchmark's run only. Those addresses put about 250 fakes in each /24
site, so the tracker's site rule (:func:`fedpipe.planner.protoio.site_of`)
sees 40 sites at 10,000 nodes. Fakes advertise 1 GFLOP/s and 64 MiB.

After every fake is registered and the link backlog has drained (or
``--settle`` seconds passed), two real nodes (``python -m fedpipe node``)
join; then ``--seconds`` of steady state are measured, and halfway through a
small job (the digits MLP, 2 stages) is submitted with :class:`fedpipe.Client`
and timed from submit to RUNNING.

Printed: registration time, the interval and lease the tracker set,
heartbeat latency p50/p99/max over the window, the same figures of a *control*
(the generators send ``CONTROL_RATE`` Heartbeats a second to a bare gRPC
server of its own process that does nothing else, so its p99 is what the
machine's load alone adds: the floor of the tracker's), the tracker's CPU
(psutil on its pid) and CPU per heartbeat, the load generators' share of the
machine's cores, nodes marked lost (ListNodes with include_lost: every fake
keeps heartbeating, so any lost node is a false verdict) and nodes whose
lease ran out at any time in the run (the tracker's log; registration
included), submit-to-RUNNING seconds, and the load average. Targets (10,000
nodes, default heartbeat interval): p99 <= 50 ms, no live node lost, the job
RUNNING within 30 s of its submission.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # measure this checkout's tracker, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks"))
import heartbeat_rpc  # noqa: E402 — the control server, from its sibling benchmark
from fedpipe.proc import TRACKER_SERVICE, child_env, free_port, wait_serving  # noqa: E402

PER_SUBNET = 250
"""Fake nodes per /24 (one site each)."""
FAKE_FLOPS, FAKE_MEMORY = 1e6, 64 * 2**20
"""What a fake node advertises: slow enough that the planner never gives one a stage (a fake
cannot run one), so the job lands on the real nodes."""
REGISTER_CONCURRENCY = 32
"""Registrations in flight per load generator."""
CONTROL_RATE = 50.0
"""Heartbeats a second, from all generators together, to the control server: a bare gRPC
server in a process of its own that answers at once (``benchmarks/heartbeat_rpc.py``'s
``bare-sync``), so its latency is what the machine's load alone adds."""
REGISTER_ATTEMPTS = 30
"""Tries per fake node's registration (backoff from 0.2 s to 5 s between them)."""


# -- load generator (a child process) ----------------------------------------------------

def generator(g: int, count: int, tracker: str, versions: bytes, port: int, window, results,
              control: str, control_rate: float):
    """Run ``count`` fake nodes until ``window[2]``; put ``(latencies in the window, counts)``
    on ``results``. ``window`` is a shared array: (start, end, stop) in time.time(), 0 until
    set; heartbeats are timed between start and end, and go on until stop. In the window,
    also send ``control_rate`` Heartbeats a second to the bare server at ``control``."""
    asyncio.run(_generator(g, count, tracker, versions, port, window, results, control,
                           control_rate))


async def _generator(g, count, tracker, versions_bytes, port, window, results, control,  # noqa: C901 (one load program: its coroutines share the fakes' ids, counts and clock)
                     control_rate):
    import grpc
    from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc

    class FakeNode(node_pb2_grpc.NodeServicer):
        async def Ping(self, request, context):
            return node_pb2.PingReply()

        async def MeasureLinks(self, request, context):
            # src_id is filled in by the tracker (a node speaks only for its own links)
            now = time.time()
            return node_pb2.MeasureLinksReply(links=[
                node_pb2.LinkMeasurement(dst_id=p.node_id, bandwidth=1e9, latency=1e-4,
                                         measured_at=now) for p in request.peers])

        async def Send(self, request_iterator, context):
            async for _ in request_iterator:
                pass
            return node_pb2.SendReply()

        async def SendOne(self, request, context):
            return node_pb2.SendReply()

    server = grpc.aio.server()
    node_pb2_grpc.add_NodeServicer_to_server(FakeNode(), server)
    server.add_insecure_port(f"0.0.0.0:{port}")
    await server.start()

    versions = tracker_pb2.Versions.FromString(versions_bytes)
    channel = grpc.aio.insecure_channel(tracker)
    stub = tracker_pb2_grpc.TrackerStub(channel)
    ids: list[str] = [""] * count
    interval, lease = [2.5], [10.0]
    sem = asyncio.Semaphore(REGISTER_CONCURRENCY)
    counts = {"heartbeats": 0, "unknown": 0, "errors": 0, "register_errors": 0,
              "register_refused": 0, "unregistered": 0}

    def request(i: int) -> tracker_pb2.RegisterNodeRequest:
        return tracker_pb2.RegisterNodeRequest(
            name=f"fake{g}-{i}", boot_id=uuid.uuid4().hex, versions=versions,
            address=f"127.{g + 1}.{i // PER_SUBNET}.{i % PER_SUBNET + 1}:{port}",
            resources=node_pb2.Resources(flops=FAKE_FLOPS, memory_bytes=FAKE_MEMORY,
                                         device="cpu", cores=1))

    async def register(i: int) -> None:
        # as fedpipe.net.retry does for a real node: UNAVAILABLE (the tracker admits a few
        # registrations at once) is retried with exponential backoff and jitter
        delay = 0.2
        async with sem:
            for _ in range(REGISTER_ATTEMPTS):
                try:
                    reply = await stub.RegisterNode(request(i), timeout=60)
                except grpc.aio.AioRpcError as e:
                    refused = e.code() == grpc.StatusCode.UNAVAILABLE
                    counts["register_refused" if refused else "register_errors"] += 1
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(5.0, delay * 2)
                    continue
                ids[i] = reply.node_id
                interval[0] = reply.heartbeat_seconds or interval[0]
                lease[0] = reply.lease_seconds or lease[0]
                break

    async def live(i: int) -> None:
        await register(i)  # then heartbeat at once: registering 10,000 outlasts a lease
        if ids[i]:
            await beat(i)
        else:
            counts["unregistered"] += 1

    latencies: list[float] = []
    stamps: list[float] = []  # when each beat in the window was sent (time.time())
    if os.environ.get("TRACKER_SCALE_DEBUG"):
        async def report():
            seen = 0
            while not (window[2] and time.time() > window[2]):
                await asyncio.sleep(5)
                n = counts["heartbeats_all"] - seen
                seen = counts["heartbeats_all"]
                recent = sorted(recent_lat[-n:]) if n else [0.0]
                print(f"gen{g} {time.strftime('%H:%M:%S')}: {n / 5:.0f} beats/s, "
                      f"p99 {recent[int(0.99 * len(recent))] * 1e3:.0f} ms, "
                      f"errors {counts['errors']} unknown {counts['unknown']}", flush=True)
        asyncio.ensure_future(report())
    recent_lat: list[float] = []
    counts["heartbeats_all"] = 0

    async def beat(i: int) -> None:
        await asyncio.sleep(random.random() * interval[0])
        due = time.monotonic()
        while True:
            now = time.time()
            if window[2] and now > window[2]:
                return
            t = time.perf_counter()
            try:
                reply = await stub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=ids[i]),
                                             timeout=10)
            except grpc.aio.AioRpcError:
                counts["errors"] += 1
            else:
                took = time.perf_counter() - t
                counts["heartbeats_all"] += 1
                recent_lat.append(took)
                if len(recent_lat) > 100_000:
                    del recent_lat[:50_000]
                if window[0] and window[0] <= now <= window[1]:
                    latencies.append(took)
                    stamps.append(now)
                    counts["heartbeats"] += 1
                if not reply.known:
                    counts["unknown"] += 1
                interval[0] = reply.heartbeat_seconds or interval[0]
                lease[0] = reply.lease_seconds or lease[0]
            due += interval[0]
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    control_latencies: list[float] = []
    control_stamps: list[float] = []

    async def probe_control() -> None:
        """The same call to a server that does nothing else: the latency this machine's
        scheduler alone adds (its p99 is the floor of the tracker's)."""
        async with grpc.aio.insecure_channel(control) as ch:
            cstub = tracker_pb2_grpc.TrackerStub(ch)
            while not window[0] or time.time() < window[0]:
                await asyncio.sleep(0.05)
            n, t0 = 0, time.monotonic()
            while time.time() < window[1]:
                t = time.perf_counter()
                try:
                    await cstub.Heartbeat(tracker_pb2.HeartbeatRequest(node_id="control"),
                                          timeout=10)
                except grpc.aio.AioRpcError:
                    counts["control_errors"] = counts.get("control_errors", 0) + 1
                else:
                    control_latencies.append(time.perf_counter() - t)
                    control_stamps.append(time.time() - (time.perf_counter() - t))
                n += 1
                await asyncio.sleep(max(0.0, t0 + n / control_rate - time.monotonic()))

    t0 = time.time()
    control_task = asyncio.ensure_future(probe_control())
    fakes = [asyncio.ensure_future(live(i)) for i in range(count)]
    while sum(1 for i in ids if i) + counts["unregistered"] < count:
        await asyncio.sleep(0.2)
    # this process's own collector pauses would delay every beat in flight and count
    # against the tracker: what registration left is long-lived, out of its reach
    gc.collect()
    gc.freeze()
    results.put(("registered", g, time.time() - t0, sum(1 for i in ids if i)))
    await asyncio.gather(*fakes, control_task)
    results.put(("done", g, latencies, counts, interval[0], lease[0], control_latencies,
                 stamps, control_stamps))
    await channel.close()
    await server.stop(None)


# -- the conductor -----------------------------------------------------------------------

def prepare_job() -> tuple:
    """The small job's parts (the digits MLP, its loss, optimizer and batches), made before
    the window: importing torch and sklearn and loading the data take this process a few
    seconds of CPU, which would otherwise land in the window as the benchmark's own load."""
    import torch
    from torch import nn

    import fedpipe
    from fedpipe.examples import digits

    x, y, _, _ = digits.load()
    return (digits.make_model(hidden=32), nn.functional.cross_entropy,
            fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), digits.batches(x, y, 32))


def submit_job(client, parts: tuple, delay: float, out: dict) -> None:
    """After ``delay`` seconds, submit the job of ``parts`` (:func:`prepare_job`) on 2 stages;
    time submit to RUNNING into ``out["to_running"]``, its nodes into ``out["placed"]``, how
    it ended into ``out["end"]``."""
    time.sleep(delay)
    t = time.time()
    job = client.submit(*parts, steps=5, microbatches=2, stages=2, replicas=1)
    while time.time() - t < 120:
        status = job.status()
        if status.state in ("RUNNING", "SUCCEEDED") or status.step > 0:
            out["to_running"] = time.time() - t
            break
        if status.state in ("FAILED", "CANCELLED"):
            break
        time.sleep(0.1)
    out["placed"] = sorted({a.node_name for a in job.status().plan.stages})
    try:
        out["end"] = job.wait(timeout=60, progress=False).state
    except Exception as e:  # noqa: BLE001 — report, do not hide
        out["end"] = f"{type(e).__name__}: {e}"


def lease_misses(log_text: str) -> int:
    """Nodes the tracker's log says missed their lease (one line each, or one line for many)."""
    one = len(re.findall(r"node \S+ missed its lease", log_text))
    return one + sum(int(k) for k in re.findall(r"(\d+) nodes missed their lease", log_text))


def tail_summary(stamps: list[float], latencies: list[float], start: float,
                 trace: list[tuple[float, float, str]], path: Path, slow: float = 0.050) -> str:
    """Write every call of ``trace`` (seconds from ``start`` it was sent, latency in ms, the
    generator or control probe that sent it) to ``path``, and say whether the beats slower
    than ``slow`` seconds come in bursts: how many 1 s slices hold them, and the share of
    them in the 5 worst slices."""
    with open(path, "w") as f:
        for t, took, who in sorted(trace):
            f.write(f"{t - start:.4f}\t{took * 1e3:.2f}\t{who}\n")
    slices: dict[int, int] = {}
    for t, took in zip(stamps, latencies):
        if took > slow:
            slices[int(t - start)] = slices.get(int(t - start), 0) + 1
    n = sum(slices.values())
    worst = sorted(slices.items(), key=lambda kv: -kv[1])[:5]
    in_worst = sum(k for _, k in worst)
    return (f"beats over {slow * 1e3:.0f} ms: {n} of {len(latencies)} "
            f"({n / max(1, len(latencies)):.2%}), in {len(slices)} one-second slices; the 5 "
            f"worst slices (s from the window's start: beats) "
            f"{', '.join(f'{s}: {k}' for s, k in sorted(worst))} hold "
            f"{in_worst / max(1, n):.0%} of them; every beat in {path}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000],
                    help="fake nodes; one run per value, the first is the baseline of the "
                         "ratios (default: 1000 10000)")
    ap.add_argument("--generators", type=int, default=2, help="load-generator processes")
    ap.add_argument("--seconds", type=float, default=60.0, help="steady state measured, s")
    ap.add_argument("--lease", type=float, default=None,
                    help="the tracker's --lease (default: the tracker's own default)")
    ap.add_argument("--settle", type=float, default=120.0,
                    help="longest wait for the link backlog to drain after registration, s")
    ap.add_argument("--heartbeat-rate", type=float, default=None,
                    help="the tracker's --heartbeat-rate (default: the tracker's own, "
                         "fedpipe.tracker.registry.HEARTBEAT_RATE)")
    ap.add_argument("--link-refresh", type=float, default=None,
                    help="the tracker's --link-refresh, s (default: the tracker's, 300 s, whose "
                         "first round starts after the window of a short run; 30 at 1,000 "
                         "nodes puts rounds in the window at the pace of 10,000 nodes' "
                         "default: one MeasureLinks call each 27 ms)")
    ap.add_argument("--py-spy", default=None, metavar="PATH",
                    help="a py-spy executable: sample the tracker (--gil --nonblocking) over "
                         "the window into tracker-gil.txt in the run's log directory")
    args = ap.parse_args()
    rows = [run(n, args) for n in args.nodes]
    print()
    print("nodes   interval  lease   beats/s  p50 ms  p99 ms  control p99  tracker CPU  "
          "CPU/beat ms  gen CPU  lost  misses  to RUNNING s  load  RSS idle MiB  RSS fakes MiB")
    for r in rows:
        print(f"{r['nodes']:>6}  {r['interval']:>6.1f} s {r['lease']:>5.0f} s {r['rate']:>8.0f}  "
              f"{r['p50'] * 1e3:>6.1f}  {r['p99'] * 1e3:>6.1f}  {r['control_p99'] * 1e3:>11.1f}  "
              f"{r['cpu']:>10.0%}  "
              f"{r['per_beat'] * 1e3:>11.3f}  {r['gen']:>7.0%}  {r['lost']:>4}  {r['misses']:>6}  "
              f"{r['to_running'] if r['to_running'] is None else round(r['to_running'], 1)!s:>12}"
              f"  {r['load']:.1f}  {r['rss_idle'] / 2**20:>12.0f}  {r['rss_fakes'] / 2**20:>13.0f}")
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['nodes']} against {base['nodes']} nodes: p99 {r['p99'] / base['p99']:.2f}x, "
              f"tracker CPU {r['cpu'] / max(base['cpu'], 1e-9):.2f}x, CPU per heartbeat "
              f"{r['per_beat'] / max(base['per_beat'], 1e-9):.2f}x, heartbeats/s "
              f"{r['rate'] / max(base['rate'], 1e-9):.2f}x")
    met = all(r["p99"] <= 0.050 and r["lost"] == 0 and r["misses"] == 0 and
              r["to_running"] is not None and r["to_running"] <= 30 for r in rows)
    print(f"targets (p99 <= 50 ms, no lease missed, RUNNING <= 30 s) "
          f"{'met' if met else 'NOT met'} at every size")
    return 0


def run(n: int, args) -> dict:
    """One tracker under ``n`` fake nodes (see the module docstring); prints its figures and
    returns them: nodes, interval and lease (s), rate (heartbeats/s), p50/p99 (s), cpu (share
    of one core), per_beat (CPU s), gen (share of all cores), lost, misses, to_running (s or
    None), load (1-minute load average)."""


    import psutil

    import fedpipe
    from fedpipe.node.daemon import local_versions
    from fedpipe.proto import tracker_pb2

    work = Path(tempfile.mkdtemp(prefix="fedpipe-scale-"))
    print(f"logs in {work}")
    env = dict(child_env(1), PYTHONPATH=str(ROOT))
    port = free_port()
    tracker = f"127.0.0.1:{port}"
    tproc = subprocess.Popen(tracker_command(args, port, work),
                             stdout=open(work / "tracker.log", "w"), stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
    procs: list = []
    control_proc = None
    nodes: list[subprocess.Popen] = []
    try:
        def alive() -> None:
            if tproc.poll() is not None:
                raise RuntimeError((work / "tracker.log").read_text()[-2000:])
        wait_serving(tracker, TRACKER_SERVICE, 30, alive)
        client = fedpipe.Client(tracker)
        tps = psutil.Process(tproc.pid)
        rss_idle = resident(tps, "no node, no job")

        ctx = mp.get_context("spawn")
        ready, cport = ctx.Event(), free_port()
        procs.append(ctx.Process(target=heartbeat_rpc.serve, args=("bare-sync", cport, ready),
                                 daemon=True))
        procs[-1].start()
        if not ready.wait(60):
            raise RuntimeError("the control server did not start")
        control = f"127.0.0.1:{cport}"
        control_proc = procs.pop()
        window = ctx.Array("d", [0.0, 0.0, 0.0])
        results = ctx.Queue()
        share = [n // args.generators + (g < n % args.generators)
                 for g in range(args.generators)]
        versions = local_versions().SerializeToString()
        t_reg = time.time()
        for g, count in enumerate(share):
            p = ctx.Process(target=generator, args=(g, count, tracker, versions, free_port(),
                                                    window, results, control,
                                                    CONTROL_RATE / len(share)), daemon=True)
            p.start()
            procs.append(p)
        registered = 0
        for _ in procs:
            _, g, seconds, ok = results.get(timeout=1800)
            registered += ok
        reg_seconds = time.time() - t_reg
        print(f"{registered} of {n} fake nodes registered in {reg_seconds:.1f} s "
              f"({registered / reg_seconds:.0f}/s) by {args.generators} generators")

        def list_nodes():
            return client.stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=True),
                                         timeout=60)

        settle_links(list_nodes, args.settle)
        rss_fakes = resident(tps, f"{registered} fake nodes, no job")
        nodes += start_real_nodes(client, tracker, work, env)

        parts = prepare_job()
        start = time.time() + 2.0
        window[0], window[1] = start, start + args.seconds
        time.sleep(max(0.0, start - time.time()))
        spy = None
        if args.py_spy:  # sample what holds the tracker's GIL over the window
            spy = subprocess.Popen(
                [args.py_spy, "record", "--pid", str(tproc.pid), "--gil", "--nonblocking",
                 "--rate", "250", "--format", "raw", "--duration", str(round(args.seconds)),
                 "-o", str(work / "tracker-gil.txt")], stdout=subprocess.DEVNULL,
                stderr=open(work / "py-spy.log", "w"))
        cpu0 = tps.cpu_times()
        gen0 = [psutil.Process(p.pid).cpu_times() for p in procs]
        wall0 = time.time()

        submitted: dict = {}
        job_thread = threading.Thread(target=submit_job, args=(client, parts, args.seconds / 2,
                                                               submitted), daemon=True)
        job_thread.start()
        time.sleep(max(0.0, window[1] - time.time()))
        cpu1 = tps.cpu_times()
        gen1 = [psutil.Process(p.pid).cpu_times() for p in procs]
        wall = time.time() - wall0
        load = os.getloadavg()
        rss = tps.memory_info().rss
        reply = list_nodes()  # while every fake still heartbeats
        lost = [n.name for n in reply.nodes if not n.alive]
        log_text = (work / "tracker.log").read_text(errors="replace")
        job_thread.join(150)
        window[2] = time.time()

        latencies, counts, told, floor, stamps, trace = gather(len(procs), results)

        t_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        g_cpu = sum((b.user + b.system) - (a.user + a.system) for a, b in zip(gen0, gen1))
        cores = os.cpu_count() or 1
        beats = counts.get("heartbeats", 0)
        print(f"nodes: {n} fake + 2 real, {args.generators} generators, "
              f"window {wall:.1f} s; pids: tracker {tproc.pid}, generators "
              f"{[p.pid for p in procs]}, control {control_proc.pid}")
        print(f"heartbeat interval {told[0]:.1f} s, lease {told[1]:.0f} s (as the tracker "
              f"set them last); registrations refused UNAVAILABLE and retried "
              f"{counts.get('register_refused', 0)}, failed otherwise "
              f"{counts.get('register_errors', 0)}")
        print(f"heartbeats: {beats} ({beats / wall:.0f}/s), errors {counts.get('errors', 0)}, "
              f"unknown {counts.get('unknown', 0)}")
        print(f"heartbeat latency: p50 {percentile(latencies, 0.5) * 1e3:.1f} ms, "
              f"p99 {percentile(latencies, 0.99) * 1e3:.1f} ms, "
              f"max {max(latencies, default=float('nan')) * 1e3:.1f} ms  (target p99 <= 50 ms)")
        print(f"control (the same call to a bare server, {CONTROL_RATE:.0f}/s, same window): "
              f"p50 {percentile(floor, 0.5) * 1e3:.1f} ms, p99 {percentile(floor, 0.99) * 1e3:.1f} "
              f"ms; tracker p99 / control p99 = "
              f"{percentile(latencies, 0.99) / percentile(floor, 0.99):.2f}x")
        print(f"tracker CPU: {t_cpu:.1f} s in {wall:.1f} s = {100 * t_cpu / wall:.0f}% of one "
              f"core; {1e3 * t_cpu / max(beats, 1):.3f} ms CPU per heartbeat (all tracker work "
              f"in the window / heartbeats); RSS {rss / 2**20:.0f} MiB")
        print(f"load generators CPU: {g_cpu:.1f} s = {100 * g_cpu / wall / cores:.0f}% of the "
              f"{cores} cores")
        print(tail_summary(stamps, latencies, wall0, trace, work / "beats.tsv"))
        if spy is not None:
            spy.wait(30)
            print(f"py-spy (samples holding the tracker's GIL, in the window): "
                  f"{work / 'tracker-gil.txt'}")
        misses = lease_misses(log_text)
        print(f"nodes marked lost: {len(lost)} {lost[:5]}; nodes whose lease ran out during "
              f"the run (tracker log): {misses}  "
              f"(target 0)")
        to_running = submitted.get("to_running")
        print(f"small job on {submitted.get('placed')}: submit to RUNNING "
              f"{'never' if to_running is None else f'{to_running:.2f} s'}  (target <= 30 s); "
              f"{submitted.get('end', 'no end')}")
        print(f"tracker log: {len(log_text) / 1024:.0f} KiB; load average "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        return dict(nodes=n, interval=told[0], lease=told[1], rate=beats / wall,
                    p50=percentile(latencies, 0.5), p99=percentile(latencies, 0.99),
                    control_p99=percentile(floor, 0.99),
                    cpu=t_cpu / wall, per_beat=t_cpu / max(beats, 1), gen=g_cpu / wall / cores,
                    lost=len(lost), misses=misses, to_running=to_running, load=load[0],
                    rss_idle=rss_idle, rss_fakes=rss_fakes)
    finally:
        stop_all(tproc, nodes, procs + ([control_proc] if control_proc is not None else []))


def tracker_command(args, port: int, work: Path) -> list[str]:
    """``fedpipe tracker`` on 127.0.0.1:``port`` with its database in ``work``, and the
    ``--lease``, ``--heartbeat-rate`` and ``--link-refresh`` given."""
    cmd = [sys.executable, "-m", "fedpipe", "tracker", "--host", "127.0.0.1", "--port",
           str(port), "--db", str(work / "tracker.db")]
    for flag, value in (("--lease", args.lease), ("--heartbeat-rate", args.heartbeat_rate),
                        ("--link-refresh", args.link_refresh)):
        if value:
            cmd += [flag, str(value)]
    return cmd


def resident(tps, when: str) -> int:
    """Print and return the resident memory (bytes) of the tracker process ``tps`` (a
    ``psutil.Process``), its children's (the planner's worker) apart; ``when`` says what
    it holds."""
    rss = tps.memory_info().rss
    children = sum(c.memory_info().rss for c in tps.children(recursive=True))
    print(f"tracker resident memory with {when}: {rss / 2**20:.0f} MiB "
          f"(its planner worker process: {children / 2**20:.0f} MiB more)", flush=True)
    return rss


def settle_links(list_nodes, settle: float) -> None:
    """Wait up to ``settle`` seconds for the link backlog: every selected link measured (the
    fakes all answer); print what is left."""
    from fedpipe.planner.protoio import unmeasured

    t_settle = time.time()
    left = -1
    while time.time() - t_settle < settle:
        reply = list_nodes()
        left = len(unmeasured([n for n in reply.nodes if n.alive], list(reply.links)))
        if not left:
            break
        time.sleep(3.0)
    print(f"link backlog: {left} selected links unmeasured after "
          f"{time.time() - t_settle:.1f} s")


def start_real_nodes(client, tracker: str, work: Path, env: dict) -> list[subprocess.Popen]:
    """Start two real ``fedpipe node`` processes (real0, real1) and wait until both are
    registered.

    Raises:
        RuntimeError: they did not register within 120 s.
    """
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "fedpipe", "node", "--tracker", tracker, "--host",
         "127.0.0.1", "--port", "0", "--name", f"real{i}", "--device", "cpu",
         "--threads", "1"], stdout=open(work / f"real{i}.log", "w"),
        stderr=subprocess.STDOUT, env=env, cwd=ROOT) for i in range(2)]
    deadline = time.monotonic() + 120
    while sum(1 for n in client.nodes() if n.name.startswith("real")) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the real nodes did not register")
        time.sleep(0.5)
    return nodes


def gather(generators: int, results) -> tuple:
    """The ``done`` results of ``generators`` load generators, merged: heartbeat latencies
    (s), counts, the interval and lease told last, control latencies, send stamps, and the
    trace of every call ``(sent, latency, who)``."""
    latencies, counts, told, floor, stamps = [], {}, (0.0, 0.0), [], []
    trace: list[tuple[float, float, str]] = []
    for _ in range(generators):
        _, g, lat, c, interval, lease, control_lat, sent, control_sent = \
            results.get(timeout=120)
        told = max(told, (interval, lease))
        latencies += lat
        stamps += sent
        trace += [(t, took, f"g{g}") for t, took in zip(sent, lat)]
        trace += [(t, took, f"control{g}") for t, took in zip(control_sent, control_lat)]
        floor += control_lat
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
    return latencies, counts, told, floor, stamps, trace


def stop_all(tproc: subprocess.Popen, nodes: list[subprocess.Popen], procs: list) -> None:
    """Terminate the real nodes, the generators and control server, and the tracker; kill
    what has not exited 10 s later."""
    for n in nodes:
        n.terminate()
    for p in procs:
        p.terminate()
    tproc.terminate()
    for proc in [tproc, *nodes]:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
