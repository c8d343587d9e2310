"""The planner's search: initial groupings, local search, and the final simulated choice.

1. Score the contiguous and strided layouts (:mod:`~fedpipe.planner.grouping`)
   for every candidate group count with the analytic estimate
   (:class:`~fedpipe.planner.evaluate.Evaluator`).
2. Refine the best few by a seeded local search (hill climbing) over moves
   that relocate a node to another group or to the unused pool, swap two
   nodes, reorder or reverse a chain, merge two groups, split one, or swap
   two groups' places in the all-reduce ring.
3. Build the best candidates' plans (codecs per link), polish the splits of
   those the discrete-event simulator finds fastest on the simulator
   (:func:`~fedpipe.planner.evaluate.polish`), and return the fastest,
4. with no group's bottleneck stage behind a relay where a direct node can take it
   (:mod:`~fedpipe.planner.relayed`).
"""
from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import numpy as np

from ..units import binary_bytes
from .context import PlanContext
from .evaluate import Candidate, Chain, Evaluator, Split, build_plan, polish
from .memfit import MEMORY_REMEDIES
from .grouping import initial_groupings, site_subsets
from .ordering import locality_order, path_cost, site_runs
from .relayed import keep_bottlenecks_direct
from .types import ClusterView, ModelProfile, Plan, PlanError, SearchOptions, TrainConfig

MOVES = ("relocate", "swap", "reorder", "reverse", "merge", "split", "regroup")
_WEIGHTS = (3, 3, 2, 1, 1, 1, 1)
_KEEPS_LENGTH = ("swap", "reorder", "reverse", "regroup")
SCREEN_ABOVE = 16
"""Above this many nodes, initial groupings are screened with a split by speed
before the dynamic program scores the best few."""

Archive = dict[tuple[Chain, ...], Candidate]
"""The candidates the final step may simulate, by each group's nodes with a stage
(:func:`_remember`)."""


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
    deadline = time.perf_counter() + options.time_limit_s
    ctx = PlanContext(cluster, profile, config)
    ev = Evaluator(ctx)
    hop = ctx.hop_cost()
    archive: Archive = {}
    starts = _starts(ev, hop, options, deadline, archive)
    rng = random.Random(options.seed)
    iterations = options.iterations if options.iterations is not None else default_iterations(ctx.n)
    for cand in starts:
        used = {i for c in cand.chains for i in c}
        pool = tuple(i for i in range(ctx.n) if i not in used)
        local_search(ev, hop, cand, pool, rng, iterations, deadline, archive)
    ranked = sorted(archive.values(), key=lambda c: c.seconds)[:max(1, options.finalists)]
    # (simulated step seconds, rank as a tie-break, splits, microbatches per group)
    plans: list[tuple[float, int, list[Split], tuple[int, ...]]] = []
    for cand in ranked:
        final = ev.estimate(cand.chains, refine=True) or cand
        groups: list[Split] = [(s.nodes, s.ranges) for s in final.solutions]
        plans.append((build_plan(ctx, groups, final.microbatches).predicted_step_seconds,
                      len(plans), groups, final.microbatches))
    plans.sort()
    polished = [polish(ctx, groups, micro, deadline=deadline)
                for _, _, groups, micro in plans[:max(1, options.polished)]]
    best = min(polished, key=lambda p: p.predicted_step_seconds)
    return keep_bottlenecks_direct(ctx, best)


def _remember(archive: Archive, cand: Candidate) -> None:
    """Keep ``cand`` among the candidates the final step may simulate: the best
    by estimate for each distinct assignment of nodes to groups and stages."""
    key = tuple(s.nodes for s in cand.solutions)
    if key not in archive or cand.seconds < archive[key].seconds:
        archive[key] = cand


def _starts(ev: Evaluator, hop: np.ndarray, options: SearchOptions, deadline: float,
            archive: Archive) -> list[Candidate]:
    """The scored initial groupings the local search starts from, best first.

    Raises:
        PlanError: none fits in memory.
    """
    ctx = ev.ctx
    line = locality_order(hop, range(ctx.n), ctx.flops)
    lines = site_subsets(line, site_runs(hop, line), ctx.flops)
    seeds = initial_groupings(lines, ctx.flops, hop, ctx.M, ctx.L, ctx.config.stages,
                              ctx.config.replicas)
    if not ctx.config.stages and ctx.config.replicas <= 1 and ctx.n > ev.exact_up_to:
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
    for cand in scored:
        _remember(archive, cand)
    return scored[:max(1, options.starts)]


