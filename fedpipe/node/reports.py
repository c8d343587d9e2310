"""What a node tells the tracker about its stages (StageReport), and its metrics of each step.

:class:`StageReporter` makes the reports; :class:`ReportQueue` sends them in order and
keeps them while no tracker takes them, so the stages train on without one."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

import grpc

from ..net import reason, timeouts
from ..observe.metrics import NodeMetrics
from ..proto import tracker_pb2
from ..runtime.stage import StepResult
from ..spec import StageKey
from .lifecycle import StageSlot
from .memory import StageMemory

log = logging.getLogger(__name__)


class Reported(Protocol):
    """What a report names of a stage (a :class:`~fedpipe.node.lifecycle.Stage`)."""

    slot: StageSlot
    epoch: int

    @property
    def job_id(self) -> str: ...

    @property
    def key(self) -> StageKey: ...


class StageReporter:
    """Sends a stage's reports to the tracker and sets the node's gauges of its steps.

    Args:
        node_id: returns the tracker-assigned id (known after registration).
        report: sends a StageReport to the tracker (may block briefly).
        metrics: where each step's time split goes (None: no metrics).
        memory: each stage's measured peak and predicted memory (None: not reported).
    """

    def __init__(self, node_id: Callable[[], str],
                 report: Callable[[tracker_pb2.StageReport], None],
                 metrics: NodeMetrics | None = None, memory: StageMemory | None = None):
        self.node_id, self.send, self.metrics = node_id, report, metrics
        self.memory = memory

    def report(self, stage: Reported, status: tracker_pb2.StageReport.Status,
               **fields: Any) -> None:
        """One StageReport of ``stage`` with ``status`` (a ``StageReport.STATUS_*``) and
        ``fields`` (step, error, peer, ...)."""
        self.send(tracker_pb2.StageReport(job_id=stage.job_id, replica=stage.slot.replica,
                                          stage=stage.slot.stage, node_id=self.node_id(),
                                          status=status, epoch=stage.epoch, **fields))

    def step(self, stage: Reported, result: StepResult) -> None:
        """One report per step, from every stage: its time split, its measured peak
        memory beside the predicted, and the loss and samples (the last stage's count
        towards the job's step)."""
        peak, predicted = self.memory.figures(stage.slot) if self.memory else (0, 0)
        self.report(stage, tracker_pb2.StageReport.STATUS_STEP, step=result.step + 1,
                    loss=result.loss or 0.0, samples=result.samples, seconds=result.seconds,
                    compute_seconds=result.compute_seconds, wait_seconds=result.wait_seconds,
                    send_seconds=result.send_seconds, peak_memory_bytes=peak,
                    predicted_memory_bytes=predicted)
        if self.metrics is not None:
            self.metrics.stage_step(stage.job_id, *stage.key, compute=result.compute_seconds,
                                    wait=result.wait_seconds, send=result.send_seconds)
            self.metrics.in_flight(stage.job_id, *stage.key, result.in_flight)
            self.metrics.staleness(stage.job_id, *stage.key, result.staleness)

    def forget_job(self, job_id: str) -> None:
        """Drop ``job_id``'s gauges (its stages and snapshots are gone from this node)."""
        if self.metrics is not None:
            self.metrics.forget_job(job_id)


REPORTS_KEPT = 10_000
"""Most stage reports a node keeps while no tracker takes them (its tracker restarting, or
no tracker leading); past it the oldest step report is dropped (a later step's report
says more), never a checkpoint's, a stage's end or its failure."""
KEEP_ALWAYS = frozenset({tracker_pb2.StageReport.STATUS_DONE, tracker_pb2.StageReport.STATUS_FAILED,
                         tracker_pb2.StageReport.STATUS_CHECKPOINT,
                         tracker_pb2.StageReport.STATUS_SUSPECT})
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class ReportQueue:
    """A node's stage reports, sent to the tracker in order on one thread, and kept while
    no tracker takes them, for the next one that leads (or the restarted one).

    The stages never wait for the tracker: :meth:`put` only queues. A report the
    tracker cannot take now (UNAVAILABLE: down, restarting, a standby that knows no
    leader; DEADLINE_EXCEEDED: stopped) is sent again, :data:`~fedpipe.net.timeouts.
    RECONNECT_BACKOFF_MIN` to ``MAX`` s apart, before any later one; at most
    ``limit`` are kept (:data:`REPORTS_KEPT`). The node's log says once that the
    tracker is unreachable and once that it takes reports again. A report the tracker
    refuses for another reason (the job ended, a stage moved) is logged and dropped,
    as before there was a queue.

    Args:
        send: sends one report (``TrackerStub.ReportStage`` with a deadline).
        limit: the most reports kept, >= 1.
    """

    def __init__(self, send: Callable[[tracker_pb2.StageReport], object],
                 limit: int = REPORTS_KEPT):
        self.send, self.limit = send, limit
        self._queue: deque[tracker_pb2.StageReport] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0  # step reports dropped at the limit, since the tracker was last reached
        self.sent = 0
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="reports", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def put(self, report: tracker_pb2.StageReport) -> None:
        """Queue ``report`` (never blocks); at the limit drop the oldest step report."""
        with self._cond:
            self._queue.append(report)
            if len(self._queue) > self.limit:
                for i, r in enumerate(self._queue):
                    if r.status not in KEEP_ALWAYS:
                        del self._queue[i]
                        self.dropped += 1
                        break
            self._cond.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every queued report to be sent; whether they were."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout)

    def close(self, timeout: float = timeouts.THREAD_JOIN) -> None:
        """Stop sending (what is still queued is dropped); wait for the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        delay = timeouts.RECONNECT_BACKOFF_MIN
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                report = self._queue[0]
            try:
                self.send(report)
            except grpc.RpcError as e:
                if e.code() in UNREACHABLE:
                    self.unreachable(e)
                    with self._cond:
                        self._cond.wait_for(lambda: self._closed, delay)
                    delay = min(timeouts.RECONNECT_BACKOFF_MAX, delay * 2)
                    continue
                log.warning("the tracker refused a report of job %s stage %d (replica %d) "
                            "(%s: %s); dropped", report.job_id, report.stage, report.replica,
                            e.code().name, e.details())
            self._reached()
            delay = timeouts.RECONNECT_BACKOFF_MIN
            with self._cond:
                if self._queue and self._queue[0] is report:
                    self._queue.popleft()
                self.sent += 1
                self._cond.notify_all()

    def unreachable(self, e: grpc.RpcError) -> None:
        """The tracker did not take a call (``e``): the first time since it last did, log it
        (one line for the node's calls that wait for a leader, not one per try)."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("the tracker is unreachable (%s); this node's stages train on "
                        "and it keeps their reports (at most %d) for the tracker that leads "
                        "next", reason(e), self.limit)

    def _reached(self) -> None:
        if self._down_since is not None:
            log.warning("the tracker takes reports again after %.1f s: sending the %d kept"
                        "%s", time.monotonic() - self._down_since, len(self),
                        f" ({self.dropped} step reports dropped at the limit)"
                        if self.dropped else "")
            self._down_since, self.dropped = None, 0
