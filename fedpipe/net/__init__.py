"""Channels and servers: the one place fedpipe opens gRPC connections.

Every channel and server gets the same options: message caps large enough for
the control plane (the data plane chunks tensors, see :mod:`fedpipe.wire.frames`),
keepalives so a dead peer is noticed, and no proxy (peers are addressed directly).

Every server comes from :func:`server`, which also

- refuses to share its port (gRPC sets ``SO_REUSEPORT`` on Linux by default,
  so a second server on a held port would start and the kernel would split
  connections between the two);
- keeps threads for control calls: data-plane streams (:data:`STREAMING_METHODS`)
  may hold at most :data:`DATA_CALLS` of its :data:`SERVER_THREADS` threads,
  so a swarm's worth of open streams never stops a node answering Ping or the
  tracker taking heartbeats, and one caller at most :data:`PEER_DATA_CALLS`, so
  one caller's idle streams never shut out the others;
- serves the standard ``grpc.health.v1.Health`` service, SERVING from
  :meth:`Server.start` until :meth:`Server.stop`;
- authenticates and authorizes every call with one
  :class:`~fedpipe.security.AuthInterceptor`: given a
  :class:`~fedpipe.security.TlsConfig` it listens with mutual TLS only and
  enforces the policy table; without one the interceptor admits every call
  with no identity (plaintext, the services' loopback rules apply).

Channels get mutual TLS the same way: ``channel(address, tls=config)``.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import ipaddress
import logging
import os
import random
import re
import socket
import threading
import time
from concurrent import futures
from typing import Callable, Collection, Iterable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..proto import node_pb2, tracker_pb2
from ..security import AuthInterceptor, Role, TlsConfig, identity_of
from ..security.tls import unresolved
from . import timeouts, trackers
from .decode import ParseRequests

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", round(timeouts.KEEPALIVE_TIME * 1000)),
    ("grpc.keepalive_timeout_ms", round(timeouts.KEEPALIVE_TIMEOUT * 1000)),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # a peer's long-lived Send stream gets no data back until it ends, so the
    # client's keepalive and flow-control (BDP) pings must not count as abuse
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.initial_reconnect_backoff_ms", round(timeouts.RECONNECT_BACKOFF_MIN * 1000)),
    ("grpc.max_reconnect_backoff_ms", round(timeouts.RECONNECT_BACKOFF_MAX * 1000)),
]
_SERVER_OPTIONS = _OPTIONS + [
    # a port held by another server must be an error, not a share of its connections
    ("grpc.so_reuseport", 0),
]

SERVER_THREADS = 64
"""Threads of a server's pool: the most calls it runs at once."""
DATA_CALLS = 48
"""The most data-plane calls (:data:`STREAMING_METHODS`) a server runs at once; the other
``SERVER_THREADS - DATA_CALLS`` threads are kept for control calls. A node holds one
inbound stream per neighbouring stage and peer replica, so 48 leave room for many stages."""
PEER_DATA_CALLS = 24
"""The most data-plane calls one caller (a certificate's identity; without TLS, a
connection) may run at once on one server, so one caller's idle streams never take all
:data:`DATA_CALLS`. A node opens one Send stream per stage and peer it sends to; a client
one feed per job and replica group and up to two watches per job, for at most 8 jobs.
Callers whose certificate is not a node's get :data:`CLIENT_DATA_CALLS` instead."""
CLIENT_DATA_CALLS = 8
"""The most data-plane calls one client (or admin) certificate may run at once on one
node, so that a few clients' idle streams cannot fill a node's :data:`DATA_CALLS` (six
such clients are needed, and a client has at most 8 jobs). A client needs one call at a
time per job on a node: a job's feed sends its steps one call after another, and fetches
state or puts snapshots only outside that loop; a refused feed call is retried as
back-pressure (:mod:`fedpipe.client.job`)."""
TRACKER_CLIENT_DATA_CALLS = 16
"""The most WatchJob streams one client certificate may hold on the tracker: two per job
(its feeder's watch and one waiter's, see :data:`fedpipe.tracker.service.WATCHES_PER_JOB`)
for each of its at most 8 jobs."""


