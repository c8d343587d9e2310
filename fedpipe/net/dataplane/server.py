"""A process's end of the socket data plane: a listener, and one :class:`Link` per peer.

:class:`DataPlane` listens on its data port, accepts connections from peers
(each starts with the peer's preface; with TLS, after a mutual TLS handshake
whose certificate names the peer), and dials peers on demand
(:meth:`DataPlane.link`). One link per peer carries tensors both ways: a link
dialed to a peer is reused for that peer, and so is one the peer dialed here.
If both sides dial each other at the same moment, each has two links; both
work, and the one the peer dialed is preferred from then on.

Except through a relay: a link dialed to a peer's relayed address (the peer is
outbound-only, behind NAT) for one job is that job's alone, one per (peer, job).
Its dialer says the job to the relay first (a ``TAG``: :func:`fedpipe.net.relay.dial_job`),
so the relay bounds it by the job's share of the peer; the relay's ``OPEN`` tells
the peer the job (:class:`~.caps.Sources`), and both ends key the link by
``(peer, job)`` and refuse any frame of another job on it (:attr:`~.ends.Peer.job`).

The dialing side owns reconnection: its reader thread redials a broken
connection with backoff; the accepting side waits for it
(:attr:`Timeouts.resume`), then fails the link.

Keepalive is the kernel's (``SO_KEEPALIVE`` with fedpipe's keepalive times,
and ``TCP_USER_TIMEOUT``): a dead peer's connection errors without a Python
thread waking for it, and its link fails unless the peer comes back.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import ssl
import threading
import time
from typing import Callable

from ...security import Authenticator, TlsConfig
from ...security.tls import client_context, server_context, socket_identity
from ...security.errors import SecurityError
from ...wire.format import WireError
from .. import timeouts as net_timeouts
from ..relay.records import Tag
from ..relay.tagged import dial_job
from . import records
from .caps import MAX_CALLER_CONNECTIONS, MAX_CONNECTIONS, Caps, Sources
from .connection import Closed, Connection
from .credits import LinkFailed
from .ends import LinkEvents, Peer, Receiver
from .fetch import Server
from .link import DEFAULT_TIMEOUTS, WINDOW_BYTES, WINDOW_MESSAGES, Link, Timeouts
from .records import Code, Preface, RecordType

log = logging.getLogger(__name__)

BACKLOG = 128
"""Connections the kernel queues before :class:`DataPlane` accepts them."""


def _tune(sock: socket.socket) -> None:
    """Options every data connection gets."""
    # records are written whole; Nagle would hold a small one back for an ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux: the kernel probes an idle peer
        idle = max(1, round(net_timeouts.KEEPALIVE_TIME))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                        max(1, round(net_timeouts.KEEPALIVE_TIMEOUT / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # data unacknowledged this long: the peer is gone
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                        round(1000 * (net_timeouts.KEEPALIVE_TIME
                                      + net_timeouts.KEEPALIVE_TIMEOUT)))


def read_preface(conn: Connection) -> Preface:
    """The peer's preface, the first record of a connection.

    Raises:
        LinkFailed: the peer answered with GOAWAY (it refused this side).
        WireError: anything else first, or a malformed preface.
    """
    kind, arg = records.unpack(conn.read_exact(records.PREFIX_BYTES))
    if kind is RecordType.GOAWAY:
        code, size = records.TEXT.unpack(conn.read_exact(records.TEXT.size))
        text = conn.read_exact(min(size, records.MAX_TEXT_BYTES)).decode(errors="replace")
        raise LinkFailed(f"the peer refused the connection: {records.code_of(code).name}: "
                         f"{text}")
    if kind is not RecordType.PREFACE:
        raise WireError(f"a connection must start with a PREFACE record, not {kind.name}")
    if arg > records.MAX_PREFACE_BYTES:
        raise WireError(f"preface of {arg} bytes exceeds {records.MAX_PREFACE_BYTES}")
    return Preface.decode(conn.read_exact(arg))


CLIENT_SEP = "#"
"""Between a client's certificate name and the suffix that tells its processes apart
(certificate names never hold it: :mod:`fedpipe.security.certs`)."""


def client_name(base: str) -> str:
    """A name for one client process's data plane: ``base`` (its certificate's name, with
    TLS) and a random suffix, so two clients of one user get a link each at a node."""
    return f"{base}{CLIENT_SEP}{secrets.token_hex(6)}"


def peer_of(sock: socket.socket, theirs: Preface, auth: Authenticator | None) -> Peer:
    """Who is at the other end: with TLS the certificate's identity, which the preface's
    name and role must match; without it the preface's word.

    A client's preface may name it ``NAME#SUFFIX`` (:func:`client_name`): one
    certificate's holder may run several clients at once, and each needs a link of its
    own; ``NAME`` must still be the certificate's. The peer's name is the preface's,
    suffix and all, as without TLS (the accepting side keys its link by it): were it the
    certificate's, two clients of one certificate would share one link at a node, each
    connection replacing the other's and resetting where its tensors resume, so a
    tensor delivered and not yet acknowledged would be delivered again.

    Raises:
        SecurityError: no valid certificate, revoked, or a preface naming someone else.
    """
    if auth is None or not isinstance(sock, ssl.SSLSocket):
        return Peer(theirs.name, theirs.role)
    identity = socket_identity(sock, auth)
    name = theirs.name.partition(CLIENT_SEP)[0] if theirs.role == "client" else theirs.name
    if identity.name != name or identity.role.value != theirs.role:
        raise SecurityError(f"preface says {theirs.role} {theirs.name!r} but the certificate "
                            f"is {identity}")
    return Peer(theirs.name, identity.role.value, identity)


class _Capped(Exception):
    """A connection past a cap of :class:`~.caps.Caps` (the message names it)."""


def _refusal_of(error: BaseException) -> tuple[Code, str]:
    """The GOAWAY code and text for a connection refused with ``error``."""
    if isinstance(error, _Capped):
        return Code.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, SecurityError):
        return Code(error.code.value[0]), str(error)
    return Code.INVALID_ARGUMENT, str(error) or type(error).__name__


class _Deadline:
    """Ends a blocking TLS handshake on ``sock`` after ``seconds``: its receiving half is
    shut down, so a read waiting in it returns (end of stream), unless :meth:`met` came
    first."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.expired = sock, False
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = self.expired = True
            try:  # the plain socket's shutdown: SSLSocket's would drop its TLS state
                socket.socket.shutdown(self.sock, socket.SHUT_RD)
            except OSError:
                pass

    def met(self) -> None:
        """The handshake ended (either way): the deadline no longer applies (see
        :attr:`expired` for whether it had passed)."""
        self._timer.cancel()
        with self._lock:
            self._done = True


