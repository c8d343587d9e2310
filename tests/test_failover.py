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

import grpc
import pytest
import torch
from pg_server import postgres_server  # noqa: F401 — the session's PostgreSQL (a fixture)
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.net import trackers
from fedpipe.proto import tracker_pb2, tracker_pb2_grpc
from fedpipe.testing import TRACKER_SERVICE, LocalSwarm, free_port, wait_serving
from fedpipe.tracker.store import PostgresStore
from reference import digit_batches, max_relative_difference, single_process

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
STEPS, EVERY = 18, 3
LEADER_LEASE = 3.0


class TwoTrackers:
    """A :class:`LocalSwarm` whose tracker is two processes on one PostgreSQL database:
    ``a`` starts first and leads, ``b`` stands by. The swarm's ``tracker`` is ``a,b``."""

    def __init__(self, url: str, workdir: str, n_nodes: int = 4):
        self.swarm = LocalSwarm(n_nodes=n_nodes, workdir=workdir, store=url,
                                tracker_args=["--leader-lease", str(LEADER_LEASE)])
        self.url = url
        self.procs: dict[str, object] = {}

    def __enter__(self) -> "TwoTrackers":
        s = self.swarm
        try:
            self.a = s.start_tracker()  # serving: it leads
            self.procs[self.a] = s.tracker_proc
            self.b = f"127.0.0.1:{free_port()}"
            self.procs[self.b] = s._spawn("tracker-b", [
                "tracker", "--host", "127.0.0.1", "--port", self.b.rsplit(":", 1)[1],
                "--store", self.url, "--lease", str(s.lease),
                "--leader-lease", str(LEADER_LEASE)])
            self._wait_log(self.procs[self.b], "stands by")
            s.tracker = f"{self.a},{self.b}"
            for i in range(s.n_nodes):
                s.add_node()
                s.wait_for_nodes(i + 1)
            s.wait_for_links()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_log(self, proc, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.swarm.log(proc):
            assert proc.poll() is None, self.swarm.log(proc)
            assert time.monotonic() < deadline, self.swarm.log(proc)
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs.values():
            LocalSwarm.stop_process(proc, now=True)
        self.swarm.close()

    def __exit__(self, *exc) -> None:
        self.close()


def submit(client, data):
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=STEPS, microbatches=2, stages=3,
                        replicas=1, schedule="1f1b", compression="none",
                        checkpoint_every=EVERY, rebalance="never")
    return model, job


def leader_of(address: str) -> str | None:
    """What the tracker at ``address`` says of the leader: itself (it answers), the
    address it redirects to, or None (no leader now)."""
    with grpc.insecure_channel(address) as ch:
        try:
            tracker_pb2_grpc.TrackerStub(ch).ListNodes(tracker_pb2.ListNodesRequest(), timeout=5)
        except grpc.RpcError as e:
            return trackers.leader_of(e)
        return address


def test_kill_9_of_the_leading_tracker_mid_job_the_standby_leads_and_the_job_is_exact(
        request, tmp_path):
    url = request.getfixturevalue("postgres_server").new_database()
    with TwoTrackers(url, str(tmp_path)) as two:
        s = two.swarm
        assert leader_of(two.a) == two.a and leader_of(two.b) == two.a
        client, data = s.client(), digit_batches(STEPS)
        model, job = submit(client, data)
        killed: list[float] = []

        def kill_leader() -> None:
            two.procs[two.a].kill()
            killed.append(time.monotonic())
        inj = s.inject(job.id)
        inj.at_step(5, "kill -9 the leader", kill_leader).start()
        wait_serving(two.b, TRACKER_SERVICE, 60)  # b leads once a's lease lapses
        took = time.monotonic() - killed[0]
        status = job.wait(timeout=200, progress=False)
        inj.stop()
        assert status.state == "SUCCEEDED", status
        got = job.state_dict()
        assert max_relative_difference(got, single_process(model, LOSS, SGD, data)) <= 1e-5
        job.release()
        assert took < 4 * LEADER_LEASE
        assert "leads now, at fencing epoch 2" in s.log(two.procs[two.b])
        store = PostgresStore(url)
        lease = store.lease()
        store.close()
        assert (lease.address, lease.epoch) == (two.b, 2)


def test_a_leader_stopped_past_its_lease_is_deposed_and_its_writes_refused(request, tmp_path):
    url = request.getfixturevalue("postgres_server").new_database()
    with TwoTrackers(url, str(tmp_path), n_nodes=1) as two:
        a = two.procs[two.a]
        os.kill(a.pid, signal.SIGSTOP)
        try:
            wait_serving(two.b, TRACKER_SERVICE, 60)  # b took over
        finally:
            os.kill(a.pid, signal.SIGCONT)
        two._wait_log(a, "stops leading")
        log = two.swarm.log(a)
        assert "could not be renewed" in log or "another tracker took the lease over" in log
        # a looks at the lease once more after stepping down, then names b
        deadline = time.monotonic() + 10 * LEADER_LEASE
        while leader_of(two.a) != two.b:
            assert time.monotonic() < deadline, two.swarm.log(a)
            time.sleep(0.1)
        assert leader_of(two.b) == two.b
        # every write a made after resuming was refused: none committed under epoch 1
        store = PostgresStore(url)
        assert store.lease().epoch == 2 and store.lease().address == two.b
        store.close()
        # and the swarm goes on under b: its node is alive there
        with s_client(two) as client:
            assert [n.alive for n in client.nodes()] == [True]


def s_client(two: TwoTrackers) -> fedpipe.Client:
    return fedpipe.Client(f"{two.a},{two.b}")
