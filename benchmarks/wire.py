"""Wire benchmark: fedpipe's tensor transfer beside raw-bytes gRPC and plain TCP.

For 64 KiB, 1 MiB and 16 MiB float32 tensors on 127.0.0.1, in one run:

* ``tcp``: a plain socket; the sender ``sendall``s a length and the bytes, the
  receiver ``recv_into``s a reused buffer and acks with one byte.
* ``grpc unary``: one raw ``bytes`` message per transfer (generic handler,
  identity serializers), the receiver counts the bytes and acks.
* ``grpc stream``: the same bytes as a client stream of 1 MiB pieces (what
  fedpipe's chunking would cost if framing were free).
* ``fedpipe``: PeerSender's encoding and framing for an activation on a fast
  link (``codecs.encode_payload(t, "raw")``, ``frames.to_frames``: wire frames,
  protos/fedpipe/v1/FRAMES.md) sent by ``rpc.send`` (as the client's feed and
  link probes send: one ``Send`` call, unary when the tensor fits one frame)
  into a real ``fedpipe.v1.Node`` ``Send`` served by ``rpc.add_node_servicer``
  that runs ``frames.read_tensors`` (validate, reassemble, decode to a torch
  tensor): the node's receive path minus the mailbox. Each transfer is a call
  of its own, so its end is acknowledged; PeerSender writes a job's tensors
  into one long-lived stream instead, which also spares the call set-up per tensor.

The raw senders send prebuilt ``bytes`` (no per-transfer copy on the Python
side) and the TCP receiver reuses its buffer, so they are ceilings. Every gRPC
channel and server comes from :mod:`fedpipe.net`, so options match production.

Receiver and sender are separate processes (no shared GIL), started by this
script with a chosen environment. The whole comparison runs once per malloc
configuration, all in the same run: glibc's defaults; ``MALLOC_MMAP_THRESHOLD_``
alone; with ``MALLOC_TRIM_THRESHOLD_``; with ``MALLOC_ARENA_MAX=1`` too ("env
tuned"); and the tuned values set in-process with ``mallopt()`` at start-up
(``--quick``: defaults and env tuned only). Configurations and transports
take turns in rounds, so a busy machine slows them alike. A number is the
median over transfers of payload MB (1e6 bytes) / wall time of one transfer,
sender side, end to end including the ack. Page faults are minor faults per
fedpipe transfer, in the sender and in the receiver.

Then the codec table of ``benchmarks/codecs.py``.

    python benchmarks/wire.py            # ~2 min
    python benchmarks/wire.py --quick    # ~40 s (fewer configurations, shorter)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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
TRANSPORTS = ["tcp", "grpc unary", "grpc stream", "fedpipe"]
RAW_CHUNK = MiB  # pieces of the raw gRPC stream: fedpipe's CHUNK_BYTES
TARGETS = {"1 MiB": 0.8, "16 MiB": 0.9}  # fedpipe >= TARGET x raw-bytes gRPC

# glibc's malloc: a block above the mmap threshold (128 KiB at start; dynamic,
# up to 32 MiB) is mmapped and unmapped on free, and free heap above the trim
# threshold goes back to the kernel, so large messages keep landing on freshly
# mapped pages, ~2 us of page faults per 4 KiB. The threshold cannot be set
# above 32 MiB (HEAP_MAX_SIZE / 2 on 64-bit; a larger value is ignored).
# Setting it explicitly turns the dynamic adjustment off, trim threshold
# included, so the trim threshold must be raised with it ("env mmap only"
# shows what happens otherwise). Threads other than the main one allocate from
# per-thread arenas made of 64 MiB heaps that are unmapped when they empty,
# whatever the trim threshold: a receiver holding a few copies of a 16 MiB
# payload overflows one and faults again; one arena (the main, sbrk heap) does not.
MMAP_TRIM = {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB), "MALLOC_TRIM_THRESHOLD_": str(256 * MiB)}
TUNED = {**MMAP_TRIM, "MALLOC_ARENA_MAX": "1"}
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
            "MALLOC_ARENA_MAX": -8}


def configs(full: bool) -> dict[str, dict]:
    """name -> {"env": MALLOC_* variables, "mallopt": the same, applied in-process}."""
    out = {"glibc defaults": {"env": {}, "mallopt": {}}}
    if full:
        out["env mmap only"] = {"env": {k: MMAP_TRIM[k] for k in ["MALLOC_MMAP_THRESHOLD_"]},
                                "mallopt": {}}
        out["env mmap+trim"] = {"env": MMAP_TRIM, "mallopt": {}}
    out["env tuned"] = {"env": TUNED, "mallopt": {}}
    if full:
        out["mallopt tuned"] = {"env": {}, "mallopt": TUNED}
    return out


def apply_mallopt(settings: dict[str, str]) -> None:
    """Set glibc malloc parameters in this process (like the env variables, but at run time)."""
    if not settings:
        return
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    for name, value in settings.items():
        if libc.mallopt(_MALLOPT[name], int(value)) != 1:
            raise OSError(f"mallopt({name}={value}) failed")


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
        """``Send`` exactly as the node receives, minus the mailbox: it checks the
        decoded tensor's size against the envelope (the sender puts it in ``batch_size``)."""

        def Send(self, request_iterator, context):
            try:
                for head, tensor in frames.read_tensors(request_iterator):
                    got = tensor.numel() * tensor.element_size()
                    if got != head.envelope.batch_size:
                        context.abort(grpc.StatusCode.DATA_LOSS,
                                      f"got {got} bytes, expected {head.envelope.batch_size}")
            except WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {e}")
            return node_pb2.SendReply()

    def raw_stream(request_iterator, context):
        n = sum(len(piece) for piece in request_iterator)
        return struct.pack("<Q", n)

    def raw_unary(request, context):
        return struct.pack("<Q", len(request))

    srv = net.server()
    rpc.add_node_servicer(BenchNode(), srv)
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Raw", {
        "Stream": grpc.stream_unary_rpc_method_handler(raw_stream),
        "Unary": grpc.unary_unary_rpc_method_handler(raw_unary)})])
    grpc_port = net.bind(srv, "127.0.0.1", 0)
    srv.start()

    listener = socket.create_server(("127.0.0.1", 0))

    def tcp_conn(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(16 * MiB))
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                n = struct.unpack("<Q", head)[0]
                if n > len(buf):
                    buf = memoryview(bytearray(n))
                got = 0
                while got < n:
                    k = conn.recv_into(buf[got:n])
                    if not k:
                        return
                    got += k
                conn.sendall(b"k")

    def tcp_accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=tcp_conn, args=(conn,), daemon=True).start()

    threading.Thread(target=tcp_accept, daemon=True).start()
    print(json.dumps({"grpc": grpc_port, "tcp": listener.getsockname()[1]}), flush=True)
    _exit_when_parent_goes()
    threading.Event().wait()


