"""Stage-to-stage tensors travel over the socket data plane between nodes that offer one,
and so does the client's feed (inputs to the first stage, targets to the last).

Real processes: a tracker and two nodes. Each node exports which data plane
carried each tensor it sent (``fedpipe_link_transport_tensors_total``), so the
tests see the bytes' path, not only the result. A node started with
``--no-data-port`` offers only gRPC; its links fall back to the gRPC data
plane, and the job still trains exactly as plain PyTorch does.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import fedpipe
from fedpipe.testing import LocalSwarm
from reference import max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
STEPS, BATCH, MICROBATCHES = 3, 16, 4
OPT = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transports(port: int, by: str = "transport") -> dict[tuple[str, str], float]:
    """``{(dst, transport): tensors}`` a node sent, from its /metrics page (``by="kind"``:
    ``{(dst, kind): tensors}``, every transport's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    name = {"transport": "fedpipe_link_transport_tensors_total",
            "kind": "fedpipe_link_sent_tensors_total"}[by]
    return {(s.labels["dst"], s.labels[by]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name}


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def train(swarm: LocalSwarm, client: fedpipe.Client | None = None):
    torch.manual_seed(0)
    model = mlp()
    batches = [(torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,))) for _ in range(STEPS)]
    loss_fn = nn.CrossEntropyLoss()
    expected = single_process(model, loss_fn, OPT, batches)
    job = (client or swarm.client()).submit(model, loss_fn, OPT, batches, steps=STEPS,
                                microbatches=MICROBATCHES, schedule="1f1b", stages=2,
                                compression="none", checkpoint_every=1)
    status = job.wait(timeout=150, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS, status
    assert len({a.node_id for a in status.plan.stages}) == 2, "expected a 2-stage pipeline"
    got = job.state_dict()
    job.release()
    assert max_relative_difference(got, model.state_dict()) > 1e-3
    assert max_relative_difference(got, expected) <= 1e-5
    return status


def weights_streamed(status) -> dict[str, int]:
    """Tensors of each node's initial-weights stream (``fedpipe.runtime.weights_link``: a
    begin marker, its stage's layers' tensors, an end marker), by node name."""
    layers = list(mlp())
    return {a.node_name: 2 + sum(len(layers[i].state_dict())
                                 for i in range(a.layer_start, a.layer_end))
            for a in status.plan.stages}


def fed(client: fedpipe.Client) -> dict[str, int]:
    """``{node name: tensors}`` the client's socket links carried to each node, every one
    acknowledged (delivered) by the node."""
    plane = client.data_plane()
    assert plane is not None
    links = plane.links()
    assert all(not link.retained for link in links), links  # each one acknowledged
    return {link.peer_name: link.next_seq for link in links}


def start(swarm: LocalSwarm, *node_args: list[str]) -> list[int]:
    """Start a node per argument list, each with a metrics port; return the ports."""
    ports = []
    for i, extra in enumerate(node_args):
        ports.append(free_port())
        swarm.add_node("--metrics-port", str(ports[-1]), *extra)
        swarm.wait_for_nodes(i + 1)
    swarm.wait_for_links()
    return ports


def test_a_two_stage_job_sends_its_tensors_over_the_socket_plane_and_trains_exactly():
    with LocalSwarm(n_nodes=0) as swarm:
        ports = start(swarm, [], [])
        nodes = {n.name: n for n in swarm.client().nodes()}
        assert all(n.data_address.startswith("127.0.0.1:") for n in nodes.values()), nodes
        client = swarm.client()  # the feed goes over sockets by default
        status = train(swarm, client)
        assert all(a.data_address for a in status.plan.stages), status.plan
        # the feed: one tensor a step to each end of the pipeline (inputs to the first
        # stage's node, targets to the last's), after each stage's initial weights, all
        # over sockets
        streamed = weights_streamed(status)
        assert fed(client) == {n: STEPS + streamed[n] for n in ("node0", "node1")}
        sent = [transports(p) for p in ports]
        # activations one way, gradients the other, and each stage's checkpoint snapshots
        # to its buddy (the other node): all over the socket plane, none on gRPC
        for port, mine, peer in ((ports[0], sent[0], "node1"), (ports[1], sent[1], "node0")):
            kinds = transports(port, by="kind")
            assert kinds.get((peer, "snapshot"), 0) >= 2, kinds  # a skeleton and tensors
            assert mine.get((peer, "socket"), 0) >= STEPS * MICROBATCHES, mine
            assert mine.get((peer, "grpc"), 0) == 0, mine


def test_a_node_without_a_data_port_is_served_over_grpc_and_the_job_trains_exactly():
    with LocalSwarm(n_nodes=0) as swarm:
        ports = start(swarm, [], ["--no-data-port"])
        nodes = {n.name: n for n in swarm.client().nodes()}
        assert nodes["node0"].data_address and not nodes["node1"].data_address
        client = swarm.client()
        status = train(swarm, client)
        # the client feeds (and streams the initial weights to) node0 over sockets,
        # node1 (gRPC only) over gRPC
        assert fed(client) == {"node0": STEPS + weights_streamed(status)["node0"]}
        sent = [transports(p) for p in ports]
        for mine, peer in ((sent[0], "node1"), (sent[1], "node0")):
            assert mine.get((peer, "grpc"), 0) >= STEPS * MICROBATCHES, mine
            assert mine.get((peer, "socket"), 0) == 0, mine


def test_a_data_port_in_use_is_a_clear_error_at_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "fedpipe", "node", "--tracker",
                              "127.0.0.1:1", "--host", "127.0.0.1", "--data-port", str(port),
                              "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"data port {port}" in out.stderr, out.stderr[-2000:]


def test_an_emulated_link_shapes_the_socket_plane_too():
    latency = 0.1
    profile = {"links": [{"from": "node0", "to": "node1", "latency_ms": latency * 1e3}]}
    with LocalSwarm(n_nodes=0, link_profile=profile) as swarm:
        ports = start(swarm, [], [])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        batch = (torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,)))
        job = swarm.client().submit(model, nn.CrossEntropyLoss(), OPT, [batch], steps=4,
                                    microbatches=2, schedule="gpipe", stages=2,
                                    compression="none")
        times = [ev.time for ev in job.events() if ev.step > 0]
        assert job.wait(timeout=150, progress=False).state == "SUCCEEDED"
        job.release()
        sent = [transports(p) for p in ports]
        assert sent[0].get(("node1", "socket"), 0) > 0 and sent[1].get(("node0", "socket"), 0)
    # a step crosses the link at least twice (activations out, gradients back): each way
    # pays the emulated latency, which a step on loopback would not come near
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps and min(gaps) >= 2 * latency * 0.9, gaps
