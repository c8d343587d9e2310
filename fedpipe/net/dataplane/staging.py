"""A device tensor's bytes staged through one pinned host buffer, a chunk at a time, so that
the copy of chunk i+1 overlaps the send of chunk i.

A raw CPU tensor is sent from its own memory (:func:`fedpipe.wire.codecs.encode_payload`).
A tensor on a CUDA device has to come to host memory first: here it is copied into one
page-locked (pinned) buffer from torch's caching host allocator in chunks of
:data:`CHUNK_BYTES`, each an asynchronous copy (``copy_(..., non_blocking=True)``) on
a copy stream of the :class:`Copier`'s own, followed by an event recorded on that
stream. The copies are all enqueued at once; the link's writer
(:meth:`fedpipe.net.dataplane.connection.Connection.write_staged`) then writes the
payload up to each chunk's :class:`Mark` as soon as that chunk's event has completed,
so the wire carries chunk i while the DMA engine copies chunk i+1. Only pinned memory
makes a device-to-host copy asynchronous; into pageable memory the driver copies
through a staging buffer of its own before the call returns.

The technique is PyTorch's: "A guide on good usage of ``non_blocking`` and
``pin_memory()``" (pytorch.org/tutorials/intermediate/pinmem_nonblock.html: a
device-to-host copy with ``non_blocking=True`` must be waited for, by an event or a
synchronize, before the host reads the bytes) and the CUDA semantics notes on
streams (docs.pytorch.org/docs/stable/notes/cuda.html, "CUDA streams": a copy on a
side stream waits for the producer's stream, and ``Tensor.record_stream`` keeps the
source's memory from being reused before the copy ends).

The host buffer is the payload a link keeps for a resend like any CPU payload: a
resend waits for the same marks (by then done) and writes the same bytes. The buffer
goes back to torch's caching host allocator when the last view of it is dropped; the
allocator holds a freed block until the copies recorded on it have completed, so a
block is never refilled under a copy still in flight.

The device copy is a collaborator (:class:`Copier`): :class:`CudaCopier` is the real
one; a test passes one that copies on a thread of its own and sets a
``threading.Event`` per chunk, so the chunk ordering and overlap are tested where no
GPU is.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from ...proto import tensor_pb2
from ...spec import CodecSpec, parse_codec
from ...wire import codecs
from ...wire.format import WireError

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
"""Bytes of a staged payload copied between two marks: large enough that an event and a
write per chunk cost nothing beside the chunk's copy (4 MiB: about 0.2 ms over PCIe 4),
small enough that the first chunk goes on the wire soon (a 64 MiB activation is 16)."""


class Mark(NamedTuple):
    """How far a staged payload may be written once a chunk's copy has completed.

    Attributes:
        end: the offset, bytes from the payload's start, up to which the payload is in
            host memory once ``ready`` returned (the chunk is ``[previous end, end)``).
        ready: blocks until that chunk's copy has completed (a CUDA event's
            ``synchronize``; a ``threading.Event``'s ``wait`` in tests). Called again
            after it returned (a resend), it returns at once.
    """

    end: int
    ready: Callable[[], object]


class CopyFailed(Exception):
    """A staged chunk's copy to host memory failed: its mark's ``ready`` raised (a CUDA
    error; chained). The payload can never be written whole, nor resent."""


def wait(mark: Mark, start: int) -> None:
    """Block until ``mark``'s chunk (bytes ``[start, mark.end)``) is in host memory.

    Raises:
        CopyFailed: ``ready`` raised (whatever it raised: never taken for a broken
            connection, which would resend the payload and wait for the mark again).
    """
    try:
        mark.ready()
    except Exception as e:  # noqa: BLE001 — any failure of the copy is the payload's end
        raise CopyFailed(f"copying bytes {start}..{mark.end} of a staged payload to host "
                         f"memory failed: {e!r}") from e


class Staged(NamedTuple):
    """A payload being copied to host memory, with the marks a writer follows.

    Attributes:
        payload: the whole host buffer, ``nbytes`` long (its bytes past a mark are
            not valid until that mark's ``ready`` returned). It keeps the buffer alive.
        marks: strictly increasing ``end`` offsets, the last ``len(payload)``
            (:func:`check_marks`).
    """

    payload: memoryview
    marks: tuple[Mark, ...]


class Copier(Protocol):
    """Copies a device tensor's bytes into host memory in chunks, asynchronously."""

    def stage(self, flat: torch.Tensor) -> Staged:
        """Start copying ``flat`` (1-D, uint8, contiguous, at least one byte, on the
        copier's kind of device) into a new host buffer; return at once with the buffer
        and one :class:`Mark` per chunk, in order."""
        ...


def chunk_ends(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The ``end`` offsets of ``nbytes`` cut into chunks of ``chunk_bytes`` (the last one
    shorter): ``[chunk, 2 * chunk, ..., nbytes]``; ``[]`` for no bytes.

    Raises:
        ValueError: ``chunk_bytes`` < 1 or ``nbytes`` < 0.
    """
    if chunk_bytes < 1 or nbytes < 0:
        raise ValueError(f"cannot cut {nbytes} bytes into chunks of {chunk_bytes} bytes")
    return [min(end, nbytes) for end in range(chunk_bytes, nbytes + chunk_bytes, chunk_bytes)]


def check_marks(marks: Sequence[Mark], nbytes: int) -> None:
    """Check that ``marks`` cover a payload of ``nbytes`` exactly, in order.

    Raises:
        ValueError: no marks, an ``end`` that does not grow, or a last ``end`` other than
            ``nbytes`` (the message gives the offsets).
    """
    ends = [m.end for m in marks]
    if not ends or ends[-1] != nbytes or any(b <= a for a, b in zip([0, *ends], ends)):
        raise ValueError(f"chunk marks {ends} do not cover a payload of {nbytes} bytes in "
                         f"strictly increasing steps")


def stageable(t: torch.Tensor, codec: str | CodecSpec) -> bool:
    """Whether ``t`` is sent by :func:`stage`: a tensor with elements, not on the CPU, of a
    wire dtype, sent raw without zstd. Compressed codecs on a device tensor keep
    :func:`fedpipe.wire.codecs.encode`'s path (they run on the device, then copy the
    smaller output)."""
    spec = codec if isinstance(codec, CodecSpec) else parse_codec(codec)
    return (spec.name == "raw" and spec.zstd_level is None and t.device.type != "cpu"
            and t.dtype in codecs.DTYPES and t.numel() > 0)


def stage(t: torch.Tensor, copier: Copier) -> tuple[tensor_pb2.Tensor, Staged]:
    """``t``'s raw header and its bytes being copied to host memory by ``copier``.

    Args:
        t: a tensor :func:`stageable` says yes to (any shape; not contiguous is made
            contiguous on its device first).
        copier: the device copy.

    Returns:
        ``(header, staged)``: the header as :func:`~fedpipe.wire.codecs.encode_payload`
        gives a raw CPU tensor (``payload`` empty, ``payload_bytes`` set), and the
        payload with its marks, for :meth:`fedpipe.net.dataplane.Link.send_encoded`.

    Raises:
        WireError: the dtype cannot be sent.
        ValueError: the copier's marks do not cover the payload.
    """
    if t.dtype not in codecs.DTYPES:
        raise WireError(f"dtype {t.dtype} cannot be sent; supported: "
                        f"{sorted(map(str, codecs.DTYPES))}")
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    staged = copier.stage(flat)
    check_marks(staged.marks, len(staged.payload))
    nbytes = len(staged.payload)
    return tensor_pb2.Tensor(dtype=codecs.DTYPES[t.dtype], shape=t.shape,
                             codec=tensor_pb2.CODEC_RAW, encoded_bytes=nbytes,
                             payload_bytes=nbytes), staged


_pin_warned = False


def pinned_empty(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of uninitialized page-locked host memory as a 1-D uint8 tensor, from
    torch's caching host allocator (``torch.empty(..., pin_memory=True)``); None where
    pinning is unavailable (a CPU-only torch build, no driver, the locked-memory limit
    reached), with a warning logged the first time naming why: the caller then uses
    pageable memory, and its copies to or from the device do not overlap anything.

    A tensor, not a numpy view: an asynchronous copy records its stream's event on the
    allocator's block only through the storage's own allocation context, which a
    ``torch.from_numpy`` of the same memory does not carry (the block could be handed out
    again under a copy still in flight).
    """
    global _pin_warned
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        if not _pin_warned:
            _pin_warned = True
            log.warning("pinned host memory is unavailable (%s): device tensors are staged "
                        "in and received into pageable memory, without overlapping their "
                        "copies and sends", str(e).splitlines()[0] if str(e) else repr(e))
        return None


class CudaCopier:
    """:class:`Copier` for CUDA tensors: pinned host buffers, one copy stream per device and
    calling thread (two stage threads' copies never queue behind each other's kernels).

    Each :meth:`stage` waits (on the copy stream, not the host) for the work queued so
    far on the calling thread's current stream of the tensor's device, which produced
    the tensor, records the tensor on the copy stream (so the caching allocator does not
    reuse its memory before the copies end, even if the caller drops it), and enqueues
    one ``non_blocking`` copy and one event per chunk of ``chunk_bytes``. Where pinned
    memory is unavailable (:func:`pinned_empty`) the buffer is pageable and the copies
    end before :meth:`stage` returns. Thread-safe.

    Args:
        chunk_bytes: bytes per chunk (:data:`CHUNK_BYTES`).
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._local = threading.local()  # .streams: this thread's, by device

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
        return stream

    def stage(self, flat: torch.Tensor) -> Staged:
        """As :meth:`Copier.stage`; ``flat`` on a CUDA device.

        Raises:
            ValueError: ``flat`` is not on a CUDA device.
        """
        if flat.device.type != "cuda":
            raise ValueError(f"CudaCopier stages CUDA tensors, not one on {flat.device}")
        nbytes = flat.numel()
        host = pinned_empty(nbytes)
        if host is None:
            host = torch.empty(nbytes, dtype=torch.uint8)
        stream = self._stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        flat.record_stream(stream)
        marks = []
        start = 0
        with torch.cuda.stream(stream):
            for end in chunk_ends(nbytes, self.chunk_bytes):
                host[start:end].copy_(flat[start:end], non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # a waiting sender sleeps, not spins
                done.record(stream)
                marks.append(Mark(end, done.synchronize))
                start = end
        return Staged(host.numpy().data, tuple(marks))
