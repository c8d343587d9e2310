"""Whether a job can fit a swarm's memory at all, and by how many bytes it does not.

What the tracker checks at submit, before any planning: two lower bounds of what
any plan needs, priced by :func:`~fedpipe.planner.costs.stage_memory_bytes`
(its one memory model) against the nodes' memory as the planner sees it (nodes of
one host share it, :func:`~fedpipe.planner.costs.host_memory_shares`).
"""
from __future__ import annotations

from typing import Sequence

from ..units import binary_bytes
from .costs import host_memory_shares, stage_memory_bytes
from .types import ModelProfile, NodeSpec, TrainConfig

MEMORY_REMEDIES = ("; to fit, submit with recompute=\"auto\" (or True), more microbatches, "
                   "precision=\"bf16-mixed\", or add nodes")
"""What a job that does not fit the swarm's memory can change, ending each such refusal
(at submit, here; at planning, :func:`~fedpipe.planner.search.no_fit_error`; at a node's
``LoadStage``, :class:`~fedpipe.node.memory.StageMemory`)."""


CLI_MEMORY_REMEDIES = ("; to fit, give --recompute auto (or on), a larger --microbatches, "
                       "--precision bf16-mixed, or add nodes")
""":data:`MEMORY_REMEDIES` as the command line says them (:func:`for_command_line`): in the
flags ``fedpipe plan`` and ``fedpipe submit`` take for ``submit()``'s keywords."""


def for_command_line(text: str) -> str:
    """``text`` (an error's) with :data:`MEMORY_REMEDIES`, if it carries them, said as
    :data:`CLI_MEMORY_REMEDIES`: what the ``fedpipe`` command prints."""
    return text.replace(MEMORY_REMEDIES, CLI_MEMORY_REMEDIES)


def is_memory_refusal(text: str) -> bool:
    """Whether a refusal's (or a failed job's) text is one of memory: it carries
    :data:`MEMORY_REMEDIES` (the client raises ``NotEnoughMemory`` for it)."""
    return MEMORY_REMEDIES in text


def shortfall(profile: ModelProfile, config: TrainConfig, nodes: Sequence[NodeSpec]
              ) -> tuple[float, str]:
    """``(bytes, why)``: how many more bytes of memory the swarm needs before any plan
    of the job can fit, and in words; ``(0.0, "")`` when these bounds pass.

    Two bounds, the first that fails is given:
    - the whole model as one stage (weights, gradients, optimizer state, snapshots,
      the activations of the stage's microbatches in flight) against all the nodes'
      memory together;
    - its largest layer alone as a stage (as the last of a pipeline, which keeps the
      fewest microbatches in flight) against the node with the most memory.
    Passing both does not promise a plan (the planner may still find none).
    """
    if not nodes or not profile.layers:
        return 0.0, ""
    shares = host_memory_shares(nodes)
    have = float(sum(shares.values()))
    n_layers = len(profile.layers)
    disk = any(n.snapshots_on_disk for n in nodes)  # the least any plan may need: bounds
    need = stage_memory_bytes(profile, 0, n_layers, config, 0, 1, snapshots_on_disk=disk)
    if need > have:
        return need - have, (
            f"the job needs about {binary_bytes(need)} (weights, gradients, optimizer state, "
            f"{'a snapshot tensor in flight' if disk else 'snapshots'}, activations) but the "
            f"swarm's {len(nodes)} node(s) have "
            f"{binary_bytes(have)} in all: {binary_bytes(need - have)} "
            f"({need - have:.0f} bytes) more are needed{MEMORY_REMEDIES}")
    top = float(max(shares.values()))
    layer, need = max(((k, stage_memory_bytes(profile, k, k + 1, config, n_layers - 1,
                                                 n_layers, snapshots_on_disk=disk))
                       for k in range(n_layers)), key=lambda x: x[1])
    if need > top:
        return need - top, (
            f"layer {layer} ({profile.layers[layer].name}) alone needs about "
            f"{binary_bytes(need)} as a stage but the largest node has {binary_bytes(top)}: "
            f"{binary_bytes(need - top)} ({need - top:.0f} bytes) more are needed"
            f"{MEMORY_REMEDIES}")
    return 0.0, ""
