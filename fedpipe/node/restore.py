"""Restoring a stage's state from a checkpoint snapshot: kept on this node, fetched from
the nodes the tracker names, or assembled from layers of the old plan's stages.

The life cycle (:mod:`~fedpipe.node.stages`, :mod:`~fedpipe.node.running`) decides
when; :class:`Restorer` only finds the snapshot and loads it into the stage's parts.

A source that offers a data port (where this node has one too) is fetched from over
the socket data plane (:mod:`fedpipe.net.dataplane.fetch`: a relayed node through its
relay's data port, never its relayed gRPC port, on the job's own tagged link, which the
relay bounds by the job's share); one without, over gRPC's ``FetchSnapshot``. The
sources are gRPC addresses (what the tracker names); their nodes' names, data ports and
relays come from the load's plan and its ``snapshot_peers``
(:meth:`Restorer.learn`).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Collection

import grpc

from ..net import timeouts
from ..net.dataplane import DataPlane as SocketPlane, LinkFailed
from ..net.dataplane.records import Method
from ..proto import node_pb2
from ..runtime import checkpoint, layerstate
from ..spec import StageKey, peer_of
from ..wire import WireError, rpc
from .errors import StageLoadError
from .lifecycle import Stage
from .peers import ChannelPool
from .snapshots import MAX_SNAPSHOT_BYTES, SnapshotStore
from ..units import layer_range

log = logging.getLogger(__name__)


class Restorer:
    """Loads a stage's snapshot of its resume step (``stage.start``).

    Args:
        snapshots: the snapshots kept on this node (own and buddies'); a whole
            snapshot fetched for a stage's own key is kept there too.
        channels: the node's channels to the sources.
        sockets: the node's socket data plane (None: it has none; every fetch is gRPC's).
    """

    def __init__(self, snapshots: SnapshotStore, channels: ChannelPool,
                 sockets: Callable[[], SocketPlane | None] = lambda: None):
        self.snapshots, self.channels, self.sockets = snapshots, channels, sockets
        self._lock = threading.Lock()
        self._peers: dict[str, node_pb2.Peer] = {}  # a node's gRPC address -> it

    def learn(self, request: node_pb2.LoadStageRequest) -> None:
        """Remember the names, data ports and relays of the nodes ``request``'s plan and
        its ``snapshot_peers`` name, by address: where its sources are on the socket plane."""
        with self._lock:
            for a in request.plan.stages:
                self._peers[a.address] = peer_of(a)
            for p in request.snapshot_peers:
                self._peers[p.address] = p

    def restore(self, stage: Stage, sources: list[str],
                pieces: Collection[node_pb2.SnapshotPiece] = ()) -> None:
        """Load the stage's snapshot of ``stage.start``: kept here, else from ``sources``;
        or, given ``pieces`` (a plan that splits the layers otherwise), assemble it
        from those layers of the old stages' snapshots
        (:mod:`~fedpipe.runtime.layerstate`): each from the copy kept here if there is
        one, else fetched from its sources, only the layers that change hands.

        A corrupt or truncated snapshot is refused by the decoder and the next
        source is tried.

        Raises:
            StageLoadError: no source had a good snapshot (or piece) of that step, or
                the pieces do not make the stage (the message names what is missing).
        """
        try:
            if pieces:
                snap = layerstate.merge([self._piece(stage, p) for p in pieces])
            else:
                snap = self.snapshots.get(stage.job_id, stage.key, stage.start) or \
                    self._fetch(stage, stage.key, sources)
            layerstate.restore(stage.parts, snap)  # a resplit's pieces come in layer form
        except (WireError, RuntimeError, ValueError, KeyError) as e:
            raise StageLoadError(f"cannot restore stage {stage.key.stage} from its step "
                                 f"{stage.start} snapshot: {e}") from e

    def _piece(self, stage: Stage, piece: node_pb2.SnapshotPiece) -> checkpoint.Snapshot:
        """Layers ``[piece.layer_start, piece.layer_end)`` of old stage ``piece``'s
        snapshot of ``stage.start``, in layer form: from the copy kept here, else fetched."""
        key = StageKey(piece.replica, piece.stage)
        kept = self.snapshots.get(stage.job_id, key, stage.start)
        if kept is not None:
            return layerstate.split(kept, piece.layer_start, piece.layer_end)
        return self._fetch(stage, key, list(piece.sources), piece.layer_start, piece.layer_end)

    def _fetch(self, stage: Stage, key: StageKey, sources: list[str], layer_start: int = 0,
               layer_end: int = 0) -> checkpoint.Snapshot:
        """Stage ``key``'s snapshot of ``stage.start`` from the first of ``sources`` that
        has a good one (``layer_end`` > 0: only those layers, in layer form); a whole
        one of the stage's own key is kept here.

        Raises:
            StageLoadError: no source had it.
        """
        tried = []
        what = f"{layer_range(layer_start, layer_end)} of " if layer_end > 0 else ""
        request = node_pb2.FetchSnapshotRequest(
            job_id=stage.job_id, replica=key.replica, stage=key.stage, step=stage.start,
            layer_start=layer_start, layer_end=layer_end)
        for address in sources:
            try:
                snap, over = self._fetch_from(address, request)
            except (grpc.RpcError, WireError) as e:  # PeerRefused: a WireError
                detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
                log.info("could not fetch %sthe step %d snapshot of job %s stage %d (replica %d) "
                         "from %s: %s", what, stage.start, stage.job_id, key.stage,
                         key.replica, address, detail)
                tried.append(f"{address}: {detail}")
                continue
            if not layer_end:
                self.snapshots.put(stage.job_id, key, snap)
            # the state that changed hands (tests and benchmarks count it from this line)
            log.info("fetched %sthe step %d snapshot of job %s stage %d (replica %d) from %s: "
                     "%d tensors, %d bytes, over %s", what, snap.step, stage.job_id, key.stage,
                     key.replica, address, len(snap.tensors), snap.nbytes, over)
            return snap
        raise StageLoadError(f"no snapshot of step {stage.start} for stage {key.stage} "
                             f"(replica {key.replica}) of job {stage.job_id}: tried "
                             f"{'; '.join(tried) or 'no source'}")

    def _fetch_from(self, address: str, request: node_pb2.FetchSnapshotRequest
                    ) -> tuple[checkpoint.Snapshot, str]:
        """The snapshot ``request`` asks for, from the node at ``address``: over the socket
        data plane where both ends have a data port, else (or when that link fails) over
        gRPC; and which it was.

        Raises:
            grpc.RpcError, WireError (PeerRefused: the node refused).
        """
        plane, peer = self.sockets(), self._peers.get(address)
        if plane is not None and peer is not None and peer.data_address:
            assembler = checkpoint.Assembler(MAX_SNAPSHOT_BYTES)
            try:
                # through the source's relay: the job's own link, bounded by its share there
                plane.link(peer.name, peer.data_address, request.job_id,
                           relayed=bool(peer.relay)).fetch(
                    Method.FETCH_SNAPSHOT, request.SerializeToString(), assembler.admit,
                    assembler.add, timeouts.FETCH_STATE_RPC)
                return assembler.finish()[1], "the socket data plane"
            except LinkFailed as e:  # its data port may be gone while its gRPC port is not
                assembler.abort()
                log.info("fetching a snapshot from %s over its data port failed (%s): over "
                         "gRPC instead", address, e)
            except BaseException:
                assembler.abort()
                raise
        with self.channels.borrow(address) as ch:
            stream = rpc.NodeStub(ch).FetchSnapshot(request, timeout=timeouts.FETCH_STATE_RPC)
            return checkpoint.from_frames(stream, MAX_SNAPSHOT_BYTES)[1], "gRPC"
