"""Plain single-process PyTorch training, the yardstick of the equivalence tests."""
from __future__ import annotations

import copy


def single_process(model, loss_fn, spec, batches) -> dict:
    """A copy of ``model`` trained one optimizer step per batch; its state_dict."""
    model = copy.deepcopy(model)
    opt = spec.build(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def max_relative_difference(a: dict, b: dict) -> float:
    """Per tensor max|a - b| / max|b|, the worst over the state dicts (same keys)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() or 1.0) for k in b)


def digit_batches(n: int, batch: int = 32) -> list:
    """The first ``n`` batches of scikit-learn's digits (training split), ``batch`` rows
    each: ``x`` (batch, 64) float32, ``y`` (batch,) int64."""
    from fedpipe.examples import digits
    x, y, _, _ = digits.load()
    gen = digits.batches(x, y, batch)
    return [next(gen) for _ in range(n)]


def job_info(client, job):
    """The tracker's JobInfo of ``job`` now."""
    from fedpipe.proto import tracker_pb2
    return client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