STREAMING_METHODS = frozenset(
    f"/{service.full_name}/{m.name}"
    for proto in (node_pb2, tracker_pb2) for service in proto.DESCRIPTOR.services_by_name.values()
    for m in service.methods if m.client_streaming or m.server_streaming)
"""Full gRPC method names of the streaming calls, the long-lived data-plane calls that
:func:`server` caps: a node's ``Send`` (tensors from peers and the client's feed),
``FetchState`` (a stage's weights to a client), ``PutSnapshot`` (a checkpoint snapshot to
its buddy) and ``FetchSnapshot`` (a snapshot to the node restoring a stage, where either
node has no data port: :mod:`fedpipe.net.dataplane.fetch` otherwise), and the
tracker's ``WatchJob`` (a job's events, for as long as it runs). Not the methods whose
messages are wire frames: those are :data:`fedpipe.wire.rpc.FRAME_METHODS` (the unary
``SendOne`` is one of them, and is not capped)."""

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


def channel(address: str, shaper: grpc.UnaryUnaryClientInterceptor | None = None, *,
            tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to ``HOST:PORT`` with fedpipe's options: mutual TLS with ``tls``, else plaintext.

    Several trackers' addresses (``a:7070,b:7070``) give a
    :class:`~fedpipe.net.trackers.LeaderChannel`: one channel per address, each call
    sent to whichever leads.

    ``shaper`` (a :class:`fedpipe.net.emulation.Shaper`) delays and paces
    every call, to emulate a slow link. With ``tls`` the channel trusts only
    the swarm CA, checks that the server's certificate names ``HOST``, and
    shows this process's certificate.
    """
    if trackers.several(address):
        return trackers.LeaderChannel(address, lambda one: channel(one, shaper, tls=tls))
    options = _OPTIONS + [("grpc.enable_http_proxy", 0)]
    ch = (grpc.secure_channel(address, tls.channel_credentials(), options=options)
          if tls is not None else grpc.insecure_channel(address, options=options))
    return grpc.intercept_channel(ch, shaper) if shaper is not None else ch


class DataCallLimit(grpc.ServerInterceptor):
    """Cap the data-plane calls a server runs at once, in all and per caller; refuse the excess.

    A call to one of ``methods`` takes a slot for its whole life (until the
    RPC terminates, however it ends). When all ``limit`` slots are taken, or
    its caller already holds ``per_peer`` of them, it is refused at once with
    RESOURCE_EXHAUSTED and a message that names the limit, instead of waiting
    for a thread that control calls need. The per-caller cap keeps one caller's
    idle streams from taking every slot: others are still served. Works for
    all four RPC shapes; other methods pass untouched.

    The caller is its certificate's identity (``role/name``) as the
    :class:`~fedpipe.security.AuthInterceptor`, which runs first, left it on
    the context; without TLS it is the connection (``context.peer()``, e.g.
    ``ipv4:127.0.0.1:53412``), since a whole LocalSwarm shares one address.

    Args:
        methods: full method names, e.g. ``/fedpipe.v1.Node/Send``.
        limit: slots, >= 1.
        per_peer: slots one caller may hold, >= 1; at ``limit`` or above, no
            per-caller cap.
        per_client: slots one caller with a certificate of another role than
            ``node`` (a client, an admin) may hold, >= 1; None: ``per_peer``. Nodes
            hold one long-lived stream per stage and peer (:mod:`fedpipe.node.peers`),
            a client one call per job at a time, so clients get fewer and a few of
            them cannot take every slot.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, methods: Collection[str], limit: int, per_peer: int | None = None,
                 per_client: int | None = None):
        if limit < 1:
            raise ValueError(f"a data-call limit must be >= 1, got {limit}")
        per_peer = limit if per_peer is None else per_peer
        per_client = per_peer if per_client is None else per_client
        if min(per_peer, per_client) < 1:
            raise ValueError(f"a per-peer data-call limit must be >= 1, got "
                             f"{min(per_peer, per_client)}")
        self.methods, self.limit, self.per_peer = frozenset(methods), limit, per_peer
        self.per_client = per_client
        self._lock = threading.Lock()
        self._total = 0
        self._held: dict[str, int] = {}  # caller -> slots held

    def held(self, peer: str) -> int:
        """Slots ``peer`` (as :meth:`peer_of` names it) holds now."""
        with self._lock:
            return self._held.get(peer, 0)

    @staticmethod
    def peer_of(context: grpc.ServicerContext) -> str:
        """Who a call counts against: the certificate's ``fedpipe://role/name``, else the
        connection."""
        identity = identity_of(context)
        return identity.uri if identity is not None else context.peer()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.methods:
            return handler
        for shape in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, shape)
            if behavior is not None:
                return handler._replace(**{shape: self._guard(method, behavior)})
        return handler

    def _cap(self, context: grpc.ServicerContext) -> tuple[int, str]:
        """The slots the call's caller may hold, and the constant that sets it."""
        identity = identity_of(context)
        if identity is not None and identity.role != Role.NODE:
            return self.per_client, "fedpipe.net.CLIENT_DATA_CALLS"
        return self.per_peer, "fedpipe.net.PEER_DATA_CALLS"

    def _take(self, method: str, peer: str, cap: tuple[int, str]) -> str | None:
        """Take a slot for ``peer``, who may hold ``cap[0]``; None, or why it is refused."""
        most, named = cap
        with self._lock:
            mine = self._held.get(peer, 0)
            if most < self.limit and mine >= most:
                return (f"{method} refused: {peer} already has {mine} data-plane calls open "
                        f"on this server, the most one peer may have at once "
                        f"({most}, {named}); try again when one ends")
            if self._total >= self.limit:
                return (f"{method} refused: this server already runs {self.limit} "
                        f"data-plane calls, the most it takes at once (so control "
                        f"calls keep threads; fedpipe.net.DATA_CALLS); try again "
                        f"when one ends")
            self._total += 1
            self._held[peer] = mine + 1
            return None

    def _give(self, peer: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._held[peer] - 1
            if left:
                self._held[peer] = left
            else:
                del self._held[peer]

    def _guard(self, method: str, behavior: Callable) -> Callable:
        def guarded(request, context):
            peer = self.peer_of(context)
            refused = self._take(method, peer, self._cap(context))
            if refused is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            # released when the RPC terminates, also if it is cancelled before
            # the behaviour runs or returns a stream that is never drained
            release = functools.partial(self._give, peer)
            if not context.add_callback(release):
                release()
            return behavior(request, context)
        return guarded


class Server(grpc.Server):
    """A gRPC server (from :func:`server`) that reports its readiness over ``grpc.health.v1``.

    Each service added to it is NOT_SERVING until :meth:`start`, SERVING after,
    and NOT_SERVING again from :meth:`stop` on; so is the server as a whole
    (the service name ``""``). Everything else is the wrapped ``grpc.Server``'s.
    """

    def __init__(self, inner: grpc.Server, tls: TlsConfig | None = None):
        self._inner = inner
        self.tls = tls
        """The server's TLS configuration; :func:`bind` listens with it (None: plaintext)."""
        self.health = health.HealthServicer()
        self._services: set[str] = {""}
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, inner)

    def _declare(self, name: str) -> None:
        self._services.add(name)
        self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable) -> None:
        for h in generic_rpc_handlers:
            name = getattr(h, "service_name", lambda: None)()
            if name:
                self._declare(name)
        self._inner.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self._declare(service_name)
        self._inner.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._inner.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._inner.add_secure_port(address, server_credentials)

    def start(self) -> None:
        self._inner.start()
        for name in self._services:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None) -> threading.Event:
        self.health.enter_graceful_shutdown()  # NOT_SERVING, and it stays so
        return self._inner.stop(grace)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._inner.wait_for_termination(timeout)


