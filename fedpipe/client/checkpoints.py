"""A job's complete checkpoint on the client's disk: safetensors shards plus JSON.

A checkpoint is a folder, written a stage at a time, each stage a tensor at a time as it
streams from its node (the client holds one tensor, however big the model; :func:`pull`,
:class:`~fedpipe.runtime.tensorfile.TensorFileWriter`):

- the model's weights in the Hugging Face layout: one shard per stage of replica
  group 0, ``model-0000k-of-0000n.safetensors``, and ``model.safetensors.index.json``
  (its ``weight_map`` names the shard of each tensor); ``model.safetensors`` alone
  when there is one stage. Each tensor has its *model name*: layer 3's ``weight`` is
  ``"3.weight"`` (an ``nn.Sequential``'s own), or the checkpoint's name for a job
  submitted from :func:`fedpipe.hf.sequential` (``"transformer.h.2.attn.c_attn.weight"``;
  a tied copy is stored once, as ``transformers`` stores it), whose ``config.json``
  is written too: ``from_pretrained(folder)`` loads the original architecture, and
  ``submit(..., weights=folder)`` starts a job from it;
- ``state-r{replica}-s{stage}.safetensors``: the rest of each stage's snapshot
  (:mod:`fedpipe.runtime.checkpoint`: optimizer state, LR schedule, DiLoCo outer
  state, codec residuals; other replica groups' weights; a tied copy), named by its
  snapshot path, e.g. ``optimizer/state/0/exp_avg``;
- ``checkpoint.json``: the metadata: ``step`` (steps done; the next step to run),
  ``steps``, the ``plan`` (as protobuf JSON), the job's ``config`` (its settings,
  pickles left out), and per stage its layer range, its state file, the model name of
  each of its weights in the shards, and the *skeleton* of its state (everything
  that is not a tensor: hyper-parameters, step counters).

safetensors files hold a JSON header of names, dtypes, shapes and offsets, then the
raw bytes: no pickles. ``checkpoint.json`` is written last (beside its final name,
then renamed), so a folder with one is complete. A checkpoint directory
(``submit(checkpoint_dir=...)``) holds one such folder per kept step,
``step-00000012``, and the newest :data:`KEEP` are kept. Folders of the first format
(every tensor in ``tensors.safetensors``) are still read.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf import json_format
from torch import nn

from ..hf import checkpoint_names
from ..net import timeouts
from ..net.dataplane import DataPlane
from ..net.dataplane.records import Method
from ..proto import node_pb2
from ..runtime import layerstate
from ..runtime import checkpoint
from ..runtime.checkpoint import Snapshot, SnapshotStream
from ..runtime.tensorfile import TensorFileError, TensorFileWriter
from ..runtime.weights import (INDEX_NAME, SINGLE_NAME, KeyMap, WeightFiles, WeightsError,
                               sequential_keys)
from ..spec import TERMINAL, JobSpec, PlanView, StageKey, state_name
from ..units import layer_range
from ..wire import frames
from ..wire.format import WireError
from ..wire.codecs import MAX_TENSOR_BYTES
from . import links
from .errors import CheckpointGone

TENSORS = "tensors.safetensors"
"""The first format's one file of every tensor (read, no longer written)."""
META = "checkpoint.json"
FORMAT = "fedpipe-checkpoint/2"
FORMAT_1 = "fedpipe-checkpoint/1"
KEEP = 2
"""Checkpoints a checkpoint directory keeps (the newest)."""
TMP_PREFIX = ".tmp-step-"
"""A checkpoint directory's folder of a checkpoint being written (:func:`keep`)."""


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


def state_file(key: StageKey) -> str:
    """The file of stage ``key``'s state other than its model weights."""
    return f"state-r{key.replica}-s{key.stage}.safetensors"


def shard_file(stage: int, n_stages: int) -> str:
    """The model shard of stage ``stage`` (replica group 0) of ``n_stages``."""
    return SINGLE_NAME if n_stages == 1 else \
        f"model-{stage + 1:05d}-of-{n_stages:05d}.safetensors"


