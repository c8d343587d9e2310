"""What a node tells the tracker about its stages (StageReport), and its metrics of each step."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from ..observe.metrics import NodeMetrics
from ..proto import tracker_pb2
from ..runtime.stage import StepResult
from ..spec import StageKey
from .lifecycle import StageSlot
from .memory import StageMemory


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
