"""Hostile record sequences for a socket data-plane port (:mod:`fedpipe.net.dataplane`),
drawn from one ``random.Random`` (:class:`~fedpipe.testing.fuzzvalues.Values`):
:class:`Records` makes one case of :data:`Records.CASES` (see
:mod:`fedpipe.testing.fuzzdata`, which sends them and judges the node's answers), each
ending as :class:`End` says.
"""
from __future__ import annotations

import enum
import json

from google.protobuf.descriptor import FieldDescriptor as FD

from ..net.dataplane import records
from ..net.dataplane.records import RecordType
from ..proto import node_pb2, tensor_pb2
from ..wire import format
from .fuzzvalues import Frames, Values

PROBE_NAME = "fuzz-probe"
"""The name of the fuzzer's good connection (hostile sequences never use it)."""


class End(enum.Enum):
    """How a hostile sequence ends (see the module docstring)."""

    HALF_CLOSE = "half-close"
    STALL = "stall"
    HOLD = "hold"


def preface(name: str, role: str = "node", session: str = "5e55", **fields) -> bytes:
    """A valid PREFACE record (any field overridden by ``fields``)."""
    return records.Preface(name=name, role=role, session=session,
                           **{"window_bytes": 1 << 20, "window_messages": 64, **fields}).encode()


def tensor(seq: int, header: node_pb2.Frame, payload: bytes) -> bytes:
    """A TENSOR record: its prefix, a HEAD frame of ``header``, ``payload``."""
    return records.pack(RecordType.TENSOR, seq) + format.pack_head(header) + payload


_GARBAGE = (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"FPW\x01\x01", b"FPR\x01\x01",
            b"\x00" * 16, b"\xff" * 16)
_U64 = 2**64 - 1


