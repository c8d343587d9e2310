"""The node registry: registration rules, versions, incarnations and leases.

Rules a registration must pass, in this order:

1. **Well formed** (:func:`validate_node`): ``HOST:PORT`` with a port in
   1..65535, finite FLOP/s > 0, memory > 0, name and address of at most
   :data:`MAX_NAME` characters. Else :class:`~.errors.InvalidArgument`.
2. **One node per address.** A live node with a different name at the same
   address is another node: the registration is refused with
   :class:`~.errors.AlreadyExists`, naming it (two processes answering at one
   address split its connections between them).
3. **Compatible versions** (:func:`check_versions`): the node's protocol
   version must equal this tracker's (:data:`fedpipe.spec.PROTOCOL_VERSION`);
   its Python major.minor, torch and cloudpickle versions must equal those of
   the live nodes already registered, since pickled layers, optimizers and
   tensors travel between nodes. The fedpipe version itself is logged, not
   compared: the protocol version is the compatibility contract. Else
   :class:`~.errors.FailedPrecondition`, naming both versions.
4. **Incarnations.** A node is an incarnation: (name, address, boot id).
   The same incarnation registering again (after the tracker forgot it, or
   after it missed its lease) keeps its node id. A new boot id at the same
   name and address is a new process: it gets a new node id, and the old
   incarnation is *fenced* (lost for good: its heartbeats are no longer
   accepted, and the jobs that used it treat it as lost), so its stages are
   never merged with the new process. A fenced incarnation that registers
   again is refused with :class:`~.errors.FailedPrecondition`.

Leases: a node is lost after ``lease`` seconds without a heartbeat; it is
told to heartbeat every ``lease / 4`` seconds, so three heartbeats in a row
may be lost before its lease runs out.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

from ..proto import tracker_pb2
from ..spec import PROTOCOL_VERSION
from .errors import AlreadyExists, FailedPrecondition, InvalidArgument
from .store import NodeRecord, Store, new_id

log = logging.getLogger("fedpipe.tracker")

MAX_NAME = 256
"""Longest node name or address accepted, characters."""
HEARTBEATS_PER_LEASE = 4
"""Heartbeats a node sends per lease: it may miss ``HEARTBEATS_PER_LEASE - 1`` in a row."""
PICKLE_VERSIONS = ("python", "torch", "cloudpickle")
"""The :class:`Versions` fields every live node must agree on (pickles depend on them)."""


def validate_node(request: tracker_pb2.RegisterNodeRequest) -> None:
    """Check a registration's address, resources, name and address lengths.

    Raises:
        InvalidArgument: the first problem found.
    """
    host, _, port = request.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise InvalidArgument(f"node address must be HOST:PORT with a port in 1..65535, "
                              f"got {request.address!r}")
    r = request.resources
    if not (math.isfinite(r.flops) and r.flops > 0) or r.memory_bytes <= 0:
        raise InvalidArgument("node resources must have finite flops > 0 and memory_bytes > 0")
    if len(request.name) > MAX_NAME or len(request.address) > MAX_NAME:
        raise InvalidArgument(f"node name and address must be at most {MAX_NAME} characters")


def check_versions(name: str, theirs: tracker_pb2.Versions, live: list[NodeRecord]) -> None:
    """Refuse a node whose versions cannot work with this tracker and the ``live`` nodes.

    Args:
        name: the registering node's name, for the message.
        theirs: the versions it registered with.
        live: the other live nodes, oldest first; the first that speaks this
            tracker's protocol is the reference (all live nodes agree, since
            each was checked against it when it registered).

    Raises:
        FailedPrecondition: a different protocol version, or a Python, torch or
            cloudpickle version that differs from the reference node's; the
            message names both versions.
    """
    if theirs.protocol != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"node {name!r} speaks fedpipe protocol {theirs.protocol} (fedpipe "
            f"{theirs.fedpipe or 'unknown'}) but this tracker speaks protocol {PROTOCOL_VERSION}; "
            f"run the same fedpipe release on the tracker and every node")
    ref = next((r for r in live if r.versions.protocol == PROTOCOL_VERSION), None)
    if ref is None:
        return
    for field in PICKLE_VERSIONS:
        mine, swarm = getattr(theirs, field), getattr(ref.versions, field)
        if mine != swarm:
            raise FailedPrecondition(
                f"node {name!r} runs {field} {mine or 'unknown'} but the swarm's nodes (e.g. "
                f"{ref.info.name!r}) run {field} {swarm}; pickled layers and tensors travel "
                f"between nodes, so every node needs the same Python, torch and cloudpickle")


class Registry:
    """Registers nodes, renews and expires their leases.

    Args:
        store: the tracker's state.
        lease: seconds a node may go without a heartbeat before it is lost.
        on_lost: called with the ids of nodes that were lost (lease expired,
            left, or replaced by a new incarnation) and the reason, in words
            ("left the swarm"), after the store says so.
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, lease: float,
                 on_lost: Callable[[set[str], str], None],
                 clock: Callable[[], float] = time.time):
        self.store, self.lease, self.on_lost, self.clock = store, lease, on_lost, clock
        self._lock = threading.Lock()  # registrations at one address must not interleave

    @property
    def heartbeat_seconds(self) -> float:
        """How often nodes should heartbeat, seconds."""
        return self.lease / HEARTBEATS_PER_LEASE

    def register(self, request: tracker_pb2.RegisterNodeRequest) -> str:
        """Register a node incarnation (see the module docstring); return its node id.

        Raises:
            InvalidArgument: a malformed registration.
            AlreadyExists: another live node holds the address.
            FailedPrecondition: incompatible versions, or a fenced incarnation.
        """
        validate_node(request)
        name, address, boot = request.name or request.address, request.address, request.boot_id
        with self._lock:
            records = self.store.node_records(include_lost=True)
            for r in records:
                if r.info.alive and r.info.address == address and r.info.name != name:
                    raise AlreadyExists(
                        f"address {address} is held by live node {r.info.name!r} "
                        f"({r.info.node_id}); node {name!r} must use another port or "
                        f"advertised address, or that node must stop first")
            same = [r for r in records if r.info.name == name and r.info.address == address]
            for r in same:
                if r.fenced and r.boot_id == boot:
                    raise FailedPrecondition(
                        f"node {name!r} at {address} (boot id {boot}) was replaced by a newer "
                        f"process at the same address; this process must stop")
            same_ids = {r.info.node_id for r in same}
            check_versions(name, request.versions,
                           [r for r in records if r.info.alive and r.info.node_id not in same_ids])
            current = next((r for r in same if r.boot_id == boot and not r.fenced), None)
            replaced = {r.info.node_id for r in same if r.boot_id != boot and not r.fenced}
            for node_id in replaced:
                self.store.fence_node(node_id)
            now = self.clock()
            if current is not None:
                node_id = current.info.node_id
                self.store.renew_node(node_id, request.resources, request.versions, now)
            else:
                node_id = new_id()
                self.store.add_node(node_id, name, address, request.resources, boot,
                                    request.versions, now)
        v = request.versions
        log.info("node %s (%s) registered at %s: fedpipe %s, protocol %d, python %s, torch %s, "
                 "cloudpickle %s", name, node_id, address, v.fedpipe, v.protocol, v.python,
                 v.torch, v.cloudpickle)
        if replaced:
            log.warning("node %s restarted at %s: incarnation(s) %s fenced", name, address,
                        ", ".join(sorted(replaced)))
            self.on_lost(replaced, f"restarted (a new process registered at {address}; "
                                   f"the stages of the old one are gone)")
        return node_id

    def heartbeat(self, node_id: str) -> bool:
        """Renew ``node_id``'s lease; False if the tracker does not know it (or fenced it)."""
        return self.store.heartbeat(node_id, self.clock())

    def leave(self, node_id: str) -> bool:
        """The node shuts down: mark it lost now; False if unknown."""
        return self.declare_lost(node_id, "left the swarm")

    def declare_lost(self, node_id: str, why: str) -> bool:
        """Mark ``node_id`` lost now, before its lease ends (it left, or a peer's failed
        send and a failed Ping say it is gone); ``why`` completes "node(s) NAMES ...".
        Returns False if it was not a live node."""
        known = self.store.mark_lost(node_id)
        if known:
            log.info("node %s %s", node_id, why)
            self.on_lost({node_id}, why)
        return known

    def expire(self) -> set[str]:
        """Mark the nodes whose lease ran out lost; return their ids."""
        lost = set(self.store.expire_nodes(self.clock() - self.lease))
        for node_id in sorted(lost):
            log.warning("node %s missed its lease of %.1f s: marked lost", node_id, self.lease)
        if lost:
            self.on_lost(lost, f"lost (no heartbeat for {self.lease:.0f} s)")
        return lost
