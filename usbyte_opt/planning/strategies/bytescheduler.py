"""ByteScheduler: equal partitions, forward-order priority, credit-based dispatch; tuned P and C.

Peng et al., "A Generic Communication Scheduler for Distributed DNN Training Acceleration",
SOSP 2019; the open-source core is ``bytescheduler/common/bytecore.py`` in bytedance/byteps.
What this module reproduces, in ByteScheduler's own units:

* **Partition** ``P`` is a number of *elements* ("the number of parameters",
  ``BYTESCHEDULER_PARTITION``). A tensor larger than ``P`` is cut into ``ceil(numel / P)``
  pieces of whole rows (first dimension), as even as rows allow: ``rows // n`` rows each, the
  last ``rows % n`` pieces one row more, and never more pieces than rows.
* **Priority** is forward order (input side first): a tensor's rank in the need order, then the
  partition index (ByteScheduler gives a child ``parent_priority * 1000 + i``).
* **Credit** ``C`` is also in elements ("the max number of unacknowledged parameters",
  ``BYTESCHEDULER_CREDIT``). The scheduler loop pops the highest-priority *ready* partition
  whenever the credit is positive, subtracts its size (so the credit may go negative by less
  than one partition), and hands it to the communication engine; the credit comes back, capped
  at ``C``, when that partition's all-reduce finishes.
* **Tuning** ranges are those of ByteScheduler's auto-tuner for all-reduce (``tuner.py``,
  in millions of parameters): partition 2–32 M, credit 4–64 M. ByteScheduler searches them
  with Bayesian optimisation on measured step times; here the simulator is cheap and exact for
  the model, so a log grid (factor sqrt 2, 9 x 9 points) is searched exhaustively.

**Credit on a single channel.** docs/design.md §2.4 has one collective at a time, in issue
order, like
one NCCL communicator. Partitions handed to the engine run first-in first-out, so the *issue
order* is the order in which the credit loop dispatches them, and the credit bounds the elements
dispatched but not yet finished: the one on the wire plus those queued behind it. With a credit
of one partition the queue holds nothing extra, and a high-priority partition that becomes
ready later overtakes every lower-priority one still waiting in the priority queue; a large
credit dispatches partitions as soon as they are ready (ready order, FIFO). The replay is
event-driven over the profile's ready times and the finish times it computes; a partition
never starts later than ``max(its ready, previous finish)``: when the channel is idle nothing
is outstanding, the full credit is back and anything ready is dispatched at once. So the
replayed times equal the simulator's for that issue order, and the plan is then scored by the
one scorer (:class:`usbyte_opt.planning.fastsim.Scorer`, with the profile's compute-cost option when it
has one). Overlap mode: ByteScheduler lets the forward pass of the next iteration start before
all communication ends. The grid search skips a partition size when a lower bound on every
issue order of its partitions (:func:`_lower`) is no better than the best plan so far, a
credit that gives an issue order already scored, and the credits above one that never held a
ready partition back (they all give its order); it stops raising the credit once a plan meets
the bound. The result is the grid's best, as an exhaustive search would find it.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(chain_profile([5_000_000, 1000, 3_000_000]))
    >>> p = plan(pb, partition=2_000_000, credit=4_000_000)
    >>> [k.end - k.start for k in p.blocks]     # layer2 (ready first) in 2 parts, layer0 in 3
    [1500000, 1500000, 1000, 1666666, 1666667, 1666667]
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence

import numpy as np

from ...formats import Block, Mode
from ..fastsim import scorer_for, tails
from ..problem import Layout, Problem, Runner
from . import Plan, register

M = 1_000_000
#: ByteScheduler's auto-tuning ranges for all-reduce, in elements (tuner.py: 2–32 M, 4–64 M).
PARTITION_RANGE = (2 * M, 32 * M)
CREDIT_RANGE = (4 * M, 64 * M)
GRID_POINTS = 9  # per knob: factor sqrt(2) between neighbours over a 16x range


def log_grid(lo: float, hi: float, points: int) -> list[int]:
    """``points`` values from ``lo`` to ``hi``, evenly spaced in log scale, rounded to ints.

    Example::

        >>> log_grid(2, 32, 5)
        [2, 4, 8, 16, 32]
    """
    if points == 1:
        return [int(round(lo))]
    r = (hi / lo) ** (1.0 / (points - 1))
    return [int(round(lo * r ** k)) for k in range(points)]


def partition_tensor(numel: int, rows: int, partition: int) -> list[int]:
    """Element counts of ByteScheduler's partitions of one tensor (rows of the first dimension).

    Example::

        >>> partition_tensor(10, 10, 3)     # ceil(10/3) = 4 pieces of 2, 2, 3, 3 rows
        [2, 2, 3, 3]
        >>> partition_tensor(6 * 9, 6, 4)    # 14 pieces wanted, only 6 rows: one row each
        [9, 9, 9, 9, 9, 9]
    """
    if numel <= partition:
        return [numel]
    rows = max(1, min(rows, numel))
    row = numel // rows
    n = min(-(-numel // partition), rows)
    base, extra = divmod(rows, n)
    return [(base + (1 if k >= n - extra else 0)) * row for k in range(n)]


class _Parts:
    """The partitions of every tensor for one partition size, with what the replay needs.

    Partition ``p`` (tensors in profile order, each tensor's pieces in row order) is element
    range ``[start[p], end[p])`` of buffer ``buf[p]``; built with numpy (only the tensors
    larger than the partition are cut in Python), each distinct size costed once by the cost
    model's own :meth:`allreduce_ms`."""

    __slots__ = ("buf", "start", "end", "size", "cost", "ready", "by_key", "by_key_array",
                 "ready_sorted", "rank_by_ready", "rank_by_ready_array", "_blocks")

    def __init__(self, problem: Problem, layout: Layout, partition: int, tail: Sequence[float]):
        n = problem.n
        need_rank, numel, tbuf, tstart = _tensor_arrays(problem, layout)
        counts = np.ones(n, dtype=np.int64)
        cut: dict[int, list[int]] = {}
        for i in np.flatnonzero(numel > partition).tolist():
            shape = problem.profile.tensors[i].shape
            cut[i] = partition_tensor(problem.numel[i], shape[0] if shape else 1, partition)
            counts[i] = len(cut[i])
        tensor = np.repeat(np.arange(n), counts) if cut else np.arange(n)
        first = np.cumsum(counts) - counts                      # each tensor's first partition
        size = numel[tensor]
        for i, sizes in cut.items():
            size[first[i]:first[i] + len(sizes)] = sizes
        j = np.arange(len(size)) - first[tensor]                # the partition's index in its tensor
        within = np.cumsum(size) - size                         # elements before, over all tensors
        buf = tbuf[tensor]
        self.buf = buf
        self.start = tstart[tensor] + within - within[first][tensor]
        self.end = self.start + size
        nbytes = size * np.asarray(layout.itemsize, dtype=np.int64)[buf]
        uniq, inv = np.unique(nbytes, return_inverse=True)
        cost = problem.cost
        self.cost: list[float] = np.asarray([cost.allreduce_ms(int(b)) for b in uniq.tolist()],
                                            dtype=float)[inv].tolist()
        ready = np.asarray(problem.ready, dtype=float)[tensor]
        # forward order first, then the partition index (ByteScheduler: rank*1000 + i)
        key = need_rank[tensor] * (1 << 32) + j
        self.size: list[int] = size.tolist()
        self.ready: list[float] = ready.tolist()
        #: Partitions by priority (the keys are distinct), and each one's place there: the
        #: replay's queue holds places.
        by_key = np.argsort(key, kind="stable")
        self.by_key_array = by_key
        self.by_key: list[int] = by_key.tolist()
        rank = np.empty(len(key), dtype=np.int64)
        rank[by_key] = np.arange(len(key))
        by_ready = np.lexsort((key, ready))                     # the keys are distinct
        #: The releases in ready order (ties by priority), and each one's place in ``by_key``.
        self.ready_sorted: list[float] = ready[by_ready].tolist()
        self.rank_by_ready_array = rank[by_ready]
        self.rank_by_ready: list[int] = self.rank_by_ready_array.tolist()
        self._blocks: list[Block] | None = None

    def __len__(self) -> int:
        return len(self.size)

    @property
    def blocks(self) -> list[Block]:
        """The partitions as blocks (built on first use)."""
        if self._blocks is None:
            self._blocks = [Block(b, s, e) for b, s, e in
                            zip(self.buf.tolist(), self.start.tolist(), self.end.tolist())]
        return self._blocks


def _tensor_arrays(problem: Problem, layout: Layout) -> tuple[np.ndarray, ...]:
    """Per tensor: its place in the need order, its elements, its buffer and its first element
    in ``layout``; once per problem and layout (kept in ``problem.cache``)."""
    key = ("bytescheduler-tensors", id(layout))
    hit = problem.cache.get(key)
    if hit is None or hit[0] is not layout:
        n = problem.n
        need_rank = np.empty(n, dtype=np.int64)
        need_rank[np.asarray(problem.need_order(), dtype=np.int64)] = np.arange(n)
        pos = np.asarray(layout.pos, dtype=np.int64).reshape(n, 3)
        hit = problem.cache[key] = (layout, need_rank, np.asarray(problem.numel, dtype=np.int64),
                                    pos[:, 0].copy(), pos[:, 1].copy())
    return hit[1:]


def replay(parts: _Parts, credit: float, stats: dict | None = None) -> list[int]:
    """Issue order (indices into ``parts``) of ByteScheduler's credit loop on one channel.
    ``stats["held"]`` is set to whether the credit ever held back a ready partition (if not,
    every larger credit gives this order too).

    Event-driven, with two shortcuts that give the same order as stepping through every
    event: while the credit is spent nothing is dispatched before the next finish gives some
    back, so the releases up to it join the priority queue at once; and once every partition
    is released nothing joins it any more, so the credit decides only when the rest is
    dispatched, not in which order: the queue's priority order, appended whole. The queue is
    a flag per place in the priority order (``bytearray.find`` gives its head; a numpy view
    of the same bytes sets a batch of releases at once)."""
    size, cost = parts.size, parts.cost
    by_key = parts.by_key
    R, KR, KRa = parts.ready_sorted, parts.rank_by_ready, parts.rank_by_ready_array
    n = len(R)
    queued = bytearray(n)                             # by place in by_key: released, not sent
    flags = np.frombuffer(queued, dtype=np.uint8)
    find = queued.find
    head = 0                                          # no queued place is below this one
    outstanding: deque[tuple[float, int]] = deque()   # (finish, elements), FIFO = finish order
    out: list[int] = []
    send, back, issue = outstanding.append, outstanding.popleft, out.append
    left = credit
    last_fin = 0.0
    t = 0.0
    j = 0                                             # releases so far (in ready order)
    issued = 0
    inf = math.inf
    held = False
    r_next = R[0] if n else inf                       # the next release
    while issued < n:
        if r_next <= t:
            k = bisect_right(R, t, j)
            if k == j + 1:
                r = KR[j]
                queued[r] = 1
            else:
                batch = KRa[j:k]
                flags[batch] = 1
                r = int(batch.min())
            if r < head:
                head = r
            j = k
            r_next = R[j] if j < n else inf
        while outstanding and outstanding[0][0] <= t:
            left += back()[1]
            if left > credit:
                left = credit
        while issued < j and left > 0:
            head = find(1, head)
            queued[head] = 0
            p = by_key[head]
            sz = size[p]
            left -= sz
            last_fin = (last_fin if last_fin > t else t) + cost[p]
            send((last_fin, sz))
            issue(p)
            issued += 1
        if issued < j:
            held = True
            if j >= n:                   # all released: the rest goes in priority order
                out.extend(parts.by_key_array[np.flatnonzero(flags)].tolist())
                break
        nf = outstanding[0][0] if outstanding else inf
        if left <= 0 and nf < inf:
            # credit spent: nothing is dispatched before a finish; a release before it waits
            if r_next < nf:
                held = True
            t = nf
        else:
            t = r_next if r_next < nf else nf
    if stats is not None:
        stats["held"] = held
    return out


def _lower(problem: Problem, ready: np.ndarray, cost: np.ndarray, tail_min: float,
           blocks: int = 1) -> float:
    """A lower bound on the time of every issue order of ``blocks`` blocks with these ``ready``
    times and ``cost`` (per block, or per tensor summed over its blocks), run by the runtime:
    the channel sends every block that becomes ready at or after ``r`` after ``r``, and the
    last block's tail is at least the smallest (the compute-cost option only lengthens this).
    The caller's costs are the cost model's linear bound, which no block costs less than; the
    ``ready`` times are the runtime's host floor's (:meth:`Problem.host_floor`, no earlier than
    any block's issue) and backward ends no earlier than its hooks and ``blocks`` issues."""
    order = np.argsort(ready, kind="stable")
    R, C = ready[order], cost[order]
    after = np.cumsum(C[::-1])[::-1]
    return max(problem.host_backward(blocks) + problem.F, float((R + after).max()) + tail_min)


@register("bytescheduler")
def plan(problem: Problem, *, partition: int | None = None, credit: float | None = None,
         grid_points: int = GRID_POINTS) -> Plan:
    """ByteScheduler's plan, with partition size and credit tuned on the simulator.

    Args:
        problem: the compiled profile.
        partition: fix ``P`` (elements) instead of searching 2–32 M.
        credit: fix ``C`` (elements) instead of searching 4–64 M.
        grid_points: points per knob on the log grid.

    Returns:
        An overlap-mode :class:`Plan`; ``info`` holds ``partition``, ``credit`` (elements) and
        the predicted ``iteration_ms``.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([1000, 2000, 3000]))
        >>> p = plan(pb)
        >>> len(p.blocks), str(p.mode)                # small tensors are never partitioned
        (3, 'overlap')
    """
    if partition is not None and partition < 1:
        raise ValueError(f"partition: expected >= 1 elements, got {partition}")
    if credit is not None and not credit > 0:
        raise ValueError(f"credit: expected > 0 elements, got {credit}")
    layout = problem.layout()
    tail = tails(problem)
    sc = scorer_for(problem, layout)
    ps = [partition] if partition is not None else log_grid(*PARTITION_RANGE, grid_points)
    cs = [credit] if credit is not None else log_grid(*CREDIT_RANGE, grid_points)
    best: tuple[float, int, float, _Parts, list[int]] | None = None
    # Partition sizes that cut every tensor alike give the same plan: keep the smallest.
    numel = np.asarray(problem.numel, dtype=np.int64)
    rows = np.asarray([max(1, min(t.shape[0] if t.shape else 1, n))
                       for t, n in zip(problem.profile.tensors, problem.numel)], dtype=np.int64)
    distinct: dict[bytes, tuple[int, np.ndarray]] = {}
    for P in sorted(ps):
        pieces = np.where(numel > P, np.minimum(-(-numel // P), rows), 1)
        distinct.setdefault(pieces.tobytes(), (P, pieces))
    # A lower bound per partition size (:func:`_lower`, from each tensor's piece count, before
    # building the partitions); the most promising first, so that the bound prunes the rest.
    ready = np.asarray(problem.host_floor(Runner.RUNTIME).ready, dtype=float)
    alpha, beta = problem.cost.linear_bound()    # each block costs at least this line
    tensor_cost = beta * np.asarray([problem.nbytes(i) for i in range(problem.n)], dtype=float)
    tail_min = float(min(tail))
    lows = sorted((_lower(problem, ready, pieces * alpha + tensor_cost, tail_min,
                          int(pieces.sum())), -P)
                  for P, pieces in distinct.values())
    for low, negP in lows:
        P = -negP
        if best is not None and low > best[0] + 1e-12:
            break             # no issue order of these partitions (or later ones) beats the best
        parts = _Parts(problem, layout, P, tail)
        st = sc.stats_arrays(parts.buf, parts.start, parts.end)
        orders: set[tuple[int, ...]] = set()
        above = False
        info: dict = {}
        for C in sorted(cs):
            if above:
                break         # the credit held nothing back: every larger one gives this order
            order = replay(parts, C, info)
            above = not info["held"]
            key = tuple(order)
            if key in orders:
                continue
            orders.add(key)
            T = sc.score(st.take(order))
            if best is None or T < best[0] - 1e-12 or (T < best[0] + 1e-12 and (P, C) < best[1:3]):
                best = (T, P, C, parts, order)
            if T <= low:
                break         # the bound is reached: no larger credit does better
    assert best is not None
    T, P, C, parts, order = best
    blocks = [parts.blocks[p] for p in order]
    return Plan(layout, blocks, Mode.OVERLAP, {"partition": P, "credit": C, "partitions": len(blocks),
                                            "iteration_ms": T})
