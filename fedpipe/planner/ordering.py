"""Orders of nodes: the stage order inside a group and a locality order of the cluster.

Both work on a symmetric hop-cost matrix (seconds to move a typical boundary
tensor there and back, :meth:`PlanContext.hop_cost`).
"""
from __future__ import annotations

from typing import Sequence, TypeAlias

import numpy as np

PerNode: TypeAlias = Sequence[float] | np.ndarray
"""One number per node, indexed by node (FLOP/s, say): a list or a 1-D array."""

EXACT_PATH_NODES = 8
"""Groups of up to this many nodes get an exact bottleneck path; larger ones a heuristic."""


def path_cost(cost: np.ndarray, order: Sequence[int]) -> tuple[float, float]:
    """``(slowest hop, sum of hops)`` of the open path ``order``, seconds."""
    hops = [cost[a, b] for a, b in zip(order, order[1:])]
    return (max(hops), sum(hops)) if hops else (0.0, 0.0)


def bottleneck_path(cost: np.ndarray, nodes: Sequence[int]) -> list[int]:
    """An open path through ``nodes`` whose slowest hop is as fast as possible.

    The bottleneck travelling-salesman path DTFM uses to order pipeline stages
    (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous
    Environments", NeurIPS 2022), ties broken by the sum of hops. Exact (dynamic
    program over subsets, O(2ⁿ n²)) for up to :data:`EXACT_PATH_NODES` nodes;
    beyond that, segment reversals (2-opt) that remove the slowest hop,
    starting from the given order.

    Args:
        cost: symmetric hop-cost matrix (seconds), indexed by node.
        nodes: the nodes to order.
    """
    nodes = list(nodes)
    if len(nodes) <= 2:
        return nodes
    sub = cost[np.ix_(nodes, nodes)]
    off = sub[~np.eye(len(nodes), dtype=bool)]
    if off.max() <= off.min() * (1 + 1e-12):
        return nodes        # all hops cost the same: any order is optimal
    if len(nodes) <= EXACT_PATH_NODES:
        return _exact_path(cost, nodes)
    return _two_opt(cost, nodes)


def _exact_path(cost: np.ndarray, nodes: list[int]) -> list[int]:
    n = len(nodes)
    sub = cost[np.ix_(nodes, nodes)].tolist()
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * n for _ in range(1 << n)]
    prev = [[-1] * n for _ in range(1 << n)]
    for i in range(n):
        best[1 << i][i] = (0.0, 0.0)
    for mask in range(1, 1 << n):
        row = best[mask]
        for last in range(n):
            cur = row[last]
            if cur[0] == float("inf"):
                continue
            for nxt in range(n):
                if mask >> nxt & 1:
                    continue
                w = sub[last][nxt]
                cand = (max(cur[0], w), cur[1] + w)
                m2 = mask | 1 << nxt
                if cand < best[m2][nxt]:
                    best[m2][nxt] = cand
                    prev[m2][nxt] = last
    full = (1 << n) - 1
    last = min(range(n), key=lambda i: best[full][i])
    order, mask = [], full
    while last >= 0:
        order.append(nodes[last])
        last, mask = prev[mask][last], mask & ~(1 << last)
    return order[::-1]


def _two_opt(cost: np.ndarray, order: list[int], rounds: int = 50) -> list[int]:
    """Reverse segments while that lowers (slowest hop, sum of hops)."""
    cur = path_cost(cost, order)
    for _ in range(rounds):
        hops = [cost[a, b] for a, b in zip(order, order[1:])]
        worst = int(np.argmax(hops))
        improved = False
        for i in range(len(order)):
            lo, hi = sorted((worst + 1, i)) if i > worst else (i, worst)
            if hi - lo < 1:
                continue
            cand = order[:lo] + order[lo:hi + 1][::-1] + order[hi + 1:]
            c = path_cost(cost, cand)
            if c < cur:
                order, cur, improved = cand, c, True
                break
        if not improved:
            break
    return order


def locality_order(cost: np.ndarray, nodes: Sequence[int], speed: PerNode) -> list[int]:
    """A line through ``nodes`` on which nodes joined by cheap links sit together.

    Single-linkage clustering (Kruskal on the hop costs): clusters merge along
    their cheapest link, and each merge joins the two clusters' lines end to
    end, so a site's nodes stay contiguous and sites follow their fastest
    links. Equal costs are merged fastest node first, so the nodes of a
    uniform site come roughly in decreasing speed.

    Args:
        cost: symmetric hop-cost matrix (seconds), indexed by node.
        nodes: the nodes to order.
        speed: FLOP/s per node (indexed like ``cost``).
    """
    nodes = sorted(nodes, key=lambda i: (-speed[i], i))
    n = len(nodes)
    if n <= 2:
        return nodes
    sub = cost[np.ix_(nodes, nodes)]
    iu, ju = np.triu_indices(n, 1)
    edges = np.argsort(sub[iu, ju], kind="stable")
    parent = list(range(n))
    lines = {i: [i] for i in range(n)}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    merges = 0
    for e in edges.tolist():
        a, b = int(iu[e]), int(ju[e])
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        la, lb = lines.pop(ra), lines.pop(rb)
        if la[0] == a:
            la.reverse()
        if lb[-1] == b:
            lb.reverse()
        parent[rb] = ra
        lines[ra] = la + lb
        merges += 1
        if merges == n - 1:
            break
    (line,) = lines.values()
    return [nodes[i] for i in line]


def site_runs(cost: np.ndarray, line: Sequence[int], jump: float = 2.0) -> list[list[int]]:
    """Cut a locality line into sites: runs whose consecutive hops cost at most
    ``jump`` × the median consecutive hop (seconds)."""
    if len(line) < 2:
        return [list(line)]
    hops = np.array([cost[a, b] for a, b in zip(line, line[1:])])
    limit = jump * float(np.median(hops))
    runs, cur = [], [line[0]]
    for node, hop in zip(line[1:], hops):
        if hop > limit:
            runs.append(cur)
            cur = []
        cur.append(node)
    runs.append(cur)
    return runs
