"""Peer-address checks behind the node's refusal of pickled code from remote peers."""
import pytest

from fedpipe import net

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
