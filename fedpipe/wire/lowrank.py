"""The lowrank codecs' maths and state: a basis per stage boundary, held by both ends.

An activation ``X`` of shape ``(..., d)`` is sent as its coefficients ``C = X·P``
(``R`` values per row of ``d``) in an orthonormal basis ``P`` (``d × R``) that
both ends of the link hold; the receiver rebuilds ``X̂ = C·Pᵀ``, the projection
of ``X`` onto the subspace. ``P`` is the top-``R`` principal directions of the
activations the sender sends: made from the first message of a step (at most
:data:`SAMPLE_ROWS` of its rows; the eigenvectors of ``XᵀX`` in float64, each
column's sign fixed so that its largest entry is positive), so the same data give
the same basis, bit for bit, and a replayed job makes the bases the original did.
It is refreshed every ``N`` steps (the spec's ``@N``) and carried in the message
only when it changed (the header's ``basis`` flag; ``basis_version`` names the
basis every message's coefficients use, so a receiver can tell it holds it).

The gradients go back the other way in the same subspace: the gradient sender
(the activations' receiver) projects ``G`` onto the ``P`` it received, and the
gradient receiver (which made ``P``) rebuilds ``Ĝ = (G·P)·Pᵀ``. Through the
projection the forward pass applied, ``G·P·Pᵀ`` is the exact gradient of the
compressed model with respect to its input; with error feedback
(:class:`~fedpipe.wire.feedback.ErrorFeedback`) the part outside the subspace is
kept and sent later, once a refreshed basis can carry it.

The state (:class:`Subspace`) is a stage's, one basis per link key, and is part
of the stage's checkpoint (``state_dict`` / ``load_state_dict``). A restored
sender carries each basis again in its next message, so a receiver that lost or
never had it (a replacement, a migrated stage) gets it; the values decoded do
not change, so a recovered job stays equal to an uninterrupted one.

This is the idea of subspace activation compression (Ramasinghe et al.,
"Protocol Models: Scaling Decentralized Training with Communication-Efficient
Model Parallelism", 2025: a fixed shared subspace; Janson et al., "Learned
Subspace Compression for Communication-Efficient Pipeline Parallelism", 2026:
learned per-stage orthogonal projections) with a basis from the data instead,
in the spirit of PowerSGD's low-rank projections (Vogels et al., 2019).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from ..spec import CodecSpec
from .format import WireError

__all__ = ["SAMPLE_ROWS", "Basis", "End", "Subspace", "coefficients", "principal", "rebuild"]

SAMPLE_ROWS = 4096
"""Rows of an activation a basis is made from, at most (the first ones)."""


class Basis(NamedTuple):
    """One link's basis.

    Attributes:
        matrix: ``(d, R)`` float32, orthonormal columns.
        version: 1 for the link's first basis, then one more per refresh (the sender's count).
        step: the training step it was made at (the next refresh is ``refresh`` steps
            later); -1 for a basis received from the other end.
    """

    matrix: torch.Tensor
    version: int
    step: int


class End(NamedTuple):
    """What a lowrank encode or decode needs of its end of the link.

    Attributes:
        subspace: the stage's state.
        key: the link, as a string (e.g. ``"boundary/1"``): the activations across a
            stage boundary and their gradients use the same key at both ends.
        step: the sender's training step, which times the refreshes; None for a
            message that must not refresh the basis (gradients, evaluation), and
            ignored by a decode.
    """

    subspace: "Subspace"
    key: str
    step: int | None = None


def principal(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-``rank`` principal directions of ``rows`` (``(n, d)``): ``(d, rank)`` float32.

    The eigenvectors of ``XᵀX`` (uncentred: the mean is part of what is sent) over the
    first :data:`SAMPLE_ROWS` rows, in float64, largest eigenvalue first, each column's
    largest-magnitude entry made positive: a deterministic function of the data.

    Raises:
        WireError: non-finite values (a basis from them would be NaN).
    """
    x = rows[:SAMPLE_ROWS].to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise WireError("lowrank cannot make a basis from non-finite activations")
    vectors: torch.Tensor = torch.linalg.eigh(x.T @ x).eigenvectors
    top = vectors[:, -rank:].flip(1)
    signs = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))
    signs[signs == 0] = 1
    return (top * signs).to(torch.float32).contiguous()