def default_iterations(n_nodes: int) -> int:
    """Local-search moves per start when the options do not say: more for
    small clusters, where each move is cheap and the space is tight."""
    return 400 if n_nodes <= 16 else 200 if n_nodes <= 128 else 100


def local_search(ev: Evaluator, hop: np.ndarray, cand: Candidate, pool: Sequence[int],
                 rng: random.Random, iterations: int, deadline: float,
                 archive: Archive | None = None) -> tuple[Candidate, tuple[int, ...]]:
    """Hill climbing from ``cand`` over random moves (:func:`propose`), scored by
    the analytic estimate: a move is kept when it lowers the estimate. Returns
    the final candidate and its pool of unused nodes.

    Every candidate scored is also offered to ``archive`` (if given), so the
    final step can simulate near-ties the estimate cannot tell apart.
    Deterministic for a given ``rng`` state unless ``deadline`` (a
    ``time.perf_counter()`` value) stops it first.
    """
    pool = tuple(pool)
    cfg = ev.ctx.config
    moves = [m for m in (_KEEPS_LENGTH if cfg.stages else MOVES)
             if not (cfg.replicas and m in ("merge", "split"))]
    weights = [_WEIGHTS[MOVES.index(m)] for m in moves]
    max_groups = cfg.replicas or ev.ctx.M
    for _ in range(iterations):
        if time.perf_counter() > deadline:
            break
        kind = rng.choices(moves, weights)[0]
        proposal = propose(kind, [list(c) for c in cand.chains], list(pool), hop, rng, max_groups)
        if proposal is None:
            continue
        proposed, new_pool = proposal
        chains: list[Chain] = [tuple(c) for c in proposed if c]
        options = [chains]
        if len(chains) > len(cand.chains) and len(chains) >= 3:
            # a new group (appended last): try it at every place in the all-reduce ring
            *rest, last = chains
            options = [rest[:i] + [last] + rest[i:] for i in range(len(rest) + 1)]
        scored = [c for c in map(ev.estimate, options) if c is not None]
        if not scored:
            continue
        new = min(scored, key=lambda c: c.seconds)
        if archive is not None:
            _remember(archive, new)
        if new.seconds < cand.seconds * (1 - 1e-9):
            cand, pool = new, tuple(new_pool)
    return cand, pool


def _best_insert(hop: np.ndarray, chain: list[int], node: int) -> list[int]:
    """``chain`` with ``node`` inserted where the path's (slowest hop, sum) is least."""
    options = [chain[:i] + [node] + chain[i:] for i in range(len(chain) + 1)]
    return min(options, key=lambda c: path_cost(hop, c))


def _relocate(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
              max_groups: int) -> bool:
    """A node (from a group or the pool) to another group (where its path is
    best), to the pool, or to a new group of its own."""
    where = [(g, i) for g, c in enumerate(chains) for i in range(len(c))] + \
            [(-1, i) for i in range(len(pool))]
    g, i = rng.choice(where)
    node = (chains[g] if g >= 0 else pool).pop(i)
    new = len(chains)  # the index a new group gets
    targets = [h for h in range(len(chains)) if h != g] + ([-1] if g >= 0 else []) + \
              ([new] if len(chains) < max_groups else [])
    if not targets:
        return False
    h = rng.choice(targets)
    if h == -1:
        pool.append(node)
    elif h == new:
        chains.append([node])
    else:
        chains[h] = _best_insert(hop, chains[h], node)
    return True


def _swap(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
          max_groups: int) -> bool:
    """Two nodes of different groups (or a node and an unused one) trade places."""
    where = [(g, i) for g, c in enumerate(chains) for i in range(len(c))]
    a = rng.choice(where)
    others = [w for w in where if w[0] != a[0]] + [(-1, i) for i in range(len(pool))]
    if not others:
        return False
    b = rng.choice(others)
    seq_b = chains[b[0]] if b[0] >= 0 else pool
    chains[a[0]][a[1]], seq_b[b[1]] = seq_b[b[1]], chains[a[0]][a[1]]
    return True


