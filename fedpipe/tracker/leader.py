"""One leader among trackers that share a database: a lease with a fencing epoch.

Several trackers may run on one PostgreSQL database (``fedpipe tracker --store
postgresql://... --leader-lease 5``). One leads; the others stand by, answer every
call with UNAVAILABLE and the leader's address (:mod:`.service`), and take over
when its lease lapses. The lease is one row of the store
(:meth:`~.store.base.Store.take_lease`): who holds it, where it serves, its
fencing epoch (one more at every takeover) and when it lapses.

Safety does not rest on clocks agreeing. Every write of the leader's store is
fenced (:class:`~.store.sql.SqlStore`): inside the write's transaction the lease
row's epoch must still be this tracker's, so once a standby has taken over
(epoch + 1) no write of the deposed leader commits, however late it arrives.
Liveness and the handover's speed rest on two clocks:

- the leader's own monotonic clock: it stops leading :data:`STEP_DOWN` of a lease
  after the start of its last successful renewal, before the lease it wrote
  lapses, whatever kept it from renewing (the database unreachable, the process
  stopped with SIGSTOP): :meth:`LeaderFence.epoch` refuses from then on, so its
  writes stop before a standby may take over;
- the wall clocks of leader and standby, which must agree to within
  ``(1 - STEP_DOWN) * lease`` (1 s at the default 5 s lease; NTP keeps them far
  closer): the lease row's expiry is the leader's clock plus the lease, read
  against the standby's.

A takeover is the start of a tracker on the store (:class:`~.scheduler.Tracker`
rebuilds from it what lived in memory, as after a restart), so what a restarted
tracker keeps, a standby keeps; every live node gets a whole node lease from the
takeover (``Registry``'s ``renew_all``), so none is declared lost for one lease
while the nodes find the new leader.

Timeouts (seconds) are named here: :data:`LEASE`, :data:`RENEW_EVERY`,
:data:`STEP_DOWN`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from .store import Deposed, Lease, Store, StoreError, new_id

log = logging.getLogger("fedpipe.tracker")

LEASE = 5.0
"""Seconds the leader lease runs from each renewal: a standby takes over at most about
this long after the leader stops renewing (killed, cut off, stopped)."""
RENEW_EVERY = 1 / 3
"""Part of a lease between two renewals (and between a standby's looks at the lease), so
two renewals may fail before the leader steps down."""
STEP_DOWN = 0.8
"""Part of a lease, from the start of its last successful renewal by its own monotonic
clock, after which a leader stops leading (and refuses its own writes): before the lease
it wrote lapses for the standbys."""


class LeaderFence:
    """Whether this tracker leads now, by its own monotonic clock: the store's
    :class:`~.store.base.Fence`.

    Args:
        monotonic: seconds, monotonic (a fake in tests).
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic):
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._until = 0.0

    def epoch(self) -> int:
        """The epoch this tracker writes under.

        Raises:
            Deposed: it does not lead, or its step-down deadline has passed.
        """
        with self._lock:
            epoch, until = self._epoch, self._until
        if epoch is None:
            raise Deposed("this tracker is a standby: it does not lead, and writes nothing")
        late = self.monotonic() - until
        if late >= 0:
            raise Deposed(f"this tracker's leader lease (epoch {epoch}) could not be renewed "
                          f"in time ({late:.1f} s past its step-down deadline): it no longer "
                          f"leads, and writes nothing")
        return epoch

    def leading(self) -> bool:
        """Whether :meth:`epoch` would answer now."""
        try:
            self.epoch()
        except Deposed:
            return False
        return True

    def grant(self, epoch: int, until: float) -> None:
        """Lead at ``epoch`` until ``until`` (this fence's monotonic clock)."""
        with self._lock:
            self._epoch, self._until = epoch, until

    def revoke(self) -> None:
        """Lead no more."""
        with self._lock:
            self._epoch = None


