"""A 256 MiB activation crosses from stage to stage (and its gradient back), chunked."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fedpipe

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
N = 64 * 2**20  # float32 elements: 256 MiB per sample


class Spread(nn.Module):
    """(B, 1) -> (B, N): each input scaled by a ramp, so every element differs."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.w = n, nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w * torch.linspace(0.5, 1.5, self.n)


class Collapse(nn.Module):
    """(B, N) -> (B, 1): a weighted mean."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.full((1,), 2.0))

    def forward(self, x):
        return (x * self.v).mean(dim=1, keepdim=True)


def test_256_mib_activation_and_gradient_cross_stages(swarm):
    model = nn.Sequential(Spread(N), Collapse())
    x, y = torch.tensor([[3.0]]), torch.tensor([[1.0]])
    spec = fedpipe.optimizer(torch.optim.SGD, lr=0.01)
    ref = copy.deepcopy(model)
    opt = spec.build(ref.parameters())
    nn.functional.mse_loss(ref(x), y).backward()
    opt.step()

    job = swarm.client().submit(model, nn.functional.mse_loss, spec, [(x, y)], steps=1,
                                stages=2, compression="none")
    status = job.wait(timeout=200, progress=False)
    assert status.state == "SUCCEEDED"
    assert {(a.layer_start, a.layer_end) for a in status.plan.stages} == {(0, 1), (1, 2)}
    got = job.state_dict()
    job.release()
    for k, want in ref.state_dict().items():
        assert torch.allclose(got[k], want, rtol=1e-5), (k, got[k], want)
        assert not torch.equal(got[k], model.state_dict()[k]), f"{k} did not train"
