"""The :class:`Store` interface: everything the tracker knows, and the rules every backend keeps.

The rest of the tracker talks to a :class:`Store` only. Its backends
(:mod:`.sqlite`, :mod:`.postgres`, :mod:`.memory`) live beside this module and
``tests/test_store.py`` runs one contract test against each, as Flower's
``LinkState`` ABC has an in-memory and an SQL implementation under one test.

The store decides nothing: it never reads a clock (callers pass ``now``,
seconds since the epoch) and applies no rule beyond the one every backend
must keep, that a job in a terminal state never changes state again.
Protobuf messages are returned as fresh copies; changing them changes nothing
stored.

Errors every backend raises (beyond ``KeyError`` for an unknown job):
:class:`StoreUnavailable` (the database cannot be reached; a tracker call answers
UNAVAILABLE and its caller retries), :class:`StoreConfigError` (a store URL or
path that names no usable store) and :class:`SchemaTooNew` (a database written
by a newer fedpipe), and, for a store opened with a :class:`Fence`, :class:`Deposed`
(this tracker no longer leads: its write was refused and nothing was written).

Several trackers may share one database (:mod:`fedpipe.tracker.leader`): one leads,
holding the one lease row (:meth:`Store.take_lease`) whose fencing epoch grows at
every takeover. A store opened with a :class:`Fence` checks, inside the
transaction of every write, that the lease's epoch is still the fence's, so a
deposed leader's writes are refused by the database itself.
"""
from __future__ import annotations

import abc
import math
import uuid
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from ...proto import node_pb2, tracker_pb2
from ..errors import Unavailable


class StoreError(Exception):
    """Base of the errors a store raises about itself (not about a job or node)."""


class StoreConfigError(StoreError, ValueError):
    """The store's URL or path names no usable store (a garbage URL, an unknown scheme)."""


class StoreUnavailable(StoreError, Unavailable):
    """The database cannot be reached now (refused, timed out, the connection broke).

    A subclass of the tracker's :class:`~fedpipe.tracker.errors.Unavailable`, so a call
    that meets it answers UNAVAILABLE and the caller retries.
    """


class SchemaTooNew(StoreError):
    """The database's schema is newer than this fedpipe knows: written by a later release.

    Attributes:
        found: the database's schema version.
        supported: the newest version this fedpipe knows.
    """

    def __init__(self, where: str, found: int, supported: int):
        super().__init__(
            f"{where} has schema version {found}, newer than this fedpipe's {supported}: "
            f"it was written by a later fedpipe release; run that release (or a newer "
            f"one), or point the tracker at another database")
        self.found, self.supported = found, supported


class Deposed(StoreError, Unavailable):
    """This tracker does not lead (any more): its write was refused, nothing was written.

    Either its own lease deadline passed (it could not renew in time: cut off from
    the database, or stopped) or the lease row holds another epoch (a standby took
    over). A subclass of :class:`~fedpipe.tracker.errors.Unavailable`: the caller is
    told UNAVAILABLE and retries, at the new leader.
    """


class Fence(Protocol):
    """What a store asks before every write, when several trackers share its database."""

    def epoch(self) -> int:
        """The fencing epoch this tracker writes under.

        Raises:
            Deposed: it does not lead now (or its lease deadline has passed).
        """


@dataclass(frozen=True)
class Lease:
    """The leader lease as the store keeps it (one row).

    Attributes:
        holder: the leading tracker's id (new at every tracker process start; '' none yet).
        address: where it serves (``HOST:PORT``), for redirects.
        epoch: the fencing epoch, one more at every takeover (0: never held).
        expires: when the lease lapses unless renewed, seconds since the epoch (the
            holder's clock at its last renewal plus the lease length).
    """

    holder: str
    address: str
    epoch: int
    expires: float


@dataclass(frozen=True)
class NodeRecord:
    """One registered node incarnation as the store keeps it.

    Attributes:
        info: what ``ListNodes`` shows of it.
        boot_id: the node process's boot id (new at every process start).
        versions: the versions it registered with.
        fenced: a newer incarnation registered at its address; this one
            never becomes alive again.
    """

    info: tracker_pb2.NodeInfo
    boot_id: str
    versions: tracker_pb2.Versions
    fenced: bool = False


def new_id() -> str:
    """A fresh 12-hex-digit id for a node or a job."""
    return uuid.uuid4().hex[:12]


