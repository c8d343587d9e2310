"""Codec benchmark: compression ratio, speed and error of each wire codec.

Tensors: the demo model's (``fedpipe.examples.digits``) layer activations,
parameter gradients and activation gradients for a batch of 256 after a few
dozen AdamW steps, plus a 16 MiB N(0, 1) float32 tensor.

    python benchmarks/codecs.py

Other benchmarks import it as ``from benchmarks.codecs import codec_table``
with the repository root on ``sys.path`` (a script in ``benchmarks/`` cannot
``import codecs``: that name is the standard library's).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

try:
    import fedpipe  # noqa: F401
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedpipe.examples import digits  # noqa: E402
from fedpipe.wire.codecs import decode, encode  # noqa: E402

CODECS = ["raw", "fp16", "bf16", "int8", "int8+zstd", "topk:0.01", "topk:0.01+zstd",
          "raw+zstd", "bf16+zstd"]


def demo_tensors(steps: int = 40, batch: int = 256, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Real tensors of the digits MLP after ``steps`` AdamW steps (batch 64).

    Returns:
        ``{"activations": [...], "gradients": [...]}``: each layer's output for
        a batch of ``batch`` samples; each parameter's gradient and the
        gradient of the loss with respect to each layer's output. float32.
    """
    x, y, _, _ = digits.load(seed)
    model = digits.make_model(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _, (xb, yb) in zip(range(steps), digits.batches(x, y, 64, seed)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    activations, act_grads = [], []

    def capture(module, inputs, output):
        activations.append(output.detach().clone())
        output.register_hook(lambda g: act_grads.append(g.detach().clone()))

    handles = [layer.register_forward_hook(capture) for layer in model]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[:batch]), y[:batch]).backward()
    for h in handles:
        h.remove()
    param_grads = [p.grad.detach().clone() for p in model.parameters()]
    return {"activations": activations, "gradients": param_grads + act_grads}


def _best_seconds(fn, args: list, reps: int) -> float:
    """Sum over ``args`` of the best of ``reps`` timings of ``fn(arg)``. The
    repetitions go round all args in turn, so a stall of a busy machine spoils
    one timing of several tensors, not every timing of one."""
    best = [math.inf] * len(args)
    for _ in range(reps):
        for i, arg in enumerate(args):
            start = time.perf_counter()
            fn(arg)
            best[i] = min(best[i], time.perf_counter() - start)
    return sum(best)


def measure(tensors: list[torch.Tensor], codec: str, reps: int = 5) -> dict:
    """Ratio (fp32 bytes / wire bytes), encode and decode MB/s of fp32 data
    (1 MB = 1e6 bytes; per tensor the best of ``reps``) and relative L2 error
    (``sqrt(sum ||decoded - t||²) / sqrt(sum ||t||²)``) over ``tensors``."""
    msgs = [encode(t, codec) for t in tensors]
    outs = [decode(m) for m in msgs]
    fp32 = sum(t.numel() * 4 for t in tensors)
    wire = sum(len(m.payload) for m in msgs)
    err = math.sqrt(sum((o.double() - t.double()).pow(2).sum().item()
                        for o, t in zip(outs, tensors)))
    norm = math.sqrt(sum(t.double().pow(2).sum().item() for t in tensors))
    enc = _best_seconds(lambda t: encode(t, codec), tensors, reps)
    dec = _best_seconds(decode, msgs, reps)
    return {"codec": codec, "ratio": fp32 / wire, "encode_MBps": fp32 / enc / 1e6,
            "decode_MBps": fp32 / dec / 1e6, "rel_l2": err / norm,
            "fp32_bytes": fp32, "wire_bytes": wire}


def codec_table(codecs: list[str] = CODECS) -> list[dict]:
    """One row per (data, codec): the keys of :func:`measure` plus ``data``."""
    data = demo_tensors()
    data["gaussian 16MiB"] = [torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))]
    return [{"data": name, **measure(tensors, codec, reps=5 if name.startswith("gauss") else 7)}
            for name, tensors in data.items() for codec in codecs]


def main() -> None:
    header = (f"{'data':<15} {'codec':<15} {'ratio':>7} {'enc MB/s':>9} {'dec MB/s':>9} "
              f"{'rel L2':>9}")
    print(header)
    print("-" * len(header))
    for row in codec_table():
        print(f"{row['data']:<15} {row['codec']:<15} {row['ratio']:>7.2f} "
              f"{row['encode_MBps']:>9.0f} {row['decode_MBps']:>9.0f} {row['rel_l2']:>9.2e}")


if __name__ == "__main__":
    main()
