"""Hugging Face causal language models as fedpipe layers (``pip install fedpipe[hf]``).

:func:`sequential` turns a ``transformers`` causal LM (GPT-2; the Llama family:
Llama, Qwen2, Mistral, which share its decoder layer's calling convention) into an
``nn.Sequential`` a pipeline can split between blocks:

    [embeddings, block 0, ..., block n-1, final norm + head]

(B, T) int64 token ids in, (B, T, vocab) logits out. It works on a real model and
on one built under ``torch.device("meta")``, and reuses the model's own modules.

What the wrappers add, because a decoder layer called alone is not what the model
runs:

- Each block builds its causal mask itself, with ``transformers``'
  ``create_causal_mask`` for the model's attention implementation, exactly as the
  model's ``forward`` does. Called bare, a GPT-2 block under ``attn_implementation=
  "eager"`` attends both ways, silently (no mask is added to the scores); under
  "sdpa" it is causal only because the kernel's ``is_causal`` default applies.
- Llama-family blocks compute their rotary positions inside (each keeps a copy of
  the model's rotary embedding: a small non-persistent buffer).
- Tuple outputs (older ``transformers``) are unwrapped.

Tied input and output embeddings (GPT-2 and every ``tie_word_embeddings`` model):
the embedding stage and the head stage each keep a copy, as Megatron-LM does
(``_allreduce_word_embedding_grads``): both copies start equal
(:func:`fedpipe.runtime.materialize.materialize_layers` copies the source) and their
gradients are summed before every optimizer step
(:func:`fedpipe.runtime.materialize.sum_tied_gradients`, or an all-reduce between the
two stages), so training equals training the tied model. ``HFLayers.tied_parameters``
names them.

Names: ``HFLayers.names`` maps a layer's keys to the checkpoint's
(``"block.attn.c_attn.weight"`` of layer 3 is ``"transformer.h.2.attn.c_attn.weight"``),
so :mod:`fedpipe.runtime.weights` loads a ``save_pretrained`` directory, and
:func:`save_pretrained` writes one back that ``from_pretrained`` loads.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .runtime.materialize import TIES_ATTRIBUTE, TiedGroup, children_first
from .runtime.weights import DEFAULT_SHARD_BYTES, save_layers


class AdapterError(ValueError):
    """A model the adapters do not know how to split, with what they found."""


@dataclass(frozen=True)
class _Arch:
    """Where a model family keeps its parts (attribute paths from the LM)."""

    base: str          # the decoder: "transformer" (GPT-2), "model" (Llama)
    tokens: str        # token embedding inside the decoder
    positions: str     # learned position embedding ("" for rotary)
    dropout: str       # embedding dropout ("" for none)
    blocks: str        # the ModuleList of decoder layers
    norm: str          # the final norm
    rotary: str        # the rotary embedding ("" for none)


_GPT2 = _Arch("transformer", "wte", "wpe", "drop", "h", "ln_f", "")
_LLAMA = _Arch("model", "embed_tokens", "", "", "layers", "norm", "rotary_emb")
ARCHITECTURES: dict[str, _Arch] = {"gpt2": _GPT2, "llama": _LLAMA, "qwen2": _LLAMA,
                                   "mistral": _LLAMA}
"""``config.model_type`` -> where its parts are. Tested: gpt2 and llama."""


class Embeddings(nn.Module):
    """Token embedding, plus learned positions (GPT-2) and dropout when the model has
    them: (B, T) int64 -> (B, T, hidden)."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Module | None,
                 dropout: nn.Module | None):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(input_ids.shape[1], device=h.device)[None])
        return self.dropout(h) if self.dropout is not None else h


class Block(nn.Module):
    """One decoder layer with its causal mask (and rotary positions) made inside:
    (B, T, hidden) -> (B, T, hidden), positions 0..T-1, no padding."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None):
        super().__init__()
        self.layer = layer
        self.config = config
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        # No position_ids here: they only serve to detect packed sequences, a data-dependent
        # check (.item()) that fails on meta tensors; ours are 0..T-1, never packed.
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None)
        extra = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(hidden, position_ids=position_ids)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Final norm and the projection to the vocabulary: (B, T, hidden) -> (B, T, vocab)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits`` (B, T, vocab), ``targets`` (B, T) the
    tokens that follow each input (already shifted, as fedpipe feeds them); -100 is
    ignored. ``transformers``' loss for ``labels=input_ids`` equals this with targets
    ``input_ids[:, 1:]`` and -100 at the end (computed in float32 or wider)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(flat.float() if flat.dtype in (torch.float16,
                                                                      torch.bfloat16) else flat,
                                       targets.reshape(-1), ignore_index=-100)


class HFNames:
    """The checkpoint names of the adapter's layers (a :data:`fedpipe.runtime.weights.KeyMap`).

    ``prefixes[i]`` maps a prefix of layer ``i``'s keys to the checkpoint's;
    ``fallback`` gives a second name for a tied copy the checkpoint stores once.
    """

    def __init__(self, prefixes: Sequence[dict[str, str]], fallback: dict[tuple[int, str], str]):
        self.prefixes = list(prefixes)
        self.fallback = dict(fallback)

    def __call__(self, index: int, key: str) -> tuple[str, ...]:
        for local, remote in self.prefixes[index].items():
            if key.startswith(local):
                name = remote + key[len(local):]
                extra = self.fallback.get((index, key))
                return (name, extra) if extra else (name,)
        raise KeyError(f"layer {index} has no checkpoint name for {key!r}")


class HFInit:
    """The model's own initialization (``_init_weights``: GPT-2's scaled residual
    projections, normal embeddings, rotary buffers) as an ``init_fn`` for
    :func:`fedpipe.runtime.materialize.materialize`. Applied children first, as
    ``transformers``' ``initialize_weights`` does; draws from the forked, seeded global
    RNG. Picklable: the model's class and its config."""

    def __init__(self, model_class: Any, config: Any):
        self.model_class = model_class
        self.config = config

    def __call__(self, layer: nn.Module, index: int, generator: torch.Generator) -> None:
        host = self.model_class.__new__(self.model_class)
        nn.Module.__init__(host)
        host.config = self.config
        for module in children_first(layer):
            host._init_weights(module)


