"""Tied parameters across stages (issue 22), in one process: the gradient sum between the
copies' stages, and what submit refuses."""
from __future__ import annotations

import queue
import threading

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client.weights import package
from fedpipe.node.initial import make_layers
from fedpipe.proto import node_pb2
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.materialize import MaterializeError, sum_tied_gradients
from fedpipe.runtime.ties import TiedGradients
from fedpipe.spec import JobSpec, JobSpecError, StageKey, WeightsSpec

TIES = [[(0, "weight"), (2, "weight")]]


class Mailboxes:
    """Two stages' transports over queues, keyed by (receiver, kind, step, tag)."""

    def __init__(self):
        self.boxes: dict[tuple, queue.Queue] = {}
        self.lock = threading.Lock()

    def box(self, key) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())

    def of(self, me: StageKey):
        outer = self

        class T:
            def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
                outer.box((peer, kind, step, tag)).put(tensor.clone())

            def recv(self, kind, step, tag, timeout=None):
                return outer.box((me, kind, step, tag)).get(timeout=10), 1
        return T()


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]


def test_the_copies_on_two_stages_get_the_sum_of_their_gradients_and_stay_bit_equal():
    layers = _layers()
    for layer in layers:
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
    want = [nn.Linear(4, 4) for _ in range(3)]
    for w, layer in zip(want, layers):
        w.load_state_dict(layer.state_dict())
        for pw, p in zip(w.parameters(), layer.parameters()):
            pw.grad = p.grad.clone()
    sum_tied_gradients(want, TIES)
    spans = [StageSpan(StageKey(0, 0), 0, 2), StageSpan(StageKey(0, 1), 2, 3)]
    boxes = Mailboxes()
    first = TiedGradients({0: layers[0], 1: layers[1]}, StageKey(0, 0), TIES, spans,
                          boxes.of(StageKey(0, 0)))
    second = TiedGradients({2: layers[2]}, StageKey(0, 1), TIES, spans, boxes.of(StageKey(0, 1)))
    t = threading.Thread(target=second, args=(0,))
    t.start()
    first(0)
    t.join(10)
    assert torch.equal(layers[0].weight.grad, layers[2].weight.grad)
    assert torch.equal(layers[0].weight.grad, want[0].weight.grad)
    assert torch.equal(layers[1].weight.grad, want[1].weight.grad)  # not tied: untouched
    assert torch.equal(layers[0].bias.grad, want[0].bias.grad)


def test_a_tie_under_the_async_schedule_is_refused_saying_why():
    spec = JobSpec(steps=1, optimizer=b"o", loss_fn=b"l", schedule="async",
                   weights=WeightsSpec("seed", ties=(((0, "a"), (1, "b")),)))
    with pytest.raises(JobSpecError, match="synchronous schedule") as e:
        spec.validate(2)
    assert e.value.field == "schedule"


def test_a_parameter_shared_by_two_layers_without_a_tie_is_refused_naming_both():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(MaterializeError, match=r"layer 0's 'weight' is also layer 2's 'weight'"):
        package(nn.Sequential(a, nn.ReLU(), b), torch.zeros(2, 4))


def test_seeded_tied_copies_start_equal_and_the_source_layer_travels_as_code():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    code = package(model, torch.zeros(2, 4), seed=3, ties=TIES)
    assert [i for i, _ in code.weights.tie_sources] == [0]
    # the node of the last layer alone makes its copy equal to the source's seeded values
    alone, _ = make_layers(node_pb2.LoadStageRequest(layers=code.layers[2:]), code.weights, 2,
                           torch.device("cpu"))
    made = fedpipe.materialize(model, 3, ties=TIES)
    assert torch.equal(made[0].weight, made[2].weight)
    assert torch.equal(alone[0].weight, made[0].weight)
    assert torch.equal(alone[0].bias, made[2].bias)
