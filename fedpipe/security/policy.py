"""Who may call which RPC: one table, default deny, and the identity checks services add.

The table (:data:`POLICY`) maps every method of the Tracker and Node services
(and gRPC's health service) to the roles that may call it; a method that is not
in it is refused. :class:`fedpipe.security.interceptor.AuthInterceptor` enforces
it on every server before a servicer runs.

What the table cannot know (whose job this is, which node a request speaks
for) is checked by the service with the caller's identity, through the
``require_*`` functions below, after it has looked the job or node up. Each row
says which check its service owes in ``service_check``.

An identity of None means the server runs without TLS: nobody has an identity,
every check here passes, and the services' loopback rules apply instead.

Mapping onto gRPC status codes: :class:`PermissionDenied` (PERMISSION_DENIED).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping

from grpc_health.v1 import health_pb2
from google.protobuf.message import Message

from ..proto import node_pb2, tracker_pb2
from ..wire.format import WireError, peek_header
from .certs import Identity, Role
from .errors import PermissionDenied

NODE, TRACKER, CLIENT, ADMIN, RELAY = Role.NODE, Role.TRACKER, Role.CLIENT, Role.ADMIN, Role.RELAY
ALL_ROLES = frozenset(Role) - {RELAY}
"""Every role that calls RPCs. A relay (``fedpipe relay``) only forwards streams it cannot
read (:mod:`fedpipe.net.relay`): no row of the table admits it, so every call it might make
is refused."""
CLIENT_SEND_KINDS = frozenset({node_pb2.KIND_INPUT, node_pb2.KIND_TARGET})
"""What a client may put on the data plane: a microbatch's inputs and targets, never activations,
gradients or synchronisation traffic between stages."""


@dataclass(frozen=True)
class Rule:
    """Who may call one method.

    Attributes:
        roles: the roles admitted; others get PERMISSION_DENIED.
        public: anyone may call, even without a certificate (health checks).
        message_check: called with the identity and each request message (every
            message of a request stream); raises :class:`PermissionDenied`.
        service_check: the identity check the service adds once it knows the job
            or node, for people reading the table (not run by the interceptor).
    """

    roles: frozenset[Role] = frozenset()
    public: bool = False
    message_check: Callable[[Identity, Message], None] | None = None
    service_check: str = ""


def check_send_kind(identity: Identity | None, frame: Message | bytes) -> None:
    """A client may Send only inputs and targets; nodes send any kind.

    Args:
        frame: a wire frame (bytes, :mod:`fedpipe.wire.format`) or a ``fedpipe.v1.Frame``;
            only the first of a tensor stream has an envelope.

    Raises:
        PermissionDenied: a client sent another kind.
    """
    if identity is None or identity.role is not CLIENT:
        return
    if isinstance(frame, (bytes, bytearray, memoryview)):
        try:
            frame = peek_header(frame) or node_pb2.Frame()
        except WireError:  # the servicer refuses it, with INVALID_ARGUMENT and the reason
            return
    if not frame.HasField("envelope"):
        return
    kind = frame.envelope.kind
    if kind not in CLIENT_SEND_KINDS:
        name = node_pb2.Kind.Name(kind) if kind in node_pb2.Kind.values() else f"kind {kind}"
        raise PermissionDenied(f"{identity} may send only inputs and targets, not {name}")


def _methods(descriptor, service: str, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    svc = descriptor.services_by_name[service]
    names = {m.name for m in svc.methods}
    if set(rules) != names:  # a new RPC must get a row here, a renamed one must not linger
        raise AssertionError(f"policy for {svc.full_name} does not match the protocol: "
                             f"missing {sorted(names - set(rules))}, "
                             f"unknown {sorted(set(rules) - names)}")
    return {f"/{svc.full_name}/{name}": rule for name, rule in rules.items()}


def _roles(*roles: Role) -> frozenset[Role]:
    return frozenset(roles)


POLICY: Mapping[str, Rule] = {
    **_methods(tracker_pb2.DESCRIPTOR, "Tracker", {
        "RegisterNode": Rule(_roles(NODE), service_check="require_self(identity, request.name)"),
        "Heartbeat": Rule(_roles(NODE), service_check="require_self(identity, name of node_id)"),
        "ListNodes": Rule(ALL_ROLES),
        "SubmitJob": Rule(_roles(CLIENT), service_check="the job's owner is identity.name"),
        # the operator may look at and cancel any job (require_owner admits admin)
        "GetJob": Rule(_roles(CLIENT, ADMIN), service_check="require_owner(identity, owner)"),
        "ListJobs": Rule(_roles(CLIENT, ADMIN), service_check="a client's own jobs only; the "
                                                              "operator's, every job"),
        "WatchJob": Rule(_roles(CLIENT, ADMIN), service_check="require_owner(identity, owner)"),
        "CancelJob": Rule(_roles(CLIENT, ADMIN), service_check="require_owner(identity, owner)"),
        "ReportStage": Rule(_roles(NODE), service_check="require_self(identity, the stage's "
                                                        "assigned node, what='the stage')"),
        "RestoreJob": Rule(_roles(CLIENT), service_check="require_owner(identity, owner)"),
        # the operator drains any node (`fedpipe drain`); a node on SIGTERM drains itself
        "DrainNode": Rule(_roles(ADMIN, NODE), service_check="nodes: require_self(identity, "
                                                             "the node's name)"),
        "ReplicaQuorum": Rule(_roles(NODE), service_check="require_self(identity, the stage's "
                                                          "assigned node, what='the stage')"),
        "JoinReplica": Rule(_roles(CLIENT), service_check="require_owner(identity, owner)"),
    }),
    **_methods(node_pb2.DESCRIPTOR, "Node", {
        "Probe": Rule(_roles(NODE, TRACKER)),
        "LoadStage": Rule(_roles(TRACKER)),
        # the tracker stops a job's stages; its own client releases them at the end
        "StopJob": Rule(_roles(TRACKER, CLIENT), service_check="require_owner(identity, owner)"),
        "Send": Rule(_roles(NODE, CLIENT), message_check=check_send_kind,
                     service_check="clients: require_owner(identity, owner) and "
                                   "require_feeds_stage(...); nodes: require_assigned("
                                   "identity, nodes)"),
        "SendOne": Rule(_roles(NODE, CLIENT), message_check=check_send_kind,
                        service_check="as Send"),
        # state moves between nodes (checkpoints, drains, healing) and to the job's client
        "FetchState": Rule(_roles(CLIENT, NODE), service_check="require_owner_or_assigned("
                                                              "identity, owner, nodes)"),
        # checkpoint snapshots travel between a job's nodes (stage -> buddy, buddy -> restorer)
        # ... and between the job's client and its nodes (Job.save, submit(resume_from=))
        "PutSnapshot": Rule(_roles(NODE, CLIENT), service_check="require_owner_or_assigned("
                                                               "identity, owner, nodes)"),
        "FetchSnapshot": Rule(_roles(NODE, CLIENT), service_check="require_owner_or_assigned("
                                                                 "identity, owner, nodes)"),
        # a stage's initial weights, from the job's own client straight to the stage's node
        # (weights never pass through the tracker)
        "PutWeights": Rule(_roles(CLIENT), service_check="require_owner(identity, owner)"),
        "Ping": Rule(_roles(NODE, TRACKER)),
        "MeasureLinks": Rule(_roles(TRACKER)),
        # a drain's or a migration's cut at a step boundary
        "HoldAt": Rule(_roles(TRACKER)),
        # who a new plan epoch assigns, told to the nodes holding the job's state: only the
        # control plane's word counts, never a node's about itself
        "AssignJob": Rule(_roles(TRACKER)),
    }),
    **_methods(health_pb2.DESCRIPTOR, "Health", {
        "Check": Rule(public=True), "List": Rule(public=True), "Watch": Rule(public=True),
    }),
}
"""Every RPC fedpipe serves, by full method name (``/fedpipe.v1.Tracker/RegisterNode``)."""


def authorize(method: str, identity: Identity | None,
              table: Mapping[str, Rule] = POLICY) -> Rule | None:
    """Check that ``identity`` may call ``method`` by the table; return its rule.

    Args:
        method: the full method name, as in ``HandlerCallDetails.method``.
        identity: the caller, or None on a server without TLS (admitted; returns
            the rule, or None for a method not in the table).

    Raises:
        PermissionDenied: the method is not in the table (default deny), or the
            caller's role is not among its roles; the message names both.
    """
    rule = table.get(method)
    if identity is None:
        return rule
    if rule is None:
        raise PermissionDenied(f"{method} is not in fedpipe's policy table: denied by default")
    if rule.public or identity.role in rule.roles:
        return rule
    allowed = ", ".join(sorted(r.value for r in rule.roles)) or "nobody"
    raise PermissionDenied(f"wrong role for {method}: {identity} may not call it "
                           f"(allowed: {allowed})")


def require_self(identity: Identity | None, name: str, *, what: str = "") -> None:
    """A node speaks only for itself: ``name`` (the node a request is about) must be the caller's.

    Used for RegisterNode (``request.name``), Heartbeat (the name of
    ``request.node_id``) and ReportStage (the node the stage is assigned to).

    Args:
        what: what ``name`` is, for the message (default: "node <name>").

    Raises:
        PermissionDenied: another node's name.
    """
    if identity is None or identity.name == name:
        return
    raise PermissionDenied(f"{identity} may speak only for itself, not for "
                           f"{what or 'node'} {name!r}")


def require_owner(identity: Identity | None, owner: str, *, job_id: str = "") -> None:
    """Only a job's own client (and the tracker and admin) may watch, cancel, stop or feed it.

    The tracker passes since it acts for every job; admin passes since the
    operator may cancel any job (the table still limits admin to what it lists).

    Args:
        owner: the name of the client that submitted the job (the job records it).
        job_id: for the message.

    Raises:
        PermissionDenied: a client that does not own the job, or a node.
    """
    if identity is None or identity.role in (TRACKER, ADMIN):
        return
    if identity.role is CLIENT and owner and identity.name == owner:
        return
    raise PermissionDenied(f"{identity} is not the owner of job {job_id or '?'}"
                           + (f" (owner: {owner!r})" if owner else " (it has no owner)"))


def require_assigned(identity: Identity | None, assigned: Collection[str], *,
                     job_id: str = "") -> None:
    """Only a node that a plan of the job assigned (``assigned``: node names) may send
    its stages tensors or move its checkpoint snapshots (PutSnapshot to its buddy,
    FetchSnapshot to restore).

    Raises:
        PermissionDenied: a node not assigned to the job, or any other role, naming the job.
    """
    if identity is None or (identity.role is NODE and identity.name in assigned):
        return
    raise PermissionDenied(f"{identity} is not assigned to job {job_id or '?'}")


def require_feeds_stage(identity: Identity | None, kind: int, stage: int, n_stages: int, *,
                        job_id: str = "") -> None:
    """A client feeds only the stage that consumes what it sends: inputs the first stage of
    the pipeline, targets the last (stage indices ``0 .. n_stages-1`` of the plan).

    Nodes (and callers without TLS) pass: stages send each other activations and gradients.

    Raises:
        PermissionDenied: a client sending inputs past the first stage, targets to another
            than the last, or any other kind; the message names the job and stage.
    """
    if identity is None or identity.role is not CLIENT:
        return
    wanted = (0 if kind == node_pb2.KIND_INPUT else
              n_stages - 1 if kind == node_pb2.KIND_TARGET else None)
    if wanted == stage:
        return
    name = node_pb2.Kind.Name(kind) if kind in node_pb2.Kind.values() else f"kind {kind}"
    where = "no stage" if wanted is None else f"only stage {wanted}"
    raise PermissionDenied(f"{identity} may not send {name} to stage {stage} of job "
                           f"{job_id or '?'}: a client feeds {where} with it")


def require_owner_or_assigned(identity: Identity | None, owner: str,
                              assigned: Collection[str], *, job_id: str = "") -> None:
    """A job's own client, or a node assigned to it (``assigned``: node names), may fetch its state.

    Raises:
        PermissionDenied: anyone else, naming the job.
    """
    if identity is not None and identity.role is NODE:
        if identity.name in assigned:
            return
        raise PermissionDenied(f"{identity} is not assigned to job {job_id or '?'}")
    require_owner(identity, owner, job_id=job_id)
