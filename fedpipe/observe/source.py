"""Where the views read from: a narrow, read-only interface to the tracker's state.

The tracker's store satisfies :class:`Source` as it is (its methods have these
names and signatures); :class:`GrpcSource` reads the parts a remote tracker
serves over gRPC (``fedpipe status`` and ``fedpipe plot`` use it). The views
never write.

Per-stage step times (compute, waiting, sending) are reported by the stages
(``StageReport.compute_seconds`` ...) but not yet kept by the tracker: a
source that keeps them also implements :class:`StageTimeSource`, and the views
pick them up (:func:`stage_times_of`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol, Sequence, runtime_checkable

import grpc

from ..net import timeouts
from ..proto import node_pb2, tracker_pb2, tracker_pb2_grpc
from .views import History, StageTime


class JobNotFound(KeyError):
    """No job of this id where it was asked (a tracker, or its dashboard); ``str()`` names
    both: ``no job 'deadbeef0000' on tracker 10.0.0.1:7070``.

    A KeyError (so a LookupError), as a :class:`JobSource` raises for an unknown job, so
    callers that catch that catch this too. Raised by :class:`GrpcSource`,
    :class:`fedpipe.observe.status.HttpSource` and :class:`fedpipe.Job`'s calls (it is
    exported by :mod:`fedpipe.client`).

    Attributes:
        job_id: the id asked for.
        where: where it was asked: ``tracker HOST:PORT``, ``the dashboard at URL``.
    """

    def __init__(self, job_id: str, where: str):
        super().__init__(job_id)
        self.job_id, self.where = job_id, where

    def __str__(self) -> str:  # KeyError's would be the repr of its argument
        return f"no job {self.job_id!r} on {self.where}"


def on_tracker(tracker: str) -> str:
    """A :attr:`JobNotFound.where` for the tracker at ``tracker`` ("": not known)."""
    return f"tracker {tracker}" if tracker else "the tracker"


def raise_unknown_job(error: grpc.RpcError, job_id: str, tracker: str = "") -> NoReturn:
    """Raise the failure ``error`` of a tracker call about job ``job_id``: as a
    :class:`JobNotFound` naming ``tracker`` (its ``HOST:PORT``; "": not known) if it is
    NOT_FOUND (the tracker knows no such job), else as it is."""
    if error.code() == grpc.StatusCode.NOT_FOUND:
        raise JobNotFound(job_id, on_tracker(tracker)) from None
    raise error


@contextmanager
def naming_job(job_id: str, tracker: str = "") -> Iterator[None]:
    """Within: a tracker call's failure raised as :func:`raise_unknown_job` raises it
    (NOT_FOUND as :class:`JobNotFound` naming ``job_id`` and ``tracker``), for a call
    that has no other failure to tell apart."""
    try:
        yield
    except grpc.RpcError as e:
        raise_unknown_job(e, job_id, tracker)


@runtime_checkable
class SwarmSource(Protocol):
    """Nodes and measured links."""

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        """Registered nodes in registration order (live ones only unless ``include_lost``)."""

    def links(self) -> list[node_pb2.LinkMeasurement]:
        """The latest measurement of every directed link."""


@runtime_checkable
class JobSource(Protocol):
    """One job's state and event log."""

    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job's current state. Raises KeyError if unknown."""

    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        """The job's events with ``seq > after_seq``, in order."""


