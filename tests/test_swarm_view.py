"""The swarm's view (``fedpipe status``, the dashboard): what its totals and links count."""
from __future__ import annotations

from fedpipe.observe.views import swarm_view
from fedpipe.proto import node_pb2, tracker_pb2

GiB = 1 << 30


def node(node_id: str, alive: bool = True, host: str = "", memory: int = 8 * GiB,
         host_memory: int = 0) -> tracker_pb2.NodeInfo:
    return tracker_pb2.NodeInfo(
        node_id=node_id, name=node_id, address=f"{node_id}:1", alive=alive,
        resources=node_pb2.Resources(device="cpu", cores=1, memory_bytes=memory, flops=1e9,
                                     host_id=host, host_memory_bytes=host_memory))


def test_nodes_sharing_a_host_count_its_memory_once_in_the_totals():
    # was: two nodes on one 8 GiB machine, each advertising the machine's 8 GiB, made 16
    nodes = [node("a", host="h1", host_memory=8 * GiB), node("b", host="h1", host_memory=8 * GiB),
             node("c", memory=2 * GiB)]
    assert swarm_view(nodes, [])["totals"]["memory_bytes"] == 8 * GiB + 2 * GiB
    # nodes that say nothing of their host keep their own figures
    assert swarm_view([node("a"), node("b")], [])["totals"]["memory_bytes"] == 16 * GiB


def test_links_of_gone_nodes_leave_the_links_table_but_stay_in_the_matrix():
    nodes = [node("a"), node("b"), node("gone", alive=False)]
    links = [node_pb2.LinkMeasurement(src_id=s, dst_id=d, bandwidth=1e6, latency=0.01)
             for s, d in (("a", "b"), ("a", "gone"), ("gone", "b"))]
    view = swarm_view(nodes, links)
    assert [(lk["src"], lk["dst"]) for lk in view["links"]] == [("a", "b")]
    assert view["matrix"]["bandwidth"][0][2] == 1e6  # a -> gone, still measured
