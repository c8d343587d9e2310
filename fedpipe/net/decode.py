"""Requests that do not parse are refused with INVALID_ARGUMENT naming the message type.

gRPC Python parses a request with the handler's ``request_deserializer`` before
any application code runs; when that raises, it answers ``INTERNAL: Exception
deserializing request!`` (which says neither what nor why, and reads as a
server fault) and logs a traceback at ERROR for every such call, so a stranger
can fill a server's log. :class:`ParseRequests` takes the parsing over: the
handler gets raw bytes from gRPC, parses them itself and refuses a request that
does not parse with ``INVALID_ARGUMENT: request to /fedpipe.v1.Node/Ping does
not parse as fedpipe.v1.PingRequest: ...``. Methods without a deserializer (the
data plane's wire frames, :mod:`fedpipe.wire.format`) pass untouched.
"""
from __future__ import annotations

from typing import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError


def _type_name(deserializer: Callable) -> str:
    """``fedpipe.v1.PingRequest`` for ``PingRequest.FromString`` (else the callable's name)."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", getattr(deserializer, "__qualname__", "its type"))


class ParseRequests(grpc.ServerInterceptor):
    """Parse every request in the handler, refusing one that does not parse (all four shapes).

    Put it first among a server's interceptors, so the ones after it (and the
    services) see parsed messages, as they would without it.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, parse = handler_call_details.method, handler.request_deserializer
        what = _type_name(parse)

        def one(request: bytes, context: grpc.ServicerContext):
            try:
                return parse(request)
            except (DecodeError, ValueError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request to {method} does not parse as {what}: {e}")

        def each(requests: Iterator[bytes], context: grpc.ServicerContext):
            for r in requests:
                yield one(r, context)

        ser = handler.response_serializer
        if handler.unary_unary:
            uu = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(
                lambda r, c: uu(one(r, c), c), response_serializer=ser)
        if handler.unary_stream:
            us = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                lambda r, c: us(one(r, c), c), response_serializer=ser)
        if handler.stream_unary:
            su = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(
                lambda rs, c: su(each(rs, c), c), response_serializer=ser)
        ss = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            lambda rs, c: ss(each(rs, c), c), response_serializer=ser)
