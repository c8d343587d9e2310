"""Where a job's initial weights come from (:class:`WeightsSpec`, issue 22): the tracker
carries code, a seed or a path, and per-layer digests, never a weight."""
from __future__ import annotations

from dataclasses import dataclass

from ..proto import node_pb2
from .errors import JobSpecError

WEIGHT_SOURCES = ("", "seed", "files", "stream")
"""Where a job's initial weights come from (:class:`WeightsSpec`)."""


@dataclass(frozen=True)
class WeightsSpec:
    """Where each stage gets its initial weights; the tracker never holds a weight.

    Attributes:
        source: "" the pickled layers carry their weights (a job built by hand);
            "seed": the layers are pickled on the meta device and each node makes its
            own from ``(seed, layer index)`` (:mod:`fedpipe.runtime.materialize`);
            "files": each node reads its layers' tensors from ``path``
            (:mod:`fedpipe.runtime.weights`), and one that cannot read it gets them
            streamed by the client (``PutWeights``); "stream": the client streams each
            stage's layers to its node.
        seed: "seed": the job's seed.
        init_fn: "seed": a cloudpickled ``init_fn(layer, index, generator)``, or b"".
        path: "files": a safetensors file or a Hugging Face sharded directory.
        digests: "files", "stream": :func:`fedpipe.runtime.weights.layer_digest` (hex)
            of every layer, in order: the node checks what it loads against them, and
            the job's signature covers them.
        names: "files": a cloudpickled ``fedpipe.runtime.weights.KeyMap`` (the file's
            names of each layer's tensors), or b"" for an ``nn.Sequential``'s own.
        ties: the model's tied parameters: groups of ``(layer index, parameter name)``
            copies, the first the source (:attr:`fedpipe.hf.HFLayers.tied_parameters`).
            Their gradients are summed before every optimizer step.
        tie_sources: ``(layer index, that layer's code pickled on meta)`` for each source
            layer of a tie: a node holding a copy makes the source's seeded values.
    """

    source: str = ""
    seed: int = 0
    init_fn: bytes = b""
    path: str = ""
    digests: tuple[str, ...] = ()
    names: bytes = b""
    ties: tuple[tuple[tuple[int, str], ...], ...] = ()
    tie_sources: tuple[tuple[int, bytes], ...] = ()

    @property
    def on_meta(self) -> bool:
        """Whether the job's layers are pickled without weights."""
        return bool(self.source)

    def validate(self, n_layers: int | None = None) -> "WeightsSpec":
        """Check the fields; return self.

        Raises:
            JobSpecError: an unknown source, a "files" job without a path, or digests
                that are not one per layer.
        """
        if self.source not in WEIGHT_SOURCES:
            raise JobSpecError("weights", f"source must be one of {list(WEIGHT_SOURCES)}, "
                                          f"got {self.source!r}")
        if self.source == "files" and not self.path:
            raise JobSpecError("weights", "weights from files need a path")
        for group in self.ties:
            if len(group) < 2 or len({layer for layer, _ in group}) != len(group) or any(
                    n_layers is not None and not 0 <= layer < n_layers for layer, _ in group):
                raise JobSpecError("ties", f"a tie needs copies in 2 or more different "
                                           f"layers of the model, got {list(group)}")
        if self.source in ("files", "stream") and n_layers is not None \
                and len(self.digests) != n_layers:
            raise JobSpecError("weights", f"{len(self.digests)} layer digests for "
                                          f"{n_layers} layers")
        return self

    def to_proto(self) -> node_pb2.WeightsConfig:
        """The ``fedpipe.v1.WeightsConfig`` message."""
        return node_pb2.WeightsConfig(source=self.source, seed=self.seed, init_fn=self.init_fn,
                                      path=self.path, digests=list(self.digests),
                                      names=self.names, ties=[
                                          node_pb2.TiedGroup(copies=[
                                              node_pb2.TiedCopy(layer=i, name=n) for i, n in g])
                                          for g in self.ties],
                                      tie_sources=dict(self.tie_sources))

    @classmethod
    def from_proto(cls, msg: node_pb2.WeightsConfig) -> "WeightsSpec":
        """The spec in a ``WeightsConfig`` (unset: the layers carry their weights)."""
        return cls(source=msg.source, seed=msg.seed, init_fn=msg.init_fn, path=msg.path,
                   digests=tuple(msg.digests), names=msg.names,
                   ties=tuple(tuple((c.layer, c.name) for c in g.copies) for g in msg.ties),
                   tie_sources=tuple(sorted(msg.tie_sources.items())))
