"""The tracker's domain assembled, and its two background loops.

:class:`Tracker` builds the tracker's parts over one store, in one order, each
given what it calls (:meth:`Tracker.__init__` is the one place a reader finds
every call's target): the :class:`~.registry.Registry`, the
:class:`~.links.LinkMeasurer`, the per-job memory (:mod:`.specs`, :mod:`.tallies`,
:mod:`.retention`), the :class:`~.jobs.Jobs` life cycle, the
:class:`~.deploy.Deployer`, the elastic replica groups (:mod:`.replica_groups`),
the :class:`~.recovery.Recovery`, the :class:`~.rebalance.Rebalancer`, the
:class:`~.progress.Progress` of reports and the client leases
(:class:`~.clients.Feeders`). It runs:

- the scheduler: every ``min(TICK, lease/4)`` seconds, or sooner when something
  changes, it expires leases, persists the heartbeats taken since the last
  batch (every :data:`~.registry.PERSIST_EVERY` seconds), fails PENDING jobs
  past their timeout, and plans and deploys PENDING jobs. A job is planned over
  its candidates (:func:`candidates`: at most :data:`PLAN_CANDIDATES` nodes),
  once none of them waits for its first link measurement (or ``link_wait``
  has passed). Bookkeeping per tick is O(log n) per due lease plus, only
  while a job is PENDING or RECOVERING, O(n) to read the nodes and choose
  its candidates.
- the link measurer: measures the links of nodes as they join
  (:class:`~.links.LinkMeasurer`: O(k) links per node, never a full round),
  and every ``link_refresh`` seconds re-measures each node's selected links,
  one node every ``REFRESH_SPREAD * link_refresh / n`` seconds (10,000
  nodes: one call each 27 ms, not all in one burst).

:meth:`Tracker.tick` and :meth:`Tracker.measure_links` are one round of each,
so tests can drive them without threads.
"""
from __future__ import annotations

import gc
import heapq
import logging
import socket
import threading
import time
from concurrent import futures
from typing import Callable

from ..net import timeouts
from ..proto import tracker_pb2
from .calibration import Calibration
from .clients import Feeders
from .deploy import Deployer
from .errors import FailedPrecondition
from .jobs import Jobs
from .links import LinkMeasurer
from .nodes import NodeCallError, NodeCalls
from .planning import Planner
from . import pauses
from .progress import Progress
from .readdress import readdress
from .rebalance import REBALANCE_THRESHOLD, Drains, Rebalancer
from .recovery import Records, Recovery
from .registration import validate_node
from .registry import HEARTBEAT_RATE, Registry
from .replica_groups import ElasticReplicas
from .retention import RETENTION, Retention
from .specs import JobSpecs
from .stagetimes import StageTimes
from .store import Deposed, Store, StoreUnavailable
from .tallies import Tallies

log = logging.getLogger("fedpipe.tracker")

TICK = 1.0
"""Longest pause between scheduler rounds, seconds (it also runs at once on every change,
and at least 4 times per lease so an expired lease is noticed within a quarter of it)."""
REFRESH_SPREAD = 0.9
"""Part of ``link_refresh`` a round of re-measurements is spread over (the rest is slack,
so a round ends before the next is due)."""
FREEZE_GROWTH = 1.25
"""The live swarm grows by this factor (and by :data:`FREEZE_LEAST` nodes) between two
freezes of the heap (:meth:`Tracker.freeze_heap`)."""
FREEZE_LEAST = 100
PLAN_CANDIDATES = 256
"""Most nodes a job is planned over: the planner's link matrices grow as the square of the
nodes it is given, and a swarm of 10,000 would make them 800 MB."""


