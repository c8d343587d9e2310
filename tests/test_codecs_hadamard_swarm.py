"""Training through real links with the Hadamard codecs: 4-bit activations forward, their
gradients back in 4 bits with the peers' error feedback, over a swarm of node processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
STEPS = 800


def test_had4_both_ways_trains_digits_to_the_accuracy_raw_reaches(swarm):
    x_train, y_train, x_test, y_test = digits.load()
    job = swarm.client().submit(digits.make_model(), nn.functional.cross_entropy,
                                fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                                digits.batches(x_train, y_train, 64), steps=STEPS,
                                microbatches=4, schedule="1f1b", stages=2,
                                compression={"activations": "had4", "gradients": "had4:64"})
    status = job.wait(timeout=200, progress=False)
    trained = job.model()
    job.release()
    stages = sorted(status.plan.stages, key=lambda a: a.stage)
    assert (stages[0].activation_codec, stages[1].gradient_codec) == ("had4", "had4:64")
    # raw reaches >= 0.95 in tests/test_compression.py on the same swarm and data
    assert digits.accuracy(trained, x_test, y_test) >= 0.95
