"""Ring all-reduce and segment cutting, run with threads and queues (the algorithm alone)."""
from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.runtime.allreduce import Holder, segments, ring_allreduce

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


def test_segments_follow_every_groups_cuts():
    # group 0: two stages [0,3) [3,6); group 1: three stages [0,2) [2,4) [4,6)
    stages = [(0, 0, 0, 3), (0, 1, 3, 6), (1, 0, 0, 2), (1, 1, 2, 4), (1, 2, 4, 6)]
    segs = segments(stages)
    assert [(s.start, s.end) for s in segs] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert segs[1].holders == (Holder(0, 0), Holder(1, 1))
    assert segs[2].holders == (Holder(0, 1), Holder(1, 1))


def test_segments_refuse_groups_that_differ_in_layers():
    with pytest.raises(ValueError, match="different numbers of layers"):
        segments([(0, 0, 0, 3), (1, 0, 0, 4)])
    with pytest.raises(ValueError, match="contiguously"):
        segments([(0, 0, 0, 2), (0, 1, 3, 4)])
