"""The one table from the tracker's domain errors to gRPC status codes.

Every handler of :class:`~.service.TrackerService` is wrapped in :func:`unary` or
:func:`stream`, which answer a :class:`~.errors.TrackerError` with its code from
:data:`STATUS` (a :class:`~fedpipe.security.SecurityError` carries its own), so the
same error never means one code in one handler and another elsewhere.
"""
from __future__ import annotations

import functools

import grpc

from ..security import SecurityError
from . import errors

STATUS: dict[type[errors.TrackerError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}
"""The status code of each domain error."""


def status_of(error: errors.TrackerError) -> grpc.StatusCode:
    """The status code for a domain error (its nearest mapped base class; else INTERNAL)."""
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def unary(method):
    """Answer a unary RPC whose domain call raised a :class:`~.errors.TrackerError` (or whose
    identity check raised a :class:`~fedpipe.security.SecurityError`) with that error's
    status code and message."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            return method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
        except SecurityError as e:
            context.abort(e.code, str(e))
    return call


def stream(method):
    """:func:`unary` for a server-streaming RPC."""
    @functools.wraps(method)
    def call(self, request, context):
        try:
            yield from method(self, request, context)
        except errors.TrackerError as e:
            context.abort(status_of(e), str(e))
        except SecurityError as e:
            context.abort(e.code, str(e))
    return call
