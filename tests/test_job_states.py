"""A job's states as a table: what the table allows, and the one function that moves a job.

In-process: a store in memory, a fake clock, fake nodes; no threads, no processes.
"""
from __future__ import annotations

import itertools

import pytest

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import TERMINAL, WAITING, state_name
from fedpipe.tracker.jobs import TRANSITIONS, Jobs, may_move, sources
from fedpipe.tracker.specs import JobSpecs
from fedpipe.tracker.store import MemoryStore
from tracker_fakes import FakeClock, FakeNodes, submission

pytestmark = pytest.mark.timeout(30)
S = tracker_pb2
STATES = [v for v in S.JobState.values() if v != S.JOB_STATE_UNSPECIFIED]


class Memory:
    """Per-job memory that records what it was told to forget."""

    def __init__(self):
        self.forgotten: list[str] = []

    def forget(self, job_id: str) -> None:
        self.forgotten.append(job_id)


def life_cycle():
    clock = FakeClock()
    store = MemoryStore()
    ended: list[tuple[str, float]] = []
    memory = Memory()
    jobs = Jobs(store, FakeNodes(clock), JobSpecs(store), lambda: [], clock=clock,
                ended=lambda job_id, when: ended.append((job_id, when)), forget=(memory,))
    return jobs, store, clock, ended, memory


def job_in(jobs: Jobs, store: MemoryStore, state: int) -> str:
    """A new job put straight into ``state`` (the store does not check the table)."""
    job_id = jobs.submit(submission())
    if state != S.JOB_STATE_PENDING:
        assert store.set_state(job_id, state, "put there by the test", 0.0)
    return job_id


def test_the_table_names_every_state_and_terminal_states_have_no_way_out():
    assert set(TRANSITIONS) == set(STATES)
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()
    for state in set(STATES) - TERMINAL:  # any job that has not ended can fail or be cancelled
        assert {S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED} <= TRANSITIONS[state]
    assert sources(S.JOB_STATE_PLANNING) == {S.JOB_STATE_PENDING}
    assert sources(WAITING) == {S.JOB_STATE_RUNNING}
    assert not may_move(S.JOB_STATE_PENDING, S.JOB_STATE_RUNNING)
    assert not may_move(WAITING, S.JOB_STATE_RUNNING)  # a returning client recovers first


def test_every_state_is_reachable_from_pending_and_every_job_can_end():
    seen, frontier = {S.JOB_STATE_PENDING}, [S.JOB_STATE_PENDING]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()] - seen:
            seen.add(nxt)
            frontier.append(nxt)
    assert seen == set(STATES)
    for state in STATES:  # from anywhere, some path ends
        reach, todo = {state}, [state]
        while todo:
            for nxt in TRANSITIONS[todo.pop()] - reach:
                reach.add(nxt)
                todo.append(nxt)
        assert reach & TERMINAL


@pytest.mark.parametrize("current,to", list(itertools.product(STATES, STATES)),
                         ids=lambda s: state_name(s))
def test_move_does_exactly_what_the_table_allows(current, to):
    jobs, store, clock, _, _ = life_cycle()
    job_id = job_in(jobs, store, current)
    events = len(store.events(job_id, 0))
    clock.advance(5)
    moved = jobs.move(job_id, to, "the test's reason")
    assert moved == may_move(current, to)
    info = store.job(job_id)
    if moved:
        assert (info.state, info.reason) == (to, "the test's reason")
        last = store.events(job_id, 0)[-1]
        assert (last.state, last.reason, last.time) == (to, "the test's reason", clock())
    else:  # refused: nothing changed, nothing logged
        assert info.state == current and len(store.events(job_id, 0)) == events


def test_only_from_narrows_the_table_and_never_widens_it():
    jobs, store, _, _, _ = life_cycle()
    job_id = job_in(jobs, store, S.JOB_STATE_RUNNING)
    assert not jobs.move(job_id, S.JOB_STATE_RECOVERING, "x", only_from={S.JOB_STATE_DEPLOYING})
    assert not jobs.move(job_id, S.JOB_STATE_PLANNING, "x", only_from={S.JOB_STATE_RUNNING})
    assert not jobs.move(job_id, S.JOB_STATE_FAILED, "x", only_from=set())
    assert store.job(job_id).state == S.JOB_STATE_RUNNING
    assert jobs.move(job_id, S.JOB_STATE_RECOVERING, "a node was lost",
                     only_from={S.JOB_STATE_RUNNING, S.JOB_STATE_DEPLOYING})
    assert store.job(job_id).state == S.JOB_STATE_RECOVERING


def test_a_job_that_ends_is_told_to_retention_and_forgotten_once():
    jobs, store, clock, ended, memory = life_cycle()
    job_id = job_in(jobs, store, S.JOB_STATE_RUNNING)
    assert jobs.move(job_id, WAITING, "the client left")
    assert ended == [] and memory.forgotten == []
    clock.advance(3)
    jobs.fail(job_id, "the client did not come back")
    assert ended == [(job_id, clock())] and memory.forgotten == [job_id]
    assert state_name(store.job(job_id).state) == "FAILED"
    jobs.cancel(job_id)  # an ended job stays as it ended
    assert state_name(store.job(job_id).state) == "FAILED" and memory.forgotten == [job_id]


def test_a_failed_or_cancelled_job_has_its_stages_stopped_and_a_refused_move_stops_nothing():
    jobs, store, clock, _, _ = life_cycle()
    job_id = job_in(jobs, store, S.JOB_STATE_RUNNING)
    store.set_plan(job_id, node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=0, node_id="a", node_name="a", address="127.0.0.1:1", layer_start=0,
        layer_end=4)]))
    nodes = jobs.nodes
    jobs.fail(job_id, "boom", only_from={S.JOB_STATE_PENDING})  # refused
    assert nodes.stops == [] and store.job(job_id).state == S.JOB_STATE_RUNNING
    jobs.cancel(job_id, "enough")
    assert [(a, r.release, r.reason) for a, r in nodes.stops] == [("127.0.0.1:1", True,
                                                                    "cancelled")]
