"""The checkpoint snapshots a node keeps: its own stages' and those it keeps as a buddy.

:class:`SnapshotStore` holds them; :class:`Checkpoints` takes a stage's, keeps it,
ships it to the stage's buddy and reports it; :class:`SnapshotDesk` takes them in
(PutSnapshot) and hands them out (FetchSnapshot). See :mod:`fedpipe.runtime.checkpoint`.

A store made with a directory (``fedpipe node --snapshot-dir DIR``) keeps every
snapshot as a safetensors file there (:mod:`fedpipe.runtime.tensorfile`), not in
memory: its own are written from the stage's live tensors on the stage thread (no
copy), a buddy's as its tensors arrive, and each is read back a tensor at a time when
it is shipped, fetched or restored. Only the skeletons (a few KiB) stay in memory.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch

from ..net import dataplane, timeouts
from ..proto import node_pb2, tracker_pb2
from ..runtime import checkpoint, layerstate, tensorfile
from ..runtime.checkpoint import Snapshot
from ..runtime.snapshot_link import send_snapshot
from ..spec import SNAPSHOTS_KEPT, Kind, StageKey
from ..wire import WireError, rpc
from ..wire.format import peek_header
from .errors import NoSuchSnapshot, NoSuchStage
from .lifecycle import Stage, StageState
from .peers import ChannelPool
from .reports import StageReporter
from .snapfiles import SnapshotWriter, claim_dir

log = logging.getLogger(__name__)

MAX_SNAPSHOT_BYTES = 4 * 2**30
"""Largest snapshot a node accepts from a buddy or a restore source, bytes: a stage of
about 250 M float32 parameters with AdamW's two moments (16 bytes a parameter)."""


