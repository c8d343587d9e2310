"""Link measurement: which links are measured, and when.

Not all n² pairs: the rule is :func:`fedpipe.planner.protoio.measurement_peers`
(each node measures its links to at most ``MEASURE_NEIGHBOURS`` members of its
site, in registration order, and each site's representative to those of at
most ``MEASURE_SITES`` other sites); the planner takes an unmeasured pair to be
like the measured links between the two nodes' sites
(:func:`fedpipe.planner.protoio.cluster_view`), else its default link.

:class:`LinkMeasurer` applies that rule incrementally. It keeps each site's
live members in registration order and a queue of *pending* nodes, those whose
selected links may not have been measured since both ends registered. A node
that registers makes itself and its O(k) neighbours pending, never a full
round; a lost node makes its neighbours pending (their bands shift). Measuring
a pending node is one ``MeasureLinks`` call over only its unmeasured pairs, so
a burst of registrations is absorbed in about one call per node. Every
``link_refresh`` seconds each live node re-measures all its selected links,
without holding back jobs; the tracker paces those calls over the period
(:meth:`LinkMeasurer.run`'s ``gap``), since 10,000 of them back to back take a
core for a minute and delay heartbeats by up to a second.

A node that cannot be measured (unreachable, or its call failed) counts as
measured for that round, so it never holds back a job; it is named in one
warning when it first fails and when it recovers, and each round's failures are
summarised in one line.
"""
from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, cast

from ..planner.protoio import MEASURE_NEIGHBOURS, MEASURE_SITES, band, site_of
from ..proto import node_pb2
from .nodes import NodeCallError, NodeCalls
from .store import Store

log = logging.getLogger("fedpipe.tracker")

ERRORS_NAMED = 3
"""Failed links named as examples in a round's one-line summary."""


@dataclass(frozen=True)
class _Member:
    node_id: str
    name: str
    address: str
    registered: float
    site: str
    data_address: str = ""  # its socket data plane ("": gRPC only): what a probe crosses

    @property
    def key(self) -> tuple[float, str]:
        return self.registered, self.node_id


