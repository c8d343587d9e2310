"""Synchronous pipelines equal single-process training (gradient accumulation).

Real processes: a tracker and 3 nodes on 127.0.0.1 (the session swarm). After
a few steps the weights gathered from the stages must match those of plain
PyTorch trained on the same batches: per tensor, max|a - b| / max|b| <= 1e-5.
The transformer's blocks are classes defined in this file, so their code must
travel to the nodes by value.

The transformer runs in float64: the gradient of attention's key bias is zero
in exact arithmetic, and in float32 AdamW turns its rounding noise (which
differs between one batch and its microbatches, in one process as well) into
full-size updates, so float32 would compare rounding noise, not the pipeline.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from reference import max_relative_difference, single_process

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]
STEPS, BATCH, MICROBATCHES = 4, 32, 4


class Block(nn.Module):
    """A pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.proj(self.ln(x))


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def text_batches(batch: int, seq: int = 32):
    """Character batches of Python's own documentation (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))[:200_000].encode("ascii", "replace")
    data = torch.tensor(list(text), dtype=torch.int64).clamp_(max=127)
    g = torch.Generator().manual_seed(0)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def transformer():
    torch.manual_seed(0)
    d = 32
    return nn.Sequential(nn.Embedding(128, d), Block(d, 4), Block(d, 4), Head(d, 128)).double()


def mlp():
    return digits.make_model(hidden=64)


def digit_batches(batch: int):
    x, y, _, _ = digits.load()
    return digits.batches(x, y, batch)


CASES = {
    "mlp": (mlp, digit_batches, nn.functional.cross_entropy),
    "transformer": (transformer, text_batches, lm_loss),
}
OPTIMIZERS = {
    "sgd": fedpipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw": fedpipe.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_equals_single_process(swarm, case, opt, schedule):
    make, make_batches, loss_fn = CASES[case]
    model = make()
    gen = make_batches(BATCH)
    batches = [next(gen) for _ in range(STEPS)]
    expected = single_process(model, loss_fn, OPTIMIZERS[opt], batches)

    job = swarm.client().submit(model, loss_fn, OPTIMIZERS[opt], batches, steps=STEPS,
                                microbatches=MICROBATCHES, schedule=schedule, stages=3,
                                compression="none")
    status = job.wait(timeout=120, progress=False)
    assert status.state == "SUCCEEDED" and status.step == STEPS
    assert len({a.node_id for a in status.plan.stages}) == 3, "expected a 3-stage pipeline"
    got = job.state_dict()
    job.release()
    # the weights moved, so equality is not trivially the initial weights
    assert max_relative_difference(got, model.state_dict()) > 1e-3
    diff = max_relative_difference(got, expected)
    assert diff <= 1e-5, f"{case}/{opt}/{schedule}: max relative difference {diff:.2e}"
    assert math.isfinite(status.loss)
