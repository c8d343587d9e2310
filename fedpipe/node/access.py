"""Who may act on a job on this node: what the tracker told it (LoadStage, AssignJob,
a quorum's newer plan), and the identity checks of :mod:`fedpipe.security.policy`
made with that knowledge. Every check raises a
:class:`~fedpipe.security.SecurityError` (or a node domain error); the servicer
maps them (:mod:`~fedpipe.node.errors`).
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .. import net
from ..proto import node_pb2, tracker_pb2
from ..security import Authenticator, Identity, SecurityError
from ..security.certs import Role
from ..security.policy import (require_assigned, require_feeds_stage, require_owner,
                               require_owner_or_assigned)
from ..security.signing import verify_job
from ..spec import StageKey
from ..wire import WireError
from .errors import CodeRefused, InvalidRequest

log = logging.getLogger(__name__)

KNOWN_JOBS = 1024
"""Jobs whose owner and nodes a node remembers for its identity checks (the least recently
loaded go first; a forgotten job's calls are refused as if it had no owner)."""

Quorum = Callable[[tracker_pb2.ReplicaQuorumRequest], tracker_pb2.ReplicaQuorumReply]
"""One ReplicaQuorum call to the tracker."""


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


class JobAccessBook:
    """What this node knows of each job's owner, nodes and stage keys, and the checks
    made with it. Thread-safe.

    Args:
        verifier: checks job signatures against the swarm CA and deny list (None:
            no TLS, when identities are None and every identity check passes).
        trust_code: without TLS, load pickled layers from any peer, not only loopback ones.
    """

    def __init__(self, verifier: Authenticator | None = None, trust_code: bool = False):
        self.verifier, self.trust_code = verifier, trust_code
        self._jobs: collections.OrderedDict[str, JobAccess] = collections.OrderedDict()
        self._lock = threading.Lock()

    # -- what the tracker said ------------------------------------------------
    def learn(self, job_id: str, owner: str | None, names: Iterable[str],
              keys: Iterable[StageKey] = ()) -> None:
        """Remember that the tracker assigned the nodes ``names`` and stage ``keys`` to
        ``job_id`` (``owner``: its client, taken for a job not known yet)."""
        with self._lock:
            access = self._jobs.pop(job_id, None) or JobAccess(owner or "")
            access.nodes.update(names)
            access.keys.update(keys)
            self._jobs[job_id] = access
            while len(self._jobs) > KNOWN_JOBS:
                self._jobs.popitem(last=False)

    def learn_plan(self, job_id: str, plan: node_pb2.Plan, owner: str | None = None) -> None:
        """Remember ``plan``'s nodes and stage keys as ``job_id``'s."""
        self.learn(job_id, owner, (a.node_name for a in plan.stages),
                   (StageKey(a.replica, a.stage) for a in plan.stages))

    def learning(self, quorum: Quorum | None) -> Quorum | None:
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
                self.learn_plan(request.job_id, reply.plan)
            return reply
        return learning

    def get(self, job_id: str) -> JobAccess:
        """What is known of ``job_id`` (an empty record for a job not known)."""
        with self._lock:
            return self._jobs.get(job_id) or JobAccess("")

    # -- checks -----------------------------------------------------------------
    def require_owner(self, identity: Identity | None, job_id: str) -> None:
        """Only the job's own client (or the tracker) may stop or feed it."""
        require_owner(identity, self.get(job_id).owner, job_id=job_id)

    def require_assigned(self, identity: Identity | None, job_id: str) -> None:
        """Only a node of the job's plans may send its stages tensors or move its snapshots."""
        require_assigned(identity, self.get(job_id).nodes, job_id=job_id)

    def require_owner_or_assigned(self, identity: Identity | None, job_id: str) -> None:
        """The job's own client, or a node of its plans, may fetch its state."""
        access = self.get(job_id)
        require_owner_or_assigned(identity, access.owner, access.nodes, job_id=job_id)

    def check_snapshot(self, identity: Identity | None, env: node_pb2.Envelope) -> None:
        """A PutSnapshot's caller and stage key, before a byte of the snapshot is buffered.

        Raises:
            SecurityError: neither the job's client nor a node of its plans.
            WireError: the key is of no plan of the job this node knows.
        """
        self.require_owner_or_assigned(identity, env.job_id)
        if StageKey(env.replica, env.stage) not in self.get(env.job_id).keys:
            raise WireError(f"job {env.job_id!r} has no stage {env.stage} of replica "
                            f"group {env.replica} in any plan this node knows")

    def check_sender(self, identity: Identity | None, env: node_pb2.Envelope,
                     n_stages: Callable[[node_pb2.Envelope], int]) -> None:
        """Who may send a tensor, checked before its stage is looked up or a payload byte
        buffered: a node of the job's plans, or its own client with inputs for the first
        stage and targets for the last (``n_stages``: the depth of the envelope's
        stage's pipeline, which raises NoSuchStage for a stage not held here)."""
        if env.kind == node_pb2.KIND_PROBE:  # a link probe is no job's
            return
        if identity is not None and identity.role is Role.CLIENT:
            self.require_owner(identity, env.job_id)
            require_feeds_stage(identity, env.kind, env.stage, n_stages(env), job_id=env.job_id)
        else:
            self.require_assigned(identity, env.job_id)

    def check_code(self, request: node_pb2.LoadStageRequest, peer: str) -> None:
        """May this node load ``request``'s pickled code? With TLS only code a client of the
        swarm CA signed (:mod:`fedpipe.security.signing`), whoever forwards it; without,
        only from a loopback ``peer`` unless the node trusts code.

        Raises:
            InvalidRequest: the plan does not name the stage once.
            SecurityError: a signature that does not verify.
            CodeRefused: no TLS, a remote peer, and code not trusted.
        """
        if self.verifier is None:
            if not (self.trust_code or net.is_loopback_peer(peer)):
                raise CodeRefused(f"refusing pickled model code from {peer}: start the node "
                                  "with --trust-code to accept code from non-loopback peers")
            return
        mine = [a for a in request.plan.stages
                if (a.replica, a.stage) == (request.replica, request.stage)]
        if len(mine) != 1:
            raise InvalidRequest(f"the plan has {len(mine)} assignments of stage "
                                 f"{request.stage} (replica {request.replica}), not one")
        try:
            verify_job(self.verifier, owner=request.owner, client_cert=request.client_cert,
                       job_signature=request.job_signature, digests=request.layer_digests,
                       config=request.config, layers=request.layers,
                       first_layer=mine[0].layer_start)
        except SecurityError as e:
            log.warning("refused job %s: %s", request.job_id, e)
            raise
