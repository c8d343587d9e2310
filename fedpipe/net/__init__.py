"""Channels and servers: the one place fedpipe opens gRPC connections.

Every channel and server gets the same options: message caps large enough for
the control plane (the data plane chunks tensors, see :mod:`fedpipe.wire.frames`),
keepalives so a dead peer is noticed, and no proxy (peers are addressed directly).
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import random
import time
from concurrent import futures
from typing import Callable, TypeVar

import grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # a peer's long-lived Send stream gets no data back until it ends, so the
    # client's keepalive and flow-control (BDP) pings must not count as abuse
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    # a restarted peer is found again within 2 s, not after gRPC's default 2 min backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

T = TypeVar("T")


def tune_malloc() -> bool:
    """Keep glibc from returning large freed buffers to the kernel between transfers.

    Each gRPC message of a tensor stream is a fresh buffer of up to ~1 MiB;
    glibc maps and unmaps such buffers, and the first touch of every fresh
    4 KiB page costs about 2 µs. Raising the mmap threshold (32 MiB, the
    most glibc allows) and the trim threshold (256 MiB) and using one malloc
    arena made fedpipe's 1 MiB and 16 MiB transfers 1.8-3.6× faster here
    (``benchmarks/wire.py``); raising the mmap threshold alone made them
    slower, since it also fixes the trim threshold low. A process may keep up
    to 256 MiB of freed heap. Skipped when the user set any ``MALLOC_*``
    variable or libc is not glibc; returns whether the settings were applied.
    """
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        settings = ((-1, 256 * 2**20), (-3, 32 * 2**20), (-8, 1))  # TRIM, MMAP, ARENA_MAX
        return all(libc.mallopt(k, v) == 1 for k, v in settings)
    except (OSError, AttributeError):
        return False


def channel(address: str, shaper: grpc.UnaryUnaryClientInterceptor | None = None) -> grpc.Channel:
    """An insecure channel to ``HOST:PORT`` with fedpipe's options.

    ``shaper`` (a :class:`fedpipe.net.emulation.Shaper`) delays and paces
    every call, to emulate a slow link.
    """
    ch = grpc.insecure_channel(address, options=_OPTIONS + [("grpc.enable_http_proxy", 0)])
    return grpc.intercept_channel(ch, shaper) if shaper is not None else ch


def server(max_workers: int = 64) -> grpc.Server:
    """A thread-pool gRPC server with fedpipe's options; add servicers, then :func:`bind`."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)


def bind(srv: grpc.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (port 0 takes a free one) and return the real port.

    Raises:
        OSError: the address cannot be bound.
    """
    real = srv.add_insecure_port(f"{host}:{port}")
    if real == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return real


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC ``context.peer()`` string (``ipv4:127.0.0.1:5000``) is a loopback address."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def retry(call: Callable[[], T], what: str, *, attempts: int | None = None,
          first_delay: float = 0.2, max_delay: float = 10.0,
          stop: Callable[[], bool] = lambda: False) -> T:
    """Call ``call()`` until it succeeds, with exponential backoff and jitter.

    Retries on ``grpc.RpcError`` with status UNAVAILABLE or DEADLINE_EXCEEDED,
    logging each failure with ``what`` and the reason. Other errors propagate.

    Args:
        attempts: give up after this many calls (None: never).
        first_delay, max_delay: backoff bounds, seconds.
        stop: checked between attempts; when true the last error is raised.

    Raises:
        grpc.RpcError: the last error, once attempts are spent or ``stop()``.
    """
    delay, n = first_delay, 0
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            n += 1
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            if (attempts is not None and n >= attempts) or stop():
                raise
            log.warning("%s failed (%s: %s); retrying in %.1f s", what, e.code().name,
                        e.details(), delay)
            time.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(max_delay, delay * 2)
