"""Dataclasses the planner takes and returns. Pure data: no I/O, no torch.

Units: FLOP/s for node speed, FLOP for work, bytes for sizes, bytes/s for
bandwidth, seconds for latency and times.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..spec.jobspec import MICROBATCHES, SCHEDULE
from ..wire.codecmodel import CodecSpeed


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
        site: where the node is (a region, a lab); nodes of one site share the
            cluster's ``site_links``. Empty: no site.
        host: the machine the node runs on: nodes of one host share its
            ``host_cores`` (see :func:`fedpipe.planner.costs.host_factors`). Empty:
            a machine of its own.
        threads: compute threads the node runs (its torch threads).
        host_cores: logical cores of the node's machine (0: unknown, not shared).
        host_memory: memory of the node's machine that its nodes share, bytes (0:
            unknown, not shared; see :func:`fedpipe.planner.costs.host_memory_shares`).
        relay: the relay an outbound-only node (behind NAT) is reached through,
            ``HOST:PORT``; empty: reachable. Its links that were not measured cost two
            legs, through the relay (:meth:`ClusterView.link`).
        snapshots_on_disk: the node keeps checkpoint snapshots on disk, not in memory
            (:func:`fedpipe.planner.costs.state_bytes`).
        codec_speeds: its codecs' CPU costs as it measured them
            (:class:`~fedpipe.wire.codecmodel.CodecSpeed`); a link's codec is priced by
            its sender's encode and its receiver's decode
            (:func:`fedpipe.planner.costs.transfer_seconds`). Empty: the table's.
    """

    node_id: str
    flops: float
    memory_bytes: int
    name: str = ""
    device: str = "cpu"
    site: str = ""
    host: str = ""
    threads: int = 1
    host_cores: int = 0
    host_memory: int = 0
    relay: str = ""
    snapshots_on_disk: bool = False
    codec_speeds: tuple[CodecSpeed, ...] = ()


def reach(relay: str) -> str:
    """How peers reach a node homed at ``relay`` (:attr:`NodeSpec.relay`, a node's or a
    plan's stage's) in words: "outbound-only via RELAY", or "direct" for "" (no relay).
    The one wording of ``fedpipe plan``, ``fedpipe status`` and the dashboard."""
    return f"outbound-only via {relay}" if relay else "direct"


@dataclass(frozen=True)
class Link:
    """A directed link: bandwidth in bytes/s, one-way latency in seconds."""

    bandwidth: float
    latency: float = 0.0

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes over this link (latency + size / bandwidth)."""
        return self.latency + nbytes / self.bandwidth

    def then(self, leg: "Link") -> "Link":
        """This link and ``leg`` in series (a relay forwarding as it receives): the slower
        bandwidth, the latencies added."""
        return Link(min(self.bandwidth, leg.bandwidth), self.latency + leg.latency)


# Used where nothing was measured: loopback-like, 1 GB/s and 0.1 ms.
DEFAULT_LINK = Link(bandwidth=1e9, latency=1e-4)


@dataclass(frozen=True)
class Overheads:
    """Fixed costs of a runtime that a FLOP count and a link's bandwidth miss, seconds.

    All 0 by default: the planner alone prices FLOP and bytes only. The tracker
    plans with :data:`RUNTIME_OVERHEADS`, fedpipe's own, refined by calibration
    (:mod:`fedpipe.planner.calibrate`).

    Attributes:
        message: per tensor message on a pipeline link, added to the time the
            link is busy with it: the hand-off to the sender thread, framing,
            the receiver's decode and mailbox.
        microbatch: per forward or backward pass of one microbatch on a stage:
            Python dispatch, autograd set-up, the mailbox wait and wake-up.
        optimizer_per_byte: the optimizer step, per parameter byte of the
            stage: it streams the weights, gradients and optimizer state.
    """

    message: float = 0.0
    microbatch: float = 0.0
    optimizer_per_byte: float = 0.0


RUNTIME_OVERHEADS = Overheads(message=2e-4, microbatch=5e-5, optimizer_per_byte=2.5e-10)
"""fedpipe's runtime before calibration, as measured on a 2-core machine (issue 12):
about 0.2 ms per tensor message, 50 µs per pass, and an SGD step at about 4 GB/s
of parameter bytes on one core."""


@dataclass
class ClusterView:
    """Nodes and the directed links between them.

    ``links[(a, b)]`` is the link from node ``a`` to node ``b``. A missing pair
    falls back to ``site_links[(site of a, site of b)]`` when both nodes have a
    site and that pair of sites is listed (``(s, s)`` is the link inside site
    ``s``), and otherwise to ``default_link``. A missing pair with an outbound-only
    end (:attr:`NodeSpec.relay`) goes through its relay: that fallback twice in series,
    the node's leg to the relay and the relay's to the peer (a measured pair was measured
    through the relay already). ``overheads`` are the runtime's fixed costs (defaults, or
    fitted by :mod:`fedpipe.planner.calibrate`).
    """

    nodes: list[NodeSpec]
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    default_link: Link = DEFAULT_LINK
    site_links: dict[tuple[str, str], Link] = field(default_factory=dict)
    overheads: Overheads = field(default_factory=Overheads)
    _sites: dict[str, tuple[str, str]] = field(default_factory=dict, init=False, repr=False,
                                               compare=False)

    def link(self, a: str, b: str) -> Link:
        """The link from ``a`` to ``b`` (explicit, else by sites, else the default; twice
        in series through a relay)."""
        found = self.links.get((a, b))
        if found is not None:
            return found
        found = self.site_links.get((self.site_of(a), self.site_of(b))) \
            if self.site_links else None
        leg = found or self.default_link
        return leg.then(leg) if self._where(a)[1] or self._where(b)[1] else leg

    def _where(self, node_id: str) -> tuple[str, str]:
        """``(site, relay)`` of node ``node_id`` (each "" if none, or it is unknown)."""
        if node_id not in self._sites:
            self._sites.clear()
            self._sites.update((n.node_id, (n.site, n.relay)) for n in self.nodes)
        return self._sites.get(node_id, ("", ""))

    def site_of(self, node_id: str) -> str:
        """The site of node ``node_id`` ("" if it has none or is unknown)."""
        return self._where(node_id)[0]

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
        activation_width: the output's last dimension, values (``d`` of a ``(batch,
            tokens, d)`` activation): what a lowrank codec's rank is out of
            (:meth:`fedpipe.planner.codecs.CodecCost.wire_bytes`); 0 when unknown
            (then lowrank is priced as no saving).
    """

    name: str
    flops: float
    activation_bytes: int
    parameter_bytes: int
    activation_width: int = 0


