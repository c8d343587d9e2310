"""Local processes: a free port, dying with the parent, a swarm child's environment,
waiting until a server serves.

Torch-free, and nothing here imports the client: ``fedpipe tracker`` calls
:func:`die_with_parent` at start-up, and the control plane stays light (see
``tests/test_lightweight.py``). :mod:`fedpipe.testing` re-exports these for tests.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from typing import Callable

from . import net
from .net import timeouts
from .proto import node_pb2, tracker_pb2
from .security import TlsConfig
from .security.tls import TLS_DIR_ENV

TRACKER_SERVICE = tracker_pb2.DESCRIPTOR.services_by_name["Tracker"].full_name
NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name
PARENT_PID_ENV = "FEDPIPE_PARENT_PID"
"""Set by :func:`child_env`: the process that a tracker or node dies with."""
_POLL = 0.05  # seconds between looks at a server that is starting


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket holds now (the kernel's pick).

    Another process may take it before the caller binds it; callers retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_serving(address: str, service: str, timeout: float,
                 alive: Callable[[], None] = lambda: None, *,
                 tls: TlsConfig | None = None) -> None:
    """Wait until the server at ``address`` reports ``service`` SERVING over grpc.health.v1.

    Args:
        service: full service name, e.g. :data:`TRACKER_SERVICE`.
        timeout: seconds.
        alive: called between tries; raises if the server's process died.
        tls: the certificate to show a server that takes only mutual TLS.

    Raises:
        TimeoutError: not serving within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    ch = net.channel(address, tls=tls)
    try:
        while True:
            left = deadline - time.monotonic()
            if net.serving(ch, service, timeout=max(0.001, min(timeouts.HEALTH_RPC, left))):
                return
            alive()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{service} at {address} is not serving after {timeout} s")
            time.sleep(_POLL)
    finally:
        ch.close()


def die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent dies (Linux).

    Called at start-up by ``fedpipe tracker`` and ``fedpipe node``; does something
    only in a process started with :func:`child_env` (``$FEDPIPE_PARENT_PID`` set,
    by a LocalSwarm for instance). Not a ``preexec_fn``, since forking a process
    that runs gRPC threads and then running Python code before exec can abort the
    child.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a swarm process: ``threads`` BLAS/OpenMP threads, and this
    process as the parent it dies with (:func:`die_with_parent`).

    ``$FEDPIPE_TLS_DIR`` is not passed on: a swarm process gets its TLS
    directory, if any, on its command line.
    """
    env = {k: v for k, v in os.environ.items() if k != TLS_DIR_ENV}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", **{PARENT_PID_ENV: str(os.getpid())})
    return env