class Records:
    """Hostile record sequences for a data port (see the module docstring)."""

    CASES = ("garbage", "bad-prefix", "not-preface-first", "preface-oversize",
             "preface-body", "preface-cut", "preface-lies", "stall", "frames", "seq",
             "payload-lies", "oversize", "envelopes", "second-preface", "control",
             "credits", "sync-flood", "half-open", "fetches")

    def __init__(self, values: Values, name: str, role: str = "node"):
        self.v, self.rng = values, values.rng
        self.frames = Frames(values)
        self.name, self.role = name, role

    def one(self) -> tuple[str, list[bytes], End]:
        """A hostile sequence: its case, its writes and how it ends."""
        case = self.rng.choice(self.CASES)
        sends, end = getattr(self, "_" + case.replace("-", "_"))()
        return case, sends, end

    def _preface(self) -> bytes:
        """A good preface (as the certificate's holder), a session from a small pool so
        that some calls resume an earlier one's link state."""
        return preface(self.name, self.role, session=f"5e55{self.rng.randrange(4)}",
                       base=self.rng.choice((0, 0, 1, 7)))

    def _sane(self, seq: int, n: int | None = None) -> bytes:
        """A TENSOR record of a sane header (random envelope) and its whole payload."""
        header = self.frames.header(True)
        if n is not None:
            header.tensor.shape[:] = [n]
            header.tensor.encoded_bytes = header.tensor.payload_bytes = n
            header.tensor.zstd = False
        return tensor(seq, header, self.rng.randbytes(header.tensor.payload_bytes))

    # -- before a preface ---------------------------------------------------------------
    def _garbage(self):
        return [self.rng.choice(_GARBAGE) + self.v.blob()], End.HALF_CLOSE

    def _bad_prefix(self):
        rng = self.rng
        magic, version, kind = records.MAGIC, records.VERSION, int(RecordType.PREFACE)
        bad = rng.randrange(3)
        if bad == 0:
            magic = rng.choice((b"FPW", b"\0\0\0", b"fpc"))
        elif bad == 1:
            version = rng.choice((0, 2, 255))
        else:
            kind = rng.choice((0, 7, 255))
        return ([records.PREFIX.pack(magic, version, kind, rng.choice((0, 5, _U64)))
                 + self.v.blob()], End.HALF_CLOSE)

    def _not_preface_first(self):
        kind = self.rng.choice([k for k in RecordType if k is not RecordType.PREFACE])
        return [self._control_record(kind) + self.v.blob()], End.HALF_CLOSE

    def _preface_oversize(self):
        arg = self.rng.choice((records.MAX_PREFACE_BYTES + 1, 2**32, _U64))
        return [records.pack(RecordType.PREFACE, arg) + self.v.blob(256)], End.HALF_CLOSE

    def _preface_body(self):
        fields: dict = json.loads(self._preface()[records.PREFIX_BYTES:])
        rng = self.rng
        for _ in range(rng.randint(1, 3)):
            what, key = rng.randrange(6), rng.choice(sorted(fields) or ["name"])
            if what == 0:
                fields.pop(key, None)
            elif what == 1:
                fields[self.v.text()] = rng.choice((1, "x", None))
            elif what == 2:  # a value of another type, or out of range
                if rng.random() < 0.5:  # mostly a number: sequence numbers, windows
                    key = rng.choice(("base", "resume", "window_bytes", "window_messages"))
                fields[key] = rng.choice((None, True, 1.5, "7", [], {}, -1, 0, 2**63 - 1,
                                          2**63, _U64, 2**64, 2**70, -(2**63), float("nan")))
            elif what == 3:
                fields[key] = self.v.text()
            elif what == 4:
                fields[key] = self.v.integer(rng.choice(_INT_KINDS))
            else:
                fields["name"] = rng.choice((PROBE_NAME + "x", "", "a#b", "x" * 3000,
                                             "node0", self.v.text()))
        body = rng.choice((json.dumps(fields).encode(), json.dumps([fields]).encode(),
                           b"\xff\xfe" + json.dumps(fields).encode(), b"{", b"null", b""))
        body = body[:records.MAX_PREFACE_BYTES]
        base = fields.get("base")
        seq: int = base if type(base) is int else 0
        after = rng.choice(([], [records.pack(RecordType.SYNC, 0)], [self._sane(0)],
                            [self._sane(min(max(0, seq), _U64)), records.pack(RecordType.SYNC, 9)]))
        return [records.pack(RecordType.PREFACE, len(body)) + body, *after], End.HALF_CLOSE

    def _preface_cut(self):
        whole = self._preface()
        return [whole[:self.rng.randrange(len(whole))]], End.HALF_CLOSE

    def _preface_lies(self):
        whole = self._preface()
        body = whole[records.PREFIX_BYTES:]
        arg = len(body) + self.rng.randint(1, 64)
        return [records.pack(RecordType.PREFACE, arg) + body], End.HALF_CLOSE

    def _stall(self):
        whole = self._preface()
        return [whole[:self.rng.randrange(len(whole))]], End.STALL

    # -- after a preface ----------------------------------------------------------------
    def _frames(self):
        frames = self.frames.one()
        return ([self._preface(), *(records.pack(RecordType.TENSOR, seq) + f
                                    for seq, f in enumerate(frames))], End.HALF_CLOSE)

    def _seq(self):
        rng = self.rng
        seqs = rng.choice(([0, 0], [0, 2], [1], [_U64], [0, 1, 1, 0], [2**63], [7, 7, 8]))
        return ([self._preface()] + [self._sane(s) for s in seqs]
                + [records.pack(RecordType.SYNC, rng.choice((0, 2, _U64)))], End.HALF_CLOSE)

    def _payload_lies(self):
        rng = self.rng
        n = rng.randint(8, 4096)
        whole = self._sane(0, n)
        if rng.random() < 0.5:  # fewer payload bytes than the header says, then the end
            return [self._preface(), whole[:len(whole) - rng.randint(1, n)]], End.HALF_CLOSE
        # more: the extra bytes are read as the next record
        return [self._preface(), whole + self.v.blob(64) + b"x"], End.HALF_CLOSE

    def _oversize(self):
        rng = self.rng
        header = self.frames.header(True)
        t = header.tensor
        t.zstd = False
        if rng.random() < 0.5:  # a probe past the probe limit, or just within it
            header.envelope.kind = node_pb2.KIND_PROBE
            n = rng.choice((64 * 2**20 + 1, 64 * 2**20, 2**40))
        else:
            n = rng.choice((2**34 + 1, 2**40, 2**62))
        t.dtype, t.codec = tensor_pb2.DTYPE_UINT8, tensor_pb2.CODEC_RAW
        t.shape[:] = [n]
        t.encoded_bytes = t.payload_bytes = n
        return [self._preface(), tensor(0, header, self.v.blob())], End.HALF_CLOSE

    def _envelopes(self):
        out = [self._preface()]
        for seq in range(self.rng.randint(1, 4)):
            header = self.frames.header(True)
            header.tensor.zstd = False
            header.tensor.payload_bytes = header.tensor.encoded_bytes
            env = header.envelope
            env.CopyFrom(self.v.message(node_pb2.Envelope.DESCRIPTOR))
            env.kind = self.rng.choice((*node_pb2.Kind.values(), 99, -1))
            out.append(tensor(seq, header, self.rng.randbytes(header.tensor.payload_bytes)))
        return out + [records.pack(RecordType.SYNC, len(out) - 1)], End.HALF_CLOSE

    def _second_preface(self):
        return [self._preface(), self._sane(0), self._preface()], End.HALF_CLOSE

    def _control_record(self, kind: RecordType) -> bytes:
        rng = self.rng
        arg = rng.choice((0, 1, 2**32, _U64))
        if kind in (RecordType.REFUSED, RecordType.GOAWAY, RecordType.FETCHED):
            text = self.v.text().encode()
            size = rng.choice((len(text), len(text) + 10, records.MAX_TEXT_BYTES + 1,
                               2**32 - 1))
            return (records.pack(kind, arg) + records.TEXT.pack(rng.choice((0, 3, 13, 999)),
                                                                size) + text)
        if kind is RecordType.PREFACE:
            return records.pack(kind, rng.choice((0, 10)))
        return records.pack(kind, arg)

    def _control(self):
        kinds = [RecordType.ACK, RecordType.SYNC, RecordType.REFUSED, RecordType.GOAWAY]
        return ([self._preface(), *(self._control_record(self.rng.choice(kinds))
                                    for _ in range(self.rng.randint(1, 4)))], End.HALF_CLOSE)

    def _credits(self):
        # more tensors than the node grants (1024) before any acknowledgement
        tiny = [self._sane(seq, 1) for seq in range(self.rng.choice((70, 1100)))]
        return [self._preface(), b"".join(tiny), records.pack(RecordType.SYNC, len(tiny))], \
            End.HALF_CLOSE

    def _sync_flood(self):
        # each SYNC asks for an ACK; held: the node must serve others while this one's
        # answers back up into a connection that is not read
        n = self.rng.choice((1000, 100_000))
        return ([self._preface(), records.pack(RecordType.SYNC, 0) * n],
                End.HOLD if n > 1000 else End.HALF_CLOSE)

    def _fetch(self) -> bytes:
        """A FETCH record: any method, a request that may lie about its length or be past
        its limit, of random bytes or a request for a random job's stage."""
        rng = self.rng
        method = rng.choice((*records.Method, 0, 99, 2**32 - 1))
        request = rng.choice((b"", rng.randbytes(rng.randrange(64)), self.v.message(
            rng.choice((node_pb2.FetchStateRequest, node_pb2.FetchSnapshotRequest)).DESCRIPTOR
        ).SerializeToString()))
        size = rng.choice((len(request), len(request) + 7, records.MAX_REQUEST_BYTES + 1,
                           2**32 - 1))
        return (records.pack(RecordType.FETCH, rng.choice((0, 1, rng.randrange(8), _U64)))
                + records.FETCH_BODY.pack(int(method), size) + request)

    def _fetches(self):
        # fetches (each a thread on the node, up to its cap), answers nobody asked for
        # (FETCHED, a TENSOR of an unknown fetch), in any order
        out = [self._preface()]
        for seq in range(self.rng.randint(1, 40)):
            kind = self.rng.randrange(3)
            if kind == 0:
                out.append(self._fetch())
            elif kind == 1:
                out.append(self._control_record(RecordType.FETCHED))
            else:
                header = self.frames.header(True)
                header.fetch = self.rng.choice((1, 2, _U64))
                out.append(tensor(seq, header, self.rng.randbytes(header.tensor.payload_bytes)))
        return out, self.rng.choice((End.HALF_CLOSE, End.HALF_CLOSE, End.HOLD))

    def _half_open(self):
        whole = self._sane(0, self.rng.randint(64, 4096))
        return [self._preface(), whole[:self.rng.randrange(1, len(whole))]], End.HOLD


_INT_KINDS = (FD.TYPE_INT64, FD.TYPE_UINT64, FD.TYPE_INT32)
