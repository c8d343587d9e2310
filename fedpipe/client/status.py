"""What a job is doing, as its client sees it: :class:`JobStatus`."""
from __future__ import annotations

from dataclasses import dataclass

from ..observe.views import recovery_headline
from ..proto import node_pb2, tracker_pb2
from ..spec import state_name


@dataclass
class JobStatus:
    """A job's state and the reason for it, its progress and its plan.

    Attributes:
        checkpoint_step: the last complete checkpoint (0: none yet).
        recoveries: each recovery from a lost node: who was lost, the
            checkpoint step it rewound to, steps recomputed, and the seconds
            spent detecting, replanning and restoring.
    """

    state: str
    reason: str
    step: int
    steps: int
    loss: float
    plan: node_pb2.Plan
    checkpoint_step: int = 0
    recoveries: tuple[tracker_pb2.Recovery, ...] = ()

    def __str__(self) -> str:
        loss = f"{self.loss:.4f}" if self.step else "-"  # no step done: no loss yet
        text = f"{self.state} ({self.reason}); step {self.step}/{self.steps}, loss {loss}"
        for r in self.recoveries:
            text += (f"\n  {recovery_headline(r)}: rewound to step "
                     f"{r.checkpoint_step}, {r.steps_recomputed} steps recomputed, "
                     f"{r.detect_seconds + r.replan_seconds + r.restore_seconds:.1f} s "
                     f"(detect {r.detect_seconds:.1f}, replan {r.replan_seconds:.1f}, "
                     f"restore {r.restore_seconds:.1f})")
        return text

    @classmethod
    def of(cls, info: tracker_pb2.JobInfo) -> "JobStatus":
        """The status a job's ``JobInfo`` (``GetJob``'s answer) says."""
        return cls(state_name(info.state), info.reason, info.step, info.steps, info.loss,
                   info.plan, info.checkpoint_step, tuple(info.recoveries))
