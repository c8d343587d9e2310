"""The node's end of the socket data plane: its admission and delivery behind a link's
:class:`~fedpipe.net.dataplane.Receiver`, and its suspect path behind the links' events.

A tensor that arrives on a socket link (:mod:`fedpipe.net.dataplane`) passes the
checks a ``Send`` on gRPC passes, in the same order, before a payload byte is
buffered: the per-method policy (:data:`fedpipe.security.policy.POLICY`'s row
for ``Send``: the caller's role, and the kinds a client may send), who may send
for the job (:meth:`~fedpipe.node.access.JobAccessBook.check_sender`), then the
stage, epoch and sizes (:meth:`~fedpipe.node.admission.DataPlane.admit`).
Identity is the peer's certificate (with TLS), as ``identity_of(context)`` is on
gRPC. A node domain error refuses the one tensor with the status code the node's
error table (:data:`fedpipe.node.errors.STATUS`) gives it on gRPC; the link goes on.
A link through a relay for one job (:attr:`Peer.job <fedpipe.net.dataplane.Peer.job>`)
refuses a tensor (its reader, before these checks) or a fetch of any other job
(PERMISSION_DENIED, naming both: :meth:`~fedpipe.net.dataplane.Peer.check_job`), so
no peer passes another job's frames under the one job's bound at the relay.

A checkpoint snapshot from a buddy, or from the job's client restoring a saved
checkpoint, comes as its tensors (KIND_SNAPSHOT, each with its envelope and name;
:func:`fedpipe.runtime.snapshot_link.send_snapshot`) and passes ``PutSnapshot``'s
checks instead, as on gRPC: its policy row (roles ``node`` and ``client``), then
who may move the job's snapshots and for which stage key
(:meth:`~fedpipe.node.access.JobAccessBook.check_snapshot`, on the skeleton: a
node of the job's plans or its own client, a key of its plans); the
:class:`~fedpipe.node.snapshots.SnapshotDesk` puts the tensors together within
the snapshot and job size limits and keeps the snapshot once it has them all,
if this node runs a stage of the job.

A client's initial weights for a stage (KIND_WEIGHTS, each tensor with its envelope;
:func:`fedpipe.runtime.weights_link.send_weights`) pass ``PutWeights``' checks, as
on gRPC: its policy row (role ``client``), the job's own client
(:meth:`~fedpipe.node.access.JobAccessBook.require_owner`), then the
:class:`~fedpipe.node.initial.WeightsDesk`: a stage of the envelope's epoch that
waits for its weights, and each tensor's name and shape one of its layers', checked
on the header before its payload is buffered. They fill the stage's
:class:`~fedpipe.node.initial.Pending` a tensor at a time (each layer's digest checked
once it is in); the stream's last marker is taken only once the stage has them all.

A peer's fetch (``FetchState``, ``FetchSnapshot``: a node restoring a stage from
this one's snapshot; :mod:`fedpipe.net.dataplane.fetch`) is served by
:meth:`NodeReceiver.serve` on a thread of its own, with gRPC's checks: the
deny list, the method's policy row, then :mod:`fedpipe.node.fetches` (the job's
client or a node of its plans; the stage or snapshot held here). A stage's
weights are copied as they are sent (the stage goes on training meanwhile).

Delivery runs on the link's reader thread: it files the tensor in the stage's
mailbox and never sends (the stage threads do), so a reader never waits on its
own link's credit.

A link that fails is a warning, but for a client that left once its jobs were over:
the receiver keeps, for each client peer, the jobs it sent tensors for (its feed,
initial weights, snapshots; a client that only fetched has none), and a client's
link whose connection broke while none of them ran a live stage here
(:meth:`~fedpipe.node.stages.StageRegistry.runs`: they ended, or were released), and
none runs when the link fails, ends with "client X left" at INFO. One whose connection
broke mid-job keeps the warning, even if the job was parked meanwhile.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator, TypeVar

import torch

from google.protobuf.message import DecodeError

from ..net.dataplane import Code, Peer, Refused
from ..net.dataplane.records import Method
from ..proto import node_pb2
from ..security import Unauthenticated, policy
from ..spec import Kind
from ..wire.frames import Admitted
from .access import JobAccessBook
from .admission import DataPlane as Admission
from .admission import slot_of
from . import fetches
from .errors import MAPPED, InvalidRequest, NoSuchSnapshot, status_of
from .initial import WeightsDesk
from .snapshots import SnapshotDesk
from .stages import StageRegistry

log = logging.getLogger(__name__)
M = TypeVar("M", node_pb2.FetchStateRequest, node_pb2.FetchSnapshotRequest)

SEND_METHOD = "/fedpipe.v1.Node/Send"
"""The policy row a socket link's tensors are checked by: they are ``Send``'s frames."""
PUT_SNAPSHOT_METHOD = "/fedpipe.v1.Node/PutSnapshot"
"""The policy row a socket link's snapshot tensors are checked by."""
PUT_WEIGHTS_METHOD = "/fedpipe.v1.Node/PutWeights"
"""The policy row a socket link's initial-weight tensors are checked by."""
FETCH_METHODS = {Method.FETCH_STATE: "/fedpipe.v1.Node/FetchState",
                 Method.FETCH_SNAPSHOT: "/fedpipe.v1.Node/FetchSnapshot"}
