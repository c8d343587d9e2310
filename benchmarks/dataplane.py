"""Socket data plane benchmark: fedpipe.net.dataplane vs raw TCP and gRPC, interleaved in one run.

64 KiB, 1 MiB and 16 MiB float32 tensors on 127.0.0.1, between two processes
(a receiver serving every transport, a sender driving them), both with
fedpipe's malloc settings (:func:`fedpipe.net.tune_malloc`) and one torch
thread. Each transfer ends with the receiver's answer, timed on the sender.

Transports:

* ``raw tcp``: the baseline (issue 24). One ``sendall`` of a prebuilt buffer
  (an 8-byte length, then the bytes) into a preallocated buffer the receiver
  fills with ``recv_into``; it answers one byte.
* ``dataplane``: :meth:`Link.send` of the torch tensor with ``flush=True`` (a
  header, the tensor's own memory and a SYNC in one ``sendmsg``; it returns
  on the ACK the receiver sends once it holds the tensor): the receiver reads
  it into a ``torch.empty`` of the header's shape and checks its size.
* ``dataplane x8``: 8 sends, the last with ``flush=True`` (how a stage streams
  and then flushes); per tensor.
* ``dataplane tls``: ``dataplane`` over mutual TLS (certificates made for the run).
* ``raw tls``: ``raw tcp`` over a bare :class:`ssl.SSLSocket` with fedpipe's mutual-TLS
  contexts (:func:`fedpipe.security.tls.server_context`, ``client_context``): what
  Python's ``ssl`` itself allows, the ceiling of ``dataplane tls`` (no fedpipe code on
  its path).
* ``grpc raw``: one raw-bytes unary gRPC call of a prebuilt message.
* ``grpc call``: today's gRPC data plane, ``rpc.send`` of ``frames.encode_frames``
  into a ``Send`` that runs ``frames.read_tensors(in_place=True)`` as the node does.
* ``grpc stream x8``: 8 tensors by ``PeerSender.submit``, then ``flush`` (today's
  stage path); per tensor.

Transports take turns in short rounds (the order reversed every other
round). A transport's figure is MB/s (1e6 bytes) over its median transfer
time; the ratios are taken within each round and reported as the median over
rounds with the interquartile range, with the load average before and after.
Then: per-message latency at 64 KiB (median round trip), and the CPU per
64 KiB message streamed (user + system CPU of both processes over
``--messages`` messages, then one flush), in interleaved rounds, on four paths
(:data:`CPU_PATHS`): issue 24's figure, ``node``, goes through a node's own
receive path (:class:`NodePath`: its socket listener, NodeReceiver's admission
checks, the mailbox, and a stage thread taking each tensor from it), plain and
over mutual TLS; beside it the floor, ``raw tcp`` (the same bytes by ``sendall``
into ``recv_into``, one answer byte per message read at the end: the kernel's
copies and two Python loops), the socket plane into a bench inbox (no admission,
no mailbox: the figure printed before) and today's gRPC stream.

    python benchmarks/dataplane.py            # ~1 min
    python benchmarks/dataplane.py --quick
    python benchmarks/dataplane.py --sizes --cpu-rounds 5   # only the CPU figure
    python benchmarks/dataplane.py --sizes --paths node dataplane  # of these paths
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
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks.wire import _cpu_seconds, _exit_when_parent_goes, _load, quartiles  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64 KiB": 64 * KiB, "1 MiB": MiB, "16 MiB": 16 * MiB}
BURST = 8
TRANSPORTS = ["raw tcp", "dataplane", f"dataplane x{BURST}", "raw tls", "dataplane tls",
              "grpc raw", "grpc call", f"grpc stream x{BURST}"]
RATIOS = [("dataplane", "raw tcp"), (f"dataplane x{BURST}", "raw tcp"),
          ("dataplane", "grpc raw"), ("dataplane", "grpc call"),
          ("dataplane tls", "dataplane"), ("raw tls", "raw tcp"), ("dataplane tls", "raw tls")]
TARGETS = {("16 MiB", "dataplane", "raw tcp"): 0.9, ("1 MiB", "dataplane", "raw tcp"): 0.8,
           ("16 MiB", "dataplane", "grpc raw"): 1.5, ("16 MiB", "dataplane tls", "dataplane"): 0.6}
CPU_TARGET_US = 50.0


def _tls(directory: str, name: str) -> Any:
    from fedpipe.security import TlsConfig
    return TlsConfig.load(directory, name)


# ---------------------------------------------------------------------------
# receiver process


def _raw_server(context: Any = None) -> int:
    """A raw TCP receiver: per transfer an 8-byte length, then that many bytes into a
    preallocated buffer; answers one byte. ``context``: an :class:`ssl.SSLContext` to
    serve each connection over (a bare ``SSLSocket``), or None for plain TCP."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            conn = context.wrap_socket(conn, server_side=True)
        buf = memoryview(bytearray(16 * MiB + 8))
        while True:
            got = 0
            while got < 8:
                n = conn.recv_into(buf[got:8])
                if not n:
                    return
                got += n
            (size,) = struct.unpack_from("<Q", buf)
            got = 0
            while got < size:
                got += conn.recv_into(buf[got:size])
            conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


