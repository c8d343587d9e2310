"""The planner's search: initial groupings, local search, and the final simulated choice.

1. Score the contiguous and strided layouts (:mod:`~fedpipe.planner.grouping`)
   for every candidate group count with the analytic estimate
   (:class:`~fedpipe.planner.evaluate.Evaluator`).
2. Refine the best few by a seeded local search (hill climbing) over moves
   that relocate a node to another group or to the unused pool, swap two
   nodes, reorder or reverse a chain, merge two groups or split one.
3. Build the best candidates' plans (codecs per link), keep the one the
   discrete-event simulator finds fastest, and polish its split on the
   simulator (:func:`~fedpipe.planner.evaluate.polish`).
"""
from __future__ import annotations

import random
import time
from typing import Sequence

from .context import PlanContext
from .evaluate import Candidate, Chain, Evaluator, build_plan, polish
from .grouping import initial_groupings, site_subsets
from .ordering import locality_order, path_cost, site_runs
from .types import ClusterView, ModelProfile, Plan, PlanError, SearchOptions, TrainConfig

MOVES = ("relocate", "swap", "reorder", "reverse", "merge", "split")
_WEIGHTS = (3, 3, 2, 1, 1, 1)
_KEEPS_LENGTH = ("swap", "reorder", "reverse")
SCREEN_ABOVE = 16
"""Above this many nodes, initial groupings are screened with a split by speed
before the dynamic program scores the best few."""


def make_plan(cluster: ClusterView, profile: ModelProfile, config: TrainConfig,
              options: SearchOptions | None = None) -> Plan:
    """Plan replica groups, stage order, layer split and codecs for the job.

    Args:
        cluster: nodes (FLOP/s, memory bytes) and links (bytes/s, seconds).
        profile: per-layer FLOP, activation and parameter bytes.
        config: batch, microbatches, schedule, compression, optional pinned depth.
        options: search bounds and seed (default :class:`SearchOptions`).

    Returns:
        The plan; its ``predicted_step_seconds`` is the simulator's.

    Raises:
        PlanError: bad inputs, or no grouping whose stages fit the nodes'
            memory (the message gives the bytes needed and available).
    """
    options = options or SearchOptions()
    start = time.perf_counter()
    deadline = start + options.time_limit_s
    ctx = PlanContext(cluster, profile, config)
    ev = Evaluator(ctx)
    hop = ctx.hop_cost()
    line = locality_order(hop, range(ctx.n), ctx.flops)
    lines = site_subsets(line, site_runs(hop, line), ctx.flops)
    seeds = initial_groupings(lines, ctx.flops, hop, ctx.M, ctx.L, config.stages)
    if not config.stages and ctx.n > ev.exact_up_to:
        seeds.append((tuple(sorted(range(ctx.n), key=lambda i: (-ctx.flops[i], i))[:ctx.L]),))
    screen = ctx.n > SCREEN_ABOVE
    scored: list[Candidate] = []
    for chains in seeds:
        cand = ev.estimate(chains, fast=screen)
        if cand is not None:
            scored.append(cand)
        if time.perf_counter() > deadline and scored:
            break
    scored.sort(key=lambda c: c.seconds)
    if screen:
        rescored = (ev.estimate(c.chains) for c in scored[:2 * options.starts + 2])
        scored = sorted((c for c in rescored if c is not None), key=lambda c: c.seconds)
    if not scored:
        raise no_fit_error(ctx)
    rng = random.Random(options.seed)
    iterations = options.iterations if options.iterations is not None else default_iterations(ctx.n)
    finalists: dict[tuple[Chain, ...], Candidate] = {}
    for cand in scored[:max(1, options.starts)]:
        finalists.setdefault(cand.chains, cand)
        used = {i for c in cand.chains for i in c}
        pool = tuple(i for i in range(ctx.n) if i not in used)
        best, _ = local_search(ev, hop, cand, pool, rng, iterations, deadline)
        finalists.setdefault(best.chains, best)
    ranked = sorted(finalists.values(), key=lambda c: c.seconds)[:max(2, options.starts)]
    finals = [ev.estimate(cand.chains, refine=True) or cand for cand in ranked]
    plans = [(build_plan(ctx, [(s.nodes, s.ranges) for s in f.solutions], f.microbatches), f)
             for f in finals]
    _, best = min(plans, key=lambda pf: pf[0].predicted_step_seconds)
    return polish(ctx, [(s.nodes, s.ranges) for s in best.solutions], best.microbatches,
                  deadline=deadline)


def default_iterations(n_nodes: int) -> int:
    """Local-search moves per start when the options do not say: more for
    small clusters, where each move is cheap and the space is tight."""
    return 400 if n_nodes <= 16 else 200 if n_nodes <= 128 else 100


