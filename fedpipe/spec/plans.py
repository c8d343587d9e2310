"""Typed, read-only questions about a plan message: :class:`StageKey`, :class:`PlanView`,
:func:`peer_of`."""
from __future__ import annotations

from typing import NamedTuple

from ..proto import node_pb2


class StageKey(NamedTuple):
    """One stage of a plan: pipeline position ``stage`` in replica group ``replica``."""

    replica: int
    stage: int


def peer_of(a: node_pb2.StageAssignment) -> node_pb2.Peer:
    """The node that holds assignment ``a``, as a ``Peer``: how to reach it (gRPC and data
    addresses, and its relay when it is outbound-only) without the stage it holds."""
    return node_pb2.Peer(node_id=a.node_id, name=a.node_name, address=a.address,
                         data_address=a.data_address, relay=a.relay)


class PlanView:
    """Typed, read-only questions about a ``fedpipe.v1.Plan``.

    Args:
        plan: the plan message; its stages may come in any order.
        microbatches: the job's microbatches per step, for groups whose
            ``ReplicaInfo`` leaves them unset.
    """

    def __init__(self, plan: node_pb2.Plan, microbatches: int = 1):
        self.plan, self.job_microbatches = plan, microbatches
        self.stages: dict[StageKey, node_pb2.StageAssignment] = {
            StageKey(a.replica, a.stage): a for a in plan.stages}

    def __bool__(self) -> bool:
        return bool(self.stages)

    def __getitem__(self, key: StageKey) -> node_pb2.StageAssignment:
        return self.stages[key]

    def get(self, key: StageKey) -> node_pb2.StageAssignment | None:
        """The assignment of ``key``, or None."""
        return self.stages.get(key)

    @property
    def replicas(self) -> list[int]:
        """The replica groups, in order."""
        return sorted({k.replica for k in self.stages})

    def chain(self, replica: int) -> list[node_pb2.StageAssignment]:
        """Replica group ``replica``'s stages, first to last."""
        return [a for k, a in sorted(self.stages.items()) if k.replica == replica]

    def chains(self) -> list[list[node_pb2.StageAssignment]]:
        """Every group's :meth:`chain`, in group order."""
        return [self.chain(r) for r in self.replicas]

    def depth(self, replica: int) -> int:
        """Stages in group ``replica``."""
        return len(self.chain(replica))

    def neighbours(self, key: StageKey) -> tuple[node_pb2.StageAssignment | None,
                                                 node_pb2.StageAssignment | None]:
        """The stages before and after ``key`` in its group (None at the ends)."""
        return (self.stages.get(StageKey(key.replica, key.stage - 1)),
                self.stages.get(StageKey(key.replica, key.stage + 1)))

    def holders(self, layer_start: int, layer_end: int) -> list[node_pb2.StageAssignment]:
        """The stages (of any group) whose layers overlap ``[layer_start, layer_end)``."""
        return [a for _, a in sorted(self.stages.items())
                if a.layer_start < layer_end and layer_start < a.layer_end]

    def microbatches(self, replica: int) -> int:
        """Microbatches per step of group ``replica``."""
        info = self.plan.replicas[replica] if replica < len(self.plan.replicas) else None
        return info.microbatches if info is not None and info.microbatches else \
            self.job_microbatches

    def share(self, replica: int) -> int:
        """Group ``replica``'s planned share of each batch, in samples (1 if unset:
        equal shares)."""
        info = self.plan.replicas[replica] if replica < len(self.plan.replicas) else None
        return info.samples if info is not None and info.samples else 1

    def buddies(self, key: StageKey) -> list[node_pb2.StageAssignment]:
        """Where stage ``key`` may keep the copy of its checkpoint snapshots, best first.

        Another replica group's nodes first (a loss that takes the stage's
        group leaves the copy), then the nodes of the neighbouring stages, then
        any other node of the plan; never the stage's own node. One
        assignment per node. Checkpoint number ``c`` uses entry
        ``c % len(buddies)`` (:meth:`buddy`), so copies rotate and a node lost
        together with one buddy still leaves an older complete checkpoint
        elsewhere.
        """
        mine = self.stages[key]
        prev, nxt = self.neighbours(key)
        ranked = ([a for k, a in sorted(self.stages.items()) if k.replica != key.replica]
                  + [a for a in (nxt, prev) if a is not None]
                  + [a for _, a in sorted(self.stages.items())])
        out: dict[str, node_pb2.StageAssignment] = {}
        for a in ranked:
            if a.node_id != mine.node_id and a.node_id not in out:
                out[a.node_id] = a
        return list(out.values())

    def buddy(self, key: StageKey, checkpoint: int) -> node_pb2.StageAssignment | None:
        """The buddy of stage ``key`` for its ``checkpoint``-th snapshot (None: a one-node plan)."""
        options = self.buddies(key)
        return options[checkpoint % len(options)] if options else None

    def node_ids(self) -> set[str]:
        """Every node the plan uses."""
        return {a.node_id for a in self.stages.values()}

    def addresses(self) -> set[str]:
        """Every node address the plan uses."""
        return {a.address for a in self.stages.values()}