class SnapshotStore:
    """Snapshots by ``(job_id, StageKey)`` and step: the newest
    :data:`~fedpipe.spec.SNAPSHOTS_KEPT` of each stage, and the job's last complete
    checkpoint as the tracker last said (:meth:`protect`). Without that one, a node
    that keeps taking checkpoints the tracker cannot complete (a peer cut off from
    the tracker, a revoked one) would evict the only step a recovery can rewind to.

    Thread-safe. Own snapshots and buddy copies live side by side: a stage
    restored on this node finds either.

    Args:
        keep: snapshots kept per stage (beside the protected one).
        directory: keep them as files there (see the module docstring; the directory is
            claimed, :func:`claim_dir`), or None: in memory.

    Raises:
        ~.snapfiles.SnapshotDirInUse: ``directory`` is another live node's.
    """

    def __init__(self, keep: int = SNAPSHOTS_KEPT, directory: str | os.PathLike | None = None):
        self.keep = keep
        self._snaps: dict[tuple[str, StageKey], OrderedDict[int, Snapshot]] = {}
        self._complete: dict[str, int] = {}  # job -> its last complete checkpoint
        self._acked: dict[tuple[str, StageKey, int], set[int]] = {}  # (job, key, epoch) -> steps
        self._lock = threading.Lock()
        self.directory = Path(directory) if directory is not None else None
        self._dir_lock = claim_dir(self.directory) if self.directory is not None else None

    @property
    def on_disk(self) -> bool:
        """Whether snapshots are kept as files (not in memory)."""
        return self.directory is not None

    def file(self, job_id: str, key: StageKey, step: int) -> Path:
        """The file of stage ``key``'s snapshot of ``step`` (a disk store's)."""
        assert self.directory is not None, "a store in memory has no files"
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:40]
        tag = hashlib.sha256(job_id.encode()).hexdigest()[:8]  # two odd ids never collide
        return self.directory / (f"{safe}-{tag}-r{key.replica}-s{key.stage}-{step:010d}"
                                 ".safetensors")

    def writer(self, job_id: str, key: StageKey, snap: Snapshot) -> SnapshotWriter:
        """A file for ``snap`` of stage ``key`` (its step and skeleton; tensors come by
        :meth:`SnapshotWriter.add`), which :meth:`put` then keeps."""
        return SnapshotWriter(self.file(job_id, key, snap.step), snap)

    def put(self, job_id: str, key: StageKey, snap: Snapshot) -> Snapshot:
        """Keep ``snap`` (a disk store writes it to its file, tensor by tensor from their
        own memory, unless it is that file already); the oldest of the stage's snapshots
        beyond :attr:`keep` is dropped (its file removed). Returns the snapshot kept (a
        disk store's reads its file).

        Raises:
            OSError: a disk store could not write it.
        """
        if self.on_disk:
            target = self.file(job_id, key, snap.step)
            if not (isinstance(snap.tensors, tensorfile.TensorFile)
                    and snap.tensors.path == target):
                writer = SnapshotWriter(target, snap)
                try:
                    for name, t in snap.tensors.items():
                        writer.add(name, t)
                except BaseException:
                    writer.abort()
                    raise
                snap = writer.finish()
        with self._lock:
            steps = self._snaps.setdefault((job_id, key), OrderedDict())
            steps[snap.step] = snap
            steps.move_to_end(snap.step)
            self._prune(job_id, steps)
        return snap

    def protect(self, job_id: str, step: int) -> None:
        """``step`` is ``job_id``'s last complete checkpoint (the tracker's word): keep its
        snapshots beside the newest :attr:`keep`; an older protected step is let go."""
        with self._lock:
            if self._complete.get(job_id) == step:
                return
            self._complete[job_id] = step
            for (job, _), steps in self._snaps.items():
                if job == job_id:
                    self._prune(job_id, steps)

    def acked(self, job_id: str, key: StageKey, epoch: int, step: int) -> None:
        """This node acknowledged stage ``key``'s snapshot of ``step`` (plan ``epoch``) to
        the tracker: kept here and on its buddy."""
        with self._lock:
            held = self._snaps.get((job_id, key), OrderedDict())
            acked = self._acked.setdefault((job_id, key, epoch), set())
            acked.add(step)
            acked.intersection_update(held)

    def acked_steps(self, job_id: str, key: StageKey, epoch: int) -> list[int]:
        """The steps of stage ``key`` (plan ``epoch``) acknowledged and still kept here that
        are newer than the job's last complete checkpoint (:meth:`protect`): the
        acknowledgements a tracker may not have counted yet, oldest first."""
        with self._lock:
            held = self._snaps.get((job_id, key), OrderedDict())
            done = self._complete.get(job_id, 0)
            return sorted(s for s in self._acked.get((job_id, key, epoch), ())
                          if s in held and s > done)

    def _prune(self, job_id: str, steps: OrderedDict[int, Snapshot]) -> None:
        kept = set(list(steps)[-self.keep:])
        kept.add(self._complete.get(job_id, -1))
        for step in [s for s in steps if s not in kept]:
            self._forget(steps.pop(step))

    @staticmethod
    def _forget(snap: Snapshot) -> None:
        """Remove a dropped snapshot's file (a reader that has it open still reads it)."""
        if isinstance(snap.tensors, tensorfile.TensorFile):
            snap.tensors.path.unlink(missing_ok=True)

    def get(self, job_id: str, key: StageKey, step: int) -> Snapshot | None:
        """The snapshot of stage ``key`` at ``step``, or None."""
        with self._lock:
            steps = self._snaps.get((job_id, key))
            return steps.get(step) if steps is not None else None

    def steps(self, job_id: str, key: StageKey) -> list[int]:
        """The steps held for stage ``key``, oldest first."""
        with self._lock:
            return list(self._snaps.get((job_id, key), ()))

    def room(self, job_id: str, key: StageKey, budget: int) -> int:
        """Bytes one more snapshot of stage ``key`` may take while ``job_id``'s kept
        snapshots stay within ``budget`` bytes (the one that snapshot would push out,
        the stage's oldest when :attr:`keep` are kept, does not count); 0 at or past it."""
        with self._lock:
            held = sum(s.nbytes for (job, _), steps in self._snaps.items() if job == job_id
                       for s in steps.values())
            steps = self._snaps.get((job_id, key), OrderedDict())
            if len(steps) >= self.keep:  # the oldest but the protected one goes
                out = next((s for k, s in steps.items() if k != self._complete.get(job_id)),
                           None)
                held -= out.nbytes if out is not None else 0
        return max(0, budget - held)

    def drop_job(self, job_id: str) -> None:
        """Forget every snapshot of ``job_id``."""
        with self._lock:
            for k in [k for k in self._snaps if k[0] == job_id]:
                for snap in self._snaps.pop(k).values():
                    self._forget(snap)
            for a in [a for a in self._acked if a[0] == job_id]:
                del self._acked[a]
            self._complete.pop(job_id, None)

    def jobs(self) -> set[str]:
        """The jobs with snapshots here."""
        with self._lock:
            return {k[0] for k in self._snaps}

    @property
    def nbytes(self) -> int:
        """Bytes all kept snapshots take (a disk store's on disk)."""
        with self._lock:
            return sum(s.nbytes for steps in self._snaps.values() for s in steps.values())


