"""What a user asks for at submit, grouped as users think of it (``fedpipe.Client.submit``):
:class:`Training`, :class:`Compression`, :class:`Replicas`, :class:`Placement`,
:class:`Lifetime`, gathered into :class:`Knobs`, which makes the :class:`JobSpec`."""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping

from .cuts import cuts_problem
from .errors import JobSpecError
from .jobspec import MICROBATCHES, SCHEDULE, JobSpec, check_field
from .replicas import DiLoCo
from .states import CLIENT_TIMEOUT


_KINDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "int": ("an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    "number": ("a number (int or float)",
               lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    "str": ("a str", lambda v: isinstance(v, str)),
}
"""Each knob type: how a message names it, and its test (a bool is neither an int nor a
number, though Python counts it as one; numpy's ints and floats are)."""


def _check_types(group: object, kinds: Mapping[str, tuple[str, str]]) -> None:
    """Check the type of each of ``group``'s fields named in ``kinds`` (field -> (its
    ``submit`` keyword, a kind of :data:`_KINDS`)).

    Raises:
        TypeError: the first field of the wrong type, named by its keyword and its group's
            field, with the type expected and the value given.
    """
    for attr, (keyword, kind) in kinds.items():
        value = getattr(group, attr)
        expected, test = _KINDS[kind]
        if not test(value):
            raise TypeError(f"{keyword} ({type(group).__name__}.{attr}) must be {expected}, "
                            f"got {type(value).__name__} {value!r}")


def _check_fields(group: object, names: Mapping[str, str]) -> None:
    """Check each of ``group``'s fields named in ``names`` (field -> its rule's name)."""
    for attr, rule in names.items():
        check_field(rule, getattr(group, attr))


@dataclass(frozen=True)
class Training:
    """How each step trains: ``submit(..., training=Training(...))``.

    Attributes:
        microbatches: each batch is split into this many along dim 0.
        schedule: one of :data:`SCHEDULES`: "gpipe" or "1f1b" (synchronous), or
            "async" (PipeDream-style, no flush, weight stashing).
        max_staleness: async only: weight versions a stage may run ahead of the
            versions its gradients come back for (0 equals "1f1b").
        lr_scheduler: a ``fedpipe.LRSchedulerSpec`` (from :func:`fedpipe.lr_scheduler`),
            built over each stage's optimizer and stepped after each optimizer step;
            None for none. (Typed ``object`` here: this module does not import torch;
            the client checks its type.)
        clip_grad_norm: clip the gradients to this global L2 norm before each
            optimizer step; 0: no clipping.
        checkpoint_every: steps between checkpoints; 0: the tracker picks it so that
            a recovery recomputes about 30 s of training.
        recompute: activation recomputation: False; True: every stage keeps only its
            inputs per microbatch in flight and re-runs its forward in backward (one
            more forward per backward; weights equal to no recomputation); "auto": the
            planner turns it on for the stages that would not fit otherwise.
        precision: "fp32", or "bf16-mixed": each stage's forward runs under
            ``torch.autocast`` to bfloat16 (activations between stages travel in
            bfloat16); weights, gradients, optimizer state and the loss stay float32.
    """

    microbatches: int = MICROBATCHES
    schedule: str = SCHEDULE
    max_staleness: int = 1
    lr_scheduler: object | None = None
    clip_grad_norm: float = 0.0
    checkpoint_every: int = 0
    recompute: bool | str = False
    precision: str = "fp32"

    _RULES = {"microbatches": "microbatches", "schedule": "schedule",
              "max_staleness": "max_staleness", "clip_grad_norm": "clip_grad_norm",
              "checkpoint_every": "checkpoint_every", "recompute_mode": "recompute",
              "precision": "precision"}

    @property
    def recompute_mode(self) -> str:
        """``recompute`` as the job spec names it: "off", "on" or "auto"
        (:data:`~fedpipe.spec.jobspec.RECOMPUTE`)."""
        if self.recompute is True or self.recompute is False:
            return "on" if self.recompute else "off"
        return self.recompute if self.recompute == "auto" else repr(self.recompute)

    def validate(self) -> "Training":
        """Check every field; return self.

        Raises:
            TypeError: a field of the wrong type, or an ``lr_scheduler`` not made by
                ``fedpipe.lr_scheduler`` (each named, with the type expected).
            JobSpecError: the first invalid field (named by its ``submit`` keyword).
        """
        _check_types(self, {"microbatches": ("microbatches", "int"),
                            "schedule": ("schedule", "str"),
                            "max_staleness": ("max_staleness", "int"),
                            "clip_grad_norm": ("clip_grad_norm", "number"),
                            "checkpoint_every": ("checkpoint_every", "int"),
                            "precision": ("precision", "str")})
        if not (isinstance(self.recompute, bool) or self.recompute == "auto"):
            raise JobSpecError("recompute", f"must be True, False or \"auto\", got "
                                            f"{type(self.recompute).__name__} "
                                            f"{self.recompute!r}")
        if self.lr_scheduler is not None:
            # only a torch user has one: importing its type here costs nothing more
            from ..runtime.optim import LRSchedulerSpec

            if not isinstance(self.lr_scheduler, LRSchedulerSpec):
                raise TypeError(f"lr_scheduler must come from fedpipe.lr_scheduler(torch.optim"
                                f".lr_scheduler.X, ...) (a fedpipe.LRSchedulerSpec) or be "
                                f"None, got {type(self.lr_scheduler).__name__} "
                                f"{self.lr_scheduler!r}")
        _check_fields(self, self._RULES)
        return self


