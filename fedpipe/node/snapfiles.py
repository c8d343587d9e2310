"""A node's snapshot directory (``fedpipe node --snapshot-dir``): its lock, and the
file of one snapshot written a tensor at a time (:class:`SnapshotWriter`, a safetensors
file from :mod:`fedpipe.runtime.tensorfile` whose metadata holds the snapshot's step and
skeleton). :class:`~fedpipe.node.snapshots.SnapshotStore` keeps and prunes the files.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import IO

import torch

from ..runtime import checkpoint, tensorfile
from ..runtime.checkpoint import Snapshot
from ..wire.format import WireError


class SnapshotDirInUse(RuntimeError):
    """A snapshot directory that another live node holds."""


SNAPSHOT_META = "fedpipe.snapshot"
"""The safetensors metadata key of a disk snapshot's ``{"step", "skeleton"}`` JSON."""
LOCK_NAME = ".lock"


def claim_dir(directory: str | os.PathLike) -> IO[str]:
    """Make ``directory`` this process's snapshot directory: take its lock file (an
    exclusive ``flock``, let go when the process ends, however it ends) and remove the
    snapshot files an earlier node left there (a node starts with none). Returns the
    lock file, to keep open for as long as the directory is used.

    Raises:
        SnapshotDirInUse: another live process holds it (the message names its pid).
        OSError: the directory cannot be made or written, or its lock file is a link.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # never through a link: a .lock that links elsewhere would have that file truncated
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    lock = os.fdopen(fd, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise SnapshotDirInUse(f"snapshot directory {path} is in use by another live node "
                               f"(pid {holder}); give each node its own --snapshot-dir"
                               ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    for old in (*path.glob("*.safetensors"), *path.glob("*.safetensors.tmp*")):
        old.unlink(missing_ok=True)
    return lock


class SnapshotWriter:
    """One snapshot written to its file a tensor at a time (a
    :class:`~fedpipe.runtime.checkpoint.Sink`): ``NAME.tmp-TOKEN`` until :meth:`finish`.

    Args:
        path: the file.
        snap: the snapshot's step and skeleton (its tensors are not read).
    """

    def __init__(self, path: Path, snap: Snapshot):
        self.step, self.skeleton = snap.step, snap.skeleton
        meta = {"format": "pt", SNAPSHOT_META: json.dumps({"step": snap.step,
                                                            "skeleton": snap.skeleton})}
        self._file = tensorfile.TensorFileWriter(path, checkpoint.tensor_paths(snap), meta)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write tensor ``name`` (from its own memory).

        Raises:
            WireError: a tensor the skeleton does not name, or one written twice.
            OSError: the write failed.
        """
        try:
            self._file.add(name, t)
        except tensorfile.TensorFileError as e:
            raise WireError(f"snapshot of step {self.step}: {e}") from None

    def finish(self) -> Snapshot:
        """Name the file; the snapshot, reading it.

        Raises:
            WireError: a tensor the skeleton names never came.
            OSError: the write failed.
        """
        try:
            path = self._file.close()
        except tensorfile.TensorFileError as e:
            raise WireError(f"snapshot of step {self.step}: {e}") from None
        return Snapshot(self.step, tensorfile.TensorFile(path), self.skeleton)

    def abort(self) -> None:
        """Remove the partial file."""
        self._file.abort()
