"""A node's side of a relay: home at one, splice its streams to the node's own ports. No torch.

``fedpipe node --relay HOST:PORT[,HOST:PORT]`` makes a :class:`Homing`: the
node dials its first relay that answers, says HELLO and gets an
:class:`~.records.Allocation` (the relay's addresses for its gRPC service and
data port), which it advertises to the tracker instead of its own. Each stream
the relay opens becomes a loopback connection to the node's own port
(:mod:`.splice`), so its servers run unchanged; TLS runs end to end through it.

Losing the relay: the node keeps trying the same relay for
:data:`~fedpipe.net.timeouts.RELAY_FAILOVER` seconds, asking for its old ports
again (a restarted relay gives them back if they are free, so the node's
addresses, the plans naming them and the peers' links stay valid: they redial
and resume), then the next relay of its list, and so on round the list, with
backoff, until one homes it. When the new allocation's addresses differ,
``on_moved`` tells the node, which registers them with the tracker.

Displaced: a relay that homes another process under this node's name tells this
one so (a REFUSED record on its live home connection). Homing again would
displace the other in turn, without end, so the node stops re-homing and
``on_displaced`` tells it why (the daemon exits with that error).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Sequence

from ...security import Role, TlsConfig
from ...security.errors import SecurityError
from ...security.tls import client_context, socket_identity
from .. import address, timeouts
from ..dataplane.caps import Sources
from . import records
from .records import Allocation, RecordType, RelayError, RelayRefused
from .splice import Home, read_exact, tune

log = logging.getLogger(__name__)


def split_relays(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT]`` as a list.

    Raises:
        ValueError: an empty list, or an entry that is not ``HOST:PORT``
            (:func:`fedpipe.net.address.problem`; a URL's scheme or path included: the
            tracker would refuse it).
    """
    relays = [r.strip() for r in text.split(",") if r.strip()]
    if not relays:
        raise ValueError(f"--relay {text!r} names no relay (HOST:PORT[,HOST:PORT])")
    for r in relays:
        why = address.problem(r)
        if why is not None:
            raise ValueError(f"relay {r!r}: {why}")
    return relays


def dial(relay: str, hello: records.Hello, tls: TlsConfig | None) -> tuple[socket.socket,
                                                                             Allocation]:
    """Home at ``relay``: connect (TLS when ``tls``), say ``hello``, read the allocation.

    Raises:
        RelayRefused: the relay refused (its reason), or under TLS its certificate is not a
            relay's.
        RelayError: it answered with something else than ALLOCATED (not a relay?).
        OSError: it could not be reached within :data:`~fedpipe.net.timeouts.RELAY_HANDSHAKE`.
    """
    host, _, port = relay.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeouts.RELAY_HANDSHAKE)
    try:
        tune(sock)
        if tls is not None:
            secure = client_context(tls).wrap_socket(sock, server_hostname=host)
            sock = secure
            try:
                identity = socket_identity(secure, tls.authenticator())
            except SecurityError as e:
                raise RelayRefused(f"relay {relay}: {e}") from None
            if identity.role is not Role.RELAY:
                raise RelayRefused(f"{relay} is {identity}, not a relay: a node homes only at "
                                   "a certificate of role relay")
        sock.sendall(hello.encode())
        kind, _, arg = records.unpack(read_exact(sock, records.PREFIX_BYTES))
        if kind is RecordType.REFUSED:
            why = read_exact(sock, min(arg, records.MAX_BODY)).decode(errors="replace")
            raise RelayRefused(f"relay {relay} refused node {hello.node!r}: {why}")
        if kind is not RecordType.ALLOCATED or arg > records.MAX_BODY:
            raise RelayError(f"relay {relay} answered HELLO with {kind.name}, not ALLOCATED")
        alloc = Allocation.decode(read_exact(sock, arg))
        sock.settimeout(None)
        return sock, alloc
    except BaseException:
        sock.close()
        raise


