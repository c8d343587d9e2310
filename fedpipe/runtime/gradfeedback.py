"""A stage's gradient error feedback as a checkpoint part, so a recovery, drain or
migration resumes with the residuals an uninterrupted job would have.

A stage sends the gradient of its input to the stage before it; under a lossy
gradient codec (``topk``, ``int8``, ...) the sender keeps what the codec dropped and
adds it to the next gradient of the same slot (:class:`~fedpipe.wire.feedback.ErrorFeedback`,
keyed by the node's senders as ``(receiving stage, microbatch, shape)``,
:func:`fedpipe.node.peers.encode`). That residual is state of the training as much as
the optimizer's moments: started afresh, the replayed steps send other gradients than
the uninterrupted job did. :class:`GradientFeedbackPart` is the :data:`FEEDBACK` part
of a stage's snapshot (:mod:`~fedpipe.runtime.checkpoint`).

Its ``state_dict()`` is ``{"boundary": L, "replica": g, "residuals": [[microbatch,
[dims...], residual], ...]}``: ``L`` is the global layer whose input the gradients are
the gradient of (the stage's first layer: the boundary does not depend on how the
stages are numbered), ``g`` the replica group, and each residual float32 (float64 for
float64 gradients), shaped like the gradient of that microbatch. It is read at the step
boundary the snapshot is taken at, after the senders encoded every gradient of the
step (``settle``), so it is the residual consistent with the snapshot's step.

Loading keys the residuals again as the senders key them, with this stage's receiving
stage; state of another boundary or replica group (a joining group restored from a
donor's snapshot) is not this link's and is dropped: the residuals start afresh.
In a layer-form snapshot (:mod:`~fedpipe.runtime.layerstate`) the residuals travel with
the boundary layer (``layer/<L>``), so a re-split that keeps a boundary keeps them.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from ..wire.feedback import ErrorFeedback
from .checkpoint import FEEDBACK

log = logging.getLogger(__name__)

__all__ = ["FEEDBACK", "GradientFeedbackPart", "residual_entries"]


class GradientFeedbackPart:
    """The :data:`FEEDBACK` part of a stage: its senders' gradient error feedback.

    Args:
        feedback: the residuals the stage's senders encode gradients with (shared by
            all of them: :attr:`fedpipe.node.peers.StagePeers.feedback`).
        settle: waits until every gradient submitted so far has been encoded (the
            senders encode on threads of their own), so the residuals are those of
            the step boundary.
        boundary: the stage's first global layer.
        replica: its replica group.
        receiver: the stage its gradients go to (``stage - 1``; -1 for a first stage,
            which sends none).
    """

    def __init__(self, feedback: ErrorFeedback, settle: Callable[[], None], boundary: int,
                 replica: int, receiver: int):
        self.feedback, self.settle = feedback, settle
        self.boundary, self.replica, self.receiver = boundary, replica, receiver

    def state_dict(self) -> dict[str, Any]:
        """The residuals at this step boundary (copies; see the module docstring)."""
        self.settle()
        residuals = []
        for key, r in self.feedback.state_dict()["residuals"]:
            if not isinstance(key, tuple) or len(key) != 3:
                continue  # not a gradient slot of fedpipe.node.peers.encode's
            stage, microbatch, shape = key  # as fedpipe.node.peers.encode keys them
            if stage == self.receiver:
                residuals.append([int(microbatch), [int(d) for d in shape], r])
        residuals.sort(key=lambda e: (e[0], e[1]))
        return {"boundary": self.boundary, "replica": self.replica, "residuals": residuals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the residuals with ``state``'s (none if it is of another boundary or
        replica group: see the module docstring).

        Raises:
            ValueError: a residual whose shape is not the one its entry names.
        """
        self.feedback.reset()
        if not state.get("residuals"):
            return
        if state.get("boundary") != self.boundary or state.get("replica") != self.replica:
            log.info("gradient error feedback of boundary %s (group %s) is not this stage's "
                     "(boundary %d, group %d): its residuals start afresh",
                     state.get("boundary"), state.get("replica"), self.boundary, self.replica)
            return
        for microbatch, shape, r in residual_entries(state):
            self.feedback.remember((self.receiver, microbatch, shape), r.clone())


def residual_entries(state: Mapping[str, Any]) -> list[tuple[int, tuple[int, ...], torch.Tensor]]:
    """``state``'s residuals as ``(microbatch, shape, residual)``.

    Raises:
        ValueError: an entry that is not ``[microbatch, [dims...], tensor]``, or a
            residual whose shape is not the one its entry names.
    """
    out = []
    for entry in state.get("residuals", []):
        try:
            microbatch, dims, r = entry
            shape = tuple(int(d) for d in dims)
        except (TypeError, ValueError):
            raise ValueError(f"gradient error feedback: a residual entry is not [microbatch, "
                             f"[dims...], tensor]: {type(entry).__name__}") from None
        if not isinstance(r, torch.Tensor) or tuple(r.shape) != shape:
            raise ValueError(f"gradient error feedback: the residual of microbatch "
                             f"{microbatch} is not a tensor of shape {list(shape)}")
        out.append((int(microbatch), shape, r))
    return out
