"""Error feedback for lossy gradient codecs: what a codec drops is sent later, not lost."""
from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch


class ErrorFeedback:
    """Residual memory for lossy gradient compression ("error feedback").

    Before a tensor is encoded, the residual stored under its key is added to
    it; after encoding, the new residual ``t + residual - sent`` is stored,
    where ``sent`` is exactly what the receiver will decode. So what a codec
    drops is delayed, not lost: over steps, ``sum(sent) + residual ==
    sum(inputs)`` up to float32 rounding. Residuals are float32 (float64 for
    float64 tensors), on the tensor's device, shaped like the tensor.

    Source: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory" (NeurIPS
    2018); Lin et al., "Deep Gradient Compression" (ICLR 2018); it works for
    any lossy codec (Karimireddy et al., "Error Feedback Fixes SignSGD", 2019).

    With ``decay`` β < 1 the residual is scaled by β before the next tensor is
    added (``e ← β·e + t``, send ``C(e)``, keep ``e - C(e)``): SparseLoCo's
    error feedback, where the decayed accumulator stands in for DiLoCo's outer
    momentum (Sarfi et al., "Communication Efficient LLM Pre-training with
    SparseLoCo", 2025). Then ``sum(sent)`` no longer tracks ``sum(inputs)``.

    Use one key per link and tensor slot, e.g. ``(peer, "grad", stage, slot)``.
    Not locked: one key must not be encoded from two threads at once.

    Args:
        decay: β in (0, 1]: the factor on the residual before it is added (1: plain
            error feedback).

    Raises:
        ValueError: ``decay`` outside (0, 1].
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual stored under ``key`` (not yet sent), or None."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key``, or all residuals when ``key`` is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def __len__(self) -> int:
        return len(self._residuals)

    def _compensate(self, key: Hashable, t: torch.Tensor) -> torch.Tensor:
        """``t`` plus ``decay`` × the residual stored under ``key``, flat, in float32 or wider.

        Raises:
            ValueError: the key holds a residual of another shape (a reused key).
        """
        acc = t.reshape(-1).to(torch.promote_types(t.dtype, torch.float32), copy=True)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != t.shape:
                raise ValueError(f"error feedback key {key!r} holds a residual of shape "
                                 f"{list(residual.shape)}, the tensor has shape {list(t.shape)}; "
                                 f"use one key per tensor slot or reset() it")
            if self.decay == 1:
                acc += residual.reshape(-1).to(acc)
            else:
                acc.add_(residual.reshape(-1).to(acc), alpha=self.decay)
        return acc

    def state_dict(self) -> dict[str, list[tuple[Hashable, torch.Tensor]]]:
        """Every residual, as ``{"residuals": [(key, residual), ...]}`` (keys of plain data:
        strings, numbers, tuples of them, as a checkpoint carries them)."""
        return {"residuals": [(k, r.clone()) for k, r in self._residuals.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace every residual with a :meth:`state_dict`'s."""
        self._residuals = {k: r.clone() for k, r in state["residuals"]}

    def remember(self, key: Hashable, residual: torch.Tensor) -> None:
        """Store ``residual`` under ``key`` (what encoding leaves over; or a checkpoint's)."""
        self._residuals[key] = residual