class CheckpointWriter:
    """Writes a checkpoint folder a stage at a time (see the module docstring).

    Args:
        path: the folder (created at the first file written, so a save that fetches
            nothing leaves none; a checkpoint there before is replaced by :meth:`close`,
            and stays whole until then: each file is written aside, as ``NAME.tmp``, and
            they all take their names in :meth:`close`, so a save that fails midway leaves
            the earlier checkpoint readable; that needs the disk space of both).
        plan: the job's plan (layer ranges; replica group 0's depth names the shards).
        names: a layer's key -> its model names (the first is used).
        skip: ``skip(layer, key)``: a weight kept out of the shards (a tied copy; it
            goes to the stage's state file).
        model_config: written as ``config.json`` by its ``save_pretrained`` (a
            ``transformers`` config), or None.
    """

    def __init__(self, path: str | os.PathLike, plan: node_pb2.Plan, *,
                 names: KeyMap = sequential_keys,
                 skip: Callable[[int, str], bool] = lambda i, k: False,
                 model_config: Any = None):
        self.folder = Path(path)
        self._pending: list[str] = []  # files written aside, named in close()
        self._ranges = {StageKey(a.replica, a.stage): (a.layer_start, a.layer_end)
                        for a in plan.stages}
        self._depth = 1 + max((k.stage for k in self._ranges if k.replica == 0), default=0)
        self._names, self._skip, self._config = names, skip, model_config
        self._plan = plan
        self._stages: list[dict] = []
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._files: set[str] = set()
        self._made = False

    def _model_name(self, key: StageKey, path: str) -> str | None:
        """The model name of snapshot tensor ``path`` of stage ``key``, or None if it
        stays in the state file.

        Raises:
            WireError: a ``module/`` path whose layer is not one of the stage's (a node's
                skeleton cannot name another stage's layer, or one past the model).
        """
        if not path.startswith("module/"):
            return None
        local, _, name = path[len("module/"):].partition(".")
        start, end = self._ranges.get(key, (0, 0))
        if not (local.isascii() and local.isdigit()) or (
                key in self._ranges and int(local) >= end - start):
            raise WireError(f"stage {key.stage}'s snapshot names {path!r}: not a layer of the "
                            f"stage's {end - start} ({layer_range(start, end)})")
        layer = start + int(local)
        if self._skip(layer, name):
            return None
        try:
            return self._names(layer, name)[0]
        except KeyError:  # a tensor without a checkpoint name: kept with the state
            return None

    def add(self, key: StageKey, snap: Snapshot | SnapshotStream) -> None:
        """Write stage ``key``'s snapshot, a tensor at a time as it comes (a
        :class:`~fedpipe.runtime.checkpoint.SnapshotStream` is never held whole): its
        replica group 0 weights to its shard, the rest to its state file
        (:class:`~fedpipe.runtime.tensorfile.TensorFileWriter`). A stage that fails midway
        leaves nothing of itself in the checkpoint.

        Raises:
            WeightsError: two tensors would get one model name.
            OSError: a file cannot be written.
            WireError: a streamed snapshot that is malformed or cut short, or that names
                a layer not of its stage, or a tensor its skeleton does not name.
        """
        start, end = self._ranges.get(key, (0, 0))
        named: dict[str, str] = {}  # snapshot path -> model name, for the shard
        for path in sorted(checkpoint.tensor_paths(snap)):
            name = self._model_name(key, path) if key.replica == 0 else None
            if name is None:
                continue
            if name in self._weight_map or name in named.values():
                raise WeightsError(f"stage {key.stage}: {path!r} would be saved as "
                                   f"{name!r}, a name already written")
            named[path] = name
        paths = checkpoint.tensor_paths(snap)
        folder = self._folder()
        files = [TensorFileWriter(folder / (state_file(key) + ".tmp"),
                                  paths - set(named), {"format": "pt"})]
        if key.replica == 0:
            files.append(TensorFileWriter(folder / (shard_file(key.stage, self._depth) + ".tmp"),
                                          named.values(), {"format": "pt"}))
        items: Iterable[tuple[str, torch.Tensor]] = (
            snap.tensors.items() if isinstance(snap.tensors, Mapping) else snap.tensors)
        try:
            try:
                for path, t in items:
                    if path in named:
                        files[1].add(named[path], t)
                    else:
                        files[0].add(path, t)
                    del t  # not held while the next one is read
                done = [f.close() for f in files]
            except TensorFileError as e:  # a tensor its skeleton does not name, or a dtype
                raise WireError(f"stage {key.stage}'s snapshot: {e}") from None
        except BaseException:
            for f in files:
                f.abort()
            raise
        for file in done:
            self._pending.append(file.name[:-len(".tmp")])
            self._files.add(file.name[:-len(".tmp")])
        if key.replica == 0:
            self._weight_map.update((n, done[1].name[:-len(".tmp")]) for n in named.values())
            self._total += files[1].nbytes
        self._stages.append({"replica": key.replica, "stage": key.stage, "layer_start": start,
                             "layer_end": end, "state": state_file(key), "weights": named,
                             "skeleton": snap.skeleton})

    def _folder(self) -> Path:
        """The folder, made on first use (an earlier failed save's files aside removed)."""
        if not self._made:
            self.folder.mkdir(parents=True, exist_ok=True)
            for tmp in (*self.folder.glob("model*.safetensors.tmp*"),  # an earlier save's
                        *self.folder.glob("state-*.safetensors.tmp*")):  # that failed
                tmp.unlink()
            self._made = True
        return self.folder

    def close(self, step: int, steps: int, config: dict | None = None) -> Path:
        """Write the index, ``config.json`` and ``checkpoint.json`` (last); drop files
        of an earlier checkpoint in the folder that this one does not have; return
        the folder."""
        (self._folder() / META).unlink(missing_ok=True)  # incomplete until its last line
        for name in self._pending:
            os.replace(self.folder / (name + ".tmp"), self.folder / name)
        self._pending.clear()
        if self._depth > 1:
            self._text(INDEX_NAME, json.dumps({"metadata": {"total_size": self._total},
                                               "weight_map": self._weight_map}, indent=2))
        if self._config is not None:
            self._config.save_pretrained(self.folder)
        for old in (*self.folder.glob("model*.safetensors"), *self.folder.glob("state-*"),
                    self.folder / TENSORS, self.folder / INDEX_NAME):
            if old.name not in self._files and old.is_file():
                old.unlink()
        meta = {"format": FORMAT, "step": step, "steps": steps,
                "plan": json_format.MessageToDict(self._plan), "config": config or {},
                "stages": sorted(self._stages, key=lambda s: (s["replica"], s["stage"]))}
        self._text(META, json.dumps(meta, indent=1))
        return self.folder

    def _text(self, name: str, text: str) -> None:
        tmp = self.folder / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.folder / name)
        self._files.add(name)


