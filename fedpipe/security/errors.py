"""The two ways a call is refused, as domain errors that carry their gRPC status code."""
from __future__ import annotations

import grpc


class SecurityError(Exception):
    """A refused call; ``code`` is the gRPC status a server answers with, the message one line."""

    code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(SecurityError):
    """The caller's certificate does not prove who it is: none, another CA's, expired, revoked."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SecurityError):
    """The caller is known but may not do this: the wrong role, or not its node or job."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DenyListUnreadable(SecurityError):
    """This server cannot read its deny list, so it refuses every caller until it can."""

    code = grpc.StatusCode.UNAVAILABLE