@dataclass(frozen=True)
class Compression:
    """Codecs on the links between stages: ``submit(..., compression=Compression(...))``.

    Attributes:
        activations: "auto" (the planner picks each link's codec from its bandwidth),
            "none", or a codec spec such as "int8+zstd" (:func:`parse_codec`).
        gradients: the same for gradients; a gradients-only codec (top-k) is allowed.
    """

    activations: str = "auto"
    gradients: str = "auto"

    @classmethod
    def of(cls, setting: "str | Mapping[str, str] | Compression") -> "Compression":
        """The group for ``submit``'s ``compression``: a group, one setting for both, or a
        dict ``{"activations": ..., "gradients": ...}``.

        Raises:
            JobSpecError: a dict with other keys.
        """
        if isinstance(setting, Compression):
            return setting
        if isinstance(setting, str):
            return cls(setting, setting)
        unknown = set(setting) - {"activations", "gradients"}
        if unknown:
            raise JobSpecError("compression", f"keys must be 'activations' and 'gradients', "
                                              f"got {sorted(unknown)}")
        return cls(setting.get("activations", "auto"), setting.get("gradients", "auto"))

    def validate(self) -> "Compression":
        """Check both settings; return self.

        Raises:
            TypeError: a setting that is not a str (named).
            JobSpecError: a bad codec spec, or a gradients-only codec for activations.
        """
        _check_types(self, {"activations": ("activation_compression", "str"),
                            "gradients": ("gradient_compression", "str")})
        _check_fields(self, {"activations": "activation_compression",
                             "gradients": "gradient_compression"})
        return self


@dataclass(frozen=True)
class Replicas:
    """Data-parallel replica groups: ``submit(..., replicas=Replicas(...))``.

    Attributes:
        groups: replica groups (0: the planner chooses); ``submit``'s ``replicas=N``.
        sync: how the groups agree: "allreduce" (gradients summed every step),
            "diloco" or a :class:`DiLoCo` (outer steps every H inner steps), or "auto"
            (the plan picks from the links between groups); ``replica_sync``.
        min_groups: elastic groups: while this many are live, a lost node drops only
            its group; below it the job rewinds; 0: every loss rewinds;
            ``min_replicas``.
    """

    groups: int = 0
    sync: "str | DiLoCo" = "auto"
    min_groups: int = 0

    def validate(self) -> "Replicas":
        """Check every field; return self.

        Raises:
            TypeError: ``sync`` neither a string nor a :class:`DiLoCo`, or ``groups`` or
                ``min_groups`` not an int (named).
            JobSpecError: the first invalid field (named by its ``submit`` keyword).
        """
        _check_types(self, {"groups": ("replicas", "int"),
                            "min_groups": ("min_replicas", "int")})
        if not isinstance(self.sync, (str, DiLoCo)):
            raise TypeError(f"replica_sync must be a string or fedpipe.DiLoCo, got "
                            f"{type(self.sync).__name__}")
        _check_fields(self, {"groups": "replicas", "sync_name": "replica_sync",
                             "min_groups": "min_replicas"})
        return self  # min_groups against groups: JobSpec.validate

    @property
    def sync_name(self) -> str:
        """The sync's name, one of :data:`REPLICA_SYNCS`."""
        return "diloco" if isinstance(self.sync, DiLoCo) else self.sync

    @property
    def diloco(self) -> DiLoCo:
        """The DiLoCo settings (the defaults unless ``sync`` is a :class:`DiLoCo`)."""
        return self.sync if isinstance(self.sync, DiLoCo) else DiLoCo()


