"""``best``: our optimizer. Fusion, partition, order and mode together, scored by the one scorer.

Why this shape. By the closed form of :mod:`usbyte_opt.planning.fastsim`, a schedule's overlap-mode
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
   latency-bound (fuse a lot, never cut) to bandwidth-bound (cut freely, fuse little); cut
   sizes no tensor is large enough for give the same plan and are run once, and beyond
   :data:`FULL_GRID_TENSORS` tensors the cuts are tried at the best fusion cap only.
2. Builds **two-phase** bucketed candidates, each phase optimal for its part by dynamic
   programming (:func:`two_phase`), the first of them (every tensor in phase 1) the fastest
   fence schedule of whole tensors in ready order.
3. Builds **bound-guided** candidates (:func:`bound_guided`): claim 4 of
   :mod:`usbyte_opt.planning.bounds` finds, with the bound, the blocks a schedule at the bound
   would have (where each starts or ends); filling them earliest deadline first (the largest
   tail among the released bytes whose deadline the block meets), cutting a tensor where a
   block is full, gives a plan on a layout of its own (:func:`chained_layout`: the blocks in
   chains, linked by the cut tensors). This is the candidate that reaches the bound where
   alpha and the end of backward compete (the regimes the first two miss: few large blocks,
   the input side released last); a few slacks and fills are built, the best
   :data:`GUIDE_KEEP` by the closed form kept.
4. **Seeds** from every other strategy's plan it is given (the CLI passes all of them), plus
   the cheap baselines it computes itself.
5. Scores **every candidate in both modes** (fence: every block, then every update, as DDP;
   overlap: each update gated in the next forward), as a plan of the runtime (its host cost:
   :meth:`usbyte_opt.planning.problem.Problem.host_releases`), so it is never predicted
   slower than any strategy's blocks on the runtime in the mode that strategy runs in,
   whatever the compute-cost fields.
6. **Improves** the best candidates (:data:`STARTS`, and the best one not bound-guided when
   all of those are) by local search in their mode
   (:func:`improve`), one after the other within the time budget: moves on the
   block that sets T, then merge / swap / split of consecutive blocks within the stretch of
   channel that sets T (a move elsewhere cannot lower it; with the compute-cost option or the
   updates at the gates every block counts, and the whole schedule is searched); first
   improvement, to a fixed point or
   the time budget. Each move is scored by :class:`usbyte_opt.planning.fastsim.Scorer` in O(blocks)
   numpy with ``finish_k = C_k + max_{j<=k}(r_j - C_{j-1})`` (``C`` the prefix sum of costs).
   With the compute-cost option the best candidate of the other mode is improved too.
   Each result is kept in whichever mode is faster for its blocks.
7. On small instances (``<= exact_max_tensors`` tensors) it also solves the exact MILP of
   :mod:`usbyte_opt.planning.exact` (whole-tensor grid, 2 s limit) with pulp and keeps it when better.

It reports the lower bound of :mod:`usbyte_opt.planning.bounds` and its gap in ``Plan.info``.

Example::

    >>> import random
    >>> from usbyte_opt.planning.synthetic import random_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> from usbyte_opt.planning.fastsim import evaluate
    >>> from usbyte_opt.planning.strategies import get
    >>> pb = Problem.from_profile(random_profile(random.Random(1), 40))
    >>> best = get("best").plan(pb)
    >>> wfbp = get("wfbp").plan(pb)
    >>> T = evaluate(pb, best.layout, best.blocks, best.mode)
    >>> T <= evaluate(pb, wfbp.layout, wfbp.blocks, "fence")
    True
    >>> best.info["gap"] >= 0
    True
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...formats import Block, Buffer, Mode
from ..bounds import lower_bound
from ..cost import HierCost
from ..ddp import expressible, min_finish
from ..fastsim import MODES, Scorer, Stats, scorer_for, tails
from ..problem import Layout, Problem, Runner, UpdateRule
from . import STRATEGIES, NotApplicable, Plan, register

#: Grid of the constructive heuristic, in units of alpha/beta bytes.
#: ``cut_min``: smallest piece a preemption may leave (inf: never cut a tensor).
#: ``fuse_cap``: largest block that fusion may build (0: no fusion).
CUT_GRID = (0.25, 1.0, 4.0, 16.0, math.inf)
FUSE_GRID = (0.0, 1.0, 4.0, 16.0, 64.0)

#: Up to this many tensors the whole grid is built and two-phase tries 24 boundaries; beyond,
#: the fusion caps without cuts, then the cut sizes at the best cap (each construction is
#: O(n log n) in Python), and 8 boundaries.
FULL_GRID_TENSORS = 2000

#: Candidates the local search starts from, best first, while its time budget lasts.
STARTS = 3

#: The clock of the local search's budget: this process's processor time, not the wall clock,
#: so that other jobs on a shared machine do not cut the search short (and change the plan):
#: on an idle core the two run alike.
clock = time.process_time

#: Baselines cheap enough to recompute inside ``best`` when the caller passed none.
CHEAP_SEEDS = ("wfbp", "ddp", "ddp-tuned", "mgwfbp")


def construct(problem: Problem, layout: Layout, tail: Sequence[float], cut_min: float,
              fuse_cap: float) -> list[Block]:
    """Jackson's rule with a cut threshold and neighbour fusion; ``cut_min``/``fuse_cap`` in bytes.

    Each tensor is sent from its first element upward, so what is left of it is always a
    suffix ``[lo, end)``; a block may extend *down* over released whole tensors whose
    remainder ends where it starts, and *up* over released, wholly unsent neighbours.
    The rule times blocks on the cost model's linear bound (alpha per block, beta per byte):
    its cuts and fusions are judged on that line (:func:`_cut`, :func:`_fuse`).
    """
    n = problem.n
    ready = problem.ready
    alpha, beta = problem.cost.linear_bound()
    rs = _Remainders.of(problem, layout)
    lo, end, isz = rs.lo, rs.end, rs.isz
    rel = problem.ready_order()
    # The heap holds each released tensor's place in the order of (-tail, -ready, index),
    # plain ints, instead of those tuples: the same top, compared faster.
    by_place, place = _places(problem, tail)
    ptr = 0
    heap: list[int] = []
    t = 0.0
    blocks: list[Block] = []
    left = n
    push, pop = heapq.heappush, heapq.heappop
    cutting = cut_min < math.inf
    r_next = ready[rel[0]] if n else math.inf      # release of rel[ptr]
    while left:
        if r_next <= t:
            while ptr < n and ready[rel[ptr]] <= t:
                push(heap, place[rel[ptr]])
                ptr += 1
            r_next = ready[rel[ptr]] if ptr < n else math.inf
        while heap and lo[by_place[heap[0]]] >= end[by_place[heap[0]]]:
            pop(heap)
        if not heap:
            t = r_next
            continue
        p = by_place[heap[0]]
        lo_p, end_p, isz_p = lo[p], end[p], isz[p]
        amount = end_p - lo_p
        if cutting:
            # Next release that would outrank p (a few steps ahead is enough in practice:
            # releases are sorted, and beyond a handful the gap is too long to matter).
            amount = _cut(problem, tail, rel[ptr:ptr + 8], p, t, amount, isz_p, alpha, beta,
                          cut_min)
        b_lo, b_hi = lo_p, lo_p + amount
        lo[p] = b_hi
        if b_hi >= end_p:
            left -= 1
            pop(heap)                       # p is the top: sent in full
        nbytes = amount * isz_p
        if fuse_cap > 0 and b_hi == end_p:
            b_lo, b_hi, nbytes, fused = _fuse(rs, ready, p, t, b_lo, b_hi, nbytes, fuse_cap)
            left -= fused
        blocks.append(Block(layout.pos[p][0], b_lo, b_hi))
        t += alpha + nbytes * beta
    return blocks


@dataclass(slots=True)
class _Remainders:
    """What :func:`construct` has left to send of each tensor: ``[lo, end)`` of its elements
    in the layout (``start``: where it begins), its element size and its layout neighbours
    (``-1``: none)."""

    lo: list[int]
    end: list[int]
    start: list[int]
    isz: list[int]
    prev_of: list[int]
    next_of: list[int]

    @staticmethod
    def of(problem: Problem, layout: Layout) -> _Remainders:
        """Nothing sent yet: every tensor's whole range. The fixed lists are built once per
        problem and layout (kept in ``problem.cache``) and shared; ``lo``, which
        :func:`construct` moves, is a fresh copy."""
        key = ("remainders", id(layout))
        hit = problem.cache.get(key)
        if hit is None or hit[0] is not layout:
            hit = problem.cache[key] = (layout, _Remainders._build(problem, layout))
        rs: _Remainders = hit[1]
        return _Remainders(list(rs.lo), rs.end, rs.start, rs.isz, rs.prev_of, rs.next_of)

    @staticmethod
    def _build(problem: Problem, layout: Layout) -> _Remainders:
        n = problem.n
        pos = layout.pos
        lo = [pos[i][1] for i in range(n)]
        prev_of = [-1] * n
        next_of = [-1] * n
        for members in layout.members:
            for a, b in zip(members, members[1:]):
                next_of[a], prev_of[b] = b, a
        return _Remainders(lo, [pos[i][2] for i in range(n)], list(lo),
                           [layout.itemsize[pos[i][0]] for i in range(n)], prev_of, next_of)


def _cut(problem: Problem, tail: Sequence[float], upcoming: Sequence[int], p: int, t: float,
         rem: int, isz_p: int, alpha: float, beta: float, cut_min: float) -> int:
    """How many of the ``rem`` elements left of tensor ``p`` :func:`construct` sends at ``t``:
    only what fits before the first of the ``upcoming`` releases that outranks ``p`` (a
    larger tail), where both that piece and the rest exceed ``cut_min`` bytes; else all."""
    ready = problem.ready
    t_next = math.inf
    tp = tail[p]
    for j in upcoming:
        if tail[j] > tp:
            t_next = ready[j]
            break
    gap = t_next - t
    if gap < alpha + rem * isz_p * beta:
        k = int((gap - alpha) / (isz_p * beta)) if gap > alpha else 0
        min_el = int(cut_min / isz_p) + 1
        if k >= min_el and rem - k >= min_el:
            return k
    return rem


def _fuse(rs: _Remainders, ready: Sequence[float], p: int, t: float, b_lo: int, b_hi: int,
          nbytes: int, fuse_cap: float) -> tuple[int, int, int, int]:
    """:func:`construct`'s block ``[b_lo, b_hi)``, which ends tensor ``p``, fused with its
    released neighbours up to ``fuse_cap`` bytes: down over whole remainders ending where it
    starts, then up over wholly unsent tensors. Returns the block, its bytes and how many
    tensors it finished besides ``p``."""
    lo, end, start, isz = rs.lo, rs.end, rs.start, rs.isz
    fused = 0
    # Down: the block starts at p's start, so a neighbour's suffix can join.
    cur = p
    while b_lo == start[cur] and rs.prev_of[cur] >= 0:
        j = rs.prev_of[cur]
        if lo[j] >= end[j] or ready[j] > t:
            break
        add = (end[j] - lo[j]) * isz[j]
        if nbytes + add > fuse_cap:
            break
        nbytes += add
        b_lo = lo[j]
        lo[j] = end[j]
        fused += 1
        cur = j
    # Up: wholly unsent, released neighbours above.
    cur = p
    while rs.next_of[cur] >= 0:
        j = rs.next_of[cur]
        if lo[j] != start[j] or ready[j] > t:
            break
        add = (end[j] - lo[j]) * isz[j]
        if nbytes + add > fuse_cap:
            break
        nbytes += add
        b_hi = end[j]
        lo[j] = end[j]
        fused += 1
        cur = j
    return b_lo, b_hi, nbytes, fused


def _places(problem: Problem, tail: Sequence[float]) -> tuple[list[int], list[int]]:
    """The tensors in Jackson's order (largest tail first, then latest release, then index)
    and each one's place in it; once per problem and ``tail`` (kept in ``problem.cache``)."""
    key = ("jackson-places", id(tail))
    hit = problem.cache.get(key)
    if hit is None or hit[0] is not tail:
        ready = problem.ready
        by_place = sorted(range(problem.n), key=lambda i: (-tail[i], -ready[i], i))
        place = [0] * problem.n
        for k, i in enumerate(by_place):
            place[i] = k
        hit = problem.cache[key] = (tail, by_place, place)
    return hit[1], hit[2]