@runtime_checkable
class Source(SwarmSource, JobSource, Protocol):
    """Everything the dashboard and the tracker's metrics read (the tracker's store)."""

    def jobs_in(self, *states: int) -> list[str]:
        """Ids of jobs in any of ``states``, oldest first."""

    def spec(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        """The job's submission (config and model profile; layers may be absent).
        Raises KeyError if unknown."""


@runtime_checkable
class StageTimeSource(Protocol):
    """A source that keeps the stages' last reported step times (issue 12)."""

    def stage_times(self, job_id: str) -> Sequence[StageTime]:
        """Each stage's split of its last reported step, any order."""


@runtime_checkable
class JobListSource(Protocol):
    """A source that lists the jobs its caller may see (``ListJobs``)."""

    def jobs(self) -> list[tracker_pb2.JobInfo] | None:
        """The jobs, newest first, without their plans; None where the caller may not
        list them."""


def stage_times_of(source: object, job_id: str) -> list[StageTime]:
    """The stages' step times from ``source`` if it keeps them, else ``[]``."""
    if isinstance(source, StageTimeSource):
        return list(source.stage_times(job_id))
    return []


CATCH_UP_SECONDS = 1.0
"""How long :meth:`GrpcSource.events` listens on a WatchJob stream for more
events of a running job before it takes what it has."""


class GrpcSource:
    """:class:`SwarmSource` and :class:`JobSource` over a tracker's gRPC API.

    Args:
        stub: a ``TrackerStub``; the caller owns its channel.
        catch_up: see :data:`CATCH_UP_SECONDS`, seconds.
        tracker: the tracker's ``HOST:PORT``, named by :class:`JobNotFound` ("": not known).

    An unknown job raises :class:`JobNotFound`; other errors propagate as
    ``grpc.RpcError``.
    """

    def __init__(self, stub: tracker_pb2_grpc.TrackerStub, catch_up: float = CATCH_UP_SECONDS,
                 *, tracker: str = ""):
        self.stub, self.catch_up, self.tracker = stub, catch_up, tracker

    def _list(self, include_lost: bool) -> tracker_pb2.ListNodesReply:
        return self.stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=include_lost),
                                   timeout=timeouts.CONTROL_RPC)

    def nodes(self, include_lost: bool = False) -> list[tracker_pb2.NodeInfo]:
        return list(self._list(include_lost).nodes)

    def links(self) -> list[node_pb2.LinkMeasurement]:
        return list(self._list(False).links)

    def job(self, job_id: str) -> tracker_pb2.JobInfo:
        with naming_job(job_id, self.tracker):
            return self.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job_id),
                                    timeout=timeouts.CONTROL_RPC)

    def jobs(self) -> list[tracker_pb2.JobInfo] | None:
        """:class:`JobListSource`'s: a client's own jobs, the operator's every job; None
        for a caller that may not list them (a node's certificate) or a tracker without
        ``ListJobs``."""
        try:
            return list(self.stub.ListJobs(tracker_pb2.ListJobsRequest(),
                                           timeout=timeouts.CONTROL_RPC).jobs)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED):
                return None
            raise

    def events(self, job_id: str, after_seq: int) -> list[tracker_pb2.JobEvent]:
        # WatchJob streams a running job's events for ever: read until the stream
        # stays quiet for ``catch_up`` seconds (or ends, for a finished job), or
        # brings an event from after this call began (a busy job is never quiet)
        out: list[tracker_pb2.JobEvent] = []
        began = time.time()
        while True:
            got = 0
            try:
                for ev in self.stub.WatchJob(tracker_pb2.WatchJobRequest(
                        job_id=job_id, after_seq=after_seq), timeout=self.catch_up):
                    out.append(ev)
                    after_seq, got = ev.seq, got + 1
                return out
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise_unknown_job(e, job_id, self.tracker)
            if not got or out[-1].time >= began:
                return out


class Histories:
    """Each job's :class:`~fedpipe.observe.views.History`, read incrementally from a source.

    :meth:`get` reads only the events since the last call for that job. At
    most ``max_jobs`` histories are kept (the least recently asked for go
    first). Thread-safe.
    """

    def __init__(self, source: JobSource, max_jobs: int = 64):
        self.source, self.max_jobs = source, max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[str, History] = {}

    def get(self, job_id: str) -> History:
        """A snapshot of job ``job_id``'s history, brought up to date."""
        with self._lock:
            h = self._jobs.pop(job_id, None) or History()
            self._jobs[job_id] = h  # most recently used last
            while len(self._jobs) > self.max_jobs:
                self._jobs.pop(next(iter(self._jobs)))
            h.extend(self.source.events(job_id, h.last_seq))
            snap = History(h.max_records, h.changes.maxlen or 1)
            snap.records = list(h.records)
            snap.changes.extend(h.changes)
            snap.checkpoints.extend(h.checkpoints)
            snap.last_seq = h.last_seq
            return snap
