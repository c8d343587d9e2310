"""A checkpoint snapshot put on a node over a socket data-plane link: what ``PutSnapshot``
is on gRPC, for a stage shipping its snapshot to its buddy
(:class:`fedpipe.node.snapshots.Checkpoints`) and a client restoring a saved checkpoint
(:func:`fedpipe.client.links.put_snapshot`).

The receiving node puts the tensors together by their envelope
(:meth:`fedpipe.node.snapshots.SnapshotDesk.admit_part`) after ``PutSnapshot``'s
checks (:mod:`fedpipe.node.dataplane`). Contract: ``protos/fedpipe/v1/FRAMES.md``.
"""
from __future__ import annotations

import contextlib

from ..net import dataplane, timeouts
from ..proto import node_pb2
from .checkpoint import Snapshot, to_tensors


def send_snapshot(link: dataplane.Link, envelope: node_pb2.Envelope, snap: Snapshot) -> None:
    """Put ``snap`` on the node at the other end of ``link``: its tensors in
    :func:`~fedpipe.runtime.checkpoint.to_tensors`' order, each with ``envelope``
    (``KIND_SNAPSHOT``, its job, stage key and step; the receiver puts them together by
    it) and its name, from their own memory (a snapshot is a copy nobody changes);
    returns once the node kept it: its own tensors acknowledged, whatever else is sent
    on the link meanwhile, within :data:`~fedpipe.net.timeouts.FETCH_STATE_RPC` (as
    ``PutSnapshot``'s deadline).

    Raises:
        PeerRefused: the node refused it (a WireError; ``code``: the status gRPC's
            ``PutSnapshot`` would end with); a refusal is raised here only, never to
            another sender on the same link (:func:`~fedpipe.net.dataplane.owner_of`).
        LinkFailed: the link failed, or the node did not acknowledge it in time.
    """
    owner, last = dataplane.owner_of(envelope), -1
    try:
        for name, t in to_tensors(snap):
            last = link.send(t, envelope=envelope, name=name)
    except dataplane.PeerRefused:
        # refused already (its other tensors are refused too): wait for what was sent, so
        # that no refusal of this snapshot is left on the link, then say the first
        with contextlib.suppress(dataplane.PeerRefused):
            link.flush(timeout=timeouts.FETCH_STATE_RPC, owner=owner, through=last)
        raise
    link.flush(timeout=timeouts.FETCH_STATE_RPC, owner=owner, through=last)