"""The policy row a socket link's fetch is checked by: the gRPC method it stands for."""
PIPELINE_KINDS = frozenset({Kind.ACTIVATION, Kind.GRADIENT})
"""Kinds whose sender is a pipeline neighbour: a link that broke after one is suspect."""
_SNAPSHOT, _WEIGHTS = int(Kind.SNAPSHOT), int(Kind.WEIGHTS)
"""The kinds that take other checks than ``Send``'s, as plain ints: an enum member's read
costs a lookup in its metaclass, and these are compared per tensor."""


def refusal(error: BaseException) -> Refused:
    """``error`` (a node domain error, a WireError or a SecurityError) as the refusal a link
    sends back: the status code it has on gRPC, and its message."""
    return Refused(Code(status_of(error).value[0]), str(error))


class NodeReceiver:
    """Admits and delivers the tensors this node's socket links bring (a
    :class:`~fedpipe.net.dataplane.Receiver`); reports a neighbour whose link broke.

    Args:
        access: who may send for which job.
        admission: the stage, epoch and size checks, and delivery to the mailbox.
        stages: the stages held here (the depth of a pipeline, for a client's feeds).
        revoked: the certificate serials refused now (the node's deny list, as its
            gRPC streams check it at each message); None without TLS.
        desk: where snapshots are kept (None: snapshots are refused).
        weights: where stages' streamed initial weights go (None: they are refused).
    """

    def __init__(self, access: JobAccessBook, admission: Admission, stages: StageRegistry,
                 revoked: Callable[[], frozenset[int]] | None = None,
                 desk: SnapshotDesk | None = None, weights: WeightsDesk | None = None):
        self.access, self.admission, self.stages = access, admission, stages
        self.revoked, self.desk, self.weights = revoked, desk, weights
        self._lock = threading.Lock()
        self._last: dict[str, node_pb2.Envelope] = {}  # peer -> its last pipeline tensor's
        self._clients: dict[str, set[str]] = {}  # a client peer -> the jobs it sent for
        self._broke_busy: dict[str, bool] = {}  # a client peer -> whether a job of those
        # ran here when its connection last broke (read when its link fails)
        self._closed = threading.Event()
        self.received = 0
        """Tensors delivered over socket links (stage tensors and probes)."""
        self.snapshot_tensors = 0
        """Snapshot tensors taken over socket links (skeletons included)."""
        self.weight_tensors = 0
        """Initial-weight tensors taken over socket links (markers included)."""
        self.fetches_served = 0
        """Fetches (FetchState, FetchSnapshot) over socket links that reached this node's
        answer, refused there or not (not those the link refused first: a method it does
        not serve, too many at once)."""

    def close(self) -> None:
        """Stop waiting for room in a mailbox (node shutdown)."""
        self._closed.set()

    # -- Receiver ---------------------------------------------------------------
    def admit(self, peer: Peer, header: node_pb2.Frame) -> int | Admitted:
        """As ``Send``'s checks on gRPC; the size limit of the tensor, bytes (with the
        receiving stage's end of its link for a stateful codec: :class:`Admitted`).

        Raises:
            Refused: with the code gRPC would answer.
        """
        identity = peer.identity
        env = header.envelope
        if peer.role == "client":
            self._client_sent(peer.name, env.job_id)
        try:
            self._check_revoked(peer)
            kind = env.kind
            if kind == _SNAPSHOT:
                return self._admit_snapshot(peer, header)
            if kind == _WEIGHTS:
                return self._admit_weights(peer, header)
            policy.authorize(SEND_METHOD, identity)
            policy.check_send_kind(identity, header)
            self.access.check_sender(identity, env, self._depth)
            return self.admission.admitted(env, header.tensor.shape)
        except MAPPED as e:
            raise refusal(e) from None

    def _depth(self, env: node_pb2.Envelope) -> int:
        """The depth of the pipeline of ``env``'s stage (a client's feeds are checked with it).

        Raises:
            NoSuchStage: the stage is not held here.
        """
        return self.stages.get(slot_of(env)).n_stages

    def _open(self) -> bool:
        """Whether deliveries may still wait for room (not after :meth:`close`)."""
        return not self._closed.is_set()

    def _check_revoked(self, peer: Peer) -> None:
        """Raise Unauthenticated if the peer's certificate is on the deny list now."""
        identity = peer.identity
        if identity is not None and self.revoked is not None \
                and identity.serial in self.revoked():
            raise Unauthenticated(f"certificate of {identity} (serial {identity.serial}) "
                                  "is revoked")

    def _admit_snapshot(self, peer: Peer, header: node_pb2.Frame) -> int:
        """A snapshot tensor's checks: ``PutSnapshot``'s (module docstring)."""
        if self.desk is None:
            raise NoSuchSnapshot("this node takes no snapshots over its data port")
        policy.authorize(PUT_SNAPSHOT_METHOD, peer.identity)
        return self.desk.admit_part(
            peer.name, header, lambda env: self.access.check_snapshot(peer.identity, env))

    def _admit_weights(self, peer: Peer, header: node_pb2.Frame) -> int:
        """An initial-weight tensor's checks: ``PutWeights``' (module docstring)."""
        if self.weights is None:
            raise InvalidRequest("this node takes no initial weights over its data port")
        identity = peer.identity
        policy.authorize(PUT_WEIGHTS_METHOD, identity)
        return self.weights.admit_part(
            peer.name, header, lambda env: self.access.require_owner(identity, env.job_id))

    def _deliver_weights(self, peer: Peer, header: node_pb2.Frame,
                         tensor: torch.Tensor) -> None:
        """Into the stage's :class:`~fedpipe.node.initial.Pending`; logs a stage's
        weights complete."""
        assert self.weights is not None  # admit refused it otherwise
        complete = self.weights.add_part(peer.name, header, tensor)
        with self._lock:
            self.weight_tensors += 1
        if complete:  # tests read this line: the socket path was taken
            env = header.envelope
            log.info("stage %d of job %s (replica %d) took its initial weights from %s over "
                     "the socket data plane", env.stage, env.job_id, env.replica, peer.name)

    def deliver(self, peer: Peer, header: node_pb2.Frame,
                tensor: torch.Tensor) -> Callable[[], None] | None:
        """File an admitted tensor for its stage (a client's inputs wait for room); a
        snapshot's for the snapshot desk; an initial weight into its stage's layers.

        Returns the wake-up of the stage thread that waits for the tensor, if one does:
        the link runs it once it has read the tensors that came with this one
        (:meth:`~fedpipe.net.dataplane.connection.Connection.later`).

        Raises:
            Refused: with the code gRPC would answer.
        """
        env = header.envelope
        kind = env.kind
        try:
            if kind == _SNAPSHOT:
                assert self.desk is not None  # admit refused it otherwise
                kept = self.desk.add_part(peer.name, header, tensor)
                with self._lock:
                    self.snapshot_tensors += 1
                if kept and peer.role == "client":  # a saved checkpoint restored (rare)
                    log.info("kept the step %d snapshot of job %s stage %d (replica %d) that "
                             "%s put over the socket data plane", env.step, env.job_id,
                             env.stage, env.replica, peer.name)
                return None
            if kind == _WEIGHTS:
                self._deliver_weights(peer, header, tensor)
                return None
            wake = self.admission.deliver(env, tensor, self._open, defer=True)
        except MAPPED as e:
            raise refusal(e) from None
        with self._lock:
            self.received += 1
            if kind in PIPELINE_KINDS:
                self._last[peer.name] = env
        return wake

    # -- fetch Server ---------------------------------------------------------
    def serve(self, peer: Peer, method: Method, request: bytes
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """A peer's fetch, checked as on gRPC (module docstring); its answer's tensors.

        Raises:
            Refused: with the code gRPC would answer (checks run before the first tensor).
        """
        with self._lock:
            self.fetches_served += 1
            if peer.role == "client":  # a client known here, its fetches no job it feeds
                self._clients.setdefault(peer.name, set())
        tensors: fetches.Named
        try:
            self._check_revoked(peer)
            policy.authorize(FETCH_METHODS[method], peer.identity)
            if method is Method.FETCH_STATE:
                asked = _parse(node_pb2.FetchStateRequest, request)
                peer.check_job(asked.job_id, "fetch")
                state = fetches.state(self.access, self.stages, peer.identity, asked)
                tensors = ((name, t.detach().to("cpu", copy=True)) for name, t in state)
            else:
                snap = _parse(node_pb2.FetchSnapshotRequest, request)
                peer.check_job(snap.job_id, "fetch")
                if self.desk is None:
                    raise NoSuchSnapshot("this node keeps no snapshots")
                tensors = fetches.snapshot(self.access, self.desk, peer.identity, snap)
            first = next(tensors, None)  # a generator's checks run at its first tensor
        except MAPPED as e:
            raise refusal(e) from None
        # what a fetch over the socket plane served (tests count it from this line)
        log.info("serving %s to %s over the socket data plane", FETCH_METHODS[method]
                 .rpartition("/")[2], peer.name)
        return _refusing(first, tensors)

    # -- clients ----------------------------------------------------------------
    def _client_sent(self, peer: str, job: str) -> None:
        """Client ``peer`` sent a tensor for ``job`` (one of the jobs its link serves)."""
        with self._lock:
            jobs = self._clients.get(peer)
            if jobs is None:
                jobs = self._clients[peer] = set()
            jobs.add(job)

    def _runs_any(self, jobs: set[str]) -> bool:
        """Whether any of ``jobs`` has a live stage here."""
        return any(self.stages.runs(job) for job in jobs)

    # -- LinkEvents -------------------------------------------------------------
    def lost(self, peer: str, why: str) -> None:
        """A connection from ``peer`` broke (its link tries to resume): report the
        neighbour to the tracker, as a broken ``Send`` stream is. A client none of whose
        jobs runs here is only going away (DEBUG)."""
        with self._lock:
            known = self._clients.get(peer)
            jobs = None if known is None else set(known)
        busy = None if jobs is None else self._runs_any(jobs)  # None: not a client's link
        if busy is not None:
            with self._lock:
                self._broke_busy[peer] = busy
        if busy is False:
            log.debug("data connection to client %s closed (no job it fed runs here): %s",
                      peer, why)
        else:
            log.info("data connection to %s broke: %s", peer, why)
        self._suspect(peer)

    def failed(self, peer: str, why: str) -> None:
        """The link to ``peer`` is gone for good: a warning, but for a client that left with
        none of its jobs running here, at its last break nor now (module docstring)."""
        with self._lock:
            jobs = self._clients.pop(peer, None)
            broke_busy = self._broke_busy.pop(peer, False)
        if jobs is not None and not broke_busy and not self._runs_any(jobs):
            log.info("client %s left: no job it fed runs on this node (its data link "
                     "ended: %s)", peer, why)
        else:
            log.warning("data link to %s failed: %s", peer, why)
        self._suspect(peer)

    def _suspect(self, peer: str) -> None:
        with self._lock:
            env = self._last.pop(peer, None)
        if env is not None:
            self.admission.suspect(env)


def _parse(kind: type[M], body: bytes) -> M:
    """A fetch's request from its bytes.

    Raises:
        InvalidRequest: they do not parse as ``kind``.
    """
    try:
        return kind.FromString(body)
    except DecodeError as e:
        raise InvalidRequest(f"a fetch's request is not a {kind.__name__}: {e}") from None


def _refusing(first: tuple[str, torch.Tensor] | None,
              rest: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``first`` then ``rest``, a node domain error raised meanwhile (a snapshot file that
    cannot be read) as the refusal gRPC's call would end with."""
    try:
        if first is not None:
            yield first
        yield from rest
    except MAPPED as e:
        raise refusal(e) from None