#: Bound-guided candidates (:func:`bound_guided`): the lower bound's blocks at the bound times
#: each of these, filled in each of these ways ``(fill, hold, uncut)``; the best
#: :data:`GUIDE_KEEP` by the closed form join the candidates. Beyond :data:`FULL_GRID_TENSORS`
#: tensors, the first two of each and one kept.
GUIDE_SLACK = (1.0, 1.001, 1.002, 1.005)
GUIDE_FILLS = (("split", False, True), ("split", False, False), ("split", True, True),
               ("skip", False, False), ("over", False, False))
GUIDE_KEEP = 4


def bound_guided(problem: Problem, slack: float = 1.0, fill: str = "split", hold: bool = False,
                 uncut: bool = False, events: set[str] | None = None
                 ) -> list[dict[int, int]] | None:
    """A schedule built from claim 4 of :mod:`usbyte_opt.planning.bounds`, as the elements of
    each tensor in each block, blocks in issue order (:func:`chained_layout` lays it out):
    the block boundaries of the bound's programme at ``slack`` times the bound (left blocks
    start at releases, right ones end at deadlines), each block filled, earliest first, with
    the released bytes of largest tail whose deadline it meets (earliest deadline first, the
    rule that is optimal for the relaxation), releases and tails as the bound relaxed them.
    ``fill``: ``"split"`` cuts the tensor that overflows a block (each cut tensor in two
    pieces, at most one cut at each end of a block, so that every block is one range of a
    layout built for it); ``"over"`` lets a whole tensor overflow a block when at least half
    of it fits; ``"skip"`` passes over tensors that do not fit. A block that nothing fits takes
    the first tensor that may join it. ``hold``: a tensor too big for a block and not to be
    cut waits for a later block instead of closing this one; ``uncut``: the second piece of a
    cut that no block took rejoins the first (else it goes last, alone). What is left goes
    into the first block that starts after its release. ``events``: as :func:`_edf_fill`'s.
    ``None`` when the bound has no blocks."""
    key = ("bound-guided", slack)
    if key not in problem.cache:
        problem.cache[key] = _guide(problem, slack)
    guide = problem.cache[key]
    if guide is None:
        return None
    T, windows, ready, tail = guide
    alpha, beta = problem.cost.linear_bound()
    return _edf_fill(problem, windows, T, alpha, beta, fill, ready, tail, hold, uncut, events)


