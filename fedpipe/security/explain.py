"""A client channel whose failed calls say in one line what is wrong with the TLS set-up.

gRPC reports a refused TLS handshake as a bare ``UNAVAILABLE: Socket closed`` (or
``failed to connect to all addresses``), whichever side was wrong. A channel
wrapped by :func:`explained` keeps every call and status code as they were, and
replaces the error of a failed call by an :class:`Explained` one whose
``details()`` (and ``str()``) is one line:

- UNAVAILABLE on a channel that has never completed a call: a host gRPC
  could not resolve (:func:`fedpipe.security.tls.unresolved`), else the cause
  :func:`fedpipe.security.tls.diagnose` finds (no certificate, a certificate of
  another CA, an expired one, a server without TLS, ...), else gRPC's own;
- UNAUTHENTICATED and PERMISSION_DENIED (e.g. the wrong role for a method):
  the server's own one-line reason, with the status code in front.

Once a call on the channel has succeeded, the TLS set-up is known to work and an
UNAVAILABLE is left as it is (a peer that went away), so recovery paths pay
for no probe.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import grpc

from ..status import StatusError
from .tls import TlsConfig, diagnose, unresolved

REASON_SECONDS = 5.0
"""How long one diagnosis is reused for the calls of a channel that fail together, seconds."""
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Explained(StatusError):
    """A failed call's error with a one-line reason: ``code()`` is the call's status code,
    ``details()`` the reason, ``cause`` gRPC's own error."""

    def __init__(self, cause: grpc.RpcError, reason: str):
        super().__init__(grpc.StatusCode.UNKNOWN, reason)
        self.cause, self.reason = cause, reason

    def code(self) -> grpc.StatusCode:
        return self.cause.code()

    def initial_metadata(self):
        return _call_attr(self.cause, "initial_metadata", ())

    def trailing_metadata(self):
        return _call_attr(self.cause, "trailing_metadata", ())


def _call_attr(error: grpc.RpcError, name: str, default: Any) -> Any:
    fn = getattr(error, name, None)
    return fn() if callable(fn) else default


class _Explainer:
    """What one channel knows: its address, TLS, whether a call ever succeeded."""

    def __init__(self, address: str, tls: TlsConfig | None):
        self.address, self.tls = address, tls
        self.connected = False
        self._lock = threading.Lock()
        self._reason: tuple[float, str | None] | None = None

    def explain(self, error: BaseException | None) -> BaseException | None:
        """``error`` with a one-line reason where one is known (see the module docstring)."""
        if not isinstance(error, grpc.RpcError):
            return error
        return self.explain_rpc(error)

    def explain_rpc(self, error: grpc.RpcError) -> grpc.RpcError:
        if isinstance(error, Explained):
            return error
        code = error.code() if callable(getattr(error, "code", None)) else None
        if code in _REFUSED:
            return Explained(error, error.details() or code.name.lower())
        if code == grpc.StatusCode.UNAVAILABLE and not self.connected:
            reason = unresolved(error.details() or "") or self._diagnosis()
            if reason:
                return Explained(error, reason)
        return error

    def _diagnosis(self) -> str | None:
        with self._lock:  # calls that fail together share one probe of the server
            now = time.monotonic()
            if self._reason is None or now - self._reason[0] > REASON_SECONDS:
                self._reason = (now, diagnose(self.address, self.tls))
            return self._reason[1]


class _Outcome(grpc.Call, grpc.Future):
    """A unary response (a call and a future) whose error is explained."""

    def __init__(self, inner, explainer: _Explainer):
        self._inner, self._x = inner, explainer

    def result(self, timeout=None):
        try:
            out = self._inner.result(timeout)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e) from None
        self._x.connected = True
        return out

    def exception(self, timeout=None):
        e = self._inner.exception(timeout)
        if e is None:
            self._x.connected = True
        return self._x.explain(e)

    def traceback(self, timeout=None):
        return self._inner.traceback(timeout)

    def add_done_callback(self, fn: Callable) -> None:
        self._inner.add_done_callback(lambda _: fn(self))

    def code(self):
        return self._inner.code()

    def details(self):
        e = self.exception() if self._inner.done() else None
        return e.details() if isinstance(e, grpc.RpcError) else self._inner.details()

    def __getattr__(self, name):  # cancel, cancelled, running, done, metadata, ...
        return getattr(self._inner, name)

    def cancel(self):
        return self._inner.cancel()

    def cancelled(self):
        return self._inner.cancelled()

    def running(self):
        return self._inner.running()

    def done(self):
        return self._inner.done()

    def initial_metadata(self):
        return self._inner.initial_metadata()

    def trailing_metadata(self):
        return self._inner.trailing_metadata()

    def is_active(self):
        return self._inner.is_active()

    def time_remaining(self):
        return self._inner.time_remaining()

    def add_callback(self, callback):
        return self._inner.add_callback(callback)


class _Responses(_Outcome):
    """A response stream whose error is explained."""

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        try:
            out = next(self._inner)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e) from None
        self._x.connected = True
        return out


class _Unary:
    """A unary-response multicallable (unary-unary or stream-unary) whose errors are explained."""

    def __init__(self, inner, explainer: _Explainer):
        self._inner, self._x = inner, explainer

    def __call__(self, request, **kw):
        try:
            out = self._inner(request, **kw)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e) from None
        self._x.connected = True
        return out

    def with_call(self, request, **kw):
        try:
            out = self._inner.with_call(request, **kw)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e) from None
        self._x.connected = True
        return out

    def future(self, request, **kw):
        return _Outcome(self._inner.future(request, **kw), self._x)


class _Streaming:
    """A response-streaming multicallable (unary-stream or stream-stream), explained."""

    def __init__(self, inner, explainer: _Explainer):
        self._inner, self._x = inner, explainer

    def __call__(self, request, **kw):
        try:
            return _Responses(self._inner(request, **kw), self._x)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e) from None


class _ExplainedChannel(grpc.Channel):
    """A channel whose calls' errors are explained. Its multicallables are made on the
    wrapped channel when a stub asks for them, as gRPC's own are, so a call on a closed
    channel raises ValueError as usual (gRPC's interceptor channels make them at each call,
    which crashes on a closed channel)."""

    def __init__(self, channel: grpc.Channel, explainer: _Explainer):
        self._ch, self._x = channel, explainer

    def subscribe(self, callback, try_to_connect=False):
        self._ch.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._ch.unsubscribe(callback)

    def unary_unary(self, method, *args, **kw):
        return _Unary(self._ch.unary_unary(method, *args, **kw), self._x)

    def stream_unary(self, method, *args, **kw):
        return _Unary(self._ch.stream_unary(method, *args, **kw), self._x)

    def unary_stream(self, method, *args, **kw):
        return _Streaming(self._ch.unary_stream(method, *args, **kw), self._x)

    def stream_stream(self, method, *args, **kw):
        return _Streaming(self._ch.stream_stream(method, *args, **kw), self._x)

    def close(self):
        self._ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def explained(channel: grpc.Channel, address: str, tls: TlsConfig | None) -> grpc.Channel:
    """``channel`` (to ``address``, made with ``tls``) with one-line errors; closing the
    result closes ``channel``."""
    return _ExplainedChannel(channel, _Explainer(address, tls))
