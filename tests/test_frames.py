"""The data plane's wire frames (protos/fedpipe/v1/FRAMES.md): round trips, and malformed,
truncated or oversized frames refused by name before anything of a declared size is held."""
from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import pytest
import torch

from fedpipe.proto import node_pb2, tensor_pb2
from fedpipe.security.certs import Identity, Role
from fedpipe.security.errors import PermissionDenied
from fedpipe.security.policy import check_send_kind
from fedpipe.wire import codecs, format, frames
from fedpipe.wire.format import WireError

pytestmark = pytest.mark.timeout(60)


def env(kind=node_pb2.KIND_ACTIVATION, **kw) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=1, kind=kind, batch_size=4, **kw)


def head(tensor: tensor_pb2.Tensor, piece: bytes = b"", **kw) -> bytes:
    """A HEAD frame, built field by field as a hostile sender could."""
    return format.pack_head(node_pb2.Frame(tensor=tensor, **kw), piece)


def raw_head(header: node_pb2.Frame) -> bytes:
    """A HEAD frame around any header, as pack_head would refuse to make it."""
    data = header.SerializeToString()
    return b"FPW\x01\x01" + struct.pack("<I", len(data)) + data


F32 = dict(dtype=tensor_pb2.DTYPE_FLOAT32, codec=tensor_pb2.CODEC_RAW)


@pytest.mark.parametrize("chunk", [1, 7, 64, frames.CHUNK_BYTES])
def test_tensors_of_every_codec_round_trip_through_frames_with_envelope_and_name(chunk):
    g = torch.Generator().manual_seed(chunk)
    sent = [("a", torch.randn(3, 5, generator=g), "raw"),
            ("empty", torch.zeros(0, 4), "raw"),
            ("scalar", torch.tensor(2.5, dtype=torch.float64), "raw+zstd"),
            ("ids", torch.arange(100), "int8:32"),  # a lossy codec on ints falls back to raw
            ("q", torch.randn(40, generator=g), "int8:16+zstd"),
            ("h", torch.randn(8, 8, generator=g), "fp16"),
            ("k", torch.randn(64, generator=g), "topk:0.25")]
    stream = [f for i, (name, t, codec) in enumerate(sent)
              for f in frames.encode_frames(t, codec, name=name, envelope=env(microbatch=i),
                                            chunk_bytes=chunk)]
    assert all(type(f) is bytes and f[:4] == b"FPW\x01" for f in stream)
    got = list(frames.read_tensors(stream))
    assert [h.name for h, _ in got] == [name for name, _, _ in sent]
    assert [h.envelope.microbatch for h, _ in got] == list(range(len(sent)))
    for (_, t, codec), (h, back) in zip(sent, got):
        want = codecs.decode(codecs.encode(t, codec))
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, want), codec
        assert not h.tensor.payload and not h.chunk  # the header never carries payload


def test_a_large_tensor_is_cut_into_pieces_of_chunk_bytes_and_decoded_into_a_writable_copy():
    t = torch.randn(2**18 + 3)  # 1 MiB and 12 bytes
    stream = list(frames.encode_frames(t, envelope=env()))
    assert len(stream) == 2 and len(stream[1]) == len(format.MORE_PREFIX) + 12
    assert stream[1][:5] == b"FPW\x01\x02"
    ((h, back),) = frames.read_tensors(stream)
    assert h.tensor.payload_bytes == t.numel() * 4 and torch.equal(back, t)
    back += 1  # its own memory: neither the frames nor the sender's tensor change
    assert torch.equal(next(frames.read_tensors(stream))[1], t)


def test_a_single_frame_payload_is_copied_out_of_the_message():
    t = torch.arange(6, dtype=torch.float32)
    stream = list(frames.encode_frames(t))
    ((_, back),) = frames.read_tensors(stream)
    back.zero_()
    assert stream[0].endswith(t.numpy().tobytes())  # the received message is untouched