class NodePath:
    """The node's own receive path (issue 24's CPU figure): a node's parts as ``fedpipe
    node --data-port`` builds them (:func:`fedpipe.node.parts.build_parts`: its socket
    listener, :class:`~fedpipe.node.dataplane.NodeReceiver`, the job access book, the
    admission checks, the stage registry and the mailbox), one RUNNING stage of job
    ``bench`` (stage 1 of 2) registered in it, the sender assigned to the job, and a
    thread that takes each activation from the mailbox in order, as the stage's
    transport does (:meth:`fedpipe.node.wiring.StageTransport.recv`), checking its size.

    Args:
        name: the node's name (the sender's link names it).
        tls: mutual TLS (the sender's certificate then passes the policy and job checks).
    """

    def __init__(self, name: str, tls: Any = None):
        import torch
        from torch import nn

        from fedpipe.node.lifecycle import Stage, StageSlot, StageState
        from fedpipe.node.parts import build_parts
        from fedpipe.proto import node_pb2

        self.parts = build_parts(lambda: name, name, node_pb2.Resources(), lambda report: None,
                                 tls=tls, data_port=0)
        assert self.parts.sockets is not None
        self.port = self.parts.sockets.port
        slot = StageSlot("bench", 0, 1)
        self.stage = Stage(slot, n_stages=2, layer_start=0, module=nn.Sequential(),
                           steps=2**31 - 1, peers=self.parts.stages.make_peers())
        self.stage.move(StageState.RUNNING, "benchmark")
        with self.parts.stages.lock:
            self.parts.stages.stages[slot] = self.stage
        self.parts.access.learn("bench", "sender", ["sender", name], [slot.key])
        self.taken, self.bad = 0, 0
        self._cond = threading.Condition()
        self._torch = torch
        threading.Thread(target=self._take, daemon=True).start()

    def _take(self) -> None:
        from fedpipe.spec import Kind
        mailbox, i = self.parts.stages.mailbox, 0
        while True:
            t, batch = mailbox.get(self.stage.inbox, Kind.ACTIVATION, i // NODE_MICROBATCHES,
                                   i % NODE_MICROBATCHES, stopped=lambda: not self.stage.live)
            i += 1
            with self._cond:
                self.taken += 1
                self.bad += t.numel() * t.element_size() != batch
                self._cond.notify_all()

    def wait_taken(self, count: int, timeout: float = 120.0) -> int:
        """Wait until the stage has taken ``count`` tensors in all; tensors of a wrong size."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.taken >= count, timeout):
                raise TimeoutError(f"the stage took {self.taken} of {count} tensors")
            return self.bad


NODE_MICROBATCHES = 64
"""Microbatches per step of the node path's stream (envelope step and microbatch)."""


