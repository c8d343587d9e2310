"""The relay in one process, over real loopback sockets: splicing, credit, half-close, refusals,
identities under TLS, and re-homing after the relay is lost.

A "node" here is an echo server (the port a relay's streams reach) and a
:class:`~fedpipe.net.relay.Homing`; peers are plain sockets that dial the addresses
the relay allocated.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from fedpipe.net import timeouts
from fedpipe.net.relay import Homing, Relay, RelayError, RelayRefused, dial, records
from fedpipe.net.relay.home import split_relays
from fedpipe.security import PermissionDenied, Role, TlsConfig, certs
from fedpipe.security.policy import POLICY, authorize
from fedpipe.security.tls import server_context

pytestmark = pytest.mark.timeout(60)


class Server:
    """A loopback TCP server that hands each connection it accepts to :meth:`serve`;
    counts them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.served = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.served += 1
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self):
        self.sock.close()


class Echo(Server):
    """A server that sends back what it receives, then half-closes when its peer does."""

    def serve(self, conn):
        threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)


@pytest.fixture
def echo():
    e = Echo()
    yield e
    e.close()


def dial_address(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=20)


def round_trip(address: str, payload: bytes) -> bytes:
    """Send ``payload`` to ``address``, half-close, read everything back to the end."""
    with dial_address(address) as s:
        writer = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        writer.start()
        got = bytearray()
        while data := s.recv(1 << 20):
            got += data
        writer.join()
    return bytes(got)


def test_streams_to_a_homed_node_are_spliced_both_ways_with_half_close(echo):
    relay = Relay(window=64 * 1024)  # a small window: the payloads need many credits each
    homing = Homing([relay.address], "n1", echo.port, echo.port)
    try:
        alloc = homing.home(timeout=10)
        assert alloc.relay == relay.address and alloc.window == 64 * 1024
        assert alloc.grpc_address != alloc.data_address
        assert alloc.grpc_address.rpartition(":")[2] != str(echo.port)
        payloads = [bytes(range(256)) * (4000 + 97 * i) for i in range(4)]
        results: dict[int, bytes] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(
            i, round_trip(alloc.grpc_address if i % 2 else alloc.data_address, p)))
            for i, p in enumerate(payloads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] == p for i, p in enumerate(payloads)] == [True] * 4
        assert echo.served == 4
        deadline = time.monotonic() + 5
        while relay.homed() != {"n1": 0} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.homed() == {"n1": 0}, "every stream ended on both sides"
    finally:
        homing.close()
        relay.close()


def test_a_stream_whose_node_port_is_closed_is_reset_and_others_still_flow(echo):
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    relay = Relay()
    homing = Homing([relay.address], "n1", echo.port, dead_port)
    try:
        alloc = homing.home(timeout=10)
        with dial_address(alloc.data_address) as s:
            assert s.recv(10) == b"", "the dialer sees its connection end"
        assert round_trip(alloc.grpc_address, b"still here") == b"still here"
    finally:
        homing.close()
        relay.close()


def test_a_relay_at_its_node_limit_refuses_the_next_node_naming_the_limit(echo):
    relay = Relay(max_nodes=1)
    first = Homing([relay.address], "n1", echo.port, None)
    second = Homing([relay.address], "n2", echo.port, None)
    try:
        first.home(timeout=10)
        with pytest.raises(RelayRefused, match=r"refused node 'n2'.*homes 1 nodes, its limit"):
            second.home(timeout=10)
        assert relay.homed() == {"n1": 0}, "the refusal left the homed node alone"
        assert round_trip(first.allocation.grpc_address, b"x" * 1000) == b"x" * 1000
    finally:
        first.close()
        second.close()
        relay.close()


def test_a_node_without_a_data_port_gets_no_data_address(echo):
    relay = Relay()
    homing = Homing([relay.address], "n1", echo.port, None)
    try:
        assert homing.home(timeout=10).data_address == ""
    finally:
        homing.close()
        relay.close()


def test_something_that_is_not_a_relay_is_a_clear_error():
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    threading.Thread(target=answer, daemon=True).start()
    try:
        with pytest.raises(RelayError, match="not a fedpipe relay record"):
            dial(f"127.0.0.1:{server.getsockname()[1]}", records.Hello(node="n1"), None)
    finally:
        server.close()


def test_a_relay_refuses_a_malformed_hello_and_goes_on_homing(echo):
    relay = Relay()
    try:
        with dial_address(relay.address) as s:
            s.sendall(records.pack(records.RecordType.HELLO, 0, 2) + b"[]")
            kind, _, arg = records.unpack(s.recv(records.PREFIX_BYTES, socket.MSG_WAITALL))
            assert kind is records.RecordType.REFUSED
            assert b"not a JSON object" in s.recv(arg, socket.MSG_WAITALL)
        homing = Homing([relay.address], "n1", echo.port, None)
        homing.home(timeout=10)
        homing.close()
    finally:
        relay.close()