@dataclass(frozen=True)
class Placement:
    """Where the job runs: ``submit(..., placement=Placement(...))``.

    Attributes:
        stages: pipeline depth (0: the planner chooses from the nodes' speeds and links).
        rebalance: "auto": the tracker may move stages to a better plan at a step
            boundary when the predicted gain pays for moving the state; "never": only
            drains and losses move stages.
        cuts: pinned stage boundaries, as ``torch.distributed.pipelining``'s split points:
            the index of the model's top-level child at which each stage but the first
            begins (so stage ``i`` ends just before child ``cuts[i]``), ``stages - 1`` of
            them, strictly increasing, each in ``1 .. n_layers - 1``. ``Placement(stages=4,
            cuts=(2, 3, 4))`` over 6 children gives every replica group the layer ranges
            ``(0, 2), (2, 3), (3, 4), (4, 6)`` in every plan: the first, re-plans after a
            loss or drain, and rebalances (which may move stages between nodes, never the
            cuts). ``()``: the planner splits the layers (:mod:`fedpipe.spec.cuts`). A list
            is taken as a tuple.
    """

    stages: int = 0
    rebalance: str = "auto"
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.cuts, list):
            object.__setattr__(self, "cuts", tuple(self.cuts))

    def validate(self) -> "Placement":
        """Check every field; return self.

        Raises:
            TypeError: a field of the wrong type (named, with the type expected).
            JobSpecError: the first invalid field; ``cuts`` of the wrong length for
                ``stages``, not increasing, or below 1 (against the model's layer count
                when the client knows it: :meth:`JobSpec.validate`).
        """
        _check_types(self, {"stages": ("stages", "int"), "rebalance": ("rebalance", "str")})
        if not isinstance(self.cuts, tuple):
            raise TypeError(f"cuts (Placement.cuts) must be a tuple of ints, got "
                            f"{type(self.cuts).__name__} {self.cuts!r}")
        _check_fields(self, {"stages": "stages", "rebalance": "rebalance"})
        problem = cuts_problem(self.cuts, self.stages)
        if problem is not None:
            raise JobSpecError("cuts", problem)
        return self


@dataclass(frozen=True)
class Lifetime:
    """How long the job waits: ``submit(..., lifetime=Lifetime(...))``.

    Attributes:
        pending_timeout: fail the job if no node takes it within this many seconds
            (0: no limit).
        client_timeout: seconds the job waits for a client once its client is gone
            (WAITING, "waiting for the client"); then it fails.
    """

    pending_timeout: float = 0.0
    client_timeout: float = CLIENT_TIMEOUT

    def validate(self) -> "Lifetime":
        """Check every field; return self.

        Raises:
            TypeError: a field that is not a number (named).
            JobSpecError: the first invalid field.
        """
        _check_types(self, {"pending_timeout": ("pending_timeout", "number"),
                            "client_timeout": ("client_timeout", "number")})
        _check_fields(self, {"pending_timeout": "pending_timeout",
                             "client_timeout": "client_timeout"})
        return self


Group = Training | Compression | Replicas | Placement | Lifetime
GROUPS: dict[str, type[Group]] = {"training": Training, "compression": Compression,
                                  "replicas": Replicas, "placement": Placement,
                                  "lifetime": Lifetime}
"""``submit``'s grouped keywords and their types."""
FLAT_KNOBS: dict[str, tuple[str, str]] = {
    "microbatches": ("training", "microbatches"), "schedule": ("training", "schedule"),
    "max_staleness": ("training", "max_staleness"),
    "lr_scheduler": ("training", "lr_scheduler"),
    "clip_grad_norm": ("training", "clip_grad_norm"),
    "checkpoint_every": ("training", "checkpoint_every"),
    "recompute": ("training", "recompute"), "precision": ("training", "precision"),
    "replica_sync": ("replicas", "sync"), "min_replicas": ("replicas", "min_groups"),
    "stages": ("placement", "stages"), "rebalance": ("placement", "rebalance"),
    "pending_timeout": ("lifetime", "pending_timeout"),
    "client_timeout": ("lifetime", "client_timeout"),
}
"""``submit``'s flat keywords (as before the groups) -> (group, field). ``replicas=N`` and
``compression="..."`` are the flat forms of their groups' keywords themselves."""


