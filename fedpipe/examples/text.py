"""A real text task for demos, tests and benchmarks: Python's own documentation.

``pydoc_data.topics`` ships with CPython, so this needs no download: a
character-level language model (a small causal transformer built as an
``nn.Sequential``, so a pipeline can split it between blocks) on the text of
Python's documentation topics, the last 10% held out.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 128  # ASCII; other characters become "?"


def pydoc_text() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) character codes of Python's documentation topics (90/10)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")
    data = torch.tensor(list(text), dtype=torch.int64).clamp_(max=VOCAB - 1)
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def text_batches(data: torch.Tensor, batch: int, seq: int, seed: int = 0):
    """Endless (input, next-character target) batches of random windows."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g).tolist()
        chunk = torch.stack([data[s:s + seq + 1] for s in starts])
        yield chunk[:, :-1], chunk[:, 1:]


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, x):
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.proj(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy: ``logits`` (B, T, vocab), ``targets`` (B, T)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def char_transformer(d: int = 64, heads: int = 4, blocks: int = 2, seq: int = 64,
                     seed: int = 0) -> nn.Sequential:
    """A small causal character-level transformer as an ``nn.Sequential`` (embedding,
    ``blocks`` blocks of width ``d`` with ``heads`` heads, head), its weights drawn
    from ``seed``: (B, T) int64 character codes, T <= ``seq``, to (B, T, :data:`VOCAB`)
    logits."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(VOCAB, d, seq), *[Block(d, heads) for _ in range(blocks)],
                         Head(d, VOCAB))