def _address(buf) -> int:
    """Where ``buf``'s bytes are in memory."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("name_len", range(0, 40, 3))
def test_a_head_frames_payload_starts_aligned_whatever_the_header_length(name_len):
    t = torch.arange(6, dtype=torch.float64)
    (frame,) = frames.encode_frames(t, envelope=env(), name="n" * name_len)
    h, piece = format.unpack(frame)
    assert (len(frame) - len(piece)) % format.PAYLOAD_ALIGN == 0
    assert h.name == "n" * name_len and h.pad == bytes(len(h.pad))  # pad: zeros, ignored
    assert bytes(piece) == t.numpy().tobytes()


def test_in_place_a_one_frame_tensor_is_decoded_over_the_frame_and_a_longer_one_copied():
    t = torch.randn(1000, dtype=torch.float64)
    (frame,) = frames.encode_frames(t, envelope=env())
    ((h, back),) = frames.read_tensors([frame], in_place=True)
    start = _address(frame)
    assert start <= back.data_ptr() < start + len(frame)  # no copy: the frame's memory
    assert back.data_ptr() % 16 == 0 and torch.equal(back, t) and h.envelope.job_id == "j"
    back += 1  # writable
    assert torch.equal(back, t + 1)
    stream = list(frames.encode_frames(t, chunk_bytes=3000))
    ((_, long),) = frames.read_tensors(stream, in_place=True)
    assert torch.equal(long, t) and not any(
        _address(f) <= long.data_ptr() < _address(f) + len(f) for f in stream)


def test_in_place_a_misaligned_payload_is_copied_out_aligned():
    """A sender that does not pad (as FRAMES.md lets it): the float64s would sit at an odd
    address in the frame, so they are copied out instead."""
    t = torch.randn(4, dtype=torch.float64)
    header = node_pb2.Frame(tensor=tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT64, codec=tensor_pb2.CODEC_RAW, shape=[4],
        encoded_bytes=32, payload_bytes=32))
    for extra in range(8):
        header.name = "x" * extra
        frame = raw_head(header) + t.numpy().tobytes()
        ((_, back),) = frames.read_tensors([frame], in_place=True)
        assert torch.equal(back, t) and back.data_ptr() % 8 == 0


GOOD = head(tensor_pb2.Tensor(shape=[2], encoded_bytes=8, payload_bytes=8, **F32), b"\0" * 8)


@pytest.mark.parametrize("frame,why", [
    (b"FP", "shorter than its 5-byte prefix"),
    (b"XYZ\x01\x01" + GOOD[5:], "not a fedpipe wire frame"),
    (node_pb2.Frame(tensor=tensor_pb2.Tensor(**F32)).SerializeToString(),
     "not a fedpipe wire frame"),
    (b"FPW\x02\x01" + GOOD[5:], "version 2 is not supported; this side speaks version 1"),
    (b"FPW\x01\x09" + GOOD[5:], "unknown wire frame kind 9"),
    (b"FPW\x01\x01\x03", "shorter than its 9-byte prefix"),
    (b"FPW\x01\x01" + struct.pack("<I", 2**31) + b"\0" * 64, "header length 2147483648 exceeds"),
    (b"FPW\x01\x01" + struct.pack("<I", 100) + b"\0" * 64, "runs past the end"),
    (b"FPW\x01\x01" + struct.pack("<I", 3) + b"\xff\xff\xff", "does not parse"),
    (b"FPW\x01\x01" + struct.pack("<I", 0), "has no tensor"),
    (raw_head(node_pb2.Frame(tensor=tensor_pb2.Tensor(payload=b"xx"))), "payload bytes of its own"),
    (raw_head(node_pb2.Frame(tensor=tensor_pb2.Tensor(), chunk=b"x")), "payload bytes of its own"),
    (format.pack_more(b"abc"), "continuation frame without a tensor header"),
    (head(tensor_pb2.Tensor(dtype=99, codec=1)), "unknown tensor dtype code 99"),
    (head(tensor_pb2.Tensor(shape=[4, 4], encoded_bytes=10, payload_bytes=10, **F32)),
     "encoded_bytes is 10 but codec raw and shape [4, 4] need 64"),
    (head(tensor_pb2.Tensor(shape=[2], encoded_bytes=8, payload_bytes=9, **F32)),
     "payload_bytes is 9 but the payload without zstd is encoded_bytes = 8"),
    (head(tensor_pb2.Tensor(shape=[2**62, 0], **F32)), "dimension over 2**40"),
    (head(tensor_pb2.Tensor(shape=[2**20], encoded_bytes=2**22, payload_bytes=2**22, **F32),
          b"\0" * 16), "ended after 16 payload bytes, header declared 4194304"),
    (GOOD + b"\0", "more than the declared 8 payload bytes"),
])
def test_malformed_frames_are_refused_naming_the_field(frame, why):
    with pytest.raises(WireError) as e:
        for _ in frames.read_tensors([frame]):
            pass
    assert why in str(e.value)


def test_a_longer_piece_than_declared_and_a_header_before_the_end_are_refused():
    with pytest.raises(WireError, match="more than the declared 8"):
        list(frames.read_tensors([GOOD[:-4], format.pack_more(b"\0" * 5)]))
    with pytest.raises(WireError, match="ended after 4 payload bytes, header declared 8"):
        list(frames.read_tensors([GOOD[:-4], GOOD]))


def test_a_header_over_the_limit_is_refused_before_its_payload_is_read():
    """admit() runs on the header alone, and the limit it returns is checked before the
    stream gives another frame: a refused tensor's pieces are never read."""
    declared = tensor_pb2.Tensor(shape=[2**28], encoded_bytes=2**30, payload_bytes=2**30, **F32)
    read = []

    def stream():
        yield head(declared, envelope=env())
        for i in range(4):
            read.append(i)
            yield format.pack_more(b"\0" * 2**20)

    admitted = []
    with pytest.raises(WireError, match="exceeds the limit of 1048576"):
        list(frames.read_tensors(stream(), lambda h: admitted.append(h.envelope.job_id) or 2**20))
    assert admitted == ["j"] and read == []

    def refuse(h):
        raise LookupError(f"no stage {h.envelope.stage}")
    with pytest.raises(LookupError, match="no stage 1"):
        list(frames.read_tensors(stream(), refuse))
    assert read == []


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_memory_held_follows_the_bytes_received_not_the_size_declared():
    """A 1 GiB tensor declared within the limit, of which 64 KiB arrive: the reader holds
    about what arrived, in Python objects and in resident memory (its payload buffer is
    reserved, not touched), when the stream ends short."""
    declared = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, codec=tensor_pb2.CODEC_RAW,
                                 shape=[2**30], encoded_bytes=2**30, payload_bytes=2**30)
    held = []

    def stream():
        yield head(declared)
        for _ in range(4):
            yield format.pack_more(b"\1" * 2**14)
        held.append(_resident_bytes() - before)  # the four pieces are in the buffer

    before = _resident_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="ended after 65536 payload bytes"):
            list(frames.read_tensors(stream()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    assert held[0] < 16 * 2**20, held


def test_pack_head_refuses_payload_in_the_header_and_oversized_headers():
    with pytest.raises(WireError, match="must not carry payload"):
        format.pack_head(node_pb2.Frame(tensor=tensor_pb2.Tensor(payload=b"x")))
    with pytest.raises(WireError, match="exceeds the limit of 65536"):
        format.pack_head(node_pb2.Frame(tensor=tensor_pb2.Tensor(), name="n" * 2**16))


def test_a_clients_send_kinds_are_read_from_the_frame_header():
    alice = Identity(Role.CLIENT, "alice", 1)
    node = Identity(Role.NODE, "n1", 2)
    activation = next(frames.encode_frames(torch.zeros(2), envelope=env()))
    inputs = next(frames.encode_frames(torch.zeros(2), envelope=env(node_pb2.KIND_INPUT)))
    with pytest.raises(PermissionDenied, match="only inputs and targets, not KIND_ACTIVATION"):
        check_send_kind(alice, activation)
    check_send_kind(alice, inputs)
    check_send_kind(node, activation)
    check_send_kind(alice, format.pack_more(b"abc"))  # no envelope: nothing to check
    check_send_kind(alice, b"garbage")  # malformed: the servicer refuses it, with the reason


@pytest.mark.parametrize("t", [torch.randn(16384), torch.zeros(3, 5, 7, dtype=torch.bfloat16),
                               torch.tensor(2.5), torch.zeros(300, 2**12, dtype=torch.uint8)])
@pytest.mark.parametrize("envelope, name, fetch", [
    (env(step=70000, microbatch=3, epoch=2), "", 0), (None, "3.weight", 0),
    (None, "x" * 200, 2**40 + 7), (env(), "n", 1)])
def test_pack_head_of_is_pack_head_of_the_frame_byte_for_byte(t, envelope, name, fetch):
    # the socket plane's sender packs a header from its parts' serializations: the
    # same bytes as the Frame protobuf would write, and they unpack to that Frame
    msg, own = codecs.encode_payload(t, "raw")
    frame = node_pb2.Frame(envelope=envelope, tensor=msg, name=name, fetch=fetch)
    packed = format.pack_head_of(envelope, msg, name, fetch)
    assert packed == format.pack_head(frame)
    header, piece = format.unpack(packed)
    header.ClearField("pad")
    assert header == frame and not len(piece) and len(packed) % format.PAYLOAD_ALIGN == 0
    with pytest.raises(WireError, match="must not carry payload bytes"):
        format.pack_head_of(envelope, tensor_pb2.Tensor(payload=b"x"))
    # a raw CPU tensor's header as the socket plane's sender frames it: serialized once
    # per dtype and shape, the same bytes as the message's
    raw = codecs.raw_payload(t)
    assert raw is not None
    serialized, payload = raw
    assert serialized == msg.SerializeToString() and bytes(payload) == bytes(own)
    assert format.pack_head_of(envelope, serialized, name, fetch) == packed
