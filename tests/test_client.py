"""The client owns its channels, feeds each replica group from the plan's view, and ends the
feed (detaching: the job waits for a client) when it is closed."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client import Client
from fedpipe.client.job import GroupFeed
from fedpipe.examples import digits
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import PlanView
from fedpipe.testing import LocalSwarm

pytestmark = pytest.mark.timeout(180)
ADAMW = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3)


def stage(replica: int, stage: int, address: str) -> node_pb2.StageAssignment:
    return node_pb2.StageAssignment(replica=replica, stage=stage, address=address,
                                    node_id=address)


def test_each_replica_group_is_fed_at_its_first_and_last_stage_with_its_share():
    plan = node_pb2.Plan(
        stages=[stage(1, 1, "d"), stage(0, 2, "c"), stage(1, 0, "e"), stage(0, 0, "a"),
                stage(0, 1, "b")],  # in no particular order
        replicas=[node_pb2.ReplicaInfo(microbatches=4, samples=48),
                  node_pb2.ReplicaInfo(microbatches=0, samples=16)])
    g0, g1 = GroupFeed.of(PlanView(plan, microbatches=2))
    assert (g0.first.address, g0.last.address, g0.microbatches, g0.share) == ("a", "c", 4, 48)
    # microbatches unset: the job's
    assert (g1.first.address, g1.last.address, g1.microbatches, g1.share) == ("e", "d", 2, 16)


def test_a_one_stage_group_takes_inputs_and_targets_at_the_same_stage_in_equal_shares():
    plan = node_pb2.Plan(stages=[stage(0, 0, "a"), stage(1, 0, "b")])
    groups = GroupFeed.of(PlanView(plan, microbatches=3))
    assert [(g.first.address, g.last.address, g.microbatches, g.share) for g in groups] == [
        ("a", "a", 3, 1), ("b", "b", 3, 1)]


def digit_batches():
    x, y, _, _ = digits.load()
    return digits.batches(x, y, 32)


@pytest.mark.processes
def test_a_client_reuses_one_channel_per_node_and_closes_them_all(swarm):
    with Client(swarm.tracker) as client:
        job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy, ADAMW,
                            digit_batches(), steps=3, microbatches=2, stages=2)
        job.wait(timeout=120, progress=False)
        weights = job.state_dict()
        assert set(weights) == set(digits.make_model(hidden=32).state_dict())
        addresses = PlanView(job.plan).addresses()
        stubs = {a: client.node(a) for a in addresses}
        assert all(client.node(a) is stubs[a] for a in addresses)  # built once, kept
        job.release()
    for stub in stubs.values():  # every node channel it made is closed
        with pytest.raises(ValueError, match="closed channel"):
            stub.Ping(node_pb2.PingRequest(), timeout=5)
    with pytest.raises(ValueError, match="closed"):
        client.node(next(iter(addresses)))
    with pytest.raises(ValueError, match="closed channel"):
        client.nodes()
    client.close()  # closing again is harmless


@pytest.mark.processes
def test_closing_a_client_mid_feed_ends_the_feed_and_the_job_waits_for_a_client(swarm):
    client = Client(swarm.tracker)
    job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy, ADAMW,
                        digit_batches(), steps=100_000, microbatches=2)
    deadline = time.monotonic() + 120
    while (s := job.status()).step < 2:
        assert s.state in ("PENDING", "PLANNING", "DEPLOYING", "RUNNING"), s
        assert time.monotonic() < deadline, f"the job made no progress: {s}"
        time.sleep(0.2)
    closed = time.monotonic()
    client.close()
    assert not job._feeder.is_alive()  # close() waits for the feeder to stop
    assert time.monotonic() - closed < 10
    with Client(swarm.tracker) as other:
        watched = other.job(job.id)
        deadline = time.monotonic() + 60
        while (status := watched.status()).state == "RUNNING":
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status.state == "WAITING", status
        assert status.reason.startswith("waiting for the client"), status
        watched.cancel()
        assert watched.status().state == "CANCELLED"
    assert "closed" in str(job.feed_error)


@pytest.mark.processes
def test_closing_a_client_whose_job_waits_for_a_node_ends_its_watch_and_leaves_the_job():
    """The feeder waits for RUNNING on a WatchJob stream; close() must end that wait. The
    job stays PENDING: it fails at its client_timeout unless a client resumes it."""
    with LocalSwarm(n_nodes=0) as lone:
        client = Client(lone.tracker)
        job = client.submit(nn.Sequential(nn.Linear(4, 2)), nn.functional.mse_loss,
                            fedpipe.optimizer(torch.optim.SGD, lr=0.1),
                            [(torch.zeros(4, 4), torch.zeros(4, 2))], steps=1)
        assert job.status().state == "PENDING"
        closed = time.monotonic()
        client.close()
        assert not job._feeder.is_alive()
        assert time.monotonic() - closed < 5
        assert not job._follower.is_alive()
        with Client(lone.tracker) as other:
            status = other.job(job.id).status()
            assert status.state == "PENDING", status
            deadline = time.monotonic() + 10  # the tracker sees the client's watch end
            while other.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id),
                                    timeout=10).feeder:
                assert time.monotonic() < deadline, "the tracker still counts the client in"
                time.sleep(0.05)


def test_cycling_a_dataloader_draws_its_shuffle_as_a_plain_epoch_loop_does():
    """Each pass calls iter() once: a seeded shuffle gives the batches of
    ``for epoch in ...: for batch in loader``, not ones shifted by an extra iter()."""
    import itertools as it

    from fedpipe.client.job import _cycle

    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(12, 1), torch.arange(12))

    def loader():
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                           generator=torch.Generator().manual_seed(7))

    once = loader()
    plain = [y.tolist() for _ in range(3) for _, y in once]
    cycled = [y.tolist() for _, y in it.islice(_cycle(loader()), 9)]
    assert cycled == plain
    assert plain[:3] != plain[3:6]  # the epochs are shuffled differently: the test can fail