def server(max_workers: int = SERVER_THREADS, *,
           data_methods: Collection[str] = STREAMING_METHODS,
           data_calls: int | None = None, peer_calls: int = PEER_DATA_CALLS,
           client_calls: int = CLIENT_DATA_CALLS, tls: TlsConfig | None = None) -> Server:
    """A thread-pool gRPC server with fedpipe's options; add servicers, then :func:`bind`.

    Every request is parsed by :class:`~fedpipe.net.decode.ParseRequests` (one that
    does not parse is refused with INVALID_ARGUMENT), then every call passes an
    :class:`~fedpipe.security.AuthInterceptor` (so a refused caller never takes a
    data-call slot), then the :class:`DataCallLimit`.

    Args:
        tls: this process's certificate: :func:`bind` listens with mutual TLS and
            the policy table is enforced. None: plaintext, every call admitted
            with no identity.
        max_workers: threads, the most calls it runs at once.
        data_methods: full names of the data-plane methods (long-lived streams), capped.
        data_calls: the most ``data_methods`` calls it runs at once (see
            :class:`DataCallLimit`); the other threads are kept for control calls.
            Default: :data:`DATA_CALLS` of :data:`SERVER_THREADS`, in proportion.
        peer_calls: the most ``data_methods`` calls one caller runs at once (see
            :class:`DataCallLimit`; at ``data_calls`` or above, no per-caller cap).
        client_calls: the same for a caller whose certificate is not a node's.

    Raises:
        ValueError: ``data_calls`` leaves no thread for control calls.
    """
    if data_calls is None:
        data_calls = max(1, max_workers * DATA_CALLS // SERVER_THREADS)
    if not 1 <= data_calls < max_workers:
        raise ValueError(f"data_calls must be in [1, max_workers) = [1, {max_workers}), "
                         f"got {data_calls}: control calls need threads of their own")
    auth = AuthInterceptor(tls.authenticator() if tls is not None else None)
    inner = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                        interceptors=[ParseRequests(), auth,
                                      DataCallLimit(data_methods, data_calls, peer_calls,
                                                    client_calls)],
                        options=_SERVER_OPTIONS)
    return Server(inner, tls)