def _guide(problem: Problem, slack: float
           ) -> tuple[float, list[tuple[float, float]], list[float], list[float]] | None:
    """``(T, windows, ready, tail)`` of :func:`bound_guided` at ``slack``: the bound's blocks
    as time windows, and each tensor's release and tail as the bound relaxed them."""
    from ..bounds import nested_bound, nested_config

    nested_bound(problem)
    items, _, T_ok = max(problem.cache["nested_bound"].values(), key=lambda v: v[1])
    T = T_ok * slack
    cfg = nested_config(items, problem.cost.linear_bound()[0], T)
    if cfg is None:
        return None
    A, C = cfg
    R, Q = items.R.tolist(), items.Q.tolist()
    times = [R[a] for a in A] + [T - Q[c] for c in reversed(C)]
    # Each tensor with its item's release and tail: the instance the programme solved.
    ready, tail = [0.0] * problem.n, [0.0] * problem.n
    for k, members in enumerate(items.members):
        for i in members:
            ready[i], tail[i] = R[k], Q[k]
    return T, list(zip(times, times[1:])), ready, tail


def _guided(pool: _Pool) -> None:
    """Step 3: the bound-guided candidates (:func:`bound_guided`): every variant built, the
    distinct ones timed by the closed form (overlap mode, or fence where overlap is not
    planned; without the compute-cost option), the best :data:`GUIDE_KEEP` laid out and
    added."""
    problem = pool.view
    assert problem is not None
    small = problem.n <= FULL_GRID_TENSORS
    ready = np.asarray(problem.ready, dtype=float)
    tail = np.asarray(tails(problem), dtype=float)
    isz = np.asarray(problem.itemsize, dtype=float)
    alpha, beta = problem.cost.linear_bound()
    overlap = Mode.OVERLAP in pool.modes
    seen: dict[tuple, tuple[float, str, list[dict[int, int]]]] = {}
    for slack in GUIDE_SLACK if small else GUIDE_SLACK[:2]:
        built: list[tuple[str, bool, bool, set[str]]] = []
        for fill, hold, uncut in GUIDE_FILLS if small else GUIDE_FILLS[:2]:
            # The same plan as a fill built already whose run never met what its other
            # flags change: not built again.
            if any(f == fill and (h == hold or "hold" not in ev) and (u == uncut or "uncut" not in ev)
                   for f, h, u, ev in built):
                continue
            events: set[str] = set()
            pieces = bound_guided(problem, slack, fill, hold, uncut, events)
            if pieces is None:
                return
            built.append((fill, hold, uncut, events))
            key = tuple(tuple(sorted(c.items())) for c in pieces)
            if key in seen:
                continue
            R = np.array([ready[list(c)].max() for c in pieces])
            Q = np.array([tail[list(c)].max() for c in pieces])
            nb = np.array([float(np.dot(isz[list(c)], list(c.values()))) for c in pieces])
            fin = Scorer.finishes(R, alpha + nb * beta)
            if overlap:
                T = max(problem.B + problem.F, float(fin[-1]), float((fin + Q).max()))
            else:
                T = max(problem.B, float(fin[-1]))
            name = f"bound-guided(slack={slack:g},{fill}{',hold' if hold else ''}{',uncut' if uncut else ''})"
            seen[key] = (T, name, pieces)
    keep = GUIDE_KEEP if small else 1
    for _, name, pieces in sorted(seen.values(), key=lambda v: v[0])[:keep]:
        pool.add(name, *chained_layout(problem, pieces))


def _edf_fill(problem: Problem, windows: Sequence[tuple[float, float]], T: float, alpha: float,
              beta: float, fill: str, ready: Sequence[float], tail: Sequence[float],
              hold: bool = False, uncut: bool = False,
              events: set[str] | None = None) -> list[dict[int, int]]:
    """:func:`bound_guided`'s fill of ``windows`` (the bound's blocks, in time order);
    ``ready`` and ``tail`` per tensor as the bound relaxed them. ``events`` collects
    ``"hold"`` where ``hold`` would have changed the fill and ``"uncut"`` where ``uncut``
    would have (a fill without them is the same plan).

    The fill of the windows (:func:`_edf_place`) does not depend on ``uncut``, which only
    says where the pieces it left go: it is done once per problem and ``(windows, T, fill,
    hold)`` (kept in ``problem.cache``) and copied for each ``uncut``."""
    events = set() if events is None else events
    key = ("edf-place", tuple(windows), T, alpha, beta, fill, hold, id(ready), id(tail))
    hit = problem.cache.get(key)
    if hit is None or hit[0] is not ready or hit[1] is not tail:
        hit = problem.cache[key] = (ready, tail, _edf_place(problem, windows, T, alpha, beta, fill,
                                                             ready, tail, hold))
    placed, starts0, first0, left0, held_event = hit[2]
    if held_event:
        events.add("hold")
    blocks = [dict(c) for c in placed]
    starts, first, left = list(starts0), dict(first0), list(left0)
    n = problem.n
    dtype = problem.dtype
    # Cuts whose second piece found no block: it goes last, alone (or back to the first piece).
    if first:
        events.add("uncut")
    for i, a in first.items():
        if uncut:
            blocks[a][i] += left[i]
        else:
            blocks.append({i: left[i]})
            starts.append(math.inf)
        left[i] = 0
    # The rest: into the first block of its dtype that starts after its release (else the
    # last of its dtype, else a block of its own).
    of_dtype: dict[str, tuple[list[float], list[int]]] = {}
    for b, c in enumerate(blocks):
        at, ids = of_dtype.setdefault(dtype[next(iter(c))], ([], []))
        at.append(starts[b])
        ids.append(b)
    for i in range(n):
        if left[i] <= 0:
            continue
        at, ids = of_dtype.setdefault(dtype[i], ([], []))
        if ids:
            j = bisect_left(at, ready[i])
            blocks[ids[min(j, len(ids) - 1)]][i] = left[i]
        else:
            blocks.append({i: left[i]})
            at.append(ready[i])
            ids.append(len(blocks) - 1)
        left[i] = 0
    return blocks


def _edf_place(problem: Problem, windows: Sequence[tuple[float, float]], T: float, alpha: float,
               beta: float, fill: str, ready: Sequence[float], tail: Sequence[float], hold: bool
               ) -> tuple[list[dict[int, int]], list[float], dict[int, int], list[int], bool]:
    """The fill of ``windows`` of :func:`_edf_fill`, before the pieces it left are placed:
    ``(blocks, starts, first, left, held)``: each block's elements per tensor and its start,
    the cut tensors whose second piece found no block (and the block of the first), the
    elements of each tensor not placed, and whether ``hold`` would have changed the fill."""
    ef = _EdfPlace(problem, T, fill, ready, tail, hold)
    for s, f in windows:
        cap = (f - s - alpha) / beta if beta > 0 else math.inf
        if cap <= 0:
            continue
        ef.window(s, f, cap)
    return ef.blocks, ef.starts, ef.first, ef.left, "hold" in ef.events


