"""Gradient clipping by global norm, exact across the stages of a pipeline.

Clipping by norm (Pascanu, Mikolov & Bengio, "On the difficulty of training
recurrent neural networks", ICML 2013, Algorithm 1) rescales the gradient
``g`` of *all* the model's parameters when its L2 norm exceeds a threshold.
In a pipeline each stage holds only part of ``g``, so the norm is assembled
from the parts: stage ``s`` computes ``S_s = Σ_p ||g_p||²`` over its own
parameters ``p``, sends ``S_s`` to every other stage of its replica group
(a :data:`fedpipe.spec.Kind.NORM` message, tag = sender stage) and sums the
``S`` of all stages in stage order, so every stage gets the same bits
``||g|| = sqrt(Σ_s S_s)``. Then each stage scales its own gradients by::

    min(1, max_norm / (||g|| + 1e-6))

which is what :func:`torch.nn.utils.clip_grad_norm_` (``norm_type=2``,
``error_if_nonfinite=False``) does to the whole model in one process: the
per-tensor norms are those of :func:`torch.linalg.vector_norm`, the factor
is clamped at 1 and also applied when it is 1 (a no-op). The sum of squares
travels and is added in float64, so the result matches single-process
clipping up to float32 rounding of the norm (relative ~1e-7). A non-finite
norm is not an error, as in torch: the gradients become NaN (or zero when
the norm is inf and the gradients finite).

Where it runs (:class:`~fedpipe.runtime.stage.StageRunner`, ``clip``): after
the step's backward passes and after ``grad_sync``, just before the optimizer
step. So:

- under all-reduce (several replica groups, :class:`~fedpipe.runtime.
  allreduce.GradientSync`) the norm is that of the *full batch's* gradient,
  which every group holds identically after the sync; every group computes
  the same norm and clips the same way, as one process would on the full
  batch;
- under DiLoCo each group clips its own inner gradient (that of its shard's
  mean loss, after :meth:`~fedpipe.runtime.diloco.OuterSync.rescale_gradients`),
  as each DiLoCo replica is a model of its own between outer steps;
- under the async schedule each step's accumulated gradient is clipped when
  the stage applies it; stages wait for each other's norm of that step only.

Cost: ``n_stages - 1`` scalar messages sent and received per stage and step.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Protocol

import torch

from .. import spec

NORM = spec.Kind.NORM
"""The transport kind of squared-norm messages (``KIND_NORM`` on the wire)."""


class PeerTransport(Protocol):
    """What :class:`GlobalNormClip` needs of a stage's transport: send to any
    stage of the plan, and receive what was sent to this stage."""

    def send_to(self, peer: Any, kind: Any, step: int, tag: int,
                tensor: torch.Tensor) -> None:
        """Queue ``tensor`` for stage ``peer``; may return before it is delivered."""

    def recv(self, kind: Any, step: int, microbatch: int) -> tuple[torch.Tensor, int]:
        """Block until the tensor sent to this stage with that key arrives."""


def squared_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """``Σ_p ||p.grad||²`` over the parameters that have a gradient, in float64.

    Each tensor's norm is :func:`torch.linalg.vector_norm` of its gradient, as
    in :func:`torch.nn.utils.clip_grad_norm_`; 0.0 when no parameter has one.
    """
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in params if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.stack([n.to(torch.float64) for n in norms]).square().sum())


def scale_gradients(params: Iterable[torch.nn.Parameter], max_norm: float,
                    total_norm: float) -> float:
    """Multiply every gradient by ``min(1, max_norm / (total_norm + 1e-6))``; return that factor.

    As :func:`torch.nn.utils.clip_grad_norm_` applies it: in place, also when
    it is 1, to the parameters that have a gradient.
    """
    coef = min(1.0, max_norm / (total_norm + 1e-6)) if not math.isnan(total_norm) else math.nan
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(torch.tensor(coef, dtype=p.grad.dtype, device=p.grad.device))
    return coef


class GlobalNormClip:
    """Clips a stage's gradients by the L2 norm of the whole pipeline's gradients.

    Called as ``clip(step)`` by the stage runner after the gradient sync and
    before the optimizer step (see the module docstring for the maths, where
    it runs, and how it matches :func:`torch.nn.utils.clip_grad_norm_`).
    Every stage of the replica group must run one, with the same
    ``max_norm``, including stages without parameters (they contribute 0).

    Args:
        params: the stage's trainable parameters.
        max_norm: the largest global L2 norm allowed, in the gradients' own
            units (those of the loss per parameter unit); > 0.
        stage: this stage's index in its replica group.
        peers: the group's *other* stages: stage index -> what
            ``transport.send_to`` takes to reach it.
        transport: sends and receives :data:`NORM` messages (float64 scalars).

    Attributes:
        last_norm: the global norm of the last step, before clipping.
        last_scale: the factor the gradients were multiplied by (<= 1).

    Raises:
        ValueError: ``max_norm`` is not a finite number > 0, or ``peers``
            holds this stage itself or a negative stage index.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], max_norm: float, stage: int,
                 peers: Mapping[int, Any], transport: PeerTransport):
        if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
        if stage in peers or any(s < 0 for s in peers):
            raise ValueError(f"peers must be the other stages of the group (not stage {stage}), "
                             f"got {sorted(peers)}")
        self.params = list(params)
        self.max_norm, self.stage = float(max_norm), stage
        self.peers, self.transport = dict(peers), transport
        self.last_norm = self.last_scale = math.nan

    def __call__(self, step: int) -> None:
        """Exchange squared norms for ``step``, then clip this stage's gradients in place.

        Raises:
            whatever ``transport`` raises (e.g. StageError when a peer is gone).
        """
        own = squared_norm(self.params)
        message = torch.tensor(own, dtype=torch.float64)
        for peer in self.peers.values():
            self.transport.send_to(peer, NORM, step, self.stage, message)
        parts = {self.stage: own}
        for s in self.peers:
            parts[s] = float(self.transport.recv(NORM, step, s)[0])
        # every stage adds the same numbers in the same order: the same bits everywhere
        total = math.sqrt(sum(parts[s] for s in sorted(parts)))
        self.last_norm = total
        self.last_scale = scale_gradients(self.params, self.max_norm, total)
