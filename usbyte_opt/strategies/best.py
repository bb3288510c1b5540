"""``best``: our optimizer. Fusion, partition and order together, scored by the one simulator.

Why this shape. By the closed form of :mod:`usbyte_opt.fastsim`, a schedule's overlap-mode
time is ``max(B + F, finish_last, max_k finish_k + q_k)`` with release times
``r_p = ready_p`` and tails ``q_p = update_p + F - need_p``. Without per-block latency this is
the single-machine problem ``1 | r_j, pmtn | max(C_j + q_j)``, which Jackson's preemptive
rule solves optimally: *at every moment send the released tensor with the largest tail*.
US-Byte's phase 1/phase 2 is that rule with a unit grid (the forward order is the tail order),
and its weakness is the per-block latency alpha: it never fuses, and it preempts even when a
cut costs more than it saves. So ``best``:

1. **Constructs** schedules with Jackson's rule made alpha-aware (:func:`construct`): a
   released tensor with a larger tail may cut the current block only when the cut leaves at
   least ``cut_min`` bytes on each side, and a block absorbs its released neighbours in the
   layout (fusion) up to ``fuse_cap`` bytes. A small grid of ``(cut_min, fuse_cap)`` in units
   of ``alpha / beta`` (the bytes one alpha could have carried) covers the regimes from
   latency-bound (fuse a lot, never cut) to bandwidth-bound (cut freely, fuse little).
2. **Seeds** from every other strategy's plan it is given (the CLI passes all of them), plus
   the cheap baselines it computes itself, so it is never predicted slower than any of them
   in overlap mode.
3. **Improves** the best candidate by local search (:func:`improve`): merge two consecutive
   blocks that are contiguous in a buffer, split a block (at a tensor boundary or in the middle
   of a tensor), swap two consecutive blocks; first improvement, sweeps until a fixed point or
   the time budget. Each move is scored in O(blocks) numpy with
   ``finish_k = C_k + max_{j<=k}(r_j - C_{j-1})`` (``C`` the prefix sum of costs), which is the
   channel recurrence unrolled.
4. On small instances (``<= exact_max_tensors`` tensors) it also solves the exact MILP of
   :mod:`usbyte_opt.exact` (whole-tensor grid, 2 s limit) with pulp and keeps it when better.

It reports the lower bound of :mod:`usbyte_opt.bounds` and its gap in ``Plan.info``.

Example::

    >>> import random
    >>> from usbyte_opt.synthetic import random_profile
    >>> from usbyte_opt.problem import Problem
    >>> from usbyte_opt.fastsim import evaluate
    >>> from usbyte_opt.strategies import get
    >>> pb = Problem.from_profile(random_profile(random.Random(1), 40))
    >>> best = get("best").plan(pb)
    >>> wfbp = get("wfbp").plan(pb)
    >>> evaluate(pb, best.layout, best.blocks) <= evaluate(pb, wfbp.layout, wfbp.blocks, "fence")
    True
    >>> best.info["gap"] >= 0
    True
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Sequence

import numpy as np

from ..bounds import lower_bound
from ..fastsim import evaluate, tails
from ..formats import Block
from ..problem import Layout, Problem
from . import Plan, STRATEGIES, register

#: Grid of the constructive heuristic, in units of alpha/beta bytes.
#: ``cut_min``: smallest piece a preemption may leave (inf: never cut a tensor).
#: ``fuse_cap``: largest block that fusion may build (0: no fusion).
CUT_GRID = (0.25, 1.0, 4.0, 16.0, math.inf)
FUSE_GRID = (0.0, 1.0, 4.0, 16.0, 64.0)

#: Baselines cheap enough to recompute inside ``best`` when the caller passed none.
CHEAP_SEEDS = ("wfbp", "ddp", "mgwfbp")


def construct(problem: Problem, layout: Layout, tail: Sequence[float], cut_min: float,
              fuse_cap: float) -> list[Block]:
    """Jackson's rule with a cut threshold and neighbour fusion; ``cut_min``/``fuse_cap`` in bytes.

    Each tensor is sent from its first element upward, so what is left of it is always a
    suffix ``[lo, end)``; a block may extend *down* over released whole tensors whose
    remainder ends where it starts, and *up* over released, wholly unsent neighbours.
    """
    n = problem.n
    ready = problem.ready
    alpha, beta = problem.cost.alpha_ms, problem.cost.beta_ms_per_byte
    pos = layout.pos
    lo = [pos[i][1] for i in range(n)]
    end = [pos[i][2] for i in range(n)]
    start = list(lo)
    isz = [layout.itemsize[pos[i][0]] for i in range(n)]
    # Neighbours in the layout.
    prev_of = [-1] * n
    next_of = [-1] * n
    for members in layout.members:
        for a, b in zip(members, members[1:]):
            next_of[a], prev_of[b] = b, a
    rel = sorted(range(n), key=lambda i: (ready[i], i))
    ptr = 0
    heap: list[tuple[float, float, int]] = []
    t = 0.0
    blocks: list[Block] = []
    left = n
    while left:
        while ptr < n and ready[rel[ptr]] <= t:
            i = rel[ptr]
            heapq.heappush(heap, (-tail[i], -ready[i], i))
            ptr += 1
        while heap and lo[heap[0][2]] >= end[heap[0][2]]:
            heapq.heappop(heap)
        if not heap:
            t = ready[rel[ptr]]
            continue
        p = heap[0][2]
        rem = end[p] - lo[p]
        amount = rem
        if cut_min < math.inf:
            # Next release that would outrank p (a few steps ahead is enough in practice:
            # releases are sorted, and beyond a handful the gap is too long to matter).
            t_next = math.inf
            for j in rel[ptr:ptr + 8]:
                if tail[j] > tail[p]:
                    t_next = ready[j]
                    break
            gap = t_next - t
            if gap < alpha + rem * isz[p] * beta:
                k = int((gap - alpha) / (isz[p] * beta)) if gap > alpha else 0
                min_el = int(cut_min / isz[p]) + 1
                if k >= min_el and rem - k >= min_el:
                    amount = k
        b_lo, b_hi = lo[p], lo[p] + amount
        lo[p] += amount
        if lo[p] >= end[p]:
            left -= 1
        nbytes = amount * isz[p]
        if fuse_cap > 0 and b_hi == end[p]:
            # Down: the block starts at p's start, so a neighbour's suffix can join.
            cur = p
            while b_lo == start[cur] and prev_of[cur] >= 0:
                j = prev_of[cur]
                if lo[j] >= end[j] or ready[j] > t:
                    break
                add = (end[j] - lo[j]) * isz[j]
                if nbytes + add > fuse_cap:
                    break
                nbytes += add
                b_lo = lo[j]
                lo[j] = end[j]
                left -= 1
                cur = j
            # Up: wholly unsent, released neighbours above.
            cur = p
            while next_of[cur] >= 0:
                j = next_of[cur]
                if lo[j] != start[j] or ready[j] > t:
                    break
                add = (end[j] - lo[j]) * isz[j]
                if nbytes + add > fuse_cap:
                    break
                nbytes += add
                b_hi = end[j]
                lo[j] = end[j]
                left -= 1
                cur = j
        blocks.append(Block(pos[p][0], b_lo, b_hi))
        t += alpha + nbytes * beta
    return blocks


def two_phase(problem: Problem, layout: Layout, tail: Sequence[float],
              n_boundaries: int = 24, window: int = 2048) -> list[list[Block]]:
    """Bucketed schedules in two phases, each optimal by dynamic programming for its part.

    Tensors in ready order ``0..N-1`` (so fused runs of one dtype are contiguous in the default
    layout). Phase 1 sends ``[0, x)`` in ready order, fused into runs; phase 2 sends ``[x, N)``
    in *reverse* ready order (input side first), fused into runs. Once the first phase-2 block
    (which holds the last-ready tensor) starts, every gradient is final, so phase 2's
    contribution is ``start + D_x(N)`` with

        D_x(y) = min_z  c(z, y) + max(Q(z, y), D_x(z)),   D_x(x) = 0,

    where block ``[z, y)`` goes first and ``Q`` is its largest tail. Phase 1 minimises the
    channel's finish time: ``f(j) = min_i max(f(i), ready_{j-1}) + c(i, j)``. Returns one
    schedule per tried boundary ``x`` (the boundaries around where phase 1 meets the end of
    backward, plus a spread); the caller scores them with the simulator.
    """
    order = problem.ready_order()
    N = len(order)
    pos = layout.pos
    alpha, beta = problem.cost.alpha_ms, problem.cost.beta_ms_per_byte
    R = np.array([problem.ready[i] for i in order])
    Q = np.array([tail[i] for i in order])
    w = np.array([problem.nbytes(i) * beta for i in order])
    P = np.concatenate([[0.0], np.cumsum(w)])
    buf = [pos[i][0] for i in order]
    run_lo = [0] * N  # first index of the single-buffer run that ends at j
    for j in range(1, N):
        run_lo[j] = run_lo[j - 1] if buf[j] == buf[j - 1] else j
    f = np.zeros(N + 1)
    arg = [0] * (N + 1)
    for j in range(1, N + 1):
        lo = max(run_lo[j - 1], j - window)
        cand = np.maximum(f[lo:j], R[j - 1]) + alpha + (P[j] - P[lo:j])
        k = int(np.argmin(cand))
        f[j], arg[j] = cand[k], lo + k

    def runs_to_blocks(runs: list[tuple[int, int]]) -> list[Block]:
        return [Block(buf[i], pos[order[i]][1], pos[order[j - 1]][2]) for i, j in runs]

    x0 = int(np.searchsorted(f, R[-1], side="right")) - 1
    xs = set(int(v) for v in np.linspace(0, N - 1, max(n_boundaries // 2, 2)))
    xs.update(range(max(0, x0 - n_boundaries // 4), min(N - 1, x0 + n_boundaries // 4) + 1))
    out = []
    for x in sorted(xs):
        D = np.zeros(N + 1)
        darg = [0] * (N + 1)
        for y in range(x + 1, N + 1):
            lo = max(x, run_lo[y - 1], y - window)
            qz = np.maximum.accumulate(Q[lo:y][::-1])[::-1]
            cand = alpha + (P[y] - P[lo:y]) + np.maximum(qz, D[lo:y])
            k = int(np.argmin(cand))
            D[y], darg[y] = cand[k], lo + k
        runs1, j = [], x
        while j > 0:
            runs1.append((arg[j], j))
            j = arg[j]
        runs1.reverse()
        runs2, y = [], N
        while y > x:
            runs2.append((darg[y], y))
            y = darg[y]
        out.append(runs_to_blocks(runs1) + runs_to_blocks(runs2))
    return out


class _Scorer:
    """Block stats as numpy arrays and the vectorised channel recurrence."""

    def __init__(self, problem: Problem, layout: Layout):
        self.problem, self.layout = problem, layout
        self.tail = tails(problem)
        self.floor = problem.B + problem.F
        self.alpha = problem.cost.alpha_ms
        self.beta = problem.cost.beta_ms_per_byte

    def stat(self, k: Block) -> tuple[float, float, float]:
        idx = self.layout.tensors_of(k.buffer, k.start, k.end)
        ready, tail = self.problem.ready, self.tail
        return (max(ready[i] for i in idx),
                self.alpha + (k.end - k.start) * self.layout.itemsize[k.buffer] * self.beta,
                max(tail[i] for i in idx))

    def arrays(self, blocks: Sequence[Block]) -> np.ndarray:
        return np.array([self.stat(k) for k in blocks], dtype=float).reshape(-1, 3)

    def score(self, S: np.ndarray) -> float:
        R, C, Q = S[:, 0], S[:, 1], S[:, 2]
        f = self.problem.stretch(len(S))  # compute-cost option: ready, tails, B + F scale
        if f != 1.0:
            R, Q = R * f, Q * f
        cum = np.cumsum(C)
        fin = cum + np.maximum.accumulate(R - (cum - C))
        return max(self.floor * f, float(fin[-1]), float((fin + Q).max()))


def _splits(problem: Problem, layout: Layout, k: Block) -> list[tuple[Block, Block]]:
    """Candidate ways to cut block ``k`` in two: at tensor boundaries near its ends and
    middle, or in the middle of a single tensor."""
    idx = layout.tensors_of(k.buffer, k.start, k.end)
    cuts = set()
    if len(idx) > 1:
        bounds = [layout.pos[i][1] for i in idx[1:]]
        for c in (bounds[0], bounds[-1], bounds[len(bounds) // 2]):
            if k.start < c < k.end:
                cuts.add(c)
    if k.end - k.start >= 2:
        cuts.add((k.start + k.end) // 2)
    return [(Block(k.buffer, k.start, c), Block(k.buffer, c, k.end)) for c in sorted(cuts)]


def _critical(sc: "_Scorer", layout: Layout, blocks: list[Block], S: np.ndarray,
              cur: float, eps: float = 1e-9) -> tuple[list[Block], np.ndarray, float] | None:
    """Moves aimed at the block that sets T (the largest ``finish + tail``).

    *Hoist*: issue it before one of the blocks that hold the channel when it becomes ready.
    *Preempt*: cut such an earlier, smaller-tail block at the moment the critical block
    becomes ready and send the rest after it — Jackson's preemption, paid with one alpha.
    Returns the best improving move, or ``None``.
    """
    R, C, Q = S[:, 0], S[:, 1], S[:, 2]
    cum = np.cumsum(C)
    fin = cum + np.maximum.accumulate(R - (cum - C))
    start = fin - C
    c = int(np.argmax(fin + Q))
    if fin[c] + Q[c] < cur - eps:
        return None  # T is set by the compute floor or the last finish, not by a tail
    # Blocks before c still on the wire when c became ready, latest first.
    busy = [k for k in range(c - 1, -1, -1) if fin[k] > R[c]][:16]
    best: tuple[list[Block], np.ndarray, float] | None = None
    for k in busy:
        order = blocks[:k] + [blocks[c]] + blocks[k:c] + blocks[c + 1:]
        S2 = np.concatenate([S[:k], S[c:c + 1], S[k:c], S[c + 1:]])
        v = sc.score(S2)
        if v < cur - eps and (best is None or v < best[2]):
            best = (order, S2, v)
        a = blocks[k]
        if Q[k] >= Q[c] or start[k] >= R[c]:
            continue
        per_el = sc.beta * layout.itemsize[a.buffer]
        cut = a.start + int((R[c] - start[k] - sc.alpha) / per_el) if per_el > 0 else a.start
        if not a.start < cut < a.end:
            continue
        k1, k2 = Block(a.buffer, a.start, cut), Block(a.buffer, cut, a.end)
        order = blocks[:k] + [k1] + blocks[k + 1:c + 1] + [k2] + blocks[c + 1:]
        S2 = np.concatenate([S[:k], np.array([sc.stat(k1)]), S[k + 1:c + 1],
                             np.array([sc.stat(k2)]), S[c + 1:]])
        v = sc.score(S2)
        if v < cur - eps and (best is None or v < best[2]):
            best = (order, S2, v)
    return best


def improve(problem: Problem, layout: Layout, blocks: list[Block], deadline: float) -> list[Block]:
    """Local search: moves on the critical block (:func:`_critical`), then a first-improvement
    sweep of merge / swap / split over consecutive blocks; repeated to a fixed point or the
    deadline."""
    sc = _Scorer(problem, layout)
    blocks = list(blocks)
    S = sc.arrays(blocks)
    cur = sc.score(S)
    eps = 1e-9
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        while time.perf_counter() < deadline:
            move = _critical(sc, layout, blocks, S, cur)
            if move is None:
                break
            blocks, S, cur = move
            improved = True
        k = 0
        while k < len(blocks) and time.perf_counter() < deadline:
            a = blocks[k]
            moved = False
            if k + 1 < len(blocks):
                b = blocks[k + 1]
                # Merge when contiguous in one buffer (either side).
                if a.buffer == b.buffer and (a.end == b.start or b.end == a.start):
                    m = Block(a.buffer, min(a.start, b.start), max(a.end, b.end))
                    S2 = np.concatenate([S[:k], np.array([sc.stat(m)]), S[k + 2:]])
                    v = sc.score(S2)
                    if v < cur - eps:
                        blocks[k:k + 2] = [m]
                        S, cur, moved = S2, v, True
                if not moved:
                    S2 = S.copy()
                    S2[[k, k + 1]] = S2[[k + 1, k]]
                    v = sc.score(S2)
                    if v < cur - eps:
                        blocks[k], blocks[k + 1] = b, a
                        S, cur, moved = S2, v, True
            if not moved:
                for x, y in _splits(problem, layout, a):
                    sx, sy = sc.stat(x), sc.stat(y)
                    for first, second in ((x, y), (y, x)) if sy[2] > sx[2] else ((x, y),):
                        pair = np.array([sc.stat(first), sc.stat(second)])
                        S2 = np.concatenate([S[:k], pair, S[k + 1:]])
                        v = sc.score(S2)
                        if v < cur - eps:
                            blocks[k:k + 1] = [first, second]
                            S, cur, moved = S2, v, True
                            break
                    if moved:
                        break
            if moved:
                improved = True
                k = max(k - 1, 0)
            else:
                k += 1
    return blocks


@register("best", "overlap", "ours: alpha-aware Jackson rule with fusion + local search, "
          "seeded by every other strategy")
def plan(problem: Problem, seeds: Sequence[Plan] | None = None, time_budget_s: float = 0.6,
         exact_max_tensors: int = 6) -> Plan:
    """Plan with fusion, partition and order chosen together (see module docstring).

    Args:
        seeds: plans of other strategies to start from; without them the cheap baselines
            (wfbp, ddp, mgwfbp) are computed here.
        time_budget_s: wall-clock budget of the local search.
        exact_max_tensors: also solve the exact unit-grid MILP up to this many tensors.

    Returns:
        A :class:`Plan` in overlap mode whose ``info`` holds the lower bound, the gap and
        where the winning candidate came from.
    """
    t0 = time.perf_counter()
    layout = problem.layout()
    tail = tails(problem)
    u0 = problem.cost.alpha_ms / problem.cost.beta_ms_per_byte
    if u0 <= 0:
        u0 = max(sum(problem.nbytes(i) for i in range(problem.n)) / (10 * problem.n), 1.0)
    candidates: list[tuple[float, str, Layout, list[Block]]] = []

    def add(name: str, lay: Layout, blocks: list[Block]) -> None:
        candidates.append((evaluate(problem, lay, blocks), name, lay, list(blocks)))

    for cut in CUT_GRID:
        for fuse in FUSE_GRID:
            add(f"construct(cut={cut:g},fuse={fuse:g})", layout,
                construct(problem, layout, tail, cut * u0, fuse * u0))
    for i, blocks in enumerate(two_phase(problem, layout, tail)):
        add(f"two-phase#{i}", layout, blocks)
    if seeds is None:
        seeds = [STRATEGIES[s].plan(problem) for s in CHEAP_SEEDS if s in STRATEGIES]
    for s in seeds:
        add(f"seed:{s.info.get('strategy', '?')}", s.layout, s.blocks)
    if problem.n <= exact_max_tensors:
        from ..exact import solve_exact

        res = solve_exact(problem, layout, units_per_tensor=1, time_limit_s=2.0)
        if res is not None:
            add("exact-milp", layout, res.blocks)
    candidates.sort(key=lambda c: c[0])
    _, origin, lay, blocks = candidates[0]
    deadline = time.perf_counter() + time_budget_s
    blocks = improve(problem, lay, blocks, deadline)
    T = evaluate(problem, lay, blocks)
    lb = lower_bound(problem)
    return Plan(lay, blocks, "overlap", {
        "strategy": "best",
        "origin": origin,
        "start_ms": candidates[0][0],
        "lower_bound_ms": lb,
        "gap": max(0.0, (T - lb) / lb) if lb > 0 else 0.0,
        "candidates": len(candidates),
        "solve_s": time.perf_counter() - t0,
    })
