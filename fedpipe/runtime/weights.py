"""Layer weights in safetensors files: read a stage's slice, write shards, digest.

A job that starts from weights names a safetensors file or a sharded directory in
the Hugging Face layout (``model.safetensors.index.json``, whose ``weight_map``
says which shard holds each tensor). ``safetensors.safe_open`` maps a file and
reads one tensor at a time, so a node reads only its own layers' tensors, and the
submit check reads only headers (names, shapes).

Names: layer ``i`` of the pipeline has its own ``state_dict`` keys (``"weight"``,
``"block.ln_1.bias"``); a :data:`KeyMap` gives the file names to look for, first
found wins. :func:`sequential_keys` is an ``nn.Sequential``'s own (``"3.weight"``);
:mod:`fedpipe.hf` gives a Hugging Face checkpoint's, with the tied head falling back
to the input embedding's name.

Writing: :class:`ShardWriter` takes layers as they come (a stage at a time, from the
nodes) and holds one shard at most, so a big save needs no big client;
:func:`save_layers` writes a whole model with it.

Digests (job signing): :func:`layer_digest` hashes a layer's tensors in key order,
each as its key, dtype, shape and bytes, so the client can digest a layer from the
files and the node from what it loaded, and both agree.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from . import tensorfile

KeyMap = Callable[[int, str], Sequence[str]]
"""``names(layer_index, key)``: the file names that may hold that layer's ``key``, in
order of preference."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 * 1024**3  # Hugging Face's default shard size is 5 GB; 2 GiB keeps
# one shard's mapping small on a node with little memory


class WeightsError(ValueError):
    """Weights that do not fit the model: the message names the layer, the key, the
    file names looked for, or both shapes."""


def sequential_keys(index: int, key: str) -> tuple[str, ...]:
    """An ``nn.Sequential``'s own names: layer 3's ``weight`` is ``"3.weight"``."""
    return (f"{index}.{key}",)


class WeightFiles:
    """A safetensors file or a sharded directory, opened lazily (one handle per shard,
    made on first use). Use as a context manager, or call :meth:`close`.

    Raises:
        WeightsError: the path is neither a ``.safetensors`` file nor a directory with
            ``model.safetensors.index.json`` or ``model.safetensors``; an index that is
            not JSON with a ``weight_map``; a shard that is missing or not safetensors
            (here or at first use; each names the file).
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._handles: dict[Path, Any] = {}
        if path.is_file():
            self._where = {k: path for k in self._open(path).keys()}
        elif (path / INDEX_NAME).is_file():
            self._where = {k: path / f for k, f in _weight_map(path / INDEX_NAME).items()}
        elif (path / SINGLE_NAME).is_file():
            self._where = {k: path / SINGLE_NAME for k in self._open(path / SINGLE_NAME).keys()}
        else:
            raise WeightsError(f"{path}: not a safetensors file, nor a directory with "
                               f"{INDEX_NAME} or {SINGLE_NAME}")

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (OSError, SafetensorError) as e:
                raise WeightsError(f"{file}: not a readable safetensors file: {e}") from None
        return self._handles[file]

    def keys(self) -> list[str]:
        """Every tensor name in the file(s)."""
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key`` from the header, no data read."""
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key``, read now (a copy in memory, on the CPU)."""
        return self._open(self._where[key]).get_tensor(key)

    def close(self) -> None:
        """Drop the file handles (and their mappings)."""
        self._handles.clear()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _state_shapes(layer: nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    # state_dict, so non-persistent buffers (made by the layer itself) are not asked for;
    # works on meta layers: only shapes are read.
    for key, t in layer.state_dict(keep_vars=True).items():
        yield key, tuple(t.shape)


def _find(files: WeightFiles, index: int, key: str, names: KeyMap) -> str:
    candidates = tuple(names(index, key))
    for name in candidates:
        if name in files:
            return name
    raise WeightsError(f"layer {index}: no tensor for {key!r} in {files.path} "
                       f"(looked for {', '.join(map(repr, candidates))})")


def _weight_map(index: Path) -> dict[str, str]:
    """The tensor name -> shard file map of a Hugging Face index file.

    Raises:
        WeightsError: not JSON, or no ``weight_map`` object of names to file names.
    """
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as e:  # not JSON (or not UTF-8), or not an object
        raise WeightsError(f"{index}: not a JSON object: {e}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise WeightsError(f"{index}: no \"weight_map\" object of tensor names to shard files")
    return weight_map


def _check_shape(index: int, key: str, name: str, file_shape: Sequence[int],
                 want: Sequence[int]) -> None:
    if tuple(file_shape) != tuple(want):
        raise WeightsError(f"layer {index}: {key!r} has shape {tuple(want)} in the model but "
                           f"{name!r} has shape {tuple(file_shape)} in the weights")


def check_weights(files: WeightFiles, layers: Sequence[nn.Module],
                  names: KeyMap = sequential_keys) -> None:
    """The submit check: every layer's state_dict key has a tensor of its shape in
    ``files`` (headers only; the layers may be on meta).

    Raises:
        WeightsError: the first missing name or mismatched shape, naming the layer.
    """
    for i, layer in enumerate(layers):
        for key, shape in _state_shapes(layer):
            name = _find(files, i, key, names)
            _check_shape(i, key, name, files.shape(name), shape)


def layer_tensors(files: WeightFiles, index: int, layer: nn.Module,
                  names: KeyMap = sequential_keys) -> dict[str, torch.Tensor]:
    """Layer ``index``'s tensors read from ``files``, by the layer's own keys, in its
    state_dict order: what a node loads, or what a client streams to that node.

    Raises:
        WeightsError: a name is missing or a shape differs (naming layer and key).
    """
    out = {}
    for key, shape in _state_shapes(layer):
        name = _find(files, index, key, names)
        _check_shape(index, key, name, files.shape(name), shape)
        out[key] = files.tensor(name)
    return out


def load_layer(layer: nn.Module, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (by the layer's state_dict keys) into materialized layer
    ``index``, converting dtype and device.

    Raises:
        WeightsError: a key is missing, unexpected, or of another shape.
    """
    state = layer.state_dict(keep_vars=True)
    extra = sorted(set(tensors) - set(state))
    if extra:
        raise WeightsError(f"layer {index}: unexpected tensor(s) {', '.join(extra)}")
    with torch.no_grad():
        for key, target in state.items():
            if key not in tensors:
                raise WeightsError(f"layer {index}: no tensor for {key!r}")
            _check_shape(index, key, key, tensors[key].shape, target.shape)
            target.copy_(tensors[key])


