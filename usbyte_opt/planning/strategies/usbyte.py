"""US-Byte: unequal-sized tensor blocks in two phases, with a priority search and a tuned unit.

Gao, Hu, Mashhadi, Jin, Xiao, Wu, "US-Byte: An Efficient Communication Framework for
Scheduling Unequal-sized Tensor Blocks in Distributed Deep Learning", IEEE TPDS 35(1), 2024.
The method (the paper's Algorithms 1–3; summary in docs/design.md §3.1):

* **Units.** Tensor l holds ``m_l = ceil(M_l / S_p)`` units of ``S_p`` elements; a block of k
  units costs ``alpha + beta * S_p * k`` (the last unit of a tensor at its true size).
* **Phase 1** (Algorithm 1, during backward), event-driven over the ready times: while the
  channel is free before the next gradient becomes ready (gap ``g``), take the ready tensor
  with units left and the highest phase-1 priority and send

  - 1 unit if ``g < alpha``;
  - ``ceil((g - alpha) / (beta * S_p))`` units if ``g`` is shorter than sending all it has left
    (at least 1: at ``g == alpha`` the formula gives 0, and a block carries a unit or more);
  - everything it has left otherwise.

  If it is the tensor of the previous block, that block grows instead (one alpha per block).
  With nothing ready the channel idles until the next gradient.
* **Phase 2** (Algorithm 2, after backward): each tensor's remaining units as *one* block, in
  forward order (input side first), the order the paper proves optimal for this phase.
* **Priority search** (Algorithm 3): start from forward order (ByteScheduler's). For l from the
  tensor ready first: find when l's first phase-1 block would finish if it carried all of l,
  find the tensor k whose ready window contains that instant, move l ahead of the tensors
  ready after it up to k, re-simulate, keep the move only if the iteration time drops, and
  continue after k.
* **S_p** is tuned by search (the paper tunes it with Bayesian optimisation on measured step
  times; here see :func:`plan`).

Two defects of the authors' released planner are *not* reproduced (docs/design.md §3.1): their
phase-2
timing charges whole units and corrects the last unit of the wrong tensor, and extending a block
overwrites its unit count, so units of a gradient vanish. Here every block carries true sizes,
every element is sent exactly once (phase 1 sends a tensor's units from its first element
upward, phase 2 sends the contiguous rest). On the extension rule: adding k units to the previous block costs
``beta * S_p * k`` and no alpha, so the block grows by ``ceil(g / (beta * S_p))`` units; that is
what the three-case rule yields applied again on the shrinking gap, and what the authors' code
computes by measuring the gap from the block's start.

US-Byte never fuses tensors: every block lies inside one tensor. Overlap mode.

Speed (the authors' planner takes tens of seconds on ResNet-152; mixture-of-experts models
have 10,000+ tensors): one run of phases 1–2 is O(n log n). The priority search re-runs phase
1 only from the instant the moved tensor and one it overtakes are both ready (earlier decisions
cannot differ), from states stored per ready event, and drops a candidate as soon as a lower
bound on its time reaches the incumbent's: the worst finish plus tail so far, the last block's,
or the channel's time now plus what is left to send plus one alpha per tensor that still needs
a block. The bound is first read off the stored state where the candidate resumes, so a
candidate that cannot win costs O(1); ranks and the range minima the search reads are kept in
arrays rebuilt only when a move is kept. The unit grid drops a unit as soon as its bound
reaches the second best so far (two finalists go on). These shortcuts return exactly what full
runs would (tests compare them). With the profile's compute-cost option every candidate is
scored by :class:`usbyte_opt.planning.fastsim.Scorer` (the phase model's own time, which leaves the
option out, is then only used as a lower bound). The method is stated for a linear cost: its
``alpha`` and ``beta`` are the cost model's linear bound
(:meth:`usbyte_opt.planning.cost.CostModel.linear_bound`). With the updates at the gates, or a
cost model that is not a line, candidates are scored by the one scorer too, and the phase
model's time, never above the scorer's, is again only a lower bound.

**The phase model and the one iteration model.** Algorithm 1 decides as it goes, from the
channel's time (how long the gap to the next gradient is), so phases 1–2
(:meth:`USByte.phases`) time the blocks they build themselves, on the cost model's line, one
block at a time: the iteration model of :mod:`usbyte_opt.planning.simulate` in overlap mode
without its options, the closed form of :func:`usbyte_opt.planning.fastsim.score` summed as
the phases build it (equal to the scorer's up to rounding; tests compare them). It cannot call
the scorer per decision without rebuilding the plan at each gap. Where the iteration model
says more (the three cases above) the candidates are scored by the scorer itself
(:meth:`USByte.value`). Host cost is the one option the phase model leaves out and that does
not bring in the scorer: with it, candidates are still compared on the phase model, and
``info["iteration_ms"]`` is the phase model's time, below what the planner then predicts for
the plan (it scores every plan with the scorer).

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> from usbyte_opt.planning.fastsim import evaluate
    >>> pb = Problem.from_profile(chain_profile([2_000_000, 500_000, 3_000_000], alpha_ms=0.5,
    ...                                         algbw_gbs=1.0, forward_ms=10, backward_ms=20))
    >>> p = plan(pb)
    >>> round(p.info["iteration_ms"], 6) == round(evaluate(pb, p.layout, p.blocks), 6)
    True
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...formats import Block, Mode
from ..fastsim import scorer_for, tails
from ..problem import Layout, Problem, UpdateRule
from . import Plan, register

#: The paper's default unit: 1e6 elements (ByteScheduler's default partition).
DEFAULT_UNIT = 1_000_000


@dataclass(slots=True)
class Phase1Block:
    """A phase-1 block: units ``[u0, u1)`` of ``tensor``, on the channel ``[start, finish)``."""

    tensor: int
    u0: int
    u1: int
    start: float
    finish: float


#: Phase 1's state when a tensor becomes ready (before the gap up to it is filled): what a run
#: resumed there starts from, and what :meth:`USByte._lower` reads. A plain tuple (one is
#: recorded per ready event, so it is built in the hot loop): ``(t, blocks, last_u1,
#: last_finish, rest_ms, unfinished, worst)``, with ``t`` the time the channel is free from,
#: ``blocks`` the phase-1 blocks issued so far, ``last_u1`` and ``last_finish`` the end unit and
#: finish of the last of them (it may still grow; 0 without blocks), ``rest_ms`` the transfer
#: time (no alpha) of what is not yet sent, ``unfinished`` the tensors with elements not yet
#: sent and ``worst`` the max of finish + tail over the closed blocks (at least ``B + F``).
Snapshot = tuple[float, int, int, float, float, int, float]


@dataclass(slots=True)
class _Phase1:
    """The running state of phase 1 (:meth:`USByte.phases`)."""

    t: float
    blocks: list[Phase1Block]
    last: Phase1Block | None
    sent: list[int]
    first: list[float]
    rest_ms: float
    unfinished: int
    worst: float
    heap: list[tuple[float, int]]
    snaps: list[Snapshot]
    done_at: list[int] | None


@dataclass(slots=True)
class Outcome:
    """One simulated US-Byte plan for a unit size and a phase-1 priority."""

    unit: int
    iteration_ms: float
    phase1: list[Phase1Block]
    sent: list[int]
    """Units each tensor sent in phase 1."""
    first_start: list[float]
    """Start of each tensor's first phase-1 block (``nan`` if it has none)."""
    priority: list[int] = field(default_factory=list)
    """Phase-1 priority, highest first (tensor indices)."""
    snaps: list[Snapshot] = field(default_factory=list, repr=False)
    """Phase-1 state when each tensor (ready order) became ready, for resuming."""
    done_at: list[int] = field(default_factory=list, repr=False)
    """The ready event during which each tensor sent its last phase-1 unit (n: never)."""
    min_tail: list[float] = field(default_factory=list, repr=False)
    """Smallest tail among the tensors with units left when each event begins."""