def row_width(shape: Sequence[int]) -> int:
    """The width of a layer's output of ``shape`` (a batch's): its last dimension, the
    values of one row a lowrank codec projects (:mod:`fedpipe.wire.lowrank`); 0 for fewer
    than 2 dimensions (the last is then the batch's)."""
    return int(shape[-1]) if len(shape) >= 2 else 0


@dataclass
class ModelProfile:
    """Per-layer costs of a model.

    Attributes:
        layers: the layers in order.
        input_bytes: bytes of the model's input per sample.
        element_bytes: bytes per element of the activations as profiled (4 for
            float32, 2 for bf16/fp16); codec wire sizes are relative to float32.
    """

    layers: list[LayerProfile]
    input_bytes: int = 0
    element_bytes: int = 4

    @property
    def parameter_bytes(self) -> int:
        """Bytes of all parameters."""
        return sum(layer.parameter_bytes for layer in self.layers)


@dataclass(frozen=True)
class TrainConfig:
    """What a job asks for.

    Attributes:
        batch_size: samples per optimizer step.
        microbatches: microbatches per batch (default
            :data:`fedpipe.spec.MICROBATCHES`, submit's).
        schedule: "gpipe", "1f1b" or "async".
        max_staleness: under "async", steps a forward may run ahead of the updates
            (:attr:`fedpipe.spec.JobSpec.max_staleness`): the steps a group's step is
            priced as overlapping (:func:`~fedpipe.planner.steptime.steps_in_flight`).
        state_factor: bytes kept per parameter byte for a stage: weights,
            gradients and optimizer state (4 for AdamW: weights, grads, two moments;
            3 for SGD with momentum, 2 for plain SGD). The tracker derives it from the
            job's optimizer (:func:`fedpipe.spec.optimizers.state_factor`).
        step_scratch: bytes the optimizer allocates during its step per parameter
            byte (1 for torch's foreach AdamW; :func:`fedpipe.spec.optimizers.step_scratch`).
        snapshot_copies: checkpoint snapshots a node keeps per stage it runs,
            its own and those it keeps as a buddy (each weights and optimizer
            state: ``state_factor - 1`` bytes per parameter byte); 0 when
            checkpoints are off.
        stages: pipeline depth the user asked for: every replica group gets
            exactly this many stages (0: the planner chooses).
        cuts: pinned stage boundaries (:mod:`fedpipe.spec.cuts`; ``stages - 1`` of
            them): every replica group's stages hold exactly the layer ranges they
            make, and the planner chooses only the nodes, their order, the groups,
            the microbatches and the codecs. ``()``: the planner splits the layers.
        replicas: number of replica groups the user asked for (0: the
            planner chooses).
        compression: codec policy for every pipeline link: "auto" (the planner
            picks per link from its bandwidth, see ``fedpipe.planner.codecs``),
            "none" (raw everywhere) or one codec spec such as "int8+zstd".
        activation_compression: overrides ``compression`` for activations.
        gradient_compression: overrides ``compression`` for the gradients sent
            back along the pipeline.
        sync_every: optimizer steps between two syncs of the replica groups:
            1 for a gradient all-reduce every step, H under DiLoCo (an outer
            step every H inner steps; Douillard et al., "DiLoCo", 2023). The
            sync's time is charged to every step divided by this.
        recompute: activation recomputation: "off", "on" (every stage), or "auto"
            (the planner turns it on for the stages that would not fit otherwise:
            :attr:`StagePlan.recompute`).
        precision: "fp32", or "bf16-mixed" (activations of half the bytes;
            faster compute only on devices in :data:`~fedpipe.planner.costs.BF16_SPEEDUP`).

    With several replica groups the job's ``microbatches`` (each of
    ``batch_size / microbatches`` samples) are shared among the groups.
    """

    batch_size: int
    microbatches: int = MICROBATCHES
    schedule: str = SCHEDULE
    max_staleness: int = 1
    state_factor: float = 4.0
    snapshot_copies: float = 0.0
    step_scratch: float = 0.0
    stages: int = 0
    cuts: tuple[int, ...] = ()
    replicas: int = 0
    compression: str = "auto"
    activation_compression: str | None = None
    gradient_compression: str | None = None
    sync_every: int = 1
    recompute: str = "off"
    precision: str = "fp32"