@dataclass
class HFLayers:
    """A causal LM as fedpipe layers.

    Attributes:
        layers: [embeddings, blocks..., head] (shares the model's modules).
        tied_parameters: groups of copies that must stay equal, ``(layer, name)``;
            the first is the source.
        names: layer keys -> checkpoint names, for :mod:`fedpipe.runtime.weights`.
        init_fn: the model's own initialization, for a meta model.
        config: the model's config (``save_pretrained`` writes it).
    """

    layers: nn.Sequential
    tied_parameters: list[TiedGroup]
    names: HFNames
    init_fn: HFInit
    config: Any

    loss = staticmethod(lm_loss)

    def is_tied_copy(self, index: int, key: str) -> bool:
        """Whether ``key`` of layer ``index`` is a tied copy (not the group's source)."""
        return any((index, key) in group[1:] for group in self.tied_parameters)


def _get(obj: Any, path: str) -> Any:
    return getattr(obj, path) if path else None


def _copy_head(lm_head: nn.Linear) -> nn.Linear:
    """An untied head with the same weight values (meta stays meta)."""
    head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None,
                     device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    with torch.no_grad():
        if not lm_head.weight.is_meta:
            head.weight.copy_(lm_head.weight)
            if lm_head.bias is not None:
                head.bias.copy_(lm_head.bias)
    return head


def sequential(model: Any) -> HFLayers:
    """Split a ``transformers`` causal LM (a ``PreTrainedModel`` with ``lm_head``) into
    fedpipe layers (see the module docstring).

    The model is taken apart, not copied: use the returned layers, not the model,
    afterwards. A tied head gets its own copy of the embedding's weight.

    Raises:
        AdapterError: an unknown ``config.model_type`` (the known ones are listed).
    """
    import copy

    config = model.config
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise AdapterError(f"no adapter for model_type {config.model_type!r}; known: "
                           f"{', '.join(sorted(ARCHITECTURES))}")
    base = getattr(model, arch.base)
    tokens = getattr(base, arch.tokens)
    tied = model.lm_head.weight is tokens.weight
    rotary = _get(base, arch.rotary)
    blocks = list(getattr(base, arch.blocks))
    layers = nn.Sequential(
        Embeddings(tokens, _get(base, arch.positions), _get(base, arch.dropout)),
        *[Block(b, config, copy.deepcopy(rotary)) for b in blocks],
        Head(getattr(base, arch.norm), _copy_head(model.lm_head) if tied else model.lm_head))
    last = len(blocks) + 1
    ties: list[TiedGroup] = [[(0, "tokens.weight"), (last, "lm_head.weight")]] if tied else []
    setattr(layers, TIES_ATTRIBUTE, ties)  # submit's default ``ties``
    return HFLayers(layers=layers, tied_parameters=ties, names=_names(arch, len(blocks), tied),
                    init_fn=HFInit(type(model), config), config=config)


def _names(arch: _Arch, n_blocks: int, tied: bool) -> HFNames:
    """The checkpoint names of [embeddings, ``n_blocks`` blocks, head] of ``arch``."""
    b, last = arch.base, n_blocks + 1
    prefixes = [{"tokens.": f"{b}.{arch.tokens}.", "positions.": f"{b}.{arch.positions}."}]
    prefixes += [{"layer.": f"{b}.{arch.blocks}.{k}.", "rotary.": f"{b}.{arch.rotary}."}
                 for k in range(n_blocks)]
    prefixes.append({"norm.": f"{b}.{arch.norm}.", "lm_head.": "lm_head."})
    fallback = {(last, "lm_head.weight"): f"{b}.{arch.tokens}.weight"} if tied else {}
    return HFNames(prefixes, fallback)


def checkpoint_names(layers: Iterable[nn.Module]) -> tuple[HFNames, Any] | None:
    """The checkpoint names and the ``transformers`` config of layers that
    :func:`sequential` made ([:class:`Embeddings`, :class:`Block`..., :class:`Head`]),
    so a job's save maps its weights back to the original model's names
    (:mod:`fedpipe.client.checkpoints`); None for any other layers. A tied head
    (``config.tie_word_embeddings``) falls back to the embedding's name."""
    found = list(layers)
    if len(found) < 3 or not isinstance(found[0], Embeddings) or \
            not isinstance(found[-1], Head) or \
            not all(isinstance(b, Block) for b in found[1:-1]):
        return None
    config = found[1].config
    arch = ARCHITECTURES.get(getattr(config, "model_type", ""))
    if arch is None:
        return None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return _names(arch, len(found) - 2, tied), config


def save_pretrained(adapted: HFLayers, path: str | Path,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the layers' weights under the checkpoint's names (a tied copy once) and
    the config, so ``AutoModelForCausalLM.from_pretrained(path)`` loads the original
    architecture back. Returns ``path``."""
    path = Path(path)
    save_layers(list(adapted.layers), path, names=adapted.names,
                max_shard_bytes=max_shard_bytes, skip=adapted.is_tied_copy)
    adapted.config.save_pretrained(path)
    return path
