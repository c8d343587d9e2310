"""A node that joins mid-job gets layers of their own: the plan is re-split, exactly.

Real processes on 127.0.0.1. Two equal nodes run a 2-stage job; a third equal
node joins; at a checkpoint boundary the tracker's planner re-splits the model
into 3 stages and the job moves there with 0 steps recomputed: each new stage
is assembled from the layers of the old stages' snapshots
(:mod:`fedpipe.runtime.layerstate`), fetching only the layers that change
hands. Weights must equal the same job run undisturbed (synchronous 1F1B, no
compression): equal, not close.

This machine has 2 cores: 3 node processes on it are no faster than 2, and the
planner knows it (nodes of one host share its cores). Each node is started with
``--host-id ''`` (a machine of its own), so the planner sees three equal
machines, as on real ones; the speed-up itself is measured by
``benchmarks/elastic.py`` on a machine with cores for it.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.testing import LocalSwarm
from reference import (digit_batches, job_info, max_relative_difference, running_plan,
                       single_process)

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.02, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY, HIDDEN, BLOCKS = 120, 4, 1024, 6
PIECE = re.compile(r"fetched layers? (\d+)(?:-(\d+))? of the step (\d+) snapshot of job (\S+) "
                   r"stage (\d+) \(replica (\d+)\) from \S+: (\d+) tensors, (\d+) bytes")


def make_model() -> nn.Sequential:
    """Equal linear layers (each with parameters, so a layer that changes hands always
    moves state), so that any number of equal nodes can share them evenly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, HIDDEN),
                         *[nn.Linear(HIDDEN, HIDDEN) for _ in range(BLOCKS)],
                         nn.Linear(HIDDEN, 10))


def submit(client, data, rebalance, stages=0):
    return client.submit(make_model(), LOSS, SGD, data, steps=STEPS, microbatches=8,
                         schedule="1f1b", compression="none", checkpoint_every=EVERY,
                         rebalance=rebalance, replicas=1, stages=stages)


class Gate:
    """``data`` whose batch ``stop_at`` waits until :meth:`release`: the job stands there
    while the joining node starts and has its links measured, however slow the machine."""

    def __init__(self, data: list, stop_at: int):
        self.data, self.stop_at, self.released = data, stop_at, threading.Event()

    def __iter__(self):
        yield from self.data[:self.stop_at]
        self.released.wait(120)
        yield from self.data[self.stop_at:]

    def release(self) -> None:
        self.released.set()


def ranges(summary: str) -> dict[str, tuple[int, int]]:
    """A plan's one-line summary as node name -> (first layer, last layer + 1)."""
    return {m.group(1): (int(m.group(2)), int(m.group(3) or m.group(2)) + 1)
            for m in re.finditer(r"(\S+): layers? (\d+)(?:-(\d+))?", summary)}


def test_a_join_re_splits_two_stages_into_three_moving_only_the_layers_that_change_hands():
    # the predicted gain of 3 stages over 2 is 6-20 % here, as the nodes' probed FLOP/s
    # vary with the machine's load: a threshold of 2 % keeps the test off that noise
    with LocalSwarm(n_nodes=2, lease=5.0, node_args=["--host-id", ""],
                    tracker_args=["--rebalance-threshold", "0.02"]) as swarm:
        client, data = swarm.client(), digit_batches(STEPS, batch=64)
        # first, before the tracker calibrates its cost model on this busy 2-core machine
        # (where, measured, a pipeline does not pay)
        gate = Gate(data, 12)
        job = submit(client, gate, "auto")
        before = running_plan(client, job)
        assert len(before.stages) == 2, before.plan.summary  # the planner uses both nodes
        swarm.add_node()  # joins mid-job; the job waits for data at step 12 till it is measured
        deadline = time.monotonic() + 120
        while "made 3 link measurement(s)" not in swarm.log(swarm.tracker_proc):
            assert time.monotonic() < deadline, "node2 was not measured"
            time.sleep(0.2)
        gate.release()
        status = job.wait(timeout=240, progress=False)
        assert status.state == "SUCCEEDED", status.reason
        got = job.state_dict()
        job.release()
        final = job_info(client, job)
        # the plans the job ran on, in order: the first, then one per migration (the
        # tracker may migrate again, e.g. when it finds the joined node slower than probed)
        moves = re.findall(rf"job {job.id} RUNNING: migrated from .* to .*: resumed at "
                           r"checkpoint step (\d+) \(0 steps to recompute\) on (.*)",
                           swarm.log(swarm.tracker_proc))
        assert moves and [r.cause for r in final.recoveries] == ["rebalance"] * len(moves)
        assert all(r.steps_recomputed == 0 for r in final.recoveries)
        plans = [ranges(before.plan.summary)] + [ranges(m[1]) for m in moves]
        assert any(len(p) == 3 for p in plans), plans  # 2 stages became 3 over the 3 nodes

        # exact: the re-split job ends with the weights of one that ran undisturbed (a sync
        # schedule's weights do not depend on the split: asked for 2 stages here)
        undisturbed = submit(client, data, "never", stages=2)
        assert undisturbed.wait(timeout=240, progress=False).state == "SUCCEEDED"
        want = undisturbed.state_dict()
        undisturbed.release()
        assert got.keys() == want.keys()
        assert [k for k in want if not torch.equal(got[k], want[k])] == []
        assert max_relative_difference(got, single_process(make_model(), LOSS, SGD, data)) \
            <= 1e-5

        # only the layers that change hands move, each piece exactly its layers' weights
        # and SGD momentum; a node fetches only layers it did not hold, and the joined
        # node fetches all of its first layers (it held no snapshot of any)
        model = make_model()
        cut = {int(step): i for i, (step, _) in enumerate(moves)}
        fetched: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for i, proc in enumerate(swarm.nodes):
            for f in PIECE.finditer(swarm.log(proc)):
                if f.group(4) != job.id:
                    continue
                lo, hi = int(f.group(1)), int(f.group(2) or f.group(1)) + 1  # or "layer 3"
                step, nbytes = int(f.group(3)), int(f.group(8))
                layers = list(model)[lo:hi]
                assert nbytes == 2 * sum(p.numel() * p.element_size() for m in layers
                                         for p in m.parameters())
                k = cut[step]
                held = plans[k].get(f"node{i}")
                assert held is None or hi <= held[0] or lo >= held[1]  # not its own layers
                want_range = plans[k + 1][f"node{i}"]
                assert want_range[0] <= lo < hi <= want_range[1]
                fetched.setdefault((f"node{i}", k), []).append((lo, hi))
        first = next(k for k, p in enumerate(plans) if "node2" in p) - 1
        got_ranges = sorted(fetched[("node2", first)])
        assert (got_ranges[0][0], got_ranges[-1][1]) == plans[first + 1]["node2"]
        assert all(a[1] == b[0] for a, b in zip(got_ranges, got_ranges[1:]))