def test_a_node_rehomes_at_its_restarted_relay_and_keeps_its_addresses(echo):
    relay = Relay()
    moved = []
    homing = Homing([relay.address], "n1", echo.port, echo.port, on_moved=moved.append)
    try:
        alloc = homing.home(timeout=10)
        relay.close()
        relay = Relay(port=relay.port)  # the same relay, back
        deadline = time.monotonic() + 45  # generous: a loaded machine
        while homing.homings < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert homing.homings == 2 and homing.relay == relay.address
        assert (homing.allocation.grpc_address, homing.allocation.data_address) == \
            (alloc.grpc_address, alloc.data_address)
        assert moved == [], "the same addresses: nothing to tell the tracker"
        assert round_trip(alloc.data_address, b"again" * 1000) == b"again" * 1000
    finally:
        homing.close()
        relay.close()


def test_a_node_whose_relay_stays_away_moves_to_the_next_and_says_so(echo, monkeypatch):
    monkeypatch.setattr(timeouts, "RELAY_FAILOVER", 0.5)
    first, second = Relay(), Relay()
    moved = []
    homing = Homing([first.address, second.address], "n1", echo.port, echo.port,
                    on_moved=moved.append)
    try:
        homing.home(timeout=10)
        assert homing.relay == first.address
        first.close()
        deadline = time.monotonic() + 45  # generous: a loaded machine
        while not moved and time.monotonic() < deadline:
            time.sleep(0.05)
        assert homing.relay == second.address and moved == [homing.allocation]
        assert moved[0].relay == second.address
        assert round_trip(moved[0].grpc_address, b"moved" * 100) == b"moved" * 100
    finally:
        homing.close()
        first.close()
        second.close()


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    certs.make_ca(d)
    certs.issue(d, Role.RELAY, "relay")
    for name in ("node0", "node1"):
        certs.issue(d, Role.NODE, name)
    certs.issue(d, Role.CLIENT, "client")
    return d


def test_under_tls_a_node_homes_as_its_certificate_and_streams_pass_through(ca, echo):
    relay = Relay(tls=TlsConfig.load(ca, "relay"))
    homing = Homing([relay.address], "node0", echo.port, None, tls=TlsConfig.load(ca, "node0"))
    try:
        alloc = homing.home(timeout=10)
        assert round_trip(alloc.grpc_address, b"secret" * 999) == b"secret" * 999
    finally:
        homing.close()
        relay.close()


def test_under_tls_a_node_claiming_another_nodes_identity_is_refused(ca, echo):
    relay = Relay(tls=TlsConfig.load(ca, "relay"))
    honest = Homing([relay.address], "node0", echo.port, None, tls=TlsConfig.load(ca, "node0"))
    liar = Homing([relay.address], "node0", echo.port, None, tls=TlsConfig.load(ca, "node1"))
    try:
        alloc = honest.home(timeout=10)
        with pytest.raises(RelayRefused, match=r"refused node 'node0': the certificate is "
                                               r"node 'node1', which may home only as itself, "
                                               r"not as node 'node0'"):
            liar.home(timeout=10)
        assert relay.homed() == {"node0": 0}, "the liar took nothing over"
        assert honest.allocation == alloc
        assert round_trip(alloc.grpc_address, b"ok") == b"ok"
    finally:
        honest.close()
        liar.close()
        relay.close()


def test_under_tls_a_client_certificate_may_not_home(ca, echo):
    relay = Relay(tls=TlsConfig.load(ca, "relay"))
    client = Homing([relay.address], "client", echo.port, None, tls=TlsConfig.load(ca, "client"))
    try:
        with pytest.raises(RelayRefused, match=r"the certificate is client 'client'"):
            client.home(timeout=10)
    finally:
        client.close()
        relay.close()


def test_under_tls_a_node_homes_only_at_a_relay_certificate(ca):
    with pytest.raises(ValueError, match="role relay"):
        Relay(tls=TlsConfig.load(ca, "node1"))
    # a server showing a node's certificate where the node expects its relay
    server = socket.create_server(("127.0.0.1", 0))
    ctx = server_context(TlsConfig.load(ca, "node1"))

    def handshake():
        conn, _ = server.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls_conn:
            tls_conn.recv(1)
    threading.Thread(target=handshake, daemon=True).start()
    try:
        with pytest.raises(RelayRefused, match=r"is node 'node1', not a relay"):
            dial(f"127.0.0.1:{server.getsockname()[1]}", records.Hello(node="node0"),
                 TlsConfig.load(ca, "node0"))
    finally:
        server.close()


def test_the_relay_role_may_call_no_rpc():
    relay = certs.Identity(Role.RELAY, "relay", 1)
    for method, rule in POLICY.items():
        if rule.public:
            continue
        with pytest.raises(PermissionDenied, match="wrong role"):
            authorize(method, relay)


