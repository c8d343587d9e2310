"""Ring all-reduce and segment cutting, run with threads and queues (the algorithm alone)."""
from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.runtime.allreduce import StageSpan, held_segments, ring_allreduce, segments
from fedpipe.spec import StageKey

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("world,n", [(1, 5), (2, 7), (3, 3), (4, 10), (5, 2)])
def test_ring_allreduce_sums_identically_everywhere(world, n):
    inputs = [torch.randn(n, dtype=torch.float64) for _ in range(world)]
    boxes = [{} for _ in range(world)]
    cond = threading.Condition()
    results = [None] * world

    def member(rank):
        def send(tag, t):
            with cond:
                boxes[(rank + 1) % world][tag] = t.clone()
                cond.notify_all()

        def recv(tag):
            with cond:
                cond.wait_for(lambda: tag in boxes[rank], timeout=10)
                return boxes[rank].pop(tag)

        results[rank] = ring_allreduce(inputs[rank], rank, world, send, recv)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(inputs)
    for r in results:
        assert torch.allclose(r, total)
        assert torch.equal(r, results[0])


def spans(*rows):
    """``StageSpan``s from ``(replica, stage, start, end)`` rows."""
    return [StageSpan(StageKey(r, s), a, b) for r, s, a, b in rows]


def test_segments_follow_every_groups_cuts():
    # group 0: two stages [0,3) [3,6); group 1: three stages [0,2) [2,4) [4,6)
    stages = spans((0, 0, 0, 3), (0, 1, 3, 6), (1, 0, 0, 2), (1, 1, 2, 4), (1, 2, 4, 6))
    segs = segments(stages)
    assert [(s.start, s.end) for s in segs] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert segs[1].holders == (StageKey(0, 0), StageKey(1, 1))
    assert segs[2].holders == (StageKey(0, 1), StageKey(1, 1))


def test_held_segments_map_global_layers_to_the_stages_own_modules():
    stages = spans((0, 0, 0, 3), (0, 1, 3, 6), (1, 0, 0, 2), (1, 1, 2, 4), (1, 2, 4, 6))
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())  # layers 2, 3
    held = held_segments(module, StageKey(1, 1), stages)
    # segment [2, 3) holds the Linear; [3, 4) only the ReLU, so it needs no sync
    assert [(seg.start, seg.end, rank) for seg, rank, _ in held] == [(2, 3, 1)]
    assert held[0][2] == list(module[0].parameters())
    with pytest.raises(ValueError, match="not once"):
        held_segments(module, StageKey(2, 0), stages)


def test_segments_refuse_groups_that_differ_in_layers():
    with pytest.raises(ValueError, match="different numbers of layers"):
        segments(spans((0, 0, 0, 3), (1, 0, 0, 4)))
    with pytest.raises(ValueError, match="contiguously"):
        segments(spans((0, 0, 0, 2), (0, 1, 3, 4)))
