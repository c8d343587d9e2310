"""A job's progress: the nodes' reports of steps, checkpoints, and stages done or failed.

:meth:`Progress.report` takes one stage's word (``ReportStage``):

- a step done: each stage's step split is kept (:mod:`.stagetimes`); the step is
  recorded once every replica group's last stage has reported it (its loss is
  the groups' sum, its samples/s the total over the slowest group's time), and
  once per window of steps the cost model is fitted to the splits
  (:mod:`.calibration`);
- a checkpoint acknowledged: once every stage has acknowledged its snapshot of a
  step, that step is a complete checkpoint (a consistent cut), stored;
- a stage done: once every stage of the plan is, the job SUCCEEDS;
- a peer suspected, or a stage failed: the peer is Pinged and declared lost if
  it does not answer (:meth:`~.recovery.Recovery.suspect`), else the job fails.

Each recorded step and each complete checkpoint is told to a
:class:`StepListener` (the :mod:`.rebalance` hand-overs and migrations).
:meth:`Progress.watch` streams a job's events (``WatchJob``) until it ends.
"""
from __future__ import annotations

import logging
import statistics
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, Protocol

from .. import planner
from ..proto import tracker_pb2
from ..spec import ACTIVE, TERMINAL, PlanView, StageKey, state_name
from .calibration import Calibration
from .errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                     TrackerError)
from .jobs import Jobs, stage_name
from .stagetimes import STAGE_TIME_WINDOW, StageTimes
from .store import Store
from .tallies import Tallies

log = logging.getLogger("fedpipe.tracker")
S = tracker_pb2
R = tracker_pb2.StageReport

WATCH_RECHECK = 0.5
"""Seconds a watcher waits for a notification before it reads the job's events again
(every change notifies; this bounds the delay should one be missed)."""


class StepListener(Protocol):
    """Told of each recorded step and each complete checkpoint of a job."""

    def on_step(self, job_id: str, step: int) -> None: ...

    def on_checkpoint(self, job_id: str, step: int) -> None: ...