def serve(tls_dir: str) -> None:
    import grpc

    from fedpipe import net
    from fedpipe.net.dataplane import Code, DataPlane, Refused
    from fedpipe.proto import node_pb2, node_pb2_grpc
    from fedpipe.security import tls as security_tls
    from fedpipe.wire import WireError, frames, rpc

    class BenchNode(node_pb2_grpc.NodeServicer):
        """``Send`` as the node receives, minus the mailbox (as benchmarks/wire.py)."""

        def Send(self, request_iterator, context):  # type: ignore[no-untyped-def]
            try:
                for head, tensor in frames.read_tensors(request_iterator, in_place=True):
                    got = tensor.numel() * tensor.element_size()
                    if got != head.envelope.batch_size:
                        context.abort(grpc.StatusCode.DATA_LOSS, f"got {got} bytes")
            except WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {e}")
            return node_pb2.SendReply()

        def SendOne(self, request, context):  # type: ignore[no-untyped-def]
            return self.Send(iter((request,)), context)

    class Inbox:
        """The data plane's receiver: each tensor's size checked against its envelope."""

        def admit(self, peer: Any, header: Any) -> int:
            return 1 << 34

        def deliver(self, peer: Any, header: Any, tensor: Any) -> None:
            got = tensor.numel() * tensor.element_size()
            if got != header.envelope.batch_size or not tensor.is_contiguous():
                raise Refused(Code.INVALID_ARGUMENT, f"got {got} bytes")

    nodes = {"node": NodePath("node"), "node tls": NodePath("node", _tls(tls_dir, "node"))}

    def taken(request: bytes, context: Any) -> bytes:  # the stage took them all: its bad ones
        which, count = json.loads(request)
        return struct.pack("<Q", nodes[which].wait_taken(count))

    srv = net.server()
    rpc.add_node_servicer(BenchNode(), srv)
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Raw", {
        "Unary": grpc.unary_unary_rpc_method_handler(
            lambda request, context: struct.pack("<Q", len(request))),
        "Taken": grpc.unary_unary_rpc_method_handler(taken)})])
    grpc_port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    plain = DataPlane("receiver", Inbox())
    tls = DataPlane("receiver", Inbox(), tls=_tls(tls_dir, "receiver"))
    raw_tls = _raw_server(security_tls.server_context(_tls(tls_dir, "receiver")))
    print(json.dumps({"grpc": grpc_port, "data": plain.port, "tls": tls.port,
                      "raw": _raw_server(), "raw tls": raw_tls, "node": nodes["node"].port,
                      "node tls": nodes["node tls"].port}), flush=True)
    _exit_when_parent_goes()
    threading.Event().wait()


# ---------------------------------------------------------------------------
# sender process