def test_two_live_nodes_under_one_name_do_not_displace_each_other_without_end(echo):
    # was: each HELLO closed the other's home, whose node re-homed at once, a dozen times
    # a second each; now the relay tells the displaced one, which stops homing
    relay = Relay()
    told = []
    first = Homing([relay.address], "n1", echo.port, None, on_displaced=told.append)
    second = Homing([relay.address], "n1", echo.port, None)
    try:
        first.home(timeout=10)
        second.home(timeout=10)
        time.sleep(1)  # (it was a dozen displacements a second, each)
        assert (first.homings, second.homings) == (1, 1)
        assert told == [first.displaced] and not second.displaced
        assert first.displaced.startswith(f"relay {relay.address} displaced node n1: node "
                                          f"'n1' homed again at relay {relay.address} from "
                                          "127.0.0.1:"), first.displaced
        assert "another process runs as 'n1'" in first.displaced
        alloc = second.allocation
        assert alloc is not None and relay.homed() == {"n1": 0}
        assert round_trip(alloc.grpc_address, b"still served") == b"still served"
    finally:
        first.close()
        second.close()
        relay.close()


def test_a_reset_record_longer_than_a_reason_may_be_ends_the_home_connection():
    relay = Relay()
    try:
        sock, alloc = dial(relay.address, records.Hello(node="n1", data=0), None)
        with sock:
            # a RESET promising 4 GiB of reason: was read as 4096 bytes of whatever follows
            # (the next records of other streams), the relay blocking until they came
            sock.sendall(records.pack(records.RecordType.RESET, 7, 0xFFFFFFFF) + b"why")
            sock.settimeout(5)
            assert sock.recv(1) == b"", "the relay ends the home connection at once"
        deadline = time.monotonic() + 5
        while relay.homed() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.homed() == {}
    finally:
        relay.close()


def test_idle_connections_from_one_source_do_not_take_every_stream_slot_of_a_node(echo):
    # was: max_streams idle connections (a connect each, no byte sent) made the node
    # unreachable through its relay
    relay = Relay(max_streams=4)
    homing = Homing([relay.address], "n1", echo.port, None)
    idle = []
    try:
        alloc = homing.home(timeout=10)
        idle = [dial_address(alloc.grpc_address) for _ in range(4)]
        deadline = time.monotonic() + 5
        while relay.homed() != {"n1": 2} and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert relay.homed() == {"n1": 2}, "one source holds half the slots at most"
        # a dialer that speaks takes the place of a silent one
        assert round_trip(alloc.grpc_address, b"a peer") == b"a peer"
        closed = 0
        for s in idle:  # the two past the source's share, and one for the peer, were closed
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
        assert closed >= 3
    finally:
        for s in idle:
            s.close()
        homing.close()
        relay.close()


@pytest.mark.parametrize("first", [b"", records.MAGIC[:1], records.MAGIC[:-1]],
                         ids=["nothing", "a byte of a TAG", "all but a byte of a TAG"])
def test_a_dialer_that_falls_silent_is_closed_after_the_first_byte_timeout(echo, first):
    # was (a part of a TAG's magic): the part stayed readable, so the relay polled it for
    # ever and held the stream
    relay = Relay(first_byte=0.5)
    homing = Homing([relay.address], "n1", echo.port, None)
    try:
        alloc = homing.home(timeout=10)
        with dial_address(alloc.grpc_address) as silent:
            silent.sendall(first)
            started = time.monotonic()
            silent.settimeout(10)
            try:
                assert silent.recv(1) == b""
            except ConnectionResetError:
                pass
            assert 0.4 < time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while relay.homed() != {"n1": 0} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.homed() == {"n1": 0}
        assert round_trip(alloc.grpc_address, b"spoken") == b"spoken"  # one that speaks is not
    finally:
        homing.close()
        relay.close()


@pytest.mark.parametrize("bound,value", [("max_nodes", 0), ("max_streams", 0), ("window", 0),
                                         ("job_window", 0), ("job_streams", -1)])
def test_a_relay_with_a_bound_below_one_is_refused_at_start(bound, value):
    # was: it started, then refused every node (max_nodes 0), or its nodes refused its
    # allocation and retried without end (max_streams or window 0), or every TAG
    # (job_streams -1)
    with pytest.raises(ValueError, match=f"{bound} must be at least 1.*got {value}"):
        Relay(**{bound: value})


@pytest.mark.parametrize("text,why", [
    ("http://127.0.0.1:7071", "not a URL"),   # was: accepted, then retried for ever
    ("127.0.0.1", "expected HOST:PORT"),
    ("relay:0", "a port in 1..65535"),
    ("", "names no relay"),                          # was (the CLI's --relay ''): ignored
    (" , ", "names no relay")])
def test_a_bad_relay_list_is_refused_naming_the_entry(text, why):
    with pytest.raises(ValueError, match=why):
        split_relays(text)
    assert split_relays("a:1, b:2") == ["a:1", "b:2"]
