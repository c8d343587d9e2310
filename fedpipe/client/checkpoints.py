"""A job's complete checkpoint on the client's disk: safetensors plus a JSON file.

A checkpoint is a folder with two files:

- ``tensors.safetensors``: every tensor of every stage's snapshot
  (:mod:`fedpipe.runtime.checkpoint`: weights, optimizer state, LR schedule,
  DiLoCo outer state, codec residuals), named ``r{replica}.s{stage}/{path}``,
  e.g. ``r0.s1/optimizer/state/0/exp_avg``, in the safetensors format (a JSON
  header of names, dtypes, shapes and offsets, then the raw bytes: no pickles);
- ``checkpoint.json``: the metadata: ``step`` (steps done; the next step to run),
  ``steps``, the ``plan`` (as protobuf JSON), the job's ``config`` (its settings,
  pickles left out), and per stage its layer range and the *skeleton* of its
  state (everything that is not a tensor: hyper-parameters, step counters).

Both files are written beside their final names and renamed into place, the
JSON last, so a folder with a ``checkpoint.json`` is complete. A checkpoint
directory (``submit(checkpoint_dir=...)``) holds one such folder per kept
step, ``step-00000012``, and the newest :data:`KEEP` are kept.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from ..proto import node_pb2
from ..runtime import layerstate
from ..runtime.checkpoint import Snapshot
from ..spec import StageKey

TENSORS = "tensors.safetensors"
META = "checkpoint.json"
FORMAT = "fedpipe-checkpoint/1"
KEEP = 2
"""Checkpoints a checkpoint directory keeps (the newest)."""


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete or not fedpipe's."""


@dataclass
class SavedCheckpoint:
    """A job's complete checkpoint: every stage's snapshot after ``step`` steps.

    Attributes:
        step: steps done (the next step to run).
        snapshots: each stage's snapshot, by (replica, stage).
        layers: each stage's layer range ``(start, end)``, end exclusive.
        meta: the rest of ``checkpoint.json`` (steps, plan, config).
    """

    step: int
    snapshots: dict[StageKey, Snapshot]
    layers: dict[StageKey, tuple[int, int]]
    meta: dict

    @property
    def depth(self) -> int:
        """Stages per replica group."""
        return 1 + max(k.stage for k in self.snapshots)

    @property
    def replicas(self) -> int:
        """Replica groups."""
        return 1 + max(k.replica for k in self.snapshots)

    def for_stage(self, key: StageKey, start: int, end: int) -> Snapshot:
        """The snapshot that restores stage ``key`` of a plan holding layers ``[start, end)``:
        the saved one if the checkpoint's stage ``key`` held the same layers, else the
        pieces of its replica group's stages that held them, in layer form
        (:mod:`fedpipe.runtime.layerstate`; a node assembles its stage from it).

        Raises:
            CheckpointError: the checkpoint has no replica group ``key.replica``, or its
                state cannot be split (the message names the part).
        """
        if self.layers.get(key) == (start, end):
            return self.snapshots[key]
        held = {k: r for k, r in self.layers.items() if k.replica == key.replica}
        if not held:
            raise CheckpointError(f"the checkpoint has {self.replicas} replica group(s), none "
                                  f"for group {key.replica} of the new plan")
        try:
            return layerstate.merge([layerstate.split(self.snapshots[k], max(a, start),
                                                      min(b, end))
                                     for k, (a, b) in sorted(held.items())
                                     if max(a, start) < min(b, end)])
        except layerstate.SplitError as e:
            raise CheckpointError(f"cannot re-split the checkpoint for layers {start}-{end - 1} "
                                  f"of stage {key.stage}: {e}") from None


def _prefix(key: StageKey) -> str:
    return f"r{key.replica}.s{key.stage}/"


def write(path: str | os.PathLike, step: int, snapshots: dict[StageKey, Snapshot],
          plan: node_pb2.Plan, *, steps: int, config: dict | None = None) -> Path:
    """Write a checkpoint folder at ``path`` (created; files in it replaced); return it.

    Raises:
        OSError: the folder cannot be written.
    """
    from safetensors.torch import save_file  # only who writes checkpoints needs it

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    ranges = {(a.replica, a.stage): (a.layer_start, a.layer_end) for a in plan.stages}
    tensors, stages = {}, []
    for key, snap in sorted(snapshots.items()):
        for name, t in snap.tensors.items():
            tensors[_prefix(key) + name] = t.contiguous()
        start, end = ranges.get((key.replica, key.stage), (0, 0))
        stages.append({"replica": key.replica, "stage": key.stage, "layer_start": start,
                       "layer_end": end, "skeleton": snap.skeleton})
    meta = {"format": FORMAT, "step": step, "steps": steps,
            "plan": json_format.MessageToDict(plan), "config": config or {}, "stages": stages}
    tmp = folder / (TENSORS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "step": str(step)})
    os.replace(tmp, folder / TENSORS)
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, folder / META)
    return folder


def read(path: str | os.PathLike) -> SavedCheckpoint:
    """The checkpoint in folder ``path``, or the newest one in checkpoint directory ``path``.

    Raises:
        CheckpointError: no complete checkpoint there, or a file that does not
            hold what the metadata names.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / META).is_file():
        newest = latest(folder)
        if newest is None:
            raise CheckpointError(f"{folder} holds no complete fedpipe checkpoint "
                                  f"(no {META}, nor step-* folders with one)")
        folder = newest
    try:
        meta = json.loads((folder / META).read_text())
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{folder / META} is not a {FORMAT} file")
        tensors = load_file(str(folder / TENSORS))
        snapshots, layers = {}, {}
        for st in meta["stages"]:
            key = StageKey(int(st["replica"]), int(st["stage"]))
            prefix = _prefix(key)
            snapshots[key] = Snapshot(int(meta["step"]), skeleton=st["skeleton"], tensors={
                name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)})
            layers[key] = (int(st["layer_start"]), int(st["layer_end"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError, SafetensorError) as e:
        # RecursionError: a checkpoint.json nested too deep for json
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"cannot read the checkpoint in {folder}: {e}") from None
    if not snapshots:
        raise CheckpointError(f"the checkpoint in {folder} has no stage")
    return SavedCheckpoint(int(meta["step"]), snapshots, layers, meta)


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder in a checkpoint directory, or None."""
    folders = sorted(p for p in Path(directory).glob("step-*") if (p / META).is_file())
    return folders[-1] if folders else None


def keep(directory: str | os.PathLike, step: int, snapshots: dict[StageKey, Snapshot],
         plan: node_pb2.Plan, *, steps: int, config: dict | None = None) -> Path:
    """Add the checkpoint of ``step`` to a checkpoint directory and drop all but the
    newest :data:`KEEP`; return its folder.

    Raises:
        OSError: the directory cannot be written.
    """
    directory = Path(directory)
    folder = directory / f"step-{step:08d}"
    tmp = directory / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp, step, snapshots, plan, steps=steps, config=config)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    for old in sorted(directory.glob("step-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return folder