class _EdfPlace:
    """The state of :func:`_edf_place`: released tensors in a heap by deadline (largest tail
    first), the elements left of each, the blocks filled so far, and the cut tensors, whose
    blocks are linked (a union-find) so that no chain of cuts closes a cycle."""

    def __init__(self, problem: Problem, T: float, fill: str, ready: Sequence[float],
                 tail: Sequence[float], hold: bool):
        self.T, self.fill, self.ready, self.tail, self.hold = T, fill, ready, tail, hold
        self.isz, self.dtype = problem.itemsize, problem.dtype
        self.events: set[str] = set()
        self.left = list(problem.numel)            # elements not yet placed
        self.first: dict[int, int] = {}            # a cut tensor -> block of its first piece
        self.comp: list[int] = []                  # union-find over blocks linked by cuts
        self.blocks: list[dict[int, int]] = []
        self.starts: list[float] = []
        self.rel = sorted(range(problem.n), key=lambda i: ready[i])
        self.ptr = 0
        self.heap: list[tuple[float, float, int]] = []
        self.eps = 1e-9 * max(1.0, T)

    def root(self, b: int) -> int:
        comp = self.comp
        while comp[b] != b:
            comp[b] = comp[comp[b]]
            b = comp[b]
        return b

    def window(self, s: float, f: float, cap: float) -> None:
        """Fill the window ``[s, f)``, ``cap`` bytes after its alpha: release the tensors
        ready by ``s``, take them by deadline (:meth:`_take`), and where nothing fits, let
        the first held tensor that may join overflow the block (:meth:`_overflow`)."""
        ready, rel, n = self.ready, self.rel, len(self.rel)
        while self.ptr < n and ready[rel[self.ptr]] <= s + self.eps:
            i = rel[self.ptr]
            heapq.heappush(self.heap, (-self.tail[i], -ready[i], i))
            self.ptr += 1
        b = len(self.blocks)
        self.comp.append(b)
        content, dt, held = self._take(b, f, cap)
        if not content:
            self._overflow(b, dt, content, held)
        for h in held:
            heapq.heappush(self.heap, h)
        if content:
            self.blocks.append(content)
            self.starts.append(s)
        else:
            self.comp.pop()

    def _take(self, b: int, f: float, cap: float
              ) -> tuple[dict[int, int], str | None, list[tuple[float, float, int]]]:
        """Block ``b``'s content, taken from the heap by deadline until ``cap`` bytes are
        filled or a tensor is cut (one dtype; a cut tensor's second piece may not join a
        block its chain already holds, nor a block linked twice): ``(content, dtype, held)``,
        ``held`` what was passed over, to go back on the heap."""
        heap, tail, left, isz, dtype, first = (self.heap, self.tail, self.left, self.isz,
                                               self.dtype, self.first)
        fill, root = self.fill, self.root
        content: dict[int, int] = {}
        deg = 0
        dt = None
        held: list[tuple[float, float, int]] = []
        while heap:
            top = heapq.heappop(heap)
            i = top[2]
            if tail[i] > self.T - f + self.eps:
                continue                           # past its deadline here, and later too
            if dt is None:
                dt = dtype[i]
            cont = i in first
            if dtype[i] != dt or (cont and (deg >= 2 or root(first[i]) == root(b))):
                held.append(top)
                continue
            need = left[i] * isz[i]
            k = int(cap // isz[i])
            if need <= cap * (1 + 1e-9) or (fill == "over" and need <= 2 * cap):
                take = left[i]
            elif fill == "split" and not cont and deg < 2 and 0 < k < left[i]:
                take = k
            elif fill == "skip" or (fill == "split" and self.hold and k > 0):
                held.append(top)                   # too big here (and not to be cut again)
                continue
            else:
                if fill == "split" and k > 0:
                    self.events.add("hold")
                heapq.heappush(heap, top)
                break
            content[i] = take
            cap -= take * isz[i]
            left[i] -= take
            if cont:                               # the second piece of a cut tensor
                self.comp[root(first.pop(i))] = root(b)
                deg += 1
            if left[i]:                            # cut here: the rest goes to a later block
                first[i] = b
                deg += 1
                heapq.heappush(heap, top)
                break
            if cap <= 0:
                break
        return content, dt, held

    def _overflow(self, b: int, dt: str | None, content: dict[int, int],
                  held: list[tuple[float, float, int]]) -> None:
        """Nothing fits block ``b``: the first held tensor that may join takes it whole."""
        first = self.first
        for j, h in enumerate(held):
            i = h[2]
            if self.dtype[i] == dt and (i not in first or self.root(first[i]) != self.root(b)):
                content[i] = self.left[i]
                self.left[i] = 0
                if i in first:
                    self.comp[self.root(first.pop(i))] = self.root(b)
                del held[j]
                break


def chained_layout(problem: Problem, blocks: list[dict[int, int]]) -> tuple[Layout, list[Block]]:
    """A layout (one buffer per dtype) in which each block of ``blocks`` (elements of each
    tensor, in issue order) is one element range: blocks that share a cut tensor are chained,
    the tensor's two pieces meeting at the chain's link."""
    where: dict[int, list[int]] = {}
    for b, content in enumerate(blocks):
        for i in content:
            where.setdefault(i, []).append(b)
    links: dict[int, list[tuple[int, int]]] = {b: [] for b in range(len(blocks))}
    for i, bs in where.items():
        if len(bs) == 2:
            links[bs[0]].append((bs[1], i))
            links[bs[1]].append((bs[0], i))
    seen: set[int] = set()
    per: dict[str, list[tuple[int, int, int]]] = {}        # dtype -> (tensor, block, elements)
    for b0 in range(len(blocks)):
        if b0 in seen or len(links[b0]) == 2:
            continue
        chain: list[tuple[int, int | None, int | None]] = []
        x: int | None = b0
        via: int | None = None
        while x is not None:
            seen.add(x)
            out = next(((y, i) for y, i in links[x] if y not in seen), None)
            chain.append((x, via, None if out is None else out[1]))
            x, via = (None, None) if out is None else out
        seq = per.setdefault(problem.dtype[next(iter(blocks[b0]))], [])
        for x, t_in, t_out in chain:
            c = blocks[x]
            if t_in is not None:
                seq.append((t_in, x, c[t_in]))
            seq.extend((i, x, e) for i, e in c.items() if i != t_in and i != t_out)
            if t_out is not None:
                seq.append((t_out, x, c[t_out]))
    assert len(seen) == len(blocks), "a cycle of cut tensors"
    dts = list(per)
    buffers = []
    for dt in dts:
        names: list[int] = []
        for i, _, _ in per[dt]:
            if not names or names[-1] != i:
                names.append(i)
        buffers.append(Buffer(dt, tuple(problem.names[i] for i in names)))
    layout = problem.layout(buffers)
    span: dict[int, tuple[int, int, int]] = {}
    for bi, dt in enumerate(dts):
        off = 0
        for _, x, e in per[dt]:
            lo = span[x][1] if x in span else off
            span[x] = (bi, lo, off + e)
            off += e
    return layout, [Block(*span[b]) for b in range(len(blocks))]


def cut_grid(problem: Problem, u0: float) -> list[float]:
    """:data:`CUT_GRID` without the cut sizes that no tensor can take (a cut leaves at least
    ``cut_min`` bytes on each side, so ``cut_min >= largest / 2`` never cuts: same as inf)."""
    largest = max(problem.nbytes(i) for i in range(problem.n))
    return [c for c in CUT_GRID if c == math.inf or 2 * c * u0 < largest]


def two_phase(problem: Problem, layout: Layout, tail: Sequence[float], n_boundaries: int = 24,
              incumbent: float = math.inf) -> list[list[Block]]:
    """Bucketed schedules in two phases, each optimal by dynamic programming for its part.

    Tensors in ready order ``0..N-1`` (so fused runs of one dtype are contiguous in the default
    layout). Phase 1 sends ``[0, x)`` in ready order, fused into runs; phase 2 sends ``[x, N)``
    in *reverse* ready order (input side first), fused into runs. Phase 1 minimises the
    channel's finish time, ``f(j) = min_i max(f(i), ready_{j-1}) + c(i, j)``, in O(N log N):
    the ``i`` with ``f(i) <= ready_{j-1}`` only grow with j (the best of them is the last), the
    others are kept in a heap by ``f(i) - P_i``. Once the first phase-2 block (which holds the
    last-ready tensor) starts, every gradient is final, so phase 2's contribution is
    ``start + D_x(N)`` with

        D_x(y) = min_z  c(z, y) + max(Q(z, y), D_x(z)),   D_x(x) = 0,

    where block ``[z, y)`` goes first and ``Q`` is its largest tail, in O(N log N) by
    :func:`_phase2`. Returns the schedule with every tensor in phase 1 (the fastest fence
    schedule of whole tensors in ready order), then one per tried boundary ``x`` (around where
    phase 1 meets the end of backward, plus a spread), skipping a boundary whose schedule
    provably takes at least ``incumbent`` (its phase-1 blocks' finish plus tail, or phase 2's
    start plus one alpha, its bytes and, for the last-ready tensor, its tail). Both
    programmes cost a run on the cost model's linear bound: they are optimal for a linear
    model (every candidate is scored by the one scorer in any case).
    """
    order = problem.ready_order()
    N = len(order)
    pos = layout.pos
    alpha, beta = problem.cost.linear_bound()
    R = [problem.ready[i] for i in order]
    Q = [tail[i] for i in order]
    Qa = np.asarray(Q)
    w = np.array([problem.nbytes(i) * beta for i in order])
    Pa = np.concatenate([[0.0], np.cumsum(w)])
    P = Pa.tolist()
    buf = [pos[i][0] for i in order]
    run_lo = [0] * N  # first index of the single-buffer run that ends at j
    for j in range(1, N):
        run_lo[j] = run_lo[j - 1] if buf[j] == buf[j - 1] else j
    # Phase 1: f(j) = alpha + P_j + min_i (max(f(i), R_{j-1}) - P_i), i in [run_lo[j-1], j).
    f, arg = min_finish(R, P, alpha, run_lo)
    fa = np.asarray(f)

    def runs_to_blocks(runs: list[tuple[int, int]]) -> list[Block]:
        return [Block(buf[i], pos[order[i]][1], pos[order[j - 1]][2]) for i, j in runs]

    def phase1_runs(x: int) -> list[tuple[int, int]]:
        runs, j = [], x
        while j > 0:
            runs.append((arg[j], j))
            j = arg[j]
        runs.reverse()
        return runs

    out = [runs_to_blocks(phase1_runs(N))]
    x0 = int(np.searchsorted(fa, R[-1], side="right")) - 1
    xs = set(int(v) for v in np.linspace(0, N - 1, max(n_boundaries // 2, 2)))
    xs.update(range(max(0, x0 - n_boundaries // 4), min(N - 1, x0 + n_boundaries // 4) + 1))
    Rl = R[-1]
    for x in sorted(xs):
        runs1 = phase1_runs(x)
        start2 = max(f[x], Rl)
        worst1 = max((f[j] + float(Qa[i:j].max()) for i, j in runs1), default=-math.inf)
        if max(worst1, start2 + alpha + max(P[N] - P[x], float(w[-1] + Qa[-1]))) >= incumbent:
            continue
        D, darg = _phase2(x, N, P, Q, run_lo, alpha)
        runs2, y = [], N
        while y > x:
            runs2.append((darg[y], y))
            y = darg[y]
        out.append(runs_to_blocks(runs1) + runs_to_blocks(runs2))
    return out


def _phase2(x: int, N: int, P: Sequence[float], Q: Sequence[float], run_lo: Sequence[int],
            alpha: float) -> tuple[list[float], list[int]]:
    """Phase 2 of :func:`two_phase` for boundary ``x``: ``D(y)`` and the ``z`` that attains it,
    for ``y`` in ``(x, N]``, ``z`` in ``[max(x, run_lo[y-1]), y)``.

    ``D`` is nondecreasing (dropping a tensor never slows the rest) and ``Q(z, y)`` falls as
    ``z`` rises, so the ``z`` with ``Q(z, y) >= D(z)`` are a prefix ending at ``z*``, which
    only moves right as ``y`` grows. Beyond ``z*`` the term is ``D(z) - P_z``, a sliding
    window minimum (monotone deque). Up to ``z*`` it is ``Q(z, y) - P_z``: over the stack of
    suffix maxima of ``Q`` (positions whose ``Q`` exceeds every later one, up to ``y - 1``)
    that value falls from bottom to top (``Q`` falls, ``P`` rises), so the best ``z`` is
    ``z*`` itself, with ``Q(z*, y)`` read from the stack by bisection.
    """
    D = [0.0] * (N + 1)
    darg = [0] * (N + 1)
    stack: list[int] = []          # suffix maxima of Q[.. y-1], Q strictly falling upward
    dq: deque[int] = deque()       # z beyond z*, D(z) - P_z rising
    zs = x - 1
    for y in range(x + 1, N + 1):
        j = y - 1
        q = Q[j]
        while stack and Q[stack[-1]] <= q:
            stack.pop()
        stack.append(j)
        lo = x if x > run_lo[j] else run_lo[j]
        if zs < lo - 1:
            zs = lo - 1
        while zs + 1 < y and Q[stack[bisect_left(stack, zs + 1)]] >= D[zs + 1]:
            zs += 1
        g = D[j] - P[j]
        while dq and D[dq[-1]] - P[dq[-1]] > g:    # ties keep the smaller z
            dq.pop()
        dq.append(j)
        first = zs + 1 if zs + 1 > lo else lo
        while dq and dq[0] < first:
            dq.popleft()
        best, arg = math.inf, -1
        if dq:
            best, arg = D[dq[0]] - P[dq[0]], dq[0]
        if zs >= lo:
            v = Q[stack[bisect_left(stack, zs)]] - P[zs]
            if v <= best:                               # ties: the smaller z
                best, arg = v, zs
        D[y] = alpha + P[y] + best
        darg[y] = arg
    return D, darg


def _critical(sc: Scorer, layout: Layout, blocks: list[Block], st: Stats, cur: float,
              eps: float = 1e-9) -> tuple[list[Block], Stats, float] | None:
    """Overlap-mode moves aimed at the block that sets T (the largest ``finish + tail``).

    *Hoist*: issue it before one of the blocks that hold the channel when it becomes ready.
    *Preempt*: cut such an earlier, smaller-tail block at the moment the critical block
    becomes ready and send the rest after it — Jackson's preemption, paid with one alpha.
    Returns the best improving move, or ``None``. The cut point is where the cost model's
    linear bound puts the end of the first piece.
    """
    alpha, beta = sc.cost.linear_bound()
    R, C, Q = st.R, st.C, st.Q
    fin = sc.finishes(R, C)
    start = fin - C
    c = int(np.argmax(fin + Q))
    if fin[c] + Q[c] < cur - eps:
        return None  # T is set by the compute floor or the last finish, not by a tail
    # Blocks before c still on the wire when c became ready, latest first.
    # (finishes grow along the issue order, so they are the blocks just before c).
    busy = [k for k in range(c - 1, max(c - 17, -1), -1) if fin[k] > R[c]]
    best: tuple[list[Block], Stats, float] | None = None
    for k in busy:
        order = blocks[:k] + [blocks[c]] + blocks[k:c] + blocks[c + 1:]
        st2 = st.take(np.r_[0:k, c, k:c, c + 1:len(st)])
        v = sc.score(st2)
        if v < cur - eps and (best is None or v < best[2]):
            best = (order, st2, v)
        a = blocks[k]
        if Q[k] >= Q[c] or start[k] >= R[c]:
            continue
        per_el = beta * layout.itemsize[a.buffer]
        cut = a.start + int((R[c] - start[k] - alpha) / per_el) if per_el > 0 else a.start
        if not a.start < cut < a.end:
            continue
        k1, k2 = Block(a.buffer, a.start, cut), Block(a.buffer, cut, a.end)
        order = blocks[:k] + [k1] + blocks[k + 1:c + 1] + [k2] + blocks[c + 1:]
        pair = sc.stats([k1, k2])
        st2 = Stats.concat([st.take(np.r_[0:k]), pair.take([0]), st.take(np.r_[k + 1:c + 1]),
                            pair.take([1]), st.take(np.r_[c + 1:len(st)])])
        v = sc.score(st2)
        if v < cur - eps and (best is None or v < best[2]):
            best = (order, st2, v)
    return best


def _window(sc: Scorer, st: Stats, mode: Mode) -> tuple[int, int]:
    """Positions ``[a, b]`` where a move can lower T: the stretch of channel, busy without a
    break, that ends at the block setting T (its finish plus tail, or the last finish). Moves
    before it cannot make that block finish earlier, and moves after it cannot touch it."""
    fin = sc.finishes(st.R, st.C)
    K = len(st)
    if mode == Mode.OVERLAP:
        terms = fin + st.Q
        c = int(np.argmax(terms))
        if terms[c] < fin[-1]:
            c = K - 1
    else:
        c = K - 1
    # Block j + 1 waited for its gradients (beyond rounding: a tie counts as busy, which only
    # widens the stretch).
    tol = 1e-9 * max(1.0, float(fin[-1]))
    idle = np.flatnonzero(st.R[1:c + 1] > fin[:c] + tol)
    a = int(idle[-1]) + 1 if len(idle) else 0
    return max(a - 1, 0), c


def _splits(layout: Layout, k: Block) -> list[tuple[Block, Block]]:
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


def improve(problem: Problem, layout: Layout, blocks: list[Block], deadline: float,
            mode: Mode = Mode.OVERLAP, scorer: Scorer | None = None) -> list[Block]:
    """Local search in ``mode``: moves on the critical block (:func:`_critical`, overlap mode),
    then a first-improvement sweep of merge / swap / split over consecutive blocks within
    :func:`_window` (everywhere with the compute-cost option or the updates at the gates,
    where a move anywhere can change T); repeated to a fixed point or the deadline (on
    :func:`clock`)."""
    sc = scorer if scorer is not None else scorer_for(problem, layout)
    blocks = list(blocks)
    st = sc.stats(blocks)
    cur = sc.score(st, mode)
    eps = 1e-9
    # a move anywhere can change T with the compute-cost option, the updates at the gates, or
    # host cost on the critical path (a block fewer issues every later one sooner)
    every = (problem.charges_cpu or problem.update_rule == UpdateRule.GATE
             or (problem.charges_host and not problem.host_hidden))
    floor = problem.B + problem.F + (sum(problem.update) if mode == Mode.FENCE else 0.0)
    if not every and cur <= floor + eps:
        return blocks
    improved = True
    while improved and clock() < deadline:
        improved = False
        while mode == Mode.OVERLAP and clock() < deadline:
            move = _critical(sc, layout, blocks, st, cur)
            if move is None:
                break
            blocks, st, cur = move
            improved = True
        a, b = (0, len(blocks) - 1) if every else _window(sc, st, mode)
        k = a
        while k <= min(b, len(blocks) - 1) and clock() < deadline:
            moved = (_pair_move(sc, blocks, st, k, mode, cur - eps)
                     or _split_move(sc, layout, blocks, st, k, mode, cur - eps))
            if moved:
                st, cur = moved
                improved = True
                if not every:
                    a, b = _window(sc, st, mode)
                    k = max(min(k - 1, b), a)
                else:
                    k = max(k - 1, 0)
                    b = len(blocks) - 1
            else:
                k += 1
    return blocks


def _pair_move(sc: Scorer, blocks: list[Block], st: Stats, k: int, mode: Mode,
               below: float) -> tuple[Stats, float] | None:
    """:func:`improve`'s moves on blocks ``k`` and ``k + 1``: merge them (contiguous in one
    buffer, either side), else swap them; the first that scores below ``below`` is made on
    ``blocks`` and returns ``(stats, time)``."""
    if k + 1 >= len(blocks):
        return None
    blk, nxt = blocks[k], blocks[k + 1]
    if blk.buffer == nxt.buffer and (blk.end == nxt.start or nxt.end == blk.start):
        m = Block(blk.buffer, min(blk.start, nxt.start), max(blk.end, nxt.end))
        st2 = st.splice(k, k + 2, sc.stats([m]))
        v = sc.score(st2, mode)
        if v < below:
            blocks[k:k + 2] = [m]
            return st2, v
    st2 = st.take(np.r_[0:k, k + 1, k, k + 2:len(st)])
    v = sc.score(st2, mode)
    if v < below:
        blocks[k], blocks[k + 1] = nxt, blk
        return st2, v
    return None


def _split_move(sc: Scorer, layout: Layout, blocks: list[Block], st: Stats, k: int, mode: Mode,
                below: float) -> tuple[Stats, float] | None:
    """:func:`improve`'s split of block ``k`` (at the cuts of :func:`_splits`, the two pieces
    in either order where the second has the larger tail); the first that scores below
    ``below`` is made on ``blocks`` and returns ``(stats, time)``."""
    for x, y in _splits(layout, blocks[k]):
        pair = sc.stats([x, y])
        options = [(x, y, pair)]
        if pair.Q[1] > pair.Q[0]:
            options.append((y, x, pair.take([1, 0])))
        for first, second, ps in options:
            st2 = st.splice(k, k + 1, ps)
            v = sc.score(st2, mode)
            if v < below:
                blocks[k:k + 1] = [first, second]
                return st2, v
    return None


@dataclass(slots=True)
class Candidate:
    """One schedule ``best`` weighs, with its time in one mode."""

    T: float
    mode: Mode
    origin: str
    """Where it came from (``seed:ddp``, ``construct(cut=1,fuse=4)``, ``two-phase#3`` ...)."""
    layout: Layout
    blocks: list[Block]
    fuse_cap: float | None = None
    """The fusion cap it was constructed with (units of alpha/beta bytes; ``None``: not a
    construction)."""
    runner: Runner = Runner.RUNTIME
    """What runs it: the runtime, or torch DDP with these blocks as its buckets (fence mode,
    flat rings, DDP's host cost)."""
    cut_pieces: tuple[int, ...] | None = None
    """Compiled profiles: the pieces :attr:`T` cuts before (the runtime's plans)."""


def planning_view(problem: Problem) -> Problem:
    """The problem ``best`` builds its candidates on: with host cost, the runtime's host floor
    (:meth:`~usbyte_opt.planning.problem.Problem.host_floor`: each release and backward's end
    raised by the hooks run by then and one issue), where a runtime plan's blocks can start;
    else the problem itself. The constructions, two-phase programmes and bound-guided blocks
    time their blocks from the releases they are given: on the raw ready times they would
    plan for a channel free before the runtime can issue anything (at 11,691 tensors, 6% slower
    than planned on the floor). Its layouts hold the same tensors in the same places."""
    if problem.host_line(Runner.RUNTIME) is None:
        return problem
    return problem.host_floor(Runner.RUNTIME)


def flat(problem: Problem) -> Problem:
    """``problem`` on flat rings only (what torch DDP runs on several nodes); kept in its cache."""
    if not isinstance(problem.cost, HierCost):
        return problem
    hit = problem.cache.get("flat")
    if hit is None:
        hit = problem.cache["flat"] = problem.with_cost(problem.cost.flat_only())
    return hit


@dataclass(slots=True)
class _Pool:
    """The candidates of one plan: each schedule scored in every chosen mode on the runtime,
    and, where torch DDP can run it (:func:`usbyte_opt.planning.ddp.expressible`), in fence
    mode on DDP (:meth:`add_ddp`)."""

    problem: Problem
    modes: tuple[Mode, ...]
    items: list[Candidate] = field(default_factory=list)
    view: Problem | None = None
    """What the constructions are built on (:func:`planning_view`); every candidate is scored
    on :attr:`problem`."""
    ddp: list[Candidate] = field(default_factory=list)
    """The candidates run by torch DDP (not searched: the local search's moves leave what DDP
    can express)."""

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = planning_view(self.problem)

    def add(self, origin: str, lay: Layout, blocks: list[Block], fuse_cap: float | None = None) -> None:
        if self.view is not None and self.view is not self.problem and lay is self.view.layout():
            lay = self.problem.layout()      # the view's default layout: the same places
        s = scorer_for(self.problem, lay)
        st = s.stats(blocks)
        for mode in self.modes:
            self.items.append(Candidate(s.score(st, mode), mode, origin, lay, list(blocks), fuse_cap))

    def add_ddp(self, origin: str, lay: Layout, blocks: Sequence[Block], check: bool = True) -> None:
        """``blocks`` as torch DDP's buckets, scored in fence mode at DDP's host cost on flat
        rings, if fence mode is planned and (with ``check``) DDP can express them."""
        if Mode.FENCE not in self.modes or (check and not expressible(self.problem, lay, blocks)):
            return
        pb = flat(self.problem)
        s = scorer_for(pb, lay)
        self.ddp.append(Candidate(s.score(s.stats(blocks), Mode.FENCE, Runner.DDP), Mode.FENCE,
                                  f"ddp:{origin}", lay, list(blocks), runner=Runner.DDP))


@register("best")
def plan(problem: Problem, seeds: Sequence[Plan] | None = None, time_budget_s: float = 0.6,
         exact_max_tensors: int = 6, lower_bound_ms: float | None = None,
         modes: Sequence[Mode | str] = MODES) -> Plan:
    """Plan with fusion, partition, order and mode chosen together (see module docstring).

    Args:
        seeds: plans of other strategies to start from; without them the cheap baselines
            (wfbp, ddp, ddp-tuned, mgwfbp) are computed here.
        time_budget_s: budget of the local search, seconds of this process's processor time
            (:func:`clock`; it stops earlier at a fixed point).
        exact_max_tensors: also solve the exact unit-grid MILP up to this many tensors.
        lower_bound_ms: the problem's lower bound when the caller has it (else computed).
        modes: the modes to plan in (default both; ``(Mode.FENCE,)`` for a run that waits for
            every block at the end of backward, as a trainer with DDP's gradient contract).

    Returns:
        A :class:`Plan` in the faster mode; ``info`` holds the lower bound, the gap and
        where the winning candidate came from.
    """
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes: expected a non-empty subset of {[str(m) for m in MODES]}, "
                         f"got {[str(m) for m in modes]}")
    t0 = time.perf_counter()
    pool = _Pool(problem, tuple(Mode(m) for m in modes))
    _seeded(pool, seeds)
    _constructed(pool)
    if problem.n <= exact_max_tensors:
        from ..exact import solve_exact

        res = solve_exact(problem, problem.layout(), units_per_tensor=1, time_limit_s=2.0)
        if res is not None:
            pool.add("exact-milp", problem.layout(), res.blocks)
    candidates = pool.items
    candidates.sort(key=lambda c: (c.T, c.mode != Mode.OVERLAP))
    for c in _distinct(candidates):
        pool.add_ddp(c.origin, c.layout, c.blocks)
    finals = _searched(problem, candidates, pool.modes, time_budget_s)
    for c in _distinct(finals):
        pool.add_ddp(c.origin, c.layout, c.blocks)
    finals += pool.ddp
    if problem.compiled:
        finals = _compiled_finals(problem, candidates, finals)
    # The fastest; overlap mode on a tie (within rounding: the two closed forms add the same
    # terms in another order), then the runtime.
    T_min = min(c.T for c in finals)
    finals.sort(key=lambda c: (c.T > T_min * (1 + 1e-12) + 1e-12, c.mode != Mode.OVERLAP,
                               c.runner != Runner.RUNTIME, c.T))
    win = finals[0]
    lb = lower_bound(problem) if lower_bound_ms is None else lower_bound_ms
    return Plan(win.layout, win.blocks, win.mode, cut_pieces=win.cut_pieces, info={
        "strategy": "best",
        "runner": str(win.runner),
        "origin": win.origin,
        "start_ms": candidates[0].T,
        "iteration_ms": win.T,
        "lower_bound_ms": lb,
        "gap": max(0.0, (win.T - lb) / lb) if lb > 0 else 0.0,
        "candidates": len(candidates) // len(pool.modes),
        "solve_s": time.perf_counter() - t0,
    }, runner=win.runner)


#: Compiled profiles (:mod:`usbyte_opt.planning.compiled`): how many of the fastest searched
#: candidates, and of the fastest before the search, are weighed again with their cuts' costs.
COMPILED_RESCORE = 6


def _compiled_finals(problem: Problem, candidates: Sequence[Candidate], finals: list[Candidate]
                     ) -> list[Candidate]:
    """The candidates as they run compiled: the fastest :data:`COMPILED_RESCORE` searched and
    unsearched runtime plans and the other strategies' (the seeds), each at the cuts that
    :func:`~usbyte_opt.planning.compiled.choose_cuts` keeps, and torch DDP's, cut at every
    bucket as DDPOptimizer cuts."""
    from ..compiled import choose_cuts, compiled_time

    runtime = sorted((c for c in finals if c.runner is Runner.RUNTIME), key=lambda c: c.T)
    pre = sorted(candidates, key=lambda c: c.T)
    # The other strategies' plans (the seeds) always: each is predicted with its cuts too.
    seeds = [c for c in _distinct(pre) if c.origin.startswith("seed:")]
    chosen = _distinct(runtime)[:COMPILED_RESCORE] + _distinct(pre)[:COMPILED_RESCORE] + seeds
    modes = sorted({x.mode for x in finals if x.runner is Runner.RUNTIME}, key=str)
    out: list[Candidate] = []
    seen: set[tuple[int, int, str]] = set()
    for c in chosen:
        for mode in modes:
            key = (id(c.layout), id(c.blocks), str(mode))
            if key not in seen:
                seen.add(key)
                keep, T = choose_cuts(problem, c.layout, c.blocks, mode, Runner.RUNTIME)
                out.append(dataclasses.replace(c, T=T, mode=mode, cut_pieces=keep))
    pb = flat(problem)
    out += [dataclasses.replace(c, T=compiled_time(pb, c.layout, c.blocks, Mode.FENCE, Runner.DDP))
            for c in finals if c.runner is Runner.DDP]
    return out


def _distinct(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per schedule (the pool scores each in every mode)."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for c in cands:
        key = (c.origin, id(c.layout), len(c.blocks))
        if key not in seen and c.runner is Runner.RUNTIME:
            seen.add(key)
            out.append(c)
    return out


def _seeded(pool: _Pool, seeds: Sequence[Plan] | None) -> None:
    """Step 4: the plans of other strategies (without them, the cheap baselines)."""
    if seeds is None:
        seeds = []
        for name in CHEAP_SEEDS:
            if name in STRATEGIES:
                try:
                    seeds.append(STRATEGIES[name].plan(pool.problem))
                except NotApplicable:      # e.g. ddp-tuned on several dtypes
                    pass
    for s in seeds:
        name = f"seed:{s.info.get('strategy', '?')}"
        pool.add(name, s.layout, s.blocks)
        if s.runner is Runner.DDP and s.mode == Mode.FENCE:
            # what torch DDP runs (stock DDP's buckets, ddp-tuned's), as it runs them, where a
            # schedule can give DDP these buckets (one dtype: not DDP's own buckets of several)
            if expressible(pool.problem, s.layout, s.blocks, ties=False):
                pool.add_ddp(name, s.layout, s.blocks, check=False)


def prepare(problem: Problem, modes: Sequence[Mode | str] = MODES) -> None:
    """Build now the candidates of ``best`` that its seeds do not change (the constructions of
    step 1, the bound-guided ones of step 3) and keep them in ``problem.cache``, where
    :func:`plan` takes them from: what the planner does while another process plans the
    seeds (:func:`usbyte_opt.planning.planner.compare` with ``workers=2``). Without it,
    :func:`plan` builds them itself; the plan is the same."""
    ms = tuple(Mode(m) for m in modes)
    key = ("best-prepared", ms)
    if key not in problem.cache:
        built, guided = _Pool(problem, ms), _Pool(problem, ms)
        _constructions(built)
        _guided(guided)
        problem.cache[key] = (built.items, guided.items)


def _constructed(pool: _Pool) -> None:
    """Steps 1 to 3 in the pool's order: the constructions (:func:`_constructions`), the
    two-phase candidates (whose pruning reads the seeds), the bound-guided ones
    (:func:`_guided`); the first and the last from :func:`prepare` where it ran."""
    problem, view = pool.problem, pool.view
    assert view is not None
    prepared = problem.cache.get(("best-prepared", pool.modes))
    if prepared is None:
        _constructions(pool)
    else:
        pool.items.extend(prepared[0])
    layout = problem.layout()
    tail = tails(view)
    incumbent = min(c.T for c in pool.items)
    bounds_tried = 24 if problem.n <= FULL_GRID_TENSORS else 8
    for i, blocks in enumerate(two_phase(view, view.layout(), tail, bounds_tried, incumbent)):
        pool.add("fence-dp" if i == 0 else f"two-phase#{i}", layout, blocks)
    if prepared is None:
        _guided(pool)
    else:
        pool.items.extend(prepared[1])


def _constructions(pool: _Pool) -> None:
    """Step 1: the alpha-aware Jackson rule over the ``(cut_min, fuse_cap)`` grid, in units of
    the bytes one alpha carries on the cost model's linear bound."""
    problem = pool.view
    assert problem is not None
    layout = problem.layout()
    tail = tails(problem)
    alpha, beta = problem.cost.linear_bound()
    u0 = alpha / beta
    if u0 <= 0:
        u0 = max(sum(problem.nbytes(i) for i in range(problem.n)) / (10 * problem.n), 1.0)
    cuts = cut_grid(problem, u0)
    if problem.n <= FULL_GRID_TENSORS:
        grid = [(c, f) for c in cuts for f in FUSE_GRID]
    else:  # the fusion caps without cuts, then the cuts at the best cap
        grid = [(math.inf, f) for f in FUSE_GRID]
    tried = set()
    for cut, fuse in grid:
        tried.add((cut, fuse))
        pool.add(f"construct(cut={cut:g},fuse={fuse:g})", layout,
                 construct(problem, layout, tail, cut * u0, fuse * u0), fuse)
    if problem.n > FULL_GRID_TENSORS:
        f_best = min((c for c in pool.items if c.fuse_cap is not None), key=lambda c: c.T).fuse_cap
        assert f_best is not None
        for cut in cuts:
            if (cut, f_best) not in tried:
                pool.add(f"construct(cut={cut:g},fuse={f_best:g})", layout,
                         construct(problem, layout, tail, cut * u0, f_best * u0), f_best)


def _searched(problem: Problem, candidates: list[Candidate], modes: tuple[Mode, ...],
              time_budget_s: float) -> list[Candidate]:
    """Step 6: local search from the best few candidates (``candidates`` sorted, best first;
    ties and near-ties often lead to different local optima) and, with the compute-cost
    option, the best of the other mode, each in turn within the time budget; every result
    scored in every mode."""
    mode = candidates[0].mode
    starts = [c for c in candidates if c.mode == mode][:STARTS]
    if all(c.origin.startswith("bound-guided") for c in starts):
        # and the best of the other families (on their own layouts), whose search may win
        other = next((c for c in candidates if c.mode == mode
                      and not c.origin.startswith("bound-guided")), None)
        if other is not None:
            starts.append(other)
    if problem.charges_cpu:
        other = next((c for c in candidates if c.mode != mode), None)
        if other is not None:
            starts.insert(1, other)
    finals = []
    deadline = clock() + time_budget_s
    for j, c in enumerate(starts):
        if j and clock() >= deadline:
            break
        scorer = scorer_for(problem, c.layout)
        blocks = improve(problem, c.layout, c.blocks, deadline, c.mode, scorer)
        st = scorer.stats(blocks)
        for m in modes:    # the search's mode, or the other if these blocks run faster so
            finals.append(Candidate(scorer.score(st, m), m, c.origin, c.layout, blocks))
    return finals