class Leadership:
    """One tracker's claim on the leader lease: take it when it lapses, renew it, step down.

    :meth:`step` is one round (tests drive it with fake clocks, and then ``on_lead`` and
    ``on_depose`` run inside it); :meth:`start` runs rounds every ``RENEW_EVERY * lease``
    seconds on one thread and calls ``on_lead`` and ``on_depose`` in order on another,
    so a slow takeover (building the tracker from the store) never delays a renewal.

    Args:
        store: the shared store (its lease methods are not fenced).
        fence: the fence the store's writes ask; this grants and revokes it.
        address: where this tracker serves (``HOST:PORT``), told to callers of standbys.
        lease: seconds the lease runs from each renewal (:data:`LEASE`), > 0.
        on_lead: called with the new epoch when this tracker takes the lease (builds the
            tracker's domain from the store). If it raises, this tracker steps down.
        on_depose: called with the reason when this tracker stops leading (closes what
            ``on_lead`` built); its errors are logged.
        clock: seconds since the epoch (the lease row's times).
        monotonic: seconds, monotonic (must be the fence's).
        holder: this tracker's id in the lease row (default: a fresh one per process).

    Raises:
        ValueError: ``lease`` is not > 0.
    """

    def __init__(self, store: Store, fence: LeaderFence, address: str, *, lease: float = LEASE,
                 on_lead: Callable[[int], None], on_depose: Callable[[str], None],
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, holder: str | None = None):
        if not lease > 0:
            raise ValueError(f"a leader lease must be > 0 s, got {lease}")
        self.store, self.fence, self.address, self.lease = store, fence, address, lease
        self.on_lead, self.on_depose = on_lead, on_depose
        self.clock, self.monotonic = clock, monotonic
        self.holder = holder or new_id()
        self._lock = threading.RLock()  # the lease state below, between rounds and takeovers
        self._epoch: int | None = None  # the epoch this tracker took, until it steps down
        self._seen: Lease | None = None  # the lease at this tracker's last look
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changes: queue.Queue[tuple[str, int | str] | None] | None = None
        self._worker: threading.Thread | None = None

    @property
    def epoch(self) -> int | None:
        """The epoch this tracker leads at (None: it stands by)."""
        return self._epoch

    def leader(self) -> str | None:
        """The address of the tracker that leads now, as this one last saw the lease (at
        most ``RENEW_EVERY * lease`` ago); None if no lease is current (a takeover is due)."""
        if self.fence.leading():
            return self.address
        seen = self._seen
        if seen is None or not seen.holder or seen.expires <= self.clock():
            return None
        return seen.address

    def step(self) -> bool:
        """One round: renew the lease this tracker holds, step down if it cannot in time,
        or take the lease if it has lapsed. Returns whether this tracker leads after it.
        A store that cannot be reached is logged, never raised."""
        with self._lock:
            self._round()
            return self._epoch is not None and self.fence.leading()

    def _round(self) -> None:
        start, now = self.monotonic(), self.clock()
        if self._epoch is not None:
            if not self.fence.leading():
                self._step_down(f"its lease could not be renewed within {STEP_DOWN:.0%} of "
                                f"{self.lease:g} s")
            else:
                try:
                    kept = self.store.renew_lease(self.holder, self._epoch, now, self.lease)
                except StoreError as e:
                    log.warning("could not renew the leader lease (%s); stepping down at %.1f "
                                "s past the last renewal unless a later one succeeds", e,
                                STEP_DOWN * self.lease)
                    return
                if kept:
                    self.fence.grant(self._epoch, start + STEP_DOWN * self.lease)
                    return
                self._step_down("another tracker took the lease over")
        try:
            seen = self._seen = self.store.take_lease(self.holder, self.address, now,
                                                      self.lease)
        except StoreError as e:
            log.warning("could not look at the leader lease: %s", e)
            return
        if seen.holder != self.holder:
            return
        self._epoch = seen.epoch
        self.fence.grant(seen.epoch, start + STEP_DOWN * self.lease)
        log.info("this tracker (%s at %s) leads now, at fencing epoch %d", self.holder,
                 self.address, seen.epoch)
        self._tell("lead", seen.epoch)

    def _step_down(self, why: str) -> None:
        epoch, self._epoch = self._epoch, None
        self.fence.revoke()
        log.warning("this tracker stops leading (epoch %s): %s", epoch, why)
        self._tell("depose", why)
        if epoch is not None:
            try:
                self.store.release_lease(self.holder, epoch)
            except StoreError:
                pass  # it lapses by itself

    def _tell(self, change: str, arg: int | str) -> None:
        if self._changes is None:
            self._apply(change, arg)
        else:
            self._changes.put((change, arg))

    def _apply(self, change: str, arg: int | str) -> None:
        if change == "depose":
            try:
                self.on_depose(str(arg))
            except Exception:  # noqa: BLE001 — what on_lead built may fail to close cleanly
                log.exception("closing the deposed leader's state failed")
            return
        try:
            self.on_lead(int(arg))
        except Exception as e:  # noqa: BLE001 — a failed start gives the lease back
            log.exception("taking over as the leader failed")
            with self._lock:
                if self._epoch == arg:
                    self._step_down(f"taking over failed: {e}")

    def _changer(self) -> None:
        assert self._changes is not None
        while (change := self._changes.get()) is not None:
            self._apply(*change)

    def start(self) -> None:
        """Take the lease if it is free (and build what ``on_lead`` builds, before
        returning, so a tracker alone leads before it serves its first call), then run
        :meth:`step` every ``RENEW_EVERY * lease`` seconds on a thread."""
        self.step()
        self._changes = queue.Queue()
        self._worker = threading.Thread(target=self._changer, name="leadership-changes",
                                        daemon=True)
        self._worker.start()
        self._thread = threading.Thread(target=self._loop, name="leadership", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(RENEW_EVERY * self.lease):
            try:
                self.step()
            except Exception:  # noqa: BLE001 — keep trying to lead whatever one round did
                log.exception("leader lease round failed")

    def close(self) -> None:
        """Stop the rounds; if leading, step down and release the lease (so a standby
        takes over at once instead of a lease later); return once what ``on_lead`` built
        is closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._epoch is not None:
                self._step_down("this tracker is stopping")
        if self._changes is not None and self._worker is not None:
            self._changes.put(None)
            self._worker.join()
