"""Fast scoring for search loops: the same numbers as :mod:`usbyte_opt.simulate`, no timeline.

Unrolling the forward walk of docs/design.md §2.5 gives a closed form for overlap mode:

    forward end = max(B + F, max_p (avail_p + F - need_p))

(induction on the need order: ``t_last = max(B + need_last, max_p avail_p + need_last - need_p)``).
Since finish times grow along the issue order, ``avail_p`` is reached by the last block
covering p, and ``max_p`` can be taken over every block covering p. So with a per-block
*tail* ``q_k = max over tensors p in k of (update_p + F - need_p)``:

    T_overlap = max(B + F, finish_last, max_k (finish_k + q_k))
    T_fence   = max(B, finish_last) + sum(update) + F

Tests check these against the full simulator on random schedules. With the compute-cost
option (:meth:`Problem.stretch`), overlap mode scores the problem stretched for the schedule's
block count, and fence mode lengthens ``B`` by the blocks started and the bytes on the wire
before it ends, as :func:`usbyte_opt.simulate.simulate_blocks` does.

Example::

    >>> stats = [(2.0, 2.0, 1.0), (6.0, 2.0, 4.0)]   # (ready, cost, tail) per block
    >>> score(stats, B=6.0, F=4.0)
    12.0
"""

from __future__ import annotations

from typing import Sequence

from .formats import Block
from .problem import Layout, Problem

BlockStat = tuple[float, float, float]
"""``(ready_ms, cost_ms, tail_ms)`` of one block."""


def tails(problem: Problem) -> list[float]:
    """``update_p + F - need_p`` per tensor: how long after p is available the iteration can end."""
    F = problem.F
    return [u + F - nd for u, nd in zip(problem.update, problem.need)]


def block_stats(problem: Problem, layout: Layout, blocks: Sequence[Block],
                tail: Sequence[float] | None = None) -> list[BlockStat]:
    tail = tails(problem) if tail is None else tail
    ready, cost = problem.ready, problem.cost
    out = []
    for k in blocks:
        idx = layout.tensors_of(k.buffer, k.start, k.end)
        out.append((max(ready[i] for i in idx), cost((k.end - k.start) * layout.itemsize[k.buffer]),
                    max(tail[i] for i in idx)))
    return out


def score(stats: Sequence[BlockStat], B: float, F: float, mode: str = "overlap",
          total_update: float = 0.0) -> float:
    """Iteration time of blocks given as ``(ready, cost, tail)`` in issue order."""
    t = 0.0
    worst = B + F
    for r, c, q in stats:
        t = (r if r > t else t) + c
        if t + q > worst:
            worst = t + q
    if mode == "overlap":
        return worst if worst > t else t
    return (B if B > t else t) + total_update + F


def evaluate(problem: Problem, layout: Layout, blocks: Sequence[Block], mode: str = "overlap") -> float:
    """Iteration time of ``blocks`` on ``problem`` (same value as the full simulator)."""
    if problem.charges_cpu:
        if mode == "overlap":
            problem = problem.stretched(problem.stretch(len(blocks)))
        else:
            return _fence_cpu(problem, block_stats(problem, layout, blocks), layout, blocks)
    return score(block_stats(problem, layout, blocks), problem.B, problem.F, mode,
                 sum(problem.update))


def _fence_cpu(problem: Problem, stats: Sequence[BlockStat], layout: Layout,
               blocks: Sequence[Block]) -> float:
    """Fence mode with backward lengthened by the communication it overlaps
    (:meth:`Problem.fence_backward`)."""
    t = 0.0
    spans = []
    for (r, c, _), k in zip(stats, blocks):
        start = r if r > t else t
        t = start + c
        spans.append((start, t, (k.end - k.start) * layout.itemsize[k.buffer]))
    return max(problem.fence_backward(spans), t) + sum(problem.update) + problem.F
