"""The relay (``fedpipe relay``): homes outbound-only nodes and splices peers to them. No torch.

Like a TURN server (RFC 8656), for fedpipe's two kinds of connection: a node
that cannot be reached dials the relay (its *home connection*, mutual TLS when
the swarm is) and says HELLO; the relay opens two listening ports for it (its
gRPC service and its socket data plane) and answers ALLOCATED with their
addresses, which the node advertises. Every connection a peer, the tracker or a
client makes to one of those ports becomes a stream over the node's home
connection (:mod:`.splice`); the node connects it to its own port. TLS runs end
to end between the dialer and the node, so the relay passes ciphertext it
cannot read.

Bounds: at most ``max_nodes`` homed nodes, ``max_streams`` streams per node
(half of them from one source host), ``window`` bytes per stream and direction
(so at most ``2 * max_streams * window`` bytes held per node); and per job, for
the streams whose dialer named their job (a TAG record), ``job_streams`` streams
and ``job_window`` bytes per direction, all its streams together (a job's next
TAG past its streams is refused naming the job). A HELLO past a
bound is refused with a REFUSED record naming it; a connection past a stream
bound takes the place of the oldest one whose dialer has sent nothing yet, else
it is closed at once; a dialer that sends nothing for ``first_byte`` seconds is
closed (:class:`~.splice.Home`). Every fedpipe dialer speaks first, so idle
connections from anyone cannot make a node unreachable.

Under TLS a node's certificate must name the node it homes as: a node cannot
take another's ports. A node that homes again under its name (it lost its home
connection and the relay has not noticed yet) replaces its old home, which is
told so with a REFUSED record: if that home was alive, another process homes
under its name (a node started twice, one certificate on two machines), and the
displaced node stops re-homing (:class:`~.home.Homing`) instead of displacing
the other in turn, without end.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading

from ...security import Role, TlsConfig
from ...security.errors import SecurityError
from ...security.tls import server_context, socket_identity
from .. import timeouts
from . import records
from .records import RecordType, RelayError
from .splice import JOB_SHARE, JOB_WINDOW, MAX_STREAMS, WINDOW, Home, read_exact, tune

log = logging.getLogger(__name__)

MAX_NODES = 64
"""Default nodes one relay homes at once."""
BACKLOG = 128
"""Connections the kernel queues on each of the relay's listening ports."""


class _Homed:
    """One homed node: its home connection and its two listening ports."""

    def __init__(self, name: str, home: Home, listeners: dict[str, socket.socket]):
        self.name, self.home, self.listeners = name, home, listeners

    def close(self, why: str) -> None:
        for lsock in self.listeners.values():
            try:  # shutdown wakes the accept() blocked on it (Linux)
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lsock.close()
        self.home.close(why)


