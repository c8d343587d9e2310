"""How many connections a socket data-plane listener holds: in all, and per caller.

Each connection a listener accepts holds a *slot* from its accept until its
reader returns (the link then waits for its dialer without one). A slot is
counted against its caller: the connection's source host until its preface
is read, then, with TLS, the certificate's identity (``fedpipe://ROLE/NAME``:
several processes of one client certificate share it); without TLS it stays
the source host (a preface's name is only its word). Past either cap a
connection is refused at once with a GOAWAY (RESOURCE_EXHAUSTED) whose text
names the cap, as gRPC's data calls are refused past
:data:`fedpipe.net.DATA_CALLS` and :data:`fedpipe.net.PEER_DATA_CALLS`.

A slot is held before the preface for at most
:data:`fedpipe.net.timeouts.DATA_FIRST_RECORD`, so connections that stall cannot
keep it. Refusals are counted too, and bounded (:meth:`Caps.start_refusal`):
with TLS a refusal is said after the handshake, on a thread of its own.
"""
from __future__ import annotations

import threading

MAX_CONNECTIONS = 256
"""The most connections one listener holds at once. A node holds one accepted connection
per peer that dials it (its pipeline neighbours and replica peers, a feeding client each),
so 256 leave room for a large swarm; more are refused (RESOURCE_EXHAUSTED)."""
MAX_CALLER_CONNECTIONS = 32
"""The most connections one caller (see the module docstring) holds on one listener at
once, so one caller cannot take every slot of :data:`MAX_CONNECTIONS`. A node dials a peer
once (twice for a moment when both dial at once); without TLS every process of a machine
(a LocalSwarm's nodes, clients) is one caller, its host."""


class Caps:
    """Slots of one listener (thread-safe).

    Args:
        total: slots in all, >= 1.
        per_caller: slots one caller may hold, >= 1.

    Raises:
        ValueError: a cap below 1.
    """

    def __init__(self, total: int = MAX_CONNECTIONS, per_caller: int = MAX_CALLER_CONNECTIONS):
        if min(total, per_caller) < 1:
            raise ValueError(f"connection caps must be >= 1, got total={total}, "
                             f"per_caller={per_caller}")
        self.total, self.per_caller = total, per_caller
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._count = 0
        self._refusing = 0

    def held(self, caller: str | None = None) -> int:
        """Slots held now: by ``caller``, or in all (None)."""
        with self._lock:
            return self._count if caller is None else self._held.get(caller, 0)

    def _refusal(self, caller: str) -> str | None:
        mine = self._held.get(caller, 0)
        if mine >= self.per_caller:
            return (f"refused: {caller} already holds {mine} data connections to this "
                    f"listener, the most one caller may "
                    f"(fedpipe.net.dataplane.caps.MAX_CALLER_CONNECTIONS = "
                    f"{self.per_caller}); try again when one ends")
        if self._count >= self.total:
            return (f"refused: this listener already holds {self.total} data connections, "
                    f"the most it takes (fedpipe.net.dataplane.caps.MAX_CONNECTIONS); "
                    f"try again when one ends")
        return None

    def take(self, caller: str) -> str | None:
        """Take a slot for ``caller``; None, or why it is refused (naming the cap)."""
        with self._lock:
            refused = self._refusal(caller)
            if refused is None:
                self._count += 1
                self._held[caller] = self._held.get(caller, 0) + 1
            return refused

    def give(self, caller: str) -> None:
        """Give back a slot ``caller`` holds."""
        with self._lock:
            self._drop(caller)

    def _drop(self, caller: str) -> None:
        self._count -= 1
        left = self._held[caller] - 1
        if left:
            self._held[caller] = left
        else:
            del self._held[caller]

    def move(self, caller: str, to: str) -> str | None:
        """Count a slot of ``caller`` against ``to`` instead (its identity is known now);
        None, or why ``to`` may not hold it (then the slot is given back: none is held)."""
        if caller == to:
            return None
        with self._lock:
            self._drop(caller)
            refused = self._refusal(to)
            if refused is None:
                self._count += 1
                self._held[to] = self._held.get(to, 0) + 1
            return refused

    def start_refusal(self) -> bool:
        """Whether another refused connection may be told why (at most ``total`` at once);
        if so, call :meth:`end_refusal` when it was. Past that, close without a word."""
        with self._lock:
            if self._refusing >= self.total:
                return False
            self._refusing += 1
            return True

    def end_refusal(self) -> None:
        with self._lock:
            self._refusing -= 1


class Sources:
    """Who a spliced connection comes from, for the caps, and which job it carries.

    A relayed node's :class:`~fedpipe.net.relay.Homing` connects each stream the relay
    opens for it to the node's own listener, from loopback: every relayed peer would be
    one caller, so one dialer through the relay could take every slot of
    :data:`MAX_CALLER_CONNECTIONS` and lock the others out. The Homing notes here, before
    it connects, its socket's local address, the dialer's host as the relay saw it
    (the stream's ``Open.source``) and the job its ``TAG`` named (``Open.job``; "":
    untagged); the listener's accept takes that host as the caller, and keys the link by
    the job (:meth:`~fedpipe.net.dataplane.server.DataPlane.link`), refusing its frames
    of any other job. Thread-safe; each note is taken once (or dropped by the Homing if
    its connect fails).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[tuple[str, int], tuple[str, str]] = {}

    def note(self, local: tuple[str, int], host: str, job: str = "") -> None:
        """A connection from ``local`` (``(host, port)``) is a stream of ``host``'s, of
        ``job`` alone ("": of any job)."""
        with self._lock:
            self._hosts[local] = (host, job)

    def drop(self, local: tuple[str, int]) -> None:
        """The connection from ``local`` was not made."""
        with self._lock:
            self._hosts.pop(local, None)

    def caller(self, source: tuple) -> tuple[str, str]:
        """``(caller, job)`` of an accepted connection from ``source`` (``(host, port,
        ...)``): the host and job noted for it, else its own host and "" (any job)."""
        with self._lock:
            noted = self._hosts.pop((str(source[0]), int(source[1])), None)
        return noted or (str(source[0]), "")
