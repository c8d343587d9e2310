"""A relay's bounds per job: streams whose dialer names their job (a TAG record) count
against the job's share of the node, in streams and in bytes in flight.

In one process over real loopback sockets (a "node" is an echo server, or a sink that
does not read, and a :class:`~fedpipe.net.relay.Homing`), and once against a
`fedpipe relay` process: a job flooding the relay is refused past its share, naming
it, and another job's stream still gets through.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from fedpipe.net.relay import Homing, Relay, RelayRefused, Tag, dial_job, records
from fedpipe.net.relay.records import RecordType
from fedpipe.net.relay.splice import Home, read_exact
from fedpipe.proc import child_env, free_port
from test_relay import Echo, Server, dial_address, round_trip

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def echo():
    with contextlib.closing(Echo()) as e:
        yield e


class Drain(Server):
    """A server that reads everything and throws it away."""

    def serve(self, conn):
        threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn):
        with conn:
            try:
                while conn.recv(1 << 20):
                    pass
            except OSError:
                pass


class Sink(Server):
    """A server that accepts and never reads: what is sent to it piles up on the way."""

    def __init__(self):
        self.conns: list[socket.socket] = []
        super().__init__()

    def serve(self, conn):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.conns.append(conn)

    def close(self):
        super().close()
        for c in self.conns:
            c.close()


def tagged_round_trip(address: str, tag: Tag, payload: bytes) -> bytes:
    """:func:`test_relay.round_trip` over a tagged stream."""
    with dial_job(address, tag) as s:
        s.settimeout(30)
        writer = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        writer.start()
        got = bytearray()
        while data := s.recv(1 << 20):
            got += data
        writer.join()
    return bytes(got)


@contextlib.contextmanager
def homed(node_port: int, data_port: int | None, **relay_args):
    """A relay (``relay_args``) and node "n1" homed on it (its gRPC port ``node_port``, its
    data port ``data_port``): yields the relay, the homing and its allocation."""
    relay = Relay(**relay_args)
    homing = Homing([relay.address], "n1", node_port, data_port)
    try:
        yield relay, homing, homing.home(timeout=10)
    finally:
        homing.close()
        relay.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_tagged_stream_is_spliced_and_its_open_names_the_job(echo):
    relay = Relay()
    opened: list[records.Open] = []
    homing = Homing([relay.address], "n1", echo.port, echo.port)
    connect = homing._connect
    homing._connect = lambda o: (opened.append(o), connect(o))[1]
    try:
        alloc = homing.home(timeout=10)
        assert alloc.job_streams == relay.max_streams // 4 and alloc.job_window == 8 << 20
        payload = bytes(range(256)) * 3000
        assert tagged_round_trip(alloc.data_address, Tag("job-a", "peer", "n1"),
                                 payload) == payload
        assert round_trip(alloc.grpc_address, b"untagged") == b"untagged"
        assert [(o.service, o.job) for o in opened] == [("data", "job-a"), ("grpc", "")]
    finally:
        homing.close()
        relay.close()


def test_a_job_past_its_streams_is_refused_naming_it_and_other_jobs_go_on(echo):
    held = []
    with homed(echo.port, echo.port, max_streams=8, job_streams=2) as (_, _, alloc):
        try:
            for _ in range(2):
                s = dial_job(alloc.data_address, Tag("job-a", "peer", "n1"))
                s.sendall(b"x")  # it spoke: it holds its place
                held.append(s)
            with pytest.raises(RelayRefused) as refused:
                dial_job(alloc.data_address, Tag("job-a", "peer", "n1"))
            assert "job 'job-a' has 2 streams spliced" in str(refused.value)
            assert "at most 2 a job" in str(refused.value)
            assert tagged_round_trip(alloc.grpc_address, Tag("job-b", "peer", "n1"),
                                     b"job b") == b"job b"
            assert round_trip(alloc.data_address, b"untagged") == b"untagged"
            for s in held:  # job a's streams still work
                s.settimeout(10)
                assert s.recv(1) == b"x"
        finally:
            for s in held:
                s.close()


def test_a_tag_for_another_node_or_a_malformed_one_is_refused_clearly(echo):
    with homed(echo.port, None) as (_, _, alloc):
        with pytest.raises(RelayRefused, match="a stream of job 'job-a' from peer is for node "
                                               "'n2', but this port is for node 'n1'"):
            dial_job(alloc.grpc_address, Tag("job-a", "peer", "n2"))
        with dial_address(alloc.grpc_address) as s:  # a TAG that names no job
            s.sendall(records.pack(RecordType.TAG, 0, 2) + b"{}")
            kind, _, arg = records.unpack(read_exact(s, records.PREFIX_BYTES))
            assert kind is RecordType.REFUSED
            assert "missing fields" in read_exact(s, arg).decode()
        assert round_trip(alloc.grpc_address, b"still serving") == b"still serving"


def test_a_flooding_job_holds_its_window_and_no_more_while_another_job_flows(echo):
    # two streams of a job into a sink that does not read: each stream's window would let
    # 2 MiB be in flight; the job's window stops them at 1.5 MiB together
    sink = Sink()
    window, job_window = 1 << 20, 3 << 19
    relay = Relay(window=window, job_window=job_window)
    homing = Homing([relay.address], "n1", echo.port, sink.port)
    floods: list[socket.socket] = []
    stop = threading.Event()
    seen = [0]

    def flood(s: socket.socket) -> None:
        chunk = b"\0" * (64 << 10)
        try:
            while not stop.is_set():
                s.sendall(chunk)
        except OSError:
            pass

    def watch() -> None:
        while not stop.is_set():
            seen[0] = max(seen[0], relay.jobs("n1").get("job-a", 0))
            time.sleep(0.001)

    try:
        alloc = homing.home(timeout=10)
        for _ in range(2):
            s = dial_job(alloc.data_address, Tag("job-a", "peer", "n1"))
            s.settimeout(30)
            floods.append(s)
            threading.Thread(target=flood, args=(s,), daemon=True).start()
        threading.Thread(target=watch, daemon=True).start()
        assert wait_for(lambda: relay.jobs("n1").get("job-a", 0) == job_window, 30), \
            relay.jobs("n1")
        payload = bytes(range(256)) * 4096  # 1 MiB of job b while job a is stuck
        assert tagged_round_trip(alloc.grpc_address, Tag("job-b", "peer", "n1"),
                                 payload) == payload
        time.sleep(0.2)
        assert seen[0] == job_window  # never above it
        assert relay.jobs("n1").get("job-a") == job_window
    finally:
        stop.set()
        for s in floods:
            s.close()
        homing.close()
        relay.close()
        sink.close()


def test_a_node_that_sends_a_job_more_than_its_window_ends_its_home_naming_the_job():
    # the relay's side of the node -> dialer direction: the home connection is a raw
    # socket pair; this test plays a node that ignores its job's window
    relay_end, node_end = socket.socketpair()
    window, job_window = 64 << 10, 96 << 10
    home = Home(relay_end, "relay R for node n1", window=window, job_window=job_window,
                first_byte=5)
    runner = threading.Thread(target=home.run, daemon=True)
    runner.start()
    dialers = []
    try:
        for _ in range(2):
            relay_side, dialer = socket.socketpair()
            relay_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            dialer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            dialers.append((relay_side, dialer))
            home.splice(relay_side, records.Open("data", "10.0.0.9:4000", "n1"))
            dialer.sendall(Tag("job-a", "peer", "n1").encode())
            assert records.unpack(read_exact(dialer, records.PREFIX_BYTES))[0] \
                is RecordType.ACCEPTED
        sids = []
        for _ in range(2):  # the two OPENs, naming the job
            kind, sid, arg = records.unpack(read_exact(node_end, records.PREFIX_BYTES))
            assert kind is RecordType.OPEN
            assert records.Open.decode(read_exact(node_end, arg)).job == "job-a"
            sids.append(sid)
        data = b"\1" * window  # each within its stream's window; together past the job's
        for sid in sids:
            node_end.sendall(records.pack(RecordType.DATA, sid, len(data)) + data)
        runner.join(20)
        assert not runner.is_alive()
        assert "job 'job-a' has" in home.error and f"window of {job_window}" in home.error
    finally:
        node_end.close()
        home.close()
        for a, b in dialers:
            a.close()
            b.close()


@pytest.mark.processes
def test_a_relay_process_refuses_a_flooding_job_past_its_share_and_another_job_flows(
        echo, tmp_path):
    port = free_port()
    log = open(tmp_path / "relay.log", "w")  # its log: a pipe nobody read would stall it
    proc = subprocess.Popen([sys.executable, "-m", "fedpipe", "relay", "--host", "127.0.0.1",
                             "--port", str(port), "--max-streams", "16", "--job-streams", "3",
                             "--job-bytes", str(1 << 20)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=child_env(1))
    homing = None
    floods: list[socket.socket] = []
    stop = threading.Event()
    drain = Drain()  # the node's data port: job a floods it
    try:
        assert proc.stdout is not None
        assert "fedpipe relay listening" in proc.stdout.readline()
        homing = Homing([f"127.0.0.1:{port}"], "n1", echo.port, drain.port)
        alloc = homing.home(timeout=30)
        assert alloc.job_streams == 3 and alloc.job_window == 1 << 20

        def flood(s: socket.socket) -> None:  # job a sends as fast as it can
            chunk = b"\0" * (256 << 10)
            try:
                while not stop.is_set():
                    s.sendall(chunk)
            except OSError:
                pass

        for _ in range(3):
            s = dial_job(alloc.data_address, Tag("job-a", "flooder", "n1"))
            floods.append(s)
            threading.Thread(target=flood, args=(s,), daemon=True).start()
        with pytest.raises(RelayRefused, match="job 'job-a' has 3 streams spliced"):
            dial_job(alloc.data_address, Tag("job-a", "flooder", "n1"))
        payload = bytes(range(256)) * (8 << 10)  # 2 MiB of job b, both ways, through the flood
        assert tagged_round_trip(alloc.grpc_address, Tag("job-b", "peer", "n1"),
                                 payload) == payload
        assert proc.poll() is None
    finally:
        stop.set()
        for s in floods:
            s.close()
        if homing is not None:
            homing.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        drain.close()


def test_a_tag_that_comes_a_byte_at_a_time_is_read_whole(echo):
    with homed(echo.port, None) as (_, _, alloc), dial_address(alloc.grpc_address) as s:
        for b in Tag("job-a", "peer", "n1").encode():
            s.sendall(bytes([b]))
            time.sleep(0.002)
        kind, _, _ = records.unpack(read_exact(s, records.PREFIX_BYTES))
        assert kind is RecordType.ACCEPTED
        s.sendall(b"dripped")
        assert read_exact(s, 7) == b"dripped"
