"""The Node gRPC service: each RPC decodes its request, calls, and maps errors to status codes.

What it calls: :class:`~fedpipe.node.stages.StageRegistry` (the stages this
node holds and their life cycle) and :mod:`fedpipe.node.peers` (shared
channels to peers, link probes).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import grpc
import torch

from .. import net
from ..net import timeouts
from ..net.emulation import LinkProfile
from ..observe.metrics import NodeMetrics
from ..proto import node_pb2, node_pb2_grpc, tracker_pb2
from ..runtime import checkpoint, layerstate
from ..security import SecurityError, TlsConfig, identity_of
from ..security.certs import Role
from ..security.policy import (require_assigned, require_feeds_stage, require_owner,
                               require_owner_or_assigned)
from ..security.signing import verify_job
from ..spec import StageKey
from ..wire import WireError, frames
from ..wire.format import peek_header
from .mailbox import JOB_TENSORS, Full, Mailbox, Stopped
from .streams import StreamWatch, Watched
from .peers import (MAX_PINGS, MAX_PROBE_BYTES, MAX_PROBE_SECONDS, PROBE_BYTES, PROBE_PINGS,
                    PROBE_SECONDS, ChannelPool, Shaper, StagePeers, measure_link)
from .stages import (BOUNDED_KINDS, MAX_SNAPSHOT_BYTES, BadEnvelope, NoSuchStage, StageExists,
                     StageLoadError, StageRegistry, StageSlot, StaleEpoch, inbox_job)

log = logging.getLogger(__name__)

MAX_MEASURE_PEERS = 4096
"""The most peers one MeasureLinks call may ask a node to probe (each probe sends up to
``MAX_PROBE_BYTES``, so this bounds what one request can make a node send)."""
JOB_SNAPSHOT_BYTES = 4 * MAX_SNAPSHOT_BYTES
"""Default of the most bytes one job's kept snapshots may take on a node: room for
:data:`~fedpipe.spec.SNAPSHOTS_KEPT` (2) snapshots of two stages at the largest snapshot
size, or many more of small stages; a buddy's made-up or flooding PutSnapshots stop there."""
KNOWN_JOBS = 1024
"""Jobs whose owner and nodes a node remembers for its identity checks (the least recently
loaded go first; a forgotten job's calls are refused as if it had no owner)."""


@dataclass
class JobAccess:
    """Who may act on one job on this node, as the tracker said (LoadStage, AssignJob).

    Attributes:
        owner: the name of the client that submitted it ("" without TLS).
        nodes: the names of every node any of its plans assigned (all epochs: state
            moves from a node of an older plan to one of a newer, and the tracker names
            a new plan's nodes to the old plan's before they fetch, see AssignJob).
        keys: every stage key (replica group, position) of its plans: the only ones
            a snapshot may be kept under here.
    """

    owner: str
    nodes: set[str] = field(default_factory=set)
    keys: set[StageKey] = field(default_factory=set)


