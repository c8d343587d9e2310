"""A save into a folder that holds a checkpoint, interrupted before its end (a stage's
snapshot gone from its node, a full disk), leaves the earlier checkpoint readable."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpipe.client import checkpoints
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint
from fedpipe.spec import StageKey

pytestmark = pytest.mark.timeout(60)


def _plan_and_snapshots(step: int, fill: float):
    layers = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with torch.no_grad():
        for p in layers.parameters():
            p.fill_(fill)
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=k, layer_start=k, layer_end=k + 1, address=f"n{k}:1")
        for k in range(2)])
    snaps = [(StageKey(0, k), checkpoint.take({"module": nn.Sequential(layers[k])}, step=step))
             for k in range(2)]
    return plan, snaps


def test_an_interrupted_save_over_a_checkpoint_leaves_that_checkpoint_readable(tmp_path):
    plan, snaps = _plan_and_snapshots(100, 1.0)
    checkpoints.write(tmp_path, 100, snaps, plan, steps=300)
    assert checkpoints.read(tmp_path).step == 100

    plan, snaps = _plan_and_snapshots(200, 2.0)

    def pulled():  # as Job.save pulls them: the second stage's node has dropped it
        yield snaps[0]
        raise OSError("stage 1's snapshot of step 200 is gone from its node")
    with pytest.raises(OSError, match="gone"):
        checkpoints.write(tmp_path, 200, pulled(), plan, steps=300)
    # was: checkpoint.json was deleted when the save began and stage 0's shard overwritten,
    # so the step-100 checkpoint was lost with the step-200 one
    saved = checkpoints.read(tmp_path)
    assert saved.step == 100
    assert all(bool(torch.all(t == 1.0)) for snap in saved.snapshots.values()
               for path, t in snap.tensors.items() if path.startswith("module/"))
    # what the failed save wrote aside is gone at the next save, which replaces the old
    plan, snaps = _plan_and_snapshots(300, 3.0)
    checkpoints.write(tmp_path, 300, snaps, plan, steps=300)
    assert checkpoints.read(tmp_path).step == 300
    assert not list(tmp_path.glob("*.tmp"))
