"""The tracker plans around a slow link it measured: emulated two-site swarm on one machine.

Four node processes; node0-node1 and node2-node3 are two sites joined by a
20 Mbit/s, 30 ms emulated link. A model whose activations cross every stage
boundary each microbatch must not have a pipeline hop over the slow link.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.testing import LocalSwarm

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]
TWO_SITES = {
    "groups": {"a": ["node0", "node1"], "b": ["node2", "node3"]},
    "links": [{"from": "a", "to": "b", "mbps": 20, "latency_ms": 30}],
}


def wide_mlp(width=512, depth=6):
    torch.manual_seed(0)
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def test_plan_keeps_the_slow_link_out_of_the_pipeline():
    site = {"node0": "a", "node1": "a", "node2": "b", "node3": "b"}
    with LocalSwarm(n_nodes=4, link_profile=TWO_SITES) as s:
        x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
        job = s.client().submit(wide_mlp(), nn.functional.cross_entropy,
                                fedpipe.optimizer(torch.optim.SGD, lr=0.01), [(x, y)],
                                steps=3, microbatches=8)
        status = job.wait(timeout=150, progress=False)
        assert status.state == "SUCCEEDED"
        groups: dict[int, list] = {}
        for a in status.plan.stages:
            groups.setdefault(a.replica, []).append(a)
        for chain in groups.values():
            chain.sort(key=lambda a: a.stage)
            hops = {(site[u.node_name], site[v.node_name]) for u, v in zip(chain, chain[1:])}
            assert all(a == b for a, b in hops), f"pipeline hop over the slow link: {status.plan}"
