"""A call's failure as gRPC raises it, for failures that did not come from a gRPC call.

:class:`StatusError` is a ``grpc.RpcError`` (and ``grpc.Call``) with a status code and
details, so code that handles a failed call (retries by ``code()``, the feed's recovery,
the error tables) handles it the same: a socket link's refusal, a reason put on a call's
error, or a test's failing fake.
"""
from __future__ import annotations

import grpc


class StatusError(grpc.RpcError, grpc.Call):
    """A failure with gRPC status ``code`` and ``details``; ``str()`` is
    ``"CODE_NAME: details"``. It answers grpc.Call's other methods as an ended call."""

    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self.code().name}: {self.details()}"

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False
