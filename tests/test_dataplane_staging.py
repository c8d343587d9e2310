"""Device tensors staged through host memory (fedpipe.net.dataplane.staging), in one process
over real sockets: chunk marks cover a payload exactly; the writer writes no chunk before
its copy is done and each chunk while the next is still being copied, plain and over TLS;
a resend after a broken connection writes the same bytes; a receiver that asks for pinned
memory where there is none gets pageable memory and a warning. The device copy is a CPU
copier on a thread of its own whose chunks the test lets go one at a time; the real one
(CUDA streams and events) runs in the last test, on a machine with a CUDA device."""
from __future__ import annotations

import logging
import socket
import ssl
import threading

import pytest
import torch

from fedpipe.net.dataplane import (DataPlane, Link, LinkFailed, Peer, Timeouts, connection,
                                   staging)
from fedpipe.net.dataplane.connection import Connection
from fedpipe.net.dataplane.staging import Mark, Staged
from fedpipe.proto import node_pb2
from fedpipe.security import TlsConfig
from fedpipe.security.tls import client_context, server_context
from fedpipe.wire import codecs, frames

pytestmark = pytest.mark.timeout(120)
FAST = Timeouts(credit=20.0, resume=5.0, handshake=5.0, backoff_min=0.02, backoff_max=0.2)
WAIT = 30.0
"""Seconds a test waits for something that must happen (a failure, not a measurement)."""
UNCOPIED = 0xEE
"""What a staged buffer holds before its chunk is copied: a chunk written too early shows."""


class GatedCopier:
    """A :class:`~fedpipe.net.dataplane.staging.Copier` that copies on a thread of its own,
    a chunk once the test lets it go (:meth:`release`; ``free``: each at once), into a
    buffer filled with :data:`UNCOPIED` until then; each chunk's readiness is a
    ``threading.Event`` set after its bytes are in. It notes which chunks a writer waited
    for (:meth:`wait_for_writer`)."""

    def __init__(self, chunk_bytes: int, free: bool = False):
        self.chunk_bytes, self.free = chunk_bytes, free
        self.gates: list[threading.Event] = []
        self.waited: list[int] = []  # chunks a writer called ``ready`` of, in order
        self.cond = threading.Condition()

    def stage(self, flat: torch.Tensor) -> Staged:
        nbytes = flat.numel()
        host = bytearray([UNCOPIED]) * nbytes
        source = bytes(flat.numpy())
        ends = staging.chunk_ends(nbytes, self.chunk_bytes)
        self.gates = [threading.Event() for _ in ends]
        done = [threading.Event() for _ in ends]
        if self.free:
            self.release_all()

        def copy() -> None:
            start = 0
            for end, gate, ready in zip(ends, self.gates, done):
                gate.wait()
                host[start:end] = source[start:end]
                ready.set()
                start = end
        threading.Thread(target=copy, daemon=True).start()
        return Staged(memoryview(host),
                      tuple(Mark(e, self._ready(i, r)) for i, (e, r) in enumerate(zip(ends, done))))

    def _ready(self, i: int, done: threading.Event):
        def ready() -> None:
            with self.cond:
                self.waited.append(i)
                self.cond.notify_all()
            done.wait()
        return ready

    def wait_for_writer(self, i: int) -> None:
        """Return once a writer waits for (or waited for) chunk ``i``'s copy."""
        with self.cond:
            assert self.cond.wait_for(lambda: i in self.waited, WAIT), \
                f"no writer waited for chunk {i}'s copy (it waited for {self.waited})"

    def release(self, i: int) -> None:
        self.gates[i].set()

    def release_all(self) -> None:
        for gate in self.gates:
            gate.set()