class USByte:
    """The US-Byte model of one problem: phase 1, phase 2, timing and the priority search.

    Knobs users tune are arguments of :func:`plan`; this class holds per-tensor tables only.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([4, 4], alpha_ms=1.0, algbw_gbs=1e-5,
        ...                                         forward_ms=2, backward_ms=40))
        >>> # 16 bytes at 1e-5 GB/s: beta = 0.1 ms/byte, 0.4 ms/element, a unit of 2 costs 0.8
        >>> m = USByte(pb)
        >>> out = m.phases(2, m.forward_priority())
        >>> [(b.tensor, b.u0, b.u1, b.start, b.finish) for b in out.phase1]
        [(1, 0, 2, 20.0, 22.6)]
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.layout: Layout = problem.layout()
        n = problem.n
        cost = problem.cost
        self.alpha, beta = cost.linear_bound()
        self.numel = list(problem.numel)
        self.beta_el = [beta * problem.itemsize[i] for i in range(n)]   # ms per element
        self.ready = list(problem.ready)
        self.tail = tails(problem)
        self.total_beta_ms = sum(b * x for b, x in zip(self.beta_el, self.numel))
        self.order = problem.ready_order()
        self.ready_sorted = [self.ready[i] for i in self.order]
        self.pos = [0] * n
        for p, i in enumerate(self.order):
            self.pos[i] = p
        self.need_order = problem.need_order()
        self.B, self.F = problem.B, problem.F
        # no plan beats the compute time, nor sends a tensor faster than in one block after it
        # is ready (and then the forward still needs its tail); on a line one block is the
        # fastest way to send a tensor, otherwise the linear bound is what is sure
        one = cost.allreduce_ms if cost.is_linear else (lambda b: self.alpha + beta * b)
        self.floor = max([self.B + self.F] + [
            self.ready[i] + one(problem.nbytes(i)) + self.tail[i] for i in range(n)])
        self._units: dict[int, list[int]] = {}
        self.min_tail = min(self.tail)
        #: The one scorer, where it differs from the phase model: with the compute-cost option,
        #: the updates at the gates, or a cost model that is not a line (host cost aside: the
        #: module docstring).
        differs = (problem.charges_cpu or problem.update_rule == UpdateRule.GATE
                   or not cost.is_linear)
        self.scorer = scorer_for(problem, self.layout) if differs else None

    def forward_priority(self) -> list[int]:
        """ByteScheduler's priority: forward order, input side first."""
        return list(self.need_order)

    # ----------------------------------------------------------------------------------------
    # Algorithms 1 and 2: one plan for a unit size and a priority
    # ----------------------------------------------------------------------------------------

    def phases(self, unit: int, priority: Sequence[int], bound: float = math.inf,
                 resume: tuple[Outcome, int] | None = None, record: bool = True,
                 rank: Sequence[float] | None = None) -> Outcome | None:
        """Build and time the plan of phase 1 and phase 2 for ``unit`` (S_p) and ``priority``
        (highest first), on the phase model (module docstring: the iteration model's overlap
        mode on the cost model's line, timed as the blocks are built).

        Args:
            unit: S_p, elements per unit.
            priority: phase-1 priority, tensor indices, highest first (kept, not copied, in
                the outcome).
            bound: give up (return ``None``) as soon as the plan provably takes at least this
                long (:meth:`_lower`).
            resume: ``(outcome, e)``: an earlier outcome for the same unit whose priority
                orders every pair of tensors alike while only ``order[:e]`` are ready; the run
                continues from its state when ``order[e]`` became ready instead of from 0.
            record: keep those states in the outcome (what ``resume`` needs).
            rank: each tensor's place in ``priority`` (lower first), when the caller has it.

        Phases: the state at the start (:meth:`_fresh`, or :meth:`_resumed` from ``resume``);
        per ready event, its :data:`Snapshot` (with ``record``), the bound and Algorithm 1 over
        the gap up to it; then phase 2 and the outcome (:meth:`_outcome`). The per-event work
        is one loop over local variables: it runs once per tensor for every unit tried and
        every candidate of the priority search.

        The bound: every plan that continues the run takes at least the worst finish plus tail
        so far, the last block's, and the channel's time plus what is left plus one alpha per
        tensor that still needs a block (the last block's tensor may grow it without one), plus
        the smallest tail.

        Length: one loop over local variables on purpose (above); its setup is
        :meth:`_start` and Algorithm 1's three cases :func:`_units_for_gap`.
        """
        e0, run, m, rank = self._start(unit, priority, resume, record, rank)
        n, order, ready = len(self.numel), self.order, self.ready
        alpha, numel, beta_el, tail, low = self.alpha, self.numel, self.beta_el, self.tail, self.min_tail
        S = unit
        t, last, heap, sent, first = run.t, run.last, run.heap, run.sent, run.first
        rest_ms, worst, unfinished = run.rest_ms, run.worst, run.unfinished
        blocks, done_at = run.blocks, run.done_at
        snaps = run.snaps if record else None
        pruning = bound < math.inf
        push, pop, ceil = heapq.heappush, heapq.heappop, math.ceil
        for e in range(e0, n):
            i = order[e]
            r = ready[i]
            if snaps is not None:
                snaps.append((t, len(blocks), last.u1 if last else 0,
                              last.finish if last else 0.0, rest_ms, unfinished, worst))
            if pruning and (worst >= bound or (
                    t + rest_ms + alpha * unfinished + low >= bound if last is None else (
                        last.finish + tail[last.tensor] >= bound
                        or t + rest_ms + alpha * (unfinished - (sent[last.tensor] < m[last.tensor]))
                        + low >= bound))):
                return None
            # Algorithm 1 over the gap up to r: the ready tensor of highest priority sends, or
            # extends the previous block, until the channel reaches r or nothing ready is left;
            # then the channel idles to r.
            while t < r and heap:
                j = heap[0][1]
                g = r - t
                left = m[j] - sent[j]
                if last is not None and last.tensor == j:
                    # extend the previous block: no second alpha, so fill the gap with units
                    k = ceil(g / (beta_el[j] * S))
                    if k > left:
                        k = left
                    el0 = min(last.u1 * S, numel[j])
                    sent[j] += k
                    last.u1 = sent[j]
                    el1 = min(sent[j] * S, numel[j])
                    rest_ms -= beta_el[j] * (el1 - el0)
                    last.finish = last.start + alpha + beta_el[j] * (el1 - last.u0 * S)
                    t = last.finish
                else:
                    k = _units_for_gap(g, alpha, beta_el[j], S, numel[j] - sent[j] * S, left)
                    if last is not None:
                        v = last.finish + tail[last.tensor]
                        if v > worst:
                            worst = v
                    u0 = sent[j]
                    sent[j] += k
                    el = min(sent[j] * S, numel[j]) - u0 * S
                    rest_ms -= beta_el[j] * el
                    last = Phase1Block(j, u0, sent[j], t, t + alpha + beta_el[j] * el)
                    blocks.append(last)
                    if first[j] != first[j]:      # nan: this is j's first phase-1 block
                        first[j] = t
                    t = last.finish
                if sent[j] == m[j]:
                    pop(heap)
                    unfinished -= 1
                    if done_at is not None:
                        done_at[j] = e
            if t < r:
                t = r
            push(heap, (rank[i], i))
        run.t, run.last, run.rest_ms, run.worst, run.unfinished = t, last, rest_ms, worst, unfinished
        return self._outcome(run, unit, priority)

    def _start(self, unit: int, priority: Sequence[int], resume: tuple[Outcome, int] | None,
               record: bool, rank: Sequence[float] | None,
               ) -> tuple[int, _Phase1, list[int], Sequence[float]]:
        """What :meth:`phases` starts from: ``(first event, state, units per tensor, rank)``,
        the state :meth:`_fresh` or :meth:`_resumed` from ``resume``, the rank from
        ``priority`` unless given."""
        n = len(self.numel)
        if rank is None:
            rank = [0.0] * n
            for place, i in enumerate(priority):
                rank[i] = place
        m = self._units.get(unit)
        if m is None:
            m = self._units[unit] = [-(-x // unit) for x in self.numel]
        if resume is None:
            return 0, self._fresh(record), m, rank
        return resume[1], self._resumed(resume[0], resume[1], m, rank, record), m, rank

    def _fresh(self, record: bool) -> _Phase1:
        """Phase 1 before the first gradient: nothing sent, the channel free from 0."""
        n = len(self.numel)
        return _Phase1(0.0, [], None, [0] * n, [math.nan] * n, self.total_beta_ms, n,
                       self.B + self.F, [], [], [n] * n if record else None)

    def _resumed(self, prev: Outcome, e0: int, m: Sequence[int], rank: Sequence[float],
                 record: bool) -> _Phase1:
        """Phase 1 of ``prev`` when ``order[e0]`` became ready, with the heap of ``rank``."""
        n = len(self.numel)
        t, nb, last_u1, last_finish, rest_ms, unfinished, worst = prev.snaps[e0]
        blocks = prev.phase1[:nb]
        sent = [0] * n
        first = [math.nan] * n
        last = None
        if nb:
            # earlier blocks are final; the last one may have grown since: copy it back
            lb = blocks[-1]
            last = blocks[-1] = Phase1Block(lb.tensor, lb.u0, last_u1, lb.start, last_finish)
        for b in blocks:
            sent[b.tensor] = b.u1
            if first[b.tensor] != first[b.tensor]:
                first[b.tensor] = b.start
        heap = [(rank[x], x) for x in self.order[:e0] if sent[x] < m[x]]
        heapq.heapify(heap)
        done_at = [d if d < e0 else n for d in prev.done_at] if record else None
        return _Phase1(t, blocks, last, sent, first, rest_ms, unfinished, worst,
                       heap, prev.snaps[:e0] if record else [], done_at)

    def _outcome(self, run: _Phase1, S: int, priority: Sequence[int]) -> Outcome:
        """Phase 2 after ``run`` (:meth:`_finish`) and the outcome, with the smallest tail of
        the tensors left at each event when the run recorded its states."""
        worst, last, tail = run.worst, run.last, self.tail
        if last is not None:
            v = last.finish + tail[last.tensor]
            if v > worst:
                worst = v
        T = self._finish(worst, run.sent, S, run.t)
        out = Outcome(S, T, run.blocks, run.sent, run.first, list(priority), run.snaps)
        if run.done_at is not None:
            n = len(self.numel)
            lows = [math.inf] * (n + 1)
            for i, d in enumerate(run.done_at):
                if tail[i] < lows[d]:
                    lows[d] = tail[i]
            for e in range(n - 1, -1, -1):
                if lows[e + 1] < lows[e]:
                    lows[e] = lows[e + 1]
            out.done_at, out.min_tail = run.done_at, lows[:n]
        return out

    def _lower(self, prev: Outcome, e: int) -> float:
        """A lower bound on the time of any plan that runs as ``prev`` until ``order[e]`` is
        ready, read off ``prev``'s state then: the worst finish plus tail of the closed blocks,
        the open block's, and the channel's time plus what is left to send plus one alpha per
        tensor that still needs a block (the open block's tensor may grow it without one), and
        then the smallest tail of those tensors (the last block carries one of them)."""
        t, nb, last_u1, last_finish, rest_ms, unfinished, worst = prev.snaps[e]
        low = prev.min_tail[e] if prev.min_tail and unfinished else 0.0
        if not nb:
            return max(worst, t + rest_ms + self.alpha * unfinished + low)
        j = prev.phase1[nb - 1].tensor
        ext = last_u1 < self._units[prev.unit][j]
        return max(worst, last_finish + self.tail[j],
                   t + rest_ms + self.alpha * (unfinished - ext) + low)

    def _finish(self, worst: float, sent: list[int], S: int, t: float) -> float:
        """Phase 2 (forward order, one block per tensor) and the iteration time of the plan.

        The closed form of :func:`usbyte_opt.planning.fastsim.score`: ``T = max(B + F, last
        finish, max over blocks of finish + (update + F - need))``; ``worst`` already covers
        phase 1. Written out here rather than called: phase 1 keeps its running sums as ``t +
        alpha + beta * elements``, and phase 2 continues them the same way (one block's cost
        summed first would round differently), so the phase model's times are its own, equal
        to the scorer's up to rounding.
        """
        tail, ready, alpha = self.tail, self.ready, self.alpha
        beta_el, numel = self.beta_el, self.numel
        for i in self.need_order:
            rest = numel[i] - sent[i] * S
            if rest > 0:
                r = ready[i]
                t = (r if r > t else t) + alpha + beta_el[i] * rest
                v = t + tail[i]
                if v > worst:
                    worst = v
        return worst if worst > t else t

    # ----------------------------------------------------------------------------------------
    # Algorithm 3: the priority search
    # ----------------------------------------------------------------------------------------

    def value(self, out: Outcome) -> float:
        """What the plan of ``out`` is predicted to take: the phase model's time, or with the
        compute-cost option the one scorer's (:class:`usbyte_opt.planning.fastsim.Scorer`)."""
        if self.scorer is None:
            return out.iteration_ms
        return self.scorer.score(self.scorer.stats(self.blocks(out)))

    def search_priority(self, unit: int, start: Outcome | None = None) -> tuple[Outcome, int]:
        """Algorithm 3 from forward order; returns the best outcome and the moves kept."""
        cur = start if start is not None else self._run(unit, self.forward_priority())
        cur_v = self.value(cur)
        order, ready_sorted, alpha = self.order, self.ready_sorted, self.alpha
        n = len(order)
        moves = 0
        p = 0
        floor = self.floor + 1e-9
        prio = list(cur.priority)
        rank, by_ready, by_prio = self._ranks(prio)
        while p < n - 1 and cur_v > floor:
            l = order[p]
            fs = cur.first_start[l]
            if fs != fs:                  # l sends nothing in phase 1
                p += 1
                continue
            tau = fs + alpha + self.beta_el[l] * self.numel[l]
            pk = bisect_left(ready_sorted, tau) - 1   # last tensor ready strictly before tau
            if pk <= p:
                p += 1
                continue
            target = int(by_ready(p + 1, pk + 1))     # min rank of order[p + 1:pk + 1]
            rl = rank[l]
            if rl < target:               # l already goes ahead of all of them
                p += 1
                continue
            # The run is unchanged until l and a tensor it overtakes are both ready.
            e0 = max(p, int(by_prio(target, rl))) + 1  # min ready position of prio[target:rl]
            eps = 1e-9 * max(cur_v, 1.0)  # above the rounding of the running sums
            if e0 >= n or self._lower(cur, e0) >= cur_v - eps:
                # phase 1 unchanged (phase 2 ignores priority), or it cannot win from there
                p += 1
                continue
            rank[l] = target - 0.5        # l just ahead of prio[target]: the candidate's ranks
            cand = self.phases(unit, prio, bound=cur_v - eps, resume=(cur, e0), record=False,
                                 rank=rank)
            rank[l] = rl
            cand_v = self.value(cand) if cand is not None else math.inf
            if cand_v < cur_v - eps:
                prio = prio[:target] + [l] + prio[target:rl] + prio[rl + 1:]
                rank, by_ready, by_prio = self._ranks(prio)
                # run it again keeping its states, so later candidates can resume from it
                cur = self._run(unit, prio, resume=(cur, e0), rank=rank)
                cur_v = cand_v
                moves += 1
                p = pk + 1                # the paper continues from k - 1
            else:
                p += 1
        return cur, moves

    def _run(self, unit: int, priority: Sequence[int], **kw: Any) -> Outcome:
        """:meth:`phases` without a bound: it always returns an outcome."""
        out = self.phases(unit, priority, **kw)
        assert out is not None
        return out

    def _ranks(self, prio: list[int]):
        """``(rank, by_ready, by_prio)`` for priority ``prio``: each tensor's place in it, the
        minimum rank over ready positions ``[a, b)``, and the minimum ready position over
        priority places ``[a, b)``, each range in O(1)."""
        n = len(prio)
        rank = [0.0] * n
        for r, x in enumerate(prio):
            rank[x] = r
        return (rank, _RangeMin([rank[x] for x in self.order]),
                _RangeMin([self.pos[x] for x in prio]))

    # ----------------------------------------------------------------------------------------
    # Blocks
    # ----------------------------------------------------------------------------------------

    def blocks(self, out: Outcome) -> list[Block]:
        """The plan's blocks in issue order: phase 1, then phase 2 in forward order."""
        lay, S, numel = self.layout, out.unit, self.numel
        res = []
        for b in out.phase1:
            buf, s, _ = lay.pos[b.tensor]
            res.append(Block(buf, s + b.u0 * S, s + min(b.u1 * S, numel[b.tensor])))
        for i in self.need_order:
            buf, s, e = lay.pos[i]
            if out.sent[i] * S < numel[i]:
                res.append(Block(buf, s + out.sent[i] * S, e))
        return res


def _units_for_gap(g: float, alpha: float, beta_el: float, S: int, rest: int, left: int) -> int:
    """Algorithm 1's three cases: how many units of ``S`` elements (at ``beta_el`` ms each,
    ``rest`` elements and ``left`` units of the tensor unsent) a new block carries in a gap of
    ``g`` ms: 1 if ``g < alpha``; enough to fill the gap (at least 1: at ``g == alpha`` the
    formula gives 0) if ``g`` is shorter than sending the rest; else all that is left."""
    if g < alpha:
        return 1
    if g < alpha + beta_el * rest:
        k = max(1, math.ceil((g - alpha) / (beta_el * S)))
        return left if k > left else k
    return left


class _RangeMin:
    """Minimum of ``values[a:b]`` in O(1) after an O(n log n) build (sparse table)."""

    def __init__(self, values: Sequence[float]):
        lv = [np.asarray(values, dtype=float)]
        k = 1
        while 2 * k <= len(values):
            lv.append(np.minimum(lv[-1][:-k], lv[-1][k:]))
            k *= 2
        self.levels = [x.tolist() for x in lv]

    def __call__(self, a: int, b: int) -> float:
        k = (b - a).bit_length() - 1
        tab = self.levels[k]
        x, y = tab[a], tab[b - (1 << k)]
        return x if x < y else y


def unit_candidates(numel: Sequence[int], lo_ratio: float = 2.0 ** -14) -> list[int]:
    """Log grid (factor 2) of unit sizes from the largest tensor down to ``largest * lo_ratio``.

    A unit larger than the largest tensor changes nothing (every tensor is one unit).

    Example::

        >>> unit_candidates([1000, 64], lo_ratio=1 / 8)
        [1000, 500, 250, 125]
    """
    hi = max(numel)
    out: list[int] = []
    s = float(hi)
    while s >= max(1.0, hi * lo_ratio) - 1e-9:
        v = max(1, int(round(s)))
        if not out or v != out[-1]:
            out.append(v)
        s /= 2
    return out


@register("usbyte")
def plan(problem: Problem, *, unit: int | None = None, search_priority: bool = True,
         finalists: int = 2) -> Plan:
    """US-Byte's plan for ``problem``.

    The unit ``S_p`` is tuned on the simulator unless ``unit`` is given. The paper used
    Bayesian optimisation over measured step times; with an exact, millisecond model a
    deterministic search does better for the same budget: a factor-2 log grid from the
    largest tensor down to 2^-14 of it (plus the paper's default 1e6 when in range), each point
    scored with forward-order priority; a hill climb at factors 2^±1/2 and 2^±1/4 around the
    best; then the priority search (Algorithm 3) on the ``finalists`` best units, and the best
    resulting plan wins. The objective is piecewise constant and not unimodal in S_p, so a
    pure golden-section search would stall on plateaus; the grid sees the whole range first.
    Ties go to the larger unit (fewer blocks). Two finalists: on 30 random profiles, three or
    six changed the summed iteration time by under 1e-3 ms, and each costs a full search.

    Args:
        problem: the compiled profile.
        unit: fix S_p (elements) instead of searching.
        search_priority: run Algorithm 3 (off: forward-order priority, i.e. phases 1–2 only).
        finalists: how many of the best grid units get the priority search.

    Returns:
        An overlap-mode :class:`Plan`; ``info`` holds ``unit``, ``phase1_blocks``,
        ``priority_moves`` and the predicted ``iteration_ms``.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([3000, 1000], alpha_ms=0.01, algbw_gbs=0.01))
        >>> p = plan(pb, unit=1000)
        >>> [(k.start, k.end) for k in p.blocks]    # layer1 whole in phase 1, layer0 in phase 2
        [(0, 1000), (1000, 4000)]
    """
    if unit is not None and unit < 1:
        raise ValueError(f"unit: expected S_p >= 1 element, got {unit}")
    model = USByte(problem)
    prio0 = model.forward_priority()
    if unit is not None:
        units = [unit]
    else:
        units = unit_candidates(model.numel)
        if units[-1] <= DEFAULT_UNIT <= units[0] and DEFAULT_UNIT not in units:
            units.append(DEFAULT_UNIT)
    keep = max(1, finalists) if search_priority else 1
    scored: dict[int, Outcome] = {}
    value: dict[int, float] = {}    # each unit's predicted time (inf: dropped by the bound)

    def rank_key(s: int) -> tuple[float, int]:
        return value[s], -s

    def run(s: int) -> None:
        if s in value:
            return
        done = sorted(v for v in value.values() if v < math.inf)
        # a unit provably slower than the keep-th best so far can be neither best nor finalist
        bound = done[keep - 1] + 1e-6 if len(done) >= keep else math.inf
        out = model.phases(s, prio0, bound=bound)
        if out is None:
            value[s] = math.inf
        else:
            scored[s] = out
            value[s] = model.value(out)

    for s in units:
        run(s)
    if unit is None:
        # hill climb around the best grid point on a finer log scale
        best = min(scored, key=rank_key)
        for f in (2 ** 0.5, 2 ** 0.25):
            for s in (int(round(best * f)), int(round(best / f))):
                if 1 <= s <= units[0]:
                    run(s)
            best = min(scored, key=rank_key)
    ranked = sorted(scored, key=rank_key)
    best_out, best_v, best_moves = scored[ranked[0]], value[ranked[0]], 0
    if search_priority:
        for s in ranked[:keep]:
            out, moves = model.search_priority(s, scored[s])
            v = model.value(out)
            if v < best_v - 1e-9:
                best_out, best_v, best_moves = out, v, moves
    blocks = model.blocks(best_out)
    return Plan(model.layout, blocks, Mode.OVERLAP, {
        "unit": best_out.unit,
        "phase1_blocks": len(best_out.phase1),
        "priority_moves": best_moves,
        "units_tried": len(value),
        "iteration_ms": best_v,
    })
