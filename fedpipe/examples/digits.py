"""The demo task: scikit-learn's bundled handwritten digits (8×8 images, 10 classes).

``load()`` gives a fixed 80/20 split, ``make_model()`` an MLP as an
``nn.Sequential`` whose children are the pipeline's layers.
"""
from __future__ import annotations

import collections
import time

import torch
from torch import nn


def load(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set, scaled to [0, 1], split 80/20 with a fixed seed.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: x float32 of shape (N, 64),
        y int64 of shape (N,) with N = 1437 train and 360 test samples.

    Raises:
        ImportError: scikit-learn is missing (``pip install fedpipe[demo]``).
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = perm[:cut], perm[cut:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int = 128, seed: int = 0) -> nn.Sequential:
    """An MLP for digits: 64 -> hidden -> hidden -> 10 logits, five children."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0):
    """Endless shuffled (input, target) batches, reshuffled every epoch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            yield x[idx], y[idx]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of samples whose arg-max logit is the label."""
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(client, *, steps: int = 300, batch_size: int = 64, microbatches: int = 4,
          schedule: str = "1f1b", max_staleness: int = 1, stages: int = 0,
          cuts: tuple[int, ...] = (),
          compression: str | dict = "auto", lr: float = 3e-3,
          recompute: bool | str = False, precision: str = "fp32",
          progress: bool = True, out=print) -> float:
    """Train the digits MLP on a swarm through ``client``; return held-out accuracy.
    ``stages`` and ``cuts`` are its ``fedpipe.Placement``'s; ``max_staleness``
    (``schedule="async"`` only), ``recompute`` and ``precision`` are ``submit()``'s.

    Prints the plan (which node holds which layers) and the accuracy as
    ``held-out accuracy: 0.XXXX``.

    Raises:
        fedpipe.client.JobFailed: the job failed.
    """
    import fedpipe

    x_train, y_train, x_test, y_test = load()
    model = make_model()
    job = client.submit(model, nn.functional.cross_entropy,
                        fedpipe.optimizer(torch.optim.AdamW, lr=lr),
                        batches(x_train, y_train, batch_size), steps=steps,
                        microbatches=microbatches, schedule=schedule,
                        max_staleness=max_staleness,
                        placement=fedpipe.Placement(stages=stages, cuts=tuple(cuts)),
                        compression=compression, recompute=recompute,
                        precision=precision, name="digits-mlp")
    status = job.status()
    while not status.plan.stages and status.state in ("PENDING", "PLANNING"):
        time.sleep(0.1)
        status = job.status()
    plan = status.plan
    out(f"plan ({plan.predicted_step_seconds * 1e3:.1f} ms/step predicted):")
    depth = collections.Counter(a.replica for a in plan.stages)
    for a in plan.stages:
        layers = ", ".join(f"{i}:{type(model[i]).__name__}"
                           for i in range(a.layer_start, a.layer_end))
        sends = ([f"activations {a.activation_codec or 'raw'}"]
                 if a.stage < depth[a.replica] - 1 else [])
        sends += [f"gradients {a.gradient_codec or 'raw'}"] if a.stage > 0 else []
        out(f"  group {a.replica} stage {a.stage} on {a.node_name} ({a.address}): {layers}"
            f"  [sends {', '.join(sends) or 'nothing (one stage)'}"
            f"{'; recomputes its forward' if a.recompute else ''}]")
    status = job.wait(progress=progress)
    trained = job.model()
    job.release()
    acc = accuracy(trained, x_test, y_test)
    out(f"final training loss: {status.loss:.4f}")
    out(f"held-out accuracy: {acc:.4f}")
    return acc
