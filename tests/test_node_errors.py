"""One error table for the node: every handler of the node's servicer, made to meet every
domain error, answers with the status code :data:`fedpipe.node.errors.STATUS` gives it.

In process: the servicer is built over fakes that raise, and called with a fake
context; no server, no process.
"""
from __future__ import annotations

import contextlib
from typing import Any

import grpc
import pytest

from fedpipe.node import errors
from fedpipe.node.errors import STATUS, status_of
from fedpipe.node.parts import NodeParts
from fedpipe.node.service import NodeService
from fedpipe.proto import node_pb2
from fedpipe.runtime.checkpoint import SnapshotTooLarge
from fedpipe.security.errors import PermissionDenied, SecurityError, Unauthenticated
from fedpipe.wire import WireError

pytestmark = pytest.mark.timeout(30)


class Aborted(Exception):
    """What the fake context's abort raises (as grpc's does), with the code and details."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """A servicer context of a call without TLS (the interceptor saw no identity)."""

    _fedpipe_identity = None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def is_active(self) -> bool:
        return True


class Raising:
    """A collaborator each of whose calls raises ``error``; records what was called."""

    def __init__(self, error: BaseException, calls: list[str]):
        self._error, self._calls = error, calls

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            raise self._error
        return call


class Watched:
    def track(self, messages):
        return messages

    def belongs_to(self, job_id: str) -> None:
        pass


class Streams:
    """The stream watch, passing everything through: the errors come from the domain."""

    @contextlib.contextmanager
    def open(self, context, method, job_id=""):
        yield Watched()


def service(error: BaseException, calls: list[str]) -> NodeService:
    fake = Raising(error, calls)
    parts = NodeParts(stages=fake, data=fake, desk=fake, access=fake,  # type: ignore[arg-type]
                      streams=Streams(), channels=fake,  # type: ignore[arg-type]
                      shaper=lambda name: None, weights=fake)  # type: ignore[arg-type]
    return NodeService(lambda: "n0", "n0", node_pb2.Resources(device="cpu"),
                       lambda report: None, parts=parts)


FRAME = b"\x00"
REQUESTS = {
    "Probe": lambda: node_pb2.ProbeRequest(),
    "LoadStage": lambda: node_pb2.LoadStageRequest(job_id="j", layers=[b"layer"]),
    "StopJob": lambda: node_pb2.StopJobRequest(job_id="j"),
    "FetchState": lambda: node_pb2.FetchStateRequest(job_id="j"),
    "PutSnapshot": lambda: iter([FRAME]),
    "PutWeights": lambda: iter([FRAME]),
    "FetchSnapshot": lambda: node_pb2.FetchSnapshotRequest(job_id="j", step=1),
    "Send": lambda: iter([FRAME]),
    "SendOne": lambda: FRAME,
    "HoldAt": lambda: node_pb2.HoldAtRequest(job_id="j", step=1),
    "AssignJob": lambda: node_pb2.AssignJobRequest(job_id="j", node_names=["n1"]),
    "Ping": lambda: node_pb2.PingRequest(),
    "MeasureLinks": lambda: node_pb2.MeasureLinksRequest(peers=[node_pb2.Peer(
        node_id="n1", address="127.0.0.1:1", name="n1")]),
}
"""A request of each RPC that passes what the handler checks itself, so it calls on."""
CALLS_NOTHING = {"Probe", "Ping"}
"""Handlers that answer from what the servicer holds, calling no collaborator."""
SERVER_STREAMING = {"FetchState", "FetchSnapshot"}

ERRORS = [cls("refused") for cls in STATUS] + [PermissionDenied("not yours"),
                                              Unauthenticated("who are you")]


def call(svc: NodeService, method: str) -> Any:
    handler = getattr(svc, method)
    result = handler(REQUESTS[method](), Context())
    return list(result) if method in SERVER_STREAMING else result


def test_the_walk_covers_every_rpc_of_the_node_service_and_each_wears_the_decorator():
    rpcs = set(node_pb2.DESCRIPTOR.services_by_name["Node"].methods_by_name)
    assert rpcs == set(REQUESTS)
    for method in rpcs:
        assert getattr(getattr(NodeService, method), "maps_errors", False), method


@pytest.mark.parametrize("method", sorted(set(REQUESTS) - CALLS_NOTHING))
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_handler_answers_every_domain_error_with_the_tables_code(method, error):
    calls: list[str] = []
    with pytest.raises(Aborted) as e:
        call(service(error, calls), method)
    assert calls, f"{method} called no collaborator"
    want = error.code if isinstance(error, SecurityError) else STATUS[type(error)]
    assert e.value.code is want and e.value.code is status_of(error)
    assert e.value.details == str(error)


@pytest.mark.parametrize("method", sorted(CALLS_NOTHING))
def test_probe_and_ping_call_nothing_that_could_raise(method):
    calls: list[str] = []
    assert call(service(errors.NoSuchStage("x"), calls), method) is not None
    assert calls == []


@pytest.mark.parametrize("method", sorted(set(REQUESTS) - CALLS_NOTHING))
def test_an_error_outside_the_table_is_not_dressed_as_a_status(method):
    """A bug (or a broken stream, grpc.RpcError) propagates as it is: gRPC answers it
    UNKNOWN, or the stream's own status, never one of the table's codes by accident."""
    with pytest.raises(ZeroDivisionError):
        call(service(ZeroDivisionError("bug"), []), method)


def test_the_disagreements_of_old_are_settled_by_the_table():
    # NoSuchStage was FAILED_PRECONDITION in PutSnapshot and NOT_FOUND elsewhere
    assert status_of(errors.NoSuchStage("x")) is grpc.StatusCode.NOT_FOUND
    # a duplicate tensor was a bare KeyError; now its own error, and a KeyError maps to nothing
    assert status_of(errors.Duplicate("x")) is grpc.StatusCode.ALREADY_EXISTS
    assert status_of(KeyError("x")) is grpc.StatusCode.INTERNAL
    # a subclass takes its nearest mapped base: a snapshot too large is no malformed one
    assert status_of(SnapshotTooLarge("x")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(WireError("x")) is grpc.StatusCode.INVALID_ARGUMENT
    assert all(issubclass(cls, errors.NodeError) for cls in STATUS
               if cls.__module__ == errors.__name__)
