"""A stage's initial weights over the socket data plane (``PutWeights``' socket form,
:mod:`fedpipe.runtime.weights_link`), in one process over real sockets on 127.0.0.1 with
mutual TLS: the client's :class:`~fedpipe.client.feed.ChannelNodes` puts a streamed
("stream" init) stage's layers on the node's real receiver and weights desk, which
loads them exactly; a node's refusal (a stage that has its weights, a digest or shape
that differs, another plan epoch, another user's job) comes back as the status code
``PutWeights`` ends with on gRPC, with a message naming what was wrong, and leaves the
stage waiting for a good stream."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch
from torch import nn

from fedpipe.client.feed import ChannelNodes
from fedpipe.client.links import LinkError, client_plane
from fedpipe.client.weights import TensorsOf, package, weight_tensors
from fedpipe.net.dataplane import DataPlane
from fedpipe.node.access import JobAccessBook
from fedpipe.node.dataplane import NodeReceiver
from fedpipe.node.errors import NoSuchStage
from fedpipe.node.initial import Pending, WeightsDesk, make_layers
from fedpipe.node.lifecycle import StageSlot, StageState
from fedpipe.proto import node_pb2
from fedpipe.security import TlsConfig
from fedpipe.spec import StageKey

pytestmark = pytest.mark.timeout(60)
EPOCH = 3


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Linear(4, 3))


class Plane:
    """The client's side: its socket plane, as ``Client.data_plane`` gives it."""

    def __init__(self, plane):
        self.plane = plane

    def data_plane(self):
        return self.plane

    def node(self, address):
        raise AssertionError("a node with a data port is not called over gRPC")


class Node:
    """A node holding stage (0, 1) of alice's job "j" (layers 1 to 3 of :func:`mlp`: a
    ReLU, which has no tensors, then two Linears),
    waiting for its streamed weights: the real receiver, access book and weights desk."""

    def __init__(self, ca_dir, model: nn.Sequential):
        code = package(model, torch.zeros(2, 6))
        assert code.weights.source == "stream" and code.tensors is not None
        self.tensors: TensorsOf = code.tensors
        request = node_pb2.LoadStageRequest(layers=code.layers[1:4])
        layers, pending = make_layers(request, code.weights, 1, torch.device("cpu"))
        self.layers = layers[1:]  # the Linears
        assert pending is not None
        self.pending: Pending = pending
        access = JobAccessBook()
        access.learn("j", "alice", ["node0"], [StageKey(0, 1)])
        stage = SimpleNamespace(epoch=EPOCH, pending=pending,
                                state=StageState.AWAITING_WEIGHTS)

        def stage_of(slot: StageSlot):
            if slot != StageSlot("j", 0, 1):
                raise NoSuchStage(f"no stage {slot.stage} of job {slot.job_id!r} here")
            return stage
        self.receiver = NodeReceiver(access, None, None,  # type: ignore[arg-type]
                                     weights=WeightsDesk(stage_of))  # type: ignore[arg-type]
        self.plane = DataPlane("node0", self.receiver, tls=TlsConfig.load(ca_dir, "node0"))
        self.at = node_pb2.StageAssignment(replica=0, stage=1, node_name="node0",
                                           data_address=self.plane.address, address="unused")

    def put(self, ca_dir, tensors, user: str = "alice", epoch: int = EPOCH, stage: int = 1
            ) -> None:
        env = node_pb2.Envelope(job_id="j", replica=0, stage=stage, epoch=epoch,
                                kind=node_pb2.KIND_WEIGHTS)
        at = node_pb2.StageAssignment()
        at.CopyFrom(self.at)
        at.stage = stage
        # a fresh plane (a new connection, the same name) per put: was, about 1 run in 3,
        # the closed plane's ssl call went on writing records into the next connection,
        # which reused its descriptor (the node: "UNEXPECTED_MESSAGE" at its handshake)
        with client_plane(TlsConfig.load(ca_dir, user)) as plane:
            ChannelNodes(Plane(plane)).put_weights(at, env, tensors)


def refused(node: Node, ca_dir, tensors, **kw) -> LinkError:
    with pytest.raises(LinkError) as e:
        node.put(ca_dir, tensors, **kw)
    assert not node.pending.arrived.is_set()  # the stage still waits
    return e.value


def test_a_streamed_stage_takes_its_weights_exactly_over_the_socket_plane(ca_dir):
    torch.manual_seed(0)
    model = mlp()
    node = Node(ca_dir, model)
    with node.plane:
        node.put(ca_dir, weight_tensors(1, 4, node.tensors))
        assert node.pending.arrived.is_set()
        for made, want in zip(node.layers, model[2:4]):
            got, expected = made.state_dict(), want.state_dict()
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in got)
        # 4 tensors between the two markers
        assert node.receiver.weight_tensors == 6
        again = refused_after(node, ca_dir)
    assert again.code() == grpc.StatusCode.ALREADY_EXISTS, again.details()
    assert "has its weights already" in again.details()


def refused_after(node: Node, ca_dir) -> LinkError:
    with pytest.raises(LinkError) as e:
        node.put(ca_dir, weight_tensors(1, 4, node.tensors))
    return e.value


def test_refusals_say_what_was_wrong_and_leave_the_stage_waiting(ca_dir):
    torch.manual_seed(1)
    model = mlp()
    node = Node(ca_dir, model)
    good = list(weight_tensors(1, 4, node.tensors))
    forged = [(n, t.clone() + (1 if n == "3.bias" else 0)) for n, t in good]
    wide = [(n, torch.zeros(7, 5) if n == "2.weight" else t) for n, t in good]
    with node.plane:
        e = refused(node, ca_dir, forged)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer 3: its weights digest to" in e.details(), e.details()
        e = refused(node, ca_dir, wide)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer 2: 'weight' is (7, 5), the layer's is (4, 5)" in e.details(), e.details()
        e = refused(node, ca_dir, good[:3])  # layer 3's bias never came
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer 3: no tensor for 'bias'" in e.details(), e.details()
        e = refused(node, ca_dir, [("0.weight", model[0].weight.detach())])
        assert "layer 0 is not one of this stage's layers 1..3" in e.details(), e.details()
        e = refused(node, ca_dir, good, epoch=EPOCH - 1)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
        assert "plan epoch 3, the weights of epoch 2" in e.details()
        e = refused(node, ca_dir, good, stage=2)
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
        e = refused(node, ca_dir, good, user="bob")
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e.details()
        assert "not the owner of job j" in e.details()
        node.put(ca_dir, good)  # a good stream after all of those
    assert node.pending.arrived.is_set()
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(node.layers, model[2:4]))