class Store(abc.ABC):
    """Everything the tracker knows. Every method is safe to call from several threads.

    Every method may also raise :class:`StoreUnavailable` (a database backend that
    cannot be reached).

    Attributes:
        where: the store in words, for logs and errors (never with a password).
    """

    where: str = "a tracker store"

    # -- nodes --------------------------------------------------------------
    @abc.abstractmethod
    def add_node(self, node_id: str, name: str, address: str, resources: node_pb2.Resources,
                 boot_id: str, versions: tracker_pb2.Versions, now: float,
                 data_address: str = "", relay: str = "") -> None:
        """Store a new live node incarnation registered at ``now``, with its socket data
        plane's ``data_address`` and the ``relay`` it is homed at ("": none)."""

    @abc.abstractmethod
    def renew_node(self, node_id: str, resources: node_pb2.Resources,
                   versions: tracker_pb2.Versions, now: float, address: str = "",
                   data_address: str = "", relay: str = "") -> None:
        """The same incarnation registered again: new resources, alive, heartbeat ``now``;
        at ``address`` if one is given (it moved to another relay), and with the
        ``data_address`` and ``relay`` it registered with now.

        Its ``registered`` time is kept, so its links stay measured.
        """

    @abc.abstractmethod
    def fence_node(self, node_id: str) -> None:
        """Mark a replaced incarnation lost for good (heartbeats no longer revive it)."""

    @abc.abstractmethod
    def heartbeat(self, node_id: str, now: float) -> bool:
        """Renew a node's lease (a lost node comes back alive); False if unknown or fenced."""

    @abc.abstractmethod
    def mark_lost(self, node_id: str) -> bool:
        """Mark a node lost now (it left, or was found gone); False if it was not a live
        node (unknown, or lost already)."""

    @abc.abstractmethod
    def mark_lost_many(self, node_ids: Iterable[str]) -> None:
        """Mark each of ``node_ids`` lost, in one transaction (unknown ids are skipped)."""

    @abc.abstractmethod
    def set_heartbeats(self, beats: Mapping[str, float]) -> None:
        """Record many nodes' last heartbeat times (seconds since the epoch) in one transaction.

        Only live, unfenced nodes are updated: a node marked lost since the
        heartbeat was taken stays lost (reviving a node is :meth:`heartbeat`'s
        work). This is how the registry persists liveness in batches.
        """

    @abc.abstractmethod
    def expire_nodes(self, cutoff: float) -> list[str]:
        """Mark live nodes whose last heartbeat is before ``cutoff`` lost; return their ids."""

    @abc.abstractmethod
    def renew_all(self, now: float) -> None:
        """Give every live node a heartbeat at ``now`` (at tracker start-up)."""

    @abc.abstractmethod
    def node_records(self, include_lost: bool = False) -> list[NodeRecord]:
        """Registered node incarnations, oldest registration first (ties by node id)."""

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        """:meth:`node_records`' ``NodeInfo`` messages."""
        return [r.info for r in self.node_records(include_lost)]

    # -- links --------------------------------------------------------------
    @abc.abstractmethod
    def set_links(self, links: Iterable[node_pb2.LinkMeasurement]) -> None:
        """Keep the latest measurement of each directed link (failed ones are skipped)."""

    @abc.abstractmethod
    def links(self) -> list[node_pb2.LinkMeasurement]:
        """The latest measurement of every directed link, ordered by (src, dst)."""

    def links_among(self, node_ids: Iterable[str]) -> list[node_pb2.LinkMeasurement]:
        """:meth:`links` whose both ends are in ``node_ids``, ordered by (src, dst): what a
        plan over those nodes needs, without reading a swarm's worth of links (80,000 at
        10,000 nodes) on every scheduler tick. This default filters :meth:`links`."""
        ids = set(node_ids)
        return [m for m in self.links() if m.src_id in ids and m.dst_id in ids]

    # -- jobs ---------------------------------------------------------------
    @abc.abstractmethod
    def add_job(self, spec: tracker_pb2.SubmitJobRequest, reason: str, now: float) -> str:
        """Store a new PENDING job with its layers and a first event; return its id."""

    @abc.abstractmethod
    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        """The job's submission without its layers. KeyError if unknown."""

    @abc.abstractmethod
    def layers(self, job_id: str, start: int, end: int) -> list[bytes]:
        """The pickled layers ``[start, end)`` of a job (none once it is terminal)."""

    @abc.abstractmethod
    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job's current state. KeyError if unknown."""

    @abc.abstractmethod
    def jobs_in(self, *states: int) -> list[str]:
        """Ids of jobs in any of ``states``, oldest first."""

    @abc.abstractmethod
    def set_state(self, job_id: str, state: int, reason: str, now: float, *,
                  only_from: set[int] | None = None) -> bool:
        """Move a job to ``state`` with ``reason`` and log the event.

        A terminal state drops the job's layers. Returns False (and changes
        nothing) if the job is unknown, terminal, or not in ``only_from``
        when that is given.
        """

    @abc.abstractmethod
    def set_plan(self, job_id: str, plan: node_pb2.Plan, readdressed: bool = False) -> None:
        """Store the job's plan and mark each of its stages not done (``readdressed``: the
        same stages at new addresses, a node having moved relays: their marks stay)."""

    @abc.abstractmethod
    def set_config(self, job_id: str, config: node_pb2.JobConfig) -> None:
        """Replace the job's config (its "auto" settings resolved when it was planned)."""

    @abc.abstractmethod
    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float,
                    now: float) -> None:
        """A step completed: keep its loss (NaN allowed) and log a step event.

        The log stays bounded: every :data:`COMPACT_EVERY` steps, once a job has
        more than :data:`MAX_STEP_EVENTS` step events, every other one of the
        older half is dropped (state, checkpoint and recovery events are kept), so
        the newest steps stay complete and older ones thin out geometrically."""

    @abc.abstractmethod
    def stage_done(self, job_id: str, replica: int, stage: int) -> bool:
        """Mark a stage done; True when every stage of the job's plan is done."""

    @abc.abstractmethod
    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        """The job's events with ``seq > after_seq``, in order; seqs grow across all jobs."""

    @abc.abstractmethod
    def set_recovery(self, job_id: str, fields: tracker_pb2.JobInfo, now: float, *,
                     rewind_to: int | None = None, event: tracker_pb2.JobEvent | None = None
                     ) -> None:
        """Keep the job's recovery fields (``epoch``, ``checkpoint_step``,
        ``resume_step``, ``recoveries``) as ``fields`` has them; with ``rewind_to``
        also set its step back to that; with ``event`` also log it (its ``seq``
        and ``time`` are assigned here). Unknown jobs are ignored."""

    @abc.abstractmethod
    def set_replicas(self, job_id: str, epoch: int, snapshot: bytes) -> None:
        """Keep the job's replica-group membership of plan ``epoch`` (a
        :meth:`~fedpipe.tracker.replicas.ReplicaSet.snapshot`, as JSON), replacing the last.
        Dropped when the job ends."""

    @abc.abstractmethod
    def replicas(self, job_id: str) -> tuple[int, bytes] | None:
        """The job's last :meth:`set_replicas` as ``(epoch, snapshot)``; None if none."""

    # -- the leader lease -----------------------------------------------------
    @abc.abstractmethod
    def take_lease(self, holder: str, address: str, now: float, seconds: float) -> Lease:
        """Take the leader lease for ``holder`` if it has lapsed (``expires <= now``) or
        ``holder`` holds it already, in one transaction; return the lease as it is then.

        Taking it (even back) makes the epoch one more, so writes fenced by an older epoch
        are refused from now on; the lease then runs to ``now + seconds``. Not fenced.
        """

    @abc.abstractmethod
    def renew_lease(self, holder: str, epoch: int, now: float, seconds: float) -> bool:
        """Extend the lease to ``now + seconds`` if ``holder`` holds it at ``epoch``; False
        (nothing changed) if not: it was taken over. Not fenced."""

    @abc.abstractmethod
    def release_lease(self, holder: str, epoch: int) -> None:
        """End ``holder``'s lease at ``epoch`` now (a tracker that stops), so a standby
        need not wait for it to lapse; nothing if another holds it. Not fenced."""

    @abc.abstractmethod
    def lease(self) -> Lease:
        """The leader lease now (epoch 0 and no holder: never taken)."""

    def close(self) -> None:  # noqa: B027 — optional: a backend with nothing to release
        """Release the backend's resources."""


