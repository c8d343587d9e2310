"""A node that moved to another relay: its jobs' plans follow its new addresses.

An outbound-only node whose relay stays away re-homes at the next one of its list
and registers the addresses that relay opened for it, naming the id it holds
(:meth:`~.registry.Registry.register`: same name and boot id, it keeps it). Its
process, stages and their state are the same, so the jobs on it need no new plan
epoch and no rewind: :func:`readdress` rewrites each active job's plan in place
(same epoch, same stages, the node's new ``address``, ``data_address`` and
``relay``) and sends the plan's assignments to every node of it (``AssignJob``
with ``stages``). Each node points its stages' plans and its data-plane links to
the moved node at the new addresses (:meth:`fedpipe.net.dataplane.DataPlane.redirect`):
a link broken with the old relay redials there and resumes where it broke, resending
what was not acknowledged, so no tensor is lost or repeated. The client reads the new
addresses from ``GetJob`` when its feed to the old ones is refused.

The links' resume window (:attr:`fedpipe.net.dataplane.Timeouts.resume`) bounds the
move: a link not redirected within it fails, and the job recovers as from a node loss.
"""
from __future__ import annotations

import logging
from concurrent import futures
from typing import ContextManager

from ..proto import node_pb2, tracker_pb2
from .nodes import NodeCallError, NodeCalls
from .specs import JobSpecs
from .store import Store

log = logging.getLogger("fedpipe.tracker")


def readdress(node: tracker_pb2.NodeInfo, store: Store, nodes: NodeCalls, specs: JobSpecs,
              live: dict[str, str], lock: ContextManager) -> list[str]:
    """Rewrite the plan of every running or recovering job that assigns ``node`` (as the
    registry lists it now, moved) to its new addresses, and tell each node of such a plan
    (at ``live``: node id -> its address now; a node not there is not told). Returns the
    jobs rewritten. Each plan is read and written under ``lock`` (the recoveries' lock: a
    recovery's new plan is never overwritten with the old one).

    Each node of the plan is called at once, within ``CONTROL_RPC``; one that cannot be
    reached (its own relay may be away too) is logged and skipped: it learns the plan when
    it moves in turn, since every move sends the whole plan again.
    """
    rewritten = []
    for job_id in store.jobs_in(tracker_pb2.JOB_STATE_RUNNING, tracker_pb2.JOB_STATE_RECOVERING):
        with lock:
            plan = store.job(job_id).plan
            mine = [a for a in plan.stages if a.node_id == node.node_id]
            if not mine:
                continue
            for a in mine:
                a.address, a.data_address, a.relay = (node.address, node.data_address,
                                                      node.relay)
            store.set_plan(job_id, plan, readdressed=True)
        rewritten.append(job_id)
        request = node_pb2.AssignJobRequest(
            job_id=job_id, epoch=plan.epoch, owner=specs.request(job_id).owner,
            node_names=sorted({a.node_name for a in plan.stages}), stages=plan.stages)
        targets = sorted({live[a.node_id] for a in plan.stages if a.node_id in live})

        def tell(address: str, job_id: str = job_id,
                 request: node_pb2.AssignJobRequest = request) -> None:
            try:
                nodes.assign_job(address, request)
            except NodeCallError as e:
                log.info("job %s: could not tell %s that node %s moved: %s", job_id, address,
                         node.name, e)

        with futures.ThreadPoolExecutor(max(1, len(targets))) as pool:
            list(pool.map(tell, targets))
        log.info("job %s: node %s moved to relay %s; plan epoch %d follows it to %s",
                 job_id, node.name, node.relay, plan.epoch, node.address)
    return rewritten
