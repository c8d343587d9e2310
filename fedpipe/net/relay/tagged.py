"""A dialer's side of one job's relayed stream: connect to a relayed address and say which
job the connection carries (a TAG record, in the clear). No torch.

The relay counts such a stream, and the bytes it holds for it, against the job's share
of the node (:class:`~.splice.Home`), so one job flooding a relay cannot take another
job's place; past its share the relay refuses the job's stream, naming the job.
A node's or a client's data-plane link to a node it reaches through that node's relay
is one per (peer, job), dialed here (:meth:`fedpipe.net.dataplane.DataPlane.link`,
``relayed``); links to reachable peers and gRPC channels carry several jobs and are not
tagged: the relay cannot tell their jobs apart without decoding them,
which under TLS it cannot. Contract: ``protos/fedpipe/v1/FRAMES.md``, "Relays".
"""
from __future__ import annotations

import socket

from .. import timeouts
from . import records
from .records import RecordType, RelayError, RelayRefused
from .splice import read_exact, tune


def dial_job(address: str, tag: records.Tag,
             timeout: float = timeouts.RELAY_HANDSHAKE) -> socket.socket:
    """A connection to the relayed ``address`` (``HOST:PORT``, one a relay allocated to
    ``tag.destination``) that carries ``tag.job``'s bytes only; what the caller writes
    next (its TLS handshake, its preface) reaches the node untouched.

    Raises:
        RelayRefused: the relay refused the stream (its reason: the job past its share, or
            the port another node's).
        RelayError: the address answered with something else (not a relayed port?).
        OSError: it could not be reached, or did not answer within ``timeout`` seconds.
    """
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        tune(sock)
        sock.sendall(tag.encode())
        kind, _, arg = records.unpack(read_exact(sock, records.PREFIX_BYTES))
        if kind is RecordType.REFUSED:
            why = read_exact(sock, min(arg, records.MAX_BODY)).decode(errors="replace")
            raise RelayRefused(f"the relay at {address} refused a stream of job {tag.job!r} "
                               f"to node {tag.destination!r}: {why}")
        if kind is not RecordType.ACCEPTED:
            raise RelayError(f"{address} answered a TAG with {kind.name}, not ACCEPTED")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise
