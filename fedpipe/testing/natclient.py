"""The client side of a NAT-network job (tests/test_nat.py, benchmarks/relay.py), run inside
the network's public namespace: ``python -m fedpipe.testing.natclient --tracker T --out F``.

It submits :func:`job` (a 3-stage sync pipeline, no compression) and waits for it, then
saves to ``F`` (``torch.save``): the trained ``state_dict``, the job's final state and
reason, the plan (stage -> node name) and the seconds a step took as the client saw
them (from the first step's end to the job's, over the steps in between). :func:`job` is
deterministic, so the caller computes the reference weights itself
(:func:`tests.reference.single_process` on the same model and batches).
"""
from __future__ import annotations

import argparse
import time

import grpc
import torch
from google.protobuf import json_format
from torch import nn

import fedpipe
from fedpipe.client import Client
from fedpipe.net import timeouts
from fedpipe.proto import tracker_pb2
from fedpipe.security import TlsConfig

OPT = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
JOB_TIMEOUT = 300.0
"""Seconds the client waits for its job to end."""
POLL = 0.1
"""Seconds between the client's looks at its job's step (its step-time figure)."""
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def job(steps: int = 4, batch: int = 16, width: int = 32
        ) -> tuple[nn.Sequential, nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (6 layers, for 3 stages), its loss and ``steps`` batches of ``batch``
    samples (inputs ``(batch, width)``, class targets in 0..2); seeded, the same each call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                          nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 3))
    data = [(torch.randn(batch, width), torch.randint(0, 3, (batch,))) for _ in range(steps)]
    return model, nn.CrossEntropyLoss(), data


def wait_for_nodes(client: Client, names: set[str]) -> dict[str, dict]:
    """Wait until the nodes ``names`` are alive and every link among them is measured (up
    to :data:`JOB_TIMEOUT`); each node's ``NodeInfo`` as a dict of its fields, by name.

    Raises:
        TimeoutError: they were not, in time (the message says what was there).
    """
    deadline, nodes, links = time.monotonic() + JOB_TIMEOUT, {}, 0
    while time.monotonic() < deadline:
        try:
            reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(),
                                          timeout=timeouts.CONTROL_RPC)
        except grpc.RpcError:
            time.sleep(POLL)  # the tracker is starting
            continue
        nodes = {n.name: json_format.MessageToDict(n, preserving_proto_field_name=True)
                 for n in reply.nodes if n.alive}
        ids = {nodes[n]["node_id"] for n in names if n in nodes}
        links = sum(m.src_id in ids and m.dst_id in ids for m in reply.links)
        if set(nodes) >= names and links >= len(names) * (len(names) - 1):
            return nodes
        time.sleep(5 * POLL)
    raise TimeoutError(f"nodes {sorted(names)} were not all alive with their links measured "
                       f"within {JOB_TIMEOUT} s: alive {sorted(nodes)}, {links} link(s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tracker", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--tls-dir", default=None)
    p.add_argument("--tls-name", default="client")
    p.add_argument("--nodes", default="",
                   help="instead of a job: wait until these nodes (NAME,NAME) are alive and "
                        "every link among them is measured, then save the node list")
    args = p.parse_args(argv)
    tls = TlsConfig.load(args.tls_dir, args.tls_name) if args.tls_dir else None
    if args.nodes:
        with Client(args.tracker, tls=tls) as client:
            torch.save(wait_for_nodes(client, set(args.nodes.split(","))), args.out)
        return 0
    model, loss_fn, data = job(args.steps, args.batch, args.width)
    with Client(args.tracker, tls=tls) as client:
        j = client.submit(model, loss_fn, OPT, data, steps=args.steps,
                          microbatches=args.microbatches, schedule="1f1b", stages=3,
                          compression="none")
        first, deadline = None, time.monotonic() + JOB_TIMEOUT
        status = j.status()
        while status.state not in TERMINAL and time.monotonic() < deadline:
            time.sleep(POLL)
            status = j.status()
            if first is None and status.step >= 1:
                first = (time.monotonic(), status.step)
        if status.state not in TERMINAL:
            status = j.wait(timeout=JOB_TIMEOUT, progress=False)
        end = time.monotonic()
        steps_timed = status.step - first[1] if first is not None else 0
        result = {"state": status.state, "reason": status.reason, "step": status.step,
                  "plan": {a.stage: a.node_name for a in status.plan.stages},
                  "step_seconds": (end - first[0]) / steps_timed if first and steps_timed
                  else float("nan"),
                  "weights": j.state_dict() if status.state == "SUCCEEDED" else {}}
        if status.state == "SUCCEEDED":
            j.release()
    torch.save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
