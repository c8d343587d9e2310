"""Random inputs for the fuzzers, all from one ``random.Random`` so a seed replays a run
(:mod:`fedpipe.testing.fuzz`, :mod:`fedpipe.testing.fuzzdata`): protobuf field values
and whole messages, edge cases first (the integer limits of each field type, special
floats, hostile strings), mutations of a message's fields (:class:`Values`), and hostile
wire frames (:class:`Frames`).
"""
from __future__ import annotations

import math
import random
import struct
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import message_factory

from ..proto import node_pb2, tensor_pb2
from ..wire import format

_FD = _descriptor.FieldDescriptor

DEPTH = 4
"""How deep a random message nests (deeper message fields are left empty)."""


_INT_LIMITS = {
    _FD.TYPE_INT32: (-2**31, 2**31 - 1), _FD.TYPE_SINT32: (-2**31, 2**31 - 1),
    _FD.TYPE_SFIXED32: (-2**31, 2**31 - 1), _FD.TYPE_INT64: (-2**63, 2**63 - 1),
    _FD.TYPE_SINT64: (-2**63, 2**63 - 1), _FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    _FD.TYPE_UINT32: (0, 2**32 - 1), _FD.TYPE_FIXED32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1), _FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-320, 1e300, -1e300, 3.4e38, math.inf, -math.inf,
           math.nan)
_STRINGS = ("", "0", "-1", "x", "127.0.0.1:1", "localhost:0", "[::1]:1", "node0", "job-1",
            "none", "raw", "fp16", "int8:64", "topk:0.01+zstd", "zstd:99", "diloco",
            "gpipe", "1f1b", "async", "../../etc/passwd", "\x00", "é\u202e\U0001f600",
            "\ud7ff", "%s%n", "a" * 300)


