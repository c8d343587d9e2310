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