@dataclass(frozen=True)
class Knobs:
    """Every training knob of a submission, by group (:data:`GROUPS`)."""

    training: Training = field(default_factory=Training)
    compression: Compression = field(default_factory=Compression)
    replicas: Replicas = field(default_factory=Replicas)
    placement: Placement = field(default_factory=Placement)
    lifetime: Lifetime = field(default_factory=Lifetime)

    @classmethod
    def gather(cls, groups: Mapping[str, object], flat: Mapping[str, Any]) -> "Knobs":
        """The knobs from ``submit``'s group keywords and flat ones, validated.

        Args:
            groups: group keyword -> a group, its flat form (``replicas=2``,
                ``compression="int8"``) or None (not given).
            flat: the flat keywords given (:data:`FLAT_KNOBS`).

        Raises:
            TypeError: an unknown keyword, a group of the wrong type, or a knob given
                twice: in its group and as a flat keyword.
            JobSpecError: a knob out of range (``field`` names it).
        """
        given: dict[str, Group] = {}
        changes: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for name, value in groups.items():
            if value is not None:
                group, settings = _group(name, value)
                if group is not None:
                    given[name] = group
                changes[name].update(settings)
        for key, value in flat.items():
            if key not in FLAT_KNOBS:
                raise TypeError(f"submit() got an unexpected keyword argument {key!r}")
            name, attr = FLAT_KNOBS[key]
            if name in given:
                kind = GROUPS[name].__name__
                raise TypeError(f"{key}= sets {kind}.{attr}, and {name}= is given too: "
                                f"pass {key} once, in {kind}({attr}=...)")
            changes[name][attr] = value
        made = {name: replace(given.get(name) or kind(), **changes[name]).validate()
                for name, kind in GROUPS.items()}
        return cls(**made)  # type: ignore[arg-type]  # made maps each field to its type

    def job_spec(self, *, steps: int, optimizer: bytes, loss_fn: bytes,
                 lr_scheduler: bytes = b"", batch_size: int | None = None,
                 optimizer_kind: str = "") -> JobSpec:
        """The :class:`JobSpec` of these knobs (not validated: call ``validate``)."""
        t, r = self.training, self.replicas
        return JobSpec(steps=steps, microbatches=t.microbatches, schedule=t.schedule,
                       optimizer=optimizer, loss_fn=loss_fn, lr_scheduler=lr_scheduler,
                       optimizer_kind=optimizer_kind,
                       activation_compression=self.compression.activations,
                       gradient_compression=self.compression.gradients,
                       stages=self.placement.stages, cuts=self.placement.cuts,
                       replicas=r.groups,
                       max_staleness=t.max_staleness, replica_sync=r.sync_name,
                       diloco=r.diloco, clip_grad_norm=t.clip_grad_norm,
                       checkpoint_every=t.checkpoint_every,
                       client_timeout=self.lifetime.client_timeout,
                       rebalance=self.placement.rebalance, min_replicas=r.min_groups,
                       batch_size=t.microbatches if batch_size is None else batch_size,
                       recompute=t.recompute_mode, precision=t.precision)


def _group(name: str, value: object) -> tuple[Group | None, dict[str, Any]]:
    """``value`` given for group keyword ``name``: (the group, {}) or, for its flat form
    (``replicas=2``, ``compression="int8"``), (None, the fields it sets).

    Raises:
        TypeError: an unknown group keyword, or a value of the wrong type.
        JobSpecError: a bad flat ``compression`` dict.
    """
    kind = GROUPS.get(name)
    if kind is None:
        raise TypeError(f"submit() got an unexpected keyword argument {name!r}")
    if isinstance(value, kind):
        return value, {}
    if name == "replicas" and isinstance(value, int) and not isinstance(value, bool):
        return None, {"groups": value}
    if name == "compression" and isinstance(value, (str, dict)):
        return None, asdict(Compression.of(value))
    raise TypeError(f"{name}= must be a fedpipe.{kind.__name__}"
                    f"{' or an int' if name == 'replicas' else ''}"
                    f"{' or a str or dict' if name == 'compression' else ''}, "
                    f"got {type(value).__name__}")
