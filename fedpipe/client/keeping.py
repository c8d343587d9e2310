"""Keeping a job's newest complete checkpoints in the user's ``checkpoint_dir``.

A :class:`CheckpointKeeper` follows the job's events on the feeder's watch thread
(:mod:`.watch`): at each checkpoint the job completes it pulls the job's newest one from
its nodes into the directory (:func:`.checkpoints.keep`: the newest
:data:`~.checkpoints.KEEP` stay), and names in a warning every completed checkpoint it
did not keep, with why.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable

import grpc

from ..observe.source import JobNotFound
from ..proto import tracker_pb2
from ..runtime.checkpoint import SnapshotStream
from ..spec import StageKey
from . import checkpoints
from .errors import CheckpointGone

log = logging.getLogger("fedpipe.client")
S = tracker_pb2

Snapshots = Iterable[tuple[StageKey, SnapshotStream]]
"""Each stage's snapshot of one step, pulled as it is asked for (:func:`.checkpoints.pull`)."""


def newest_checkpoint(info: tracker_pb2.JobInfo) -> int:
    """The step of the job's newest complete checkpoint (its last, once SUCCEEDED; 0:
    none yet), from its ``info``."""
    return info.steps if info.state == S.JOB_STATE_SUCCEEDED else info.checkpoint_step


class CheckpointKeeper:
    """Keeps one job's newest complete checkpoints in ``directory`` as the job completes
    them (module docstring).

    Not thread-safe: the watch thread calls :meth:`on_event`; :meth:`sweep` comes once
    that thread has ended.

    Args:
        job_id: the job, named in each log line.
        directory: the checkpoint directory (``checkpoint_dir``).
        info: the job's info now, asked again while the tracker is unreachable; raises
            ``grpc.RpcError`` for a refusal that cannot pass.
        pull: each stage's snapshot of ``step`` (given the job's info), pulled from its
            nodes as it is iterated; raises :class:`CheckpointGone` (no node holds a
            stage's snapshot any more) or ``grpc.RpcError`` while iterated.
        layout: the keywords :func:`.checkpoints.keep` writes the checkpoint with
            (``config``, and how its weights are named: :func:`.checkpoints.layout`).
        keeping_since: checkpoints up to this step completed before this keeper kept any
            (a resumed job's watch replays their events): none of them is named as not
            kept. None: not known yet (the tracker was away); the first step kept is.
    """

    def __init__(self, job_id: str, directory: str | os.PathLike, *,
                 info: Callable[[], tracker_pb2.JobInfo],
                 pull: Callable[[tracker_pb2.JobInfo, int], Snapshots],
                 layout: Callable[[], dict[str, Any]],
                 keeping_since: int | None = 0):
        self.job_id, self.directory = job_id, directory
        self._info, self._pull, self._layout = info, pull, layout
        self._keeping_since = keeping_since
        self._kept_steps: set[int] = set()  # every checkpoint kept in the directory
        self._heard: set[int] = set()  # checkpoints completed, neither kept nor said not kept

    def on_event(self, ev: tracker_pb2.JobEvent) -> None:
        """On the watch thread: keep each complete checkpoint in the directory (:meth:`keep`)."""
        step = ev.checkpoint_step
        if self._keeping_since is None or step <= self._keeping_since:
            pass  # completed before this keeper kept checkpoints: not its to name
        elif step > self.saved_step:
            self._heard.add(step)
        elif step not in self._kept_steps:  # heard of after a newer one was kept
            log.warning("job %s: %s not kept in %s: the client had kept step %d's, newer, "
                        "when it heard that it completed", self.job_id, _checkpoints([step]),
                        self.directory, self.saved_step)
        if step or ev.state == S.JOB_STATE_SUCCEEDED:
            self.keep()

    def keep(self) -> None:
        """Pull the job's newest complete checkpoint into the directory if it is newer
        than the one kept there (:func:`.checkpoints.keep`: the newest
        :data:`~.checkpoints.KEEP` stay).

        Best effort, and every checkpoint the job completed is either kept or named in
        one warning line: one that failed, with why, and each one skipped. A client
        that pulls slower than the job takes checkpoints skips to the newest: the
        nodes keep a stage's newest :data:`~fedpipe.spec.SNAPSHOTS_KEPT` snapshots
        beside the last complete one, so an older checkpoint can be gone before the
        client asks for it, and one that goes midway (:class:`CheckpointGone` while a
        newer one has completed) is pulled again at the newest. Never raises: the
        watch thread that calls it goes on."""
        step = 0
        try:
            info = self._info()
            while (step := newest_checkpoint(info)) > self.saved_step:
                try:
                    folder = checkpoints.keep(self.directory, step, self._pull(info, step),
                                              info.plan, steps=info.steps, **self._layout())
                except CheckpointGone:
                    info = self._info()
                    if newest_checkpoint(info) > step:  # its nodes dropped it for newer ones
                        continue
                    raise
                self._kept(step, folder)
                return
        except (grpc.RpcError, JobNotFound, CheckpointGone, OSError, ValueError) as e:
            self._not_kept(step, one_line(e))
        except Exception as e:  # noqa: BLE001 — a bug here must not end the job's watch
            self._not_kept(step, f"{type(e).__name__}: {e}", trace=e)

    @property
    def saved_step(self) -> int:
        """The newest checkpoint kept in the directory (0: none)."""
        return max(self._kept_steps, default=0)

    def sweep(self) -> None:
        """Remove what unfinished checkpoints left in the directory
        (:func:`.checkpoints.sweep`); call it only once the watch that keeps them has
        ended."""
        checkpoints.sweep(self.directory)

    def _kept(self, step: int, folder: os.PathLike) -> None:
        """Checkpoint ``step`` is in ``folder``: say so, and name the older ones that
        completed since the last kept and were skipped."""
        skipped = sorted(s for s in self._heard if s < step)
        self._heard = {s for s in self._heard if s > step}
        self._kept_steps.add(step)
        if self._keeping_since is None:
            self._keeping_since = step
        if skipped:
            log.warning("job %s: %s not kept in %s: the job completed step %d's before the "
                        "client pulled %s (its nodes keep only each stage's newest "
                        "snapshots); kept step %d's", self.job_id, _checkpoints(skipped),
                        self.directory, step, "it" if len(skipped) == 1 else "them",
                        step)
        log.info("job %s: checkpoint of step %d kept in %s", self.job_id, step, folder)

    def _not_kept(self, step: int, why: str, trace: BaseException | None = None) -> None:
        """Keeping checkpoint ``step`` (0: the step is unknown) failed for ``why``: one
        warning naming it and the others completed since the last kept (with the
        traceback of ``trace``, an error nobody expected)."""
        missed = sorted(self._heard | {step} - {0})
        self._heard.clear()
        which = _checkpoints(missed) if missed else "newest checkpoint"
        log.warning("job %s: could not keep its %s in %s: %s", self.job_id, which,
                    self.directory, why, exc_info=trace)


def _checkpoints(steps: list[int]) -> str:
    """``"checkpoint of step 2"`` or ``"checkpoints of steps 2, 4, 6"``."""
    if len(steps) == 1:
        return f"checkpoint of step {steps[0]}"
    return f"checkpoints of steps {', '.join(map(str, steps))}"


def one_line(e: BaseException) -> str:
    """``e`` in one line: a gRPC error as ``CODE: details`` (its ``str()`` is the call's
    multi-line repr), anything else as ``str()``."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        return f"{e.code().name}: {e.details()}"
    return str(e)