class Values:
    """Random field values and messages, from one ``random.Random``."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def length(self, most: int = 24) -> int:
        """A random repeated-field or byte-string length, mostly small, sometimes large."""
        r = self.rng.random()
        if r < 0.3:
            return self.rng.choice((0, 1, 2))
        if r < 0.97:
            return self.rng.randint(0, most)
        return self.rng.randint(most, 40 * most)

    def integer(self, kind: int) -> int:
        lo, hi = _INT_LIMITS[kind]
        r = self.rng.random()
        if r < 0.35:
            return self.rng.choice([v for v in (0, 1, -1, 2, 7, 64, 2**31 - 1, 2**32 - 1,
                                                2**63 - 1, lo, hi) if lo <= v <= hi])
        if r < 0.7:
            return max(lo, min(hi, self.rng.randint(-8, 4096)))
        return self.rng.randint(lo, hi)

    def floating(self) -> float:
        if self.rng.random() < 0.5:
            return self.rng.choice(_FLOATS)
        return self.rng.uniform(-1e6, 1e6)

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(_STRINGS)
        if r < 0.9:
            return "".join(chr(self.rng.randint(32, 126)) for _ in range(self.length(16)))
        return "".join(chr(self.rng.randint(1, 0xD7FF)) for _ in range(self.length(64)))

    def blob(self, most: int = 64) -> bytes:
        return self.rng.randbytes(self.length(most))

    def scalar(self, f: _descriptor.FieldDescriptor):
        t = f.type
        if t in _INT_LIMITS:
            return self.integer(t)
        if t in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
            v = self.floating()
            return v if t == _FD.TYPE_DOUBLE or not math.isfinite(v) else \
                struct.unpack("<f", struct.pack("<f", max(-3.4e38, min(3.4e38, v))))[0]
        if t == _FD.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == _FD.TYPE_ENUM:
            if self.rng.random() < 0.8:
                return self.rng.choice(f.enum_type.values).number
            return self.integer(_FD.TYPE_INT32)  # proto3 enums are open: unknown values parse
        if t == _FD.TYPE_STRING:
            return self.text()
        if t == _FD.TYPE_BYTES:
            return self.blob()
        raise TypeError(f"no random value for field {f.full_name} of type {t}")

    def message(self, desc: _descriptor.Descriptor, depth: int = 0) -> _message.Message:
        """A message of type ``desc`` with a random subset of its fields set at random."""
        msg = message_factory.GetMessageClass(desc)()
        if depth >= DEPTH:
            return msg
        for f in desc.fields:
            if self.rng.random() < 0.4:
                continue
            is_msg = f.type == _FD.TYPE_MESSAGE
            if _is_map(f):
                self._entries(getattr(msg, f.name), f, self.length(4), depth)
            elif f.is_repeated:
                box = getattr(msg, f.name)
                n = self.length(4 if is_msg else 24)
                for _ in range(min(n, 8) if is_msg and depth else n):
                    if is_msg:
                        box.add().CopyFrom(self.message(f.message_type, depth + 1))
                    else:
                        box.append(self.scalar(f))
            elif is_msg:
                getattr(msg, f.name).CopyFrom(self.message(f.message_type, depth + 1))
            else:
                setattr(msg, f.name, self.scalar(f))
        return msg

    def _entries(self, box: Any, f: _descriptor.FieldDescriptor, n: int, depth: int) -> None:
        """Put ``n`` random entries into the map field ``f``'s container ``box``."""
        entry = f.message_type.fields_by_name
        key_f, value_f = entry["key"], entry["value"]
        for _ in range(n):
            key = self.scalar(key_f)
            if value_f.type == _FD.TYPE_MESSAGE:
                box[key].CopyFrom(self.message(value_f.message_type, depth + 1))
            else:
                box[key] = self.scalar(value_f)

    def mutate(self, msg: _message.Message, changes: int) -> _message.Message:
        """Change ``changes`` fields of ``msg`` in place, anywhere in its tree: a new random
        value, cleared, or (repeated fields) an element dropped or repeated."""
        for _ in range(changes):
            node = msg
            while True:  # walk down into a set message field now and then
                f = self.rng.choice(node.DESCRIPTOR.fields)
                is_msg = f.type == _FD.TYPE_MESSAGE
                if is_msg and not f.is_repeated and node.HasField(f.name) \
                        and self.rng.random() < 0.6:
                    node = getattr(node, f.name)
                    continue
                break
            box = getattr(node, f.name) if f.is_repeated else None
            r = self.rng.random()
            if r < 0.15:
                node.ClearField(f.name)
            elif _is_map(f):
                self._entries(box, f, 1, 1)
            elif box is not None and len(box) and r < 0.4:
                i = self.rng.randrange(len(box))
                if self.rng.random() < 0.5:
                    del box[i]
                elif is_msg:
                    box.add().CopyFrom(box[i])
                else:
                    box.append(box[i])
            elif box is not None:
                if is_msg:
                    box.add().CopyFrom(self.message(f.message_type, 1))
                else:
                    box.append(self.scalar(f))
            elif is_msg:
                getattr(node, f.name).CopyFrom(self.message(f.message_type, 1))
            else:
                setattr(node, f.name, self.scalar(f))
        return msg


def _is_map(f: _descriptor.FieldDescriptor) -> bool:
    """Whether ``f`` is a ``map<K, V>`` field (a repeated entry message in the descriptor)."""
    return (f.type == _FD.TYPE_MESSAGE and f.is_repeated
            and f.message_type.GetOptions().map_entry)


# -- hostile wire frames ------------------------------------------------------
_HEAD_LEN = struct.Struct("<I")


def _prefix(kind: int, magic: bytes = format.MAGIC, version: int = format.VERSION) -> bytes:
    return magic + bytes((version, kind))


def frame_head(header: bytes, piece: bytes = b"", declared: int | None = None) -> bytes:
    """A HEAD frame of ``header`` (its length given as ``declared``, to lie) and the
    first ``piece`` of its payload."""
    n = len(header) if declared is None else declared
    return _prefix(format.HEAD) + _HEAD_LEN.pack(n) + header + piece


