"""safetensors files written tensor by tensor and read lazily, tensor by tensor.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length ``N``, ``N`` bytes of JSON (each tensor's ``dtype``, ``shape`` and
``data_offsets`` into the data that follows, plus ``__metadata__``: strings), which
may end in spaces, then the tensors' raw bytes, back to back in header order.

:class:`TensorFileWriter` writes each tensor from its own memory (a ``memoryview`` of
it, no bytes copy) as it comes, so a writer never holds more than the tensor it is
given: a node's disk snapshots (:mod:`fedpipe.node.snapshots`) are written from a
stage's live tensors, or from a buddy's as its parts arrive. Because tensors may come
before their shapes are known, the header's room is reserved from the tensors' names
(:func:`header_room`) and the header is written last, padded with spaces.
:class:`TensorFile` reads the header and then one tensor per lookup, with ``preadv``
into a fresh tensor's memory (no mapping, so nothing stays in the reader's RSS).
``safetensors.safe_open`` and ``load_file`` read these files too.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from pathlib import Path

import torch

from ..wire.codecs import MAX_DIMS

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
"""The torch dtypes these files hold, by their safetensors names."""
BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20
"""Largest header a reader accepts, bytes (the safetensors library's own limit)."""
_ENTRY_ROOM = 2 * MAX_DIMS + 160
"""Bytes a header entry takes beyond its quoted name, at most: its keys and dtype
(about 50), two offsets (≤ 20 digits each) and a shape of at most :data:`MAX_DIMS`
dimensions whose digits sum to at most ``MAX_DIMS + 20`` (their product is a count of
elements), commas and brackets."""


class TensorFileError(ValueError):
    """A tensor file that is malformed, truncated, or holds a dtype these files do not."""


def header_room(names: Iterable[str], metadata: Mapping[str, str]) -> int:
    """The most bytes the JSON header of tensors ``names`` (any shapes) with ``metadata``
    can take."""
    room = len(json.dumps({"__metadata__": dict(metadata)})) + 2
    return room + sum(len(json.dumps(n)) + _ENTRY_ROOM for n in names)


class TensorFileWriter:
    """A safetensors file written one tensor at a time, at ``path`` + ``.tmp-`` + a token of
    its own until :meth:`close` gives it its name (:meth:`abort` removes it). Two writers of
    one path (a buddy sent the same step twice) never share a file: the last to close wins,
    and a reader of the first still reads the first.

    Args:
        path: the file's final name.
        names: every tensor name that will come (their order is free).
        metadata: the header's ``__metadata__`` (strings).

    Raises:
        OSError: the file cannot be made.
    """

    def __init__(self, path: str | os.PathLike, names: Iterable[str],
                 metadata: Mapping[str, str]):
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{secrets.token_hex(6)}")
        self.names = set(names)
        self.metadata = dict(metadata)
        self.room = header_room(self.names, self.metadata)
        self._entries: dict[str, dict] = {}
        self._offset = 0
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed by close/abort)
        self._file.write(b"\0" * (8 + self.room))  # the header goes here last

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write tensor ``name``'s bytes (a CPU tensor's own memory; another device's is
        copied to the CPU first, that tensor only).

        Raises:
            TensorFileError: a name not announced, or given twice, or an unknown dtype.
            OSError: the write failed.
        """
        if name not in self.names or name in self._entries:
            raise TensorFileError(f"tensor {name!r} was not announced or came twice")
        if t.dtype not in DTYPES:
            raise TensorFileError(f"tensor {name!r} has dtype {t.dtype}; these files hold "
                                  f"{sorted(DTYPES.values())}")
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self._file.write(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy
        self._entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data written so far."""
        return self._offset

    def close(self) -> Path:
        """Write the header and give the file its name; returns it.

        Raises:
            TensorFileError: a tensor announced never came, or the header outgrew its room.
            OSError: the write or rename failed.
        """
        try:
            missing = self.names - set(self._entries)
            if missing:
                raise TensorFileError(f"tensors announced but never written: "
                                      f"{sorted(missing)[:5]}")
            header = json.dumps({"__metadata__": self.metadata, **self._entries},
                                separators=(",", ":")).encode()
            if len(header) > self.room:
                raise TensorFileError(f"a header of {len(header)} bytes outgrew its room of "
                                      f"{self.room} bytes")
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self.room) + header.ljust(self.room, b" "))
            self._file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Stop and remove the partial file (even when closing it fails: a full disk fails
        the flush of what is still buffered, and the file must not stay to keep it full)."""
        try:
            self._file.close()
        except OSError:
            pass  # closed all the same; what was buffered is dropped with the file
        finally:
            self.tmp.unlink(missing_ok=True)


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
          metadata: Mapping[str, str]) -> Path:
    """Write ``tensors`` (each from its own memory, in their order) to a safetensors file
    at ``path`` (aside, then renamed); returns it.

    Raises:
        TensorFileError: an unknown dtype.
        OSError: the file cannot be written.
    """
    writer = TensorFileWriter(path, tensors, metadata)
    try:
        for name, t in tensors.items():
            writer.add(name, t)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


class TensorFile(MutableMapping[str, torch.Tensor]):
    """The tensors of a safetensors file by name, each read when looked up (a new CPU
    tensor each time). The file stays open (so a file removed after this was made is
    still read) until :meth:`close` or this is collected. Read-only: setting a tensor
    raises TypeError.

    Raises:
        TensorFileError: not a safetensors file, or a header this reader cannot use.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close / collection)
        try:
            self.metadata, self._entries, self._start = self._header()
        except BaseException:
            self._file.close()
            raise

    def _header(self) -> tuple[dict[str, str], dict[str, dict], int]:
        raw = self._file.read(8)
        if len(raw) < 8:
            raise TensorFileError(f"{self.path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise TensorFileError(f"{self.path}: a header of {n} bytes (at most "
                                  f"{MAX_HEADER_BYTES})")
        try:
            head = json.loads(self._file.read(n))
            meta = head.pop("__metadata__", {}) or {}
            for name, e in head.items():
                if e["dtype"] not in BY_NAME:
                    raise TensorFileError(f"{self.path}: tensor {name!r} has dtype "
                                          f"{e['dtype']}, which this reader does not take")
                a, b = (int(x) for x in e["data_offsets"])
                numel = 1
                for d in e["shape"]:
                    numel *= int(d)
                if b - a != numel * BY_NAME[e["dtype"]].itemsize:
                    raise TensorFileError(f"{self.path}: tensor {name!r} has offsets {a}-{b} "
                                          f"for shape {e['shape']}")
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, TensorFileError):
                raise
            raise TensorFileError(f"{self.path}: a malformed safetensors header: {e}") from None
        return meta, head, 8 + n

    def sizes(self) -> dict[str, int]:
        """Bytes of each tensor, by name (from the header; nothing is read)."""
        return {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in self._entries.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors (from the header; nothing is read)."""
        return sum(self.sizes().values())

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        a, b = e["data_offsets"]
        out = torch.empty(b - a, dtype=torch.uint8)
        if b > a:
            view = out.numpy().data
            done = 0
            while done < b - a:
                got = os.preadv(self._file.fileno(), [view[done:]], self._start + a + done)
                if got <= 0:
                    raise TensorFileError(f"{self.path}: truncated in tensor {name!r}")
                done += got
        return out.view(BY_NAME[e["dtype"]]).reshape(e["shape"])

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        raise TypeError(f"{self.path} is read-only")

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"{self.path} is read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Close the file."""
        self._file.close()