class Checkpoints:
    """A stage's checkpoints: taken on its thread (a copy), then kept here, shipped to
    its buddy and reported to the tracker on a shipper thread of their own, so the
    stage pays only for the copy.

    The buddy is a node of another replica group if any, else a neighbour's, rotating
    (:meth:`fedpipe.spec.PlanView.buddies`); the tracker marks a step complete once
    every stage has reported it.

    A snapshot goes to a buddy that offers a data port over the node's socket data
    plane (:func:`send_snapshot`), to one that does not (or whose link is broken and
    waiting to resume) over gRPC's ``PutSnapshot``.

    Args:
        snapshots: where this node keeps snapshots.
        channels: the node's channels (to buddies).
        reporter: reports each shipped checkpoint.
        plane: the node's socket data plane (returns None: gRPC only).
    """

    def __init__(self, snapshots: SnapshotStore, channels: ChannelPool,
                 reporter: StageReporter,
                 plane: Callable[[], dataplane.DataPlane | None] = lambda: None):
        self.snapshots, self.channels, self.reporter = snapshots, channels, reporter
        self.plane = plane
        self.shipper = futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")

    def take(self, stage: Stage, step: int) -> None:
        """Snapshot ``stage`` after ``step`` steps (on its thread: a copy), then keep it,
        ship it to its buddy and report it (on the shipper thread)."""
        # a disk store writes the stage's own tensors now, on its thread: no copy in memory
        snap = checkpoint.take(stage.parts, step, copy=not self.snapshots.on_disk)
        try:
            kept = self.snapshots.put(stage.job_id, stage.key, snap)
        except OSError as e:  # a full or failing disk: the checkpoint stays incomplete
            log.warning("job %s stage %d: could not keep the step %d snapshot on disk: %s",
                        stage.job_id, stage.key.stage, step, e)
            return
        self.shipper.submit(self._ship, stage, kept)

    def keep_final(self, stage: Stage, step: int) -> None:
        """The final state, kept here only: what ``Job.save()`` of an ended job pulls.

        The job's training is done either way: a disk that cannot hold the state (full or
        failing) is logged, not raised, and a later save is told the state is missing.
        """
        try:
            self.snapshots.put(stage.job_id, stage.key,
                               checkpoint.take(stage.parts, step, copy=not self.snapshots.on_disk))
        except OSError as e:
            log.warning("job %s stage %d: could not keep the final state (step %d) on disk, so "
                        "Job.save() will not find it here: %s", stage.job_id, stage.key.stage,
                        step, e)

    def _ship(self, stage: Stage, snap: Snapshot) -> None:
        buddy = stage.plan.buddy(stage.key, snap.step // stage.checkpoint_every) \
            if stage.plan is not None else None
        if buddy is not None:
            env = node_pb2.Envelope(job_id=stage.job_id, replica=stage.key.replica,
                                    stage=stage.key.stage, kind=Kind.SNAPSHOT.value, step=snap.step,
                                    epoch=stage.epoch, batch_size=1)
            plane = self.plane() if buddy.data_address else None
            try:
                # through the buddy's relay: the job's own link, bounded by its share there
                link = plane.link(buddy.node_name, buddy.data_address, stage.job_id,
                                  relayed=bool(buddy.relay)) if plane is not None else None
                if link is not None and link.conn is None:
                    # broken, waiting to resume (the buddy may be dead): a socket send would
                    # wait out the resume window; gRPC fails at once if it is gone
                    link = None
                if link is not None:
                    send_snapshot(link, env, snap)
                else:
                    with self.channels.borrow(buddy.address) as ch:
                        rpc.NodeStub(ch).PutSnapshot(checkpoint.to_frames(snap, env),
                                                     timeout=timeouts.FETCH_STATE_RPC)
                self._count(buddy.node_name, snap, "socket" if link is not None else "grpc")
            except (grpc.RpcError, dataplane.LinkFailed, WireError) as e:
                # the checkpoint stays incomplete; the last one holds
                log.warning("job %s stage %d: could not keep the step %d snapshot on buddy %s: "
                            "%s", stage.job_id, stage.key.stage, snap.step, buddy.node_name,
                            e.details() if isinstance(e, grpc.RpcError) else e)
                return
        # a stage that ran its last steps while its buddy took this snapshot (DONE) still
        # says so: the checkpoint is complete (one stopped, of an old epoch, says nothing)
        if stage.live or stage.state == StageState.DONE:
            self.reporter.report(stage, tracker_pb2.StageReport.STATUS_CHECKPOINT,
                                 step=snap.step)
            # the heartbeats say it too, for a tracker that takes over before it counts this
            self.snapshots.acked(stage.job_id, stage.key, stage.epoch, snap.step)

    def _count(self, buddy: str, snap: Snapshot, transport: str) -> None:
        """Count a snapshot shipped to ``buddy`` in the node's link metrics, a tensor each."""
        metrics = self.reporter.metrics
        if metrics is not None:  # sizes from a file's header: nothing is read again
            skeleton = next(checkpoint.to_tensors(snap))[1]
            for nbytes in (skeleton.numel(), *snap.sizes().values()):
                metrics.sent(buddy, Kind.SNAPSHOT, nbytes, nbytes, transport=transport)

    def close(self) -> None:
        """Ship nothing more (node shutdown)."""
        self.shipper.shutdown(wait=False, cancel_futures=True)


class SnapshotDesk:
    """Snapshots in and out of this node over RPC: a buddy's (or the job's client's,
    restoring a saved checkpoint) kept by PutSnapshot, and those FetchSnapshot serves;
    and a buddy's over the socket data plane, tensor by tensor (:meth:`admit_part`,
    :meth:`add_part`).

    Args:
        snapshots: where this node keeps snapshots.
        holds_job: whether this node holds a stage (of any state) of a job; it keeps
            no snapshot of a job it holds nothing of.
        job_bytes: the most bytes one job's snapshots may take on this node.
    """

    def __init__(self, snapshots: SnapshotStore, holds_job: Callable[[str], bool],
                 job_bytes: int):
        self.snapshots, self.holds_job, self.job_bytes = snapshots, holds_job, job_bytes
        self._lock = threading.Lock()
        # snapshots coming over socket links, by (sender, job, replica, stage): at most one
        # each (a sender ships one at a time; a new skeleton drops an unfinished one)
        self._parts: dict[tuple[str, str, int, int], tuple[int, checkpoint.Assembler]] = {}

    def receive(self, stream: Iterator[bytes],
                check: Callable[[node_pb2.Envelope], None]) -> None:
        """Keep the snapshot ``stream`` carries once ``check`` passed its envelope (before a
        byte of it is buffered), within :data:`MAX_SNAPSHOT_BYTES` and the job's room.

        Raises:
            SnapshotTooLarge: past either limit (the message gives both).
            WireError: a malformed or truncated snapshot, or one whose envelope is not a
                snapshot's.
            NoSuchStage: this node holds no stage of that job (it is no buddy of it).
            SecurityError: as ``check`` raises (or any other error of it).
        """
        try:
            first = next(stream, None)
            head = None if first is None else peek_header(first)
            if first is None or head is None:
                raise WireError("a snapshot stream must start with a header frame")
            env = head.envelope
            check(env)
            limit = self.snapshots.room(env.job_id, StageKey(env.replica, env.stage),
                                        self.job_bytes)
            self.keep(itertools.chain([first], stream), min(limit, MAX_SNAPSHOT_BYTES))
        except checkpoint.SnapshotTooLarge as e:
            raise checkpoint.SnapshotTooLarge(
                f"snapshot refused: {e} (a snapshot may take at most {MAX_SNAPSHOT_BYTES} "
                f"bytes, one job's kept snapshots {self.job_bytes} bytes on this node)") from e
        except WireError as e:
            raise WireError(f"malformed snapshot: {e}") from e

    def admit_part(self, sender: str, head: node_pb2.Frame,
                   check: Callable[[node_pb2.Envelope], None]) -> int:
        """Check one tensor of a snapshot coming over a socket link from ``sender`` (its
        envelope on every tensor, :func:`send_snapshot`) before its payload is read;
        return its size limit, bytes. Its skeleton (the first) passes ``check`` and starts
        the snapshot, within :data:`MAX_SNAPSHOT_BYTES` and the job's room.

        Raises:
            SnapshotTooLarge: past either limit.
            WireError: a tensor of no snapshot started, or of another step.
            SecurityError: as ``check`` raises (or any other error of it).
        """
        env = head.envelope
        key = (sender, env.job_id, env.replica, env.stage)
        try:
            if head.name == checkpoint.SKELETON:
                check(env)
                room = self.snapshots.room(env.job_id, StageKey(env.replica, env.stage),
                                           self.job_bytes)
                self._drop(key)  # an unfinished one of this sender's: its file goes
                with self._lock:
                    self._parts[key] = (env.step, checkpoint.Assembler(
                        min(room, MAX_SNAPSHOT_BYTES), self._sink))
            with self._lock:
                step, assembler = self._parts.get(key, (-1, None))
            if assembler is None or step != env.step:
                raise WireError(f"snapshot tensor {head.name!r} of step {env.step} of stage "
                                f"{env.stage} (replica {env.replica}) of job {env.job_id!r} "
                                "before its skeleton")
            return assembler.admit(head)
        except checkpoint.SnapshotTooLarge as e:
            self._drop(key)
            raise checkpoint.SnapshotTooLarge(
                f"snapshot refused: {e} (a snapshot may take at most {MAX_SNAPSHOT_BYTES} "
                f"bytes, one job's kept snapshots {self.job_bytes} bytes on this node)") from e

    def add_part(self, sender: str, head: node_pb2.Frame, tensor: torch.Tensor) -> bool:
        """Take one tensor :meth:`admit_part` admitted; keep the snapshot once it has them
        all; whether it was the last (the snapshot is kept now).

        Raises:
            WireError: a malformed snapshot (or a tensor of none started).
            NoSuchStage: as :meth:`keep`.
            OSError: a disk store could not write it (what it wrote is removed).
        """
        env = head.envelope
        key = (sender, env.job_id, env.replica, env.stage)
        with self._lock:
            _, assembler = self._parts.get(key, (-1, None))
        try:
            if assembler is None:
                raise WireError(f"snapshot tensor {head.name!r} of no snapshot started")
            assembler.add(head, tensor)
            if not assembler.complete:
                return False
            self._drop(key)
            self._kept(*assembler.finish())
            return True
        except (NoSuchStage, OSError):  # a full disk: its partial file goes, even if complete
            self._drop(key)
            if assembler is not None:
                assembler.abort()
            raise
        except WireError as e:
            self._drop(key)
            raise WireError(f"malformed snapshot: {e}") from e

    def _drop(self, key: tuple[str, str, int, int]) -> None:
        with self._lock:
            _, assembler = self._parts.pop(key, (-1, None))
        if assembler is not None and not assembler.complete:
            assembler.abort()

    def _sink(self, first: node_pb2.Frame, snap: Snapshot) -> checkpoint.Sink | None:
        """Where a disk store writes a buddy's snapshot as its tensors come (checked on its
        skeleton first, :meth:`_check`); None: kept in memory."""
        if not self.snapshots.on_disk:
            return None
        self._check(first.envelope, snap.step)
        env = first.envelope
        return self.snapshots.writer(env.job_id, StageKey(env.replica, env.stage), snap)

    def keep(self, stream: Iterator[bytes], max_bytes: int = MAX_SNAPSHOT_BYTES) -> None:
        """Keep the snapshot ``stream`` carries, of at most ``max_bytes``.

        Raises:
            SnapshotTooLarge: the snapshot's tensors would take more than ``max_bytes``.
            WireError: a malformed or truncated snapshot, or one whose envelope is not a
                snapshot's.
            NoSuchStage: this node holds no stage of that job (it is no buddy of it).
        """
        self._kept(*checkpoint.from_frames(stream, max_bytes, self._sink))

    def _kept(self, first: node_pb2.Frame, snap: Snapshot) -> None:
        """Keep a received snapshot whose first frame is ``first``.

        Raises:
            WireError: its envelope is not a snapshot's of its step.
            NoSuchStage: this node holds no stage of that job.
        """
        env = first.envelope
        self._check(env, snap.step)
        self.snapshots.put(env.job_id, StageKey(env.replica, env.stage), snap)

    def _check(self, env: node_pb2.Envelope, step: int) -> None:
        """Whether this node keeps a snapshot of ``step`` with envelope ``env``.

        Raises:
            WireError: its envelope is not a snapshot's of its step.
            NoSuchStage: this node holds no stage of that job.
        """
        if env.kind != Kind.SNAPSHOT or env.step != step:
            raise WireError(f"a snapshot stream needs a KIND_SNAPSHOT envelope of its step "
                            f"{step}, got kind {env.kind} step {env.step}")
        if not self.holds_job(env.job_id):
            raise NoSuchStage(f"this node runs no stage of job {env.job_id!r}; it keeps no "
                              f"snapshot of it")

    def snapshot(self, job_id: str, key: StageKey, step: int, layer_start: int = 0,
                 layer_end: int = 0) -> Snapshot:
        """The snapshot of stage ``key`` of ``job_id`` at ``step`` kept here; with
        ``layer_end`` > 0 only layers ``[layer_start, layer_end)``, in layer form.

        Raises:
            NoSuchSnapshot: none kept.
            SplitError: those layers cannot be cut from it.
        """
        snap = self.snapshots.get(job_id, key, step)
        if snap is None:
            raise NoSuchSnapshot(f"no step {step} snapshot of stage {key.stage} (replica "
                                 f"{key.replica}) of job {job_id!r} here; kept: "
                                 f"{self.snapshots.steps(job_id, key)}")
        if layer_end > 0:  # only the layers that change hands
            snap = layerstate.split(snap, layer_start, layer_end)
        return snap
