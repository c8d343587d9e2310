"""Cancelling a job whose nodes do not answer: CancelJob answers at once (the job is
CANCELLED) while its StopJob calls go on in the background. In-process, fake nodes."""
from __future__ import annotations

import threading
import time

import pytest

from fedpipe.spec import state_name
from fedpipe.tracker import jobs as jobs_module
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)


def test_cancel_answers_within_its_wait_though_every_node_hangs_on_stop_job(monkeypatch):
    monkeypatch.setattr(jobs_module, "CANCEL_WAIT", 0.3, raising=False)
    tracker, nodes, _ = make_tracker()
    join(tracker, 2)
    job = tracker.jobs.submit(submission(stages=2))
    tracker.tick()
    answer = threading.Event()
    asked: list[str] = []

    def hanging_stop(address, request):  # a paused node: answers after 3 s
        asked.append(address)
        answer.wait(3.0)

    monkeypatch.setattr(nodes, "stop_job", hanging_stop)
    began = time.monotonic()
    info = tracker.jobs.cancel(job)
    took = time.monotonic() - began
    answer.set()
    assert state_name(info.state) == "CANCELLED"
    assert took < 1.5, f"cancel took {took:.1f} s"
    assert sorted(asked) == ["127.0.0.1:7000", "127.0.0.1:7001"]  # every node asked at once
