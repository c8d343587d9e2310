"""The job's configuration: :class:`JobSpec` and each setting's own check
(:data:`FIELD_RULES`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Literal

from ..proto import node_pb2
from .codecs import check_compression, lowrank_problem
from .cuts import cuts_problem
from .errors import JobSpecError, SpecError
from .replicas import REPLICA_SYNCS, DiLoCo
from .schedules import check_schedule
from .states import CLIENT_TIMEOUT
from .weights import WeightsSpec

MICROBATCHES = 1
"""A job's microbatches per step unless told (each batch whole): the one default of
``submit``'s (:class:`~fedpipe.spec.knobs.Training`, :class:`JobSpec`), the planner's
(``TrainConfig``) and ``fedpipe plan``'s and ``fedpipe submit``'s, so a plan previews
what a submit does."""
SCHEDULE = "gpipe"
"""A job's pipeline schedule unless told: the one default of ``submit``'s, the planner's
and the command line's, as :data:`MICROBATCHES` is."""
MAX_MICROBATCHES = 4096
REBALANCE = ("auto", "never")
"""Whether the tracker may migrate a running job to a better plan (a node joined, or one is
slower than it said) at a checkpoint boundary, when the gain pays for the move."""
RECOMPUTE = ("off", "on", "auto")
"""Activation recomputation: "off"; "on": every stage keeps only its inputs per microbatch
and re-runs its forward in backward; "auto": the planner turns it on for the stages that
would not fit in memory otherwise (``submit``'s ``recompute=False | True | "auto"``)."""


def stage_recomputes(mode: str, chosen: bool) -> bool:
    """Whether a stage recomputes its activations: under ``mode`` "on" every stage, under
    "auto" those the plan ``chosen`` (``StageAssignment.recompute``), under "off" none."""
    return mode == "on" or (mode == "auto" and chosen)


PRECISIONS = ("fp32", "bf16-mixed")
"""Compute precision: "fp32", or "bf16-mixed": forward under ``torch.autocast`` to bfloat16,
with float32 weights, gradients, optimizer state and loss."""


def _codec_error(setting: object, carries: Literal["activations", "gradients"]) -> str | None:
    try:
        check_compression(setting, carries)  # type: ignore[arg-type]  # a str is checked there
    except (SpecError, TypeError) as e:
        return str(e)
    return None


def _schedule_error(name: object) -> str | None:
    try:
        check_schedule(name)  # type: ignore[arg-type]  # a non-str is no schedule's name
    except SpecError as e:
        return str(e)
    return None


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


FIELD_RULES: dict[str, Callable[[Any], str | None]] = {
    "steps": lambda v: None if v >= 1 else f"must be >= 1, got {v}",
    "microbatches": lambda v: None if 1 <= v <= MAX_MICROBATCHES
    else f"must be in 1..{MAX_MICROBATCHES}, got {v}",
    "schedule": _schedule_error,
    "clip_grad_norm": lambda v: None if _finite(v) and v >= 0
    else f"must be a finite number >= 0 (0: no clipping), got {v}",
    "stages": lambda v: None if v >= 0 else f"must be >= 0, got {v}",
    "replicas": lambda v: None if v >= 0 else f"must be >= 0, got {v}",
    "activation_compression": lambda v: _codec_error(v, "activations"),
    "gradient_compression": lambda v: _codec_error(v, "gradients"),
    "max_staleness": lambda v: None if v >= 0 else f"must be >= 0, got {v}",
    "replica_sync": lambda v: None if v in REPLICA_SYNCS
    else f"must be one of {list(REPLICA_SYNCS)}, got {v!r}",
    "checkpoint_every": lambda v: None if v >= 0
    else f"must be >= 0 (0: chosen from the step time), got {v}",
    "client_timeout": lambda v: None if _finite(v) and v > 0
    else f"must be a finite number of seconds > 0, got {v}",
    "rebalance": lambda v: None if v in REBALANCE
    else f"must be one of {list(REBALANCE)}, got {v!r}",
    "min_replicas": lambda v: None if v >= 0
    else f"must be >= 0 (0: every loss rewinds), got {v}",
    "pending_timeout": lambda v: None if _finite(v) and v >= 0
    else f"must be a finite number of seconds >= 0 (0: no limit), got {v}",
    "recompute": lambda v: None if v in RECOMPUTE
    else f"must be one of {list(RECOMPUTE)}, got {v!r}",
    "precision": lambda v: None if v in PRECISIONS
    else f"must be one of {list(PRECISIONS)}, got {v!r}",
}
"""Each job setting's own check, by its :class:`JobSpec` field (or ``submit`` keyword)
name: an error message, or None. :meth:`JobSpec.validate` and the ``submit`` groups
(:class:`Training`, ...) both check through here; checks that join two settings are in
:meth:`JobSpec.validate`."""