RECOVERY_FIELDS = ("epoch", "checkpoint_step", "resume_step", "recoveries")
"""The ``JobInfo`` fields :meth:`Store.set_recovery` keeps."""


def bare(spec: tracker_pb2.SubmitJobRequest) -> tracker_pb2.SubmitJobRequest:
    """A copy of ``spec`` without its layers (stored apart, served by range)."""
    out = tracker_pb2.SubmitJobRequest()
    out.CopyFrom(spec)
    del out.layers[:]
    return out


def recovery_only(info: tracker_pb2.JobInfo) -> tracker_pb2.JobInfo:
    """A ``JobInfo`` with only ``info``'s :data:`RECOVERY_FIELDS` set."""
    out = tracker_pb2.JobInfo(epoch=info.epoch, checkpoint_step=info.checkpoint_step,
                              resume_step=info.resume_step)
    out.recoveries.extend(info.recoveries)
    return out


MAX_STEP_EVENTS = 4096
"""Step events a job's log keeps before it thins out its older half (see ``record_step``)."""
COMPACT_EVERY = 256
"""Steps between checks of a job's step-event count."""


def compact_due(step: int) -> bool:
    """Whether :meth:`Store.record_step` of ``step`` checks the job's step-event count."""
    return step % COMPACT_EVERY == 0


def thinned(step_seqs: list[int]) -> list[int]:
    """The seqs to drop from a job's step events ``step_seqs`` (oldest first): none while
    there are at most :data:`MAX_STEP_EVENTS`, else every other one of the older half."""
    if len(step_seqs) <= MAX_STEP_EVENTS:
        return []
    return step_seqs[:len(step_seqs) // 2][1::2]


def job_state(state: int) -> tracker_pb2.JobState:
    """``state`` as the type protobuf's stubs give a job-state field (the enum's class;
    the interface takes plain ints, as the messages hold them)."""
    return state  # type: ignore[return-value]


def nan_if_none(value: float | None) -> float:
    """A loss read back from SQL: SQLite keeps NaN as NULL, its only way to store a
    diverged step's loss."""
    return math.nan if value is None else value
