"""The socket data plane's listener caps (fedpipe.net.dataplane.caps), over real sockets on
loopback: connections per caller (its source host; with TLS its certificate) and in all,
each refused with a GOAWAY naming its cap; a connection that stalls before its preface is
closed at the first-record deadline and gives its slot back; a caller that comes and goes
leaves no link behind."""
from __future__ import annotations

import socket
import time

import pytest

from fedpipe.net.dataplane import DataPlane, LinkFailed, Preface, Timeouts, connection, records
from fedpipe.net.dataplane.caps import Sources
from fedpipe.net.dataplane.records import Code, RecordType
from fedpipe.security import TlsConfig

pytestmark = pytest.mark.timeout(60)
QUICK = Timeouts(credit=5.0, resume=0.3, handshake=2.0, backoff_min=0.02, backoff_max=0.1,
                 first_record=0.5)


class Inbox:
    def admit(self, peer, header):
        return 1 << 20

    def deliver(self, peer, header, tensor):
        pass


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _dial(port: int, name: str, source: str = "127.0.0.1") -> tuple[connection.Connection,
                                                                      RecordType, int, str]:
    """A raw connection that sends a preface as ``name``; its first record back."""
    conn = connection.Connection(_connect(port, source), dialed=True)
    conn.write(Preface(name=name, role="node", session="00", window_bytes=1 << 20,
                       window_messages=16).encode())
    return (conn, *_record(conn))


def _record(conn: connection.Connection) -> tuple[RecordType, int, str]:
    kind, arg = records.unpack(conn.read_exact(records.PREFIX_BYTES))
    if kind is RecordType.PREFACE:
        conn.read_exact(arg)
        return kind, 0, ""
    code, n = records.TEXT.unpack(conn.read_exact(records.TEXT.size))
    return kind, code, conn.read_exact(n).decode()


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_one_caller_past_its_cap_is_refused_naming_it_and_others_are_still_served():
    with DataPlane("b", Inbox(), timeouts=QUICK, max_connections=3,
                   max_caller_connections=2) as b:
        held = [_dial(b.port, f"m{i}") for i in range(2)]
        assert [h[1] for h in held] == [RecordType.PREFACE] * 2
        conn, kind, code, text = _dial(b.port, "m2")
        assert kind is RecordType.GOAWAY and code == Code.RESOURCE_EXHAUSTED
        assert "127.0.0.1 already holds 2" in text and "MAX_CALLER_CONNECTIONS" in text, text
        conn.close()
        # another host (127.0.0.2 is loopback too) is another caller
        other, kind, _, _ = _dial(b.port, "o0", source="127.0.0.2")
        assert kind is RecordType.PREFACE
        # the listener is full now: a third host is refused by the cap in all
        conn, kind, code, text = _dial(b.port, "t0", source="127.0.0.3")
        assert kind is RecordType.GOAWAY and code == Code.RESOURCE_EXHAUSTED
        assert "already holds 3 data connections" in text and "MAX_CONNECTIONS" in text, text
        conn.close()
        assert b.caps.held() == 3
        held[0][0].close()  # a slot comes back when its connection ends
        assert _wait(lambda: b.caps.held("127.0.0.1") == 1)
        again, kind, _, _ = _dial(b.port, "m3")
        assert kind is RecordType.PREFACE
        for c in (again, other, held[1][0]):
            c.close()
        assert _wait(lambda: b.caps.held() == 0)


def test_a_connection_that_stalls_before_its_preface_is_closed_at_the_first_record_deadline():
    with DataPlane("b", Inbox(), timeouts=QUICK, max_caller_connections=1) as b:
        silent = connection.Connection(_connect(b.port), dialed=True)
        t0 = time.monotonic()
        kind, code, text = _record(silent)
        waited = time.monotonic() - t0
        assert kind is RecordType.GOAWAY and code == Code.DEADLINE_EXCEEDED
        assert "no preface within 0.5 s" in text and "DATA_FIRST_RECORD" in text, text
        assert 0.4 < waited < 3.0, waited
        silent.close()
        # a byte at a time, each well within the per-read timeout: the deadline is for all
        drip = _connect(b.port)
        body = Preface(name="slow", role="node", session="00", window_bytes=1,
                       window_messages=1).encode()
        t0, ended = time.monotonic(), False
        try:
            for byte in body:
                drip.sendall(bytes((byte,)))
                time.sleep(0.05)
        except OSError:
            ended = True
        assert ended and time.monotonic() - t0 < 3.0
        drip.close()
        # its slot came back: the one caller may connect again
        assert _wait(lambda: b.caps.held() == 0)
        conn, kind, _, _ = _dial(b.port, "next")
        assert kind is RecordType.PREFACE
        conn.close()


