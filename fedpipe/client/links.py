"""A client's socket data plane: its feed (inputs, targets) to the nodes that offer one,
its fetches of a job's weights (``FetchState``, :func:`fetch`) and snapshots
(``FetchSnapshot`` for a save, :func:`fetch_snapshot`), and the snapshots it puts on
them (``PutSnapshot``, restoring a saved checkpoint: :func:`put_snapshot`), and the
stages' initial weights it streams (``PutWeights``: :func:`put_weights`).

The client dials each node's data port (:mod:`fedpipe.net.dataplane`) from one
:class:`~fedpipe.net.dataplane.DataPlane` of role ``client`` that does not listen
(nodes never dial a client), with mutual TLS when the client has a certificate.
A tensor goes from its own memory as ``SendOne`` would: one ``send`` with
``flush=True``, which returns once the node delivered it (or refused it).

The feed's error handling is gRPC's (it retries RESOURCE_EXHAUSTED, waits for a
recovery on UNAVAILABLE, ...), so a refusal is raised as a :class:`LinkError`,
a ``grpc.RpcError`` with the status code the node gave it (the same code its
gRPC call, ``Send``, ``PutSnapshot``, ``PutWeights``, ``FetchState`` or ``FetchSnapshot``, would end
with); a link that fails is UNAVAILABLE. Each falls back to gRPC where the node offers
no data port or the client has no socket plane (``Client(sockets=False)``): the
callers choose (:class:`~.feed.ChannelNodes`, :mod:`.checkpoints`).
"""
from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from typing import Callable, Iterable, Iterator

import grpc
import torch

from ..net import dataplane, timeouts
from ..proto import node_pb2
from ..runtime import checkpoint
from ..runtime.snapshot_link import send_snapshot
from ..runtime.weights_link import send_weights
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
                               listen=False, tls=tls, timeouts=resume,
                               relayed_timeouts=dataplane.Timeouts())


def send(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
         envelope: node_pb2.Envelope, tensor: torch.Tensor) -> None:
    """Send ``tensor`` with ``envelope`` to ``node``'s data port; return once the node
    delivered it.

    Raises:
        LinkError: the node refused it (its code), or the link failed (UNAVAILABLE).
    """
    with link_errors(node):
        link_to(plane, node, envelope.job_id).send(tensor, envelope=envelope, flush=True)


def link_to(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
            job: str) -> dataplane.Link:
    """The client's link to ``node`` for ``job``'s frames: through its relay (an
    outbound-only node) one of the job's own, tagged so the relay bounds it per job
    (:meth:`~fedpipe.net.dataplane.DataPlane.link`).

    Raises:
        LinkFailed: the node cannot be reached, or its relay refused the job's stream.
    """
    return plane.link(node.node_name, node.data_address, job, relayed=bool(node.relay))


@contextlib.contextmanager
def link_errors(node: node_pb2.StageAssignment) -> Iterator[None]:
    """Raise a socket call's failure as the :class:`LinkError` its gRPC call would end
    with: a refusal by ``node`` with its code, a failed link as UNAVAILABLE, a tensor that
    cannot be encoded (or one of an answer refused here) as INVALID_ARGUMENT."""
    try:
        yield
    except dataplane.PeerRefused as e:
        raise LinkError(status_code(e.code), f"{node.node_name} refused it: {e}") from None
    except dataplane.LinkFailed as e:
        raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
    except WireError as e:
        raise LinkError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def put_snapshot(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
                 envelope: node_pb2.Envelope, snap: checkpoint.Snapshot) -> None:
    """Put a stage's snapshot on ``node`` over its data port
    (:func:`~fedpipe.runtime.snapshot_link.send_snapshot`; ``envelope``: ``KIND_SNAPSHOT``
    with the job, stage key and step); return once the node kept it. The node checks it
    as a gRPC ``PutSnapshot`` (:mod:`fedpipe.node.dataplane`: the policy row, the job's
    own client, a stage key of its plans, sizes, a job it runs).

    Raises:
        LinkError: the node refused it (the code ``PutSnapshot`` would end with: e.g.
            PERMISSION_DENIED for a job that is not the caller's or that the node does
            not know, INVALID_ARGUMENT for a stage of no plan of it), or the link failed
            (UNAVAILABLE).
    """
    with link_errors(node):
        send_snapshot(link_to(plane, node, envelope.job_id), envelope, snap)