def _reorder(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
             max_groups: int) -> bool:
    """Reverse a segment of a chain (2-opt) or move one of its nodes elsewhere in it."""
    c = chains[rng.randrange(len(chains))]
    if len(c) < 3:
        return False
    i, j = sorted(rng.sample(range(len(c)), 2))
    if rng.random() < 0.5:
        c[i:j + 1] = c[i:j + 1][::-1]
    else:
        c.insert(j, c.pop(i))
    return True


def _reverse(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
             max_groups: int) -> bool:
    """Run a chain the other way round."""
    chains[rng.randrange(len(chains))].reverse()
    return True


def _merge(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
           max_groups: int) -> bool:
    """Join two groups end to end (the orientation with the cheapest joint)."""
    if len(chains) < 2:
        return False
    g, h = rng.sample(range(len(chains)), 2)
    a, b = chains[g], chains[h]
    chains[g] = min((a + b, a + b[::-1], a[::-1] + b, b + a), key=lambda c: path_cost(hop, c))
    del chains[h]
    return True


def _split(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
           max_groups: int) -> bool:
    """Cut a chain in two groups."""
    g = rng.randrange(len(chains))
    if len(chains) >= max_groups or len(chains[g]) < 2:
        return False
    cut = rng.randrange(1, len(chains[g]))
    chains.append(chains[g][cut:])
    chains[g] = chains[g][:cut]
    return True


def _regroup(chains: list[list[int]], pool: list[int], hop: np.ndarray, rng: random.Random,
             max_groups: int) -> bool:
    """Swap two groups' places in the all-reduce ring (the group order)."""
    if len(chains) < 3:
        return False
    g, h = rng.sample(range(len(chains)), 2)
    chains[g], chains[h] = chains[h], chains[g]
    return True


Move = Callable[[list[list[int]], list[int], np.ndarray, random.Random, int], bool]
"""A move: ``(chains, pool, hop, rng, max_groups)`` -> whether it applied (in place)."""

_MOVE_FUNCTIONS: dict[str, Move] = {
    "relocate": _relocate, "swap": _swap, "reorder": _reorder, "reverse": _reverse,
    "merge": _merge, "split": _split, "regroup": _regroup}


def propose(kind: str, chains: list[list[int]], pool: list[int], hop: np.ndarray,
            rng: random.Random, max_groups: int) -> tuple[list[list[int]], list[int]] | None:
    """One random move of kind ``kind`` (one of :data:`MOVES`) on the groups
    ``chains`` and the unused ``pool``; None when it does not apply.

    The lists are modified in place and returned; ``hop`` is the hop-cost
    matrix, ``max_groups`` the most groups allowed.

    Raises:
        KeyError: unknown move.
    """
    if _MOVE_FUNCTIONS[kind](chains, pool, hop, rng, max_groups):
        return chains, pool
    return None


def no_fit_error(ctx: PlanContext) -> PlanError:
    """The PlanError for "nothing fits", with the model's and the nodes' bytes."""
    state = float(ctx.state[0, ctx.L])
    biggest = max(float(ctx.state[k, k + 1]) for k in range(ctx.L))
    top = max(ctx.mem)
    what = (f"{ctx.config.stages} stages per group at the pinned cuts {ctx.config.cuts}"
            if ctx.config.cuts else f"{ctx.config.stages} stages per group"
            if ctx.config.stages else f"the model's {ctx.L} layers")
    return PlanError(
        f"no split of {what} fits the nodes' memory: weights, gradients and optimizer "
        f"state need {binary_bytes(state)} in all and {binary_bytes(biggest)} for the "
        f"largest layer, plus {binary_bytes(ctx.stash[0, ctx.L])} of activations per "
        f"microbatch of {ctx.mb:g} samples; the largest of the {ctx.n} node(s) has "
        f"{binary_bytes(top)}, all together {binary_bytes(sum(ctx.mem))}{MEMORY_REMEDIES}")