def candidates(nodes: list[tracker_pb2.NodeInfo], limit: int | None = None
               ) -> list[tracker_pb2.NodeInfo]:
    """The nodes a job is planned over: all of them if at most ``limit`` (default
    :data:`PLAN_CANDIDATES`), else the ``limit`` fastest (FLOP/s, then memory, then the
    oldest registration), in registration order. O(n log limit): linear in the swarm
    (a bounded heap, not a sort of all n)."""
    limit = PLAN_CANDIDATES if limit is None else limit
    if len(nodes) <= limit:
        return nodes
    best = heapq.nsmallest(limit, range(len(nodes)),
                           key=lambda i: (-nodes[i].resources.flops,
                                          -nodes[i].resources.memory_bytes, i))
    return [nodes[i] for i in sorted(best)]


def dial_data_port(address: str, timeout: float) -> None:
    """Open and close a TCP connection to a node's data port (``HOST:PORT``): is it there?
    A connection, not a handshake: the tracker has no data plane of its own (and no torch).

    Raises:
        OSError: no connection within ``timeout`` seconds.
    """
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def unreachable(request: tracker_pb2.RegisterNodeRequest, address: str, error: object,
                what: str = "address") -> str:
    """Why a registering node is refused: the tracker could not reach ``address`` (its gRPC
    ``address`` or its ``data port``), and what to do about it: a node behind NAT takes
    part through a relay; one homed at a relay needs that relay to forward."""
    if request.relay:
        return (f"the tracker cannot reach node {request.name!r}'s {what} {address} through "
                f"its relay {request.relay} (is the relay running, and reachable from the "
                f"tracker at that address?): {error}")
    return (f"the tracker cannot reach node {request.name!r} at {address} ({what}; behind "
            f"NAT, a firewall, or a wrong --advertise?): {error}. A node that cannot accept "
            f"connections takes part through a relay: start one where the tracker and the "
            f"nodes can reach it (`fedpipe relay --port PORT`) and pass "
            f"`--relay RELAY_HOST:PORT` to `fedpipe node`")


