"""Two trackers on one PostgreSQL database: kill -9 the leader mid-job and the standby
leads; SIGSTOP the leader past its lease and its writes are refused when it resumes.

Real processes on 127.0.0.1 and a PostgreSQL server the tests start (``pg_server.py``).
Nodes and the client are given both trackers' addresses (``a,b``) and follow the
leader (:mod:`fedpipe.net.trackers`). The job trains the digits MLP in 3 stages with a
synchronous schedule and must end SUCCEEDED with the weights single-process training
on the same batches gives, as in ``test_recovery.py``.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
from failover_swarm import LEADER_LEASE, LOSS, SGD, Trackers, leader_of, submit
from pg_server import postgres_server  # noqa: F401 — the session's PostgreSQL (a fixture)

import fedpipe
from fedpipe.proto import tracker_pb2 as fedpipe_pb
from fedpipe.testing import TRACKER_SERVICE, wait_serving
from fedpipe.tracker.store import PostgresStore
from reference import digit_batches, max_relative_difference, single_process

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
STEPS, EVERY = 18, 3


def test_kill_9_of_the_leading_tracker_mid_job_the_standby_leads_and_the_job_is_exact(
        request, tmp_path):
    url = request.getfixturevalue("postgres_server").new_database()
    with Trackers(url, str(tmp_path)) as two:
        a, b = two.addresses
        s = two.swarm
        assert leader_of(a) == a and leader_of(b) == a
        client, data = s.client(), digit_batches(STEPS)
        killed: list[float] = []

        def kill_leader() -> None:
            two.procs[a].kill()
            killed.append(time.monotonic())
        inj = s.inject().at_step(5, "kill -9 the leader", kill_leader)
        model, job = submit(client, inj.feed(data), steps=STEPS, every=EVERY)
        inj.start(job.id)
        wait_serving(b, TRACKER_SERVICE, 60)  # b leads once a's lease lapses
        took = time.monotonic() - killed[0]
        status = job.wait(timeout=200, progress=False)
        inj.stop()
        assert status.state == "SUCCEEDED", status
        got = job.state_dict()
        assert max_relative_difference(got, single_process(model, LOSS, SGD, data)) <= 1e-5
        job.release()
        # no node was declared lost, no step recomputed: the job trained through the gap
        assert list(client.stub.GetJob(fedpipe_pb.GetJobRequest(job_id=job.id),
                                       timeout=10).recoveries) == []
        assert took < 4 * LEADER_LEASE
        assert "leads now, at fencing epoch 2" in s.log(two.procs[b])
        store = PostgresStore(url)
        lease = store.lease()
        store.close()
        assert (lease.address, lease.epoch) == (b, 2)


def test_a_leader_stopped_past_its_lease_is_deposed_and_its_calls_refused(request, tmp_path):
    url = request.getfixturevalue("postgres_server").new_database()
    with Trackers(url, str(tmp_path), n_nodes=1) as two:
        a, b = two.addresses
        proc = two.procs[a]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            wait_serving(b, TRACKER_SERVICE, 60)  # b took over
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # at once, before its lease thread has run: a's own deadline has passed, so it
        # answers nothing as the leader (and its store refuses its writes, tests/test_leader.py)
        assert leader_of(a) != a
        two.wait_log(proc, "stops leading")
        log = two.swarm.log(proc)
        assert "could not be renewed" in log or "another tracker took the lease over" in log
        # a looks at the lease once more after stepping down, then names b
        deadline = time.monotonic() + 10 * LEADER_LEASE
        while leader_of(a) != b:
            assert time.monotonic() < deadline, two.swarm.log(proc)
            time.sleep(0.1)
        assert leader_of(b) == b
        store = PostgresStore(url)
        assert (store.lease().epoch, store.lease().address) == (2, b)
        store.close()
        # the swarm goes on under b: its node heartbeats there and is alive
        with fedpipe.Client(f"{a},{b}") as client:
            assert [n.alive for n in client.nodes()] == [True]
