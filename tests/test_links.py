"""Link emulation and measurement: the tracker's matrix reflects the emulated links."""
from __future__ import annotations

import pytest

from fedpipe.net.emulation import LinkProfile, parse_link
from fedpipe.proto import tracker_pb2
from fedpipe.testing import LocalSwarm

pytestmark = pytest.mark.timeout(120)


def test_profile_matching_groups_wildcards_and_direction():
    p = LinkProfile({
        "groups": {"a": ["n0", "n1"], "b": ["n2"]},
        "links": [{"from": "a", "to": "b", "mbps": 20, "latency_ms": 30},
                  {"from": "n3", "to": "*", "bandwidth": 1000, "latency_s": 0.5, "oneway": True}],
    })
    assert p.link("n0", "n2") == p.link("n2", "n1") == parse_link({"mbps": 20, "latency_ms": 30})
    assert p.link("n0", "n2").bandwidth == 2.5e6 and p.link("n0", "n2").latency == 0.03
    assert p.link("n3", "n0").bandwidth == 1000 and p.link("n0", "n3") is None
    assert p.link("n0", "n1") is None and p.link("n2", "n2") is None
    assert p.shaper("n0", "n2") is p.shaper("n0", "n2")  # one token bucket per directed pair


@pytest.mark.parametrize("bad,msg", [
    ({"links": [{"to": "x"}]}, "needs 'from' and 'to'"),
    ({"links": [{"from": "a", "to": "b", "mbps": 1, "gbps": 1}]}, "one of bandwidth"),
    ({"links": [{"from": "a", "to": "b", "mbps": -1}]}, ">= 0"),
    ([], "JSON object"),
])
def test_bad_profiles_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LinkProfile(bad)


@pytest.mark.processes
def test_measured_matrix_reflects_10_mbit_50_ms_emulated_link():
    profile = {"links": [{"from": "node0", "to": "node1", "mbps": 10, "latency_ms": 50}]}
    with LocalSwarm(n_nodes=2, link_profile=profile) as s:
        reply = s.client().stub.ListNodes(tracker_pb2.ListNodesRequest(), timeout=10)
        names = {n.node_id: n.name for n in reply.nodes}
        links = {(names[m.src_id], names[m.dst_id]): m for m in reply.links}
        assert set(links) == {("node0", "node1"), ("node1", "node0")}
        for m in links.values():
            assert 0.8 * 1.25e6 <= m.bandwidth <= 1.2 * 1.25e6, m.bandwidth
            assert 0.8 * 0.050 <= m.latency <= 1.2 * 0.050, m.latency


def test_a_misspelled_key_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['mbit'\]"):
        LinkProfile({"links": [{"from": "a", "to": "b", "mbit": 5}]})
