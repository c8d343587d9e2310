"""Snapshots on disk (``fedpipe node --snapshot-dir``): a kill -9 recovers exactly from the
buddies' snapshot files.

Real processes on 127.0.0.1, as ``tests/test_recovery.py``: the digits MLP in 3 stages
over 4 nodes that each keep their snapshots in a directory of their own; the node of
stage 1 is killed mid-job, and the job must SUCCEED with the weights of single-process
training (1e-5 relative per tensor), having rewound to a checkpoint that only the
surviving nodes' files held.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.spec import PlanView, StageKey
from fedpipe.testing import LocalSwarm
from reference import digit_batches, gated, job_info, max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 12, 3


def test_kill_9_recovers_exactly_from_snapshots_kept_on_disk():
    with LocalSwarm(n_nodes=4, lease=5.0, snapshot_dirs=True) as swarm:
        client, data = swarm.client(), digit_batches(STEPS)
        assert all(n.resources.snapshots_on_disk for n in client.nodes())
        torch.manual_seed(0)
        model = digits.make_model(hidden=32)
        killed = threading.Event()
        job = client.submit(model, LOSS, SGD, gated(data, 9, killed), steps=STEPS,
                            microbatches=2, stages=3, replicas=1, schedule="1f1b",
                            compression="none", checkpoint_every=EVERY, rebalance="never")

        def kill() -> None:
            swarm.kill(PlanView(job_info(client, job).plan)[StageKey(0, 1)].address)
            killed.set()
        inj = swarm.inject(job.id)
        inj.at_step(7, "kill stage 1", kill).start()
        status = job.wait(timeout=180, progress=False)
        inj.stop()
        assert status.state == "SUCCEEDED" and [f.name for f in inj.fired] == ["kill stage 1"]
        assert all(a.snapshots_on_disk for a in status.plan.stages)
        got = job.state_dict()
        assert max_relative_difference(got, single_process(model, LOSS, SGD, data)) <= 1e-5
        final = job_info(client, job)
        assert len(final.recoveries) == 1
        # rewound to a file's step (which one depends on how far the pipeline ran before
        # the kill took: 9 was seen, the kill firing at the tracker's step 7)
        assert final.recoveries[0].checkpoint_step in range(EVERY, STEPS, EVERY)
        alive = [i for i, p in enumerate(swarm.nodes) if p.poll() is None]
        kept = [f for i in alive for f in swarm.snapshot_dir(i).glob("*.safetensors")]
        assert kept  # the survivors' snapshots are files, and nothing half-written stays
        assert not [f for i in alive for f in swarm.snapshot_dir(i).glob("*.tmp")]
        job.release()