@dataclass(frozen=True)
class StagePlan:
    """Layers ``[layer_start, layer_end)`` on node ``node_id``.

    The codecs are those of the tensors this stage *sends*:
    ``activation_codec`` for its output to the next stage, ``gradient_codec``
    for the gradient of its input sent back to the previous stage ("raw" where
    there is no such neighbour). ``recompute``: the stage recomputes its
    activations in backward (under the config's "auto", the planner's choice;
    :func:`fedpipe.spec.stage_recomputes`).
    """

    node_id: str
    layer_start: int
    layer_end: int
    activation_codec: str = "raw"
    gradient_codec: str = "raw"
    recompute: bool = False


@dataclass
class ReplicaGroup:
    """One data-parallel replica: an ordered chain of stages.

    Attributes:
        stages: the chain, first stage first.
        microbatches: microbatches this group runs per step (0: not set, the
            job's ``microbatches`` shared equally).
        samples: samples this group processes per step (0: not set).
        predicted_seconds: simulated time of this group's forward and
            backward passes in one step, seconds (without the all-reduce).
    """

    stages: list[StagePlan]
    microbatches: int = 0
    samples: int = 0
    predicted_seconds: float = 0.0


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        groups: replica groups (one for pure pipeline parallelism).
        predicted_step_seconds: predicted wall time of one optimizer step,
            seconds (from the discrete-event simulator).
        unused: ids of nodes left without a stage.
        predicted_samples_per_second: batch size / predicted step time.
        sync_seconds: predicted time the cross-group sync adds after the slowest
            group's last backward pass, per step (divided by the config's
            ``sync_every``), seconds (0 for one group).
        schedule: the schedule the prediction assumes ("gpipe", "1f1b" or "async").
        calibrated: the prediction used corrections fitted from measured step
            times (:mod:`fedpipe.planner.calibrate`), not the probed figures alone.
    """

    groups: list[ReplicaGroup]
    predicted_step_seconds: float
    unused: list[str] = field(default_factory=list)
    predicted_samples_per_second: float = 0.0
    sync_seconds: float = 0.0
    schedule: str = ""
    calibrated: bool = False


@dataclass(frozen=True)
class StageTime:
    """How one stage spent one step, seconds: computing (forward, backward,
    optimizer), waiting for tensors from peers, and handing tensors to its senders.

    What a stage reports (``StepReport``) and the tracker keeps per plan epoch:
    the measured counterpart of the simulator's per-stage prices
    (:func:`fedpipe.planner.simulate.stage_costs`), shown by the dashboard; with the
    stage's measured peak memory and the planner's prediction of it, bytes (0: not
    reported; see :mod:`fedpipe.node.memory`).
    """

    replica: int
    stage: int
    compute: float
    wait: float
    send: float
    peak_memory: int = 0
    predicted_memory: int = 0

    @property
    def total(self) -> float:
        """compute + wait + send, seconds."""
        return self.compute + self.wait + self.send


@dataclass(frozen=True)
class SearchOptions:
    """Bounds of the planner's local search.

    Attributes:
        seed: seed of the search's random moves; equal seeds give equal plans
            as long as ``time_limit_s`` is not what stops the search.
        iterations: local-search moves tried from each start; None: chosen from
            the cluster's size.
        time_limit_s: wall-clock bound of the whole search, seconds.
        starts: how many of the best initial groupings the local search refines.
        finalists: how many of the best candidates found are planned and simulated.
        polished: how many of the fastest finalists get their splits polished
            on the simulator.
    """

    seed: int = 0
    iterations: int | None = None
    time_limit_s: float = 20.0
    starts: int = 3
    finalists: int = 6
    polished: int = 3