def _source(nbytes: int) -> torch.Tensor:
    """``nbytes`` of distinct-looking bytes (no chunk equals another), as a uint8 tensor."""
    return (torch.arange(nbytes, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        piece = sock.recv(n - len(out))
        assert piece, f"the stream ended after {len(out)} of {n} bytes"
        out += piece
    return bytes(out)


@pytest.mark.parametrize("nbytes, chunk", [(1, 4), (4, 4), (5, 4), (12, 4), (13, 4),
                                           (3 << 20, 1 << 20), ((4 << 20) + 1, 4 << 20)])
def test_chunk_ends_cover_a_payload_exactly_in_chunks_no_larger_than_asked(nbytes, chunk):
    ends = staging.chunk_ends(nbytes, chunk)
    assert ends[-1] == nbytes
    sizes = [b - a for a, b in zip([0, *ends], ends)]
    assert all(0 < s <= chunk for s in sizes) and sum(sizes) == nbytes
    assert all(s == chunk for s in sizes[:-1])
    staging.check_marks([Mark(e, lambda: None) for e in ends], nbytes)


def test_marks_that_do_not_cover_the_payload_exactly_are_refused():
    def marks(*ends):
        return [Mark(e, lambda: None) for e in ends]
    assert staging.chunk_ends(0) == []
    for bad, nbytes in [(marks(), 4), (marks(2), 4), (marks(2, 6), 4), (marks(2, 2, 4), 4),
                        (marks(3, 2, 4), 4), (marks(0, 4), 4)]:
        with pytest.raises(ValueError, match="do not cover a payload of 4 bytes"):
            staging.check_marks(bad, nbytes)
    with pytest.raises(ValueError, match="into chunks of 0 bytes"):
        staging.chunk_ends(10, 0)


def test_only_a_raw_device_tensor_with_elements_is_staged():
    device = torch.empty(3, device="meta")  # a tensor off the CPU, on every torch build
    assert staging.stageable(device, "raw")
    assert not staging.stageable(torch.empty(3), "raw")  # the CPU path stays as it is
    assert not staging.stageable(device, "raw+zstd") and not staging.stageable(device, "fp16")
    assert not staging.stageable(torch.empty(0, device="meta"), "raw")


def test_a_staged_tensor_has_the_header_a_raw_cpu_tensor_has():
    t = torch.randn(3, 5)
    msg, staged = staging.stage(t, GatedCopier(16, free=True))
    want, payload = codecs.encode_payload(t, "raw")
    assert msg == want and len(staged.payload) == len(payload) == 60
    for mark in staged.marks:
        mark.ready()
    assert bytes(staged.payload) == bytes(payload)


def _tls_pair(node_ca) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """Two ends of a socketpair over mutual TLS, as the data plane's dialer and listener
    make them (the certificates of nodes ``a`` and ``b``)."""
    plain_a, plain_b = socket.socketpair()
    server = server_context(TlsConfig.load(node_ca, "b"))
    client = client_context(TlsConfig.load(node_ca, "a"))
    out: dict[str, ssl.SSLSocket] = {}

    def accept() -> None:
        out["b"] = server.wrap_socket(plain_b, server_side=True)
    t = threading.Thread(target=accept)
    t.start()
    a = client.wrap_socket(plain_a, server_hostname="127.0.0.1")
    t.join(WAIT)
    return a, out["b"]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_the_writer_writes_each_chunk_once_it_is_copied_and_before_the_next_is(tls, node_ca):
    """Chunk i is let go only after the peer received chunk i-1 in full: a writer that
    waited for the whole payload would never finish (the peer's read times out), and one
    that wrote a chunk before its copy would send :data:`UNCOPIED` bytes."""
    writer_sock, peer = _tls_pair(node_ca) if tls else socket.socketpair()
    peer.settimeout(WAIT)
    conn = Connection(writer_sock, dialed=True)
    # chunks across TLS records: the held-back seams must still arrive in order
    nbytes, chunk = 5 * connection.TLS_RECORD + 1234, 2 * connection.TLS_RECORD - 100
    source = _source(nbytes)
    copier = GatedCopier(chunk)
    msg, staged = staging.stage(source, copier)
    head, tail = b"H" * 37, b"T" * 16
    errors: list[BaseException] = []

    def write() -> None:
        try:
            conn.write_staged(head, staged.payload, staged.marks, tail)
        except BaseException as e:  # noqa: BLE001 — raised in the test's thread below
            errors.append(e)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    stream = head + bytes(source.numpy()) + tail
    received = 0
    for i, mark in enumerate(staged.marks):
        copier.wait_for_writer(i)  # the writer waits for this chunk's copy ...
        copier.release(i)          # ... which goes only once the one before arrived
        if i == len(staged.marks) - 1:
            upto = len(stream)
        elif tls:  # whole TLS records only: a chunk's tail waits for the next chunk
            upto = (len(head) + mark.end) // connection.TLS_RECORD * connection.TLS_RECORD
        else:
            upto = len(head) + mark.end
        assert upto > received  # every chunk here is longer than a record
        assert _recv_exact(peer, upto - received) == stream[received:upto], f"chunk {i}"
        received = upto
    writer.join(WAIT)
    assert not writer.is_alive() and not errors, errors
    peer.setblocking(False)
    with pytest.raises((BlockingIOError, ssl.SSLWantReadError)):
        peer.recv(1)  # nothing more than the record
    conn.close()
    peer.close()


def env(step: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=1, step=step, kind=node_pb2.KIND_ACTIVATION,
                             batch_size=4)


class Inbox:
    """A Receiver that keeps what it is given; it asks for pinned memory with ``pinned``."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.got: list[torch.Tensor] = []
        self.cond = threading.Condition()

    def admit(self, peer, header):
        return frames.Admitted(codecs.MAX_TENSOR_BYTES, None, self.pinned)

    def deliver(self, peer, header, tensor):
        with self.cond:
            self.got.append(tensor)
            self.cond.notify_all()

    def wait(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, WAIT), len(self.got)


def test_a_staged_tensor_cut_off_mid_record_is_resent_whole_from_the_same_buffer():
    lost: list[str] = []

    class Heard:
        def lost(self, peer, why):
            lost.append(why)

        def failed(self, peer, why):
            lost.append(f"failed: {why}")

    b_in = Inbox()
    with DataPlane("a", Inbox(), timeouts=FAST, events=Heard()) as a, \
            DataPlane("b", b_in, timeouts=FAST) as b:
        link = a.link("b", b.address)
        source = torch.randn(3 * 4096)  # 48 KiB: three chunks of 16 KiB
        copier = GatedCopier(16 * 1024)
        msg, staged = staging.stage(source, copier)
        sender = threading.Thread(target=link.send_encoded, args=(msg, staged.payload),
                                  kwargs=dict(envelope=env(0), marks=staged.marks), daemon=True)
        sender.start()
        first = link.conn
        assert first is not None
        copier.release(0)
        copier.wait_for_writer(1)  # the first chunk is written: the connection breaks
        first.close()
        copier.release_all()
        sender.join(WAIT)
        assert not sender.is_alive()
        link.flush(WAIT)
        assert link.conn is not first and not link.retained
        accepted = b.links()[0]
    assert lost and not any(w.startswith("failed") for w in lost)
    assert len(b_in.got) == 1 and torch.equal(b_in.got[0], source)
    assert accepted.received == 1 and accepted.duplicates == 0


def test_a_tensor_staged_while_the_link_is_down_is_written_once_its_copies_are_done():
    """A tensor sent while no connection carries the link goes when one is attached: the
    resend in :meth:`Link.attach` waits for the chunks' copies as a first write does (the
    bytes that arrive are the copied ones, never :data:`UNCOPIED`)."""
    b_in = Inbox()
    a_link = Link("a", "node", "b", Inbox(), timeouts=FAST)
    b_link = Link("b", "node", "a", b_in, timeouts=FAST)
    source = torch.randn(5000)
    copier = GatedCopier(4096)
    msg, staged = staging.stage(source, copier)
    send = threading.Thread(target=a_link.send_encoded, args=(msg, staged.payload),
                            kwargs=dict(envelope=env(0), marks=staged.marks), daemon=True)
    send.start()
    copier.wait_for_writer(0)  # the first chunk's copy is waited for before it is kept
    assert not a_link.retained
    copier.release(0)
    send.join(WAIT)
    assert a_link.conn is None and len(a_link.retained) == 1  # kept for the connection
    a_sock, b_sock = socket.socketpair()
    a_conn, b_conn = Connection(a_sock, dialed=True), Connection(b_sock, dialed=False)
    b_link.attach(b_conn, a_link.preface(), Peer("a", "node"))
    threading.Thread(target=b_link.read, args=(b_conn,), daemon=True).start()
    attach = threading.Thread(target=a_link.attach,
                              args=(a_conn, b_link.preface(), Peer("b", "node")), daemon=True)
    attach.start()  # resends the tensor: waits for its chunks
    for i in range(1, len(staged.marks)):
        copier.wait_for_writer(i)
        copier.release(i)
    attach.join(WAIT)
    assert not attach.is_alive()
    threading.Thread(target=a_link.read, args=(a_conn,), daemon=True).start()
    try:
        a_link.flush(WAIT)
        b_in.wait(1)
    finally:
        a_link.close()
        b_link.close()
    assert len(b_in.got) == 1 and torch.equal(b_in.got[0], source)


class FailingCopier:
    """A :class:`~fedpipe.net.dataplane.staging.Copier` whose chunk ``fails`` cannot be
    copied: its mark's ``ready`` raises (as a CUDA event's ``synchronize`` does after a
    device error); the chunks before it are copied at once."""

    def __init__(self, chunk_bytes: int, fails: int):
        self.chunk_bytes, self.fails = chunk_bytes, fails

    def stage(self, flat: torch.Tensor) -> Staged:
        ends = staging.chunk_ends(flat.numel(), self.chunk_bytes)

        def ready(i: int):
            def wait() -> None:
                if i >= self.fails:
                    raise RuntimeError("CUDA error: an illegal memory access (injected)")
            return wait
        return Staged(memoryview(bytearray(flat.numpy().tobytes())),
                      tuple(Mark(e, ready(i)) for i, e in enumerate(ends)))


class Breaks:
    """LinkEvents that note the first break or failure of a link."""

    def __init__(self):
        self.seen = threading.Event()

    def lost(self, peer, why):
        self.seen.set()

    def failed(self, peer, why):
        self.seen.set()


def test_a_chunk_whose_copy_fails_fails_the_link_and_its_cut_record_is_never_delivered():
    """The record's head and first chunk are on the wire when the second chunk's copy
    fails: nothing may follow them on that connection (the peer would take the next
    record's bytes for the rest of the payload), and the tensor can never be resent."""
    b_in, b_events = Inbox(), Breaks()
    with DataPlane("a", Inbox(), timeouts=FAST) as a, \
            DataPlane("b", b_in, timeouts=FAST, events=b_events) as b:
        link = a.link("b", b.address)
        msg, staged = staging.stage(torch.randn(3 * 4096), FailingCopier(16 * 1024, fails=1))
        with pytest.raises(LinkFailed, match="injected"):
            link.send_encoded(msg, staged.payload, envelope=env(0), marks=staged.marks)
        assert link.credits.failed is not None and not link.retained
        with pytest.raises(LinkFailed):
            link.send(torch.arange(100_000, dtype=torch.float32), envelope=env(1))
        assert b_events.seen.wait(WAIT), "the peer never saw the connection end"
    assert b_in.got == []


def test_a_first_chunk_whose_copy_fails_is_not_sent_and_leaves_the_link_up():
    b_in = Inbox()
    with DataPlane("a", Inbox(), timeouts=FAST) as a, DataPlane("b", b_in, timeouts=FAST) as b:
        link = a.link("b", b.address)
        msg, staged = staging.stage(torch.randn(3 * 4096), FailingCopier(16 * 1024, fails=0))
        with pytest.raises(staging.CopyFailed, match="injected"):
            link.send_encoded(msg, staged.payload, envelope=env(0), marks=staged.marks)
        assert link.credits.failed is None and not link.retained
        plain = torch.arange(10)
        link.send(plain, envelope=env(1))
        link.flush(WAIT)
    assert len(b_in.got) == 1 and torch.equal(b_in.got[0], plain)


def test_a_resend_whose_copy_fails_fails_the_link():
    a_link = Link("a", "node", "b", Inbox(), timeouts=FAST)
    b_link = Link("b", "node", "a", Inbox(), timeouts=FAST)
    msg, staged = staging.stage(torch.randn(5000), FailingCopier(4096, fails=1))
    a_link.send_encoded(msg, staged.payload, envelope=env(0), marks=staged.marks)
    assert a_link.conn is None and len(a_link.retained) == 1  # kept for the connection
    a_sock, b_sock = socket.socketpair()
    a_conn, b_conn = Connection(a_sock, dialed=True), Connection(b_sock, dialed=False)
    try:
        b_link.attach(b_conn, a_link.preface(), Peer("a", "node"))
        with pytest.raises(LinkFailed, match="injected"):  # what attach's callers handle
            a_link.attach(a_conn, b_link.preface(), Peer("b", "node"))
        assert a_link.credits.failed is not None and a_link.conn is None
        assert a_conn.closed and not a_link.retained
    finally:
        a_link.close()
        b_link.close()


def test_a_staged_tensor_keeps_no_other_sender_waiting_for_its_first_chunk():
    """The first chunk's copy waits for the kernels that made the tensor: the link's write
    lock is not held meanwhile, so another tensor (another stage's) goes first."""
    b_in = Inbox()
    with DataPlane("a", Inbox(), timeouts=FAST) as a, DataPlane("b", b_in, timeouts=FAST) as b:
        link = a.link("b", b.address)
        source, plain = torch.randn(3 * 4096), torch.arange(10)
        copier = GatedCopier(16 * 1024)
        msg, staged = staging.stage(source, copier)
        first = threading.Thread(target=link.send_encoded, args=(msg, staged.payload),
                                 kwargs=dict(envelope=env(0), marks=staged.marks), daemon=True)
        other = threading.Thread(target=link.send, args=(plain,),
                                 kwargs=dict(envelope=env(1)), daemon=True)
        first.start()
        try:
            copier.wait_for_writer(0)
            other.start()
            b_in.wait(1)
        finally:
            copier.release_all()
        first.join(WAIT)
        other.join(WAIT)
        link.flush(WAIT)
    assert len(b_in.got) == 2
    assert torch.equal(b_in.got[0], plain) and torch.equal(b_in.got[1], source)


def test_tls_link_carries_a_staged_tensor_and_a_cpu_tensor_in_order(node_ca):
    b_in = Inbox()
    with DataPlane("a", Inbox(), tls=TlsConfig.load(node_ca, "a"), timeouts=FAST) as a, \
            DataPlane("b", b_in, tls=TlsConfig.load(node_ca, "b"), timeouts=FAST) as b:
        link = a.link("b", b.address)
        staged_t, plain_t = torch.randn(70_001), torch.arange(10)
        msg, staged = staging.stage(staged_t, GatedCopier(50_000, free=True))
        link.send_encoded(msg, staged.payload, envelope=env(0), marks=staged.marks)
        link.send(plain_t, envelope=env(1))
        link.flush(WAIT)
    assert len(b_in.got) == 2
    assert torch.equal(b_in.got[0], staged_t) and torch.equal(b_in.got[1], plain_t)


@pytest.fixture
def no_pinning(monkeypatch):
    """Pinned memory unavailable: as it is here (a CPU-only torch build), or made so where
    a CUDA device would pin it; and the once-a-process warning not given yet."""
    monkeypatch.setattr(staging, "_pin_warned", False)
    if torch.cuda.is_available():
        empty = torch.empty

        def unpinnable(*args, pin_memory=False, **kw):
            if pin_memory:
                raise RuntimeError("no pinned memory allocator (injected)")
            return empty(*args, **kw)
        monkeypatch.setattr(torch, "empty", unpinnable)


def test_without_pinned_memory_a_pinned_reservation_is_pageable_and_says_so_once(
        no_pinning, caplog):
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        first = connection.reserve_pinned(1000)
        second = connection.reserve_pinned(10)
    assert first.dtype == torch.uint8 and first.shape == (1000,) and not first.is_pinned()
    assert second.shape == (10,)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "pinned host memory is unavailable" in warned[0]
    assert "pageable memory" in warned[0]


def test_a_receiver_that_asks_for_pinned_memory_gets_every_tensor_exactly(no_pinning):
    b_in = Inbox(pinned=True)
    sent = [torch.randn(3, 5), torch.randn(4, 6).to(torch.bfloat16), torch.rand(7) > 0.5,
            torch.arange(12).view(3, 4), torch.randn(8, 8)]
    with DataPlane("a", Inbox(), timeouts=FAST) as a, DataPlane("b", b_in, timeouts=FAST) as b:
        link = a.link("b", b.address)
        for i, t in enumerate(sent[:-1]):
            link.send(t, envelope=env(i))
        link.send(sent[-1], envelope=env(len(sent) - 1), codec="fp16")  # decoded, not pinned
        link.flush(WAIT)
    assert len(b_in.got) == len(sent)
    for t, got in zip(sent[:-1], b_in.got):
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
        got.view(-1)[0] = got.view(-1)[1]  # writable
    assert torch.allclose(b_in.got[-1], sent[-1], atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_round_trips_through_pinned_buffers_and_back_to_the_device():
    from fedpipe.net.dataplane.staging import CudaCopier
    from fedpipe.node.peers import SocketSender

    device = torch.device("cuda")
    copier = CudaCopier(chunk_bytes=1 << 20)
    b_in = Inbox(pinned=True)
    with DataPlane("a", Inbox(), timeouts=FAST) as a, DataPlane("b", b_in, timeouts=FAST) as b:
        link = a.link("b", b.address)
        # made by a kernel just before: the copy stream must wait for it
        big = torch.randn(1_500_000, device=device) * 3 + 1  # 5.7 MiB: six chunks
        msg, staged = staging.stage(big, copier)
        assert len(staged.marks) == 6
        link.send_encoded(msg, staged.payload, envelope=env(0), marks=staged.marks)
        sender = SocketSender(link, "b:0", "b", copier=copier)
        odd = torch.randn(64, 33, device=device).t()  # not contiguous
        sender.submit(env(1), odd, "raw")
        sender.submit(env(2), torch.randn(100, device=device), "fp16")  # a codec: as today
        try:
            sender.flush()
        finally:
            sender.close()
        link.flush(WAIT)
    assert len(b_in.got) == 3
    got0, got1 = b_in.got[0], b_in.got[1]
    assert got0.is_pinned() and got1.is_pinned()
    on_device = got0.to(device, non_blocking=True)
    assert torch.equal(on_device, big)
    assert torch.equal(got1.to(device, non_blocking=True), odd)
    torch.cuda.synchronize()
