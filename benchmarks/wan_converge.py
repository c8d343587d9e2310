"""Steps to a target loss, counted in one process: the first of ``benchmarks/wan.py``'s two
measurements (T = steps to target × steady step time; the step time, over a shaped swarm, is
wan.py's).

The task: a causal character transformer (:func:`fedpipe.examples.text.char_transformer`,
4 blocks, :class:`Setup`) in 4 stages on byte-level ``pydoc_data.topics`` text, the last
10 % held out (:func:`held_out`). At each of the 3 stage boundaries (:attr:`Setup.cuts`) a
:class:`Link` runs a codec configuration (:data:`CONFIGS`) as the swarm's peers run it: the
codec's own encode + decode (:mod:`fedpipe.wire.codecs`), activations forward and gradients
backward (an autograd function at each boundary, :func:`staged_forward`), gradients with
error feedback keyed per boundary and microbatch as the node's peers key it; a lowrank
codec's basis is held at both ends of each boundary (:mod:`fedpipe.wire.lowrank`),
refreshed at training steps only. Each configuration trains for the budget once per seed
(:func:`train`), scored on the held-out windows as deployed, codecs included
(:func:`evaluate`), every ``eval_every`` steps: a :class:`Curve`, with the codec outputs'
bytes (zstd included) that crossed one boundary, per token.

The protocol (:func:`convergence`): the target is the held-out loss raw fp32 reaches at
:data:`TARGET_AT` (80 %) of the budget, the median of its seeds' (3 in a full run). A
seed's steps to target are where its held-out loss first reaches the target, interpolated
linearly between the evaluations either side (:meth:`Curve.steps_to`, so not a whole
step); a configuration's are the median of its seeds' (:meth:`Convergence.steps`).

Not a command: ``python benchmarks/wan.py`` runs it (:func:`train_all`, then
:func:`convergence`; or a run split over processes, each saving its curves with
``--save-curves`` (:func:`save_curves`), joined by ``--load-curves`` (:func:`load_curves`)),
then times the swarm and reports T. ``benchmarks/wan_netns.py`` and
``benchmarks/wan_e2e.py`` take its :class:`Convergence`; wan_e2e also scores a swarm job's
trained weights as :func:`evaluate` scores the trainer's.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

for _p in (Path(__file__).resolve().parent.parent, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:  # fedpipe from the checkout; pool from beside this module
        sys.path.insert(0, str(_p))

from fedpipe.examples.text import char_transformer, lm_loss, pydoc_text, text_batches  # noqa: E402
from fedpipe.wire.codecs import ErrorFeedback, decode, encode  # noqa: E402
from fedpipe.wire.lowrank import End, Subspace  # noqa: E402
from pool import imap  # noqa: E402  (benchmarks/, beside this module)

TARGET_AT = 0.8      # the target is raw fp32's held-out loss at this fraction of the budget


@dataclass(frozen=True)
class Config:
    """A codec configuration: the codec of the activations and of their gradients."""

    name: str
    activations: str
    gradients: str

    def compression(self) -> dict[str, str]:
        return {"activations": self.activations, "gradients": self.gradients}


CONFIGS = {c.name: c for c in (
    Config("raw", "raw", "raw"),
    Config("bf16", "bf16", "bf16"),
    Config("int8", "int8", "int8"),
    Config("int8+zstd", "int8+zstd", "int8+zstd"),
    Config("had4", "had4", "had4"),
    Config("had2", "had2", "had2"),
    Config("had4/had2", "had4", "had2"),   # 2-bit costs activations more than gradients
    Config("int8/topk", "int8", "topk:0.1"),
    # a basis per boundary from the activations' principal components, refreshed every
    # 50 steps; the gradients in the same subspace, with error feedback
    Config("lowrank8", "lowrank8:16@50", "lowrank8:16@50"),
    Config("lowrank8:32", "lowrank8:32@50", "lowrank8:32@50"),
)}
DEFAULT = ("raw", "int8", "had4", "had2", "lowrank8")
"""The configurations a run trains unless told others (``wan.py --configs``; ``all``:
every one of :data:`CONFIGS`): raw, the 8-bit cast, each low-bit rotation and the
subspace codec. The rest were measured in full once (``benchmarks/results/wan-full.txt``
and, bf16, ``wan-one.txt``: bf16 takes raw's steps at half its bytes; int8+zstd's steps
are int8's at 5 % fewer bytes; had4/had2, int8/topk and lowrank8:32 never reach the
target) and are left out so the full run, 3 seeds of each, fits in an hour (six
configurations took 60 min 15 s on 2026-12-03's slow host)."""


@dataclass(frozen=True)
class Setup:
    """The model, data and budget shared by every configuration."""

    d: int = 64
    heads: int = 4
    blocks: int = 4
    seq: int = 64
    batch: int = 32
    microbatches: int = 4
    lr: float = 3e-3
    budget: int = 1000
    eval_every: int = 25
    seeds: int = 3
    held_windows: int = 256

    def model(self, seed: int) -> nn.Sequential:
        return char_transformer(self.d, self.heads, self.blocks, self.seq, seed=seed)

    @property
    def cuts(self) -> tuple[int, ...]:
        """The child index at which each stage but the first begins
        (:mod:`fedpipe.spec.cuts`): embedding + block 0, then one block each (the last
        stage also holds the head), so 3 boundaries for 4 blocks. Every wan job is
        submitted with these cuts pinned (:func:`wan.submit`), so the swarm's stages end
        where the in-process steps were counted."""
        return tuple(range(2, self.blocks + 1))

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The children ``(start, end)`` of each stage, as :attr:`cuts` split them."""
        bounds = [0, *self.cuts, self.blocks + 2]
        return list(zip(bounds, bounds[1:]))


class Link:
    """One stage boundary as the swarm's peers run it: the same encode and decode,
    error feedback on the gradients keyed by (boundary, microbatch, shape); a lowrank
    codec's basis held at each end (the sender's refreshed at the training ``step``;
    evaluation, ``step`` None, refreshes nothing)."""

    def __init__(self, index: int, config: Config):
        self.index, self.config = index, config
        self.feedback = ErrorFeedback()
        self.microbatch = 0
        self.step: int | None = None
        self.key = f"boundary/{index}"
        self.sender, self.receiver = Subspace(), Subspace()  # the two stages' states
        self.bytes = {"forward": 0, "backward": 0}
        self.tokens = {"forward": 0, "backward": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        msg = encode(x, self.config.activations, end=End(self.sender, self.key, self.step))
        self._count("forward", msg.payload_bytes, x)
        return decode(msg, end=End(self.receiver, self.key))

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        msg = encode(g, self.config.gradients, feedback=self.feedback,
                     key=(self.index, self.microbatch, tuple(g.shape)),
                     end=End(self.receiver, self.key))
        self._count("backward", msg.payload_bytes, g)
        return decode(msg, end=End(self.sender, self.key))

    def _count(self, way: str, nbytes: int, t: torch.Tensor) -> None:
        self.bytes[way] += nbytes
        self.tokens[way] += t.shape[0] * t.shape[1]

    def per_token(self, way: str) -> float:
        return self.bytes[way] / max(1, self.tokens[way])


class _Boundary(torch.autograd.Function):
    """Activations through the link's codec forward, their gradients through it backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link) -> torch.Tensor:  # noqa: D102
        ctx.link = link
        return link.forward(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return ctx.link.backward(g.contiguous()), None


def staged_forward(model: nn.Sequential, links: list[Link], cuts: tuple[int, ...],
                   x: torch.Tensor) -> torch.Tensor:
    """The model's output with ``links[i]`` between its children ``cuts[i] - 1`` and ``cuts[i]``."""
    h = x
    for i, child in enumerate(model):
        if i in cuts:
            h = _Boundary.apply(h, links[cuts.index(i)])
        h = child(h)
    return h


@dataclass
class Curve:
    """One training run: held-out loss at evaluated steps, bytes per token each way."""

    config: str
    seed: int
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0

    def steps_to(self, target: float) -> float:
        """The step at which the held-out loss first reaches ``target``, linearly
        interpolated between the evaluation before it and the first at or under it (the
        first evaluation's step when that one is; inf: it never does). A fraction of a
        step: the table's steps to target (:meth:`Convergence.steps`)."""
        points = list(zip(self.steps, self.losses))
        for i, (s, v) in enumerate(points):
            if v <= target:
                if i == 0:
                    return float(s)
                s0, v0 = points[i - 1]
                return s0 + (s - s0) * (v0 - target) / (v0 - v)
        return math.inf

    def evaluated_steps_to(self, target: float) -> float:
        """The first evaluated step whose held-out loss is at or under ``target`` (inf: none
        is): the step count an end-to-end job runs (``benchmarks/wan_e2e.py``), where the
        curve shows the target reached. At least :meth:`steps_to`; the loss between
        evaluations is not a line, so a job at ``ceil(steps_to)`` may miss the target
        (had2 seed 1: 620.3 interpolated, 1.4633 at step 621, 1.4438 at 625)."""
        return next((float(s) for s, v in zip(self.steps, self.losses) if v <= target),
                    math.inf)

    def at(self, step: int) -> float:
        """The held-out loss at the last evaluation at or before ``step``."""
        return [v for s, v in zip(self.steps, self.losses) if s <= step][-1]


def train(setup: Setup, config: Config, seed: int, data: torch.Tensor,
          held: tuple[torch.Tensor, torch.Tensor]) -> Curve:
    """Train ``setup``'s model for its budget with ``config``'s codecs at every boundary."""
    model = setup.model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    links = [Link(i, config) for i in range(len(setup.cuts))]
    batches = text_batches(data, setup.batch, setup.seq, seed=seed)
    curve = Curve(config.name, seed)
    for step in range(1, setup.budget + 1):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        for mb, (xm, ym) in enumerate(zip(x.chunk(setup.microbatches),
                                          y.chunk(setup.microbatches))):
            for link in links:
                link.microbatch, link.step = mb, step
            loss = lm_loss(staged_forward(model, links, setup.cuts, xm), ym)
            (loss / setup.microbatches).backward()
        opt.step()
        for link in links:
            link.step = None  # evaluation makes no basis
        if step % setup.eval_every == 0 or step == setup.budget:
            curve.steps.append(step)
            curve.losses.append(evaluate(model, links, setup.cuts, held))
    curve.forward_bytes = statistics.mean(link.per_token("forward") for link in links)
    curve.backward_bytes = statistics.mean(link.per_token("backward") for link in links)
    return curve


@torch.no_grad()
def evaluate(model: nn.Sequential, links: list[Link], cuts: tuple[int, ...],
             held: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Held-out loss of the model as deployed: activations through the codecs too."""
    x, y = held
    counts = [dict(link.bytes) for link in links], [dict(link.tokens) for link in links]
    out = float(lm_loss(staged_forward(model, links, cuts, x), y))
    for link, b, t in zip(links, *counts):  # evaluation traffic is not training traffic
        link.bytes, link.tokens = b, t
    return out


@dataclass
class Convergence:
    """Every configuration's runs and the target they are measured against."""

    curves: dict[str, list[Curve]]
    target: float
    budget: int

    def steps(self, name: str) -> float:
        """``name``'s steps to target: the median of its seeds' :meth:`Curve.steps_to`
        (interpolated between evaluations; inf when most seeds never reach it)."""
        return statistics.median(c.steps_to(self.target) for c in self.curves[name])

    def median_seed(self, name: str) -> Curve:
        """The curve of ``name`` whose steps to target are the median of its seeds' (of an
        even number of seeds, the lower of the middle two; a tie, the lowest seed): the one
        run that stands for the configuration's :meth:`steps`, its seed's model and data
        (:func:`train`) the ones an end-to-end job of it runs, to its
        :meth:`Curve.evaluated_steps_to` (``benchmarks/wan_e2e.py``)."""
        curves = sorted(self.curves[name], key=lambda c: (c.steps_to(self.target), c.seed))
        return curves[(len(curves) - 1) // 2]

    def final(self, name: str) -> float:
        return statistics.median(c.at(self.budget) for c in self.curves[name])

    def bytes_per_token(self, name: str) -> tuple[float, float]:
        first = self.curves[name][0]
        return first.forward_bytes, first.backward_bytes


def converge(setup: Setup, configs: list[Config], log=print, save: str = "") -> Convergence:
    """Steps to target for every configuration: raw fp32 among them (it sets the target)."""
    return convergence(setup, train_all(setup, configs, log, save))


def held_out(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out windows every evaluation scores: ``setup.held_windows`` random
    windows (inputs, targets; ``(held_windows, seq)`` byte ids each) of the last 10 %."""
    return next(text_batches(pydoc_text()[1], setup.held_windows, setup.seq, seed=12345))


_DATA: dict[str, Any] = {}
"""The training text and held-out windows, set before :func:`pool.imap` forks (its workers
inherit them)."""


def _train(task: tuple[Setup, Config, int]) -> Curve:
    setup, config, seed = task
    return train(setup, config, seed, _DATA["train"], _DATA["held"])


def train_all(setup: Setup, configs: list[Config], log=print, save: str = "",
              seeds: list[int] | None = None, jobs: int = 1) -> dict[str, list[Curve]]:
    """Every configuration's curves, one per seed (``seeds``, default 0 to
    ``setup.seeds - 1``: a long run can be split over processes), ``jobs`` runs at once
    (:func:`pool.imap`: each (configuration, seed) is its own run, seeded by itself, so
    the curves do not depend on ``jobs``). With ``save``, every configuration's curves are
    written to that JSON file as soon as each seed's is trained (:func:`save_curves`), so a
    long run killed part-way keeps them."""
    _DATA.update(train=pydoc_text()[0], held=held_out(setup))
    seeds = list(range(setup.seeds)) if seeds is None else seeds
    tasks = [(setup, config, seed) for config in configs for seed in seeds]
    curves: dict[str, list[Curve]] = {}
    t0 = time.monotonic()
    for (_, config, _), curve in zip(tasks, imap(_train, tasks, jobs)):
        curves.setdefault(config.name, []).append(curve)
        if save:
            save_curves(save, setup, curves)
        if len(curves[config.name]) == len(seeds):
            log(f"  trained {config.name:<10} {len(seeds)} seed(s) x {setup.budget} steps, "
                f"done {time.monotonic() - t0:5.0f} s in ({jobs} run(s) at once); final "
                f"held-out loss "
                f"{statistics.median(c.losses[-1] for c in curves[config.name]):.4f}; "
                f"load {os.getloadavg()[0]:.2f}")
    return curves


def convergence(setup: Setup, curves: dict[str, list[Curve]]) -> Convergence:
    """The curves against their target: raw fp32's median held-out loss at
    :data:`TARGET_AT` of the budget. Raises SystemExit when raw's curves are missing."""
    if "raw" not in curves:
        raise SystemExit(f"no raw fp32 curves among {sorted(curves)}: raw sets the target")
    at = max(setup.eval_every, round(TARGET_AT * setup.budget / setup.eval_every)
             * setup.eval_every)
    target = statistics.median(c.at(at) for c in curves["raw"])
    return Convergence(curves, target, setup.budget)


def save_curves(path: str, setup: Setup, curves: dict[str, list[Curve]]) -> None:
    """Write ``curves`` and the budget they ran for to ``path`` (JSON)."""
    import json
    from dataclasses import asdict

    doc = {"budget": setup.budget, "eval_every": setup.eval_every,
           "curves": {name: [asdict(c) for c in cs] for name, cs in curves.items()}}
    Path(path).write_text(json.dumps(doc))


def load_curves(paths: list[str], setup: Setup) -> dict[str, list[Curve]]:
    """The curves :func:`save_curves` wrote to ``paths``, merged: a configuration's
    curves from every file, one per seed (a seed in two files: the later file's). Raises
    SystemExit when a file ran for another budget or evaluation period than ``setup``'s."""
    import json

    out: dict[str, dict[int, Curve]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if (doc["budget"], doc["eval_every"]) != (setup.budget, setup.eval_every):
            raise SystemExit(f"{path}: curves of budget {doc['budget']} evaluated every "
                             f"{doc['eval_every']} steps, not {setup.budget} / "
                             f"{setup.eval_every}: pass the same --budget (and --quick)")
        for name, cs in doc["curves"].items():
            out.setdefault(name, {}).update((c["seed"], Curve(**c)) for c in cs)
    ordered = sorted(out.items(), key=lambda kv: kv[0] != "raw")  # raw first
    return {name: [by_seed[k] for k in sorted(by_seed)] for name, by_seed in ordered}
