"""Models larger than the client: meta-device jobs and weights that never pass through the
tracker (issue 22), against single-process training, bit for bit.

Real processes: a tracker and 3 nodes on 127.0.0.1 (the session swarm). Three ways in:
- a model built under ``torch.device("meta")``: each node makes its own layers from the
  job's seed; the reference is ``fedpipe.materialize(model, seed)`` trained in one process;
- a model with its weights (the API before meta jobs): the client streams each stage's
  layers to its node (``PutWeights``: over the socket data plane, the nodes' logs say so;
  over gRPC for a client without one);
- ``weights=PATH`` (a safetensors file): the nodes read their own layers' tensors.
In each case the tracker stores only code: each layer pickled on the meta device.
"""
from __future__ import annotations

import copy
import re
import time

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client.weights import package
from fedpipe.runtime.materialize import MaterializeError
from fedpipe.runtime.weights import WeightFiles, WeightsError, save_layers
from reference import digit_batches, microbatched, not_bit_equal

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
STEPS, BATCH, MICROBATCHES = 4, 32, 4
SGD = fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
LOSS = nn.functional.cross_entropy
SOCKET_WEIGHTS = re.compile(r"stage (\d+) of job \S+ \(replica 0\) took its initial weights "
                            r"from \S+ over the socket data plane")
"""A node's log line for a stage's streamed weights taken over its socket data plane
(:mod:`fedpipe.node.dataplane`)."""


def log_marks(swarm) -> dict:
    """Each node's log length now."""
    return {p: len(swarm.log(p)) for p in swarm.nodes}


def socket_weights(swarm, since: dict) -> list[int]:
    """The stages whose weights came over the socket plane past ``since``, sorted."""
    return sorted(int(m.group(1)) for p in swarm.nodes
                  for m in SOCKET_WEIGHTS.finditer(swarm.log(p)[since.get(p, 0):]))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 10))


def _train(swarm, model, save_to=None, **kw) -> tuple[dict, fedpipe.Job]:
    batches = digit_batches(STEPS, BATCH)
    job = swarm.client().submit(model, LOSS, SGD, batches, steps=STEPS,
                                microbatches=MICROBATCHES, schedule="1f1b", stages=3,
                                compression="none", **kw)
    status = job.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS, status
    assert len({a.node_id for a in status.plan.stages}) == 3, "expected a 3-stage pipeline"
    got = job.state_dict()
    if save_to is not None:
        job.save(save_to)
    job.release()
    return got, job



def test_a_meta_job_trains_as_its_materialized_model_does_in_one_process(swarm, tmp_path):
    with torch.device("meta"):
        model = mlp()
    reference = fedpipe.materialize(copy.deepcopy(model), seed=7)
    expected = microbatched(reference, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES)
    assert all(t.is_meta for t in model.state_dict().values())  # the client holds none
    got, job = _train(swarm, model, save_to=tmp_path / "saved", seed=7)
    assert not_bit_equal(got, expected) == []
    with pytest.raises(RuntimeError, match=r"meta device.*job\.save\(path\).*state_dict\(stage="):
        job.model()  # not gathered into the client: saved a stage at a time instead
    with WeightFiles(tmp_path / "saved") as files:  # one shard per stage, by model names
        saved = {k: files.tensor(k) for k in files.keys()}
    assert not_bit_equal(saved, expected) == []


def test_another_seed_makes_other_weights():
    with torch.device("meta"):
        model = mlp()
    a = fedpipe.materialize(copy.deepcopy(model), seed=1).state_dict()
    b = fedpipe.materialize(copy.deepcopy(model), seed=2).state_dict()
    assert not torch.equal(a["0.weight"], b["0.weight"])


def test_a_model_with_weights_is_streamed_to_the_nodes_and_trains_bit_equal(swarm):
    torch.manual_seed(3)
    model = mlp()
    expected = microbatched(model, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES)
    code = package(model, torch.zeros(BATCH, 64))
    assert code.weights.source == "stream"
    assert sum(map(len, code.layers)) < 8 * 1024  # code only: a few KiB, no weights
    since = log_marks(swarm)
    got, job = _train(swarm, model)
    assert not_bit_equal(got, expected) == []
    # each stage with tensors got them over the socket plane (one of activations only,
    # a Tanh alone, say, waits for none)
    streamed = [a.stage for a in job.plan.stages
                if any(model[i].state_dict() for i in range(a.layer_start, a.layer_end))]
    assert len(streamed) >= 2 and socket_weights(swarm, since) == sorted(streamed)


def test_weights_from_a_safetensors_file_are_read_by_the_nodes(swarm, tmp_path):
    torch.manual_seed(4)
    real = mlp()
    path = save_layers(list(real), tmp_path / "w")
    with torch.device("meta"):
        model = mlp()
    expected = microbatched(real, LOSS, SGD, digit_batches(STEPS, BATCH), MICROBATCHES)
    got, _ = _train(swarm, model, weights=path)
    assert not_bit_equal(got, expected) == []


def test_a_meta_layer_nothing_initializes_is_refused_at_submit_naming_it(swarm):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.empty(10))

        def forward(self, x):
            return x * self.s

    with torch.device("meta"):
        model = nn.Sequential(*mlp(), Scale())
    with pytest.raises(MaterializeError, match=r"layer 5 \(Scale\).*\bs\b"):
        swarm.client().submit(model, LOSS, SGD, digit_batches(1, BATCH), steps=1)


def test_weights_that_do_not_fit_the_model_are_refused_at_submit(swarm, tmp_path):
    path = save_layers(list(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))),
                       tmp_path / "w")
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(WeightsError, match="layer 0"):
        swarm.client().submit(model, LOSS, SGD, digit_batches(1, BATCH), steps=1, weights=path)


def test_a_streamed_job_taken_over_before_its_first_checkpoint_gets_its_weights_again(swarm):
    """Client A streams the weights, feeds 2 steps and goes; the job parks at its start (no
    checkpoint yet). Client B, attached by id, resumes it with the model: the rewound stages
    wait for their weights and B streams them, so the job ends as if nothing happened.
    B has no socket plane: its weights go over gRPC's PutWeights."""
    import threading

    torch.manual_seed(6)
    model = mlp()
    batches = digit_batches(STEPS, BATCH)
    expected = microbatched(model, LOSS, SGD, batches, MICROBATCHES)
    gate = threading.Event()

    def first_two():
        yield from batches[:2]
        gate.wait(120)  # the feed stops here until A is gone
        yield from batches[2:]

    a = swarm.client()
    job = a.submit(model, LOSS, SGD, first_two(), steps=STEPS, microbatches=MICROBATCHES,
                   schedule="1f1b", stages=3, compression="none", checkpoint_every=STEPS - 1)
    deadline = time.monotonic() + 60
    while job.status().step < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    a.close()
    since = log_marks(swarm)
    gate.set()
    b = swarm.client(sockets=False)
    resumed = b.job(job.id).resume(batches, model=model)
    status = resumed.wait(timeout=180, progress=False)
    assert status.state == "SUCCEEDED", status
    assert socket_weights(swarm, since) == []  # B's went over gRPC
    assert [r.checkpoint_step for r in status.recoveries] == [0]
    got = resumed.state_dict()
    resumed.release()
    assert not_bit_equal(got, expected) == []
