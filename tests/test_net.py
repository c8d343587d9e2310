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