def local_search(ev: Evaluator, hop, cand: Candidate, pool: Sequence[int], rng: random.Random,
                 iterations: int, deadline: float) -> tuple[Candidate, tuple[int, ...]]:
    """Hill climbing from ``cand``: try random moves, keep those that lower the estimate.

    Deterministic for a given ``rng`` state unless ``deadline`` (a
    ``time.perf_counter()`` value) stops it first.
    """
    pool = tuple(pool)
    moves = MOVES if not ev.ctx.config.stages else _KEEPS_LENGTH
    weights = _WEIGHTS if not ev.ctx.config.stages else (3, 2, 1)
    for _ in range(iterations):
        if time.perf_counter() > deadline:
            break
        kind = rng.choices(moves, weights)[0]
        proposal = propose(kind, [list(c) for c in cand.chains], list(pool), hop, rng, ev.ctx.M)
        if proposal is None:
            continue
        chains, new_pool = proposal
        new = ev.estimate([tuple(c) for c in chains if c])
        if new is not None and new.seconds < cand.seconds * (1 - 1e-9):
            cand, pool = new, tuple(new_pool)
    return cand, pool


def _best_insert(hop, chain: list[int], node: int) -> list[int]:
    """``chain`` with ``node`` inserted where the path's (slowest hop, sum) is least."""
    options = [chain[:i] + [node] + chain[i:] for i in range(len(chain) + 1)]
    return min(options, key=lambda c: path_cost(hop, c))


def propose(kind: str, chains: list[list[int]], pool: list[int], hop, rng: random.Random,
            max_groups: int) -> tuple[list[list[int]], list[int]] | None:
    """One random move of kind ``kind`` (see :data:`MOVES`); None when it does not apply.

    The arguments are modified in place and returned.
    """
    r = len(chains)
    if kind == "relocate":
        where = [(g, i) for g, c in enumerate(chains) for i in range(len(c))] + \
                [(-1, i) for i in range(len(pool))]
        g, i = rng.choice(where)
        node = (chains[g] if g >= 0 else pool).pop(i)
        targets = [h for h in range(r) if h != g] + ([-1] if g >= 0 else []) + \
                  (["new"] if r < max_groups else [])
        if not targets:
            return None
        h = rng.choice(targets)
        if h == -1:
            pool.append(node)
        elif h == "new":
            chains.append([node])
        else:
            chains[h] = _best_insert(hop, chains[h], node)
    elif kind == "swap":
        where = [(g, i) for g, c in enumerate(chains) for i in range(len(c))]
        a = rng.choice(where)
        others = [w for w in where if w[0] != a[0]] + [(-1, i) for i in range(len(pool))]
        if not others:
            return None
        b = rng.choice(others)
        seq_b = chains[b[0]] if b[0] >= 0 else pool
        chains[a[0]][a[1]], seq_b[b[1]] = seq_b[b[1]], chains[a[0]][a[1]]
    elif kind == "reorder":
        c = chains[rng.randrange(r)]
        if len(c) < 3:
            return None
        i, j = sorted(rng.sample(range(len(c)), 2))
        if rng.random() < 0.5:
            c[i:j + 1] = c[i:j + 1][::-1]
        else:
            c.insert(j, c.pop(i))
    elif kind == "reverse":
        chains[rng.randrange(r)].reverse()
    elif kind == "merge":
        if r < 2:
            return None
        g, h = rng.sample(range(r), 2)
        a, b = chains[g], chains[h]
        joined = min((a + b, a + b[::-1], a[::-1] + b, b + a), key=lambda c: path_cost(hop, c))
        chains[g] = joined
        del chains[h]
    elif kind == "split":
        if r >= max_groups:
            return None
        g = rng.randrange(r)
        if len(chains[g]) < 2:
            return None
        cut = rng.randrange(1, len(chains[g]))
        chains.append(chains[g][cut:])
        chains[g] = chains[g][:cut]
    else:
        raise ValueError(f"unknown move {kind!r}")
    return chains, pool


def no_fit_error(ctx: PlanContext) -> PlanError:
    """The PlanError for "nothing fits", with the model's and the nodes' bytes."""
    gib = 2**30
    state = float(ctx.state[0, ctx.L])
    biggest = max(float(ctx.state[k, k + 1]) for k in range(ctx.L))
    top = max(ctx.mem)
    what = (f"{ctx.config.stages} stages per group" if ctx.config.stages
            else f"the model's {ctx.L} layers")
    return PlanError(
        f"no split of {what} fits the nodes' memory: weights, gradients and optimizer "
        f"state need {state / gib:.2f} GiB in all and {biggest / gib:.2f} GiB for the largest "
        f"layer, plus {ctx.stash[0, ctx.L] / gib:.2f} GiB of activations per microbatch of "
        f"{ctx.mb:g} samples; the largest of the {ctx.n} node(s) has {top / gib:.2f} GiB, "
        f"all together {sum(ctx.mem) / gib:.2f} GiB")
