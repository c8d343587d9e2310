"""A stage's life as a table, in process: every allowed move, the illegal ones, and what a
move records. No threads of a stage run, no process starts."""
from __future__ import annotations

import itertools
import threading

import pytest
from torch import nn

from fedpipe.node.lifecycle import (ENDED, LIVE, TRANSITIONS, IllegalTransition, Stage,
                                    StageSlot, StageState)

pytestmark = pytest.mark.timeout(30)
S = StageState


def stage_in(state: StageState) -> Stage:
    """A stage brought to ``state`` along allowed moves only."""
    path = {S.LOADING: [], S.AWAITING_WEIGHTS: [S.AWAITING_WEIGHTS],
            S.RESTORING: [S.RESTORING], S.RUNNING: [S.RUNNING],
            S.HELD: [S.RUNNING, S.HELD], S.DONE: [S.RUNNING, S.DONE],
            S.FAILED: [S.RUNNING, S.FAILED], S.STOPPED: [S.STOPPED],
            S.RELEASED: [S.STOPPED, S.RELEASED]}[state]
    stage = Stage(StageSlot("j", 0, 1), 2, 3, nn.Sequential(), 10, peers=None)
    for to in path:
        stage.move(to, "setting up")
    assert stage.state is state
    return stage


def test_a_stage_starts_loading_and_the_table_is_what_the_life_cycle_says():
    assert Stage(StageSlot("j", 0, 0), 1, 0, nn.Sequential(), 1, None).state is S.LOADING
    assert TRANSITIONS == {
        (S.LOADING, S.RESTORING), (S.LOADING, S.RUNNING), (S.LOADING, S.STOPPED),
        (S.LOADING, S.AWAITING_WEIGHTS), (S.AWAITING_WEIGHTS, S.RUNNING),
        (S.AWAITING_WEIGHTS, S.FAILED), (S.AWAITING_WEIGHTS, S.STOPPED),
        (S.RESTORING, S.RUNNING), (S.RESTORING, S.FAILED), (S.RESTORING, S.STOPPED),
        (S.RUNNING, S.HELD), (S.HELD, S.RUNNING), (S.RUNNING, S.DONE), (S.RUNNING, S.FAILED),
        (S.RUNNING, S.STOPPED), (S.HELD, S.STOPPED),
        (S.DONE, S.RELEASED), (S.FAILED, S.RELEASED), (S.STOPPED, S.RELEASED)}
    assert LIVE | ENDED == set(S) and not LIVE & ENDED


@pytest.mark.parametrize("before,after", sorted(TRANSITIONS, key=lambda t: (t[0].value,
                                                                             t[1].value)))
def test_every_allowed_move_is_made_and_recorded_with_its_reason(before, after):
    stage = stage_in(before)
    assert stage.move(after, f"why {after.name}") is True
    assert stage.state is after
    last = stage.history[-1]
    assert (last.before, last.after, last.reason) == (before, after, f"why {after.name}")
    assert stage.live is (after in LIVE)
    assert stage.wait_ended(0) is (after in ENDED)


ILLEGAL = sorted(set(itertools.product(S, S)) - TRANSITIONS, key=lambda t: (t[0].value,
                                                                             t[1].value))


@pytest.mark.parametrize("before,after", ILLEGAL)
def test_every_move_outside_the_table_is_refused_and_changes_nothing(before, after):
    stage = stage_in(before)
    history = list(stage.history)
    with pytest.raises(IllegalTransition, match=f"from {before.name} to {after.name}"):
        stage.move(after, "not allowed")
    assert stage.move(after, "lost a race", strict=False) is False
    assert stage.state is before and stage.history == history


def test_illegal_moves_include_the_ones_a_bug_would_make():
    for move in [(S.RELEASED, S.RUNNING), (S.DONE, S.RUNNING), (S.STOPPED, S.RUNNING),
                 (S.FAILED, S.DONE), (S.LOADING, S.HELD), (S.LOADING, S.RELEASED),
                 (S.RUNNING, S.RELEASED), (S.HELD, S.DONE), (S.STOPPED, S.STOPPED)]:
        assert move in ILLEGAL


def _end(stage: Stage, to: StageState, barrier: threading.Barrier,
         won: list[StageState]) -> None:
    barrier.wait()
    if stage.move(to, "race", strict=False):
        won.append(to)


def test_of_two_threads_ending_a_stage_at_once_exactly_one_moves_it():
    for _ in range(50):
        stage, won, barrier = stage_in(S.RUNNING), [], threading.Barrier(2)
        threads = [threading.Thread(target=_end, args=(stage, to, barrier, won))
                   for to in (S.DONE, S.STOPPED)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and stage.state is won[0]
        assert [t.after for t in stage.history].count(won[0]) == 1
