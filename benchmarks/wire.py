"""Wire benchmark: fedpipe's tensor transfer against raw-bytes gRPC, interleaved in one run.

For 64 KiB, 1 MiB and 16 MiB float32 tensors on 127.0.0.1. One receiver
process serves every transport on one :func:`fedpipe.net.server`; one sender
process drives every transport over one :func:`fedpipe.net.channel` (the
same TCP connection, options and interceptors for all). Both processes set
malloc as ``fedpipe node`` does (:func:`fedpipe.net.tune_malloc`;
``--malloc defaults`` leaves glibc's defaults). Each transfer is one call
whose end is the receiver's reply, timed on the sender.

What each transport includes:

* ``raw unary``: one raw ``bytes`` message of the tensor's encoded bytes
  (built once, before timing: no per-transfer copy on the sender); the
  receiver's handler (identity deserializer) holds the message and answers
  its length.
* ``raw stream``: a client stream of prebuilt messages of exactly the sizes
  fedpipe sends (fedpipe's own frames for the tensor, built once); the
  receiver holds every message until the stream ends and answers their total
  length.
* ``raw stream x8``: the same, for 8 tensors' messages in one stream (the
  figure is per tensor: a stream's time / 8).
* ``fedpipe call``: from the torch tensor, ``frames.encode_frames(t, "raw")``
  (codec, wire frames: protos/fedpipe/v1/FRAMES.md) sent by ``rpc.send`` (one
  call: ``SendOne`` for one frame, else a ``Send`` stream) as the client's
  feed and link probes send, into a real ``fedpipe.v1.Node`` ``Send`` that runs
  ``frames.read_tensors(..., in_place=True)`` as the node does (validate each
  frame and header, reassemble the pieces into one buffer, decode; a tensor
  of one frame is decoded where it lies in the message) and so holds a
  writable, contiguous torch tensor of the sent shape and dtype, whose size
  it checks: the node's receive path minus the mailbox.
* ``fedpipe stream x8``: 8 tensors through ``PeerSender.submit``, then
  ``flush`` (how stages send: a tensor's frames are queued into a client
  stream that stays open between tensors; ``flush`` ends it and waits for the
  reply) into the same ``Send``; per tensor, as ``raw stream x8``.

Transports take turns in short rounds (the order reversed every other round),
so a busy machine slows them alike. Per round a transport makes ``--count``
transfers (fewer for small sizes would be noise: see ``_count``); its figure
is payload MB (1e6 bytes) / median transfer time. The ratio of a round is a
fedpipe transport's figure over the faster of raw unary and the raw stream of
the same shape (``raw stream`` for ``fedpipe call``, ``raw stream x8`` for
``fedpipe stream x8``) *in that round*; the report gives the median ratio
over rounds and its interquartile range, with the load average before and
after each size. CPU ms/tensor is the CPU time both processes used (all
threads, gRPC's included), per tensor: less noisy than wall time on a
shared machine, and what a busy one runs out of.

    python benchmarks/wire.py            # ~1 min
    python benchmarks/wire.py --quick    # ~20 s
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # for ``benchmarks.codecs`` (and fedpipe, if not installed);
    sys.path.append(str(ROOT))  # last, so an installed fedpipe is the one measured

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64 KiB": 64 * KiB, "1 MiB": MiB, "16 MiB": 16 * MiB}
BURST = 8
"""Tensors per stream in the long-lived-stream transports."""
RAW = ["raw unary", "raw stream", f"raw stream x{BURST}"]
FEDPIPE = {"fedpipe call": ["raw unary", "raw stream"],
           f"fedpipe stream x{BURST}": ["raw unary", f"raw stream x{BURST}"]}
"""Each fedpipe transport, and the raw transports whose faster one is its baseline."""
TRANSPORTS = RAW + list(FEDPIPE)
TARGETS = {"1 MiB": 0.8, "16 MiB": 0.9}  # fedpipe >= TARGET x the faster raw-bytes gRPC


def _exit_when_parent_goes() -> None:
    """Exit as soon as stdin (a pipe from the orchestrator) closes: also if it was killed."""
    def watch():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        finally:
            os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------------
# receiver process


def serve() -> None:
    import grpc

    from fedpipe import net
    from fedpipe.proto import node_pb2, node_pb2_grpc
    from fedpipe.wire import WireError, frames, rpc

    class BenchNode(node_pb2_grpc.NodeServicer):
        """``Send`` as the node receives, minus the mailbox: each tensor is decoded
        and its size checked against the envelope (the sender puts it in ``batch_size``)."""

        def Send(self, request_iterator, context):
            try:
                for head, tensor in frames.read_tensors(request_iterator, in_place=True):
                    got = tensor.numel() * tensor.element_size()
                    if got != head.envelope.batch_size or not tensor.is_contiguous():
                        context.abort(grpc.StatusCode.DATA_LOSS,
                                      f"got {got} bytes, expected {head.envelope.batch_size}")
            except WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {e}")
            return node_pb2.SendReply()

        def SendOne(self, request, context):  # as the node: Send's one-frame form
            return self.Send(iter((request,)), context)

    def raw_stream(request_iterator, context):
        held = list(request_iterator)  # every message, held until the stream ends
        return struct.pack("<Q", sum(map(len, held)))

    def raw_unary(request, context):
        return struct.pack("<Q", len(request))

    srv = net.server()
    rpc.add_node_servicer(BenchNode(), srv)
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Raw", {
        "Stream": grpc.stream_unary_rpc_method_handler(raw_stream),
        "Unary": grpc.unary_unary_rpc_method_handler(raw_unary)})])
    port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    print(json.dumps({"port": port}), flush=True)
    _exit_when_parent_goes()
    threading.Event().wait()


# ---------------------------------------------------------------------------
# sender process


def transfer(transport: str, nbytes: int, stub, peer, raw_unary, raw_stream):
    """A function doing one transfer of ``nbytes`` by ``transport`` over the sender's
    handles (its stub, its peer sender, the raw methods); its data is built here, once."""
    import torch

    from fedpipe.proto import node_pb2
    from fedpipe.wire import frames, rpc

    tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes))
    env = node_pb2.Envelope(job_id="bench", replica=0, stage=1,
                            kind=node_pb2.KIND_ACTIVATION, batch_size=nbytes)
    prebuilt = list(frames.encode_frames(tensor, envelope=env))
    # the tensor round-trips through the frames unchanged
    ((_, back),) = frames.read_tensors(prebuilt)
    assert torch.equal(back, tensor)
    if transport == "fedpipe call":
        def once():
            rpc.send(stub, frames.encode_frames(tensor, envelope=env), timeout=60)
        return once
    if transport == f"fedpipe stream x{BURST}":
        def once():
            for _ in range(BURST):
                peer.submit(env, tensor, "raw")
            peer.flush()
        return once
    if transport == "raw unary":
        whole = b"".join(prebuilt)

        def once():
            n = struct.unpack("<Q", raw_unary(whole, timeout=60))[0]
            assert n == len(whole), n
        return once
    if transport.startswith("raw stream"):
        burst = prebuilt * (BURST if transport.endswith(f"x{BURST}") else 1)
        total = sum(map(len, burst))

        def once():
            n = struct.unpack("<Q", raw_stream(iter(burst), timeout=60))[0]
            assert n == total, n
        return once
    raise ValueError(transport)


def send(port: int) -> None:
    import torch

    from fedpipe import net
    from fedpipe.node.peers import PeerSender
    from fedpipe.wire import rpc

    torch.set_num_threads(1)
    channel = net.channel(f"127.0.0.1:{port}")
    stub = rpc.NodeStub(channel)
    peer = PeerSender(f"127.0.0.1:{port}", channel)
    raw_unary = channel.unary_unary("/bench.Raw/Unary")  # no serializers: bytes in, bytes out
    raw_stream = channel.stream_unary("/bench.Raw/Stream")

    cache: dict = {}
    for line in sys.stdin:  # one JSON command per line; EOF: the orchestrator is done
        cmd = json.loads(line)
        key = (cmd["transport"], cmd["nbytes"])
        if key not in cache:
            cache[key] = transfer(*key, stub, peer, raw_unary, raw_stream)
            for _ in range(3):  # warm up: first allocations
                cache[key]()
        once, times = cache[key], []
        cpu = _cpu_seconds(os.getpid())
        for _ in range(cmd["count"]):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        print(json.dumps({"times": times, "cpu": _cpu_seconds(os.getpid()) - cpu}), flush=True)


# ---------------------------------------------------------------------------
# orchestrator


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux /proc;
    the kernel counts in ticks, 10 ms)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pair:
    """The receiver and the sender process."""

    def __init__(self, malloc: str):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        args = [sys.executable, __file__, "--malloc", malloc]
        self.procs: list[subprocess.Popen] = []
        receiver = self._start(args + ["--role", "serve"], env)
        line = receiver.stdout.readline()
        if not line:
            raise RuntimeError("the receiver did not start (see its stderr above)")
        port = json.loads(line)["port"]
        self.sender = self._start(args + ["--role", "send", "--port", str(port)], env)

    def _start(self, args: list[str], env: dict) -> subprocess.Popen:
        p = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        self.procs.append(p)
        return p

    def run(self, transport: str, nbytes: int, count: int) -> tuple[list[float], float]:
        """Seconds of each of ``count`` transfers, and the CPU seconds both processes used."""
        receiver = _cpu_seconds(self.procs[0].pid)
        self.sender.stdin.write(json.dumps({"transport": transport, "nbytes": nbytes,
                                            "count": count}) + "\n")
        self.sender.stdin.flush()
        line = self.sender.stdout.readline()
        if not line:
            raise RuntimeError(f"the sender died during {transport} {nbytes} B "
                               f"(see its stderr above)")
        out = json.loads(line)
        return out["times"], out["cpu"] + _cpu_seconds(self.procs[0].pid) - receiver

    def close(self) -> None:
        for p in reversed(self.procs):  # the sender first, so it does not see its peer go
            if p.poll() is None:
                p.kill()
            p.wait()


def _count(nbytes: int, count: int) -> int:
    """Transfers per transport and round: ``count`` at 16 MiB, more for smaller sizes
    (up to 16x), so each turn lasts a few tens of milliseconds at least."""
    return count * min(16, max(1, (16 * MiB // nbytes) // 4))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of ``xs``."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def measure(pair: Pair, nbytes: int, rounds: int, count: int
            ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """MB/s of each transport in each round (lists in round order), and its CPU
    milliseconds per tensor (sender and receiver together, over all rounds)."""
    mbps: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    cpu = {t: 0.0 for t in TRANSPORTS}
    tensors = {t: 0 for t in TRANSPORTS}
    for r in range(rounds):
        order = TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]
        for transport in order:
            per = BURST if transport.endswith(f"x{BURST}") else 1  # tensors per call
            times, used = pair.run(transport, nbytes, max(1, _count(nbytes, count) // per))
            mbps[transport].append(per * nbytes / statistics.median(times) / 1e6)
            cpu[transport] += used
            tensors[transport] += per * len(times)
    return mbps, {t: 1e3 * cpu[t] / tensors[t] for t in TRANSPORTS}


def report(size: str, mbps: dict[str, list[float]], cpu: dict[str, float],
           load: tuple[str, str]) -> list[str]:
    """Print one size's table; return its verdict lines."""
    n = len(mbps[RAW[0]])
    print(f"\n{size}: {n} rounds; load average before {load[0]}, after {load[1]}")
    print(f"  {'transport':<17} {'MB/s median':>11} {'(IQR)':>17} {'CPU ms/tensor':>14}")
    for t in TRANSPORTS:
        q1, q2, q3 = quartiles(mbps[t])
        print(f"  {t:<17} {q2:>11.0f} {f'({q1:.0f}-{q3:.0f})':>17} {cpu[t]:>14.2f}")
    verdicts = []
    for t, raws in FEDPIPE.items():
        ratios = [f / max(b) for f, *b in zip(mbps[t], *(mbps[r] for r in raws))]
        q1, q2, q3 = quartiles(ratios)
        line = (f"  {t:<17} / faster of {' and '.join(raws)}: median {q2:.2f}x "
                f"(IQR {q1:.2f}-{q3:.2f})")
        if size in TARGETS:
            target = TARGETS[size]
            line += (f", target {target}x: " + ("met" if q2 >= target
                                                 else f"NOT met by {target - q2:.2f}"))
            verdicts.append(f"{size:>6} {line.strip()}  [load {load[1]}]")
        print(line)
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, help="rounds per size (default 21, quick 9)")
    ap.add_argument("--count", type=int, default=8,
                    help="transfers per transport and round at 16 MiB (more when smaller)")
    ap.add_argument("--malloc", choices=["tuned", "defaults"], default="tuned",
                    help="tuned: fedpipe.net.tune_malloc() as fedpipe node does; "
                         "defaults: glibc's")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--no-codecs", action="store_true", help="skip the codec table")
    ap.add_argument("--role", choices=["serve", "send"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role:
        if args.malloc == "tuned":
            from fedpipe.net import tune_malloc
            if not tune_malloc():
                raise SystemExit("tune_malloc() did not apply (not glibc?)")
        serve() if args.role == "serve" else send(args.port)
        return

    # a SIGTERM unwinds like Ctrl-C, so the child processes are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rounds = args.rounds or (9 if args.quick else 21)
    print(f"wire benchmark: {len(args.sizes)} sizes x {len(TRANSPORTS)} transports, {rounds} "
          f"interleaved rounds, malloc {args.malloc}; {os.cpu_count()} CPUs, load average "
          f"{_load()}", flush=True)
    pair = Pair(args.malloc)
    verdicts: list[str] = []
    try:
        for size in args.sizes:
            before = _load()
            mbps, cpu = measure(pair, SIZES[size], rounds, args.count)
            verdicts += report(size, mbps, cpu, (before, _load()))
    finally:
        pair.close()
    print("\nTargets: fedpipe >= " + ", ".join(f"{t}x at {s}" for s, t in TARGETS.items())
          + " of the faster raw-bytes gRPC transport, median of per-round ratios:")
    for v in verdicts:
        print("  " + v)

    if not args.no_codecs:
        from benchmarks.codecs import main as codec_main
        print("\nCodecs on the demo model's tensors (benchmarks/codecs.py):")
        codec_main()


if __name__ == "__main__":
    main()
