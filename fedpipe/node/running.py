"""A stage's thread: its steps, its checkpoints, its hand-over cuts, and how it ends.

:class:`StageLoop` starts a loaded stage's thread and moves the stage through
RESTORING (a joining group's), RUNNING, HELD and its end
(:mod:`~fedpipe.node.lifecycle`). After each step it reports the step, takes a
checkpoint every ``checkpoint_every`` steps (:class:`~fedpipe.node.snapshots.Checkpoints`)
and at a hand-over cut (a drain or a migration, :meth:`StageLoop.hold`), where it
then waits until stopped or given a later cut.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from ..net import timeouts
from ..proto import tracker_pb2
from ..runtime.stage import StageError, StepResult
from .errors import StageLoadError, Stopped
from .lifecycle import Stage, StageState
from .mailbox import Mailbox
from .reports import StageReporter
from .restore import Restorer
from .snapshots import Checkpoints

log = logging.getLogger(__name__)

HOLD_RECHECK = 0.2
"""Seconds a stage holding at a hand-over cut waits before it looks at its state again."""
R = tracker_pb2.StageReport


class StageLoop:
    """Runs loaded stages, each on a thread of its own. Thread-safe.

    Args:
        reporter: reports each step and each stage's end to the tracker.
        checkpoints: takes, keeps and ships a stage's checkpoints.
        mailbox: where the stages' tensors wait (an ended stage's are dropped).
        restorer: restores a joining group's stage on its thread.
    """

    def __init__(self, reporter: StageReporter, checkpoints: Checkpoints, mailbox: Mailbox,
                 restorer: Restorer):
        self.reporter, self.checkpoints = reporter, checkpoints
        self.mailbox, self.restorer = mailbox, restorer
        self.cuts = threading.Condition()  # hand-over cuts: Stage.done and Stage.hold_at

    def start(self, stage: Stage, sources: Sequence[str] = (), wait: float = 0.0) -> None:
        """Start ``stage``'s thread. With ``wait`` > 0 (a joining group's stage) it first
        restores from ``sources`` on that thread, asking again for up to ``wait`` s."""
        name = f"stage-{stage.slot.replica}.{stage.slot.stage}"
        if wait > 0:
            stage.thread = threading.Thread(target=self._restore_then_run, name=name,
                                            args=(stage, list(sources), wait), daemon=True)
        elif stage.move(StageState.RUNNING, "loaded" if stage.start == 0 else
                        f"restored its step {stage.start} snapshot", strict=False):
            stage.thread = threading.Thread(target=self._run, args=(stage,), name=name,
                                            daemon=True)
        else:  # stopped between its load and now
            return self._ended(stage)
        stage.thread.start()

    def close(self) -> None:
        """Ship no more checkpoints (node shutdown)."""
        self.checkpoints.close()

    # -- a stage's thread ----------------------------------------------------
    def _restore_then_run(self, stage: Stage, sources: list[str], wait: float) -> None:
        """A joining group's stage: restore the state its donor keeps after the step
        before ``stage.start`` (asking ``sources`` again until it is there, up to
        ``wait`` seconds), then run; report a failure to restore."""
        deadline = time.monotonic() + wait
        if not stage.move(StageState.RESTORING, f"waits for its donor's step {stage.start} "
                          "snapshot", strict=False):
            return self._ended(stage)
        while True:
            try:
                self.restorer.restore(stage, sources)
                break
            except StageLoadError as e:
                if not stage.live or time.monotonic() > deadline:
                    if stage.move(StageState.FAILED, str(e), strict=False):
                        self.reporter.report(stage, R.STATUS_FAILED, error=str(e))
                    return self._ended(stage)
                stage.wait_ended(timeouts.QUORUM_POLL)
        if stage.move(StageState.RUNNING, f"restored its donor's step {stage.start} snapshot",
                      strict=False):
            self._run(stage)
        else:
            self._ended(stage)

    def _run(self, stage: Stage) -> None:
        assert stage.runner is not None, "a built stage has a runner"
        try:
            for result in stage.runner.run(stage.steps, stage.start):
                self._after_step(stage, result)
            stage.peers.flush()
            stage.move(StageState.DONE, f"ran its {stage.steps} steps", strict=False)
            self.reporter.report(stage, R.STATUS_DONE, step=stage.steps)
            log.info("job %s stage %d done", stage.job_id, stage.slot.stage)
        except Stopped:
            log.info("job %s stage %d stopped", stage.job_id, stage.slot.stage)
        except Exception as e:  # noqa: BLE001 — reported to the tracker, which fails the job
            if stage.move(StageState.FAILED, f"{type(e).__name__}: {e}", strict=False):
                log.exception("job %s stage %d failed", stage.job_id, stage.slot.stage)
                self.reporter.report(stage, R.STATUS_FAILED, error=f"{type(e).__name__}: {e}",
                                     peer=e.peer if isinstance(e, StageError) else "")
            else:
                log.info("job %s stage %d stopped (%s)", stage.job_id, stage.slot.stage, e)
        finally:
            self._ended(stage)

    def _after_step(self, stage: Stage, result: StepResult) -> None:
        """Count the step, checkpoint where due, report it, and hold at a cut."""
        done = result.step + 1
        with self.cuts:
            stage.done = done
            cut = stage.hold_at == done
        if (cut or stage.checkpoint_every and done % stage.checkpoint_every == 0) \
                and done < stage.steps and stage.live:
            self.checkpoints.take(stage, done)
        elif done == stage.steps and stage.live:
            self.checkpoints.keep_final(stage, done)
        self.reporter.step(stage, result)
        if cut:
            self._hold(stage)

    def _ended(self, stage: Stage) -> None:
        """However its thread ends: it sends and takes nothing more."""
        stage.peers.close()
        # a thread that ends on its own without a clean end (BaseException) stops it
        stage.move(StageState.STOPPED, "its thread ended", strict=False)
        self.mailbox.drop(lambda inbox: inbox == stage.inbox)

    # -- hand-over cuts (drains, migrations) ----------------------------------
    def hold(self, stages: Sequence[Stage], step: int) -> tuple[bool, int]:
        """Make each of ``stages`` (a job's live stages of one plan epoch) stop at the step
        boundary ``step``: snapshot there (reported as a checkpoint) and wait until
        stopped or given a later cut. ``step`` 0 lifts a hold.

        Returns:
            ``(accepted, done)``: whether every stage can still stop at ``step`` (none
            has gone past it), and the most steps any of them has done. A stage that
            cannot keeps running; the caller picks a later cut.
        """
        with self.cuts:
            done = max((s.done for s in stages), default=0)
            # a stage holding at its cut may move on to a later one; others must not be past it
            ok = step == 0 or all(s.done < step or s.done == step == s.hold_at for s in stages)
            if ok:
                for s in stages:
                    s.hold_at = step
                self.cuts.notify_all()
        return ok, done

    def _hold(self, stage: Stage) -> None:
        """Wait at a hand-over cut until the stage is stopped or its cut moves on.

        Raises:
            Stopped: it was stopped meanwhile.
        """
        if not stage.move(StageState.HELD, f"holds at step {stage.done} for a hand-over",
                          strict=False):
            raise Stopped(f"stage {stage.slot.stage} of job {stage.job_id!r} stopped")
        log.info("job %s stage %d holds at step %d for a hand-over", stage.job_id,
                 stage.key.stage, stage.done)
        with self.cuts:
            while stage.hold_at == stage.done and stage.live:
                self.cuts.wait(HOLD_RECHECK)
        if not stage.move(StageState.RUNNING, f"its cut moved on from step {stage.done}",
                          strict=False):
            raise Stopped(f"stage {stage.slot.stage} of job {stage.job_id!r} stopped")