class DataPlane:
    """This process's listener and links.

    Args:
        name, role: this process's identity, for its prefaces (with TLS, its certificate's).
        receiver: where every link's received tensors go.
        host, port: where to listen (port 0: a free one; :attr:`port` says which).
        listen: False: only dial (a client's plane: nodes never dial a client); then
            :attr:`port` is 0 and nothing listens.
        tls: mutual TLS with these certificates (None: plaintext).
        events: where links report breaks and failures.
        timeouts: each link's deadlines.
        relayed_timeouts: those of a link dialed to a relay (an outbound-only peer), when
            they differ (default: ``timeouts``): such a peer may be away while its relay
            restarts, or while it re-homes at the next relay, and comes back within the
            nodes' own :attr:`~.link.Timeouts.resume`.
        window_bytes, window_messages: the credit each link grants its peer.
        max_connections, max_caller_connections: the listener's caps on connections
            held at once, in all and per caller (:mod:`.caps`); past them a connection is
            refused with a GOAWAY (RESOURCE_EXHAUSTED) that names the cap.
        sources: who connections spliced from a relay come from (:class:`.caps.Sources`,
            a relayed node's); None: each connection's source host is its caller.
        server: what answers peers' fetches (:mod:`.fetch`; None: none are served).

    Raises:
        OSError: the port is in use (or cannot be bound).
    """

    def __init__(self, name: str, receiver: Receiver, *, role: str = "node",
                 host: str = "127.0.0.1", port: int = 0, listen: bool = True,
                 tls: TlsConfig | None = None,
                 events: LinkEvents | None = None, timeouts: Timeouts = DEFAULT_TIMEOUTS,
                 relayed_timeouts: Timeouts | None = None,
                 window_bytes: int | None = None, window_messages: int | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_caller_connections: int = MAX_CALLER_CONNECTIONS,
                 sources: Sources | None = None, server: Server | None = None):
        self.caps = Caps(max_connections, max_caller_connections)
        self.sources, self.server = sources, server
        self.name, self.role, self.receiver, self.events = name, role, receiver, events
        self.timeouts, self.relayed_timeouts = timeouts, relayed_timeouts or timeouts
        self.window_bytes = window_bytes or WINDOW_BYTES
        self.window_messages = window_messages or WINDOW_MESSAGES
        self._server_ctx = server_context(tls) if tls is not None else None
        self._client_ctx = client_context(tls) if tls is not None else None
        self._auth = tls.authenticator() if tls is not None else None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a peer's dialed link attached
        # links by (peer, job): job "" but for a link through a relay for one job
        self._dialed: dict[tuple[str, str], Link] = {}
        self._accepted: dict[tuple[str, str], Link] = {}
        self._addresses: dict[tuple[str, str], str] = {}  # the address a dialed link dials
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=BACKLOG) \
            if listen else None
        self.host = host
        self.port = self._listener.getsockname()[1] if self._listener is not None else 0
        if self._listener is not None:
            threading.Thread(target=self._accept_loop, args=(self._listener,), daemon=True,
                             name=f"data-accept-{self.port}").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _new_link(self, peer: str, dial: bool, address: str = "", job: str = "",
                  relayed: bool = False) -> Link:
        link = Link(self.name, self.role, peer, self.receiver, events=self.events,
                    timeouts=self.relayed_timeouts if relayed else self.timeouts,
                    window_bytes=self.window_bytes,
                    window_messages=self.window_messages, server=self.server)
        if dial:
            link.dial = self._dialer(address, link, job)
        return link

    # -- dialing ----------------------------------------------------------------
    def link(self, peer: str, address: str, job: str = "", relayed: bool = False) -> Link:
        """The link to ``peer`` (its node name) at ``address`` (``HOST:PORT``, its data
        port) for ``job``'s frames ("": no job in particular): one the peer dialed here
        while connected (for ``job`` through this side's relay, else one of any job);
        else one dialed before to the same address, else a new one, connected now (a
        dialed link to another address, of a peer since restarted elsewhere, is failed).

        ``relayed``: ``address`` is a relay's (the peer is outbound-only). A link dialed
        to it for a ``job`` is that job's alone (module docstring): dialed with a ``TAG``
        naming the job, keyed by ``(peer, job)``, refusing frames of other jobs. Every
        other link is one per peer, whatever ``job`` a caller names.

        Raises:
            LinkFailed: ``address`` cannot be reached, or refused this side (the relay
                refused the job's stream: the message names the job).
        """
        key = (peer, job if relayed else "")
        with self._lock:
            if self._closed:
                raise LinkFailed("the data plane is closed")
            accepted = self._accepted_for(peer, job)
            if accepted is not None:
                return accepted
            dialed = self._dialed.get(key)
            if dialed is not None and dialed.credits.failed is None:
                if self._addresses.get(key) == address:
                    return dialed
                dialed.fail(f"{peer} moved to {address}")  # restarted on another port
            link = self._dialed[key] = self._new_link(peer, True, address, key[1], relayed)
            self._addresses[key] = address
        assert link.dial is not None
        try:
            conn, theirs, who = link.dial()
            link.attach(conn, theirs, who)
        except (OSError, WireError, SecurityError) as e:
            link.fail(f"cannot connect to {peer} at {address}: {e}")
            raise LinkFailed(f"cannot connect to {peer} at {address}: {e}") from None

        def run() -> None:
            link.read(conn)
            link.redial()
        threading.Thread(target=run, daemon=True, name=f"data-{peer}").start()
        return link

    def _accepted_for(self, peer: str, job: str) -> Link | None:
        """The link ``peer`` dialed here that :meth:`link` returns for ``job``: its link
        of that job alone, else its link of any job; unless it broke (a broken one may be
        of a process that is gone: a restarted peer dials afresh only when it has to
        send). Holds :attr:`_lock`."""
        for key in ((peer, job), (peer, "")) if job else ((peer, ""),):
            accepted = self._accepted.get(key)
            if accepted is not None and accepted.credits.failed is None \
                    and (accepted.conn is not None or accepted.peer is None):
                return accepted
        return None

    def redirect(self, peer: str, old: str, new: str) -> bool:
        """``peer`` (a node name) moved from data address ``old`` to ``new`` (an
        outbound-only node re-homed at another relay): the link dialed to it at ``old``
        redials ``new`` from now on, and resumes where it broke (nothing lost, nothing
        repeated); :meth:`link` given ``new`` returns it. So does each of its links of
        one job (through ``old``, its old relay: the new one's ``TAG`` names the job
        again). Returns whether there was one."""
        with self._lock:
            moved = [(key, link) for key, link in self._dialed.items()
                     if key[0] == peer and self._addresses.get(key) == old]
            for key, link in moved:
                self._addresses[key] = new
                link.dial = self._dialer(new, link, key[1])
        if moved:
            log.info("data link to %s: redialing it at %s (it moved from %s)", peer, new, old)
        return bool(moved)

    def _dialer(self, address: str, link: Link,
                job: str) -> Callable[[], tuple[Connection, Preface, Peer]]:
        """What ``link`` dials (and redials after a break): ``address``, for ``job``."""
        return lambda: self._dial(address, link, job)

    def _dial(self, address: str, link: Link, job: str = "") -> tuple[Connection, Preface,
                                                                      Peer]:
        """A connection to ``address`` for ``link``, prefaces exchanged; through a relay
        for one ``job`` its ``TAG`` first (:func:`~fedpipe.net.relay.dial_job`).

        Raises:
            OSError: not reached, or the relay refused the job's stream (RelayRefused).
            WireError, SecurityError: the peer's preface or certificate is not its.
        """
        host, _, port = address.rpartition(":")
        if job:
            sock = dial_job(address, Tag(job, self.name, link.peer_name),
                            timeout=self.timeouts.handshake)
            sock.settimeout(self.timeouts.handshake)
        else:
            sock = socket.create_connection((host.strip("[]"), int(port)),
                                            timeout=self.timeouts.handshake)
        try:
            _tune(sock)
            if self._client_ctx is not None:
                sock = self._client_ctx.wrap_socket(sock, server_hostname=host.strip("[]"))
            conn = Connection(sock, dialed=True)
            conn.write(link.preface().encode())
            theirs = read_preface(conn)
            if theirs.name != link.peer_name:
                raise WireError(f"{address} is {theirs.name!r}, not {link.peer_name!r}")
            peer = dataclasses.replace(peer_of(sock, theirs, self._auth), job=job)
            sock.settimeout(None)
            return conn, theirs, peer
        except BaseException:
            sock.close()
            raise

    # -- accepting --------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, source = listener.accept()
            except OSError:
                return  # closed
            caller, job = self.sources.caller(source) if self.sources \
                else (str(source[0]), "")
            refused = self.caps.take(caller)
            if refused is not None and not self.caps.start_refusal():
                sock.close()  # even the refusals are at their cap: no word, no thread
                continue
            threading.Thread(target=self._serve, args=(sock, caller, refused, job),
                             daemon=True, name="data-conn").start()

    def _serve(self, sock: socket.socket, caller: str, refused: str | None,
               job: str = "") -> None:
        """One accepted connection: handshake, then its link's reader until it breaks.

        ``caller`` (its source host) holds a slot of :attr:`caps` unless ``refused``
        says why not: then the connection is only told so (after the TLS handshake, so
        a TLS dialer can read it) and closed. ``job``: the one job the relay that spliced
        it said it carries ("": any)."""
        if refused is not None:
            try:
                self._refuse(sock, refused)
            finally:
                self.caps.end_refusal()
            return
        slot: list[str | None] = [caller]  # whom the slot counts against (None: given back)
        try:
            attached = self._handshake(sock, slot, job)
            if attached is None:
                return
            link, conn = attached
            link.read(conn)
        finally:
            if slot[0] is not None:
                self.caps.give(slot[0])
        link.await_resume()
        self._forget(link)

    def _handshake(self, sock: socket.socket, slot: list[str | None],
                   job: str = "") -> tuple[Link, Connection] | None:
        """An accepted connection's TLS handshake and prefaces, within
        :attr:`Timeouts.first_record` in all; its link (``job``'s alone, if not ""),
        attached. None: refused (the peer was told why, with a GOAWAY, and the socket is
        closed)."""
        until = time.monotonic() + self.timeouts.first_record
        conn: Connection | None = None
        try:
            sock.settimeout(self.timeouts.handshake)
            _tune(sock)
            if self._server_ctx is not None:
                sock = self._tls_handshake(sock)
            conn = Connection(sock, dialed=False)
            conn.until = until  # a preface that drips in, a byte now and then, ends here
            theirs = read_preface(conn)
            conn.until = None
            sock.settimeout(self.timeouts.handshake)  # not what was left of the deadline
            peer = peer_of(sock, theirs, self._auth)
            if peer.identity is not None:  # count the slot against the certificate now
                assert slot[0] is not None
                refused, slot[0] = self.caps.move(slot[0], peer.identity.uri), None
                if refused is not None:
                    raise _Capped(refused)
                slot[0] = peer.identity.uri
            link = self._accepted_link(peer.name, job)
            conn.write(link.preface().encode())
            sock.settimeout(None)
            link.attach(conn, theirs, dataclasses.replace(peer, job=job))
            if link.fresh:  # its first record must come (Timeouts.silent); the reader lifts it
                conn.until = time.monotonic() + self.timeouts.silent
                conn.late = (f"nothing came within {self.timeouts.silent} s of its preface "
                             "(fedpipe.net.timeouts.DATA_SILENT_AFTER_PREFACE)")
        except (OSError, WireError, SecurityError, LinkFailed, _Capped) as e:
            code, why = _refusal_of(e)
            if isinstance(e, OSError) and time.monotonic() >= until:
                code, why = Code.DEADLINE_EXCEEDED, (
                    f"no preface within {self.timeouts.first_record} s of connecting "
                    "(fedpipe.net.timeouts.DATA_FIRST_RECORD)")
            if isinstance(e, Closed) and conn is not None and conn.received == 0:
                # closed unheard: a reachability check (the tracker's dial-back at registration)
                log.debug("a data connection closed before its preface")
            else:
                log.info("refused a data connection: %s", why)
            self._goaway(sock, code, why)
            return None
        except Exception as e:  # noqa: BLE001 — a bug here must close the connection, not leak it
            log.exception("accepting a data connection")
            self._goaway(sock, Code.INTERNAL, f"the listener failed: {e!r}")
            return None
        with self._arrived:
            self._arrived.notify_all()
        return link, conn

    def _tls_handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        """``sock``'s server-side TLS handshake, ended (OSError, the socket closed) if it
        takes longer than :attr:`Timeouts.first_record` in all (a dialer that sends its
        hello a byte at a time)."""
        assert self._server_ctx is not None
        tls = self._server_ctx.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False)
        deadline = _Deadline(tls, self.timeouts.first_record)
        try:
            tls.do_handshake()
            deadline.met()
            if deadline.expired:  # the handshake ended as its read was being cut off
                raise TimeoutError("the TLS handshake's deadline passed")
        except BaseException:
            deadline.met()
            tls.close()
            raise
        return tls

    def _refuse(self, sock: socket.socket, why: str) -> None:
        """Tell a connection past a cap why it is refused (after the TLS handshake, within
        :attr:`Timeouts.first_record`), and close it."""
        try:
            sock.settimeout(self.timeouts.handshake)
            if self._server_ctx is not None:
                sock = self._tls_handshake(sock)
        except OSError:
            sock.close()
            return
        log.info("refused a data connection: %s", why)
        self._goaway(sock, Code.RESOURCE_EXHAUSTED, why)

    def _forget(self, link: Link) -> None:
        """Drop an accepted link that failed (its dialer did not come back), so callers that
        come and go do not pile up links."""
        with self._lock:
            key = (link.peer_name, link.peer.job if link.peer is not None else "")
            if link.credits.failed is not None and self._accepted.get(key) is link:
                del self._accepted[key]

    def wait_dialed_by(self, peer: str, timeout: float, job: str = "") -> bool:
        """Wait up to ``timeout`` seconds until ``peer`` (a node name) has a connected link
        it dialed here (of any job, or of ``job`` alone through this side's relay);
        whether it has. :meth:`link` given ``job`` then returns that link, whatever
        address it is given: a reachable node lets an outbound-only peer (behind NAT)
        dial it, rather than dialing it through its relay, and of two outbound-only
        nodes one waits for the other's link through its relay."""
        deadline = time.monotonic() + timeout
        keys = ((peer, job), (peer, "")) if job else ((peer, ""),)
        with self._arrived:
            while True:
                for key in keys:
                    link = self._accepted.get(key)
                    if link is not None and link.credits.failed is None \
                            and link.conn is not None:
                        return True
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._arrived.wait(left)

    def _accepted_link(self, peer: str, job: str = "") -> Link:
        with self._lock:
            if self._closed:
                raise LinkFailed("the data plane is closed")
            link = self._accepted.get((peer, job))
            if link is None or link.credits.failed is not None:
                link = self._accepted[(peer, job)] = self._new_link(peer, False)
            return link

    @staticmethod
    def _goaway(sock: socket.socket, code: Code, why: str) -> None:
        """Send a GOAWAY and close: the sending half first, then what the peer still sends
        is read (for :data:`fedpipe.net.timeouts.GOAWAY_LINGER` at most), so the close does
        not reset the connection before the peer has read why."""
        try:
            sock.settimeout(net_timeouts.GOAWAY_LINGER)
            sock.sendall(records.pack_text(RecordType.GOAWAY, 0, code, why))
            socket.socket.shutdown(sock, socket.SHUT_WR)  # not SSLSocket's: no TLS close
            end = time.monotonic() + net_timeouts.GOAWAY_LINGER
            while time.monotonic() < end and sock.recv(65536):
                pass
        except (OSError, ValueError):
            pass  # it is being closed anyway (ValueError: TLS not handshaken)
        sock.close()

    # -- life cycle -------------------------------------------------------------
    def end_job(self, job: str) -> int:
        """``job`` is over here: close the links this side dialed through a relay for it
        alone (:meth:`link`), so the relay's streams of the job end (the peer's end fails
        after its resume window). Links shared by jobs stay. Returns how many closed."""
        with self._lock:
            mine = [key for key in self._dialed if job and key[1] == job]
            links = [self._dialed.pop(key) for key in mine]
            for key in mine:
                self._addresses.pop(key, None)
        for link in links:
            link.close()
        if links:
            log.info("job %s is over: closed its %d data link(s) through relays", job,
                     len(links))
        return len(links)

    def links(self) -> list[Link]:
        """Every link now, dialed and accepted."""
        with self._lock:
            return [*self._dialed.values(), *self._accepted.values()]

    def close(self) -> None:
        """Stop listening and close every link (idempotent)."""
        with self._lock:
            self._closed = True
            self._arrived.notify_all()
            links = [*self._dialed.values(), *self._accepted.values()]
            self._dialed.clear()
            self._accepted.clear()
        if self._listener is not None:
            self._listener.close()
        for link in links:
            link.close()

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
