"""Fault injection for swarm tests and benchmarks: kill, pause, restart, at a chosen step.

In the spirit of torchft's ``EventInjector.fail_at(rank, step)``: a
:class:`FaultInjector` watches a job's progress from the tracker and fires a
fault when the job reaches a step, so a test says *when* a node dies in the
job's own terms, not in seconds.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ..proto import tracker_pb2


def kill(proc: subprocess.Popen) -> None:
    """``kill -9`` a process and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def pause(proc: subprocess.Popen, seconds: float) -> threading.Thread:
    """SIGSTOP a process now and SIGCONT it ``seconds`` later (from a daemon thread).

    Returns the thread that resumes it (join it to wait for the resume).
    """
    os.kill(proc.pid, signal.SIGSTOP)

    def resume() -> None:
        time.sleep(seconds)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)

    th = threading.Thread(target=resume, name=f"resume-{proc.pid}", daemon=True)
    th.start()
    return th


@dataclass
class Fired:
    """A fault that fired: at which step of the job (as the tracker last reported it) and when."""

    name: str
    step: int
    time: float = field(default_factory=time.time)


class FaultInjector:
    """Fire faults when a job reaches given steps.

    Args:
        get_job: returns the ``JobInfo`` of the job with the id given (e.g.
            ``lambda job_id: stub.GetJob(...)``).
        job_id: the job watched; or give it to :meth:`start`.
        poll: seconds between looks at the job's step.

    Use: ``inj.at_step(5, "kill node1", lambda: swarm.kill(1)); inj.start(job.id)``.
    Faults fire in step order, each once, as soon as the job's last completed
    step is at least theirs; :attr:`fired` lists what fired. A job fed through
    :meth:`feed` cannot run past a fault's step before the fault fires, however
    fast it trains (the tracker learns of steps a little after the stages take them).
    """

    def __init__(self, get_job: Callable[[str], tracker_pb2.JobInfo], job_id: str = "",
                 poll: float = 0.02):
        self.get_job, self.job_id, self.poll = get_job, job_id, poll
        self.plans: list[tuple[int, str, Callable[[], None], threading.Event]] = []
        self.fired: list[Fired] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def at_step(self, step: int, name: str, action: Callable[[], None]) -> "FaultInjector":
        """Run ``action`` once the job has completed ``step`` steps.

        Raises:
            RuntimeError: the injector already started (a fault planned now would never
                fire).
        """
        if self._thread is not None:
            raise RuntimeError(f"fault {name!r} planned after the injector started: plan "
                               "every fault before start()")
        self.plans.append((step, name, action, threading.Event()))
        self.plans.sort(key=lambda p: p[0])
        return self

    def feed(self, batches: Iterable[Any], wait: float = 120.0) -> Iterator[Any]:
        """``batches`` one by one, holding the batch of each fault's step (0-based, so the
        job has completed exactly that many steps) until the fault has fired (or
        ``wait`` seconds, or the watch ended). Plan the faults (:meth:`at_step`) first.

        Raises:
            ValueError: a fault at step 0: the job takes its first batch before it exists,
                so before it can be watched (fire such a fault without the feed).
        """
        early = [name for step, name, _, _ in self.plans if step < 1]
        if early:
            raise ValueError(f"faults at step 0 cannot hold a feed: {', '.join(early)}")
        held = {step: [done for s, _, _, done in self.plans if s == step]
                for step, _, _, _ in self.plans}

        def fed() -> Iterator[Any]:
            for i, batch in enumerate(batches):
                for done in held.get(i, ()):
                    done.wait(wait)
                yield batch
        return fed()

    def start(self, job_id: str = "") -> "FaultInjector":
        """Start watching job ``job_id`` (default: the one given at construction) from a
        daemon thread.

        Raises:
            ValueError: no job was named.
        """
        self.job_id = job_id or self.job_id
        if not self.job_id:
            raise ValueError("FaultInjector.start: no job to watch (give its id)")
        self._thread = threading.Thread(target=self._run, name="fault-injector", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        pending = list(self.plans)
        try:
            while pending and not self._stop.is_set():
                try:
                    job = self.get_job(self.job_id)
                except Exception:  # noqa: BLE001 — the tracker may be the fault; look again
                    time.sleep(self.poll)
                    continue
                while pending and job.step >= pending[0][0]:
                    step, name, action, done = pending.pop(0)
                    try:
                        action()
                        self.fired.append(Fired(name, job.step))
                    except BaseException as e:  # noqa: BLE001 — kept for the test to raise
                        self.errors.append(e)
                    done.set()
                if job.state in (tracker_pb2.JOB_STATE_SUCCEEDED, tracker_pb2.JOB_STATE_FAILED,
                                 tracker_pb2.JOB_STATE_CANCELLED):
                    return
                time.sleep(self.poll)
        finally:
            for *_, done in pending:
                done.set()  # a feed held for a fault that will not fire goes on

    def stop(self) -> None:
        """Stop watching; raise the first error an action raised."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.errors:
            raise self.errors[0]
