"""What a node machine can do: device, cores, memory and a measured FLOP/s figure."""
from __future__ import annotations

import os
import platform
import socket
import statistics
import time

import psutil
import torch

from ..planner import protoio
from ..proto import node_pb2
from ..wire import codecspeed


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


def measure_flops(device: str = "cpu", n: int = 1024, batch: int = 64,
                  seconds: float = 0.5) -> float:
    """Training speed on ``device``, FLOP/s: median over repeated forward + backward
    passes of an n×n float32 linear layer on ``batch`` samples (6·batch·n² FLOP each).

    A layer's forward and backward, not a bare large matmul, so the figure
    includes what small training matmuls really get (the planner divides
    per-layer FLOPs by it); the median, not the best run, so a busy machine
    is not taken for an idle one.
    """
    dev = torch.device(device)
    w = torch.randn(n, n, device=dev, requires_grad=True)
    x = torch.randn(batch, n, device=dev, requires_grad=True)
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(rates) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        (x @ w).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        rates.append(6 * batch * n * n / (time.perf_counter() - t0))
        w.grad = x.grad = None
    return statistics.median(rates[1:])


BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""Linux: a random id per boot of the machine, the same in every process and container
on it."""


def host_id() -> str:
    """An id shared by every node on this machine (and only them): its boot id, else its
    host name. Nodes of one host share its cores (the planner's ``host_factors``)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def host_cores() -> int:
    """Logical cores this machine lets processes run on (CPU affinity, where known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def probe(device: str = "cpu", memory_limit: int | None = None) -> node_pb2.Resources:
    """Measure this machine.

    Args:
        device: "cpu", "cuda[:N]" (after :func:`resolve_device`).
        memory_limit: cap on the advertised memory, bytes (None: what is available).

    A CPU node also advertises its machine's available memory (``host_memory_bytes``),
    which the planner shares among the nodes of its host as it shares the cores
    (:func:`fedpipe.planner.costs.host_memory_shares`); a GPU's memory is its own.
    Every node advertises its codecs' CPU costs (:func:`fedpipe.wire.codecspeed.measure`:
    codecs run on the CPU whatever the device).
    """
    dev = torch.device(device)
    host_memory = 0
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory = props.name, props.total_memory
    else:
        name = platform.processor() or platform.machine()
        memory = host_memory = psutil.virtual_memory().available
    if memory_limit is not None:
        memory = min(memory, memory_limit)
    return node_pb2.Resources(device=device, device_name=name, cores=torch.get_num_threads(),
                              memory_bytes=int(memory), flops=measure_flops(device),
                              hostname=socket.gethostname(),
                              # a GPU is not shared the way cores are: no host for it
                              host_id=host_id() if dev.type == "cpu" else "",
                              host_cores=host_cores(),
                              # the planner splits it among the nodes of one host
                              host_memory_bytes=int(host_memory),
                              codec_speeds=codec_speeds())


def codec_speeds() -> list[node_pb2.CodecSpeed]:
    """This machine's codec costs (:func:`fedpipe.wire.codecspeed.measure`) as messages."""
    return protoio.codec_speed_messages(codecspeed.measure())