def bind(srv: grpc.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (port 0 takes a free one) and return the real port.

    A :class:`Server` made with ``tls`` listens with mutual TLS (callers must
    show a certificate of the swarm CA), any other in plaintext.

    Raises:
        OSError: the address cannot be bound, e.g. another process listens on
            the port; the message says why.
    """
    tls = getattr(srv, "tls", None)
    try:
        real = (srv.add_secure_port(f"{host}:{port}", tls.server_credentials())
                if tls is not None else srv.add_insecure_port(f"{host}:{port}"))
    except RuntimeError:  # grpc >= 1.5x raises where older versions returned 0
        real = 0
    if real == 0:
        raise OSError(f"cannot listen on {host}:{port}: {_why_unbindable(host, port)}")
    return real


def _why_unbindable(host: str, port: int) -> str:
    """The operating system's reason ``host:port`` cannot be bound (gRPC does not say)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve {host!r} ({e})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"port {port} is in use by another process ({e.strerror})"
                return e.strerror or str(e)
    return "gRPC could not bind it"


def serving(ch: grpc.Channel, service: str = "", timeout: float = timeouts.HEALTH_RPC) -> bool:
    """Whether the server behind ``ch`` reports ``service`` SERVING over ``grpc.health.v1``.

    ``service`` is a full service name such as ``fedpipe.v1.Tracker``, or ``""``
    for the server as a whole. False when it is not serving, does not know the
    service, or does not answer within ``timeout`` seconds.
    """
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


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


def is_loopback_host(host: str) -> bool:
    """Whether a listening address (``127.0.0.1``, ``::1``, ``localhost``) is this machine only.

    ``0.0.0.0``, ``::`` and ``""`` (every interface) are not loopback.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext(host: str, tls: TlsConfig | None, insecure: bool, what: str) -> None:
    """Refuse to serve without TLS on an address others can reach, unless told ``insecure``.

    Without TLS anyone who reaches the port may call every RPC, so a server on a
    non-loopback address needs ``--insecure``, and then logs a warning at each
    start.

    Raises:
        ValueError: no TLS, a non-loopback ``host`` and not ``insecure``; the message
            says what to give.
    """
    if tls is not None or is_loopback_host(host):
        return
    if not insecure:
        raise ValueError(f"{what} would serve on {host or 'every interface'} without TLS, "
                         f"where anyone who reaches it may call every RPC: give --tls-dir "
                         f"(see `fedpipe certs`), listen on 127.0.0.1, or pass --insecure")
    log.warning("%s serves on %s WITHOUT TLS (--insecure): anyone who reaches it may call "
                "every RPC", what, host or "every interface")


_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_CONNECT_DETAILS = re.compile("^" + re.escape(trackers.UNSENT) + r"; last error: "
                              r"(?:[A-Z_]+: )?(?:(?:ipv4|ipv6|unix):\S+?: )?")
"""gRPC core's wording of a connection that could not be made, up to its own reason:
``failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: `` before
``Failed to connect to remote host: Connection refused``."""


def reason(error: grpc.RpcError) -> str:
    """A failed call's reason in one short line for a log or the CLI: its status code and
    the first line of its details, without gRPC core's preamble to a failed connection
    (``UNAVAILABLE: Failed to connect to remote host: Connection refused``), and a host its
    resolver could not resolve in a line of fedpipe's (:func:`~fedpipe.security.tls.unresolved`)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if code is None or details is None:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    first = ((details() or "").strip().splitlines() or [""])[0]
    first = unresolved(first) or _CONNECT_DETAILS.sub("", first)
    return f"{code().name}: {first}" if first else code().name


def retry(call: Callable[[], T], what: str, *, attempts: int | None = None,
          first_delay: float = 0.2, max_delay: float = 10.0,
          stop: Callable[[], bool] = lambda: False,
          codes: Collection[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE,
                                                grpc.StatusCode.DEADLINE_EXCEEDED),
          on_retry: Callable[[grpc.RpcError], None] | None = None, peer: str = "") -> T:
    """Call ``call()`` until it succeeds, with exponential backoff and jitter.

    Retries on ``grpc.RpcError`` with a status in ``codes`` (UNAVAILABLE or
    DEADLINE_EXCEEDED unless told), logging each failure with ``what`` and its short
    :func:`reason`: ``"registering failed (...); retrying in 0.4 s"``, or, with ``peer``
    and a peer that did not answer (UNAVAILABLE, DEADLINE_EXCEEDED), ``"tracker
    10.0.0.1:7070 is unreachable (UNAVAILABLE: Failed to connect to remote host:
    Connection refused); registering again in 0.4 s"``. Other errors propagate.

    Args:
        what: what the call does, for the log line ("registering").
        peer: who is called ("tracker HOST:PORT"), named when it cannot be reached
            ("": say that ``what`` failed).
        attempts: give up after this many calls (None: never).
        first_delay, max_delay: backoff bounds, seconds.
        stop: checked between attempts; when true the last error is raised.
        on_retry: called with each failure that is retried, instead of logging a line
            for it (a caller that says once that its peer is unreachable, and once
            that it is back: :class:`fedpipe.client.reach.TrackerReach`).

    Raises:
        grpc.RpcError: the last error, once attempts are spent or ``stop()``.
    """
    delay, n = first_delay, 0
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            n += 1
            if e.code() not in codes:
                raise
            if (attempts is not None and n >= attempts) or stop():
                raise
            if on_retry is not None:
                on_retry(e)
            else:
                if peer and e.code() in _UNREACHABLE:
                    log.warning("%s is unreachable (%s); %s again in %.1f s", peer,
                                reason(e), what, delay)
                else:
                    log.warning("%s failed (%s); retrying in %.1f s", what, reason(e), delay)
            time.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(max_delay, delay * 2)