def write(path: str | os.PathLike, step: int,
          snapshots: Iterable[tuple[StageKey, Snapshot | SnapshotStream]]
          | Mapping[StageKey, Snapshot],
          plan: node_pb2.Plan, *, steps: int, config: dict | None = None,
          names: KeyMap = sequential_keys, skip: Callable[[int, str], bool] = lambda i, k: False,
          model_config: Any = None) -> Path:
    """Write a checkpoint folder at ``path`` from ``snapshots`` (each stage's, taken one
    at a time from an iterable: only one is held; a streamed one, :func:`pull`, a tensor
    at a time) with a :class:`CheckpointWriter`; return it.

    Raises:
        WeightsError: two tensors would get one model name.
        OSError: the folder cannot be written.
        WireError: a streamed snapshot that is malformed or cut short.
    """
    writer = CheckpointWriter(path, plan, names=names, skip=skip, model_config=model_config)
    items = sorted(snapshots.items()) if isinstance(snapshots, Mapping) else snapshots
    for key, snap in items:
        writer.add(key, snap)
        del snap  # the next stage's snapshot is pulled without this one held
    return writer.close(step, steps, config)


def _stage_tensors(folder: Path, st: dict, key: StageKey,
                   files: WeightFiles | None, old: Mapping[str, torch.Tensor] | None
                   ) -> dict[str, torch.Tensor]:
    """One stage's snapshot tensors by path, from either format."""
    from safetensors.torch import load_file

    if old is not None:  # the first format: one file, names prefixed by stage
        prefix = _prefix(key)
        return {n[len(prefix):]: t for n, t in old.items() if n.startswith(prefix)}
    tensors = load_file(str(folder / Path(st["state"]).name))
    for path, name in st.get("weights", {}).items():
        if files is None:
            raise CheckpointError(f"{folder} has no model weights ({INDEX_NAME} or "
                                  f"{SINGLE_NAME}) but stage {key.stage} names {name!r}")
        tensors[path] = files.tensor(name)
    return tensors


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
        if meta.get("format") not in (FORMAT, FORMAT_1):
            raise CheckpointError(f"{folder / META} is not a {FORMAT} file")
        old = load_file(str(folder / TENSORS)) if meta["format"] == FORMAT_1 else None
        has_model = (folder / INDEX_NAME).is_file() or (folder / SINGLE_NAME).is_file()
        snapshots, layers = {}, {}
        with contextlib.ExitStack() as stack:
            files = stack.enter_context(WeightFiles(folder)) if has_model else None
            for st in meta["stages"]:
                key = StageKey(int(st["replica"]), int(st["stage"]))
                snapshots[key] = Snapshot(int(meta["step"]), skeleton=st["skeleton"],
                                          tensors=_stage_tensors(folder, st, key, files, old))
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