class Sender:
    """The sender's connections, one per transport, and a function per transport that
    makes one transfer of a tensor (its data built once, before timing)."""

    def __init__(self, ports: dict[str, int], tls_dir: str):
        import torch

        from fedpipe import net
        from fedpipe.net.dataplane import DataPlane
        from fedpipe.node.peers import PeerSender
        from fedpipe.security import tls as security_tls
        from fedpipe.wire import rpc

        class Nothing:
            def admit(self, peer: Any, header: Any) -> int:
                raise AssertionError("the receiver sends nothing back")

            def deliver(self, peer: Any, header: Any, tensor: Any) -> None:
                raise AssertionError("the receiver sends nothing back")

        torch.set_num_threads(1)
        channel = net.channel(f"127.0.0.1:{ports['grpc']}")
        self.stub = rpc.NodeStub(channel)
        self.peer = PeerSender(f"127.0.0.1:{ports['grpc']}", channel)
        self.grpc_raw = channel.unary_unary("/bench.Raw/Unary")
        self.planes = [DataPlane("sender", Nothing()),
                       DataPlane("sender", Nothing(), tls=_tls(tls_dir, "sender"))]
        self.link = self.planes[0].link("receiver", f"127.0.0.1:{ports['data']}")
        self.tls_link = self.planes[1].link("receiver", f"127.0.0.1:{ports['tls']}")
        self.node_links = {"node": self.planes[0].link("node", f"127.0.0.1:{ports['node']}"),
                           "node tls": self.planes[1].link(
                               "node", f"127.0.0.1:{ports['node tls']}")}
        self.node_sent = dict.fromkeys(self.node_links, 0)
        self.taken = channel.unary_unary("/bench.Raw/Taken")
        self.raw = socket.create_connection(("127.0.0.1", ports["raw"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_tls = socket.create_connection(("127.0.0.1", ports["raw tls"]))
        raw_tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw_tls = security_tls.client_context(_tls(tls_dir, "sender")).wrap_socket(
            raw_tls, server_hostname="127.0.0.1")

    def transfer(self, transport: str, nbytes: int) -> Callable[[], None]:
        import torch

        from fedpipe.proto import node_pb2
        from fedpipe.wire import frames, rpc

        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes))
        env = node_pb2.Envelope(job_id="bench", replica=0, stage=1,
                                kind=node_pb2.KIND_ACTIVATION, batch_size=nbytes)
        burst = _per(transport)
        if transport.startswith("raw"):
            prebuilt = memoryview(struct.pack("<Q", nbytes) + tensor.numpy().tobytes())
            sock = self.raw_tls if transport == "raw tls" else self.raw

            def once() -> None:
                sock.sendall(prebuilt)
                assert sock.recv(1) == b"k"
        elif transport.startswith("dataplane"):
            use = self.tls_link if transport.endswith("tls") else self.link

            def once() -> None:  # the last send waits for the receiver's ACK
                for i in range(burst):
                    use.send(tensor, envelope=env, flush=i == burst - 1)
        elif transport == "grpc raw":
            whole = b"".join(frames.encode_frames(tensor, envelope=env))

            def once() -> None:
                assert struct.unpack("<Q", self.grpc_raw(whole, timeout=60))[0] == len(whole)
        elif transport == "grpc call":
            def once() -> None:
                rpc.send(self.stub, frames.encode_frames(tensor, envelope=env), timeout=60)
        else:
            def once() -> None:
                for _ in range(burst):
                    self.peer.submit(env, tensor, "raw")
                self.peer.flush()
        return once

    def stream(self, transport: str, nbytes: int, count: int) -> None:
        """``count`` tensors streamed, one flush at the end (the CPU-per-message figure)."""
        import torch

        from fedpipe.proto import node_pb2

        tensor = torch.randn(nbytes // 4)
        env = node_pb2.Envelope(job_id="bench", stage=1, kind=node_pb2.KIND_ACTIVATION,
                                batch_size=nbytes)
        if transport == "raw tcp":  # the floor: the bytes and one answer byte each, read last
            prebuilt = memoryview(struct.pack("<Q", nbytes) + tensor.numpy().tobytes())
            for _ in range(count):
                self.raw.sendall(prebuilt)
            answered = 0
            while answered < count:
                answered += len(self.raw.recv(count - answered))
        elif transport == "dataplane":
            for _ in range(count):
                self.link.send(tensor, envelope=env)
            self.link.flush()
        elif transport in self.node_links:  # a stage's stream: each its step and microbatch
            link, first = self.node_links[transport], self.node_sent[transport]
            for i in range(first, first + count):
                link.send(tensor, envelope=node_pb2.Envelope(
                    job_id="bench", stage=1, kind=node_pb2.KIND_ACTIVATION, batch_size=nbytes,
                    step=i // NODE_MICROBATCHES, microbatch=i % NODE_MICROBATCHES))
            link.flush()
            self.node_sent[transport] = total = first + count
            bad = struct.unpack("<Q", self.taken(json.dumps([transport, total]).encode(),
                                                 timeout=120))[0]
            if bad:
                raise RuntimeError(f"the node's stage took {bad} tensors of the wrong size")
        else:
            for _ in range(count):
                self.peer.submit(env, tensor, "raw")
            self.peer.flush()


def send(ports: dict[str, int], tls_dir: str) -> None:
    """The sender process: one JSON command per line on stdin, one JSON answer each."""
    sender = Sender(ports, tls_dir)
    cache: dict[tuple[str, int], Callable[[], None]] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        key = (cmd["transport"], cmd["nbytes"])
        if not cmd.get("stream") and key not in cache:
            cache[key] = sender.transfer(*key)
            for _ in range(3):  # warm up: first allocations
                cache[key]()
        cpu = _cpu_seconds(os.getpid())
        times = []
        if cmd.get("stream"):
            start = time.perf_counter()
            sender.stream(cmd["transport"], cmd["nbytes"], cmd["count"])
            times.append(time.perf_counter() - start)
        else:
            for _ in range(cmd["count"]):
                t0 = time.perf_counter()
                cache[key]()
                times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times, "cpu": _cpu_seconds(os.getpid()) - cpu}),
              flush=True)


# ---------------------------------------------------------------------------
# orchestrator


class Pair:
    """The receiver and the sender process (certificates for the TLS transport made here)."""

    def __init__(self, tls_dir: str):
        from fedpipe.security import certs
        certs.make_ca(tls_dir)
        for name in ("receiver", "sender", "node"):
            certs.issue(tls_dir, "node", name)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        args = [sys.executable, __file__, "--tls-dir", tls_dir]
        self.procs: list[subprocess.Popen[str]] = []
        self.split = (0.0, 0.0)
        """The last :meth:`run`'s CPU seconds: the sender's, the receiver's."""
        receiver = self._start(args + ["--role", "serve"], env)
        assert receiver.stdout is not None
        line = receiver.stdout.readline()
        if not line:
            raise RuntimeError("the receiver did not start (see its stderr above)")
        self.sender = self._start(args + ["--role", "send", "--ports", line.strip()], env)

    def _start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        p = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        self.procs.append(p)
        return p

    def run(self, transport: str, nbytes: int, count: int, stream: bool = False
            ) -> tuple[list[float], float]:
        """Seconds of each transfer, and the CPU seconds both processes used."""
        receiver = _cpu_seconds(self.procs[0].pid)
        assert self.sender.stdin is not None and self.sender.stdout is not None
        self.sender.stdin.write(json.dumps({"transport": transport, "nbytes": nbytes,
                                            "count": count, "stream": stream}) + "\n")
        self.sender.stdin.flush()
        line = self.sender.stdout.readline()
        if not line:
            raise RuntimeError(f"the sender died during {transport} {nbytes} B")
        out = json.loads(line)
        self.split = (out["cpu"], _cpu_seconds(self.procs[0].pid) - receiver)
        return out["times"], sum(self.split)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
            p.wait()


def _per(transport: str) -> int:
    return BURST if transport.endswith(f"x{BURST}") else 1


def measure(pair: Pair, nbytes: int, rounds: int, count: int
            ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Per transport: MB/s per round, every transfer's seconds per tensor, CPU ms per tensor."""
    mbps: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    times: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    cpu = {t: 0.0 for t in TRANSPORTS}
    n = count * max(1, min(16, (16 * MiB // nbytes) // 4))  # 16 MiB: count
    for r in range(rounds):
        for t in (TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]):
            took, used = pair.run(t, nbytes, max(1, n // _per(t)))
            mbps[t].append(_per(t) * nbytes / statistics.median(took) / 1e6)
            times[t] += [x / _per(t) for x in took]
            cpu[t] += used / (len(took) * _per(t))
    return mbps, times, {t: 1e3 * c / rounds for t, c in cpu.items()}


def report(size: str, mbps: dict[str, list[float]], cpu: dict[str, float],
           load: tuple[str, str]) -> list[str]:
    print(f"\n{size}: {len(mbps[TRANSPORTS[0]])} rounds; load average before {load[0]}, "
          f"after {load[1]}")
    print(f"  {'transport':<17} {'MB/s median':>11} {'(IQR)':>17} {'CPU ms/tensor':>14}")
    for t in TRANSPORTS:
        q1, q2, q3 = quartiles(mbps[t])
        print(f"  {t:<17} {q2:>11.0f} {f'({q1:.0f}-{q3:.0f})':>17} {cpu[t]:>14.3f}")
    verdicts = []
    for a, b in RATIOS:
        q1, q2, q3 = quartiles([x / y for x, y in zip(mbps[a], mbps[b])])
        line = f"  {a} / {b}: median {q2:.2f}x (IQR {q1:.2f}-{q3:.2f})"
        target = TARGETS.get((size, a, b))
        if target is not None:
            line += f", target {target}x: " + ("met" if q2 >= target
                                               else f"NOT met by {target - q2:.2f}")
            verdicts.append(f"{size:>6} {line.strip()}  [load {load[1]}]")
        print(line)
    return verdicts


def latency(times: dict[str, list[float]]) -> None:
    print("\nPer-message latency at 64 KiB (one tensor, sent until the receiver answers), "
          "median and IQR over every transfer:")
    for t in ("raw tcp", "dataplane", "grpc raw", "grpc call"):
        q1, q2, q3 = quartiles(times[t])
        print(f"  {t:<17} {1e6 * q2:>8.0f} us  ({1e6 * q1:.0f}-{1e6 * q3:.0f})")
    dp, gc = statistics.median(times["dataplane"]), statistics.median(times["grpc call"])
    print(f"  dataplane / grpc call: {dp / gc:.2f}x the time")


CPU_PATHS = {
    "raw tcp": "the floor: sendall of a prebuilt message into recv_into, no framing or checks",
    "node": "socket plane into a node: NodeReceiver, admission, mailbox, the stage's take",
    "node tls": "the same over mutual TLS (policy and job checks on the certificate)",
    "dataplane": "socket plane into a bench inbox (no admission, no mailbox)",
    "grpc stream": "today's gRPC stream (PeerSender) into a bench Send (no mailbox)",
}
"""The CPU-per-message paths, in the order printed; ``node`` is issue 24's figure."""


def cpu_per_message(pair: Pair, messages: int, rounds: int,
                    paths: list[str] | None = None) -> list[str]:
    """User + system CPU of both processes per 64 KiB message, ``messages`` streamed then
    one flush, for each of ``paths`` (default: all of :data:`CPU_PATHS`) in interleaved
    rounds; the median round."""
    paths = [t for t in CPU_PATHS if paths is None or t in paths]
    print(f"\nCPU per 64 KiB message, {messages} streamed then one flush (user + system of "
          f"both processes, kernel ticks of 10 ms), {rounds} interleaved rounds:")
    us: dict[str, list[float]] = {t: [] for t in paths}
    rate: dict[str, list[float]] = {t: [] for t in paths}
    sides: dict[str, list[tuple[float, float]]] = {t: [] for t in paths}
    before = _load()
    for r in range(rounds):
        for t in (paths if r % 2 == 0 else paths[::-1]):
            took, used = pair.run(t, 64 * KiB, messages, stream=True)
            us[t].append(1e6 * used / messages)
            sides[t].append(pair.split)
            rate[t].append(messages * 64 * KiB / took[0] / 1e6)
    after = _load()
    out = []
    for t in paths:
        what = CPU_PATHS[t]
        q1, q2, q3 = quartiles(us[t])
        send, recv = (1e6 * statistics.median(x) / messages for x in zip(*sides[t]))
        line = (f"{t:<12} {q2:6.1f} us/message (IQR {q1:.1f}-{q3:.1f}; sender {send:.0f} + "
                f"receiver {recv:.0f}), {statistics.median(rate[t]):.0f} MB/s")
        if t == "node":
            line += f", target <= {CPU_TARGET_US:.0f} us: " + (
                "met" if q2 <= CPU_TARGET_US else f"NOT met by {q2 - CPU_TARGET_US:.1f} us")
            if us.get("raw tcp"):
                line += f" (raw tcp's floor {statistics.median(us['raw tcp']):.1f} us)"
            out.append(f"64 KiB {line} [load {after}]")
        print(f"  {line}  ({what})")
    print(f"  load average before {before}, after {after}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, help="rounds per size (default 15, quick 5)")
    ap.add_argument("--count", type=int, default=4,
                    help="transfers per transport and round at 16 MiB (more when smaller)")
    ap.add_argument("--messages", type=int, default=10_000,
                    help="64 KiB messages streamed for the CPU figure (0: none)")
    ap.add_argument("--cpu-rounds", type=int,
                    help="rounds of the CPU-per-message figure (default 5, quick 3)")
    ap.add_argument("--sizes", nargs="*", choices=list(SIZES), default=list(SIZES),
                    help="sizes to measure (none: only the CPU figure)")
    ap.add_argument("--paths", nargs="+", choices=list(CPU_PATHS), default=list(CPU_PATHS),
                    help="paths of the CPU figure (default: all)")
    ap.add_argument("--role", choices=["serve", "send"], help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role:
        from fedpipe.net import tune_malloc
        tune_malloc()
        if args.role == "serve":
            serve(args.tls_dir)
        else:
            send(json.loads(args.ports), args.tls_dir)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rounds = args.rounds or (5 if args.quick else 15)
    print(f"dataplane benchmark: {len(args.sizes)} sizes x {len(TRANSPORTS)} transports, "
          f"{rounds} interleaved rounds; {os.cpu_count()} CPUs, load average {_load()}",
          flush=True)
    verdicts: list[str] = []
    with tempfile.TemporaryDirectory() as tls_dir:
        pair = Pair(tls_dir)
        try:
            for size in args.sizes:
                before = _load()
                mbps, times, cpu = measure(pair, SIZES[size], rounds, args.count)
                verdicts += report(size, mbps, cpu, (before, _load()))
                if size == "64 KiB":
                    latency(times)
            if args.messages:
                verdicts += cpu_per_message(pair, args.messages, args.cpu_rounds or
                                            (3 if args.quick else 5), args.paths)
        finally:
            pair.close()
    print("\nTargets (issue 24), medians of per-round ratios:")
    for v in verdicts:
        print("  " + v)


if __name__ == "__main__":
    main()
