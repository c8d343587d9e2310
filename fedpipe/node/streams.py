"""A node's watch over its open data-plane streams: idle ones that serve no running job end.

Every Send, PutSnapshot, FetchState and FetchSnapshot call registers here for
its life (:meth:`StreamWatch.open`), says which job it belongs to as soon as
it knows (the first envelope, or the request), and is touched by every message
it carries. A reaper thread cancels each stream that has carried nothing for
``idle`` seconds while it belongs to no job that runs on this node: a caller
that opened a stream and never sent an envelope, or one whose job's stages
here have ended. So idle streams can hold the node's data-call slots
(:data:`fedpipe.net.DATA_CALLS`) only for a bounded time.

Streams of a running job are never cut for idling: stages idle between DiLoCo
outer steps on purpose. A peer that died behind one is found by the
connection's keepalive (:data:`fedpipe.net.timeouts.KEEPALIVE_TIME`).

A cancelled call ends on the caller's side with CANCELLED; the node logs why.

With TLS a stream also ends when its caller's certificate is revoked while it is
open: TLS and the interceptor check the certificate once, when the call
starts, so each message a stream carries looks up the caller's serial in the
deny list again (a set lookup) and the call ends with UNAUTHENTICATED.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, TypeVar

import grpc

from ..net import timeouts
from ..security import SecurityError, identity_of

log = logging.getLogger(__name__)

T = TypeVar("T")


class Watched:
    """One open stream: its call, the job it belongs to ("" not yet known), its last message.

    Args:
        revoked: whether the caller's certificate is revoked now (None: no TLS); it may
            raise :class:`~fedpipe.security.SecurityError` (a deny list it cannot read).
    """

    def __init__(self, context: grpc.ServicerContext, method: str, job_id: str = "",
                 revoked: Callable[[], bool] | None = None):
        self.context, self.method, self.job_id = context, method, job_id
        self.last = time.monotonic()
        self._revoked = revoked

    def touch(self) -> None:
        """A message went by now."""
        self.last = time.monotonic()

    def belongs_to(self, job_id: str) -> None:
        """The stream carries ``job_id``'s tensors."""
        self.job_id = job_id

    def check(self) -> None:
        """End the call (UNAUTHENTICATED) if the caller's certificate has been revoked."""
        if self._revoked is None:
            return
        try:
            if not self._revoked():
                return
            code, why = grpc.StatusCode.UNAUTHENTICATED, "its certificate was revoked"
        except SecurityError as e:
            code, why = e.code, str(e)
        log.warning("ending a %s stream from %s: %s", self.method, self.context.peer(), why)
        self.context.abort(code, f"{self.method} stream ended: {why}")

    def track(self, messages: Iterator[T]) -> Iterator[T]:
        """``messages``, touching the stream at each and checking the caller is not revoked."""
        for m in messages:
            self.check()
            self.touch()
            yield m


class StreamWatch:
    """Cancels open streams that idle while their job does not run here. Thread-safe.

    Args:
        runs: whether a job has a running stage on this node.
        idle: seconds a stream may carry nothing while it serves no running job.
        interval: seconds between the reaper's looks (default: a quarter of ``idle``,
            at most 1 s), so a stream ends within ``idle + interval``.
        revoked_serials: the certificate serials refused now (the server's
            :meth:`~fedpipe.security.tls.Authenticator.revoked_serials`; None: no TLS).
    """

    def __init__(self, runs: Callable[[str], bool], idle: float = timeouts.IDLE_STREAM,
                 interval: float | None = None,
                 revoked_serials: Callable[[], frozenset[int]] | None = None):
        self.revoked_serials = revoked_serials
        if not idle > 0:
            raise ValueError(f"idle must be > 0 seconds, got {idle}")
        self.runs, self.idle = runs, idle
        self.interval = interval if interval is not None else min(1.0, idle / 4)
        self._open: set[Watched] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reap_loop, name="stream-reaper",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def open(self, context: grpc.ServicerContext, method: str,
             job_id: str = "") -> Iterator[Watched]:
        """Watch the current call for as long as the block runs."""
        revoked = None
        identity = identity_of(context) if self.revoked_serials is not None else None
        if identity is not None:
            serials, serial = self.revoked_serials, identity.serial
            assert serials is not None
            revoked = lambda: serial in serials()  # noqa: E731
        w = Watched(context, method, job_id, revoked)
        w.check()  # revoked between the interceptor's look and now
        with self._lock:
            self._open.add(w)
        try:
            yield w
        finally:
            with self._lock:
                self._open.discard(w)

    def count(self) -> int:
        """Streams open now."""
        with self._lock:
            return len(self._open)

    def reap(self) -> int:
        """Cancel every stream idle past ``idle`` whose job does not run here; how many."""
        now = time.monotonic()
        with self._lock:
            idle = [w for w in self._open if now - w.last > self.idle]
        doomed = [w for w in idle if not (w.job_id and self.runs(w.job_id))]
        for w in doomed:
            log.info("closing a %s stream from %s idle for %.0f s: %s", w.method,
                     w.context.peer(), now - w.last,
                     f"job {w.job_id!r} does not run here" if w.job_id else "it named no job")
            with self._lock:
                self._open.discard(w)
            w.context.cancel()
        return len(doomed)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 — the reaper must outlive one bad look
                log.exception("stream reaper")

    def close(self) -> None:
        """Stop the reaper (open streams are left to the server's shutdown)."""
        self._stop.set()
        self._thread.join(timeouts.THREAD_JOIN)