def keep(directory: str | os.PathLike, step: int,
         snapshots: Iterable[tuple[StageKey, Snapshot | SnapshotStream]]
         | Mapping[StageKey, Snapshot],
         plan: node_pb2.Plan, *, steps: int, config: dict | None = None,
         **layout: Any) -> Path:
    """Add the checkpoint of ``step`` to a checkpoint directory (written a stage at a
    time, as :func:`write` with ``layout``: names, skip, model_config, into
    ``.tmp-step-NNNNNNNN`` beside it, renamed when complete) and drop all but the newest
    :data:`KEEP`; return its folder. A checkpoint that fails midway leaves nothing (its
    ``.tmp-`` folder is removed) and the directory as it was.

    Raises:
        OSError: the directory cannot be written.
        Whatever pulling ``snapshots`` raises (:func:`pull`).
    """
    directory = Path(directory)
    folder = directory / f"step-{step:08d}"
    tmp = directory / f"{TMP_PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp, step, snapshots, plan, steps=steps, config=config, **layout)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    for old in sorted(directory.glob("step-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def sweep(directory: str | os.PathLike) -> None:
    """Remove the ``.tmp-`` folders of checkpoints :func:`keep` did not finish in a
    checkpoint directory (a process killed while it wrote one); call it only while
    nothing keeps a checkpoint there."""
    for tmp in Path(directory).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


# -- pulling a job's state from its nodes (Job.save, checkpoint_dir, Job.state_dict) ----

NodeOf = Callable[[str], Any]
"""``node(address)``: a node's stub (``fedpipe.v1.Node``), as :meth:`Client.node` gives."""


def layout(model: nn.Sequential | None, names: KeyMap | None, spec: JobSpec | None
           ) -> dict[str, Any]:
    """How a save names a job's weights (:class:`CheckpointWriter`'s ``names``, ``skip``,
    ``model_config``): ``names`` given at submit, else a :func:`fedpipe.hf.sequential`
    ``model``'s checkpoint names and config, else an ``nn.Sequential``'s own; a tied copy
    (``spec``'s ties) is stored once (its source)."""
    out: dict[str, Any] = {}
    found = checkpoint_names(model) if model is not None else None
    if found is not None:
        out["names"], out["model_config"] = found
    if names is not None:
        out["names"] = names
    ties = spec.weights.ties if spec is not None else ()
    if ties:
        copies = {member for group in ties for member in group[1:]}
        out["skip"] = lambda i, key: (i, key) in copies
    return out


def pull(node: NodeOf, job_id: str, plan: node_pb2.Plan, step: int, state: int,
         plane: DataPlane | None = None) -> Iterator[tuple[StageKey, SnapshotStream]]:
    """Each stage's snapshot of ``step``, streamed when asked for (a tensor at a time:
    a save holds one tensor of it, :meth:`CheckpointWriter.add`), from its node, else
    any node of the plan (its buddy holds a copy) if it fails before the snapshot's
    first frame: over ``plane`` (the client's socket data plane) from a node that offers
    a data port, else over gRPC (:func:`fetch_snapshot`). ``state``: the job's, for the
    error.

    Raises:
        CheckpointGone: every node answered NOT_FOUND for one stage's snapshot.
        grpc.RpcError: no node has one stage's snapshot (the last node's error, when
            it is not NOT_FOUND), or a stream failed midway (from the tensors; over the
            socket plane a :class:`~.links.LinkError` with the same code).
    """
    view = PlanView(plan)
    nodes = {a.address: a for a in view.stages.values()}
    for key, a in sorted(view.stages.items()):
        others = [nodes[address] for address in sorted(nodes.keys() - {a.address})]
        request = node_pb2.FetchSnapshotRequest(job_id=job_id, replica=key.replica,
                                                stage=key.stage, step=step)
        for i, source in enumerate([a] + others):
            try:
                snap = fetch_snapshot(node, source, request, plane)
            except grpc.RpcError as e:
                if i < len(others):
                    continue
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                raise CheckpointGone(gone_message(job_id, key, state, step)) from None
            yield key, snap
            del snap
            break


def fetch_snapshot(node: NodeOf, source: node_pb2.StageAssignment,
                   request: node_pb2.FetchSnapshotRequest, plane: DataPlane | None = None
                   ) -> SnapshotStream:
    """The snapshot ``request`` names from the node of ``source`` (a stage assignment of
    the plan: its gRPC address, name and data port), read as it comes: over ``plane``
    (:func:`.links.fetch_snapshot`) where it offers a data port, else gRPC's
    ``FetchSnapshot``; at most :data:`~fedpipe.wire.codecs.MAX_TENSOR_BYTES` in all, the
    one assembly and its checks being :func:`~fedpipe.runtime.checkpoint.stream_tensors`.

    Raises:
        grpc.RpcError: the node refused it (NOT_FOUND: it holds no such snapshot) or is
            unreachable, before its skeleton came (a :class:`~.links.LinkError` over
            the socket plane).
        WireError: a malformed snapshot (and, from its tensors, as they fail).
    """
    if plane is not None and source.data_address:
        return links.fetch_snapshot(plane, source, request, MAX_TENSOR_BYTES)
    stream = node(source.address).FetchSnapshot(request, timeout=timeouts.FETCH_STATE_RPC)
    return checkpoint.stream_frames(stream, MAX_TENSOR_BYTES, in_place=True)[1]


