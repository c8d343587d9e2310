"""Layer partition for heterogeneous nodes: PipeDream's min-max dynamic program.

Source: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training" (SOSP 2019), section 3.1. Here each node has its own speed and memory
cap, so the stage cost depends on which node of the chain holds the stage.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .types import Link, ModelProfile, NodeSpec, TrainConfig


def stage_memory_bytes(profile: ModelProfile, start: int, end: int, config: TrainConfig,
                       stage: int, n_stages: int) -> float:
    """Peak memory of a stage holding layers ``[start, end)``, bytes.

    Weights, gradients and optimizer state (``config.state_factor`` × parameter
    bytes) plus the activations stashed for backward: every microbatch of the
    batch under GPipe, at most ``n_stages - stage`` microbatches under 1F1B.
    """
    layers = profile.layers[start:end]
    params = sum(layer.parameter_bytes for layer in layers) * config.state_factor
    per_sample = profile.input_bytes if start == 0 else profile.layers[start - 1].activation_bytes
    per_sample += sum(layer.activation_bytes for layer in layers)
    mb_samples = math.ceil(config.batch_size / config.microbatches)
    in_flight = config.microbatches
    if config.schedule != "gpipe":
        in_flight = min(config.microbatches, n_stages - stage)
    return params + per_sample * mb_samples * in_flight


def stage_compute_seconds(profile: ModelProfile, start: int, end: int, node: NodeSpec,
                          samples: float) -> float:
    """Forward + backward seconds of layers ``[start, end)`` on ``node`` for ``samples``."""
    flops = sum(layer.flops for layer in profile.layers[start:end])
    return flops * samples / node.flops


def partition(chain: Sequence[NodeSpec], profile: ModelProfile, config: TrainConfig,
              link: Callable[[str, str], Link]) -> tuple[list[tuple[int, int]], float] | None:
    """Split the layers into ``len(chain)`` contiguous, non-empty stages, one per node of the chain.

    Minimises the slowest stage's per-microbatch time: compute on that stage's
    node plus sending its output activation (forward) and receiving the
    gradient back (backward) over the link to the next node. Each stage must
    fit its node's memory (:func:`stage_memory_bytes`).

    Args:
        chain: nodes in pipeline order.
        profile: per-layer costs.
        config: batch size, microbatches, schedule.
        link: ``link(a, b)`` gives the link from node id a to node id b.

    Returns:
        ``(ranges, bottleneck_seconds)`` with ``ranges[i] = (start, end)``, or
        None when no split fits in memory or there are fewer layers than nodes.

    Cost: O(S · L²) for S nodes and L layers.
    """
    n_layers, n_stages = len(profile.layers), len(chain)
    if n_stages == 0 or n_layers < n_stages:
        return None
    mb = config.batch_size / config.microbatches
    prefix = [0.0]
    for layer in profile.layers:
        prefix.append(prefix[-1] + layer.flops)

    def cost(i: int, start: int, end: int) -> float:
        node = chain[i]
        if stage_memory_bytes(profile, start, end, config, i, n_stages) > node.memory_bytes:
            return math.inf
        t = (prefix[end] - prefix[start]) * mb / node.flops
        if i + 1 < n_stages:
            nbytes = profile.layers[end - 1].activation_bytes * mb
            nxt = chain[i + 1].node_id
            t += link(node.node_id, nxt).transfer_seconds(nbytes)
            t += link(nxt, node.node_id).transfer_seconds(nbytes)
        return t

    inf = math.inf
    # best[i][j]: least bottleneck placing layers [0, j) on the first i+1 nodes.
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    choice = [[-1] * (n_layers + 1) for _ in range(n_stages)]
    for j in range(1, n_layers - n_stages + 2):
        best[0][j] = cost(0, 0, j)
    for i in range(1, n_stages):
        for j in range(i + 1, n_layers - (n_stages - i - 1) + 1):
            for k in range(i, j):
                if best[i - 1][k] == inf:
                    continue
                v = max(best[i - 1][k], cost(i, k, j))
                if v < best[i][j]:
                    best[i][j], choice[i][j] = v, k
    if best[-1][n_layers] == inf:
        return None
    ranges, end = [], n_layers
    for i in range(n_stages - 1, -1, -1):
        start = choice[i][end] if i > 0 else 0
        ranges.append((start, end))
        end = start
    ranges.reverse()
    return ranges, best[-1][n_layers]
