"""A node's parts, built in one order, each given the collaborators it calls.

The order: channels, mailbox, snapshot store, reporter, restorer, checkpoints,
stage loop, the wiring of a stage, the registry, then the data plane, the
socket data plane's listener (when the node has a data port), the snapshot
desk, the job access book and the stream watch. The servicer
(:class:`~fedpipe.node.service.NodeService`) receives the result; a test may
hand it fakes instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


import torch

from ..net import timeouts
from ..net.dataplane import DataPlane as SocketPlane
from ..net.dataplane import staging
from ..net.dataplane.caps import Sources
from ..net.emulation import LinkProfile, Pacer
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2, tracker_pb2
from ..security import Authenticator, TlsConfig
from ..spec import StageKey
from ..runtime.checkpoint import Snapshot
from .access import JobAccessBook, Quorum
from .admission import BOUNDED_KINDS, DataPlane, inbox_job
from .dataplane import NodeReceiver
from .initial import WeightsDesk
from .lifecycle import Stage, StageSlot
from .mailbox import JOB_TENSORS, Mailbox
from .memory import StageMemory
from .peers import ChannelPool, Shaper, StagePeers
from .reports import StageReporter
from .restore import Restorer
from .running import StageLoop
from .snapshots import MAX_SNAPSHOT_BYTES, Checkpoints, SnapshotDesk, SnapshotStore
from .stages import StageBuilder, StageRegistry
from .streams import StreamWatch
from .wiring import ElasticHooks, build_stage

JOB_SNAPSHOT_BYTES = 4 * MAX_SNAPSHOT_BYTES
"""Default of the most bytes one job's kept snapshots may take on a node: room for
:data:`~fedpipe.spec.SNAPSHOTS_KEPT` (2) snapshots of two stages at the largest snapshot
size, or many more of small stages; a buddy's made-up or flooding PutSnapshots stop there."""


@dataclass(frozen=True)
class NodeParts:
    """What the node's servicer calls.

    Attributes:
        stages: the stages held here and their life cycle.
        data: admits and delivers tensors (Send).
        desk: keeps and serves snapshots (PutSnapshot, FetchSnapshot).
        access: who may act on which job, and the checks.
        streams: the watch over open data-plane streams.
        channels: the node's shared channels to its peers.
        shaper: the emulated link to a peer, by its node name (None: none).
        pacer: the same emulated link for the socket data plane (None: none).
        weights: takes stages' streamed initial weights in (PutWeights).
        sockets: the node's socket data plane (None: gRPC only).
        receiver: where the socket data plane's tensors are admitted (None with it).
    """

    stages: StageRegistry
    data: DataPlane
    desk: SnapshotDesk
    access: JobAccessBook
    streams: StreamWatch
    channels: ChannelPool
    shaper: Callable[[str], Shaper | None]
    weights: WeightsDesk
    pacer: Callable[[str], Pacer | None] = lambda name: None
    sockets: SocketPlane | None = None
    receiver: NodeReceiver | None = None

    def close(self) -> None:
        """Close the socket data plane (its listener and links), if the node has one."""
        if self.receiver is not None:
            self.receiver.close()
        if self.sockets is not None:
            self.sockets.close()


