"""A stage a node holds, and its life as a state machine: one enum, one table, one move.

Life cycle of one stage (:data:`TRANSITIONS`; every move goes through
:meth:`Stage.move`, which checks the table and records the reason)::

    LOADING   -> AWAITING_WEIGHTS | RESTORING | RUNNING | STOPPED
                                                (built from its LoadStage request)
    AWAITING_WEIGHTS -> RUNNING | FAILED | STOPPED  (its initial weights, streamed by the
                                                 client: :mod:`~fedpipe.node.initial`)
    RESTORING -> RUNNING | FAILED | STOPPED      (its snapshot of resume_step)
    RUNNING   -> HELD | DONE | FAILED | STOPPED  (a report per step, a snapshot
                                                 every checkpoint_every steps)
    HELD      -> RUNNING | STOPPED               (at a hand-over cut, until it moves on)
    DONE | FAILED | STOPPED -> RELEASED          (StopJob with release, or the
                                                 tracker's drop; final)

A stage is *live* while LOADING, AWAITING_WEIGHTS, RESTORING, RUNNING or HELD: it takes tensors
and counts as running its job. It has *ended* once DONE, FAILED or STOPPED:
it takes nothing more, and is kept for its weights until released.

A stage thread and the node's calls race to end a stage (a StopJob while its
last step completes): whoever moves first wins, and the other's move, no
longer in the table, is refused (:meth:`Stage.move` with ``strict=False``
returns False and changes nothing).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch
from torch import nn

from ..proto import node_pb2
from ..runtime import checkpoint
from ..runtime.stage import StageRunnerBase
from ..spec import Kind, PlanView, StageKey
from ..wire import lowrank
from .peers import StagePeers

if TYPE_CHECKING:  # initial.py takes a Stage's slot: imported at run time it is a cycle
    from .initial import Pending

log = logging.getLogger(__name__)


class StageState(enum.Enum):
    """Where a stage is in its life (see the module docstring)."""

    # a member is equal only to itself, so identity's hash will do, and it runs in C;
    # Enum's own hashes the name in Python (:attr:`Stage.live` looks one up per tensor)
    __hash__ = object.__hash__

    LOADING = "loading"
    """Built from its LoadStage request; not stepping yet."""
    AWAITING_WEIGHTS = "awaiting weights"
    """Built on the meta device's shapes; waits for the client to stream its initial
    weights (a job whose weights never pass through the tracker)."""
    RESTORING = "restoring"
    """Its snapshot of the resume step is being loaded (on the load call, or on its
    thread for a joining replica group, which waits for its donor)."""
    RUNNING = "running"
    """Its thread steps."""
    HELD = "held"
    """Waits at a hand-over cut (a drain, a migration), its snapshot taken, until
    stopped or given a later cut."""
    DONE = "done"
    """Ran every step; kept for its weights (what ``Job.save()`` of an ended job pulls)."""
    FAILED = "failed"
    """A step, or its restore, raised; reported to the tracker."""
    STOPPED = "stopped"
    """Stopped by StopJob, the tracker's reconciliation, a newer load of its slot, or
    the node's shutdown."""
    RELEASED = "released"
    """Forgotten and its memory freed. Final."""


S = StageState
TRANSITIONS: frozenset[tuple[StageState, StageState]] = frozenset({
    (S.LOADING, S.RESTORING), (S.LOADING, S.RUNNING), (S.LOADING, S.STOPPED),
    (S.LOADING, S.AWAITING_WEIGHTS), (S.AWAITING_WEIGHTS, S.RUNNING),
    (S.AWAITING_WEIGHTS, S.FAILED), (S.AWAITING_WEIGHTS, S.STOPPED),
    (S.RESTORING, S.RUNNING), (S.RESTORING, S.FAILED), (S.RESTORING, S.STOPPED),
    (S.RUNNING, S.HELD), (S.HELD, S.RUNNING),
    (S.RUNNING, S.DONE), (S.RUNNING, S.FAILED), (S.RUNNING, S.STOPPED), (S.HELD, S.STOPPED),
    (S.DONE, S.RELEASED), (S.FAILED, S.RELEASED), (S.STOPPED, S.RELEASED),
})
"""Every allowed move ``(from, to)`` of a stage; no other is made."""
LIVE = frozenset({S.LOADING, S.AWAITING_WEIGHTS, S.RESTORING, S.RUNNING, S.HELD})
"""States in which a stage takes tensors and counts as running its job."""
ENDED = frozenset({S.DONE, S.FAILED, S.STOPPED, S.RELEASED})
"""States after which a stage steps no more."""


