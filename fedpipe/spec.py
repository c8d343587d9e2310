"""The job's vocabulary: schedules, the codec grammar, job states, DiLoCo settings, JobSpec.

Each fact about a job is written here once, and client, tracker, planner,
node and wire read it from here. This module imports neither torch nor grpc
(only the generated protobuf messages), so the tracker's control plane starts
fast and runs on a small machine.

Schedules are data: :func:`schedule_order` gives the list of
:class:`Action` a stage runs in one step. The runtime runs that list and the
planner's simulator times that same list (as torch.distributed.pipelining's
``_Action`` lists drive both its runtime and its dry-run simulator).
"""
from __future__ import annotations

import enum
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from typing import Iterator, Literal, NamedTuple

from .proto import node_pb2, tracker_pb2


class SpecError(ValueError):
    """A name or setting outside the vocabulary: the message says which and why."""


# ---------------------------------------------------------------------------
# Schedules


@dataclass(frozen=True)
class Action:
    """Run the forward ("F") or backward ("B") pass of one microbatch."""

    kind: Literal["F", "B"]
    microbatch: int


def gpipe(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward (Huang et al., NeurIPS 2019).

    Peak activation memory: all ``microbatches`` stashed per stage.
    """
    return ([Action("F", m) for m in range(microbatches)]
            + [Action("B", m) for m in range(microbatches)])


def one_f_one_b(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """1F1B with a flush (PipeDream-Flush; Narayanan et al., "Memory-Efficient
    Pipeline-Parallel DNN Training", ICML 2021).

    Stage ``s`` runs ``min(n_stages - s - 1, M)`` warm-up forwards, then
    alternates one forward and one backward, then drains the backwards; at most
    ``n_stages - s`` microbatches are stashed at once, against M under GPipe.
    """
    warmup = min(n_stages - stage - 1, microbatches)
    actions = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        actions += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    actions += [Action("B", m) for m in range(b, microbatches)]
    return actions


def async_stream(stage: int, n_stages: int, microbatches: int, steps: int,
                 max_staleness: int) -> Iterator[Action]:
    """PipeDream-style 1F1B without a flush, over all ``steps * microbatches`` microbatches.

    Yields ``Action(kind, i)`` where ``i = step * microbatches + microbatch``
    is the microbatch's place in the stream. Backwards run in stream order,
    and the stage steps its optimizer right after the last backward of each
    step, so it has applied ``b // microbatches`` updates after ``b``
    backwards. The next action is the forward of the next ``i`` if all three
    hold, else the oldest pending backward:

    - microbatches remain;
    - fewer than ``n_stages - stage`` microbatches are in flight (1F1B's stash
      bound; Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for
      DNN Training", SOSP 2019);
    - ``i``'s step ``s`` is at most ``max_staleness`` steps ahead of the
      updates applied, i.e. the updates of all steps ``<= s - 1 - max_staleness``
      are applied.

    ``max_staleness=0`` gives exactly :func:`one_f_one_b` step after step (a
    flush). A stage's microbatches in flight use at most ``max_staleness + 1``
    weight versions (PipeDream-2BW uses 2: Narayanan et al., "Memory-Efficient
    Pipeline-Parallel DNN Training", ICML 2021).

    No deadlock when every stage follows its stream and sends without
    waiting: if stage ``t`` waits for activation ``i`` while stage ``t - 1``
    waits for a gradient instead of running ``i``'s forward, what holds
    ``t - 1`` back is its stash bound (then its oldest pending backward is at
    least two behind ``t``'s) or the staleness bound (then that backward is in
    a step ``t`` has already updated); either way ``t`` has sent that gradient.

    Raises:
        SpecError: ``max_staleness < 0`` or a count below its minimum.
    """
    if max_staleness < 0 or steps < 0 or microbatches < 1 or not 0 <= stage < n_stages:
        raise SpecError(f"bad async stream: stage {stage} of {n_stages}, {microbatches} "
                        f"microbatches, {steps} steps, max_staleness {max_staleness}")
    total, limit = steps * microbatches, n_stages - stage
    f = b = 0
    while b < total:
        if (f < total and f - b < limit
                and f // microbatches - b // microbatches <= max_staleness):
            yield Action("F", f)
            f += 1
        else:
            yield Action("B", b)
            b += 1


SCHEDULES = ("gpipe", "1f1b", "async")
"""Every schedule a job may name."""
SYNC_SCHEDULES = ("gpipe", "1f1b")
"""Schedules that flush every step, so training equals single-process gradient accumulation."""
_ORDERS = {"gpipe": gpipe, "1f1b": one_f_one_b,
           # one step of "async" in isolation is 1F1B's order; the runner follows
           # async_stream, which lets steps overlap, so a flushed step bounds its time
           "async": one_f_one_b}


def check_schedule(name: str) -> str:
    """``name`` if it names a schedule.

    Raises:
        SpecError: unknown name (the message lists the known ones).
    """
    if name not in SCHEDULES:
        raise SpecError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    return name


def schedule_order(name: str, stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """The actions stage ``stage`` of ``n_stages`` runs in one step of schedule ``name``.

    Raises:
        SpecError: unknown schedule.
    """
    return _ORDERS[check_schedule(name)](stage, n_stages, microbatches)


# ---------------------------------------------------------------------------
# Codec grammar and policy

CODEC_PARAMS: dict[str, str | None] = {"raw": None, "fp16": None, "bf16": None,
                                       "int8": "block_size", "topk": "fraction",
                                       "had4": "block_size", "had2": "block_size"}
"""Every codec name and the :class:`CodecSpec` field its parameter sets (None: no parameter)."""
GRADIENT_ONLY_CODECS = frozenset({"topk"})
"""Codecs that drop most of a tensor: usable for gradients (with error feedback) only."""
CODEC_POLICIES = ("auto", "none")
"""Compression settings that are not a codec: "auto" (the planner picks per link), "none" (raw)."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec string::

        spec  := name [":" param] ["+zstd" [":" level]]
        raw | fp16 | bf16          no parameter
        int8[:B]                   B = values per scale block, 16..65536 (default 128)
        topk[:F]                   F = fraction of entries kept, 1e-6..1 (default 0.01)
        +zstd[:L]                  zstandard level L, 1..22 (default 1)

    e.g. ``"int8:64+zstd"``, ``"topk:0.05+zstd:3"``.

    Attributes:
        name: a key of :data:`CODEC_PARAMS`.
        block_size: int8 only: values per float32 scale, 16..65536.
        fraction: topk only: fraction of the entries kept, 1e-6..1; at least one
            entry of a non-empty tensor is kept.
        zstd_level: zstandard level 1..22, or None for no zstd.

    Raises:
        SpecError: unknown name or a parameter out of range.
    """

    name: str
    block_size: int = 128
    fraction: float = 0.01
    zstd_level: int | None = None

    def __post_init__(self):
        if self.name not in CODEC_PARAMS:
            raise SpecError(f"unknown codec {self.name!r}; known: {sorted(CODEC_PARAMS)}")
        _check_range("int8 block_size", self.block_size, 16, 65536)
        _check_range("topk fraction", self.fraction, 1e-6, 1.0)
        if self.zstd_level is not None:
            _check_range("zstd level", self.zstd_level, 1, 22)

    @property
    def gradients_only(self) -> bool:
        """Whether this codec may carry gradients only (see :data:`GRADIENT_ONLY_CODECS`)."""
        return self.name in GRADIENT_ONLY_CODECS

    def k(self, numel: int) -> int:
        """topk: number of entries kept out of ``numel``: ⌈fraction·numel⌉, at least 1."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def __str__(self) -> str:
        param = CODEC_PARAMS[self.name]
        text = self.name if param is None else f"{self.name}:{getattr(self, param)}"
        return text if self.zstd_level is None else f"{text}+zstd:{self.zstd_level}"


def _check_range(what: str, value, lo, hi) -> None:
    if not lo <= value <= hi:
        raise SpecError(f"{what} must be in [{lo}, {hi}], got {value}")


_SPEC_RE = re.compile(r"(?P<name>\w+)(?::(?P<param>[^+]+))?(?P<zstd>\+zstd(?::(?P<level>[^+]+))?)?")


@lru_cache(maxsize=256)
def parse_codec(spec: str) -> CodecSpec:
    """Parse a codec spec string such as ``"int8:64+zstd"`` or ``"topk:0.05+zstd:3"``.

    Raises:
        SpecError: the string does not follow the grammar, names an unknown
            codec, gives a parameter to a codec that takes none, or a value
            out of range.
    """
    m = _SPEC_RE.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        raise SpecError(f"bad codec spec {spec!r}: expected NAME[:PARAM][+zstd[:LEVEL]], "
                        f"e.g. 'int8:64+zstd'")
    name, param, level = m["name"], m["param"], m["level"]
    if name not in CODEC_PARAMS:
        raise SpecError(f"bad codec spec {spec!r}: unknown codec {name!r}; "
                        f"known: {sorted(CODEC_PARAMS)}")
    kwargs: dict = {"zstd_level": (1 if level is None else _number(spec, level, int))
                    if m["zstd"] else None}
    if param is not None:
        param_field = CODEC_PARAMS[name]
        if param_field is None:
            raise SpecError(f"bad codec spec {spec!r}: codec {name!r} takes no parameter")
        kwargs[param_field] = _number(spec, param, type(getattr(CodecSpec, param_field)))
    try:
        return CodecSpec(name, **kwargs)
    except SpecError as e:
        raise SpecError(f"bad codec spec {spec!r}: {e}") from None


def _number(spec: str, text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise SpecError(f"bad codec spec {spec!r}: {text!r} is not a valid {kind.__name__}"
                        ) from None


def check_compression(setting: str, carries: Literal["activations", "gradients", "outer"]
                      ) -> str:
    """``setting`` if it is a valid compression setting for tensors of kind ``carries``.

    ``setting`` is "auto", "none" or a codec spec; a gradients-only codec
    (top-k) is refused for activations, which it would mostly zero.

    Raises:
        SpecError: a bad codec spec, or a gradients-only codec for activations.
    """
    if setting in CODEC_POLICIES:
        return setting
    if parse_codec(setting).gradients_only and carries == "activations":
        raise SpecError(f"{setting!r} drops most of each tensor: use it for gradients only, "
                        f"e.g. compression={{'activations': 'int8', 'gradients': 'topk:0.01'}}")
    return setting


# ---------------------------------------------------------------------------
# Job states

JobState = tracker_pb2.JobState
TERMINAL = frozenset({tracker_pb2.JOB_STATE_SUCCEEDED, tracker_pb2.JOB_STATE_FAILED,
                      tracker_pb2.JOB_STATE_CANCELLED})
"""States a job never leaves."""
ACTIVE = frozenset({tracker_pb2.JOB_STATE_PLANNING, tracker_pb2.JOB_STATE_DEPLOYING,
                    tracker_pb2.JOB_STATE_RUNNING, tracker_pb2.JOB_STATE_RECOVERING})
"""States in which a job holds (or is about to hold) stages on nodes."""
WAITING = tracker_pb2.JOB_STATE_WAITING
"""The job's client is gone: its stages are stopped (their snapshots kept) and it waits up to
its ``client_timeout`` for a client to resume it from its last complete checkpoint."""
CLIENT_TIMEOUT = 600.0
"""Default seconds a job waits for its client to come back (:attr:`JobSpec.client_timeout`)."""


def state_name(state: int) -> str:
    """"RUNNING" for JOB_STATE_RUNNING, and so on."""
    return tracker_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


# ---------------------------------------------------------------------------
# Replica sync

REPLICA_SYNCS = ("auto", "allreduce", "diloco")
"""How replica groups agree: the planner chooses, a per-step all-reduce, or DiLoCo outer steps."""
REBALANCE = ("auto", "never")
"""Whether the tracker may migrate a running job to a better plan (a node joined, or one is
slower than it said) at a checkpoint boundary, when the gain pays for the move."""


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
        compression: codec of the pseudo-gradients on the wire ("none" or a codec spec).

    Raises:
        SpecError: a setting out of range (a ValueError).
    """

    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"

    def __post_init__(self):
        if self.inner_steps < 1:
            raise SpecError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0) \
                or not 0 <= self.outer_momentum < 1:
            raise SpecError(f"need outer_lr > 0 and 0 <= outer_momentum < 1, got "
                            f"{self.outer_lr}, {self.outer_momentum}")
        if self.compression != "auto":
            check_compression(self.compression, "outer")


# ---------------------------------------------------------------------------
# The job's configuration

MAX_MICROBATCHES = 4096


class JobSpecError(SpecError):
    """A job setting is invalid; ``field`` names it.

    Attributes:
        field: the :class:`JobSpec` field (or submission part) that is wrong.
    """

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


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
    """

    steps: int
    microbatches: int = 1
    batch_size: int = 1
    schedule: str = "gpipe"
    optimizer: bytes = b""
    loss_fn: bytes = b""
    lr_scheduler: bytes = b""
    clip_grad_norm: float = 0.0
    stages: int = 0
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

    def validate(self, n_layers: int | None = None) -> "JobSpec":
        """Check every field; return self.

        Args:
            n_layers: the model's layer count, if known (bounds ``stages``).

        Raises:
            JobSpecError: the first invalid field, named, with its value.
        """
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise JobSpecError(name, message)

        need(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        need(1 <= self.microbatches <= MAX_MICROBATCHES, "microbatches",
             f"must be in 1..{MAX_MICROBATCHES}, got {self.microbatches}")
        need(self.batch_size >= self.microbatches, "batch_size",
             f"{self.batch_size} is smaller than microbatches {self.microbatches}")
        try:
            check_schedule(self.schedule)
        except SpecError as e:
            raise JobSpecError("schedule", str(e)) from None
        need(bool(self.optimizer), "optimizer", "the job needs an optimizer")
        need(bool(self.loss_fn), "loss_fn", "the job needs a loss function")
        need(math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0, "clip_grad_norm",
             f"must be a finite number >= 0 (0: no clipping), got {self.clip_grad_norm}")
        need(self.stages >= 0 and (n_layers is None or self.stages <= n_layers), "stages",
             f"must be between 0 and the {n_layers} layers, got {self.stages}"
             if n_layers is not None else f"must be >= 0, got {self.stages}")
        need(0 <= self.replicas <= self.microbatches, "replicas",
             f"must be between 0 and the {self.microbatches} microbatches (each group needs "
             f"one), got {self.replicas}")
        for name, carries in (("activation_compression", "activations"),
                              ("gradient_compression", "gradients")):
            try:
                check_compression(getattr(self, name), carries)  # type: ignore[arg-type]
            except SpecError as e:
                raise JobSpecError(name, str(e)) from None
        need(self.max_staleness >= 0, "max_staleness",
             f"must be >= 0, got {self.max_staleness}")
        need(self.replica_sync in REPLICA_SYNCS, "replica_sync",
             f"must be one of {list(REPLICA_SYNCS)}, got {self.replica_sync!r}")
        need(self.checkpoint_every >= 0, "checkpoint_every",
             f"must be >= 0 (0: chosen from the step time), got {self.checkpoint_every}")
        need(math.isfinite(self.client_timeout) and self.client_timeout > 0, "client_timeout",
             f"must be a finite number of seconds > 0, got {self.client_timeout}")
        need(self.rebalance in REBALANCE, "rebalance",
             f"must be one of {list(REBALANCE)}, got {self.rebalance!r}")
        need(self.min_replicas >= 0, "min_replicas",
             f"must be >= 0 (0: every loss rewinds), got {self.min_replicas}")
        need(not self.replicas or self.min_replicas <= self.replicas, "min_replicas",
             f"{self.min_replicas} is more than the {self.replicas} replica groups asked for")
        return self

    @property
    def elastic(self) -> bool:
        """Whether a lost replica group drops out instead of rewinding the job."""
        return self.min_replicas > 0

    @property
    def sync_every(self) -> int:
        """Steps between cross-group syncs: H under DiLoCo, else 1 (every step)."""
        return self.diloco.inner_steps if self.replica_sync == "diloco" else 1

    def with_(self, **changes) -> "JobSpec":
        """A copy with ``changes`` (e.g. the tracker resolving "auto")."""
        return replace(self, **changes)

    def to_proto(self) -> node_pb2.JobConfig:
        """The ``fedpipe.v1.JobConfig`` message."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "diloco"}
        o = self.diloco
        return node_pb2.JobConfig(**d, outer_every=o.inner_steps, outer_lr=o.outer_lr,
                                  outer_momentum=o.outer_momentum,
                                  outer_compression=o.compression)

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
                           msg.outer_compression or default.compression)
        except SpecError as e:
            raise JobSpecError("diloco", str(e)) from None
        return cls(steps=msg.steps, microbatches=msg.microbatches, batch_size=msg.batch_size,
                   schedule=msg.schedule, optimizer=msg.optimizer, loss_fn=msg.loss_fn,
                   lr_scheduler=msg.lr_scheduler, clip_grad_norm=msg.clip_grad_norm,
                   stages=msg.stages, replicas=msg.replicas,
                   activation_compression=msg.activation_compression or "auto",
                   gradient_compression=msg.gradient_compression or "auto",
                   max_staleness=msg.max_staleness, replica_sync=msg.replica_sync or "auto",
                   diloco=outer, checkpoint_every=msg.checkpoint_every,
                   client_timeout=msg.client_timeout or CLIENT_TIMEOUT,
                   rebalance=msg.rebalance or "auto",
                   min_replicas=msg.min_replicas)

    def summary(self) -> dict:
        """The settings as plain values (no pickles), for logs and status pages."""
        d = asdict(self)
        for k in ("optimizer", "loss_fn", "lr_scheduler"):
            d[k] = len(d[k])
        return d


# ---------------------------------------------------------------------------
# Message kinds


class Kind(enum.IntEnum):
    """What a tensor on the data plane is; values are the wire's ``fedpipe.v1.Kind``."""

    INPUT = node_pb2.KIND_INPUT
    TARGET = node_pb2.KIND_TARGET
    ACTIVATION = node_pb2.KIND_ACTIVATION
    GRADIENT = node_pb2.KIND_GRADIENT
    PROBE = node_pb2.KIND_PROBE
    REDUCE = node_pb2.KIND_REDUCE
    OUTER = node_pb2.KIND_OUTER
    NORM = node_pb2.KIND_NORM
    SNAPSHOT = node_pb2.KIND_SNAPSHOT


SNAPSHOTS_KEPT = 2
"""Checkpoint snapshots a node keeps per stage (its own, and as a buddy): the newest
complete checkpoint and the one being taken."""

PROTOCOL_VERSION = 3
"""fedpipe's wire protocol version: nodes and trackers of different versions refuse each other."""


# ---------------------------------------------------------------------------
# Plans


class StageKey(NamedTuple):
    """One stage of a plan: pipeline position ``stage`` in replica group ``replica``."""

    replica: int
    stage: int


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


# ---------------------------------------------------------------------------
# Elastic replica groups


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
    """

    step: int
    version: int
    members: tuple[int, ...]
    committed: bool = False
    dropped: bool = False
    donate_to: tuple[int, ...] = ()
