"""Plans made in a worker process (fedpipe.tracker.planning): the same plan as in-process,
errors crossing back, a dead worker failing no job."""
from __future__ import annotations

import os
import signal

import pytest

from fedpipe import planner
from fedpipe.planner.protoio import cluster_view, model_profile
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import JobSpec
from fedpipe.tracker.planning import Planner, plan_job
from tracker_fakes import submission

pytestmark = [pytest.mark.timeout(120), pytest.mark.processes]


def swarm(n: int, memory: int = 2**33) -> planner.ClusterView:
    nodes = [tracker_pb2.NodeInfo(
        node_id=f"id{i}", name=f"n{i}", address=f"127.0.0.1:{7000 + i}", alive=True,
        registered=float(i), resources=node_pb2.Resources(flops=1e12 * (1 + i % 3),
                                                          memory_bytes=memory, cores=1))
        for i in range(n)]
    return cluster_view(nodes, [])


@pytest.fixture(scope="module")
def worker():
    p = Planner(processes=1)
    p.start()
    yield p
    p.close()


def test_the_worker_makes_the_plan_the_tracker_would_make(worker):
    request = submission(stages=2, replicas=2, replica_sync="auto")
    cluster, profile = swarm(8), model_profile(request.profile)
    job = JobSpec.from_proto(request.config)
    assert worker.plan(cluster, profile, job) == plan_job(cluster, profile, job)
    assert worker.plan(cluster, profile, job)[1].replica_sync in ("allreduce", "diloco")


def test_a_plan_error_in_the_worker_is_raised_to_the_caller_with_its_message(worker):
    request = submission(stages=2)
    with pytest.raises(planner.PlanError) as e:
        worker.plan(swarm(4, memory=10), model_profile(request.profile),
                    JobSpec.from_proto(request.config))
    assert str(e.value)  # the planner's words about what did not fit


def test_a_worker_that_dies_fails_no_plan_and_is_replaced():
    p = Planner(processes=1)
    try:
        request = submission(stages=2)
        cluster, profile = swarm(4), model_profile(request.profile)
        job = JobSpec.from_proto(request.config)
        first = p.plan(cluster, profile, job)
        (pid,) = p._executor()._processes  # the one worker
        os.kill(pid, signal.SIGKILL)
        assert p.plan(cluster, profile, job) == first  # made in-process this time
        assert p.plan(cluster, profile, job) == first  # and by a new worker
        assert pid not in p._executor()._processes
    finally:
        p.close()
