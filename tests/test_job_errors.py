"""A Job's one-line errors, in-process against a fake tracker and fake nodes: ``save``
of a checkpoint whose snapshots are gone."""
from __future__ import annotations

import grpc
import pytest
import torch

from client_fakes import FakeRpcError, FakeTracker
from fedpipe.client import CheckpointGone, Client
from fedpipe.proto import tracker_pb2 as S

pytestmark = pytest.mark.timeout(60)
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(n)]


class GoneSnapshots:
    """A node that no longer holds the job's snapshots (it dropped them at cancel)."""

    def __init__(self):
        self.asked: list = []

    def FetchSnapshot(self, request, timeout=None):
        self.asked.append(request)
        raise FakeRpcError(NOT_FOUND, f"no step {request.step} snapshot of stage "
                                      f"{request.stage} of job {request.job_id}")


@pytest.fixture
def client():
    client = Client("127.0.0.1:1")  # never dialled: the fakes answer
    yield client
    client.close()


def test_save_after_the_snapshots_are_gone_names_the_job_the_step_and_why(client, tmp_path):
    tracker = FakeTracker(steps=3)
    tracker.move(S.JOB_STATE_CANCELLED, reason="stopped", checkpoint_step=2)
    client.stub = tracker
    node = GoneSnapshots()
    client.node = lambda address: node
    with pytest.raises(CheckpointGone) as e:
        client.job("j").save(tmp_path / "run")
    assert str(e.value) == ("job j: the checkpoint of step 2 is gone: no node holds the "
                            "snapshot of stage 0 (replica group 0); the job was cancelled "
                            "and its nodes dropped its snapshots")
    assert len(node.asked) == 2  # the stage's node, then the plan's other node (a buddy)
    assert not (tmp_path / "run").exists()