class LinkMeasurer:
    """Chooses, queues and measures the links of live nodes (see the module docstring).

    Thread-safe: :meth:`add` and :meth:`remove` come from the registry's
    callers, :meth:`measure_next` from the measurer thread (or a test).

    Args:
        store: where measurements go (and, at start-up, come from).
        nodes: how to reach nodes (MeasureLinks).
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, nodes: NodeCalls, clock: Callable[[], float] = time.time):
        self.store, self.nodes, self.clock = store, nodes, clock
        self._lock = threading.Lock()
        self.added = threading.Event()
        """Set whenever a node becomes pending (the measurer thread waits on it)."""
        self._members: dict[str, _Member] = {}
        self._sites: dict[str, list[tuple[float, str]]] = {}  # site -> member keys, sorted
        self._reps: list[tuple[float, str, str]] = []  # (rep key..., site), sorted
        self._pending: dict[str, None] = {}  # first measurement due: holds back jobs
        self._refresh: dict[str, None] = {}  # periodic re-measurement: holds back nothing
        self._current: str | None = None
        # when each directed pair was last tried, by the tracker's clock (or, loaded from
        # the store at start-up, by the measuring node's)
        self._tried: dict[tuple[str, str], float] = {
            (m.src_id, m.dst_id): m.measured_at for m in store.links()}
        self._unreachable: set[str] = set()
        self._errors: list[str] = []  # this round's failed links, for one summary line

    # -- membership -----------------------------------------------------------
    def add(self, node_id: str, name: str, address: str, registered: float,
            data_address: str = "") -> None:
        """A node is alive: queue it and the neighbours it gains (O(k + sites)).
        ``data_address``: its socket data plane, which its links are measured over."""
        m = _Member(node_id, name, address, registered, site_of(address), data_address)
        with self._lock:
            known = self._members.get(node_id)
            if known is not None and known.data_address != data_address:
                self._members[node_id] = m  # registered again (a restarted tracker's store
                # knew it without its data port): same key and site, probes go the new way
            if node_id not in self._members:
                self._members[node_id] = m
                order = self._sites.setdefault(m.site, [])
                bisect.insort(order, m.key)
                if order[0] == m.key:
                    self._reset_reps()
            self._queue([node_id, *self._peers(node_id)])

    def remove(self, node_ids: Iterable[str]) -> None:
        """Nodes are lost: forget them and queue the neighbours whose bands shift."""
        with self._lock:
            for node_id in node_ids:
                m = self._members.get(node_id)
                if m is None:
                    continue
                near = self._peers(node_id)
                order = self._sites[m.site]
                i = bisect.bisect_left(order, m.key)
                del order[i]
                if not order:
                    del self._sites[m.site]
                del self._members[node_id]
                self._pending.pop(node_id, None)
                self._refresh.pop(node_id, None)
                self._unreachable.discard(node_id)
                if i == 0:
                    self._reset_reps()
                # the band's far ends and the site's new rep (and the reps' band) gain peers
                changed = set(near)
                for other in near:
                    changed.update(self._peers(other))
                self._queue(sorted(changed))

    def refresh_all(self) -> None:
        """Queue every live node to re-measure all its selected links (holds back no job)."""
        with self._lock:
            self._refresh.update(dict.fromkeys(self._members))
        self.added.set()

    def _queue(self, node_ids: Iterable[str]) -> None:
        """Under ``_lock``: queue those of ``node_ids`` that have a link to measure."""
        queued = False
        for i in node_ids:
            if i in self._members and self._untried(i):
                self._pending[i] = None
                queued = True
        if queued:
            self.added.set()

    def _untried(self, node_id: str) -> list[_Member]:
        """Under ``_lock``: the node's selected peers whose link from it was not tried since
        both registered."""
        m = self._members[node_id]
        peers = [self._members[p] for p in self._peers(node_id)]
        return [p for p in peers if self._tried.get((node_id, p.node_id), 0.0)
                < max(m.registered, p.registered)]

    def _reset_reps(self) -> None:
        # a site's first member changed: O(sites log sites), rare next to the joins themselves
        self._reps = sorted((*order[0], site) for site, order in self._sites.items())

    def _peers(self, node_id: str) -> list[str]:
        """Under ``_lock``: the node's selected peers (the rule of
        :func:`~fedpipe.planner.protoio.measurement_peers`). O(k + log n + sites)."""
        m = self._members[node_id]
        order = self._sites[m.site]
        i = bisect.bisect_left(order, m.key)
        # band() takes any sequence; it is annotated for names
        peers = [key[1] for key in band(cast(Sequence[str], order), i, MEASURE_NEIGHBOURS)]
        if i == 0:
            j = bisect.bisect_left(self._reps, (*m.key, m.site))
            h = MEASURE_SITES // 2
            near = self._reps[max(0, j - h):j + h + 1]
            peers += band([r[1] for r in near], j - max(0, j - h), MEASURE_SITES)
        return peers

    # -- state ----------------------------------------------------------------
    def waiting(self, node_ids: Iterable[str]) -> bool:
        """Whether any of ``node_ids`` has its first measurement still to come.

        O(len(node_ids)): the scheduler asks it about a job's candidate nodes
        every tick.
        """
        with self._lock:
            return any(i in self._pending or i == self._current for i in node_ids)

    def pending_count(self) -> int:
        """How many nodes wait for their first measurement (the one being measured too)."""
        with self._lock:
            return len(self._pending) + (self._current is not None)

    def peers(self, node_id: str) -> list[str]:
        """The live node's selected peers. KeyError if it is not live."""
        with self._lock:
            return self._peers(node_id)

    # -- measuring ------------------------------------------------------------
    def measure_next(self) -> bool:
        """Measure one queued node's links (pending nodes first); False if none is queued.

        Only the node's selected pairs not tried since both ends registered
        are measured (all of them on a refresh); a node with none makes no
        call. Successful measurements are stored. A failed call counts as an
        attempt: the node is not queued again until something changes.
        """
        with self._lock:
            if self._pending:
                node_id, refresh = next(iter(self._pending)), False
                del self._pending[node_id]
            elif self._refresh:
                node_id, refresh = next(iter(self._refresh)), True
                del self._refresh[node_id]
            else:
                return False
            m = self._members[node_id]
            peers = [self._members[p] for p in self._peers(node_id)] if refresh \
                else self._untried(node_id)
            if not peers:
                return True
            self._current = node_id
        try:
            self._measure(m, peers)
        finally:
            with self._lock:
                self._current = None
        return True

    def _measure(self, m: _Member, peers: list[_Member]) -> None:
        request = node_pb2.MeasureLinksRequest(peers=[
            node_pb2.Peer(node_id=p.node_id, name=p.name, address=p.address,
                          data_address=p.data_address) for p in peers])
        now = self.clock()
        error: str | None = None
        mine: list[node_pb2.LinkMeasurement] = []
        try:
            reply = self.nodes.measure_links(m.address, request)
        except NodeCallError as e:
            error = str(e)
        else:
            # a node speaks only for its own links, and only about the peers it was asked
            asked = {p.node_id for p in peers}
            mine = [x for x in reply.links if x.dst_id in asked]
            for x in mine:
                x.src_id = m.node_id
            self.store.set_links(mine)
        with self._lock:
            for p in peers:
                self._tried[(m.node_id, p.node_id)] = now
            if error is not None:
                if m.node_id not in self._unreachable:
                    self._unreachable.add(m.node_id)
                    log.warning("node %s could not measure its links (not asked again until "
                                "its neighbours change or the next refresh): %s", m.name, error)
                self._errors.append(f"{m.name}: {error}")
                return
            if m.node_id in self._unreachable:
                self._unreachable.discard(m.node_id)
                log.info("node %s measures its links again", m.name)
            self._errors.extend(f"{m.name} -> {x.dst_id}: {x.error}" for x in mine if x.error)

    def run(self, gap: float = 0.0, wait: Callable[[float], object] = time.sleep
            ) -> tuple[int, list[str]]:
        """Measure every queued node once (pending, then refresh); return how many were
        taken from the queue and the failures, which are summarised in one log line.

        Args:
            gap: seconds to ``wait`` after each re-measurement (a refresh), so a
                round is spread out; first measurements never wait, and one that
                is queued meanwhile goes next.
            wait: called with ``gap``; may return early (a node joined); a true
                result ends the round (the tracker stops).
        """
        taken = 0
        while True:
            with self._lock:
                refreshing = not self._pending and bool(self._refresh)
            if not self.measure_next():
                break
            taken += 1
            if refreshing and gap > 0 and wait(gap):
                break
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            log.warning("%d link measurement(s) failed this round, e.g. %s", len(errors),
                        "; ".join(errors[:ERRORS_NAMED]))
        if taken:
            log.info("made %d link measurement(s) this round (a node's, when it joined or "
                     "its links were due); %d node(s) live", taken, len(self._members))
        return taken, errors
