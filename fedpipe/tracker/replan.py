"""Replanning a running job after a node loss: move only what must move.

:func:`substitute` keeps every stage whose node survived where it is, with its
layer range, and gives each lost node's stages to another live node: a spare
node (one the plan does not use) first, else the surviving node with the most
memory left, which then runs two stages. Keeping the layer ranges is what lets
each stage resume from its own snapshot, so a synchronous job recovers exactly.
Rebalancing the layers over a changed swarm is a different decision (taken at
checkpoint boundaries, when it pays for the move).
"""
from __future__ import annotations

from typing import Callable

from ..planner import PlanError
from ..planner.protoio import memory_shares, move_to, plan_summary
from ..proto import node_pb2, tracker_pb2
from ..spec import PlanView, StageKey


def substitute(plan: node_pb2.Plan, lost: set[str], live: list[tracker_pb2.NodeInfo],
               need: Callable[[node_pb2.StageAssignment], float]) -> node_pb2.Plan:
    """The plan with the stages of ``lost`` nodes moved to live nodes.

    Args:
        plan: the job's current plan.
        lost: ids of the nodes that are gone (their stages move).
        live: the live nodes (survivors and spares), with their memory (nodes of one
            host share it, :func:`~fedpipe.planner.protoio.memory_shares`).
        need: bytes one stage needs on a node (weights, optimizer state,
            activations, snapshots).

    Returns:
        A copy of ``plan`` (same epoch: the caller sets the new one) in which
        no stage is on a lost node.

    Raises:
        PlanError: a stage fits on no live node; the message gives the
            stage's need and the most memory any live node has left, in MiB.
    """
    out = node_pb2.Plan()
    out.CopyFrom(plan)
    alive = {n.node_id: n for n in live if n.node_id not in lost}
    used = {a.node_id for a in out.stages}
    shares = memory_shares(list(alive.values()))  # nodes of one host share its memory
    free = {nid: float(shares[nid]) for nid in alive}
    for a in out.stages:
        if a.node_id in free:
            free[a.node_id] -= need(a)
    taken: dict[str, str] = {}  # lost node -> the node that takes its stages
    view = PlanView(out)
    for key in sorted(view.stages):
        a = view[key]
        if a.node_id in alive:
            continue
        want = need(a)
        order = sorted(alive, key=lambda nid: (nid != taken.get(a.node_id),  # keep together
                                               nid in used,                 # spares first
                                               -free[nid]))
        target = next((nid for nid in order if free[nid] >= want), None)
        if target is None:
            most = max(free.values(), default=0.0)
            raise PlanError(f"stage {key.stage} (replica {key.replica}) needs "
                            f"{want / 2**20:.1f} MiB but the {len(alive)} live node(s) have at "
                            f"most {most / 2**20:.1f} MiB left")
        taken.setdefault(a.node_id, target)
        free[target] -= want
        move_to(a, alive[target])
    out.summary = plan_summary(out)
    return out


def moved(before: node_pb2.Plan, after: node_pb2.Plan) -> list[StageKey]:
    """The stages whose node differs between two plans of a job."""
    old = PlanView(before)
    return [k for k, a in sorted(PlanView(after).stages.items())
            if old.get(k) is None or old[k].node_id != a.node_id]


def moves(before: node_pb2.Plan, after: node_pb2.Plan) -> tuple[str, str]:
    """``(from, to)``: the names of the nodes the :func:`moved` stages left and went to,
    each joined by ", " in the same stage order, so the i-th name of each is one stage's
    move: two nodes that swapped stages read ``("n3, nat1", "nat1, n3")`` (a set of each
    said ``n3, nat1 -> n3, nat1``, as if nothing moved). "" when none moved; a stage new
    to ``after`` has "-" for its "from"."""
    old, new = PlanView(before), PlanView(after)
    keys = moved(before, after)
    left = [old[k].node_name if old.get(k) is not None else "-" for k in keys]
    went = [new[k].node_name for k in keys]
    return ", ".join(left), ", ".join(went)