class IllegalTransition(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow: a bug in the node, never a caller's error."""


class Transition(NamedTuple):
    """One move of a stage, as :meth:`Stage.move` records it (``at``: time.time(), s)."""

    before: StageState
    after: StageState
    reason: str
    at: float


class StageSlot(NamedTuple):
    """A stage of a job on this node: the key of the registry and the mailbox."""

    job_id: str
    replica: int
    stage: int

    @property
    def key(self) -> StageKey:
        return StageKey(self.replica, self.stage)


@dataclass(eq=False)
class Stage:
    """A loaded stage: its layers, runner, peers and thread, and its :class:`StageState`."""

    slot: StageSlot
    n_stages: int
    layer_start: int
    module: nn.Sequential
    steps: int
    peers: StagePeers
    runner: StageRunnerBase | None = None
    thread: threading.Thread | None = None
    epoch: int = 0
    start: int = 0
    checkpoint_every: int = 0
    plan: PlanView | None = None
    parts: dict[str, checkpoint.Checkpointable | None] = field(default_factory=dict)
    """What a checkpoint snapshots: module, optimizer, LR schedule, DiLoCo outer state,
    the lowrank codecs' bases (``"codec"``: :attr:`subspace`), gradient error feedback."""
    subspace: lowrank.Subspace | None = None
    """The lowrank codecs' state of its stage boundaries, at both its links (None: its
    job's pipeline uses no lowrank codec); its ``"codec"`` part."""
    pending: Pending | None = None
    """Its layers waiting for the client's stream of their initial weights (None: it has
    them, or restores a snapshot)."""
    done: int = 0
    """Steps done (the stage's step boundary it last crossed)."""
    hold_at: int = 0
    """A hand-over cut (a drain or a migration): after this many steps the stage
    snapshots and waits there until stopped or moved to a later cut (0: none)."""
    state: StageState = StageState.LOADING
    """Where it is in its life; changed only by :meth:`move`."""
    history: list[Transition] = field(default_factory=list)
    """Every move it made, oldest first."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ended: threading.Event = field(default_factory=threading.Event, repr=False)

    def move(self, to: StageState, reason: str, *, strict: bool = True) -> bool:
        """Move to ``to`` if :data:`TRANSITIONS` allows it from the current state, and
        record ``reason``. Returns whether it moved.

        Raises:
            IllegalTransition: the table does not allow it and ``strict`` (with
                ``strict=False`` a refused move returns False: a race lost to another
                thread that ended the stage first).
        """
        with self._lock:
            before = self.state
            if (before, to) not in TRANSITIONS:
                if strict:
                    raise IllegalTransition(f"stage {tuple(self.slot)} cannot go from "
                                            f"{before.name} to {to.name} ({reason})")
                return False
            self.state = to
            self.history.append(Transition(before, to, reason, time.time()))
            if to in ENDED:
                self._ended.set()
        log.debug("job %s stage %d (replica %d): %s -> %s: %s", self.slot.job_id,
                  self.slot.stage, self.slot.replica, before.name, to.name, reason)
        return True

    def codec_end(self, env: node_pb2.Envelope, sending: bool = False) -> lowrank.End | None:
        """The stage's end of the link the pipeline tensor of ``env`` crosses, to this
        stage or (``sending``) from it, for a stateful codec; None without
        :attr:`subspace` or for any other kind of tensor.

        Both ends name a link by the boundary it crosses, ``boundary/<b>`` between stages
        b and b + 1 (``env.stage`` is the tensor's destination); an activation sent times
        the basis' refreshes by its step (:class:`~fedpipe.wire.lowrank.End`).
        """
        if self.subspace is None or env.kind not in (Kind.ACTIVATION, Kind.GRADIENT):
            return None
        forward = env.kind == Kind.ACTIVATION
        return lowrank.End(self.subspace, f"boundary/{env.stage - 1 if forward else env.stage}",
                           env.step if sending and forward else None)

    @property
    def live(self) -> bool:
        """Whether it takes tensors and runs its job (:data:`LIVE`)."""
        return self.state in LIVE

    def wait_ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for it to end; whether it has."""
        return self._ended.wait(timeout)

    @property
    def job_id(self) -> str:
        return self.slot.job_id

    @property
    def key(self) -> StageKey:
        return self.slot.key

    @property
    def inbox(self) -> tuple[StageSlot, int]:
        """The stage's key in the node's mailbox: its slot and plan epoch, so a tensor of
        an older epoch can never be taken by the stage that replaced it."""
        return (self.slot, self.epoch)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stage's state, named as in the whole model (``"<global layer>.<name>"``)."""
        for name, t in self.module.state_dict().items():
            idx, _, rest = name.partition(".")
            yield f"{self.layer_start + int(idx)}.{rest}", t