def put_weights(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
                envelope: node_pb2.Envelope, tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> None:
    """Put a stage's initial weights on ``node`` over its data port
    (:func:`~fedpipe.runtime.weights_link.send_weights`; ``envelope``: ``KIND_WEIGHTS``
    with the job, stage key and plan epoch; ``tensors``: ``("LAYER.KEY", tensor)``);
    return once the stage has them. The node checks them as a gRPC ``PutWeights``
    (:mod:`fedpipe.node.dataplane`).

    Raises:
        LinkError: the node refused them (the code ``PutWeights`` would end with:
            ALREADY_EXISTS for a stage that has its weights, INVALID_ARGUMENT for a
            digest or shape that differs, NOT_FOUND for a stage it does not run,
            FAILED_PRECONDITION for another plan epoch, PERMISSION_DENIED for a job
            that is not the caller's), or the link failed (UNAVAILABLE).
    """
    with link_errors(node):
        send_weights(link_to(plane, node, envelope.job_id), envelope, tensors)


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
    with link_errors(node):
        link_to(plane, node, request.job_id).fetch(
            method, request.SerializeToString(), admit, deliver, timeouts.FETCH_STATE_RPC)


HAND_POLL = 0.1
"""Seconds between looks at whether a :func:`fetch_snapshot`'s reader went away (while a
tensor waits to be taken), or its fetch ended (while the reader waits for a tensor)."""


def fetch_snapshot(plane: dataplane.DataPlane, node: node_pb2.StageAssignment,
                   request: node_pb2.FetchSnapshotRequest, max_bytes: int
                   ) -> checkpoint.SnapshotStream:
    """``FetchSnapshot`` from ``node``'s data port, read a tensor at a time as gRPC's
    stream is (:func:`~fedpipe.runtime.checkpoint.stream_tensors`, the same assembly
    and checks: at most ``max_bytes`` in all, exactly the tensors its skeleton names).

    The fetch runs on a thread of its own (:func:`fetch`); each tensor of the answer is
    checked on the link's reader thread and handed over one at a time: the reader waits
    while the stream's reader holds one, so this side holds one tensor (and the one
    being read), however big the snapshot. A reader that stops early (its generator
    closed) has the rest refused here, which ends the fetch, not the link.

    A reader that does neither within :data:`~fedpipe.net.timeouts.FETCH_STATE_RPC` of
    the fetch's start (a stream dropped but not yet collected) has the rest refused
    too, so the link's reader never waits longer.

    Raises:
        LinkError: before its skeleton came (the fetch failed: the node's refusal with
            its code, e.g. NOT_FOUND; UNAVAILABLE; INVALID_ARGUMENT: an empty answer);
            from the stream's tensors, as it fails later (INVALID_ARGUMENT for a tensor
            refused here).
        WireError: from the stream's end, as :func:`~fedpipe.runtime.checkpoint.stream_frames`'
            (not exactly the tensors its skeleton names).
    """
    assembler = checkpoint.Assembler(max_bytes, keep=False)
    handed: queue.Queue[tuple[node_pb2.Frame, torch.Tensor]] = queue.Queue(maxsize=1)
    stopped = threading.Event()  # the stream's reader went away
    done = threading.Event()  # the fetch ended: every tensor of it was handed over
    failed: list[LinkError] = []  # why it failed
    deadline = time.monotonic() + timeouts.FETCH_STATE_RPC

    def deliver(head: node_pb2.Frame, t: torch.Tensor) -> None:
        assembler.add(head, t)  # checked here, before it is handed on
        while not stopped.is_set() and time.monotonic() < deadline:
            try:
                handed.put((head, t), timeout=HAND_POLL)
                return
            except queue.Full:
                continue
        raise WireError("the snapshot's reader stopped taking it")

    def run() -> None:
        try:
            fetch(plane, node, dataplane.records.Method.FETCH_SNAPSHOT, request,
                  assembler.admit, deliver)
        except LinkError as e:
            failed.append(e)
        finally:
            done.set()

    def pairs() -> Iterator[tuple[node_pb2.Frame, torch.Tensor]]:
        try:
            while True:
                try:
                    yield handed.get(timeout=HAND_POLL)
                except queue.Empty:
                    if done.is_set() and handed.empty():  # nothing more will come
                        if failed:
                            raise failed[0] from None
                        return
        finally:
            stopped.set()

    threading.Thread(target=run, daemon=True, name=f"fetch-snapshot-{node.node_name}").start()
    with link_errors(node):
        return checkpoint.stream_tensors(assembler, pairs(), added=True)[1]

