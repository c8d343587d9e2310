"""A client's socket data plane: its feed (inputs, targets) to the nodes that offer one,
and its fetches of a job's weights (``FetchState``, :func:`fetch`).

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
from typing import Callable

import grpc
import torch

from ..net import dataplane, timeouts
from ..proto import node_pb2
from ..security import TlsConfig
from ..status import StatusError
from ..wire.format import WireError

FetchRequest = node_pb2.FetchStateRequest | node_pb2.FetchSnapshotRequest


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


def fetch(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
          method: dataplane.records.Method, request: FetchRequest,
          admit: Callable[[node_pb2.Frame], int],
          deliver: Callable[[node_pb2.Frame, torch.Tensor], None]) -> None:
    """Fetch ``request`` from ``node``'s data port (:meth:`~fedpipe.net.dataplane.Link.fetch`:
    each tensor of the answer checked by ``admit``, then to ``deliver``); return once the
    whole answer came.

    Raises:
        LinkError: the node refused it (the code its gRPC call would end with), the link
            failed or broke meanwhile (UNAVAILABLE), or a tensor of the answer was refused
            here (INVALID_ARGUMENT).
    """
    try:
        plane.link(node.node_name, node.data_address).fetch(
            method, request.SerializeToString(), admit, deliver, timeouts.FETCH_STATE_RPC)
    except dataplane.PeerRefused as e:
        raise LinkError(status_code(e.code), f"{node.node_name} refused it: {e}") from None
    except dataplane.LinkFailed as e:
        raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
    except WireError as e:  # a tensor of the answer that this side refused
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
