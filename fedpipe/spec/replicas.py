"""How replica groups agree: the sync's names, DiLoCo's settings, and the tracker's
:class:`Quorum` answers for elastic replica groups."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .codecs import check_compression
from .errors import SpecError


REPLICA_SYNCS = ("auto", "allreduce", "diloco")
"""How replica groups agree: the planner chooses, a per-step all-reduce, or DiLoCo outer steps."""


@dataclass(frozen=True)
class DiLoCo:
    """DiLoCo replica sync: groups train alone for ``inner_steps`` steps, then an outer step.

    At an outer step each stage's pseudo-gradient (its weights at the last
    outer step minus its weights now) is averaged across the replica groups
    and applied by SGD with Nesterov momentum. Source: Douillard et al.,
    "DiLoCo: Distributed Low-Communication Training of Language Models"
    (2023), whose defaults (outer lr 0.7, momentum 0.9) these are.

    Attributes:
        inner_steps: H, optimizer steps between outer steps (>= 1).
        outer_lr: outer learning rate (> 0).
        outer_momentum: Nesterov momentum in [0, 1) (0: plain SGD).
        compression: codec of the pseudo-gradients on the wire ("none" or a codec spec;
            "sparseloco:F" is SparseLoCo's top-k + 2-bit, see :meth:`sparseloco`).
        feedback_decay: β in (0, 1] of the pseudo-gradients' error feedback under a lossy
            codec: the residual is scaled by β before the next pseudo-gradient is added
            (1: plain error feedback; SparseLoCo: 0.95, see
            :class:`fedpipe.wire.feedback.ErrorFeedback`).

    Raises:
        SpecError: a setting out of range, or a ``feedback_decay`` below 1 without a
            lossy codec (a ValueError).
    """

    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"
    feedback_decay: float = 1.0

    @classmethod
    def sparseloco(cls, inner_steps: int = 10, outer_lr: float = 1.0,
                   fraction: float = 1 / 64, feedback_decay: float = 0.95) -> "DiLoCo":
        """SparseLoCo: DiLoCo whose pseudo-gradients go through error feedback decayed by
        ``feedback_decay`` and the ``sparseloco`` codec (top ``fraction`` of each chunk
        of 4096 values, 2-bit values: 1.56 % kept at the default), with no outer momentum
        (the decayed residual stands in for it) and outer lr ``outer_lr``. Source: Sarfi,
        Thérien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with
        SparseLoCo" (2025): the algorithm, and its 1.56 % of 4096-chunks with 2-bit
        values; β = 0.95 and outer lr 1 are a starting point, not checked against the
        paper's tables (``benchmarks/sparseloco.py`` found outer lr 2 better at H=5).

        Raises:
            SpecError: a setting out of range.
        """
        return cls(inner_steps, outer_lr, 0.0, f"sparseloco:{fraction}", feedback_decay)

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise SpecError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0) \
                or not 0 <= self.outer_momentum < 1:
            raise SpecError(f"need outer_lr > 0 and 0 <= outer_momentum < 1, got "
                            f"{self.outer_lr}, {self.outer_momentum}")
        if self.compression != "auto":
            check_compression(self.compression, "outer")
        if not 0 < self.feedback_decay <= 1:
            raise SpecError(f"feedback_decay must be in (0, 1], got {self.feedback_decay}")
        if self.feedback_decay != 1 and self.compression in ("none", "raw"):
            raise SpecError(f"feedback_decay={self.feedback_decay} needs a lossy outer "
                            f"compression (error feedback), but compression is "
                            f"{self.compression!r}; e.g. DiLoCo.sparseloco()")


@dataclass(frozen=True)
class Quorum:
    """The tracker's answer to a stage about one step's sync across replica groups
    (:meth:`fedpipe.tracker.replicas.ReplicaSet.ask`; on the wire a
    ``ReplicaQuorumReply``), for jobs with ``min_replicas`` > 0.

    Attributes:
        step: the step asked about (0-based).
        version: the replica epoch the members are of.
        members: the replica groups that take part in the step, in order.
        committed: the step is committed under ``version``: apply the sum over
            ``members``. False: sum (again) over ``members``, then report it.
        dropped: the asking stage's group is no longer live: stop the stage.
        donate_to: groups that join at ``step + 1`` and take their state from the
            asking stage's group after this step (empty: none).
        next_members: with ``committed``, when the stage named the step it syncs
            next: that step's members under ``version`` (empty: it must ask), so
            the stage syncs it without asking first (a membership change before
            then supersedes them as it would any version's).
    """

    step: int
    version: int
    members: tuple[int, ...]
    committed: bool = False
    dropped: bool = False
    donate_to: tuple[int, ...] = ()
    next_members: tuple[int, ...] = ()
