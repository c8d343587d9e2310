"""The one rule for a ``HOST:PORT`` address: a tracker's (``--tracker``), a relay's
(``--relay``), a registering node's. Each caller names the address in its own error;
:func:`problem` says what is wrong with it.
"""
from __future__ import annotations


def problem(address: str) -> str | None:
    """What is wrong with ``address`` as ``HOST:PORT`` (a host, a colon, a port in
    1..65535; no scheme, no path), in a few words for an error message; None: nothing.
    An IPv6 host is bracketed (``[::1]:7070``)."""
    host, colon, port = address.rpartition(":")
    if "/" in address:
        return "expected HOST:PORT, not a URL (no scheme, no path)"
    if any(c.isspace() for c in address):
        return "expected HOST:PORT, with no spaces"
    if not (host and colon and port):
        return "expected HOST:PORT"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return "expected HOST:PORT, an IPv6 host in brackets ([::1]:7070)"
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return f"expected HOST:PORT with a port in 1..65535, not {port!r}"
    return None