class Relay:
    """A relay process's server.

    Args:
        host, port: where nodes home (port 0: a free one; :attr:`port` says which); the
            allocated ports listen on ``host`` too.
        advertise: the host the allocated addresses name (default: ``host``, or 127.0.0.1
            for 0.0.0.0).
        tls: this relay's certificate (role relay); homing nodes must show a node
            certificate of the same CA naming the node they home as. None: plaintext.
        max_nodes, max_streams, window, job_streams, job_window: the bounds (module
            docstring; ``job_streams`` 0: ``max_streams // JOB_SHARE``, at least 1).
        first_byte: seconds a dialer may stay silent before the relay closes it
            (:data:`~fedpipe.net.timeouts.RELAY_FIRST_BYTE`).

    Raises:
        ValueError: a certificate of another role than relay, or a bound below 1 (a node
            refuses an allocation of no streams or no window: it would home nowhere).
        OSError: the port cannot be bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 tls: TlsConfig | None = None, max_nodes: int = MAX_NODES,
                 max_streams: int = MAX_STREAMS, window: int = WINDOW,
                 job_streams: int = 0, job_window: int = JOB_WINDOW,
                 first_byte: float = timeouts.RELAY_FIRST_BYTE):
        if tls is not None and tls.identity.role is not Role.RELAY:
            raise ValueError(f"a relay needs a certificate with role relay, not "
                             f"{tls.identity} ({tls.directory})")
        if job_streams < 0:
            raise ValueError(f"a relay's job_streams must be at least 1 (0: the default), "
                             f"got {job_streams}")
        job_streams = job_streams or max(1, max_streams // JOB_SHARE)
        for what, value in (("max_nodes", max_nodes), ("max_streams", max_streams),
                            ("window", window), ("job_window", job_window)):
            if value < 1:
                raise ValueError(f"a relay's {what} must be at least 1, got {value}")
        self.host = host
        self.advertise = advertise or ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        self.max_nodes, self.max_streams, self.window = max_nodes, max_streams, window
        self.job_streams, self.job_window = job_streams, job_window
        self.first_byte = first_byte
        self._ctx = server_context(tls) if tls is not None else None
        self._auth = tls.authenticator() if tls is not None else None
        self._lock = threading.Lock()
        self._homed: dict[str, _Homed] = {}
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=BACKLOG)
        self.port = self._listener.getsockname()[1]
        self.address = f"{self.advertise}:{self.port}"
        threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True).start()

    def homed(self) -> dict[str, int]:
        """The nodes homed now, each with the streams spliced for it."""
        with self._lock:
            return {name: h.home.streams for name, h in self._homed.items()}

    def jobs(self, node: str) -> dict[str, int]:
        """Bytes the relay sent to ``node`` on each job's tagged streams, not yet credited
        back by it (at most ``job_window`` a job); {} if it is not homed here."""
        with self._lock:
            homed = self._homed.get(node)
        return homed.home.jobs() if homed is not None else {}

    def tagged(self, node: str) -> dict[str, int]:
        """Streams to ``node`` spliced now whose TAG named a job, by job ({} if it is not
        homed here): a node's data-plane links through this relay, one per peer and job."""
        with self._lock:
            homed = self._homed.get(node)
        return homed.home.tagged() if homed is not None else {}

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_home, args=(sock, peer), name="relay-home",
                             daemon=True).start()

    def _serve_home(self, sock: socket.socket, peer) -> None:
        """One node's home connection, from its handshake to its end."""
        where = f"{peer[0]}:{peer[1]}"
        try:
            sock, hello = self._handshake(sock, where)
        except (OSError, ValueError, SecurityError) as e:  # RelayError is an OSError
            log.warning("relay %s: refused a home connection from %s: %s", self.address,
                        where, e)
            sock.close()
            return
        homed = self._allocate(sock, hello, where)
        if homed is None:
            return
        homed.home.run()
        with self._lock:
            if self._homed.get(hello.node) is homed:
                del self._homed[hello.node]
        homed.close(homed.home.error)
        log.info("relay %s: node %s is no longer homed here: %s", self.address, hello.node,
                 homed.home.error or "closed")

    def _refuse(self, sock: socket.socket, why: str) -> RelayError:
        try:
            sock.sendall(records.pack_text(RecordType.REFUSED, 0, why))
        except OSError:
            pass
        return RelayError(why)

    def _handshake(self, sock: socket.socket, where: str) -> tuple[socket.socket, records.Hello]:
        """TLS (when configured), then the node's HELLO, checked.

        Raises:
            RelayError: a malformed HELLO, or a refusal (the node was told why).
            SecurityError: the node's certificate is not valid or names another node.
            OSError: the connection broke, or took longer than the relay's handshake timeout.
        """
        tune(sock)
        sock.settimeout(timeouts.RELAY_HANDSHAKE)
        if self._ctx is not None:
            sock = self._ctx.wrap_socket(sock, server_side=True)
        kind, _, arg = records.unpack(read_exact(sock, records.PREFIX_BYTES))
        if kind is not RecordType.HELLO or arg > records.MAX_BODY:
            raise self._refuse(sock, f"a home connection must start with a HELLO record of at "
                                     f"most {records.MAX_BODY} bytes, not {kind.name} ({arg})")
        try:
            hello = records.Hello.decode(read_exact(sock, arg))
        except RelayError as e:
            raise self._refuse(sock, str(e)) from None
        if self._auth is not None and isinstance(sock, ssl.SSLSocket):
            try:
                identity = socket_identity(sock, self._auth)
            except SecurityError as e:
                raise self._refuse(sock, str(e)) from None
            if identity.role is not Role.NODE or identity.name != hello.node:
                why = (f"the certificate is {identity}, which may home only as itself, "
                       f"not as node {hello.node!r}")
                self._refuse(sock, why)
                raise SecurityError(why)
        sock.settimeout(None)
        return sock, hello

    def _allocate(self, sock: socket.socket, hello: records.Hello,
                  where: str) -> _Homed | None:
        """Open the node's ports and answer ALLOCATED; None if refused (the node was told).

        The node takes its place among the homed nodes (bounded by ``max_nodes``) before it
        hears ALLOCATED, so two nodes homing at once cannot both take the last place, and a
        relay closing meanwhile closes this home too."""
        with self._lock:
            old = self._homed.pop(hello.node, None)
        if old is not None:  # the same node again (its old home connection is dead), or not
            why = (f"node {hello.node!r} homed again at relay {self.address} from {where}: "
                   f"another process runs as {hello.node!r} (a node started twice, or one "
                   f"certificate on two machines); this one must stop")
            try:
                old.home.send(records.pack_text(RecordType.REFUSED, 0, why))
            except OSError:
                pass  # dead indeed
            old.close(f"node {hello.node} homed again from {where}")
        try:
            listeners = _open_ports(self.host, hello)
        except OSError as e:
            self._refuse(sock, f"relay {self.address} cannot open ports for node "
                               f"{hello.node!r}: {e}")
            sock.close()
            return None
        addresses = {svc: f"{self.advertise}:{lsock.getsockname()[1]}"
                     for svc, lsock in listeners.items()}
        alloc = records.Allocation(relay=self.address, grpc_address=addresses["grpc"],
                                   data_address=addresses.get("data", ""), window=self.window,
                                   max_streams=self.max_streams, job_streams=self.job_streams,
                                   job_window=self.job_window)
        home = Home(sock, f"relay {self.address} for node {hello.node}", window=self.window,
                    max_streams=self.max_streams, first_byte=self.first_byte,
                    job_streams=self.job_streams, job_window=self.job_window)
        homed = _Homed(hello.node, home, listeners)
        with self._lock:
            why = ("the relay is shutting down" if self._closed else
                   f"relay {self.address} homes {self.max_nodes} nodes, its limit: node "
                   f"{hello.node!r} must home at another relay"
                   if len(self._homed) >= self.max_nodes else "")
            if not why:
                self._homed[hello.node] = homed
        try:
            if why:
                raise self._refuse(sock, why)
            home.send(alloc.encode())
        except OSError as e:  # refused (RelayError), or the node left before its allocation
            log.warning("relay %s: node %s not homed: %s", self.address, hello.node, e)
            with self._lock:
                if self._homed.get(hello.node) is homed:
                    del self._homed[hello.node]
            homed.close(str(e))
            sock.close()
            return None
        for svc, lsock in listeners.items():
            threading.Thread(target=self._accept_peers, args=(homed, svc, lsock),
                             name=f"relay-{svc}-{hello.node}", daemon=True).start()
        log.info("relay %s: node %s homed from %s: gRPC at %s, data at %s", self.address,
                 hello.node, where, alloc.grpc_address, alloc.data_address or "-")
        return homed

    def _accept_peers(self, homed: _Homed, service: str, lsock: socket.socket) -> None:
        """Splice every connection to one of a node's ports over its home connection."""
        while True:
            try:
                sock, peer = lsock.accept()
            except OSError:
                return  # the node's home ended: its ports closed
            tune(sock)
            opened = records.Open(service=service, source=f"{peer[0]}:{peer[1]}",
                                  destination=homed.name)
            try:
                homed.home.splice(sock, opened)
            except OSError as e:
                log.warning("relay %s: connection from %s to node %s refused: %s",
                            self.address, opened.source, homed.name, e)
                sock.close()

    def close(self) -> None:
        """Stop homing: close the listener and every home connection and port."""
        with self._lock:
            self._closed = True
            homed = list(self._homed.values())
            self._homed.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for h in homed:
            h.close("the relay is shutting down")


def _open_ports(host: str, hello: records.Hello) -> dict[str, socket.socket]:
    """The node's listening sockets by service: gRPC, and data if it has a data plane.

    Raises:
        OSError: a port cannot be bound (none is left open).
    """
    listeners: dict[str, socket.socket] = {}
    try:
        listeners["grpc"] = _listen(host, hello.grpc_port)
        if hello.data:
            listeners["data"] = _listen(host, hello.data_port)
    except OSError:
        for lsock in listeners.values():
            lsock.close()
        raise
    return listeners


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (a re-homing node's old port when free, else any:
    port 0, or the old one taken by another process meanwhile).

    Raises:
        OSError: no port at all can be bound.
    """
    if port:
        try:
            return socket.create_server((host, port), backlog=BACKLOG)
        except OSError as e:
            log.info("port %d of %s is taken (%s): allocating another", port, host, e)
    return socket.create_server((host, 0), backlog=BACKLOG)

