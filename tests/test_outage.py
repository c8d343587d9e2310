"""Training goes on while no tracker leads: the one tracker of a swarm killed (and started
again on the same SQLite file) or SIGSTOPped for several seconds mid-job.

Real processes on 127.0.0.1 (:class:`fedpipe.testing.LocalSwarm`, 1 torch thread per
node). A synchronous job of the digits MLP in 3 stages must go on stepping through the
gap (the client's feed, which the first stage's bounded inbox holds to the pipeline's
pace, advances while the tracker is gone), end SUCCEEDED with no step recomputed, and
give the weights single-process training on the same batches gives. The client says
once that the tracker is unreachable and once that it is back. A node drained (SIGTERM)
while the tracker is gone waits for it, its stages training on, then hands them over.
"""
from __future__ import annotations

import logging
import time

import pytest

import fedpipe
from fedpipe.net import timeouts
from fedpipe.proto import tracker_pb2
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm, faults
from failover_swarm import LOSS, SGD, submit
from reference import digit_batches, job_info, max_relative_difference, single_process

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]
STEPS, EVERY, KILL_AT = 150, 5, 10
GAP = 6.0
"""Seconds the tracker is gone: past the nodes' lease (5 s) and the client's grace."""
DRAIN_TIMEOUT = 12.0
"""The nodes' ``--drain-timeout``: shorter than a drained node's wait for a tracker here,
and long enough for a hand-over on a loaded machine once a tracker leads."""


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """One swarm for this module's tests (its tracker restarted by the first)."""
    with LocalSwarm(n_nodes=3, workdir=str(tmp_path_factory.mktemp("outage")),
                    node_args=["--drain-timeout", str(DRAIN_TIMEOUT)]) as s:
        yield s


@pytest.fixture
def silent_soon(monkeypatch):
    """The feed counts the tracker gone after 0.5 s of silence (default 2 s): the gap
    then holds more steps, whatever the machine's load."""
    monkeypatch.setattr(timeouts, "TRACKER_SILENT", 0.5)


def reach_lines(caplog) -> list[str]:
    """The client's lines about reaching the tracker (any other would be one per retry)."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("fedpipe") and "tracker" in r.getMessage()]


def trained_through(s: LocalSwarm, client: fedpipe.Client, gone, back) -> None:
    """Run a job, call ``gone()`` at step :data:`KILL_AT`, wait :data:`GAP` s, call
    ``back()``; check the job stepped during the gap and ended exact, with no recovery."""
    data = digit_batches(STEPS)
    model, job = submit(client, data, steps=STEPS, every=EVERY)
    while job.status().step < KILL_AT:
        time.sleep(0.02)
    gone()
    fed_at_kill = job.fed
    time.sleep(GAP)
    fed_at_return = job.fed
    back()
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED", status
    # the feed advances only as the first stage takes its steps (its inbox is bounded)
    assert fed_at_return > fed_at_kill, (fed_at_kill, fed_at_return)
    info = client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    assert list(info.recoveries) == [], "a step was recomputed: the gap was not trained through"
    assert info.step == STEPS
    got = job.state_dict()
    assert max_relative_difference(got, single_process(model, LOSS, SGD, data)) <= 1e-5
    job.release()


def test_a_job_trains_on_while_its_tracker_is_killed_and_started_again(swarm, caplog,
                                                                        silent_soon):
    caplog.set_level(logging.INFO)
    s = swarm
    with s.client() as client:
        trained_through(s, client, lambda: faults.kill(s.tracker_proc), s.start_tracker)
    assert "missed its lease" not in s.log(s.tracker_proc)
    lines = reach_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("no tracker leads now (UNAVAILABLE"), lines
    assert lines[1].startswith("the tracker is back (unreachable for "), lines


def test_a_job_trains_on_while_its_tracker_is_stopped_past_the_nodes_lease(swarm, caplog,
                                                                           silent_soon):
    caplog.set_level(logging.INFO)
    s = swarm
    resumed: list = []
    with s.client() as client:
        trained_through(s, client, lambda: resumed.append(faults.pause(s.tracker_proc, GAP)),
                        lambda: resumed[0].join())
    log = s.log(s.tracker_proc)
    assert "missed its lease" not in log, log
    assert "this tracker did not run for" in log
    # a stopped tracker refuses nothing: its silence is asked about, and said once
    lines = reach_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("no tracker leads now (DEADLINE_EXCEEDED"), lines
    assert lines[1].startswith("the tracker is back (unreachable for "), lines


def paced(batches: list, seconds: float):
    """``batches`` one every ``seconds`` at most: the job then outlasts the gap."""
    for b in batches:
        time.sleep(seconds)
        yield b


def test_a_node_drained_while_no_tracker_leads_waits_for_one_then_hands_over(swarm,
                                                                             silent_soon):
    """Last of the module: it leaves the swarm a node short."""
    s = swarm
    steps = 500
    data = digit_batches(steps)
    with s.client() as client:
        model, job = submit(client, paced(data, 0.05), steps=steps, every=EVERY, stages=2)
        while job.status().step < KILL_AT:
            time.sleep(0.02)
        victim = PlanView(job_info(client, job).plan)[StageKey(0, 1)]
        proc = s.nodes[s.node_index(victim.node_name)]
        s.faulted.add(proc)  # its exit is expected
        faults.kill(s.tracker_proc)
        proc.terminate()  # SIGTERM: the node drains, with no tracker to move its stage
        fed_at_kill = job.fed
        time.sleep(DRAIN_TIMEOUT + 3)
        # the drain's timeout did not run while no tracker led: the node and its stage
        # are still there, training
        assert proc.poll() is None and "timed out" not in s.log(proc), s.log(proc)
        assert job.fed > fed_at_kill
        s.start_tracker()
        status = job.wait(timeout=180, progress=False)
        assert status.state == "SUCCEEDED", status
        info = client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
        # handed over at a step boundary, nothing recomputed (or the job ended first)
        assert [r.cause for r in info.recoveries] in ([], ["drain"]), info.recoveries
        assert all(r.steps_recomputed == 0 for r in info.recoveries), info.recoveries
        assert victim.node_id not in PlanView(info.plan).node_ids() or not info.recoveries
        assert max_relative_difference(job.state_dict(),
                                       single_process(model, LOSS, SGD, data)) <= 1e-5
        job.release()
    assert proc.wait(timeout=60) == 0
    log = s.log(proc)
    assert "drained: no job needs this node" in log, log
    assert "timed out" not in log, log
