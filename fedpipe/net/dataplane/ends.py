"""What the two ends of a socket data-plane link are to each other: who the peer is
(:class:`Peer`), where a link delivers what it receives (:class:`Receiver`) and reports
what befalls it (:class:`LinkEvents`), and the refusals of one tensor, by a receiver
(:class:`Refused`) and as the sender learns of it (:class:`PeerRefused`), and whose
sender that is (:func:`owner_of`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch

from ...proto import node_pb2
from ...security import Identity
from ...wire.format import WireError
from ...wire.frames import Admitted
from .records import Code


@dataclasses.dataclass(frozen=True)
class Peer:
    """Who is at the other end of a link.

    Attributes:
        name: its node (or client) name, from its preface; with TLS, its certificate's
            (a client's with the suffix that tells its processes apart:
            :func:`~fedpipe.net.dataplane.server.client_name`).
        role: ``node`` or ``client``.
        identity: its certificate's identity (None without TLS).
        job: the one job the link carries ("": any): a link through a relay dialed for
            one job (its ``TAG`` named it, and the relay bounds it per job). The receiver
            refuses any frame of another job on it.
    """

    name: str
    role: str
    identity: Identity | None = None
    job: str = ""

    def check_job(self, job: str, what: str) -> None:
        """Refuse a ``what`` (a tensor, a fetch) of ``job`` on a link that carries another
        job alone (:attr:`job`: the relay bounds the link by that job's share; a frame of
        another job on it would pass that bound). The link's reader checks each tensor's
        envelope; a fetch's server its request.

        Raises:
            Refused: PERMISSION_DENIED, naming both jobs.
        """
        if self.job and job != self.job:
            raise Refused(Code.PERMISSION_DENIED,
                          f"a {what} of job {job!r} from {self.name} is refused: it came on "
                          f"the link through a relay that carries job {self.job!r} alone "
                          f"(the relay bounds it by that job's share); job {job!r} goes "
                          f"on a link of its own")


class Refused(Exception):
    """A receiver refuses one tensor; the link goes on. ``code`` travels with the message."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


class PeerRefused(WireError):
    """The peer refused a tensor this side sent (raised by the next send or flush)."""

    def __init__(self, code: Code, message: str, seq: int):
        super().__init__(f"{code.name}: {message}")
        self.code, self.seq = code, seq


class Receiver(Protocol):
    """Where a link's received tensors go (the node: its admission checks and mailbox).

    Both methods run on the link's reader thread. They must not send on the same link
    (a send may wait for credit that only this reader brings back): hand the tensor to
    another thread first, as a node's mailbox does.
    """

    def admit(self, peer: Peer, header: node_pb2.Frame) -> int | Admitted:
        """Check a tensor's header before its payload is read; return its size limit in
        bytes, or an :class:`~fedpipe.wire.frames.Admitted` with the limit and the link's
        end a stateful codec decodes with (the stage's lowrank basis). Raises
        :class:`Refused` to refuse it (its payload is then skipped)."""

    def deliver(self, peer: Peer, header: node_pb2.Frame,
                tensor: torch.Tensor) -> Callable[[], None] | None:
        """Take a received tensor; may block (the sender then runs out of credit).
        Raises :class:`Refused` to refuse it.

        May return the wake-up of a thread that waits for the tensor instead of waking it:
        the link runs it before its reader waits for the socket, or has read
        on for :data:`~.connection.LATER_SECONDS` (:meth:`~.connection.Connection.later`), so
        tensors that arrived together wake their consumer once. None: nothing to run."""


class LinkEvents(Protocol):
    """What a link reports about its peer (the node: its suspect path)."""

    def lost(self, peer: str, why: str) -> None:
        """A connection broke; the link tries to resume."""

    def failed(self, peer: str, why: str) -> None:
        """The link is gone for good."""


def owner_of(envelope: node_pb2.Envelope | None) -> str:
    """Whose sender a refusal of a tensor with this envelope is raised to: its job at its
    plan epoch ("" for none); a snapshot's tensor's to its shipper (by step), not to the
    stage. A link is shared by every job and epoch, and a stage of an epoch a recovery
    ended may still send for a moment (its node could not be told to stop, say, having
    moved to another relay); the peer's refusal of that tensor must not fail the same
    job's stage of the new epoch, nor a buddy's refusal of a snapshot the stage itself (nor
    a node's refusal of one stage's initial weights another stage's stream)."""
    if envelope is None:
        return ""
    kind = envelope.kind
    if kind == node_pb2.KIND_SNAPSHOT:
        return f"{envelope.job_id}@{envelope.epoch}/snapshot {envelope.step}"
    if kind == node_pb2.KIND_WEIGHTS:  # one client stream per stage
        return f"{envelope.job_id}@{envelope.epoch}/weights {envelope.replica}.{envelope.stage}"
    return f"{envelope.job_id}@{envelope.epoch}"
