"""Peer-address checks behind the node's refusal of pickled code from remote peers; a failed
call's reason and retry line."""
import logging

import grpc
import pytest

from fedpipe import net
from fedpipe.status import StatusError

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("peer,loopback", [
    ("ipv4:127.0.0.1:5000", True),
    ("ipv4:127.3.2.1:80", True),
    ("ipv6:[::1]:5000", True),
    ("unix:/tmp/sock", True),
    ("ipv4:10.0.0.7:5000", False),
    ("ipv6:[2001:db8::1]:443", False),
    ("ipv4:not-an-ip:1", False),
    ("", False),
])
def test_is_loopback_peer(peer, loopback):
    assert net.is_loopback_peer(peer) is loopback


def test_read_tensors_hands_over_each_tensor_before_the_stream_ends():
    """A peer stream stays open between tensors: each must be yielded as soon as
    its last byte is in, not when the next one starts or the stream ends."""
    import queue
    import threading

    import torch

    from fedpipe.wire import frames

    pieces: queue.SimpleQueue = queue.SimpleQueue()
    got: queue.SimpleQueue = queue.SimpleQueue()
    reader = threading.Thread(target=lambda: [got.put(t) for _, t in frames.read_tensors(
        iter(pieces.get, None))], daemon=True)
    reader.start()
    for i in range(3):
        t = torch.full((3 * 2**18,), float(i))  # 3 MiB: several frames
        for f in frames.encode_frames(t):
            pieces.put(f)
        assert torch.equal(got.get(timeout=10), t)  # before the next tensor is written
    pieces.put(None)
    reader.join(timeout=10)
    assert got.empty() and not reader.is_alive()


def test_emulated_link_delays_each_message_of_a_stream_and_keeps_them_in_flight():
    """The Shaper's delay line: every message of a stream arrives at least the
    link's latency after it was produced, and messages produced 50 ms apart
    overlap in flight (8 of them over a 250 ms link take far less than 8 x 250 ms)."""
    import time

    from fedpipe.net.emulation import EmulatedLink, Shaper
    from fedpipe.proto import node_pb2

    shaper = Shaper(EmulatedLink(bandwidth=0.0, latency=0.25))
    produced = {}

    def source():
        for i in range(8):
            produced[i] = time.monotonic()
            yield node_pb2.Frame(chunk=bytes([i]))
            time.sleep(0.05)

    start = time.monotonic()
    for frame in shaper._pace(source()):
        i = frame.chunk[0]
        assert time.monotonic() - produced[i] >= 0.25 - 1e-3
    assert time.monotonic() - start < 8 * 0.25 / 2


def test_a_retry_against_an_unreachable_tracker_logs_one_short_readable_line(caplog):
    # was: "registering with tracker ... failed (UNAVAILABLE: failed to connect to all
    # addresses; last error: UNKNOWN: ipv4:127.0.0.1:PORT: Failed to connect to remote
    # host: Connection refused); retrying in 0.2 s"
    from fedpipe.proto import tracker_pb2, tracker_pb2_grpc
    from fedpipe.testing import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    stub = tracker_pb2_grpc.TrackerStub(net.channel(address))
    with pytest.raises(grpc.RpcError) as refused, caplog.at_level(logging.WARNING, "fedpipe.net"):
        net.retry(lambda: stub.ListNodes(tracker_pb2.ListNodesRequest(), timeout=5),
                  "registering", peer=f"tracker {address}", attempts=2, first_delay=0.01)
    assert net.reason(refused.value) == ("UNAVAILABLE: Failed to connect to remote host: "
                                         "Connection refused")
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (f"tracker {address} is unreachable (UNAVAILABLE: Failed to connect to "
                    f"remote host: Connection refused); registering again in 0.0 s")


def test_a_reason_is_the_code_and_the_first_line_of_the_details():
    assert net.reason(StatusError(grpc.StatusCode.INTERNAL, "boom\n  at frame 1")) == \
        "INTERNAL: boom"
    assert net.reason(StatusError(grpc.StatusCode.DEADLINE_EXCEEDED)) == "DEADLINE_EXCEEDED"


UNRESOLVED = ("errors resolving 127.0.01:7070: [field:hostname lookup error:address lookup "
              "failed for 127.0.01:7070: Domain name not found]")
"""gRPC core's details for a host its resolver cannot resolve (a typo'd IP address here:
the operating system takes 127.0.01 as 127.0.0.1, gRPC does not)."""


@pytest.mark.parametrize("details", [
    UNRESOLVED,
    "DNS resolution failed for 127.0.01:7070: C-ares status is not ARES_SUCCESS",
])
def test_a_host_grpc_cannot_resolve_is_said_in_one_line_by_the_cli_and_the_client(details):
    from fedpipe.security.explain import _Explainer

    line = ("cannot resolve host '127.0.01' (127.0.01:7070): neither an IP address nor a "
            "name DNS knows")
    error = StatusError(grpc.StatusCode.UNAVAILABLE, details)
    assert net.reason(error) == f"UNAVAILABLE: {line}"  # the CLI's line (fedpipe status)
    # a Client's channel: the same line, with gRPC's status code, and no probe of the host
    explained = _Explainer("127.0.01:7070", None).explain_rpc(error)
    assert (explained.code(), explained.details()) == (grpc.StatusCode.UNAVAILABLE, line)
    assert str(explained) == f"UNAVAILABLE: {line}"


def test_an_unresolved_ipv6_host_is_named_without_its_brackets():
    from fedpipe.security.tls import unresolved

    assert unresolved("errors resolving [fe80::zz]:7070: [Domain name not found]") == (
        "cannot resolve host 'fe80::zz' ([fe80::zz]:7070): neither an IP address nor a name "
        "DNS knows")
    assert unresolved("failed to connect to all addresses; last error: UNKNOWN: "
                      "ipv4:127.0.0.1:7070: Connection refused") is None
