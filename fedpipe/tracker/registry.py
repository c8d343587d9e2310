"""The node registry: registration rules, versions, incarnations and leases.

Rules a registration must pass, in this order:

1. **Well formed** (:func:`~.registration.validate_node`): ``HOST:PORT`` with a port in
   1..65535, finite FLOP/s > 0, memory > 0, name and address of at most
   :data:`~.registration.MAX_NAME` characters. Else :class:`~.errors.InvalidArgument`.
2. **One node per address.** A live node with a different name at the same
   address is another node: the registration is refused with
   :class:`~.errors.AlreadyExists`, naming it (two processes answering at one
   address split its connections between them).
3. **Compatible versions** (:func:`~.registration.check_versions`): the node's protocol
   version must equal this tracker's (:data:`fedpipe.spec.PROTOCOL_VERSION`);
   its Python major.minor, torch and cloudpickle versions must equal those of
   the live nodes already registered, since pickled layers, optimizers and
   tensors travel between nodes. The fedpipe version itself is logged, not
   compared: the protocol version is the compatibility contract. Else
   :class:`~.errors.FailedPrecondition`, naming both versions.
4. **Incarnations.** A node is an incarnation: (name, address, boot id). An
   outbound-only node that moved to another relay names its id: same name and
   boot id, live, relayed before and after, it keeps it at its new addresses.
   The same incarnation registering again (after the tracker forgot it, or
   after it missed its lease) keeps its node id. A new boot id at the same
   name and address is a new process: it gets a new node id, and the old
   incarnation is *fenced* (lost for good: its heartbeats are no longer
   accepted, and the jobs that used it treat it as lost), so its stages are
   never merged with the new process. A fenced incarnation that registers
   again is refused with :class:`~.errors.FailedPrecondition`.

Leases: the tracker sets every node's heartbeat interval, and scales it with
the swarm so that all nodes together send at most ``rate`` heartbeats a
second (:data:`HEARTBEAT_RATE`)::

    lease    = max(base_lease, HEARTBEATS_PER_LEASE * live_nodes / rate)
    interval = lease / HEARTBEATS_PER_LEASE

A node is lost after ``lease`` seconds without a heartbeat; it is told to
heartbeat every ``lease / 4`` seconds, so three heartbeats in a row may be
lost before its lease runs out. With the defaults (``--lease 10``, 250/s) a
swarm of up to 625 nodes heartbeats every 2.5 s; 10,000 nodes heartbeat
every 40 s with a lease of 160 s. This is Nomad's rule (its servers give each
client a heartbeat TTL of ``max(min_heartbeat_ttl, nodes /
max_heartbeats_per_second)``, 200 s at 10,000 nodes by default): a Python
gRPC server spends about 0.35 ms of CPU on the bare call (sync or asyncio
alike, ``benchmarks/heartbeat_rpc.py``), so a fixed 2.5 s interval at 10,000
nodes (4,000 calls/s) would need more than one core for heartbeats alone.
The lease is the backstop, not the detector: a failed send and a failed Ping
mark a node lost at once (docs/tracker-scale.md).

Each node is held to the lease it was last told (its deadline is set when
its heartbeat is taken), so a shrinking swarm never declares lost a node that
still beats at the longer interval it heard. Liveness lives in memory and
reaches the store in batches (see :class:`Registry`), so a heartbeat costs
O(1) and no SQLite commit, and 10,000 nodes fit in one tracker.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..proto import node_pb2, tracker_pb2
from ..spec import NODE_DRAINED, NODE_LEFT, PROTOCOL_VERSION
from .errors import AlreadyExists, FailedPrecondition
from .registration import check_versions, validate_node
from .store import NodeRecord, Store, new_id

log = logging.getLogger("fedpipe.tracker")

HEARTBEATS_PER_LEASE = 4
"""Heartbeats a node sends per lease: it may miss ``HEARTBEATS_PER_LEASE - 1`` in a row."""
HEARTBEAT_RATE = 250.0
"""Most heartbeats per second the tracker asks of the whole swarm (``fedpipe tracker
--heartbeat-rate``): about 1/6 of one core at ~0.65 ms of tracker CPU per heartbeat, which
leaves the rest of a core to registrations (~7 ms each, hundreds a second when a swarm
reconnects), link measurement and planning. Below ``rate * base_lease /
HEARTBEATS_PER_LEASE`` nodes (625 with a 10 s lease) it does not bind; above, the interval
grows with the swarm (see the module docstring)."""
PERSIST_EVERY = 5.0
"""Seconds between two writes of the heartbeats taken in between (one transaction each)."""
LOST_NAMED = 10
"""Lost nodes named one warning each; more are summarised in one line."""
@dataclass
class _Incarnation:
    """What the registry keeps in memory of one node incarnation (the store has the rest)."""

    name: str
    address: str
    boot_id: str
    versions: tracker_pb2.Versions
    registered: float
    resources: node_pb2.Resources
    fenced: bool = False
    data_address: str = ""
    """Where its socket data plane listens ("": gRPC only); stored, so a tracker that
    restarts or takes over knows it."""
    relay: str = ""
    """The relay an outbound-only node is homed at (its addresses are the relay's ports);
    "": reachable. Stored, as :attr:`data_address`."""
    info: tracker_pb2.NodeInfo = dataclasses.field(default_factory=tracker_pb2.NodeInfo)
    """The node as :meth:`Registry.nodes` lists it while it is live: built when it registers
    (:meth:`describe`), not on every listing."""

    def describe(self, node_id: str) -> None:
        """Build :attr:`info` from the fields above."""
        self.info = tracker_pb2.NodeInfo(node_id=node_id, name=self.name, address=self.address,
                                         resources=self.resources, alive=True,
                                         registered=self.registered,
                                         data_address=self.data_address, relay=self.relay)


class Registry:
    """Registers nodes, renews and expires their leases; liveness is kept in memory.

    Every incarnation the store knows is loaded at start-up, and the nodes the
    store says are alive get a fresh lease then: a restarted tracker renews
    live nodes instead of declaring them lost. Afterwards the registry is the
    authority on liveness:

    - :meth:`heartbeat` is O(1) under one lock and writes nothing: it puts the
      time in a dict. :meth:`flush` writes the heartbeats taken since the last
      flush in one transaction (:meth:`~.store.Store.set_heartbeats`); the
      scheduler calls it every :data:`PERSIST_EVERY` seconds and
      :meth:`close` once more. So ``last_heartbeat`` in the store (and
      ``ListNodes``) may lag by that much; nothing else is lost when the
      tracker stops.
    - Leases expire from a heap of deadlines, one entry per live node: a tick
      pops only entries that are due, re-queueing those renewed since
      (each live node is re-queued about once per lease), so
      :meth:`expire` costs O(log n) per due entry, not O(n).
    - Every change of liveness (registered, revived by a heartbeat, lost,
      left, fenced) is written through to the store at once, so
      ``store.nodes()`` lists the live nodes.

    Args:
        store: the tracker's state.
        lease: the base lease: seconds a node may go without a heartbeat before it
            is lost, while the swarm is small enough (see :attr:`lease_seconds`).
        on_lost: called with the ids of nodes that were lost (lease expired,
            left, or replaced by a new incarnation) and the reason, in words
            ("left the swarm"), after the store says so.
        clock: seconds since the epoch.
        on_alive: called with a node's id when it becomes alive (registered,
            or a lost node's heartbeat revived it).
        rate: the most heartbeats per second asked of all live nodes together
            (:data:`HEARTBEAT_RATE`); > 0.

    Raises:
        ValueError: ``lease`` or ``rate`` is not > 0.
    """

    def __init__(self, store: Store, lease: float,
                 on_lost: Callable[[set[str], str], None],
                 clock: Callable[[], float] = time.time,
                 on_alive: Callable[[str], None] = lambda node_id: None,
                 rate: float = HEARTBEAT_RATE):
        if not (lease > 0 and rate > 0):
            raise ValueError(f"a lease and a heartbeat rate must be > 0, got lease {lease} s "
                             f"and rate {rate}/s")
        self.store, self.lease, self.on_lost, self.clock = store, lease, on_lost, clock
        self.on_alive, self.rate = on_alive, rate
        # registrations run one at a time (they check then write the store); heartbeats take
        # only ``_lock``, which guards the dicts below and is never held across a store call
        self._registering = threading.Lock()
        self._lock = threading.Lock()
        self._nodes: dict[str, _Incarnation] = {}
        self._by_address: dict[str, set[str]] = {}
        # live nodes' (lease deadline, the lease told at their last heartbeat); insertion = age
        self._until: dict[str, tuple[float, float]] = {}
        self._dirty: dict[str, float] = {}  # heartbeats not yet persisted
        self._due: dict[str, float] = {}  # each live node's deadline as queued in _heap
        self._heap: list[tuple[float, str]] = []
        self._flushed = clock()
        self._revived = 0  # lost nodes revived by a heartbeat since the last expire()
        # why each node this tracker saw go is lost, in words ("" for a missed lease: the
        # status says how long ago its last heartbeat came); dropped when it is alive again
        self._why: dict[str, str] = {}
        self._view: list[tracker_pb2.NodeInfo] | None = None  # nodes(), until the set changes
        now = clock()
        store.renew_all(now)
        records = store.node_records(include_lost=True)
        # every node live at the restart gets the lease of the whole swarm it is part of
        lease = self._lease_for(sum(1 for r in records if r.info.alive))
        for r in records:
            i = r.info
            self._remember(i.node_id, _Incarnation(i.name, i.address, r.boot_id, r.versions,
                                                   i.registered, i.resources, r.fenced,
                                                   data_address=i.data_address,
                                                   relay=i.relay))
            if i.alive:
                self._live(i.node_id, now, lease)

    def _remember(self, node_id: str, inc: _Incarnation) -> None:
        inc.describe(node_id)
        self._nodes[node_id] = inc
        self._by_address.setdefault(inc.address, set()).add(node_id)

    def _live(self, node_id: str, now: float, lease: float | None = None) -> None:
        """Under ``_lock``: ``node_id`` is alive with a heartbeat at ``now``, held to
        ``lease`` seconds (default: :attr:`lease_seconds`)."""
        lease = self.lease_seconds if lease is None else lease
        until = now + lease
        self._until[node_id] = (until, lease)
        self._why.pop(node_id, None)
        self._view = None
        if node_id not in self._due:
            self._due[node_id] = until
            heapq.heappush(self._heap, (until, node_id))

    def _dead(self, node_id: str, why: str) -> None:
        """Under ``_lock``: ``node_id`` is no longer alive (its heap entry goes stale), for
        ``why`` if it was alive (:meth:`from_memory`: a node lost already keeps its first
        reason)."""
        if self._until.pop(node_id, None) is not None:
            self._why[node_id] = why
        self._view = None
        self._dirty.pop(node_id, None)
        self._due.pop(node_id, None)

    def _lease_for(self, live: int) -> float:
        """The lease for a swarm of ``live`` nodes, seconds (the module docstring's rule)."""
        return max(self.lease, HEARTBEATS_PER_LEASE * live / self.rate)

    @property
    def lease_seconds(self) -> float:
        """The lease nodes are told now, seconds: the base lease, or longer in a swarm so
        large that its heartbeats would exceed ``rate`` per second."""
        return self._lease_for(len(self._until))

    @property
    def heartbeat_seconds(self) -> float:
        """How often nodes should heartbeat now, seconds (:attr:`lease_seconds` / 4)."""
        return self.lease_seconds / HEARTBEATS_PER_LEASE

    def alive(self, node_id: str) -> bool:
        """Whether ``node_id`` is a live node."""
        return node_id in self._until

    def live_count(self) -> int:
        """How many nodes are alive."""
        return len(self._until)

    def nodes(self) -> list[tracker_pb2.NodeInfo]:
        """The live nodes, as ``store.nodes()`` lists them (oldest registration first, ties
        by node id) but from memory: no store read. O(n) to copy the list; a node that
        registers or is lost makes the next call sort the live nodes' ids once (a few ms
        at 10,000); each node's message is built when it registers. At 10,000 nodes
        ``store.nodes()`` takes about 70 ms of CPU holding the GIL (it builds a message
        per row); the scheduler asks on every tick a job is pending, and heartbeats would
        wait that long.

        The messages are shared between callers: read them, do not change them (copy
        first). ``last_heartbeat`` is not kept here (0); ``store.nodes()`` has it, as of
        the last batch written (:data:`PERSIST_EVERY`).
        """
        with self._lock:
            if self._view is None:
                live = sorted((self._nodes[i].registered, i) for i in self._until)
                self._view = [self._nodes[i].info for _, i in live]
            return list(self._view)

    def from_memory(self, nodes: list[tracker_pb2.NodeInfo]) -> list[tracker_pb2.NodeInfo]:
        """``nodes`` (messages of the caller's own, e.g. ``store.nodes(True)``'s) with what
        the registry keeps in memory only, in place; returned for chaining:

        - each lost one's ``lost_reason``: :data:`~fedpipe.spec.NODE_LEFT`,
          :data:`~fedpipe.spec.NODE_DRAINED`, "restarted (...)", a peer's report; "" for a
          missed lease, or a node lost before this tracker started;
        - each one's ``data_address`` (its socket data plane) and ``relay`` (outbound-only
          through it) as its registration gave them.
        """
        with self._lock:
            for n in nodes:
                if not n.alive:
                    n.lost_reason = self._why.get(n.node_id, "")
                inc = self._nodes.get(n.node_id)
                if inc is not None:
                    n.data_address = inc.data_address or n.data_address
                    n.relay = inc.relay
        return nodes

    def info(self, node_id: str) -> tuple[str, str, float, str]:
        """``(name, address, registered, data_address)`` of a known incarnation. KeyError if
        unknown."""
        inc = self._nodes[node_id]
        return inc.name, inc.address, inc.registered, inc.data_address

    def relay_of(self, node_id: str) -> str:
        """The relay a known incarnation is homed at ("": reachable). KeyError if unknown."""
        return self._nodes[node_id].relay

    def _reference(self, skip: set[str]) -> list[NodeRecord]:
        """The live node other versions are checked against (see :func:`check_versions`):
        the longest-live one that speaks this protocol, outside ``skip``; [] if none."""
        with self._lock:
            for node_id in self._until:
                inc = self._nodes[node_id]
                if node_id not in skip and inc.versions.protocol == PROTOCOL_VERSION:
                    return [NodeRecord(tracker_pb2.NodeInfo(node_id=node_id, name=inc.name,
                                                            address=inc.address, alive=True),
                                       inc.boot_id, inc.versions)]
        return []

    def register(self, request: tracker_pb2.RegisterNodeRequest) -> str:
        """Register a node incarnation (see the module docstring); return its node id.

        O(1) in the number of nodes (in-memory indexes), plus one store write.

        Raises:
            InvalidArgument: a malformed registration.
            AlreadyExists: another live node holds the address.
            FailedPrecondition: incompatible versions, or a fenced incarnation.
        """
        validate_node(request)
        name, address, boot = request.name or request.address, request.address, request.boot_id
        with self._registering:
            with self._lock:
                here = [(i, self._nodes[i]) for i in sorted(self._by_address.get(address, ()))]
                holder = next(((i, inc) for i, inc in here
                               if i in self._until and inc.name != name), None)
            if holder is not None:
                raise AlreadyExists(
                    f"address {address} is held by live node {holder[1].name!r} "
                    f"({holder[0]}); node {name!r} must use another port or "
                    f"advertised address, or that node must stop first")
            same = [(i, inc) for i, inc in here if inc.name == name]
            for _, inc in same:
                if inc.fenced and inc.boot_id == boot:
                    raise FailedPrecondition(
                        f"node {name!r} at {address} (boot id {boot}) was replaced by a newer "
                        f"process at the same address; this process must stop")
            check_versions(name, request.versions, self._reference({i for i, _ in same}))
            current = next((i for i, inc in same if inc.boot_id == boot and not inc.fenced),
                           self._mover(request) if not same else None)
            replaced = {i for i, inc in same if inc.boot_id != boot and not inc.fenced}
            now = self.clock()
            for node_id in replaced:
                self.store.fence_node(node_id)
                with self._lock:
                    self._nodes[node_id].fenced = True
                    self._dead(node_id, f"restarted (a new process registered at {address})")
            if current is not None:
                node_id = current
                self.store.renew_node(node_id, request.resources, request.versions, now,
                                      address, request.data_address, request.relay)
                with self._lock:
                    self._readdress(node_id, address)
                    self._nodes[node_id].versions = request.versions
                    self._nodes[node_id].resources = request.resources
                    self._nodes[node_id].data_address = request.data_address
                    self._nodes[node_id].relay = request.relay
                    self._nodes[node_id].describe(node_id)
                    self._live(node_id, now)
            else:
                node_id = new_id()
                self.store.add_node(node_id, name, address, request.resources, boot,
                                    request.versions, now, request.data_address, request.relay)
                with self._lock:
                    self._remember(node_id, _Incarnation(name, address, boot, request.versions,
                                                         now, request.resources,
                                                         data_address=request.data_address,
                                                         relay=request.relay))
                    self._live(node_id, now)
        v = request.versions
        log.info("node %s (%s) registered at %s: fedpipe %s, protocol %d, python %s, torch %s, "
                 "cloudpickle %s", name, node_id, address, v.fedpipe, v.protocol, v.python,
                 v.torch, v.cloudpickle)
        self.on_alive(node_id)
        if replaced:
            log.warning("node %s restarted at %s: incarnation(s) %s fenced", name, address,
                        ", ".join(sorted(replaced)))
            self.on_lost(replaced, f"restarted (a new process registered at {address}; "
                                   f"the stages of the old one are gone)")
        return node_id

    def _mover(self, request: tracker_pb2.RegisterNodeRequest) -> str | None:
        """``request.node_id`` if it is a live outbound-only node moving to another relay:
        the same name and boot id (under TLS the servicer checked the certificate's name),
        from a relay to a relay. Else None (a new incarnation)."""
        inc = self._nodes.get(request.node_id)
        if inc is None or inc.fenced or not self.alive(request.node_id) or \
                (inc.name, inc.boot_id) != (request.name, request.boot_id) or \
                not (inc.relay and request.relay):
            return None
        log.info("node %s (%s) moved from relay %s (%s) to relay %s (%s)", inc.name,
                 request.node_id, inc.relay, inc.address, request.relay, request.address)
        return request.node_id

    def _readdress(self, node_id: str, address: str) -> None:
        """Under ``_lock``: ``node_id`` is at ``address`` now (the same one, or it moved)."""
        inc = self._nodes[node_id]
        self._by_address.get(inc.address, set()).discard(node_id)
        self._by_address.setdefault(address, set()).add(node_id)
        inc.address = address

    def heartbeat(self, node_id: str) -> bool:
        """Renew ``node_id``'s lease; False if the tracker does not know it (or fenced it).

        The node is held to :attr:`lease_seconds` as it is now (what the reply
        tells it). O(1), no store write, unless the heartbeat revives a lost node
        (which is written through).
        """
        now = self.clock()
        with self._lock:
            if node_id in self._until:
                lease = self.lease_seconds
                self._until[node_id] = (now + lease, lease)
                self._dirty[node_id] = now
                return True
            inc = self._nodes.get(node_id)
            if inc is None or inc.fenced:
                return False
            self._live(node_id, now)
        try:
            self.store.heartbeat(node_id, now)
        except Exception:
            with self._lock:  # not revived until the store says so: the next beat tries again
                self._dead(node_id, self._why.get(node_id, ""))
            raise
        log.debug("node %s (%s) is back", inc.name, node_id)
        with self._lock:
            self._revived += 1
        self.on_alive(node_id)
        return True

    def leave(self, node_id: str, drained: bool = False) -> bool:
        """The node shuts down (``drained``: once its drain ended): mark it lost now, as
        having left; False if unknown."""
        return self.declare_lost(node_id, NODE_DRAINED if drained else NODE_LEFT)

    def declare_lost(self, node_id: str, why: str) -> bool:
        """Mark ``node_id`` lost now, before its lease ends (it left, or a peer's failed
        send and a failed Ping say it is gone); ``why`` completes "node(s) NAMES ...".
        Returns False if it was not a live node."""
        with self._lock:
            was = self._until.get(node_id)
            self._dead(node_id, why)
        if was is not None:
            try:
                self.store.mark_lost(node_id)
            except Exception:
                self._undo_loss({node_id: was})  # still live: the caller may try again
                raise
            log.info("node %s %s", node_id, why)
            self.on_lost({node_id}, why)
        return was is not None

    def expire(self) -> set[str]:
        """Mark the nodes whose lease ran out lost (in one store transaction); return their ids.

        A node is lost once more than the lease it was last told has passed
        since its last heartbeat. Pops only due deadlines (see the class docstring).
        """
        now = self.clock()
        lost: dict[str, tuple[float, float]] = {}  # node -> (its deadline, the lease it missed)
        with self._lock:
            revived, self._revived = self._revived, 0
            while self._heap and self._heap[0][0] < now:
                deadline, node_id = heapq.heappop(self._heap)
                if self._due.get(node_id) != deadline:
                    continue  # stale: the node was lost or left since it was queued
                renewed, lease = self._until[node_id]
                if renewed < now:
                    lost[node_id] = (renewed, lease)
                    self._dead(node_id, "")
                else:
                    self._due[node_id] = renewed
                    heapq.heappush(self._heap, (renewed, node_id))
        if revived:  # one line per tick, however many came back
            log.info("%d lost node(s) came back (heartbeat after their lease ran out)", revived)
        if not lost:
            return set()
        try:
            self.store.mark_lost_many(sorted(lost))
        except Exception:
            # the loss is acted on only once it is written: until then the nodes stay queued
            # (due again at the next tick), so a write that fails (the store is down) is
            # retried instead of leaving nodes dead in memory that no recovery ever saw
            self._undo_loss(lost)
            raise
        longest = max(lease for _, lease in lost.values())
        if len(lost) <= LOST_NAMED:
            for node_id in sorted(lost):
                log.warning("node %s missed its lease of %.1f s: marked lost", node_id,
                            lost[node_id][1])
        else:
            log.warning("%d nodes missed their leases of up to %.1f s: marked lost (e.g. %s)",
                        len(lost), longest, ", ".join(sorted(lost)[:LOST_NAMED]))
        self.on_lost(set(lost), f"lost (no heartbeat for {longest:.0f} s)")
        return set(lost)

    def renew_live(self) -> None:
        """Give every live node a heartbeat now, in memory (the tracker did not run for a
        while: :meth:`~.scheduler.Tracker.pardon_pause`)."""
        now = self.clock()
        with self._lock:
            for node_id in list(self._until):
                self._live(node_id, now, self._until[node_id][1])

    def _undo_loss(self, lost: dict[str, tuple[float, float]]) -> None:
        """A loss could not be written: put each of ``lost`` (node -> its deadline and
        lease, as :meth:`_dead` found them) back on the lease queue at that deadline, unless
        a heartbeat revived it meanwhile, so the next :meth:`expire` tries again."""
        with self._lock:
            for node_id, (until, lease) in lost.items():
                inc = self._nodes.get(node_id)
                if node_id in self._until or inc is None or inc.fenced:
                    continue
                self._until[node_id] = (until, lease)
                self._view = None
                self._due[node_id] = until
                heapq.heappush(self._heap, (until, node_id))

    def flush(self) -> int:
        """Persist the heartbeats taken since the last flush, in one transaction; return
        how many. A failed write keeps them for the next flush (a heartbeat taken since
        wins over the older one of the same node), and raises the store's error."""
        with self._lock:
            beats, self._dirty = self._dirty, {}
            self._flushed = self.clock()
        if beats:
            try:
                self.store.set_heartbeats(beats)
            except BaseException:
                with self._lock:
                    self._dirty = {**beats, **self._dirty}
                raise
        return len(beats)

    def flush_if_due(self) -> int:
        """:meth:`flush` if :data:`PERSIST_EVERY` seconds passed since the last; return how
        many heartbeats were written."""
        if self.clock() - self._flushed < PERSIST_EVERY:
            return 0
        return self.flush()