def build_parts(node_id: Callable[[], str], name: str, resources: node_pb2.Resources,
                report: Callable[[tracker_pb2.StageReport], None], *, trust_code: bool = False,
                input_capacity: int = 64, job_tensors: int = JOB_TENSORS,
                links: LinkProfile | None = None, metrics: NodeMetrics | None = None,
                tls: TlsConfig | None = None, idle_stream: float = timeouts.IDLE_STREAM,
                job_snapshot_bytes: int | None = None,
                quorum: Quorum | None = None, data_port: int | None = None,
                data_host: str = "127.0.0.1", snapshot_dir: str | None = None,
                data_sources: Sources | None = None) -> NodeParts:
    """Build a node's parts.

    Args:
        node_id: returns the tracker-assigned id (known after registration).
        name: this node's name (what link profiles and peers call it).
        resources: what :func:`fedpipe.node.probe.probe` measured.
        report: sends a StageReport to the tracker (may block briefly).
        trust_code: without TLS, load pickled layers from any peer, not only loopback
            ones (with TLS, only jobs signed by a client certificate load).
        input_capacity: inputs/targets a stage may have queued before Send blocks.
        job_tensors: tensors one job may have waiting on this node before Send refuses
            more (RESOURCE_EXHAUSTED; see :class:`~fedpipe.node.mailbox.Mailbox`).
        links: an emulated link profile for this node's outgoing traffic.
        metrics: where stages report their step times and senders count their bytes
            (None: no metrics).
        tls: this node's certificate, for mutual TLS to its peers (None: plaintext).
        idle_stream: seconds a data-plane stream may carry nothing while it serves no
            job running here, before it is closed (:class:`~fedpipe.node.streams.StreamWatch`).
        job_snapshot_bytes: the most bytes one job's snapshots may take on this node, its
            own stages' and those sent by PutSnapshot together; a PutSnapshot past it is
            refused with RESOURCE_EXHAUSTED (None: :data:`JOB_SNAPSHOT_BYTES`, at most
            half of ``resources.memory_bytes``).
        quorum: one ReplicaQuorum call to the tracker (elastic replica groups; None:
            this node cannot run stages of elastic jobs).
        data_port: listen for the socket data plane (:mod:`fedpipe.net.dataplane`) on
            this port of ``data_host`` (0: a free one), and send to peers that offer one
            over it; None: gRPC only.
        snapshot_dir: keep snapshots as files in this directory, this node's own
            (:class:`~fedpipe.node.snapshots.SnapshotStore`), not in memory; one job's
            may then take :data:`JOB_SNAPSHOT_BYTES` whatever the memory. None: in memory.
        data_sources: the dialers of streams a relay splices to the data plane (a
            relayed node's; :class:`~fedpipe.net.dataplane.caps.Sources`).

    Raises:
        OSError: ``data_port`` is in use (or cannot be bound), or ``snapshot_dir``
            cannot be made.
        ~fedpipe.node.snapfiles.SnapshotDirInUse: ``snapshot_dir`` is another live node's.
    """
    if job_snapshot_bytes is None:
        job_snapshot_bytes = JOB_SNAPSHOT_BYTES if snapshot_dir is not None else \
            min(JOB_SNAPSHOT_BYTES, resources.memory_bytes // 2 or JOB_SNAPSHOT_BYTES)
    # checks job signatures against the swarm CA and deny list (None: no TLS)
    verifier: Authenticator | None = tls.authenticator() if tls is not None else None
    access = JobAccessBook(verifier, trust_code)

    def shaper(peer_name: str) -> Shaper | None:
        return links.shaper(name, peer_name) if links else None

    def pacer(peer_name: str) -> Pacer | None:
        return links.pacer(name, peer_name) if links else None

    sockets: list[SocketPlane] = []  # the listener, made once the registry is

    channels = ChannelPool(tls)
    mailbox = Mailbox(input_capacity, bounded=BOUNDED_KINDS, job_cap=job_tensors,
                      job_of=inbox_job)
    try:
        snapshots = SnapshotStore(directory=snapshot_dir)
    except OSError as e:
        raise OSError(e.errno, f"cannot use snapshot directory {snapshot_dir}: "
                               f"{e.strerror or e}") from e
    device = torch.device(resources.device or "cpu")
    memory = StageMemory(device, resources.memory_bytes)
    reporter = StageReporter(node_id, report, metrics, memory)
    restorer = Restorer(snapshots, channels, lambda: sockets[0] if sockets else None)
    # a snapshot goes to a buddy that offers a data port over the socket plane
    checkpoints = Checkpoints(snapshots, channels, reporter,
                              lambda: sockets[0] if sockets else None)
    loop = StageLoop(reporter, checkpoints, mailbox, restorer)
    build = stage_builder(device, mailbox, node_id,
                          snapshots.put, reporter, access.learning(quorum), memory)
    # a CUDA node stages what it sends through pinned host memory, and receives into it
    copier = staging.CudaCopier() if device.type == "cuda" else None
    stages = StageRegistry(build, lambda: StagePeers(channels, shaper, metrics,
                                                     sockets[0] if sockets else None, pacer,
                                                     copier),
                           restorer, loop, mailbox, snapshots, reporter, memory,
                           job_over=lambda job: sockets[0].end_job(job) if sockets else 0)
    streams = StreamWatch(stages.runs, idle_stream,
                          revoked_serials=verifier.revoked_serials
                          if verifier is not None else None)
    data = DataPlane(stages, mailbox, reporter, pinned=device.type == "cuda")
    desk = SnapshotDesk(snapshots, stages.holds, job_snapshot_bytes)
    weights = WeightsDesk(stages.get)
    receiver = None
    if data_port is not None:
        receiver = NodeReceiver(access, data, stages, verifier.revoked_serials
                                if verifier is not None else None, desk, weights)
        try:
            sockets.append(SocketPlane(name, receiver, host=data_host, port=data_port,
                                       tls=tls, events=receiver, sources=data_sources,
                                       server=receiver))
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on data port {data_port} of {data_host}: "
                                   f"{e.strerror or e}") from e
    return NodeParts(stages=stages, data=data,
                     desk=desk,
                     access=access, streams=streams, channels=channels, shaper=shaper,
                     pacer=pacer,
                     weights=weights,
                     sockets=sockets[0] if sockets else None, receiver=receiver)


def stage_builder(device: torch.device, mailbox: Mailbox, node_id: Callable[[], str],
                  keep: Callable[[str, StageKey, Snapshot], object], reporter: StageReporter,
                  quorum: Quorum | None, memory: StageMemory | None = None) -> StageBuilder:
    """How this node wires a stage (:func:`~fedpipe.node.wiring.build_stage`): on
    ``device``, over ``mailbox``; a stage of an elastic job reaches the tracker's
    ``quorum``, keeps a joining group's state with ``keep`` and reports a peer a
    send failed to through ``reporter``; ``memory`` measures the stage's peak from
    when its code is unpickled (its imports are the node's, not the stage's)."""
    def suspect(stage: Stage, address: str) -> None:
        reporter.report(stage, tracker_pb2.StageReport.STATUS_SUSPECT, peer=address,
                        error=f"a replica sync send to {address} failed")

    def elastic(stage: Stage) -> ElasticHooks:
        if quorum is None:
            raise ValueError("an elastic job's stage needs a node that reaches a tracker")
        return ElasticHooks(stage, quorum, node_id, keep, suspect)

    def build(request: node_pb2.LoadStageRequest, peers: StagePeers) -> Stage:
        slot = StageSlot(request.job_id, request.replica, request.stage)
        return build_stage(request, device, mailbox, peers, elastic,
                           (lambda: memory.rebase(slot)) if memory is not None else None)
    return build
