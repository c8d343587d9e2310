"""Test helpers: :class:`LocalSwarm` with fault injection, and the process helpers of
:mod:`fedpipe.proc` (re-exported here for tests)."""
from __future__ import annotations

from ..net import timeouts
from ..proc import (NODE_SERVICE, TRACKER_SERVICE, child_env, die_with_parent,  # noqa: F401
                    free_port, wait_serving)  # re-exported for tests
from ..proto import tracker_pb2
from ..swarm import LocalSwarm as _Swarm
from . import faults


class LocalSwarm(_Swarm):
    """A :class:`fedpipe.swarm.LocalSwarm` (same arguments) whose nodes tests and
    benchmarks can kill, pause, and whose tracker they can restart, also at a chosen
    step of a job (:meth:`inject`)."""

    def node_index(self, name_or_address: str) -> int:
        """Which of :attr:`nodes` is called ``name_or_address`` ("node2", or its HOST:PORT).

        Raises:
            KeyError: no live node has that name or address.
        """
        if name_or_address.startswith("node") and name_or_address[4:].isdigit():
            return int(name_or_address[4:])
        with self._admin() as client:
            for n in client.nodes():
                if n.address == name_or_address:
                    return int(n.name[4:])
        raise KeyError(f"no node {name_or_address!r} in this swarm")

    def kill(self, node: int | str) -> None:
        """``kill -9`` node ``node`` (its index, name or address)."""
        proc = self.nodes[node if isinstance(node, int) else self.node_index(node)]
        self.faulted.add(proc)
        faults.kill(proc)

    def pause(self, node: int | str, seconds: float) -> None:
        """SIGSTOP node ``node`` now and SIGCONT it ``seconds`` later."""
        proc = self.nodes[node if isinstance(node, int) else self.node_index(node)]
        self.faulted.add(proc)
        faults.pause(proc, seconds)

    def restart_tracker(self, kill: bool = True) -> str:
        """Kill (``kill -9``, or terminate) the tracker and start it again on the same
        database and port; return its address once it serves."""
        if self.tracker_proc is not None:
            self.stop_process(self.tracker_proc, kill=kill)
        return self.start_tracker()

    def inject(self, job_id: str = "") -> "faults.FaultInjector":
        """A :class:`~fedpipe.testing.faults.FaultInjector` for ``job_id``: add faults
        with ``at_step(step, name, action)``, then ``start()`` it. Made before the job
        (no ``job_id``) it can hold the job's feed at each fault's step (``feed``); then
        ``start(job.id)``."""
        client = self._admin()
        self._clients.append(client)
        return faults.FaultInjector(lambda jid: client.stub.GetJob(
            tracker_pb2.GetJobRequest(job_id=jid), timeout=timeouts.CONTROL_RPC), job_id)