class Frames:
    """Hostile wire-frame sequences for ``Send`` and ``PutSnapshot``."""

    def __init__(self, values: Values):
        self.v = values
        self.rng = values.rng

    def header(self, sane: bool) -> node_pb2.Frame:
        """A ``Frame`` header: random throughout, or (``sane``) a tensor header that passes
        the codec's checks, with a random envelope (a probe half the time)."""
        if not sane:
            return self.v.message(node_pb2.Frame.DESCRIPTOR)
        n = self.rng.randint(0, 64)
        t = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[n],
                              codec=tensor_pb2.CODEC_RAW, encoded_bytes=n, payload_bytes=n)
        if self.rng.random() < 0.3:  # zstd over garbage: the decoder must refuse it
            t.zstd = True
            t.payload_bytes = self.rng.randint(1, 64)
        env = self.v.message(node_pb2.Envelope.DESCRIPTOR)
        if self.rng.random() < 0.5:
            env.kind = node_pb2.KIND_PROBE
        return node_pb2.Frame(tensor=t, envelope=env, name=self.v.text())

    def one(self) -> list[bytes]:  # noqa: C901 (a table of 16 hostile cases, one a branch)
        """One hostile frame sequence (1 to ~6 messages)."""
        rng, v = self.rng, self.v
        sane = self.header(True)
        body = sane.SerializeToString()
        declared = sane.tensor.payload_bytes
        pick = rng.randrange(16)
        if pick == 0:  # bad magic
            return [rng.choice((b"FPX", b"\0\0\0", b"fpw")) + bytes((1, 1)) + v.blob()]
        if pick == 1:  # a version this side does not speak
            return [_prefix(format.HEAD, version=rng.choice((0, 2, 255))) + v.blob()]
        if pick == 2:  # an unknown kind
            return [_prefix(rng.choice((0, 3, 255))) + v.blob()]
        if pick == 3:  # a prefix cut short
            return [frame_head(body)[:rng.randint(0, format.HEAD_PREFIX_BYTES - 1)]]
        if pick == 4:  # a header length past the end of the frame
            return [frame_head(body, declared=len(body) + rng.randint(1, 4096))]
        if pick == 5:  # a huge header length
            return [frame_head(body, declared=rng.choice((format.MAX_HEADER_BYTES + 1, 2**32 - 1)))]
        if pick == 6:  # a header that does not parse, or has no tensor
            junk = rng.choice((v.blob(), node_pb2.Frame(name="x").SerializeToString()))
            return [frame_head(junk, v.blob())]
        if pick == 7:  # a header that carries payload bytes itself
            bad = node_pb2.Frame(tensor=tensor_pb2.Tensor(payload=v.blob() or b"x"))
            return [frame_head(bad.SerializeToString())]
        if pick == 8:  # MORE frames with no HEAD
            return [_prefix(format.MORE) + v.blob() for _ in range(rng.randint(1, 3))]
        if pick == 9:  # fewer payload bytes than declared, then the stream ends
            sane.tensor.payload_bytes = sane.tensor.encoded_bytes = n = rng.randint(8, 4096)
            sane.tensor.zstd, sane.tensor.shape[:] = False, [n]
            return [frame_head(sane.SerializeToString(), rng.randbytes(n // 2))]
        if pick == 10:  # more payload bytes than declared
            return [frame_head(body, rng.randbytes(declared)),
                    *[_prefix(format.MORE) + v.blob() + b"x" for _ in range(rng.randint(1, 3))]]
        if pick == 11:  # sizes declared near 2**63 with a tiny payload
            sane.tensor.shape[:] = [rng.choice((2**62, 2**40, 2**31))]
            sane.tensor.encoded_bytes = sane.tensor.payload_bytes = rng.choice(
                (2**63 - 1, 2**62, 2**40))
            sane.tensor.zstd = False
            return [frame_head(sane.SerializeToString(), v.blob())]
        if pick == 12:  # a random header (descriptor walk) with a random payload
            return [frame_head(self.header(False).SerializeToString(), v.blob())
                    for _ in range(rng.randint(1, 3))]
        if pick == 13:  # a sane header with a garbage payload, possibly then garbage
            out = [frame_head(body, rng.randbytes(declared))]
            return out + [v.blob() for _ in range(rng.randint(0, 2))]
        if pick == 14:  # a header after a header whose tensor was not finished
            return [frame_head(body), frame_head(body, rng.randbytes(declared))]
        # a mixed sequence of everything above
        return [f for _ in range(rng.randint(2, 4)) for f in self.one()][:8]