class NodeService(node_pb2_grpc.NodeServicer):
    """The Node service of one node process.

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
    """

    def __init__(self, node_id: Callable[[], str], name: str, resources: node_pb2.Resources,
                 report: Callable[[tracker_pb2.StageReport], None], *, trust_code: bool = False,
                 input_capacity: int = 64, job_tensors: int = JOB_TENSORS,
                 links: LinkProfile | None = None,
                 metrics: NodeMetrics | None = None, tls: TlsConfig | None = None,
                 idle_stream: float = timeouts.IDLE_STREAM,
                 job_snapshot_bytes: int | None = None,
                 quorum: Callable[[tracker_pb2.ReplicaQuorumRequest],
                                  tracker_pb2.ReplicaQuorumReply] | None = None):
        self.node_id, self.name, self.resources = node_id, name, resources
        self.links = links
        self.trust_code = trust_code
        if job_snapshot_bytes is None:
            job_snapshot_bytes = min(JOB_SNAPSHOT_BYTES,
                                     resources.memory_bytes // 2 or JOB_SNAPSHOT_BYTES)
        self.job_snapshot_bytes = job_snapshot_bytes
        self.tls = tls
        # checks job signatures against the swarm CA and deny list (None: no TLS)
        self.verifier = tls.authenticator() if tls is not None else None
        self.channels = ChannelPool(tls)
        self._jobs: collections.OrderedDict[str, JobAccess] = collections.OrderedDict()
        self._jobs_lock = threading.Lock()
        self.stages = StageRegistry(
            node_id, torch.device(resources.device or "cpu"),
            Mailbox(input_capacity, bounded=BOUNDED_KINDS, job_cap=job_tensors,
                    job_of=inbox_job),
            lambda: StagePeers(self.channels, self._shaper, metrics), report, self.channels,
            metrics=metrics, quorum=self._learning(quorum))
        self.streams = StreamWatch(self.stages.runs, idle_stream,
                                   revoked_serials=self.verifier.revoked_serials
                                   if self.verifier is not None else None)

    def _shaper(self, peer_name: str) -> Shaper | None:
        return self.links.shaper(self.name, peer_name) if self.links else None

    def stop_all(self) -> None:
        """Stop every stage (node shutdown)."""
        self.stages.stop_all()
        self.streams.close()

    def _check_signed(self, request: node_pb2.LoadStageRequest, context) -> None:
        """Abort unless a client certificate of the swarm CA signed this stage's code
        (see :mod:`fedpipe.security.signing`)."""
        assert self.verifier is not None
        mine = [a for a in request.plan.stages
                if (a.replica, a.stage) == (request.replica, request.stage)]
        if len(mine) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the plan has {len(mine)} assignments of stage {request.stage} "
                          f"(replica {request.replica}), not one")
        try:
            verify_job(self.verifier, owner=request.owner, client_cert=request.client_cert,
                       job_signature=request.job_signature, digests=request.layer_digests,
                       config=request.config, layers=request.layers,
                       first_layer=mine[0].layer_start)
        except SecurityError as e:
            log.warning("refused job %s: %s", request.job_id, e)
            context.abort(e.code, str(e))

    # -- identity checks (policy.py's require_*, with this node's knowledge) --
    def _learn(self, job_id: str, owner: str | None, names: Iterable[str],
               keys: Iterable[StageKey] = ()) -> None:
        """Remember that the tracker assigned the nodes ``names`` and stage ``keys`` to
        ``job_id`` (``owner``: its client, taken for a job not known yet)."""
        with self._jobs_lock:
            access = self._jobs.pop(job_id, None) or JobAccess(owner or "")
            access.nodes.update(names)
            access.keys.update(keys)
            self._jobs[job_id] = access
            while len(self._jobs) > KNOWN_JOBS:
                self._jobs.popitem(last=False)

    def _learn_plan(self, job_id: str, plan: node_pb2.Plan, owner: str | None = None) -> None:
        """Remember ``plan``'s nodes and stage keys as ``job_id``'s."""
        self._learn(job_id, owner, (a.node_name for a in plan.stages),
                    (StageKey(a.replica, a.stage) for a in plan.stages))

    def _learning(self, quorum: Callable[[tracker_pb2.ReplicaQuorumRequest],
                                         tracker_pb2.ReplicaQuorumReply] | None
                  ) -> Callable[[tracker_pb2.ReplicaQuorumRequest],
                                tracker_pb2.ReplicaQuorumReply] | None:
        """``quorum``, learning the newer plan a reply carries: a replica group that joins
        an elastic job is loaded on its own nodes only, and this node's stages first hear
        of it here (then they send it their sums and it fetches their snapshots)."""
        if quorum is None:
            return None
        call = quorum

        def learning(request: tracker_pb2.ReplicaQuorumRequest
                     ) -> tracker_pb2.ReplicaQuorumReply:
            reply = call(request)
            if reply.HasField("plan"):
                self._learn_plan(request.job_id, reply.plan)
            return reply
        return learning

    def _access(self, job_id: str) -> JobAccess:
        with self._jobs_lock:
            return self._jobs.get(job_id) or JobAccess("")

    def _require_owner(self, context, job_id: str) -> None:
        """Only the job's own client (or the tracker) may stop or feed it; aborts otherwise."""
        try:
            require_owner(identity_of(context), self._access(job_id).owner, job_id=job_id)
        except SecurityError as e:
            context.abort(e.code, str(e))

    def _require_assigned(self, context, job_id: str) -> None:
        """Only a node of the job's plans may send its stages tensors or move its snapshots;
        aborts otherwise."""
        try:
            require_assigned(identity_of(context), self._access(job_id).nodes, job_id=job_id)
        except SecurityError as e:
            context.abort(e.code, str(e))

    def _require_owner_or_assigned(self, context, job_id: str) -> None:
        """The job's own client, or a node of its plans, may fetch its state; aborts otherwise."""
        access = self._access(job_id)
        try:
            require_owner_or_assigned(identity_of(context), access.owner, access.nodes,
                                      job_id=job_id)
        except SecurityError as e:
            context.abort(e.code, str(e))

    # -- control plane ------------------------------------------------------
    def Probe(self, request, context):
        return self.resources

    def LoadStage(self, request, context):
        if not request.layers:  # a stage thread with nothing to run would wait forever
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"LoadStage of job {request.job_id!r} has no layers")
        if self.verifier is not None:  # TLS: only code a client signed, whoever forwards it
            self._check_signed(request, context)
        elif not (self.trust_code or net.is_loopback_peer(context.peer())):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"refusing pickled model code from {context.peer()}: start the node "
                          "with --trust-code to accept code from non-loopback peers")
        self._learn_plan(request.job_id, request.plan, request.owner)
        try:
            self.stages.load(request)
        except StageExists as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except StageLoadError as e:
            log.error("%s", e, exc_info=e.__cause__)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return node_pb2.LoadStageReply()

    def StopJob(self, request, context):
        self._require_owner(context, request.job_id)
        self.stages.stop_job(request.job_id, request.release, request.before_epoch,
                             request.replicas)
        return node_pb2.StopJobReply()

    def FetchState(self, request, context):
        self._require_owner_or_assigned(context, request.job_id)
        try:
            stage = self.stages.get(StageSlot(request.job_id, request.replica, request.stage))
        except NoSuchStage as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        with self.streams.open(context, "FetchState", request.job_id) as watch:
            for name, t in stage.weights():
                yield from watch.track(frames.encode_frames(t, name=name))

    def PutSnapshot(self, request_iterator, context):
        with self.streams.open(context, "PutSnapshot") as watch:
            stream = watch.track(request_iterator)
            try:
                first = next(stream, None)
                head = None if first is None else peek_header(first)
                if first is None or head is None:
                    raise WireError("a snapshot stream must start with a header frame")
                env = head.envelope
                watch.belongs_to(env.job_id)
                # before a byte of the snapshot is buffered
                self._require_owner_or_assigned(context, env.job_id)
                key = StageKey(env.replica, env.stage)
                if key not in self._access(env.job_id).keys:
                    raise WireError(f"job {env.job_id!r} has no stage {env.stage} of replica "
                                    f"group {env.replica} in any plan this node knows")
                limit = self.stages.snapshots.room(env.job_id, key, self.job_snapshot_bytes)
                self.stages.keep_snapshot(itertools.chain([first], stream),
                                          min(limit, MAX_SNAPSHOT_BYTES))
            except checkpoint.SnapshotTooLarge as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"snapshot refused: {e} (a snapshot may take at most "
                              f"{MAX_SNAPSHOT_BYTES} bytes, one job's kept snapshots "
                              f"{self.job_snapshot_bytes} bytes on this node)")
            except WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed snapshot: {e}")
            except NoSuchStage as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return node_pb2.SendReply()

    def FetchSnapshot(self, request, context):
        self._require_owner_or_assigned(context, request.job_id)
        try:
            snap = self.stages.snapshot(request.job_id, StageKey(request.replica, request.stage),
                                        request.step)
        except NoSuchStage as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        if request.layer_end > 0:  # only the layers that change hands
            try:
                snap = layerstate.split(snap, request.layer_start, request.layer_end)
            except layerstate.SplitError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        with self.streams.open(context, "FetchSnapshot", request.job_id) as watch:
            yield from watch.track(checkpoint.to_frames(snap))

    # -- data plane ---------------------------------------------------------
    def _admit(self, head: node_pb2.Frame, context, watch: Watched) -> int:
        env = head.envelope
        if env.kind == node_pb2.KIND_PROBE:  # a link probe is no job's
            return self.stages.admit(env)
        shape = tuple(head.tensor.shape)
        watch.belongs_to(env.job_id)
        identity = identity_of(context)
        # who may send is checked before the stage is looked up or a payload byte is
        # buffered: a node of the job's plans, or its own client
        if identity is not None and identity.role is Role.CLIENT:
            self._require_owner(context, env.job_id)
            stage = self.stages.get(StageSlot(env.job_id, env.replica, env.stage))
            try:  # inputs to the first stage, targets to the last
                require_feeds_stage(identity, env.kind, env.stage, stage.n_stages,
                                    job_id=env.job_id)
            except SecurityError as e:
                context.abort(e.code, str(e))
        else:
            self._require_assigned(context, env.job_id)
        return self.stages.admit(env, shape)  # raises what Send maps to a status

    def Send(self, request_iterator, context):
        with self.streams.open(context, "Send") as watch:
            return self._receive(watch.track(request_iterator), context, watch)

    def SendOne(self, request, context):
        # Send's single-frame form: a unary call (fedpipe.wire.rpc.send)
        return self.Send(iter((request,)), context)

    def _receive(self, request_iterator, context, watch: Watched) -> node_pb2.SendReply:
        last = None
        try:
            for head, tensor in frames.read_tensors(request_iterator,
                                                    lambda h: self._admit(h, context, watch),
                                                    in_place=True):  # gRPC's messages
                last = head.envelope
                self.stages.deliver(last, tensor, context.is_active)
        except grpc.RpcError:  # the sender's side of the stream broke
            if last is not None:
                self.stages.suspect(last)
            raise
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {e}")
        except BadEnvelope as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoSuchStage as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except StaleEpoch as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KeyError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except Stopped as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except Full as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return node_pb2.SendReply()

    def HoldAt(self, request, context):
        accepted, done = self.stages.hold(request.job_id, request.epoch, request.step)
        return node_pb2.HoldAtReply(accepted=accepted, done=done)

    def AssignJob(self, request, context):
        # the policy admits only the tracker: a node's word on its own assignment never counts
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "AssignJob names no job")
        self._learn(request.job_id, request.owner, request.node_names)
        log.info("job %s: plan epoch %d assigns %s", request.job_id, request.epoch,
                 ", ".join(sorted(set(request.node_names))))
        return node_pb2.AssignJobReply()

    # -- link measurement ---------------------------------------------------
    def Ping(self, request, context):
        return node_pb2.PingReply()

    def MeasureLinks(self, request, context):
        pings = min(max(request.pings, 1), MAX_PINGS) if request.pings else PROBE_PINGS
        max_bytes = min(request.max_probe_bytes or PROBE_BYTES, MAX_PROBE_BYTES)
        seconds = min(request.probe_seconds or PROBE_SECONDS, MAX_PROBE_SECONDS)
        if len(request.peers) > MAX_MEASURE_PEERS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"MeasureLinks asks for {len(request.peers)} peers, more than "
                          f"{MAX_MEASURE_PEERS} at once")
        out = node_pb2.MeasureLinksReply()
        for peer in request.peers:
            m = node_pb2.LinkMeasurement(src_id=self.node_id(), dst_id=peer.node_id,
                                         measured_at=time.time())
            try:
                with self.channels.borrow(peer.address, self._shaper(peer.name)) as ch:
                    m.latency, m.bandwidth = measure_link(ch, pings=pings, max_bytes=max_bytes,
                                                          seconds=seconds)
            except grpc.RpcError as e:
                m.error = f"{e.code().name}: {e.details()}"
            out.links.append(m)
        return out