# ---------------------------------------------------------------------------
# sender process


def send(grpc_port: int, tcp_port: int) -> None:
    import resource

    import torch

    from fedpipe import net
    from fedpipe.proto import node_pb2
    from fedpipe.wire import codecs, frames, rpc

    torch.set_num_threads(1)
    address = f"127.0.0.1:{grpc_port}"
    fp_channel, raw_channel = net.channel(address), net.channel(address)
    stub = rpc.NodeStub(fp_channel)
    raw_unary = raw_channel.unary_unary("/bench.Raw/Unary")  # no serializers: bytes in, bytes out
    raw_stream = raw_channel.stream_unary("/bench.Raw/Stream")
    sock = socket.create_connection(("127.0.0.1", tcp_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transfer(transport: str, nbytes: int):
        """A function doing one transfer of ``nbytes``; its data is built here, once."""
        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes))
        payload = tensor.numpy().tobytes()
        if transport == "fedpipe":
            env = node_pb2.Envelope(job_id="bench", replica=0, stage=1,
                                    kind=node_pb2.KIND_ACTIVATION, batch_size=nbytes)
            # the payload round-trips through the frames unchanged
            back = [t for _, t in frames.read_tensors(frames.to_frames(codecs.encode(tensor)))]
            assert len(back) == 1 and torch.equal(back[0], tensor)

            def once():  # PeerSender's encoding and framing, one call per transfer
                msg, payload = codecs.encode_payload(tensor, "raw")
                rpc.send(stub, frames.to_frames(msg, payload=payload, envelope=env), timeout=60)
            return once
        if transport == "grpc unary":
            def once():
                n = struct.unpack("<Q", raw_unary(payload, timeout=60))[0]
                assert n == nbytes, n
            return once
        if transport == "grpc stream":
            pieces = [payload[i:i + RAW_CHUNK] for i in range(0, nbytes, RAW_CHUNK)]

            def once():
                n = struct.unpack("<Q", raw_stream(iter(pieces), timeout=60))[0]
                assert n == nbytes, n
            return once
        if transport == "tcp":
            view = memoryview(payload)
            head = struct.pack("<Q", nbytes)

            def once():
                sock.sendall(head)
                sock.sendall(view)
                if sock.recv(1) != b"k":
                    raise ConnectionError("tcp receiver closed")
            return once
        raise ValueError(transport)

    cache: dict = {}
    for line in sys.stdin:  # one JSON command per line; EOF: the orchestrator is done
        cmd = json.loads(line)
        key = (cmd["transport"], cmd["nbytes"])
        if key not in cache:
            cache[key] = transfer(*key)
            for _ in range(3):  # warm up: connection, first allocations
                cache[key]()
        once = cache[key]
        times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        end = time.perf_counter() + cmd["seconds"]
        while True:
            start = time.perf_counter()
            once()
            now = time.perf_counter()
            times.append(now - start)
            if now >= end and len(times) >= 3:
                break
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(json.dumps({"times": times, "faults": faults}), flush=True)


