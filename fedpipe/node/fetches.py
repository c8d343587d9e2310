"""What a node answers ``FetchState`` and ``FetchSnapshot`` with, on either data plane.

One home for the checks and the answer of each fetch, so gRPC's handlers
(:class:`~fedpipe.node.service.NodeService`) and the socket data plane's server
(:meth:`fedpipe.node.dataplane.NodeReceiver.serve`) answer alike: the caller must be
the job's own client or a node of its plans
(:meth:`~fedpipe.node.access.JobAccessBook.require_owner_or_assigned`), then the
stage (or the snapshot of that step) must be held here. The checks run when the
function is called, before a tensor is produced; the per-method policy and the
deny list are the transport's (gRPC's interceptor; the socket server's own look).
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..proto import node_pb2
from ..runtime import checkpoint
from ..security import Identity
from ..spec import StageKey
from .access import JobAccessBook
from .lifecycle import StageSlot
from .snapshots import SnapshotDesk
from .stages import StageRegistry

Named = Iterator[tuple[str, torch.Tensor]]
"""An answer: named tensors, in the order they are sent."""


def state(access: JobAccessBook, stages: StageRegistry, identity: Identity | None,
          request: node_pb2.FetchStateRequest) -> Named:
    """``FetchState``: the stage's weights, named as in the whole model
    (``"<global layer>.<name>"``); the stage's live tensors, not copies.

    Raises:
        SecurityError: the caller may not fetch the job's state.
        PermissionDenied: a job this node does not know (its access book).
        NoSuchStage: the stage is not held here.
    """
    access.require_owner_or_assigned(identity, request.job_id)
    return stages.get(StageSlot(request.job_id, request.replica, request.stage)).weights()


def snapshot(access: JobAccessBook, desk: SnapshotDesk, identity: Identity | None,
             request: node_pb2.FetchSnapshotRequest) -> Named:
    """``FetchSnapshot``: the kept snapshot (its skeleton first,
    :func:`~fedpipe.runtime.checkpoint.to_tensors`), or with ``layer_end`` > 0 only
    those layers of it, in layer form.

    Raises:
        SecurityError: the caller may not fetch the job's state.
        NoSuchSnapshot: no snapshot of that stage and step is kept here.
        SplitError: those layers cannot be cut from it.
    """
    access.require_owner_or_assigned(identity, request.job_id)
    snap = desk.snapshot(request.job_id, StageKey(request.replica, request.stage),
                         request.step, request.layer_start, request.layer_end)
    return checkpoint.to_tensors(snap)