def load_layers(path: str | Path, layers: Mapping[int, nn.Module],
                names: KeyMap = sequential_keys) -> None:
    """Load the weights of ``layers`` (layer index -> materialized layer) from the
    safetensors at ``path``, reading only their tensors, one layer at a time.

    Raises:
        WeightsError: as :func:`layer_tensors`.
    """
    with WeightFiles(path) as files:
        for i, layer in layers.items():
            load_layer(layer, i, layer_tensors(files, i, layer, names))


def layer_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) of a layer's tensors in key order: each key, dtype, shape and the
    bytes of its contiguous CPU copy. Pass ``layer.state_dict()`` or
    :func:`layer_tensors`."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ShardWriter:
    """Writes layers as they come (a stage at a time, from a node or a stream) into a
    safetensors directory in Hugging Face's layout, holding at most one shard in memory.

    Each layer's tensors go under their first file name (``names(i, key)[0]``); a layer
    is never split between shards. :meth:`close` gives the shards their final names:
    ``model.safetensors`` when there is one, else ``model-0000k-of-0000n.safetensors``
    and ``model.safetensors.index.json``.

    Raises:
        WeightsError: two tensors would get one name.
    """

    def __init__(self, path: str | Path, names: KeyMap = sequential_keys,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 skip: Callable[[int, str], bool] = lambda i, k: False):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._names, self._skip, self._max = names, skip, max_shard_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add layer ``index``'s tensors (its state_dict keys -> tensors)."""
        kept = {}
        for key, t in tensors.items():
            if self._skip(index, key):
                continue
            name = self._names(index, key)[0]
            if name in self._seen:
                raise WeightsError(f"layer {index}: {key!r} would be saved as {name!r}, "
                                   "a name already written")
            self._seen.add(name)
            kept[name] = t.detach().to("cpu").contiguous()
        nbytes = sum(t.numel() * t.element_size() for t in kept.values())
        if self._shard and self._shard_bytes + nbytes > self._max:
            self._flush()
        self._shard.update(kept)
        self._shard_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        file = self.path / f".shard-{len(self._written):05d}.safetensors.partial"
        tensorfile.write(file, self._shard, {"format": "pt"})
        self._written.append((file, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> Path:
        """Write the last shard, name the shards, write the index; returns the directory."""
        if self._shard or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            self._written[0][0].rename(self.path / SINGLE_NAME)
            return self.path
        weight_map: dict[str, str] = {}
        for k, (file, keys) in enumerate(self._written):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            file.rename(self.path / final)
            weight_map.update((key, final) for key in keys)
        (self.path / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2))
        return self.path


def save_layers(model: Sequence[nn.Module], path: str | Path, names: KeyMap = sequential_keys,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                skip: Callable[[int, str], bool] = lambda i, k: False) -> Path:
    """Write every layer's state_dict with a :class:`ShardWriter` (``skip(i, key)``
    leaves a tensor out: a tied copy). Returns ``path``.

    Raises:
        WeightsError: two tensors would get one name.
    """
    writer = ShardWriter(path, names, max_shard_bytes, skip)
    for i, layer in enumerate(model):
        writer.add(i, layer.state_dict())
    return writer.close()
