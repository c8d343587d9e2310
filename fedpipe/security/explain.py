"""A client channel whose failed calls say in one line what is wrong with the set-up: the
address dialled, or TLS.

gRPC reports a refused TLS handshake as a bare ``UNAVAILABLE: Socket closed`` (or
``failed to connect to all addresses``), whichever side was wrong; a port that serves
other calls (a node's, dialled as the tracker) as ``UNIMPLEMENTED: Method not found!``;
an HTTP port (the tracker's ``--http-port``) as ``Failed parsing HTTP/2 (Expected
SETTINGS frame ...)``. A channel wrapped by :func:`explained` keeps every call and status
code as they were, and replaces the error of a failed call by an :class:`Explained` one
whose ``details()`` (and ``str()``) is one line:

- UNAVAILABLE on a channel that has never completed a call: a host gRPC
  could not resolve (:func:`fedpipe.security.tls.unresolved`), a port that does not
  speak gRPC (:func:`not_grpc`), else the cause
  :func:`fedpipe.security.tls.diagnose` finds (no certificate, a certificate of
  another CA, an expired one, a server without TLS, ...), else gRPC's own;
- UNIMPLEMENTED for a method the server does not have, on a channel that has never
  completed a call: the address is not a fedpipe tracker (or node) (:func:`not_served`);
- UNAUTHENTICATED and PERMISSION_DENIED (e.g. the wrong role for a method):
  the server's own one-line reason, with the status code in front.

Once a call on the channel has succeeded, the set-up is known to work and an
UNAVAILABLE is left as it is (a peer that went away), so recovery paths pay
for no probe; so is an UNIMPLEMENTED (a server of another fedpipe version that lacks
one method).
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

ROLES = {"fedpipe.v1.Tracker": "tracker", "fedpipe.v1.Node": "node"}
"""The fedpipe role that serves each gRPC service, by the service's full name."""
NOT_SERVED_HINT = {"tracker": "is it a node's port?", "node": "is it the tracker's port?"}
"""What a port dialled as a role's but serving none of its calls more likely is."""
NOT_GRPC_HINT = {"tracker": "is it the tracker's --http-port? give the tracker's --port"}
"""What a port dialled as a role's but not speaking gRPC more likely is."""
METHOD_NOT_FOUND = "Method not found!"
"""grpc's details of UNIMPLEMENTED for a method the server has no handler for (a
servicer's own UNIMPLEMENTED says "Method not implemented!")."""
NOT_HTTP2 = "Failed parsing HTTP/2"
"""gRPC core's words, in a failed connection's details, for a server that answered
something other than HTTP/2 (an HTTP/1 server answers with ``HTTP/1.0 ...``)."""


def _role(method: str) -> str | None:
    """The fedpipe role whose service ``method`` (``/fedpipe.v1.Tracker/ListNodes``)
    belongs to; None for another service's."""
    return ROLES.get(method.lstrip("/").partition("/")[0])


def not_served(details: str, address: str, method: str) -> str | None:
    """A call of ``method`` to ``address`` that failed UNIMPLEMENTED with ``details``, in
    one line, when the server has no such method at all: ``127.0.0.1:7071 is not a
    fedpipe tracker (it does not serve the tracker's calls; is it a node's port?)``.
    None for a method of no fedpipe role, or a servicer's own UNIMPLEMENTED."""
    role = _role(method)
    if role is None or details != METHOD_NOT_FOUND:
        return None
    return (f"{address} is not a fedpipe {role} (it does not serve the {role}'s calls; "
            f"{NOT_SERVED_HINT[role]})")


def not_grpc(details: str, address: str, method: str) -> str | None:
    """A call of ``method`` to ``address`` that failed UNAVAILABLE with ``details``, in one
    line, when the server does not speak gRPC (HTTP/2): ``127.0.0.1:8080 does not speak
    gRPC (is it the tracker's --http-port? give the tracker's --port)``; None otherwise."""
    if NOT_HTTP2 not in details:
        return None
    hint = NOT_GRPC_HINT.get(_role(method) or "")
    return f"{address} does not speak gRPC" + (f" ({hint})" if hint else "")


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

    def explain(self, error: BaseException | None, method: str = "") -> BaseException | None:
        """``error`` of a call of ``method`` with a one-line reason where one is known (see
        the module docstring)."""
        if not isinstance(error, grpc.RpcError):
            return error
        return self.explain_rpc(error, method)

    def explain_rpc(self, error: grpc.RpcError, method: str = "") -> grpc.RpcError:
        """``error`` of a call of ``method`` (``/fedpipe.v1.Tracker/ListNodes``; "": not
        known) as an :class:`Explained` one where a reason is known, else itself."""
        if isinstance(error, Explained):
            return error
        code = error.code() if callable(getattr(error, "code", None)) else None
        if code in _REFUSED:
            return Explained(error, error.details() or code.name.lower())
        if self.connected:
            return error
        details = error.details() or ""
        reason = None
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = (unresolved(details) or not_grpc(details, self.address, method)
                      or self._diagnosis())
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            reason = not_served(details, self.address, method)
        return Explained(error, reason) if reason else error

    def _diagnosis(self) -> str | None:
        with self._lock:  # calls that fail together share one probe of the server
            now = time.monotonic()
            if self._reason is None or now - self._reason[0] > REASON_SECONDS:
                self._reason = (now, diagnose(self.address, self.tls))
            return self._reason[1]


class _Outcome(grpc.Call, grpc.Future):
    """A unary response (a call and a future) of ``method`` whose error is explained."""

    def __init__(self, inner, explainer: _Explainer, method: str):
        self._inner, self._x, self._method = inner, explainer, method

    def result(self, timeout=None):
        try:
            out = self._inner.result(timeout)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e, self._method) from None
        self._x.connected = True
        return out

    def exception(self, timeout=None):
        e = self._inner.exception(timeout)
        if e is None:
            self._x.connected = True
        return self._x.explain(e, self._method)

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
            raise self._x.explain_rpc(e, self._method) from None
        self._x.connected = True
        return out


class _Unary:
    """A unary-response multicallable (unary-unary or stream-unary) of ``method`` whose
    errors are explained."""

    def __init__(self, inner, explainer: _Explainer, method: str):
        self._inner, self._x, self._method = inner, explainer, method

    def __call__(self, request, **kw):
        try:
            out = self._inner(request, **kw)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e, self._method) from None
        self._x.connected = True
        return out

    def with_call(self, request, **kw):
        try:
            out = self._inner.with_call(request, **kw)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e, self._method) from None
        self._x.connected = True
        return out

    def future(self, request, **kw):
        return _Outcome(self._inner.future(request, **kw), self._x, self._method)


class _Streaming:
    """A response-streaming multicallable (unary-stream or stream-stream) of ``method``,
    explained."""

    def __init__(self, inner, explainer: _Explainer, method: str):
        self._inner, self._x, self._method = inner, explainer, method

    def __call__(self, request, **kw):
        try:
            return _Responses(self._inner(request, **kw), self._x, self._method)
        except grpc.RpcError as e:
            raise self._x.explain_rpc(e, self._method) from None


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
        return _Unary(self._ch.unary_unary(method, *args, **kw), self._x, method)

    def stream_unary(self, method, *args, **kw):
        return _Unary(self._ch.stream_unary(method, *args, **kw), self._x, method)

    def unary_stream(self, method, *args, **kw):
        return _Streaming(self._ch.unary_stream(method, *args, **kw), self._x, method)

    def stream_stream(self, method, *args, **kw):
        return _Streaming(self._ch.stream_stream(method, *args, **kw), self._x, method)

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