def coefficients(rows: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``rows`` (``(n, d)``) in ``basis`` (``(d, R)``): ``(n, R)`` float32."""
    return torch.matmul(rows.to(torch.float32), basis)


def rebuild(coeffs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Rows (``(n, d)``, float32) from their coefficients (``(n, R)``) in ``basis``."""
    return torch.matmul(coeffs, basis.T)


class Subspace:
    """One stage's lowrank state: the basis of each of its links, as both ends hold it.

    A sender (:meth:`outgoing`) makes a link's first basis from the first
    message it sends, and a new one at the first message of a step at least
    ``refresh`` steps after the last; a receiver (:meth:`incoming`) keeps what
    the messages carry. Not locked: one link's messages are encoded (decoded)
    one at a time, in order.
    """

    def __init__(self) -> None:
        self._bases: dict[str, Basis] = {}
        self._announce: set[str] = set()  # links whose next message must carry the basis
        self._received: set[str] = set()  # links whose basis a message carried since the
        #                                   last load or forget (see load_state_dict)

    def basis(self, key: str) -> Basis | None:
        """The basis of link ``key``, or None."""
        return self._bases.get(key)

    def __len__(self) -> int:
        return len(self._bases)

    def outgoing(self, end: End, rows: torch.Tensor, spec: CodecSpec) -> tuple[Basis, bool]:
        """The basis a message of ``rows`` (``(n, d)``) uses, and whether it must carry it.

        Refreshes the basis first when ``end.step`` is given and the link has
        none, one of another shape, or one made ``spec.refresh`` or more steps ago.

        Raises:
            WireError: no basis to use and none may be made (a gradient sent before
                any activation crossed the link, or after a re-plan changed it).
        """
        old = self._bases.get(end.key)
        shape = (rows.shape[1], spec.rank)
        if end.step is not None and (old is None or tuple(old.matrix.shape) != shape
                                     or end.step >= old.step + spec.refresh):
            old = Basis(principal(rows, spec.rank), old.version + 1 if old else 1, end.step)
            self._bases[end.key] = old
            self._announce.add(end.key)
        if old is None:
            raise WireError(f"lowrank link {end.key!r} has no basis yet: its activations "
                            "(which make it) must cross it before a gradient can")
        if tuple(old.matrix.shape) != shape:
            raise WireError(f"lowrank link {end.key!r} holds a {tuple(old.matrix.shape)} "
                            f"basis, a message of rank {spec.rank} and width {rows.shape[1]} "
                            f"needs {shape}")
        carry = end.key in self._announce
        self._announce.discard(end.key)
        return old, carry

    def incoming(self, key: str, matrix: torch.Tensor | None, version: int, width: int,
                 rank: int) -> Basis:
        """The basis a received message uses: the one it carries (``matrix``, kept), or
        the one held.

        Raises:
            WireError: the message carries none and this end holds no basis of link
                ``key``, another version, or one of another shape than (``width``, ``rank``).
        """
        held = self._bases.get(key)
        if matrix is not None:  # what the message carries is what its sender used; the step
            #                     stays this end's if it made that version (-1: the other did)
            step = held.step if held is not None and held.version == version else -1
            held = Basis(matrix.clone(), version, step)
            self._bases[key] = held
            self._received.add(key)
            return held
        if held is None:
            raise WireError(f"lowrank message on link {key!r} uses basis version {version}, "
                            "but this end holds no basis of that link (its sender must "
                            "send it first)")
        if held.version != version:
            raise WireError(f"lowrank message on link {key!r} uses basis version {version}, "
                            f"this end holds version {held.version}")
        if tuple(held.matrix.shape) != (width, rank):
            raise WireError(f"lowrank message on link {key!r} needs a ({width}, {rank}) basis, "
                            f"this end holds {tuple(held.matrix.shape)}")
        return held

    def state_dict(self) -> dict[str, Any]:
        """Every link's basis: ``{"bases": {key: {"matrix", "version", "step"}}}``."""
        return {"bases": {k: {"matrix": b.matrix.clone(), "version": b.version, "step": b.step}
                          for k, b in list(self._bases.items())}}  # a receive may add one

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the bases with a :meth:`state_dict`'s; each this end made is carried
        again by its next outgoing message (the peer may have lost it).

        A basis a message carried in since this state was made (or last loaded) is kept
        over the snapshot's: a node's stage takes tensors while it restores, and what its
        restored peer sends is that peer's basis now, never an older one."""
        loaded = {str(k): Basis(v["matrix"].to(torch.float32).clone(), int(v["version"]),
                                int(v["step"]))
                  for k, v in state["bases"].items()}
        loaded.update({k: self._bases[k] for k in self._received if k in self._bases})
        self._bases = loaded
        self._announce = {k for k, b in self._bases.items() if b.step >= 0}  # those it made
        self._received.clear()

    def forget(self) -> None:
        """Drop every basis (a re-plan moved the links): the next activations make new ones."""
        self._bases.clear()
        self._announce.clear()
        self._received.clear()
