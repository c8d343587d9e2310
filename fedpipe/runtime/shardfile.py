"""A safetensors file written a tensor at a time, holding none of them.

``safetensors.torch.save_file`` takes a dict of every tensor: a writer must hold a
whole shard. A safetensors file is an 8-byte little-endian header length, a JSON
header (each tensor's dtype, shape and ``data_offsets`` into the data, plus
``__metadata__``), then the tensors' raw bytes back to back
(https://github.com/huggingface/safetensors, "Format"). The header comes first but
is known only at the end, so :class:`ShardFile` writes each tensor's bytes to a
spool file beside the target as it comes, and :meth:`ShardFile.close` writes the
header and copies the spool after it in bounded pieces: memory one tensor (the
caller's) plus :data:`COPY_CHUNK`; disk the file twice, for a moment.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import torch

COPY_CHUNK = 16 * 2**20
"""Bytes copied at a time from the spool into the file, at close."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


class ShardFile:
    """Writes safetensors file ``path`` one tensor at a time (:meth:`add`), complete at
    :meth:`close`; :meth:`abort` drops what was written. The tensors' bytes are
    spooled to ``path`` + ``.spool`` meanwhile.

    Args:
        path: the file to write (replaced at :meth:`close`).
        metadata: the header's ``__metadata__`` (strings), e.g. ``{"format": "pt"}``.

    Attributes:
        nbytes: the bytes of the tensors added so far.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._spool_path = self.path.with_name(self.path.name + ".spool")
        self._spool: BinaryIO | None = None
        self._header: dict[str, dict] = {}
        self._metadata = dict(metadata or {})
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def add(self, name: str, t: torch.Tensor) -> None:
        """Append tensor ``t`` (on the CPU) as ``name``; only its bytes are kept (on disk).

        Raises:
            ValueError: ``name`` was added already, is ``__metadata__``, or ``t``'s dtype
                has no safetensors code.
            OSError: the spool cannot be written.
        """
        if name in self._header or name == "__metadata__":
            raise ValueError(f"{self.path.name}: tensor name {name!r} given twice or reserved")
        code = _DTYPES.get(t.dtype)
        if code is None:
            raise ValueError(f"{self.path.name}: tensor {name!r} is {t.dtype}, which "
                             f"safetensors cannot store")
        if self._spool is None:
            self._spool = open(self._spool_path, "wb")
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._spool.write(raw.data)
        size = int(raw.nbytes)
        self._header[name] = {"dtype": code, "shape": list(t.shape),
                              "data_offsets": [self.nbytes, self.nbytes + size]}
        self.nbytes += size

    def close(self) -> Path:
        """Write the file: its header, then the spooled bytes; remove the spool.

        Raises:
            OSError: the file cannot be written.
        """
        header: dict = {"__metadata__": self._metadata} if self._metadata else {}
        header.update(self._header)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
        if self._spool is not None:
            self._spool.close()
        with open(self.path, "wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            if self._spool is not None:
                with open(self._spool_path, "rb") as spool:
                    shutil.copyfileobj(spool, out, COPY_CHUNK)
        self._spool_path.unlink(missing_ok=True)
        self._spool = None
        return self.path

    def abort(self) -> None:
        """Drop the spool (the file is not written)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None
        self._spool_path.unlink(missing_ok=True)