class Homing:
    """A node's tie to its relays (module docstring).

    Args:
        relays: relay addresses, ``HOST:PORT``, in order of preference.
        node: the node's name (under TLS its certificate's).
        grpc_port: the node's own gRPC port, which streams to its relayed gRPC address reach.
        data_port: its socket data plane's port (None: it has none; the relay opens no data
            port for it).
        local_host: where those ports listen (127.0.0.1 for a node bound to 0.0.0.0).
        tls: the node's certificate: the home connection is mutual TLS (and the relay's
            certificate must be of role relay).
        on_moved: called (on a thread of its own) with the new allocation when a re-homing
            changed the node's addresses.
        on_displaced: called (on the homing thread) with the relay's words when it homed
            another process under this node's name; this node then homes no more.
        sources: where each stream's local connection is noted with its dialer's host and
            the job its TAG named (the node's data-plane listener counts its caps by the
            host, and keys the link by the job: :class:`Sources`).
    """

    def __init__(self, relays: Sequence[str], node: str, grpc_port: int,
                 data_port: int | None, *, local_host: str = "127.0.0.1",
                 tls: TlsConfig | None = None,
                 on_moved: Callable[[Allocation], None] | None = None,
                 on_displaced: Callable[[str], None] | None = None,
                 sources: Sources | None = None):
        if not relays:
            raise ValueError("a node homes at one relay at least")
        self.relays, self.node, self.tls = list(relays), node, tls
        self.local_host = "127.0.0.1" if local_host in ("0.0.0.0", "", "::") else local_host
        self.ports = {"grpc": grpc_port, "data": data_port}
        self.on_moved, self.on_displaced = on_moved, on_displaced
        self.sources = sources
        self.displaced = ""
        """Why a relay displaced this node ("" if none did): it homes no more."""
        self.allocation: Allocation | None = None
        """The current allocation (None before the first homing)."""
        self.relay = ""
        """The relay this node is homed at, as it is in :attr:`relays`."""
        self.homings = 0
        """Times this node homed (1 after the first; more after each re-homing)."""
        self._home: Home | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _hello(self, relay: str) -> records.Hello:
        """A HELLO asking for the ports this node had, when it homes at the same relay again."""
        old = self.allocation if relay == self.relay else None
        return records.Hello(node=self.node,
                             grpc_port=_port(old.grpc_address) if old else 0,
                             data_port=_port(old.data_address) if old else 0,
                             data=int(self.ports["data"] is not None))

    def _connect(self, opened: records.Open) -> socket.socket:
        port = self.ports[opened.service]
        if port is None:
            raise ConnectionRefusedError(f"node {self.node} has no {opened.service} port")
        family = socket.AF_INET6 if ":" in self.local_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeouts.RELAY_HANDSHAKE)
            sock.bind((self.local_host, 0))
            local = sock.getsockname()[:2]
            if self.sources is not None:  # before the connect: the accept may come first
                self.sources.note(local, opened.source.rpartition(":")[0] or opened.source,
                                  opened.job)
            try:
                sock.connect((self.local_host, port))
            except BaseException:
                if self.sources is not None:
                    self.sources.drop(local)
                raise
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _try(self, relay: str) -> None:
        """Home at ``relay`` once. Raises as :func:`dial`."""
        sock, alloc = dial(relay, self._hello(relay), self.tls)
        moved = self.allocation is not None and (
            (alloc.grpc_address, alloc.data_address)
            != (self.allocation.grpc_address, self.allocation.data_address))
        self._home = Home(sock, f"node {self.node} at relay {relay}", window=alloc.window,
                          max_streams=alloc.max_streams, connect=self._connect,
                          job_streams=alloc.job_streams, job_window=alloc.job_window)
        self.allocation, self.relay = alloc, relay
        self.homings += 1
        log.info("node %s homed at relay %s: gRPC at %s, data at %s", self.node, relay,
                 alloc.grpc_address, alloc.data_address or "-")
        if moved and self.on_moved is not None:
            # on a thread of its own: telling the tracker makes it dial the new addresses,
            # whose streams this thread serves once it runs the new home connection
            threading.Thread(target=self.on_moved, args=(alloc,), name="relay-moved",
                             daemon=True).start()

    def home(self, timeout: float | None = None) -> Allocation:
        """Home at the first relay of the list that answers, retrying the list with backoff;
        then keep the home connection (and re-home when it is lost) in a thread.

        Args:
            timeout: give up after this many seconds (None: keep trying until :meth:`close`).

        Raises:
            RelayRefused: every relay refused this node (their reasons, joined).
            TimeoutError: no relay homed it within ``timeout`` (the last errors).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._round(self.relays, deadline, refuse=True)
        self._thread = threading.Thread(target=self._keep, name="relay-home", daemon=True)
        self._thread.start()
        assert self.allocation is not None
        return self.allocation

    def _round(self, order: Sequence[str], deadline: float | None, *, refuse: bool) -> bool:
        """Try ``order`` round and round with backoff until one homes this node (True), the
        deadline passes, or :meth:`close` (False).

        Raises:
            RelayRefused: ``refuse`` and every relay refused in one round.
            TimeoutError: the deadline passed (``refuse`` only; else False).
        """
        delay = timeouts.RECONNECT_BACKOFF_MIN
        while not self._stop.is_set():
            errors: list[OSError] = []
            for relay in order:
                try:
                    self._try(relay)
                    return True
                except RelayRefused as e:
                    errors.append(e)
                except OSError as e:
                    errors.append(OSError(f"relay {relay}: {e}"))
            if refuse and all(isinstance(e, RelayRefused) for e in errors):
                raise RelayRefused("; ".join(map(str, errors)))
            if deadline is not None and time.monotonic() + delay > deadline:
                if refuse:
                    raise TimeoutError(f"node {self.node} could not home at any relay: "
                                       + "; ".join(map(str, errors)))
                return False
            log.warning("node %s could not home (%s); again in %.1f s", self.node,
                        "; ".join(map(str, errors)), delay)
            self._stop.wait(delay)
            delay = min(2 * delay, timeouts.RECONNECT_BACKOFF_MAX)
        return False

    def _keep(self) -> None:
        """Run the home connection; when it is lost, re-home (module docstring)."""
        while not self._stop.is_set():
            home = self._home
            assert home is not None
            home.run()
            if self._stop.is_set():
                return
            if home.displaced:
                self.displaced = f"relay {self.relay} displaced node {self.node}: " \
                                 f"{home.displaced}"
                log.error("%s", self.displaced)
                if self.on_displaced is not None:
                    self.on_displaced(self.displaced)
                return
            log.warning("node %s lost its relay %s (%s): homing again", self.node, self.relay,
                        home.error)
            lost = self.relay
            if self._round([lost], time.monotonic() + timeouts.RELAY_FAILOVER, refuse=False):
                continue
            i = self.relays.index(lost) if lost in self.relays else -1
            order = self.relays[i + 1:] + self.relays[:i + 1]
            self._round(order, None, refuse=False)

    def close(self) -> None:
        """Leave the relay: end the home connection and stop re-homing."""
        self._stop.set()
        if self._home is not None:
            self._home.close("the node is shutting down")
        if self._thread is not None:
            self._thread.join(timeouts.THREAD_JOIN)


def _port(address: str) -> int:
    return int(address.rpartition(":")[2]) if address else 0

