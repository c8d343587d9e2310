"""A standard-library HTTP server run on a daemon thread, for the dashboard and /metrics.

Both have no authentication: they bind 127.0.0.1 unless the operator names
another address (``--http-host``, ``--metrics-host``).
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..net import timeouts

LOCALHOST = "127.0.0.1"
"""The default bind address of every fedpipe HTTP endpoint."""
POLL = 0.05
"""Seconds between the serving loop's checks for :meth:`Served.close`: a close waits up
to this long. The standard library's 0.5 s made every close of a tracker's dashboard or
a node's /metrics take half a second; 20 empty ``select`` calls a second cost nothing
measurable."""


class Served:
    """An HTTP server answering on its own daemon thread.

    Attributes:
        server: the ``ThreadingHTTPServer``.
        port: the port it is bound to (the real one when 0 was asked for).
        url: ``http://HOST:PORT`` (with ``127.0.0.1`` for a wildcard bind).
    """

    def __init__(self, server: ThreadingHTTPServer, name: str):
        self.server = server
        self.port = server.server_address[1]
        host = server.server_address[0]
        self.url = f"http://{LOCALHOST if host in ('0.0.0.0', '') else host}:{self.port}"
        self.thread = threading.Thread(target=server.serve_forever, args=(POLL,), name=name,
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeouts.THREAD_JOIN)

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung browser connection must not hold up the tracker's exit


def serve(handler: type[BaseHTTPRequestHandler], host: str, port: int, name: str) -> Served:
    """Bind ``host:port`` (0: any free port) and serve ``handler`` on a thread.

    Raises:
        OSError: the address cannot be bound (in use, or not this machine's).
    """
    return Served(_Server((host, port), handler), name)
