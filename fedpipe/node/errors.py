"""The node's domain errors, the one table that gives each its gRPC status code, and the
decorator every handler of :class:`~fedpipe.node.service.NodeService` wears.

The domain modules (:mod:`.stages`, :mod:`.admission`, :mod:`.snapshots`,
:mod:`.mailbox`, :mod:`.access`) raise these without knowing of gRPC;
:func:`maps_errors` answers a call that raised one with :data:`STATUS`'s code
for it (its nearest mapped base class) and its message, as the tracker's
:mod:`fedpipe.tracker.errors` does. Errors of the layers below that carry a
meaning of their own (:class:`~fedpipe.wire.WireError`, a snapshot past its
limit, a layer split that cannot be made) are in the table too; a
:class:`~fedpipe.security.SecurityError` carries its own code (the policy's).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

import grpc

from ..runtime.checkpoint import SnapshotTooLarge
from ..runtime.layerstate import SplitError
from ..runtime.weights import WeightsError
from ..security import SecurityError
from ..wire import WireError


class NodeError(Exception):
    """Base of the errors a node call can answer with; the message goes to the caller."""


class InvalidRequest(NodeError):
    """A request that is malformed in itself (no layers, too many peers, no job named)."""


class StageLoadError(NodeError):
    """A stage cannot be built from its request: bad config, plan, layers or optimizer, or
    no snapshot of its resume step could be found or restored."""


class BadEnvelope(NodeError):
    """A tensor's envelope names a kind, batch size, step or microbatch the stage cannot take."""


class CodeRefused(NodeError):
    """Pickled model code from a caller this node does not take code from."""


class NoSuchStage(NodeError):
    """No (running) stage of that job on this node."""


class NoSuchSnapshot(NodeError):
    """No snapshot of that stage and step is kept on this node."""


class HasWeights(NodeError):
    """PutWeights for a stage that has its initial weights (it made or read them itself,
    restores a snapshot, or another stream already gave them)."""


class StageExists(NodeError):
    """That stage of that job is already loaded on this node."""


class Duplicate(NodeError):
    """A tensor with the same key (stage, kind, step, microbatch) is already waiting."""


class StaleEpoch(NodeError):
    """A message of another plan epoch than the stage's: from before a recovery, never taken."""


class Stopped(NodeError):
    """The stage a put or get waited on was stopped (or the caller went away)."""


class MemoryTooSmall(StageLoadError):
    """A stage predicted to need more memory than the node has left under its limit; the
    message gives both figures (:class:`~fedpipe.node.memory.StageMemory`)."""


class Full(NodeError):
    """A job already has as many tensors waiting on this node as one job may; the message
    gives the figures (:class:`~fedpipe.node.mailbox.Mailbox`)."""


STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StageLoadError: grpc.StatusCode.INVALID_ARGUMENT,
    BadEnvelope: grpc.StatusCode.INVALID_ARGUMENT,
    WireError: grpc.StatusCode.INVALID_ARGUMENT,
    CodeRefused: grpc.StatusCode.PERMISSION_DENIED,
    NoSuchStage: grpc.StatusCode.NOT_FOUND,
    NoSuchSnapshot: grpc.StatusCode.NOT_FOUND,
    StageExists: grpc.StatusCode.ALREADY_EXISTS,
    HasWeights: grpc.StatusCode.ALREADY_EXISTS,
    WeightsError: grpc.StatusCode.INVALID_ARGUMENT,
    Duplicate: grpc.StatusCode.ALREADY_EXISTS,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
    SplitError: grpc.StatusCode.FAILED_PRECONDITION,
    Stopped: grpc.StatusCode.ABORTED,
    Full: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MemoryTooSmall: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SnapshotTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""The status code of each domain error (a subclass takes its nearest mapped base's)."""

MAPPED: tuple[type[Exception], ...] = (*STATUS, SecurityError)
"""What :func:`maps_errors` answers with a status; anything else propagates as is."""


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code for ``error``: a security error's own, else the table's for its
    nearest mapped base class; INTERNAL for anything else."""
    if isinstance(error, SecurityError):
        return error.code
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


F = TypeVar("F", bound=Callable[..., Any])


def maps_errors(method: F) -> F:
    """Answer an RPC whose call raised a domain error (or an identity check's
    :class:`~fedpipe.security.SecurityError`) with :func:`status_of` its error and its
    message. Works on unary and client-streaming handlers (they return) and on
    server-streaming ones (generators)."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def streaming(self, request, context):
            try:
                yield from method(self, request, context)
            except MAPPED as e:
                context.abort(status_of(e), str(e))
        streaming.maps_errors = True  # type: ignore[attr-defined]
        return streaming  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except MAPPED as e:
            context.abort(status_of(e), str(e))
    unary.maps_errors = True  # type: ignore[attr-defined]
    return unary  # type: ignore[return-value]
