"""Schedules: every microbatch runs forward then backward once; 1F1B bounds what is stashed."""
import pytest

from fedpipe.runtime import schedules

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("name", sorted(schedules.SCHEDULES))
@pytest.mark.parametrize("n_stages,m", [(1, 1), (1, 4), (3, 1), (3, 4), (4, 8), (5, 3)])
def test_each_microbatch_forward_then_backward(name, n_stages, m):
    for stage in range(n_stages):
        acts = schedules.get(name)(stage, n_stages, m)
        fwd = [a.microbatch for a in acts if a.kind == "F"]
        bwd = [a.microbatch for a in acts if a.kind == "B"]
        assert fwd == list(range(m)) and bwd == list(range(m))
        for mb in range(m):
            assert acts.index(schedules.Action("F", mb)) < acts.index(schedules.Action("B", mb))


def peak_stashed(acts):
    live = peak = 0
    for a in acts:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n_stages,m", [(4, 8), (3, 2), (6, 16)])
def test_1f1b_stashes_at_most_remaining_stages(n_stages, m):
    for stage in range(n_stages):
        assert peak_stashed(schedules.one_f_one_b(stage, n_stages, m)) == min(m, n_stages - stage)
        assert peak_stashed(schedules.gpipe(stage, n_stages, m)) == m


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="gpipe"):
        schedules.get("zigzag")
