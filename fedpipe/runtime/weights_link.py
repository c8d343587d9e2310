"""A stage's initial weights put on its node over a socket data-plane link: what
``PutWeights`` is on gRPC, for a client whose model holds the weights (or reads them) and
whose nodes offer a data port (:meth:`fedpipe.client.feed.ChannelNodes.put_weights`).

A stream is its tensors between two empty markers, each with the stage's envelope
(``KIND_WEIGHTS``, job, stage key, plan epoch): :data:`BEGIN`, then each tensor named
``"LAYER.KEY"`` (a layer at a time), then :data:`END`. The node checks each as gRPC's
``PutWeights`` (:mod:`fedpipe.node.dataplane`) and fills the stage's
:class:`~fedpipe.node.initial.Pending`; it takes :data:`END` only once every layer is
in and its digest matches, so an acknowledged :data:`END` means the stage has its
weights. Contract: ``protos/fedpipe/v1/FRAMES.md``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from ..net import dataplane, timeouts
from ..proto import node_pb2

BEGIN = "begin"
"""The name of the empty tensor a weights stream starts with (one started before by the
same sender starts over)."""
END = "end"
"""The name of the empty tensor a weights stream ends with: refused unless every tensor
of the stage came and every layer's digest matched."""


def marker() -> torch.Tensor:
    """The empty tensor :data:`BEGIN` and :data:`END` are sent as."""
    return torch.zeros(0, dtype=torch.uint8)


def send_weights(link: dataplane.Link, envelope: node_pb2.Envelope,
                 tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Put a stage's initial weights on the node at the other end of ``link``:
    :data:`BEGIN`, ``tensors`` (``("LAYER.KEY", tensor)``, CPU tensors nobody changes
    until this returns, read from ``tensors`` as the link's credit allows), :data:`END`,
    each with ``envelope``; returns once the node took :data:`END` (the stage has its
    weights), within :data:`~fedpipe.net.timeouts.PUT_WEIGHTS_RPC` of the last send.

    Raises:
        PeerRefused: the node refused one (``code``: the status gRPC's ``PutWeights``
            would end with: ALREADY_EXISTS for a stage that has its weights,
            INVALID_ARGUMENT for a digest that differs, ...); raised here only
            (:func:`~fedpipe.net.dataplane.owner_of`: the stage's own stream).
        LinkFailed: the link failed, or the node did not acknowledge in time.
    """
    owner, last = dataplane.owner_of(envelope), -1
    try:
        last = link.send(marker(), envelope=envelope, name=BEGIN)
        for name, t in tensors:
            last = link.send(t, envelope=envelope, name=name)
        last = link.send(marker(), envelope=envelope, name=END)
    except dataplane.PeerRefused:
        # refused already (what follows is refused too): wait for what was sent, so that
        # no refusal of this stream is left on the link, then say the first
        with contextlib.suppress(dataplane.PeerRefused):
            link.flush(timeout=timeouts.PUT_WEIGHTS_RPC, owner=owner, through=last)
        raise
    link.flush(timeout=timeouts.PUT_WEIGHTS_RPC, owner=owner, through=last)
