"""One server interceptor that authenticates and authorizes every call, for all four RPC shapes.

``AuthInterceptor(authenticator)`` goes on every server (``grpc.server(...,
interceptors=[...])``). For each call it reads the caller's certificate from the
TLS auth context (:class:`fedpipe.security.tls.Authenticator`), checks the
method's row of :data:`fedpipe.security.policy.POLICY` (default deny), checks
each request message where the row says so (a client's Send kinds), and leaves
the identity on the servicer context, where the servicer reads it with
:func:`identity_of` for the checks that need job knowledge.

A refused call ends before the servicer runs, with UNAUTHENTICATED (no
certificate, another CA, expired, revoked) or PERMISSION_DENIED (wrong role for
the method, not in the table) and a one-line message that says which. The
server goes on serving everyone else.

With ``authenticator=None`` (a server without TLS) every call is admitted and
:func:`identity_of` returns None, so services need one code path for both modes.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator, Mapping

import grpc

from .certs import Identity
from .errors import SecurityError
from .policy import POLICY, Rule, authorize
from .tls import Authenticator

log = logging.getLogger(__name__)

_ATTR = "_fedpipe_identity"


def identity_of(context: grpc.ServicerContext) -> Identity | None:
    """The caller of the current call, as the :class:`AuthInterceptor` found it.

    Returns:
        The identity, or None on a server without TLS.

    Raises:
        RuntimeError: no AuthInterceptor saw this call (the server was built
            without it): a wiring bug, never to be read as "no TLS".
    """
    try:
        return getattr(context, _ATTR)
    except AttributeError:
        raise RuntimeError("no AuthInterceptor admitted this call; build servers with "
                           "fedpipe.net so every one has it") from None


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticate the caller, enforce the policy table, record the identity; every RPC shape.

    Args:
        authenticator: checks callers' certificates; None on a server without TLS.
        table: the policy, by full method name (tests add rows for their own services).
    """

    def __init__(self, authenticator: Authenticator | None,
                 table: Mapping[str, Rule] = POLICY):
        self.authenticator = authenticator
        self.table = table

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # no such method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        return _wrap(handler, lambda context: self._admit(method, context))

    def _admit(self, method: str,
               context: grpc.ServicerContext) -> tuple[Identity | None, Rule | None]:
        identity: Identity | None = None
        rule = self.table.get(method)
        if self.authenticator is not None:
            try:
                try:
                    identity = self.authenticator.authenticate(context.auth_context())
                except SecurityError:
                    if rule is None or not rule.public:
                        raise
                if identity is not None:
                    rule = authorize(method, identity, self.table)
            except SecurityError as e:
                log.info("refused %s from %s: %s", method, context.peer(), e)
                context.abort(e.code, str(e))
        setattr(context, _ATTR, identity)
        return identity, rule


def _checked(messages: Iterator, identity: Identity, rule: Rule,
             context: grpc.ServicerContext) -> Iterator:
    for m in messages:
        _check_message(m, identity, rule, context)
        yield m


def _check_message(message, identity: Identity | None, rule: Rule | None,
                   context: grpc.ServicerContext) -> None:
    if identity is None or rule is None or rule.message_check is None:
        return
    try:
        rule.message_check(identity, message)
    except SecurityError as e:
        log.info("refused a message from %s: %s", identity, e)
        context.abort(e.code, str(e))


def _wrap(handler: grpc.RpcMethodHandler,
          admit: Callable[[grpc.ServicerContext], tuple[Identity | None, Rule | None]]
          ) -> grpc.RpcMethodHandler:
    # each wrapper admits before the servicer runs; for a streaming response that
    # is before the first message, so a refused caller gets no partial answer
    ser, de = handler.response_serializer, handler.request_deserializer
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        def unary_unary(request, context):
            identity, rule = admit(context)
            _check_message(request, identity, rule, context)
            return inner_uu(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, de, ser)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        def unary_stream(request, context):
            identity, rule = admit(context)
            _check_message(request, identity, rule, context)
            return inner_us(request, context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, de, ser)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        def stream_unary(requests, context):
            identity, rule = admit(context)
            if identity is not None and rule is not None and rule.message_check is not None:
                requests = _checked(requests, identity, rule, context)
            return inner_su(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, de, ser)
    if handler.stream_stream:
        inner_ss = handler.stream_stream

        def stream_stream(requests, context):
            identity, rule = admit(context)
            if identity is not None and rule is not None and rule.message_check is not None:
                requests = _checked(requests, identity, rule, context)
            return inner_ss(requests, context)
        return grpc.stream_stream_rpc_method_handler(stream_stream, de, ser)
    raise TypeError(f"a method handler of no known RPC shape: {handler!r}")
