"""What a node machine can do: device, cores, memory and a measured FLOP/s figure."""
from __future__ import annotations

import platform
import socket
import time

import psutil
import torch

from ..proto import node_pb2


def resolve_device(device: str) -> str:
    """Turn "auto" into "cuda" when a GPU is visible, else "cpu".

    Raises:
        ValueError: "cuda" was asked for but no GPU is visible, or an unknown name.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is visible to PyTorch")
        return device
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")
    return device


def measure_flops(device: str = "cpu", n: int = 512, seconds: float = 0.3) -> float:
    """Float32 matmul speed on ``device``, FLOP/s: best of repeated n×n products."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        (a @ b).sum().item()
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / dt)
        if time.perf_counter() > deadline:
            return best


def probe(device: str = "cpu", memory_limit: int | None = None) -> node_pb2.Resources:
    """Measure this machine.

    Args:
        device: "cpu", "cuda[:N]" (after :func:`resolve_device`).
        memory_limit: cap on the advertised memory, bytes (None: what is available).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory = props.name, props.total_memory
    else:
        name = platform.processor() or platform.machine()
        memory = psutil.virtual_memory().available
    if memory_limit is not None:
        memory = min(memory, memory_limit)
    return node_pb2.Resources(device=device, device_name=name, cores=torch.get_num_threads(),
                              memory_bytes=int(memory), flops=measure_flops(device),
                              hostname=socket.gethostname())