KEEP_WEIGHTS = ("to keep a job's weights, fetch them before it is released "
                "(job.state_dict(), job.save(path)), or submit it with "
                "checkpoint_dir=CHECKPOINT_DIR: submit(..., resume_from=CHECKPOINT_DIR) starts "
                "a new job from a kept checkpoint")
"""What to do about weights that are gone (the end of :func:`gone_message`'s for them)."""


def gone_message(job_id: str, key: StageKey, state: int, step: int | None = None) -> str:
    """:class:`CheckpointGone`'s message: the job, the stage and why its state is gone.

    Args:
        state: the job's (why: a cancelled or failed job's nodes dropped it; else they
            no longer hold it: released, or restarted).
        step: the checkpoint step whose snapshot is gone (:meth:`Job.save`); None: the
            stage's trained weights are gone (:meth:`Job.state_dict`), and the message
            ends with what to do (:data:`KEEP_WEIGHTS`).
    """
    what, them = ("snapshots", "it") if step is not None else ("weights", "them")
    why = {"CANCELLED": f"the job was cancelled and its nodes dropped its {what}",
           "FAILED": f"the job failed and its nodes dropped its {what}",
           }.get(state_name(state), f"its nodes no longer hold {them} (released, or they "
                                    f"restarted)")
    where = f"stage {key.stage} (replica group {key.replica})"
    if step is not None:
        return (f"job {job_id}: the checkpoint of step {step} is gone: no node holds the "
                f"snapshot of {where}; {why}")
    return f"job {job_id}: the trained weights of {where} are gone: {why}; {KEEP_WEIGHTS}"


def stage_weights(node: NodeOf, job_id: str, plan: node_pb2.Plan, stage: int | None = None,
                  plane: DataPlane | None = None, state: int = 0) -> dict[str, torch.Tensor]:
    """The trained weights of replica group 0's stages (or of stage ``stage`` alone),
    fetched from their nodes (``FetchState``), keyed as the model's own state_dict
    (``"3.weight"``: layer 3's ``weight``): over ``plane`` (the client's socket data
    plane) from a node that offers a data port (a relayed one through its relay's),
    else over gRPC. ``state``: the job's, for the error (0: not known).

    Raises:
        ValueError: the plan has no stage ``stage``.
        CheckpointGone: the job has ended (``state``) and a stage's node no longer holds
            the stage (it answered NOT_FOUND, on either plane: the weights were released,
            or the node restarted); the message names the job and the stage
            (:func:`gone_message`).
        grpc.RpcError: a stage's node is unreachable or refused otherwise, NOT_FOUND
            included while the job is active (a stage being loaded: deploying,
            recovering); over the socket plane a :class:`~.links.LinkError` with the
            same code.
    """
    out: dict[str, torch.Tensor] = {}
    chain = PlanView(plan).chain(0)
    if stage is not None:
        chain = [a for a in chain if a.stage == stage]
        if not chain:
            raise ValueError(f"job {job_id} has no stage {stage}")
    def keep(head: node_pb2.Frame, t: torch.Tensor) -> None:
        out[head.name] = t

    for a in chain:
        request = node_pb2.FetchStateRequest(job_id=job_id, replica=a.replica, stage=a.stage)
        try:
            if plane is not None and a.data_address:
                links.fetch(plane, a, Method.FETCH_STATE, request,
                            lambda head: MAX_TENSOR_BYTES, keep)
                continue
            stream = node(a.address).FetchState(request, timeout=timeouts.FETCH_STATE_RPC)
            for head, t in frames.read_tensors(stream, in_place=True):  # gRPC's messages
                keep(head, t)
        except grpc.RpcError as e:  # a LinkError too: a refusal over the socket plane
            # an active job's stage may not be loaded yet (deploying, recovering): not gone
            if e.code() != grpc.StatusCode.NOT_FOUND or state not in TERMINAL:
                raise
            raise CheckpointGone(gone_message(job_id, StageKey(a.replica, a.stage),
                                              state)) from None
    return out