class Tracker:
    """The tracker's domain: registry, jobs, scheduler and link measurer over one store.

    Args:
        store: the tracker's state.
        nodes: how to reach nodes.
        lease: seconds a node may go without a heartbeat before it is lost, while the
            swarm is small (see :attr:`~.registry.Registry.lease_seconds`).
        link_refresh: seconds between re-measurements of every selected link
            (0: only when nodes join).
        link_wait: seconds a job waits for the first link measurement of its
            candidate nodes before it is planned with what is known (the
            planner's assumptions for the rest: see
            :func:`~fedpipe.planner.protoio.cluster_view`).
        clock: seconds since the epoch.
        rebalance_threshold: least relative fall of the predicted step time for which a
            running job migrates to a better assignment (see :mod:`~.rebalance`).
        background: start the scheduler and link-measurer threads (False:
            the caller drives :meth:`tick` and :meth:`measure_links`).
        heartbeat_rate: the most heartbeats per second asked of all nodes together
            (:data:`~.registry.HEARTBEAT_RATE`).
        plan_processes: worker processes that make plans (:mod:`.planning`; 0: on the
            scheduler thread, holding the GIL for as long as a plan takes).
        freeze_heap: call :meth:`freeze_heap` every tick, as a tracker process should
            (``gc.freeze`` is process-wide: not for a tracker inside another program).
        retention: seconds an ended job's stages keep their weights on the nodes
            (:data:`~.retention.RETENTION`).
    """

    def __init__(self, store: Store, nodes: NodeCalls, *, lease: float = 10.0,
                 link_refresh: float = 300.0, link_wait: float = 30.0,
                 clock: Callable[[], float] = time.time, background: bool = True,
                 heartbeat_rate: float = HEARTBEAT_RATE,
                 rebalance_threshold: float = REBALANCE_THRESHOLD, plan_processes: int = 0,
                 freeze_heap: bool = False, retention: float = RETENTION):
        self.store, self.nodes, self.clock = store, nodes, clock
        self.lease, self.link_refresh, self.link_wait = lease, link_refresh, link_wait
        # Built in one order, each part given what it calls (nothing is assigned later).
        # The registry's losses come back through _nodes_lost, which reaches the parts
        # built below it: the one call that goes up the order.
        self.registry = Registry(store, lease, self._nodes_lost, clock, on_alive=self._alive,
                                 rate=heartbeat_rate)
        live = self.registry.nodes  # the live nodes in memory (store.nodes() reads rows)
        self.links = LinkMeasurer(store, nodes, clock)
        # state kept in memory per job, each dropped when its job ends
        self.specs = JobSpecs(store)
        self.tallies = Tallies()
        self.records = Records()
        self.retention = Retention(store, clock, retention)
        self.jobs = Jobs(store, nodes, self.specs, live, clock=clock,
                         ended=self.retention.ended, forget=(self.tallies, self.records))
        self.stage_times = StageTimes(lambda job_id: store.job(job_id).epoch)
        self.calibration = Calibration()
        self.planner = Planner(plan_processes)
        self.deployer = Deployer(store, nodes, self.jobs, self.specs, live, self.calibration,
                                 self.planner, clock)
        self.replicas = ElasticReplicas(store, nodes, self.jobs, self.specs, self.deployer,
                                        clock)
        self.drains = Drains(live, clock)
        self.recovery = Recovery(store, nodes, self.jobs, self.deployer, self.specs,
                                 self.tallies, self.records, self.registry, self.drains,
                                 self.replicas, clock)
        self.rebalancer = Rebalancer(
            store, nodes, self.jobs, self.specs, self.recovery, self.drains, self.stage_times,
            live, unmeasured=lambda node_id: self.links.waiting([node_id]),
            candidates=lambda nodes: candidates(nodes),  # PLAN_CANDIDATES read late
            threshold=rebalance_threshold, clock=clock)
        self.progress = Progress(store, self.jobs, self.tallies, self.stage_times,
                                 self.calibration, self.replicas, self.recovery,
                                 self.rebalancer, self.records.lock, clock)
        self.planner.start()
        for n in store.nodes():
            self.links.add(n.node_id, n.name, n.address, n.registered)
        self.stop_event = threading.Event()
        self.pauses = pauses.PauseWatch(self.stop_event)
        self._moves = futures.ThreadPoolExecutor(1, thread_name_prefix="readdress")
        self.measure_now = self.links.added
        self.jobs.recover()
        self.feeders = Feeders(self.jobs, self.recovery, self.specs, clock)  # after recover()
        self.threads: list[threading.Thread] = []
        self._frozen_at = 0  # live nodes at the last freeze_heap()
        self._store_down = False  # the last tick met StoreUnavailable (logged once)
        self.freezes = freeze_heap
        if background:
            self.threads = [threading.Thread(target=self._scheduler, name="scheduler",
                                             daemon=True),
                            threading.Thread(target=self._measurer, name="links", daemon=True),
                            threading.Thread(target=self.pauses.run, name="pauses",
                                             daemon=True)]
            for th in self.threads:
                th.start()

    def register(self, request) -> str:
        """Register a node (see :meth:`~.registry.Registry.register`, which says what it
        raises); queue its links, and let the scheduler look again. Returns its node id.

        The tracker first dials the address the node advertises, and its data port
        if it offers one: a node it cannot reach (behind NAT, a wrong ``--advertise``,
        a firewalled data port) would be planned onto and fail every job, so it is
        refused with that reason. An outbound-only node (``request.relay``: it cannot
        be reached itself) advertises the ports its relay opened for it, so the tracker
        dials it through the relay, as its peers will.

        Raises:
            FailedPrecondition: the node's address does not answer a Ping, or its data
                port does not accept a connection (through its relay, if it has one).
        """
        validate_node(request)  # a malformed address is refused as such, not dialled
        try:
            self.nodes.ping(request.address, timeouts.REGISTER_PING_RPC)
        except NodeCallError as e:
            raise FailedPrecondition(unreachable(request, request.address, e)) from None
        if request.data_address:
            try:
                dial_data_port(request.data_address, timeouts.REGISTER_PING_RPC)
            except OSError as e:
                raise FailedPrecondition(unreachable(request, request.data_address, e,
                                                     "data port")) from None
        try:
            before = self.registry.info(request.node_id)[1] if request.node_id else ""
        except KeyError:
            before = ""
        node_id = self.registry.register(request)
        if node_id == request.node_id and before not in ("", request.address):
            self._moves.submit(self._readdress, node_id)  # one at a time, in order
        self.jobs.notify()
        return node_id

    def _readdress(self, node_id: str) -> None:
        """A node moved relays: its jobs' plans follow it (:mod:`.readdress`)."""
        nodes = self.registry.nodes()
        moved = next((n for n in nodes if n.node_id == node_id), None)
        if moved is not None:
            readdress(moved, self.store, self.nodes, self.specs,
                      {n.node_id: n.address for n in nodes}, self.records.lock)
        self.jobs.notify()

    def _alive(self, node_id: str) -> None:
        name, address, registered, data_address = self.registry.info(node_id)
        # an outbound-only node's links are measured over gRPC through its relay: a probe
        # over its relayed data address would open the data link its neighbours must take
        # from its own dial (the reverse connection)
        relayed = bool(self.registry.relay_of(node_id))
        self.links.add(node_id, name, address, registered, "" if relayed else data_address)

    def _nodes_lost(self, lost: set[str], why: str) -> None:
        self.links.remove(lost)
        self.rebalancer.forget(lost)
        self.recovery.nodes_lost(lost, why)

    def close(self) -> None:
        """Stop the background loops (waiting up to ``THREAD_JOIN`` seconds for each),
        persist the last heartbeats, then close the planner's worker and ``nodes`` if it
        has a ``close()``. The store stays open: its opener closes it.

        A deposed leader (its lease already revoked: stopped with SIGTERM, or a standby
        took over) cannot persist its last heartbeats; that is logged, not raised (the
        next leader gives every live node a whole lease), and the rest still closes.
        Any other error of the flush is raised once the rest is closed."""
        self.stop_event.set()
        self.measure_now.set()
        self.jobs.notify()
        for th in self.threads:
            th.join(timeout=timeouts.THREAD_JOIN)
        try:
            self.registry.flush()
        except Deposed as e:
            log.info("the last heartbeats were not persisted: %s", e)
        finally:
            self.planner.close()
            self._moves.shutdown(wait=False, cancel_futures=True)
            close = getattr(self.nodes, "close", None)
            if close is not None:
                close()

    # -- scheduler ------------------------------------------------------------
    def tick(self) -> None:
        """One scheduler round: expire leases, persist heartbeats when due, go on
        recovering each RECOVERING job, then time out, wait or start each PENDING job."""
        self.registry.expire()
        self.registry.flush_if_due()
        if self.freezes:
            self.freeze_heap()
        self.feeders.sweep()
        self.rebalancer.tick()
        # the live nodes from the registry's memory (store.nodes() builds a message per row)
        for job_id in self.jobs.recovering():
            self.recovery.resume(job_id, self.registry.nodes())
        self.replicas.heal_all(self.registry.nodes)  # read only if a job needs it
        for job_id in self.jobs.pending():
            nodes = self.drains.usable(self.registry.nodes())
            if not nodes:
                self.jobs.expire_pending(job_id)
                continue
            chosen = candidates(nodes)
            if self.links.waiting(n.node_id for n in chosen) and \
                    self.clock() - self.jobs.get(job_id).created < self.link_wait:
                continue  # the links of nodes that just joined are being measured
            # the planner uses only the links among the candidates (cluster_view)
            self.deployer.start(job_id, chosen,
                                self.store.links_among(n.node_id for n in chosen))

    def freeze_heap(self, force: bool = False) -> bool:
        """Move the objects alive now out of the garbage collector's reach (``gc.freeze``)
        once the live swarm has grown by :data:`FREEZE_GROWTH` since the last time (or
        ``force``); True if it did. O(1).

        A full collection walks every tracked object holding the GIL: at 10,000 nodes
        (registry, link measurer, imports) about 50 ms, every few tens of seconds, in
        which no heartbeat is answered. What registered nodes leave in memory lives as
        long as they do, so the collector need not walk it; the young generations are
        collected first, so fresh cyclic garbage is not frozen with it. Frozen objects are
        still freed by reference counting; only a reference cycle among them would stay.
        """
        live = self.registry.live_count()
        if not force and (live < FREEZE_GROWTH * self._frozen_at or
                          live < self._frozen_at + FREEZE_LEAST):
            return False
        gc.collect(1)
        gc.freeze()
        self._frozen_at = live
        return True

    def guarded_tick(self) -> None:
        """:meth:`tick`, logging what it raises instead of raising: a store that cannot be
        reached is logged once when it goes (one line, no traceback: every tick meets it
        until it is back) and once when a tick succeeds again; any other error is logged
        with its traceback."""
        try:
            self.tick()
        except StoreUnavailable as e:
            if not self._store_down:
                log.warning("the store is unavailable (%s); retrying every tick", e)
            self._store_down = True
            return
        except Exception:  # noqa: BLE001 — keep scheduling whatever one job did
            log.exception("scheduler error")
            return
        if self._store_down:
            log.warning("the store is available again")
            self._store_down = False

    def _scheduler(self) -> None:
        self.pauses.take()
        while not self.stop_event.is_set():
            self.pardon_pause(self.pauses.take())
            self.guarded_tick()
            self.jobs.wait(min(TICK, self.lease / 4))

    def pardon_pause(self, gap: float) -> bool:
        """After a gap of ``gap`` seconds in this process's run (:class:`~.pauses.PauseWatch`;
        a round that waited on the network is none): if that is past
        :data:`~fedpipe.net.timeouts.TRACKER_PAUSED`, this tracker itself did not run
        (SIGSTOPped, or starved of CPU) and heard no heartbeat and no client meanwhile,
        so it judges none by that time: every live node gets a fresh lease and every
        client gone its grace again, as at a start (:class:`~.registry.Registry`). Returns
        whether it pardoned."""
        if gap <= max(timeouts.TRACKER_PAUSED, pauses.LEAST):
            return False
        log.warning("this tracker did not run for %.1f s (stopped, or starved of CPU): every "
                    "live node gets a fresh lease and every client its grace again", gap)
        self.registry.renew_live()
        self.feeders.renew_gone()
        return True

    # -- links ----------------------------------------------------------------
    def measure_links(self, refresh: bool = False, paced: bool = False) -> None:
        """Measure the links of every queued node (see :class:`~.links.LinkMeasurer`); with
        ``refresh``, re-measure every live node's selected links first; with ``paced``,
        spread the re-measurements over ``REFRESH_SPREAD * link_refresh`` seconds (until
        the tracker stops)."""
        if refresh:
            self.links.refresh_all()
        gap = (REFRESH_SPREAD * self.link_refresh / max(1, self.registry.live_count())
               if paced else 0.0)
        self.links.run(gap, self._pause)
        self.jobs.notify()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` between two re-measurements, less if a node joins (its first
        measurement goes next); True if the tracker is stopping."""
        self.measure_now.wait(seconds)
        self.measure_now.clear()
        return self.stop_event.is_set()

    def _measurer(self) -> None:
        next_refresh = time.monotonic() + self.link_refresh if self.link_refresh else None
        while not self.stop_event.is_set():
            self.measure_now.clear()
            refresh = next_refresh is not None and time.monotonic() >= next_refresh
            if refresh:
                next_refresh = time.monotonic() + self.link_refresh
            try:
                self.measure_links(refresh, paced=True)
            except Exception:  # noqa: BLE001 — try again at the next trigger
                log.exception("link measurement failed")
            wait = None if next_refresh is None else max(0.0, next_refresh - time.monotonic())
            self.measure_now.wait(wait)