def test_a_caller_that_comes_and_goes_leaves_no_link_behind():
    with DataPlane("b", Inbox(), timeouts=QUICK) as b:
        for i in range(5):
            conn, kind, _, _ = _dial(b.port, f"gone{i}")
            assert kind is RecordType.PREFACE
            conn.close()
        # each link waits QUICK.resume for its dialer, then fails and is dropped
        assert _wait(lambda: not b.links()), b.links()
        assert b.caps.held() == 0


def test_with_tls_a_caller_is_its_certificate_and_its_refusal_is_readable_over_tls(node_ca):
    with DataPlane("b", Inbox(), tls=TlsConfig.load(node_ca, "b"), timeouts=QUICK,
                   max_caller_connections=1) as b:
        a = DataPlane("a", Inbox(), tls=TlsConfig.load(node_ca, "a"), timeouts=QUICK)
        a.link("b", b.address)
        # same host, another certificate: another caller
        c = DataPlane("c", Inbox(), tls=TlsConfig.load(node_ca, "c"), timeouts=QUICK)
        c.link("b", b.address)
        assert b.caps.held("fedpipe://node/a") == 1 and b.caps.held("fedpipe://node/c") == 1
        # a second process with a's certificate: past a's cap, told so over TLS
        a2 = DataPlane("a", Inbox(), tls=TlsConfig.load(node_ca, "a"), timeouts=QUICK)
        with pytest.raises(LinkFailed, match="RESOURCE_EXHAUSTED.*MAX_CALLER_CONNECTIONS"):
            a2.link("b", b.address)
        for p in (a, a2, c):
            p.close()
        assert _wait(lambda: b.caps.held() == 0)


def test_with_tls_a_stalled_handshake_is_closed_at_the_first_record_deadline(node_ca):
    with DataPlane("b", Inbox(), tls=TlsConfig.load(node_ca, "b"), timeouts=QUICK,
                   max_caller_connections=1) as b:
        stalled = _connect(b.port)
        t0 = time.monotonic()
        while stalled.recv(100):  # at most a TLS alert: no TLS to say more in
            pass
        assert time.monotonic() - t0 < 3.0
        stalled.close()
        assert _wait(lambda: b.caps.held() == 0)
        a = DataPlane("a", Inbox(), tls=TlsConfig.load(node_ca, "a"), timeouts=QUICK)
        a.link("b", b.address)
        a.close()


def test_with_tls_a_preface_that_stalls_after_the_handshake_is_refused_over_tls(node_ca):
    from fedpipe.security.tls import client_context

    with DataPlane("b", Inbox(), tls=TlsConfig.load(node_ca, "b"), timeouts=QUICK) as b:
        tls = client_context(TlsConfig.load(node_ca, "a")).wrap_socket(
            _connect(b.port), server_hostname="127.0.0.1")
        tls.sendall(Preface(name="a", role="node", session="00", window_bytes=1,
                            window_messages=1).encode()[:10])  # and no more
        kind, code, text = _record(connection.Connection(tls, dialed=True))
        assert kind is RecordType.GOAWAY and code == Code.DEADLINE_EXCEEDED, text
        assert "DATA_FIRST_RECORD" in text
        tls.close()
        assert _wait(lambda: b.caps.held() == 0)


# found by the adversarial helper: the relayed node's listener saw every relayed
# connection come from its own loopback (the Homing's local socket), so all its peers were
# one caller, and one host's connections through the relay locked every other peer out
def test_one_source_through_a_relay_does_not_lock_other_peers_out_of_a_relayed_node():
    from fedpipe.net.relay import Homing, Relay
    relay = Relay()
    sources = Sources()
    with DataPlane("n1", Inbox(), timeouts=QUICK, max_caller_connections=2,
                   sources=sources) as n1:
        homing = Homing([relay.address], "n1", n1.port, n1.port, sources=sources)
        held = []
        try:
            alloc = homing.home(timeout=10)
            host, _, port = alloc.data_address.rpartition(":")
            assert host == "127.0.0.1"
            held = [_dial(int(port), f"m{i}", source="127.0.0.2") for i in range(2)]
            assert [h[1] for h in held] == [RecordType.PREFACE] * 2
            conn, kind, code, text = _dial(int(port), "peer", source="127.0.0.3")
            conn.close()
            assert kind is RecordType.PREFACE, f"{kind.name} {code}: {text}"
        finally:
            for h in held:
                h[0].close()
            homing.close()
            relay.close()
