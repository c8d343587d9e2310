"""Timing a link to a peer for the tracker (MeasureLinks): one-way latency and bandwidth,
over the path the data takes: the socket data plane's link where the peer offers a data
port (:func:`measure_socket_link`), else gRPC's ``Send`` (:func:`measure_link`)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import grpc
import torch

from ..net import dataplane, timeouts
from ..net.emulation import Pacer
from ..proto import node_pb2
from ..spec import Kind
from ..wire import frames, rpc

MAX_PROBE_BYTES = 64 * 2**20
"""Largest link-measurement probe a node sends or accepts, bytes."""
PROBE_PINGS, MAX_PINGS = 5, 100
"""Pings per link measurement: by default, and the most a request may ask for."""
PROBE_BYTES = 4 * 2**20
"""Largest bandwidth probe of a link measurement by default, bytes."""
PROBE_SECONDS, MAX_PROBE_SECONDS = 0.5, 10.0
"""How long a bandwidth probe is sized to take, seconds: by default, and at most."""


def measure_link(channel: grpc.Channel, *, pings: int = PROBE_PINGS,
                 max_bytes: int = PROBE_BYTES, seconds: float = PROBE_SECONDS
                 ) -> tuple[float, float]:
    """Latency (one way, s) and bandwidth (bytes/s) to the node ``channel`` reaches, over
    gRPC (a peer without a data port; :func:`measure_socket_link` otherwise).

    Latency is half the median round trip of ``pings`` small Ping calls.
    Bandwidth is timed over the data path itself (Send of a probe tensor,
    chunked and decoded like an activation): a 256 KiB probe gives a first
    estimate, then a probe sized to take about ``seconds`` (at most
    ``max_bytes``) gives the figure, net of one round trip.

    Raises:
        grpc.RpcError: the peer is unreachable, or a call ran past
            :data:`~fedpipe.net.timeouts.PING_RPC` / :data:`~fedpipe.net.timeouts.PROBE_SEND_RPC`.
    """
    stub = rpc.NodeStub(channel)
    env = node_pb2.Envelope(kind=Kind.PROBE.value)

    def ping() -> None:
        stub.Ping(node_pb2.PingRequest(), timeout=timeouts.PING_RPC)

    def probe(nbytes: int) -> float:
        probe_frames = list(frames.encode_frames(torch.zeros(nbytes, dtype=torch.uint8),
                                                 envelope=env))
        t0 = time.perf_counter()
        rpc.send(stub, probe_frames, timeout=timeouts.PROBE_SEND_RPC)
        return time.perf_counter() - t0

    return _measure(ping, probe, pings, max_bytes, seconds)


def measure_socket_link(link: dataplane.Link, pacer: Pacer | None = None, *,
                        pings: int = PROBE_PINGS, max_bytes: int = PROBE_BYTES,
                        seconds: float = PROBE_SECONDS) -> tuple[float, float]:
    """:func:`measure_link` over the socket data plane's ``link`` to a peer, the path its
    tensors take (through ``pacer``, the emulated link to it, as :class:`SocketSender`
    goes): a ping is a one-byte probe tensor sent and acknowledged, a bandwidth probe
    one of its size.

    Raises:
        LinkFailed: the link failed, or a probe was not acknowledged within
            :data:`~fedpipe.net.timeouts.PROBE_SEND_RPC`.
        PeerRefused: the peer refused a probe.
    """
    env = node_pb2.Envelope(kind=Kind.PROBE.value)

    def probe(nbytes: int) -> float:
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        if pacer is not None:
            time.sleep(max(0.0, pacer.due() - time.monotonic()))
            pacer.take(nbytes)
        link.send(tensor, envelope=env)
        link.flush(timeout=timeouts.PROBE_SEND_RPC, owner="")  # a probe is no job's
        if pacer is not None:
            pacer.back()
        return time.perf_counter() - t0

    return _measure(lambda: probe(1), probe, pings, max_bytes, seconds)


def _measure(ping: Callable[[], object], probe: Callable[[int], float], pings: int,
             max_bytes: int, seconds: float) -> tuple[float, float]:
    """``(latency, bandwidth)`` from ``pings`` timed ``ping()`` round trips and two
    ``probe(nbytes)`` transfers (each returns its seconds): see :func:`measure_link`."""
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        ping()
        rtts.append(time.perf_counter() - t0)
    rtt = statistics.median(rtts)

    def bandwidth_probe(nbytes: int) -> float:
        return max(probe(nbytes) - rtt, 1e-6)

    first = 256 * 1024
    estimate = first / bandwidth_probe(first)
    size = int(min(max_bytes, max(first, estimate * seconds)))
    return rtt / 2, size / bandwidth_probe(size)