class Suspects(Protocol):
    """Checks a peer a stage could not reach (:meth:`~.recovery.Recovery.suspect`)."""

    def suspect(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> bool: ...


class Quorums(Protocol):
    """Which replica groups take part in a step (:mod:`.replica_groups`)."""

    def out(self, job: tracker_pb2.JobInfo, replica: int) -> bool: ...

    def groups(self, job: tracker_pb2.JobInfo, step: int) -> int: ...

    def stages(self, job: tracker_pb2.JobInfo, step: int) -> int: ...

    def checkpointed(self, job: tracker_pb2.JobInfo, step: int) -> None: ...


class Progress:
    """The nodes' reports about a job's steps (see the module docstring).

    Args:
        store: the tracker's state.
        jobs: the life cycle (SUCCEEDED, FAILED).
        tallies: per-step reports and checkpoint acknowledgements.
        stage_times: each stage's recent step splits.
        calibration: the cost model fitted from the splits.
        groups: which replica groups take part in each step.
        suspects: checks a peer a stage reported.
        listener: told of steps and checkpoints.
        epoch_lock: held while a job's epoch changes (:class:`~.recovery.Records`): a
            checkpoint completes wholly before or after a recovery begins.
        clock: seconds since the epoch.
    """

    def __init__(self, store: Store, jobs: Jobs, tallies: Tallies, stage_times: StageTimes,
                 calibration: Calibration, groups: Quorums, suspects: Suspects,
                 listener: StepListener, epoch_lock: AbstractContextManager[Any],
                 clock: Callable[[], float] = time.time):
        self.store, self.jobs, self.tallies, self.stage_times = store, jobs, tallies, stage_times
        self.calibration, self.groups, self.suspects = calibration, groups, suspects
        self.listener, self.clock = listener, clock
        self._lock = epoch_lock

    def report(self, report: tracker_pb2.StageReport) -> None:
        """A node's word on one of its stages: a step done, all steps done, or failed.

        Reports about a job that has ended are ignored. A step is recorded
        once every replica group has reported it; the job SUCCEEDS once every
        stage of its plan is done; a failed stage fails the job.

        Raises:
            NotFound: no such job.
            PermissionDenied: the node does not run that stage of the job.
            FailedPrecondition: the job is not active, or the step is out of range.
            InvalidArgument: an unknown status.
        """
        job = self.jobs.get(report.job_id)
        if job.state in TERMINAL or report.epoch != job.epoch:
            return  # an ended job, or a stage of an epoch before a recovery
        key = StageKey(report.replica, report.stage)
        mine = PlanView(job.plan).get(key)
        if mine is None or mine.node_id != report.node_id:
            raise PermissionDenied(f"node {report.node_id!r} does not run stage {report.stage} "
                                   f"(replica {report.replica}) of job {job.job_id}")
        if job.state not in ACTIVE or not 0 <= report.step <= job.steps:
            raise FailedPrecondition(f"job {job.job_id} is {state_name(job.state)} with "
                                     f"{job.steps} steps; report of step {report.step} refused")
        if self.groups.out(job, report.replica):
            return  # a stage of a dropped replica group: the others go on without it
        if report.status == R.STATUS_STEP:
            self._step(job, report)
        elif report.status == R.STATUS_DONE:
            if self.store.stage_done(job.job_id, report.replica, report.stage):
                self.jobs.move(job.job_id, S.JOB_STATE_SUCCEEDED, f"all {job.steps} steps done")
        elif report.status == R.STATUS_CHECKPOINT:
            self._checkpointed(job, report)
        elif report.status == R.STATUS_SUSPECT:
            self.suspects.suspect(job, report)
        elif report.status == R.STATUS_FAILED:
            self._failed(job, report)
        else:
            raise InvalidArgument(f"unknown report status {report.status}")
        self.jobs.notify()

    def held(self, node_id: str, holds: list[tracker_pb2.StageRef]) -> None:
        """The checkpoint acknowledgements a node's heartbeat carries (``StageRef.acked``),
        counted as its reports were: the tallies live in memory, so a tracker that took
        over (or restarted) after its predecessor counted some of a checkpoint's
        acknowledgements learns them again from the heartbeats, and the checkpoint
        completes instead of a later recovery rewinding past it. An ack counted twice
        counts once. Acks of another epoch, of a step at or before the job's last
        complete checkpoint, of an ended or unknown job, or of a stage the node does not
        run are passed over."""
        for ref in holds:
            if not ref.acked:
                continue
            try:
                job = self.jobs.get(ref.job_id)
            except NotFound:
                continue
            if job.state not in ACTIVE or ref.epoch != job.epoch:
                continue
            for step in ref.acked:
                if step <= job.checkpoint_step:
                    continue
                try:
                    self.report(R(job_id=ref.job_id, replica=ref.replica, stage=ref.stage,
                                  node_id=node_id, status=R.STATUS_CHECKPOINT, epoch=ref.epoch,
                                  step=step))
                except TrackerError as e:  # moved meanwhile: the node is told to drop it
                    log.debug("job %s: a held acknowledgement of step %d passed over: %s",
                              ref.job_id, step, e)

    def _failed(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        if job.state == S.JOB_STATE_RECOVERING:
            return  # a stage of the epoch being replaced gave up: expected
        if report.peer and self.suspects.suspect(job, report):
            return  # its peer is gone: the job recovers
        # only from where this report was read: a recovery may have begun meanwhile
        key = StageKey(report.replica, report.stage)
        self.jobs.fail(job.job_id, f"{stage_name(key)} on node {report.node_id} failed: "
                                   f"{report.error}", only_from={job.state})

    def _step(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """Add one replica group's share of a step; record the step when all groups reported.

        Each group's loss is its part of the batch-mean loss, so the step's
        loss is their sum, and its samples/s the total samples over the
        slowest group's time. A group's report sent twice counts once.
        """
        self.stage_times.record(job, report)
        if report.stage != PlanView(job.plan).depth(report.replica) - 1:
            return  # every stage reports its step time; the group's last one carries the loss
        reports = self.tallies.add_step(job.job_id, report, self.groups.groups(job, report.step))
        if reports is None:
            return
        loss = sum(r.loss for r in reports)
        samples, seconds = sum(r.samples for r in reports), max(r.seconds for r in reports)
        self.store.record_step(job.job_id, report.step, loss,
                               samples / seconds if seconds > 0 else 0.0, self.clock())
        self.listener.on_step(job.job_id, report.step)
        if report.step % STAGE_TIME_WINDOW == 0 and report.step >= 2 * STAGE_TIME_WINDOW:
            self._calibrate(job)  # once per window of steps, past the first (warm-up)

    def _calibrate(self, job: tracker_pb2.JobInfo) -> None:
        """Fit the cost model to the job's recent stage splits (all its stages reported)."""
        windows = self.stage_times.windows(job.job_id, job.epoch)
        if not windows or len(windows) < len(job.plan.stages):
            return
        compute = {key: statistics.median(c for c, _, _ in w) for key, w in windows.items()}
        step = statistics.median(statistics.median(sum(x) for x in w) for w in windows.values())
        try:
            self.calibration.observe(job.job_id, job.epoch, compute, step)
        except (planner.PlanError, KeyError) as e:  # an async plan, a node gone meanwhile
            log.debug("job %s: no calibration from this plan: %s", job.job_id, e)

    def _checkpointed(self, job: tracker_pb2.JobInfo, report: tracker_pb2.StageReport) -> None:
        """A stage's snapshot of ``report.step`` is kept on its node and its buddy; once
        every stage of the plan says so, the step is a complete checkpoint (a consistent
        cut), recorded in the store."""
        with self._lock:  # read now: a recovery may have begun since the report was read
            job = self.jobs.get(job.job_id)
            if report.epoch != job.epoch:
                return
            if not self.tallies.ack(job.job_id, job.epoch, report.step,
                                    StageKey(report.replica, report.stage),
                                    self.groups.stages(job, report.step)) \
                    or report.step <= job.checkpoint_step:
                return
            self.groups.checkpointed(job, report.step)
            self.tallies.completed(job.job_id, report.step)
            fields = tracker_pb2.JobInfo()
            fields.CopyFrom(job)
            fields.checkpoint_step = report.step
            self.store.set_recovery(job.job_id, fields, self.clock(), event=tracker_pb2.JobEvent(
                state=job.state, reason=f"checkpoint of step {report.step} complete",
                checkpoint_step=report.step, epoch=job.epoch))
        self.listener.on_checkpoint(job.job_id, report.step)

    def info(self, job_id: str) -> tracker_pb2.JobInfo:
        """The job with each stage's recent step split, and its measured peak and
        predicted memory (``JobInfo.stage_times``), for ``GetJob``. (Each stage's
        predicted step split is on its plan: ``StageAssignment.predicted_*_seconds``.)

        Raises:
            NotFound: no such job.
        """
        job = self.jobs.get(job_id)
        for t in self.stage_times.of(job_id):
            job.stage_times.add(replica=t.replica, stage=t.stage, compute_seconds=t.compute,
                                wait_seconds=t.wait, send_seconds=t.send,
                                peak_memory_bytes=t.peak_memory,
                                predicted_memory_bytes=t.predicted_memory)
        return job

    def watch(self, job_id: str, after_seq: int, active: Callable[[], bool]
              ) -> Iterator[tracker_pb2.JobEvent]:
        """The job's events after ``after_seq``, then each new one, until it ends.

        Stops when the job is terminal and its events are all given, or when
        ``active()`` turns false (the watcher left, the tracker stops).

        Raises:
            NotFound: no such job (at the first ``next``).
        """
        self.jobs.get(job_id)
        seq = after_seq
        while active():
            events = self.store.events(job_id, seq)
            for ev in events:
                yield ev
                seq = ev.seq
            if not events:
                if self.store.job(job_id).state in TERMINAL:
                    return
                self.jobs.wait(WATCH_RECHECK)
