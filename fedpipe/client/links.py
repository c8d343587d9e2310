"""A client's socket data plane: its feed (inputs, targets) to the nodes that offer one.

The client dials each node's data port (:mod:`fedpipe.net.dataplane`) from one
:class:`~fedpipe.net.dataplane.DataPlane` of role ``client`` that does not listen
(nodes never dial a client), with mutual TLS when the client has a certificate.
A tensor goes from its own memory as ``SendOne`` would: one ``send`` with
``flush=True``, which returns once the node delivered it (or refused it).

The feed's error handling is gRPC's (it retries RESOURCE_EXHAUSTED, waits for a
recovery on UNAVAILABLE, ...), so a refusal is raised as a :class:`LinkError`,
a ``grpc.RpcError`` with the status code the node gave it (the same code its
gRPC ``Send`` would answer); a link that fails is UNAVAILABLE.
"""
from __future__ import annotations

import socket

import grpc
import torch

from ..net import dataplane, timeouts
from ..proto import node_pb2
from ..security import TlsConfig
from ..status import StatusError
from ..wire.format import WireError


class LinkError(StatusError):
    """A socket send's failure as the gRPC error a ``Send`` would raise: ``code()`` and
    ``details()`` (the feed's retry and recovery logic reads them)."""


def status_code(code: dataplane.Code) -> grpc.StatusCode:
    """The gRPC status code of a socket refusal's code (they share gRPC's numbers)."""
    return next((s for s in grpc.StatusCode if s.value[0] == code.value),
                grpc.StatusCode.UNKNOWN)


class NoInbound:
    """A client's receiver: nodes send a client nothing over its links; anything that
    comes is refused (a :class:`~fedpipe.net.dataplane.Receiver`)."""

    def admit(self, peer: dataplane.Peer, header: node_pb2.Frame) -> int:
        raise dataplane.Refused(dataplane.Code.UNIMPLEMENTED,
                                "a client takes no tensors over its data links")

    def deliver(self, peer: dataplane.Peer, header: node_pb2.Frame,
                tensor: torch.Tensor) -> None:
        raise dataplane.Refused(dataplane.Code.UNIMPLEMENTED,
                                "a client takes no tensors over its data links")


def client_plane(tls: TlsConfig | None) -> dataplane.DataPlane:
    """A client process's data plane: dial-only, role ``client``, named after its
    certificate (with TLS) or its host, with a suffix of its own
    (:func:`~fedpipe.net.dataplane.client_name`)."""
    base = tls.name if tls is not None else f"client-{socket.gethostname()}"
    resume = dataplane.Timeouts(resume=timeouts.CLIENT_LINK_RESUME)
    return dataplane.DataPlane(dataplane.client_name(base), NoInbound(), role="client",
                               listen=False, tls=tls, timeouts=resume)


def send(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
         envelope: node_pb2.Envelope, tensor: torch.Tensor) -> None:
    """Send ``tensor`` with ``envelope`` to ``node``'s data port; return once the node
    delivered it.

    Raises:
        LinkError: the node refused it (its code), or the link failed (UNAVAILABLE).
    """
    try:
        link = plane.link(node.node_name, node.data_address)
        link.send(tensor, envelope=envelope, flush=True)
    except dataplane.PeerRefused as e:
        raise LinkError(status_code(e.code), f"{node.node_name} refused it: {e}") from None
    except dataplane.LinkFailed as e:
        raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
    except WireError as e:  # the tensor cannot be encoded
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
