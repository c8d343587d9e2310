"""The node's data plane: which tensors a stage takes, checked on each tensor's header
before its payload is buffered, and their delivery to the stage's mailbox.

A tensor that arrives (Send) is admitted (:meth:`DataPlane.admit`), read within
the size limit admission gave it, then filed for its stage
(:meth:`DataPlane.deliver`), where the stage's transport takes it
(:class:`~fedpipe.node.wiring.StageTransport`). What a stage sends goes through
its :class:`~fedpipe.node.peers.StagePeers`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence

import grpc
import torch

from ..proto import node_pb2, tracker_pb2
from ..spec import Kind
from ..wire import WireError, codecs, frames
from .errors import BadEnvelope, NoSuchStage, StaleEpoch
from .lifecycle import Stage, StageSlot
from .mailbox import Mailbox
from .linkprobe import MAX_PROBE_BYTES
from .reports import StageReporter

STAGE_KINDS = frozenset(Kind) - {Kind.PROBE, Kind.SNAPSHOT, Kind.WEIGHTS}
"""Kinds of tensor a stage takes from its mailbox."""
_KINDS = {k.value: k for k in Kind}
"""Envelope kind -> :class:`Kind` (a lookup: the enum's call costs a few us a tensor)."""
BOUNDED_KINDS = (Kind.INPUT, Kind.TARGET)
"""Kinds a client may send far ahead: their inbox is bounded (backpressure)."""
_PROBE = int(Kind.PROBE)
"""``Kind.PROBE`` as a plain int: reading an enum's member costs a dict lookup in its
metaclass, and the checks here run per tensor (``benchmarks/dataplane.py``)."""
_BOUNDED = frozenset(int(k) for k in BOUNDED_KINDS)


def microbatches(env: node_pb2.Envelope, tensor: torch.Tensor) -> Sequence[torch.Tensor]:
    """The microbatches an admitted tensor holds (:meth:`DataPlane.admit` checked that
    it has the rows): itself, or with ``env.microbatches`` > 1 its
    ``torch.tensor_split`` into that many pieces along dimension 0 (views), which is
    how the client cut them (``fedpipe.v1.Envelope.microbatches``)."""
    if env.microbatches <= 1:
        return (tensor,)
    return torch.tensor_split(tensor, env.microbatches)


def inbox_job(inbox: tuple[StageSlot, int]) -> str:
    """The job of a stage's mailbox key (:attr:`Stage.inbox`), for the mailbox's per-job cap."""
    return inbox[0].job_id


class StageLookup(Protocol):
    """Where the data plane finds a stage (:class:`~fedpipe.node.stages.StageRegistry`)."""

    def get(self, slot: StageSlot) -> Stage: ...


def slot_of(env: node_pb2.Envelope) -> StageSlot:
    """The stage an envelope is for."""
    return StageSlot(env.job_id, env.replica, env.stage)


class DataPlane:
    """Admits and delivers the tensors sent to this node's stages. Thread-safe.

    Args:
        stages: finds a stage by its slot.
        mailbox: where delivered tensors wait for their stage.
        reporter: reports a neighbour whose stream broke.
        pinned: the stages run on a CUDA device: a stage's raw tensor is received into
            pinned host memory on the socket data plane (:attr:`frames.Admitted.pinned`),
            so its transport's move to the device is asynchronous
            (:meth:`~fedpipe.node.wiring.StageTransport.recv`).
    """

    def __init__(self, stages: StageLookup, mailbox: Mailbox, reporter: StageReporter,
                 pinned: bool = False):
        self.stages, self.mailbox, self.reporter = stages, mailbox, reporter
        self.pinned = pinned

    def receive(self, stream: Iterable[bytes], check: Callable[[node_pb2.Frame], None],
                active: Callable[[], bool]) -> None:
        """Admit and deliver each tensor of a Send ``stream``; ``check`` vets each header
        (who may send it) before :meth:`admit` does.

        Raises:
            WireError: a malformed tensor (or one over the limit admission gave it).
            grpc.RpcError: the sender's side broke (its neighbour is reported, see
                :meth:`suspect`).
            Whatever ``check``, :meth:`admit` or :meth:`deliver` raise.
        """
        def admit(head: node_pb2.Frame) -> frames.Admitted:
            check(head)
            return self.admitted(head.envelope, head.tensor.shape)

        last = None
        try:
            for head, tensor in frames.read_tensors(stream, admit, in_place=True):  # gRPC's
                last = head.envelope
                self.deliver(last, tensor, active)
        except grpc.RpcError:  # the sender's side of the stream broke
            if last is not None:
                self.suspect(last)
            raise
        except WireError as e:
            raise WireError(f"malformed tensor: {e}") from e

    def admit(self, env: node_pb2.Envelope, shape: Sequence[int] = ()) -> int:
        """Check a tensor's envelope, and its ``shape`` as its header gives it, before its
        payload is buffered; return its size limit in bytes.

        A probe may be at most :data:`~fedpipe.node.linkprobe.MAX_PROBE_BYTES`; a
        stage's tensor needs a live stage of its epoch, a known kind, a positive
        batch size, and a step and microbatch index the stage will ask for (others
        would sit in its bounded inbox for ever): inputs only for a first stage,
        targets only for a last, their microbatches within the stage's per step,
        and a tensor of several of them (``env.microbatches``) a row for each.

        Raises:
            NoSuchStage: no live stage of the envelope's job, group and position.
            StaleEpoch: the stage runs another plan epoch.
            BadEnvelope: an unknown kind, a batch size below 1, a step or
                microbatch out of range, inputs or targets for the wrong stage.
        """
        return self.admitted(env, shape).limit

    def _checked_stage(self, env: node_pb2.Envelope, shape: Sequence[int]) -> Stage:
        """:meth:`admit`'s checks of a stage's tensor (not a probe); the stage.

        Raises:
            As :meth:`admit`.
        """
        stage = self.stages.get(slot_of(env))
        if env.epoch != stage.epoch:
            raise StaleEpoch(f"a tensor of plan epoch {env.epoch} for stage {env.stage} of job "
                             f"{env.job_id!r}, which runs epoch {stage.epoch}")
        if not stage.live:
            raise NoSuchStage(f"stage {env.stage} of job {env.job_id!r} (replica "
                              f"{env.replica}) is stopped")
        kind = _check_envelope(env, stage)
        if kind in _BOUNDED:
            _check_feed(env, stage, shape)
        elif env.microbatches > 1:
            raise BadEnvelope(f"microbatches={env.microbatches} on a tensor of kind "
                              f"{Kind(kind).name.lower()}: only a client's inputs "
                              "and targets hold several microbatches")
        return stage

    def admitted(self, env: node_pb2.Envelope, shape: Sequence[int] = ()) -> frames.Admitted:
        """:meth:`admit`'s limit, with the receiving stage's end of the link the tensor
        crosses for a stateful codec to decode with (its lowrank bases:
        :meth:`~fedpipe.node.lifecycle.Stage.codec_end`; None for any other tensor), and
        for a stage's tensor whether to receive it into pinned memory (``pinned``; a
        probe never is).

        Raises:
            As :meth:`admit`.
        """
        if env.kind == _PROBE:  # no stage's: it only has to arrive
            return frames.Admitted(MAX_PROBE_BYTES)
        return frames.Admitted(codecs.MAX_TENSOR_BYTES,
                               self._checked_stage(env, shape).codec_end(env), self.pinned)

    def deliver(self, env: node_pb2.Envelope, tensor: torch.Tensor,
                active: Callable[[], bool], defer: bool = False) -> Callable[[], None] | None:
        """Hand an admitted tensor to its stage's mailbox (probes are dropped);
        for inputs and targets wait for room while ``active()`` and the stage is live.

        A tensor of several microbatches (``env.microbatches`` > 1, a client's
        inputs or targets) is filed as its pieces (:func:`microbatches`), all or none.
        ``defer``: the stage thread waiting for it is not woken; its wake-up is returned
        (:meth:`~fedpipe.node.mailbox.Mailbox.put`).

        Raises:
            NoSuchStage: the stage was released meanwhile.
            StaleEpoch: the stage was replaced by one of a later epoch meanwhile.
            Duplicate: the stage already has that tensor (or one of its pieces).
            Stopped: the stage ended or ``active()`` turned false while waiting.
            Full: the job has as many tensors waiting on this node as one job may
                (:class:`~fedpipe.node.mailbox.Mailbox`).
        """
        kind = env.kind
        if kind == _PROBE:
            return None  # a link measurement: it only had to arrive
        slot = slot_of(env)
        stage = self.stages.get(slot)
        epoch = env.epoch
        if stage.epoch != epoch:  # replaced since the tensor was admitted
            raise StaleEpoch(f"stage {env.stage} of job {env.job_id!r} now runs epoch "
                             f"{stage.epoch}, not {epoch}")
        return self.mailbox.put_all((slot, epoch), _KINDS.get(kind) or Kind(kind), env.step,
                                    env.microbatch, microbatches(env, tensor), env.batch_size,
                                    alive=lambda: active() and stage.live, defer=defer)

    def suspect(self, env: node_pb2.Envelope) -> None:
        """A stream that brought ``env``'s stage its pipeline tensors broke: report the
        sending neighbour to the tracker, which pings it (the stage itself goes on; a
        neighbour that died would otherwise leave it waiting until the lease ends)."""
        try:
            stage = self.stages.get(slot_of(env))
        except NoSuchStage:
            return
        if not stage.live or stage.plan is None or env.epoch != stage.epoch:
            return
        prev, nxt = stage.plan.neighbours(stage.key)
        sender = {Kind.ACTIVATION: prev, Kind.GRADIENT: nxt}.get(Kind(env.kind))
        if sender is not None:
            self.reporter.report(stage, tracker_pb2.StageReport.STATUS_SUSPECT,
                                 peer=sender.address,
                                 error=f"the stream from {sender.node_name} broke")


def _check_envelope(env: node_pb2.Envelope, stage: Stage) -> int:
    """The fields every stage tensor's envelope must have in range; its kind.

    Raises:
        BadEnvelope: one is not.
    """
    kind = env.kind
    if kind not in STAGE_KINDS:
        raise BadEnvelope(f"unknown envelope kind {kind}")
    if env.batch_size <= 0:
        raise BadEnvelope(f"envelope batch_size must be positive, got {env.batch_size}")
    step = env.step
    if not 0 <= step < stage.steps or env.microbatch < 0:
        raise BadEnvelope(f"step {step} / microbatch {env.microbatch} out of range for "
                          f"a job of {stage.steps} steps")
    if env.microbatches < 0:
        raise BadEnvelope(f"envelope microbatches must be >= 0, got {env.microbatches}")
    return kind


def _check_feed(env: node_pb2.Envelope, stage: Stage, shape: Sequence[int]) -> None:
    """A client's inputs (or targets): for the first (or last) stage, microbatches the
    stage runs, and a row for each microbatch a tensor holds.

    Raises:
        BadEnvelope: not so.
    """
    end = stage.n_stages - 1 if env.kind == Kind.TARGET else 0
    if env.stage != end:
        raise BadEnvelope(f"{Kind(env.kind).name.lower()}s go to stage {end} of job "
                          f"{env.job_id!r}, not stage {env.stage}")
    count = max(1, env.microbatches)
    held = stage.runner.microbatches if stage.runner is not None else 0
    last = env.microbatch + count - 1
    if last >= held:
        raise BadEnvelope(f"microbatches {env.microbatch}..{last} out of range: stage "
                          f"{env.stage} runs {held} per step")
    if count > 1 and (not shape or shape[0] < count):
        raise BadEnvelope(f"a tensor of shape {tuple(shape)} cannot hold {count} "
                          "microbatches (one row each at least)")
