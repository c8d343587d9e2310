"""A LocalSwarm whose tracker is several processes on one PostgreSQL database, for
``tests/test_failover.py`` and ``benchmarks/failover.py``; and the job the outage and
failover tests submit (:func:`submit`)."""
from __future__ import annotations

import subprocess
import time
from typing import Iterable

import grpc
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.net import trackers
from fedpipe.proto import tracker_pb2, tracker_pb2_grpc
from fedpipe.testing import LocalSwarm, free_port

SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
LOSS = nn.functional.cross_entropy
LEADER_LEASE = 3.0
"""The trackers' ``--leader-lease`` here, seconds (shorter than the default 5 s, so the
tests wait less)."""


class Trackers:
    """A :class:`LocalSwarm` whose tracker is ``1 + standbys`` processes on the database
    ``url``: the first starts first and leads, the others stand by. The swarm's
    ``tracker`` is every address, comma-separated, so nodes and clients follow the leader.

    Attributes:
        swarm: the swarm (its nodes, clients and faults).
        addresses: the trackers' ``HOST:PORT``, the first leading at the start.
        procs: each address's tracker process.
    """

    def __init__(self, url: str, workdir: str, n_nodes: int = 4, standbys: int = 1,
                 leader_lease: float = LEADER_LEASE, node_lease: float = 5.0):
        self.swarm = LocalSwarm(n_nodes=n_nodes, workdir=workdir, store=url, lease=node_lease,
                                tracker_args=["--leader-lease", str(leader_lease)])
        self.url, self.standbys, self.leader_lease = url, standbys, leader_lease
        self.addresses: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "Trackers":
        s = self.swarm
        try:
            first = s.start_tracker()  # serving: it leads
            self.addresses.append(first)
            self.procs[first] = s.tracker_proc
            for i in range(self.standbys):
                self.start(f"127.0.0.1:{free_port()}", f"tracker-{i + 2}")
            s.tracker = ",".join(self.addresses)
            for i in range(s.n_nodes):
                s.add_node()
                s.wait_for_nodes(i + 1)
            s.wait_for_links()
        except BaseException:
            self.close()
            raise
        return self

    def start(self, address: str, name: str) -> subprocess.Popen:
        """Start a tracker process at ``address`` on the database (it stands by, or leads
        if no lease is current); returned once it has looked at the lease."""
        proc = self.swarm._spawn(name, [
            "tracker", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
            "--store", self.url, "--lease", str(self.swarm.lease),
            "--leader-lease", str(self.leader_lease)])
        if address not in self.addresses:
            self.addresses.append(address)
        self.procs[address] = proc
        self.wait_log(proc, "fedpipe tracker listening")
        return proc

    def wait_log(self, proc: subprocess.Popen, text: str, timeout: float = 60.0) -> None:
        """Wait until ``proc``'s log shows ``text``.

        Raises:
            AssertionError: it exited, or ``timeout`` seconds passed (the log is quoted).
        """
        deadline = time.monotonic() + timeout
        while text not in self.swarm.log(proc):
            assert proc.poll() is None, self.swarm.log(proc)
            assert time.monotonic() < deadline, self.swarm.log(proc)
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs.values():
            LocalSwarm.stop_process(proc, now=True)
        self.swarm.close()

    def __exit__(self, *exc) -> None:
        self.close()


def leader_of(address: str, timeout: float = 5.0) -> str | None:
    """What the tracker at ``address`` says of the leader: itself (it answers), the
    address it redirects to, or None (no leader now, or it does not answer)."""
    with grpc.insecure_channel(address) as ch:
        try:
            tracker_pb2_grpc.TrackerStub(ch).ListNodes(tracker_pb2.ListNodesRequest(),
                                                       timeout=timeout)
        except grpc.RpcError as e:
            return trackers.leader_of(e)
        return address


def submit(client: fedpipe.Client, data: Iterable, *, steps: int, every: int,
           stages: int = 3) -> tuple[nn.Sequential, fedpipe.Job]:
    """Submit the digits MLP (seeded, so single-process training on the same batches
    can be compared) in ``stages`` stages, one group, synchronous (1F1B), uncompressed,
    a checkpoint every ``every`` steps and no rebalancing; returns the model as built
    and the job."""
    torch.manual_seed(0)
    model = digits.make_model(hidden=32)
    job = client.submit(model, LOSS, SGD, data, steps=steps, microbatches=2, stages=stages,
                        replicas=1, schedule="1f1b", compression="none",
                        checkpoint_every=every, rebalance="never")
    return model, job