def check_field(name: str, value: object) -> None:
    """Check one setting by :data:`FIELD_RULES`.

    Raises:
        JobSpecError: it is out of range (``field`` is ``name``).
    """
    error = FIELD_RULES[name](value)
    if error is not None:
        raise JobSpecError(name, error)


@dataclass(frozen=True)
class JobSpec:
    """What a job asks for: the configuration the client submits and every stage runs by.

    Frozen and typed; :meth:`validate` checks it, :meth:`to_proto` and
    :meth:`from_proto` convert to and from ``fedpipe.v1.JobConfig``. Client,
    tracker and node all go through this object, so defaults and checks live
    only here.

    Attributes:
        steps: optimizer steps, one batch each (>= 1).
        microbatches: microbatches per batch (1..4096).
        batch_size: samples per batch (>= microbatches).
        schedule: one of :data:`SCHEDULES`.
        optimizer: cloudpickled ``fedpipe.OptimizerSpec`` (built per stage).
        loss_fn: cloudpickled ``loss_fn(output, target)`` (last stage only).
        lr_scheduler: cloudpickled ``fedpipe.LRSchedulerSpec``, or b"" for none;
            stepped on every stage after each optimizer step.
        clip_grad_norm: clip gradients to this global L2 norm (over every stage
            and, under all-reduce, every replica group); 0 = no clipping.
        stages: pipeline depth asked for (0: the planner chooses).
        cuts: pinned stage boundaries (:mod:`fedpipe.spec.cuts`: the child index at which
            each stage but the first begins; ``stages - 1`` of them), or ``()``: the
            planner splits the layers.
        replicas: replica groups asked for (0: the planner chooses).
        activation_compression, gradient_compression: "auto", "none" or a codec spec.
        max_staleness: async only: steps a forward may run ahead of the updates.
        replica_sync: one of :data:`REPLICA_SYNCS`.
        diloco: the DiLoCo settings (used when ``replica_sync`` is "diloco").
        checkpoint_every: steps between checkpoints (0: chosen from the step time).
        client_timeout: seconds the job waits for its client once the client is gone
            (WAITING, "waiting for the client"), then fails (> 0; unset in the
            proto: :data:`CLIENT_TIMEOUT`).
        rebalance: one of :data:`REBALANCE`.
        min_replicas: elastic replica groups: while at least this many groups are
            live, losing a node drops only its group and the others go on without
            rewinding (:mod:`fedpipe.tracker.replicas`); below it, the job rewinds
            to its last complete checkpoint. 0 (the default): every loss rewinds.
            At most ``replicas`` when that is set.
        weights: where the stages' initial weights come from (:class:`WeightsSpec`).
        recompute: one of :data:`RECOMPUTE` (unset in the proto: "off").
        precision: one of :data:`PRECISIONS` (unset in the proto: "fp32").
        optimizer_kind: the optimizer's kind as the client names it
            (:func:`fedpipe.spec.optimizers.optimizer_kind`, e.g. "adamw", "sgd-momentum"):
            what the planner prices its state by, since the tracker never unpickles
            ``optimizer`` ("": unknown, priced as AdamW).
        libraries: ``(name, version)`` of each library the layers' classes come from,
            as the client has it (:mod:`fedpipe.runtime.libraries`: ``transformers``);
            a node with another version refuses the job's stages.
    """

    steps: int
    microbatches: int = MICROBATCHES
    batch_size: int = 1
    schedule: str = SCHEDULE
    optimizer: bytes = b""
    loss_fn: bytes = b""
    lr_scheduler: bytes = b""
    clip_grad_norm: float = 0.0
    stages: int = 0
    cuts: tuple[int, ...] = ()
    replicas: int = 0
    activation_compression: str = "auto"
    gradient_compression: str = "auto"
    max_staleness: int = 1
    replica_sync: str = "auto"
    diloco: DiLoCo = field(default_factory=DiLoCo)
    checkpoint_every: int = 0
    client_timeout: float = CLIENT_TIMEOUT
    rebalance: str = "auto"
    min_replicas: int = 0
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    recompute: str = "off"
    precision: str = "fp32"
    optimizer_kind: str = ""
    libraries: tuple[tuple[str, str], ...] = ()

    def validate(self, n_layers: int | None = None) -> "JobSpec":
        """Check every field; return self.

        Args:
            n_layers: the model's layer count, if known (bounds ``stages`` and ``cuts``).

        Raises:
            JobSpecError: the first invalid field, named, with its value.
        """
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise JobSpecError(name, message)

        for f in fields(self):
            if f.name in FIELD_RULES and f.name not in ("stages", "replicas"):
                check_field(f.name, getattr(self, f.name))
        need(self.batch_size >= self.microbatches, "batch_size",
             f"{self.batch_size} is smaller than microbatches {self.microbatches}")
        need(bool(self.optimizer), "optimizer", "the job needs an optimizer")
        need(bool(self.loss_fn), "loss_fn", "the job needs a loss function")
        need(self.stages >= 0 and (n_layers is None or self.stages <= n_layers), "stages",
             f"must be between 0 and the {n_layers} layers, got {self.stages}"
             if n_layers is not None else f"must be >= 0, got {self.stages}")
        cuts = cuts_problem(self.cuts, self.stages, n_layers)
        need(cuts is None, "cuts", cuts or "")
        need(0 <= self.replicas <= self.microbatches, "replicas",
             f"must be between 0 and the {self.microbatches} microbatches (each group needs "
             f"one), got {self.replicas}")
        need(not self.replicas or self.min_replicas <= self.replicas, "min_replicas",
             f"{self.min_replicas} is more than the {self.replicas} replica groups asked for")
        self.weights.validate(n_layers)
        need(not (self.weights.ties and self.schedule == "async"), "schedule",
             "tied parameters need a synchronous schedule: under \"async\" each stage "
             "updates its copy with gradients of other weight versions, so the copies "
             "would drift apart")
        lowrank = lowrank_problem(self.activation_compression, self.gradient_compression,
                                  self.schedule)
        need(lowrank is None, "activation_compression", lowrank or "")
        return self

    @property
    def elastic(self) -> bool:
        """Whether a lost replica group drops out instead of rewinding the job."""
        return self.min_replicas > 0

    @property
    def sync_every(self) -> int:
        """Steps between cross-group syncs: H under DiLoCo, else 1 (every step)."""
        return self.diloco.inner_steps if self.replica_sync == "diloco" else 1

    def with_(self, **changes: Any) -> "JobSpec":
        """A copy with ``changes`` (e.g. the tracker resolving "auto")."""
        return replace(self, **changes)

    def to_proto(self) -> node_pb2.JobConfig:
        """The ``fedpipe.v1.JobConfig`` message."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("diloco", "weights", "libraries")}
        o = self.diloco
        return node_pb2.JobConfig(**d, outer_every=o.inner_steps, outer_lr=o.outer_lr,
                                  outer_momentum=o.outer_momentum,
                                  outer_compression=o.compression,
                                  outer_feedback_decay=o.feedback_decay,
                                  weights=self.weights.to_proto(),
                                  libraries=dict(self.libraries))

    @classmethod
    def from_proto(cls, msg: node_pb2.JobConfig) -> "JobSpec":
        """The spec in a ``JobConfig``; fields left unset take their defaults.

        The DiLoCo settings of a job that names ``replica_sync="diloco"`` are
        taken as given (its client set them: 0 is an error, not "unset").

        Raises:
            JobSpecError: the DiLoCo settings are out of range.
        """
        default = DiLoCo()
        given = msg.replica_sync == "diloco"
        try:
            outer = DiLoCo(msg.outer_every if given else msg.outer_every or default.inner_steps,
                           msg.outer_lr if given else msg.outer_lr or default.outer_lr,
                           msg.outer_momentum if given or msg.outer_lr
                           else default.outer_momentum,
                           msg.outer_compression or default.compression,
                           msg.outer_feedback_decay or default.feedback_decay)
        except SpecError as e:
            raise JobSpecError("diloco", str(e)) from None
        return cls(steps=msg.steps, microbatches=msg.microbatches, batch_size=msg.batch_size,
                   schedule=msg.schedule, optimizer=msg.optimizer, loss_fn=msg.loss_fn,
                   lr_scheduler=msg.lr_scheduler, clip_grad_norm=msg.clip_grad_norm,
                   stages=msg.stages, cuts=tuple(msg.cuts), replicas=msg.replicas,
                   activation_compression=msg.activation_compression or "auto",
                   gradient_compression=msg.gradient_compression or "auto",
                   max_staleness=msg.max_staleness, replica_sync=msg.replica_sync or "auto",
                   diloco=outer, checkpoint_every=msg.checkpoint_every,
                   client_timeout=msg.client_timeout or CLIENT_TIMEOUT,
                   rebalance=msg.rebalance or "auto",
                   min_replicas=msg.min_replicas,
                   weights=WeightsSpec.from_proto(msg.weights),
                   recompute=msg.recompute or "off", precision=msg.precision or "fp32",
                   optimizer_kind=msg.optimizer_kind,
                   libraries=tuple(sorted(msg.libraries.items())))

    def summary(self) -> dict[str, Any]:
        """The settings as plain values (no pickles), for logs and status pages."""
        d = asdict(self)
        for k in ("optimizer", "loss_fn", "lr_scheduler"):
            d[k] = len(d[k])
        d["weights"] = {"source": self.weights.source, "seed": self.weights.seed,
                        "path": self.weights.path}
        return d