# ---------------------------------------------------------------------------
# orchestrator


def _minflt(pid: int) -> int:
    """Minor page faults of a process so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


class Pair:
    """A receiver and a sender process with one malloc configuration.

    Construction starts the receiver; :meth:`start_sender` (once its ports are
    known) the sender, so that several pairs start up side by side.
    """

    def __init__(self, name: str, cfg: dict):
        self.name, self.procs, self.sender = name, [], None
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        self.env.update(cfg["env"], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.args = [sys.executable, __file__, "--mallopt", json.dumps(cfg["mallopt"])]
        self.receiver = self._start(self.args + ["--role", "serve"], self.env)

    def start_sender(self) -> None:
        line = self.receiver.stdout.readline()
        if not line:
            raise RuntimeError(f"[{self.name}] the receiver did not start (see its stderr above)")
        ports = json.loads(line)
        self.sender = self._start(self.args + ["--role", "send", "--grpc-port", str(ports["grpc"]),
                                               "--tcp-port", str(ports["tcp"])], self.env)

    def _start(self, args: list[str], env: dict) -> subprocess.Popen:
        p = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        self.procs.append(p)
        return p

    def run(self, transport: str, nbytes: int, seconds: float) -> dict:
        before = _minflt(self.receiver.pid)
        self.sender.stdin.write(json.dumps({"transport": transport, "nbytes": nbytes,
                                            "seconds": seconds}) + "\n")
        self.sender.stdin.flush()
        line = self.sender.stdout.readline()
        if not line:
            raise RuntimeError(f"[{self.name}] the sender died during {transport} {nbytes} B "
                               f"(see its stderr above)")
        out = json.loads(line)
        out["receiver_faults"] = _minflt(self.receiver.pid) - before
        return out

    def close(self) -> None:
        for p in reversed(self.procs):  # the sender first, so it does not see its peer go
            if p.poll() is None:
                p.kill()
            p.wait()


def measure(cfgs: dict[str, dict], seconds: float, rounds: int) -> dict:
    """{(config, size, transport): {"MBps": median, "n": transfers, faults per transfer}}."""
    pairs: list[Pair] = []
    samples: dict = {}
    try:
        for name, cfg in cfgs.items():
            pairs.append(Pair(name, cfg))
        for pair in pairs:
            pair.start_sender()
        for size, nbytes in SIZES.items():
            for r in range(rounds):  # configurations and transports take turns
                for pair in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                    k = r % len(TRANSPORTS)
                    for transport in TRANSPORTS[k:] + TRANSPORTS[:k]:
                        out = pair.run(transport, nbytes, seconds / rounds)
                        s = samples.setdefault((pair.name, size, transport),
                                               {"times": [], "faults": 0, "rfaults": 0})
                        s["times"] += out["times"]
                        s["faults"] += out["faults"]
                        s["rfaults"] += out["receiver_faults"]
            print(f"  measured {size}", file=sys.stderr, flush=True)
    finally:
        for pair in pairs:
            pair.close()
    results = {}
    for (name, size, transport), s in samples.items():
        n = len(s["times"])
        results[(name, size, transport)] = {
            "MBps": SIZES[size] / statistics.median(s["times"]) / 1e6, "n": n,
            "faults": s["faults"] / n, "rfaults": s["rfaults"] / n}
    return results


def print_tables(cfgs: dict[str, dict], res: dict) -> None:
    for name, cfg in cfgs.items():
        settings = cfg["env"] or cfg["mallopt"]
        what = " ".join(f"{k}={v}" for k, v in settings.items()) or "no MALLOC_* settings"
        how = "environment" if cfg["env"] else "mallopt() at start-up" if cfg["mallopt"] else ""
        print(f"\n[{name}] {what}" + (f" ({how})" if how else ""))
        head = (f"{'size':>7} {'tcp':>8} {'grpc un':>8} {'grpc st':>8} {'fedpipe':>8}"
                f" {'fp/unary':>8} {'fp/strm':>8} {'fp/tcp':>7}  {'n fp':>5}"
                f" {'faults/xfer s/r':>16}")
        print("MB/s, median of n transfers; faults: minor page faults per fedpipe transfer, "
              "sender/receiver")
        print(head)
        print("-" * len(head))
        for size in SIZES:
            r = {t: res[(name, size, t)] for t in TRANSPORTS}
            mb = {t: r[t]["MBps"] for t in TRANSPORTS}
            fp = r["fedpipe"]
            print(f"{size:>7} {mb['tcp']:>8.0f} {mb['grpc unary']:>8.0f} {mb['grpc stream']:>8.0f} "
                  f"{mb['fedpipe']:>8.0f} {mb['fedpipe'] / mb['grpc unary']:>8.2f} "
                  f"{mb['fedpipe'] / mb['grpc stream']:>8.2f} {mb['fedpipe'] / mb['tcp']:>7.2f}  "
                  f"{fp['n']:>5} {fp['faults']:>8.0f}/{fp['rfaults']:<7.0f}")

    print("\nEffect of the malloc settings (MB/s relative to glibc defaults):")
    others = [n for n in cfgs if n != "glibc defaults"]
    head = f"{'size':>7} {'transport':<12}" + "".join(f" {n:>14}" for n in others)
    print(head)
    print("-" * len(head))
    for size in SIZES:
        for t in TRANSPORTS:
            base = res[("glibc defaults", size, t)]["MBps"]
            print(f"{size:>7} {t:<12}" + "".join(f" {res[(n, size, t)]['MBps'] / base:>13.2f}x"
                                                  for n in others))

    print("\nTargets: fedpipe >= " + ", ".join(f"{t}x at {s}" for s, t in TARGETS.items())
          + " of raw-bytes gRPC (the faster of unary and stream):")
    for size, target in TARGETS.items():
        for name in cfgs:
            fp = res[(name, size, "fedpipe")]["MBps"]
            raw = max(res[(name, size, t)]["MBps"] for t in ("grpc unary", "grpc stream"))
            print(f"  {size:>6} {name:<16} {fp:6.0f} / {raw:6.0f} MB/s = {fp / raw:.2f}x  "
                  f"{'met' if fp / raw >= target else 'NOT met'}")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter run, two malloc configurations")
    ap.add_argument("--seconds", type=float, help="time per (configuration, size, transport)")
    ap.add_argument("--no-codecs", action="store_true", help="skip the codec table")
    ap.add_argument("--role", choices=["serve", "send"], help=argparse.SUPPRESS)
    ap.add_argument("--mallopt", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tcp-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role:
        apply_mallopt(json.loads(args.mallopt))  # before anything big is allocated
        if args.role == "serve":
            serve()
        else:
            send(args.grpc_port, args.tcp_port)
        return

    # a SIGTERM unwinds like Ctrl-C, so the child processes are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    cfgs = configs(full=not args.quick)
    seconds = args.seconds or (0.6 if args.quick else 1.5)
    rounds = 2 if args.quick else 4
    print(f"wire benchmark: {len(cfgs)} malloc configurations x {len(SIZES)} sizes x "
          f"{len(TRANSPORTS)} transports, {seconds:g} s each in {rounds} rounds; "
          f"{os.cpu_count()} CPUs, load average {_load()}", flush=True)
    res = measure(cfgs, seconds, rounds)
    print_tables(cfgs, res)
    print(f"load average after: {_load()}")

    if not args.no_codecs:
        from benchmarks.codecs import main as codec_main
        print("\nCodecs on the demo model's tensors (benchmarks/codecs.py):")
        codec_main()


if __name__ == "__main__":
    main()
