"""Link measurement: ask each live node to measure its links to the others."""
from __future__ import annotations

import logging

from ..proto import node_pb2
from .nodes import NodeCallError, NodeCalls
from .store import Store

log = logging.getLogger("fedpipe.tracker")


def measure_links(store: Store, nodes: NodeCalls) -> int:
    """Ask each live node, one at a time, to measure its links to every other live node.

    One node at a time, so no two bandwidth probes share a link. Successful
    measurements are stored; a node that cannot be reached is skipped (its
    links keep their last measurement). Returns the number of measurements
    stored.
    """
    live = store.nodes()
    stored = 0
    for n in live:
        peers = [node_pb2.Peer(node_id=p.node_id, name=p.name, address=p.address)
                 for p in live if p.node_id != n.node_id]
        if not peers:
            continue
        try:
            reply = nodes.measure_links(n.address, node_pb2.MeasureLinksRequest(peers=peers))
        except NodeCallError as e:
            log.warning("node %s could not measure its links: %s", n.name, e)
            continue
        store.set_links(reply.links)
        for m in reply.links:
            if m.error:
                log.warning("link %s -> %s: %s", n.name, m.dst_id, m.error)
            else:
                stored += 1
    log.info("measured %d links among %d nodes", len(live) * (len(live) - 1), len(live))
    return stored
