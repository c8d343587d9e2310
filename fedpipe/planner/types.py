"""Dataclasses the planner takes and returns. Pure data: no I/O, no torch.

Units: FLOP/s for node speed, FLOP for work, bytes for sizes, bytes/s for
bandwidth, seconds for latency and times.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class PlanError(ValueError):
    """No plan fits: the message names what did not fit and the numbers."""


@dataclass(frozen=True)
class NodeSpec:
    """One machine as the planner sees it.

    Attributes:
        node_id: unique id (the tracker's).
        flops: measured speed in FLOP/s (float32 matmul).
        memory_bytes: memory a stage may use on it, bytes.
        name: human-readable name.
        device: "cpu" or "cuda:N".
    """

    node_id: str
    flops: float
    memory_bytes: int
    name: str = ""
    device: str = "cpu"


@dataclass(frozen=True)
class Link:
    """A directed link: bandwidth in bytes/s, one-way latency in seconds."""

    bandwidth: float
    latency: float = 0.0

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes over this link (latency + size / bandwidth)."""
        return self.latency + nbytes / self.bandwidth


# Used where nothing was measured: loopback-like, 1 GB/s and 0.1 ms.
DEFAULT_LINK = Link(bandwidth=1e9, latency=1e-4)


@dataclass
class ClusterView:
    """Nodes and the directed links between them.

    ``links[(a, b)]`` is the link from node ``a`` to node ``b``; a missing pair
    falls back to ``default_link``.
    """

    nodes: list[NodeSpec]
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    default_link: Link = DEFAULT_LINK

    def link(self, a: str, b: str) -> Link:
        """The link from ``a`` to ``b``."""
        return self.links.get((a, b), self.default_link)

    def node(self, node_id: str) -> NodeSpec:
        """The node with that id; KeyError if there is none."""
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)


@dataclass(frozen=True)
class LayerProfile:
    """Cost of one layer (one child of the nn.Sequential).

    Attributes:
        name: the layer's name, e.g. "3:Linear".
        flops: forward + backward FLOP per sample.
        activation_bytes: bytes of the layer's output per sample.
        parameter_bytes: bytes of the layer's parameters.
    """

    name: str
    flops: float
    activation_bytes: int
    parameter_bytes: int


@dataclass
class ModelProfile:
    """Per-layer costs of a model; ``input_bytes`` is the input per sample."""

    layers: list[LayerProfile]
    input_bytes: int = 0

    @property
    def parameter_bytes(self) -> int:
        """Bytes of all parameters."""
        return sum(layer.parameter_bytes for layer in self.layers)


@dataclass(frozen=True)
class TrainConfig:
    """What a job asks for.

    Attributes:
        batch_size: samples per optimizer step.
        microbatches: microbatches per batch.
        schedule: "gpipe" or "1f1b" (or "async", later).
        state_factor: bytes kept per parameter byte for a stage: weights,
            gradients and optimizer state (4 for AdamW: weights, grads, two moments).
        stages: pipeline depth the user asked for (0: the planner chooses).
    """

    batch_size: int
    microbatches: int = 1
    schedule: str = "gpipe"
    state_factor: float = 4.0
    stages: int = 0


@dataclass(frozen=True)
class StagePlan:
    """Layers ``[layer_start, layer_end)`` on node ``node_id``."""

    node_id: str
    layer_start: int
    layer_end: int
    activation_codec: str = "raw"
    gradient_codec: str = "raw"


@dataclass
class ReplicaGroup:
    """One data-parallel replica: an ordered chain of stages."""

    stages: list[StagePlan]


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        groups: replica groups (one for pure pipeline parallelism).
        predicted_step_seconds: predicted wall time of one optimizer step, seconds.
        unused: ids of nodes left without a stage.
    """

    groups: list[ReplicaGroup]
    predicted_step_seconds: float
    unused: list[str] = field(default_factory=list)
