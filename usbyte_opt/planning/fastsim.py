"""The iteration model in closed form, O(blocks) per plan: the one scorer of overlap and fence mode.

Every strategy, ``best``'s search, the planner's predictions and the bench's refinement score
plans here. It is a fast equivalent of :mod:`usbyte_opt.planning.simulate`, the step-by-step
walk that defines the model: the same numbers (tests check it on random schedules in both
modes, with and without the compute-cost option, host cost and the updates at the gates), no
timeline. Sharded mode's closed form is :func:`usbyte_opt.planning.sharded.sharded_time`.

**Closed form.** Unrolling the forward walk of docs/design.md §2.5 gives, for overlap mode,

    forward end = max(B + F, max_p (avail_p + F - need_p))

(induction on the need order: ``t_last = max(B + need_last, max_p avail_p + need_last - need_p)``).
Since finish times grow along the issue order, ``avail_p`` is reached by the last block
covering p, and ``max_p`` can be taken over every block covering p. So with a per-block
*tail* ``q_k = max over tensors p in k of (update_p + F - need_p)``:

    T_overlap = max(B + F, finish_last, max_k (finish_k + q_k))
    T_fence   = max(B, finish_last) + sum(update) + F

and the channel recurrence unrolls to ``finish_k = C_k + max_{j<=k} (r_j - C_{j-1})`` with
``C`` the prefix sum of block costs: O(blocks) with numpy.

**Compute cost of communication (the option; one rule in both modes).** Where the profile
carries ``comm.cpu_ms_per_block`` / ``comm.cpu_ms_per_mb``, block k costs the training thread
``c_k = cpu_ms_per_block + cpu_ms_per_mb * MB_k`` (:meth:`Problem.block_cpu_ms`), spread
evenly over its time on the wire, and the thread pays the part of it that overlaps its own
compute; while the thread waits (for a block in the next forward in overlap mode, for every
block before the step in fence mode, or after its work is done) communication costs it
nothing. Read off the timeline without the charge:

    X_B = sum_k c_k |wire_k ∩ backward| / |wire_k|
    X_F = sum_k c_k |wire_k ∩ forward compute| / |wire_k|

and each phase is lengthened by what it paid: backward's times (``ready``, ``B``) times
``1 + X_B / B``, forward's (``need``, ``update``, ``F``) times ``1 + X_F / F``
(:meth:`Problem.stretched`); the closed form above then gives T. In fence mode the forward
starts after the last block, so only backward pays. Forward compute in overlap mode: with the
tensors in need order, forward reaches the i-th at ``t_i = need_i + M_i``,
``M_i = max(B, max_{j<=i} (avail_j - need_j))``; it computes during
``[need_i + M_i, need_{i+1} + M_i]`` and waits from there to ``t_{i+1}``.

**Host cost (the profile's ``host`` section; docs/planner.md, "Host cost").** A plan is run by
a runner, the usbyte-opt runtime or torch DDP (:class:`~usbyte_opt.planning.problem.Runner`;
the ``ddp`` and ``ddp-tuned`` strategies' schedules run on DDP), which pays on the host
``tensor_ms`` per trainable tensor (its hook, on the backward thread) and ``block_ms`` per
block (the issue, in the hook that makes the block ready). Block k is issued at
``P_k = max_{j<=k} r_j``, when the hooks of every tensor ready by then have run and blocks
``0..k`` have been issued, so its release becomes ``P_k + D_k`` with
``D_k = tensor_ms #{p : ready_p <= P_k} + block_ms (k + 1)``, and backward ends at
``B + n tensor_ms + K block_ms`` (:meth:`Problem.host_releases`,
:meth:`Problem.host_backward`). Where the host runs ahead of the device (CUDA, not
launch-bound) the host's cost shows only where it exceeds the compute: ``max(P_k, D_k)`` and
``max(B, n tensor_ms + K block_ms)``. Host cost comes first; the compute-cost option then
lengthens the compute (``stretch P_k + D_k``), reading what communication cost it off the
host-charged timeline. The closed form is unchanged.

**Updates at the gates (the rule of a profile of CPU ranks, :meth:`UpdateRule.of`).** With the
problem's :class:`~usbyte_opt.planning.problem.UpdateRule` ``GATE``, overlap mode runs each
update on the training thread at the first forward gate that finds its blocks finished (or
at its own gate), as the runtime does, instead of as a delay of its availability: walking
the tensors in need order, the forward reaches p at ``t_prev + (need_p - need_prev)``, waits
there for p's last block if p's update is still pending, then spends the update time of p
and of every pending tensor finished by then (:meth:`Scorer.score` walks it in O(n) Python,
so it costs more than the closed form). It is never faster than the default (each update is
paid after its tensor's last block, and the forward never reaches a gate earlier), so the
lower bound holds for it; the compute charge is the default rule's.

Example::

    >>> stats = [(2.0, 2.0, 1.0), (6.0, 2.0, 4.0)]   # (ready, cost, tail) per block
    >>> score(stats, B=6.0, F=4.0)
    12.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..formats import Block, Mode
from .problem import Layout, Problem, Runner, UpdateRule

BlockStat = tuple[float, float, float]
"""``(ready_ms, cost_ms, tail_ms)`` of one block."""

#: The modes this closed form scores (sharded mode's is :func:`usbyte_opt.planning.sharded.sharded_time`).
MODES = (Mode.OVERLAP, Mode.FENCE)


def tails(problem: Problem) -> list[float]:
    """``update_p + F - need_p`` per tensor: how long after p is available the iteration can end."""
    F = problem.F
    return [u + F - nd for u, nd in zip(problem.update, problem.need)]


def score(stats: Sequence[BlockStat], B: float, F: float, mode: Mode = Mode.OVERLAP,
          total_update: float = 0.0) -> float:
    """Iteration time of blocks given as ``(ready, cost, tail)`` in issue order, without the
    compute-cost option (the closed form of the module docstring, one block at a time)."""
    t = 0.0
    worst = B + F
    for r, c, q in stats:
        t = (r if r > t else t) + c
        if t + q > worst:
            worst = t + q
    if mode == Mode.OVERLAP:
        return worst if worst > t else t
    return (B if B > t else t) + total_update + F


@dataclass(slots=True)
class Stats:
    """Blocks as arrays, in issue order: what :meth:`Scorer.score` reads.

    ``lo``/``hi``: the layout positions (:attr:`Scorer.member`) of the first and one past the
    last tensor the block touches; ``gs``: its first element in the layout's global element
    space (buffers one after the other)."""

    R: np.ndarray
    C: np.ndarray
    Q: np.ndarray
    nbytes: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    gs: np.ndarray

    def __len__(self) -> int:
        return len(self.R)

    def take(self, order: Sequence[int] | np.ndarray) -> Stats:
        """These blocks in another issue order (indices into this one)."""
        o = np.asarray(order, dtype=np.int64)
        return Stats(self.R[o], self.C[o], self.Q[o], self.nbytes[o], self.lo[o], self.hi[o],
                     self.gs[o])

    def splice(self, a: int, b: int, mid: Stats) -> Stats:
        """These blocks with positions ``[a, b)`` replaced by ``mid``."""
        return Stats(*(np.concatenate([x[:a], m, x[b:]])
                       for x, m in zip(self._arrays(), mid._arrays())))

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.R, self.C, self.Q, self.nbytes, self.lo, self.hi, self.gs

    @staticmethod
    def concat(parts: Sequence[Stats]) -> Stats:
        return Stats(*(np.concatenate(col) for col in zip(*(p._arrays() for p in parts))))


class _RangeMax:
    """Sparse table: the maximum of ``values[lo:hi]`` for many ranges at once, O(1) each."""

    def __init__(self, values: np.ndarray):
        levels = [np.asarray(values, dtype=float)]
        k = 1
        while 2 * k <= len(values):
            prev = levels[-1]
            levels.append(np.maximum(prev[:-k], prev[k:]))
            k *= 2
        self.levels = levels

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        span = hi - lo
        out = np.empty(len(lo))
        lvl = np.zeros(len(lo), dtype=np.int64)
        np.floor(np.log2(np.maximum(span, 1)), out=out)
        lvl[:] = out
        res = np.empty(len(lo))
        for L in np.unique(lvl):
            m = lvl == L
            tab = self.levels[int(L)]
            a, b = lo[m], hi[m] - (1 << int(L))
            res[m] = np.maximum(tab[a], tab[b])
        return res


class Scorer:
    """The one scorer of a problem and a layout (see the module docstring).

    Example::

        >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
        >>> prof = Profile("toy", forward_ms=4.0, backward_ms=6.0,
        ...     tensors=(TensorSpec("out", (250_000,), "float32", ready_ms=2.0, need_ms=3.0),
        ...              TensorSpec("inp", (250_000,), "float32", ready_ms=6.0, need_ms=0.0)),
        ...     comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
        >>> pb = Problem.from_profile(prof); lay = pb.layout()
        >>> sc = Scorer(pb, lay)
        >>> st = sc.stats([lay.whole(0), lay.whole(1)])
        >>> sc.score(st), sc.score(st, "fence")      # blocks [2, 4] and [6, 8]; forward 4 ms
        (12.0, 12.0)
    """

    def __init__(self, problem: Problem, layout: Layout):
        self.problem, self.layout = problem, layout
        self.cost = problem.cost
        self.B, self.F = problem.B, problem.F
        self.total_update = float(sum(problem.update))
        self.charges = problem.charges_cpu
        #: Whether a runner pays host cost here (:meth:`Problem.host_releases`).
        self.host = problem.charges_host
        #: Whether overlap mode runs the updates at the forward's gates (:class:`UpdateRule`).
        self.gated = problem.update_rule == UpdateRule.GATE
        #: Tensor index at each layout position (buffers one after the other).
        self.member = np.fromiter((i for m in layout.members for i in m), dtype=np.int64,
                                  count=sum(len(m) for m in layout.members))
        numel = np.asarray(layout.numel, dtype=np.int64)
        self.buf_off = np.concatenate([[0], np.cumsum(numel)[:-1]]).astype(np.int64)
        #: First element of each layout position in the global element space, and the end.
        self.gstart = np.fromiter((self.buf_off[b] + st for b, sts in enumerate(layout.starts)
                                   for st in sts), dtype=np.int64, count=len(self.member))
        self.gend = np.append(self.gstart[1:], int(numel.sum()))
        self.itemsize = np.asarray(layout.itemsize, dtype=float)
        ready = np.asarray(problem.ready, dtype=float)
        tail = np.asarray(tails(problem), dtype=float)
        self._rmax = _RangeMax(ready[self.member])
        self._qmax = _RangeMax(tail[self.member])
        self.cpb, self.cpm = problem.cpu_ms_per_block, problem.cpu_ms_per_mb
        self._need = np.asarray(problem.need, dtype=float)
        self._upd = np.asarray(problem.update, dtype=float)
        # Layout positions in the forward's need order (ties as Problem.need_order).
        pos_of = np.empty(problem.n, dtype=np.int64)
        pos_of[self.member] = np.arange(len(self.member))
        self._order = problem.need_order()
        order = np.asarray(self._order, dtype=np.int64)
        self._need_pos = pos_of[order]
        self._need_sorted = self._need[order]
        self._upd_layout = self._upd[self.member]

    # ----------------------------------------------------------------------------------------

    def stats(self, blocks: Sequence[Block]) -> Stats:
        """Arrays of ``blocks`` (issue order)."""
        k = len(blocks)
        buf = np.fromiter((b.buffer for b in blocks), dtype=np.int64, count=k)
        s = np.fromiter((b.start for b in blocks), dtype=np.int64, count=k)
        e = np.fromiter((b.end for b in blocks), dtype=np.int64, count=k)
        return self.stats_arrays(buf, s, e)

    def stats_arrays(self, buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> Stats:
        """Arrays of the blocks ``(buf[k], start[k], end[k])`` in issue order."""
        off = self.buf_off[buf]
        gs, ge = off + start, off + end
        lo = np.searchsorted(self.gstart, gs, side="right") - 1
        hi = np.searchsorted(self.gstart, ge, side="left")
        nbytes = (end - start) * self.itemsize[buf]
        C = self.cost.allreduce_ms_array(nbytes)
        return Stats(self._rmax(lo, hi), C, self._qmax(lo, hi), nbytes, lo, hi, gs)

    # ----------------------------------------------------------------------------------------

    @staticmethod
    def finishes(R: np.ndarray, C: np.ndarray) -> np.ndarray:
        """Finish time of every block: ``finish_k = C_k + max_{j<=k} (r_j - C_{j-1})``."""
        cum = np.cumsum(C)
        return cum + np.maximum.accumulate(R - (cum - C))

    def released(self, st: Stats, runner: Runner | str = Runner.RUNTIME,
                 stretch: float = 1.0) -> tuple[np.ndarray, float]:
        """``(release of each block, end of backward)`` once ``runner`` has paid its host cost
        (:meth:`Problem.host_releases`, :meth:`Problem.host_backward`; the module
        docstring), backward's compute times ``stretch``; without host cost ``(R, B)``
        times ``stretch``."""
        if not self.host:
            if stretch == 1.0:
                return st.R, self.B
            return st.R * stretch, self.B * stretch
        pb = self.problem
        return (pb.host_releases(st.R, runner, stretch),
                pb.host_backward(len(st), runner, stretch))

    def score(self, st: Stats, mode: Mode = Mode.OVERLAP,
              runner: Runner | str = Runner.RUNTIME) -> float:
        """Iteration time of the blocks ``st`` in ``mode``, run by ``runner`` (the runtime,
        or torch DDP: what host cost it pays), by the one rule of the module docstring."""
        if len(st) == 0:
            B = self.problem.host_backward(0, runner) if self.host else self.B
            return B + self.F + (self.total_update if mode == Mode.FENCE else 0.0)
        R, B = self.released(st, runner)
        fin = self.finishes(R, st.C)
        sb = sf = 1.0
        if self.charges:
            sb, sf = self._stretch(st, fin, B, mode)
            if sb != 1.0:
                R, B = self.released(st, runner, sb)
                fin = self.finishes(R, st.C)
        if self.gated and mode == Mode.OVERLAP:
            return self._gated(st, fin, B, sf)
        return self._closed(fin, st.Q, mode, B, sf)

    def _closed(self, fin: np.ndarray, Q: np.ndarray, mode: Mode, B: float, sf: float) -> float:
        """The closed form; ``B``: backward's end (stretched, host included)."""
        last = float(fin[-1])
        if mode == Mode.OVERLAP:
            floor = B + self.F * sf
            worst = float((fin + Q * sf).max()) if sf != 1.0 else float((fin + Q).max())
            return max(floor, last, worst)
        if mode == Mode.FENCE:
            return (B if B > last else last) + self.total_update + self.F
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")

    def _gated(self, st: Stats, fin: np.ndarray, B: float, sf: float) -> float:
        """Overlap-mode time with the updates at the forward's gates (:class:`UpdateRule`
        ``GATE``): walking the tensors in need order, the forward reaches p at ``t_prev +
        (need_p - need_prev)``; if p's update is still pending it waits for p's last block,
        then applies the update of p and of every pending tensor whose blocks have finished.
        Backward ends at ``B`` (stretched, host included), forward's times are stretched by
        ``sf`` (the compute charge)."""
        n = self.problem.n
        fin_t = np.empty(n)
        fin_t[self.member] = self.last_finish(st, fin)
        finish = fin_t.tolist()
        by_finish = np.argsort(fin_t, kind="stable").tolist()
        need = (self._need * sf).tolist() if sf != 1.0 else self._need.tolist()
        upd = (self._upd * sf).tolist() if sf != 1.0 else self._upd.tolist()
        F = self.F * sf
        pending = [True] * n
        ptr = 0
        t = -1.0
        prev_need = 0.0
        first = True
        for i in self._order:
            if first:
                t, first = B + need[i], False
            else:
                t += need[i] - prev_need
            if pending[i]:
                if finish[i] > t:
                    t = finish[i]
                paid = 0.0
                while ptr < n and finish[by_finish[ptr]] <= t:
                    j = by_finish[ptr]
                    ptr += 1
                    if pending[j]:
                        pending[j] = False
                        paid += upd[j]
                if pending[i]:
                    pending[i] = False
                    paid += upd[i]
                t += paid
            prev_need = need[i]
        end = t + F - prev_need
        last = float(fin[-1])
        return end if end > last else last

    def stretch(self, st: Stats, fin: np.ndarray | None = None,
                mode: Mode = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME
                ) -> tuple[float, float]:
        """``(backward factor, forward factor)`` that the compute-cost option applies to the
        blocks ``st`` in ``mode`` run by ``runner``; ``(1, 1)`` without the option. ``fin``:
        the blocks' finishes without the charge (host cost included), computed if not given."""
        if not self.charges:
            return 1.0, 1.0
        R, B = self.released(st, runner)
        if fin is None:
            fin = self.finishes(R, st.C)
        return self._stretch(st, fin, B, mode)

    def _stretch(self, st: Stats, fin: np.ndarray, B: float, mode: Mode) -> tuple[float, float]:
        """:meth:`stretch` given the finishes and backward's end ``B`` (host included) of the
        timeline without the charge. What backward paid lengthens its compute, ``self.B``."""
        start = fin - st.C
        rate = (self.cpb + self.cpm * st.nbytes / 1e6) / np.maximum(st.C, 1e-300)
        F = self.F
        bwd = np.clip(np.minimum(fin, B) - start, 0.0, None)
        sb = 1.0 + float(rate @ bwd) / self.B if self.B > 0 else 1.0
        if mode == Mode.FENCE or F <= 0 or fin[-1] <= B:
            return sb, 1.0
        done = self.forward_progress(st, fin, np.concatenate([start, fin]), B)
        fwd = done[len(fin):] - done[:len(fin)]
        return sb, 1.0 + float(rate @ fwd) / F

    def last_finish(self, st: Stats, fin: np.ndarray) -> np.ndarray:
        """Finish of the last block covering each layout position (the blocks in element
        order: a position's blocks are a contiguous run of them)."""
        by_pos = np.argsort(st.gs, kind="stable")
        gsort = st.gs[by_pos]
        fsort = np.append(fin[by_pos], -np.inf)
        a = np.searchsorted(gsort, self.gstart, side="right") - 1
        b = np.searchsorted(gsort, self.gend, side="left")
        idx = np.empty(2 * len(a), dtype=np.int64)
        idx[0::2], idx[1::2] = a, b
        return np.maximum.reduceat(fsort, idx)[0::2]

    def forward_progress(self, st: Stats, fin: np.ndarray, at: np.ndarray,
                         B: float | None = None) -> np.ndarray:
        """Forward compute done by each wall time in ``at`` (overlap mode, updates as
        availability delays, no charge), backward ending at ``B`` (default the problem's)."""
        B = self.B if B is None else B
        avail = (self.last_finish(st, fin) + self._upd_layout)[self._need_pos]
        need = self._need_sorted
        M = np.maximum.accumulate(np.maximum(avail - need, B))
        M = np.concatenate([[B], M])                        # M_0 = B before the first gate
        need0 = np.concatenate([[0.0], need])               # need_0 = 0
        need1 = np.concatenate([need, [self.F]])            # the next gate's need (F at the end)
        S = need0 + M                                       # where each compute window starts
        j = np.searchsorted(S, at, side="right") - 1
        jc = np.maximum(j, 0)
        done = np.minimum(at - M[jc], need1[jc])
        return np.where(j < 0, 0.0, done)


def scorer_for(problem: Problem, layout: Layout) -> Scorer:
    """The :class:`Scorer` of ``problem`` and ``layout``, built once per pair (kept in
    ``problem.cache``; strategies share the default layout)."""
    key = ("scorer", id(layout))
    hit = problem.cache.get(key)
    if hit is None or hit[0] is not layout:
        hit = problem.cache[key] = (layout, Scorer(problem, layout))
    return hit[1]


def block_stats(problem: Problem, layout: Layout, blocks: Sequence[Block],
                tail: Sequence[float] | None = None) -> list[BlockStat]:
    """``(ready, cost, tail)`` of every block, as Python tuples (for small instances)."""
    tail = tails(problem) if tail is None else tail
    ready, cost = problem.ready, problem.cost
    out = []
    for k in blocks:
        idx = layout.tensors_of(k.buffer, k.start, k.end)
        out.append((max(ready[i] for i in idx),
                    cost.allreduce_ms((k.end - k.start) * layout.itemsize[k.buffer]),
                    max(tail[i] for i in idx)))
    return out


def evaluate(problem: Problem, layout: Layout, blocks: Sequence[Block],
             mode: Mode = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME) -> float:
    """Iteration time of ``blocks`` on ``problem`` in ``mode``, run by ``runner`` (same value
    as the simulator)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    sc = scorer_for(problem, layout)
    return sc.score(sc.stats(blocks), mode, runner)


def charged(problem: Problem, layout: Layout, blocks: Sequence[Block],
            mode: Mode = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME) -> Problem:
    """``problem`` with each compute phase lengthened by what ``blocks``, run by ``runner``,
    cost it in ``mode`` (the module docstring's rule); ``problem`` itself without the
    compute-cost option. Host cost stays to be charged on the result."""
    if not problem.charges_cpu:
        return problem
    sc = scorer_for(problem, layout)
    sb, sf = sc.stretch(sc.stats(blocks), mode=mode, runner=runner)
    return problem.stretched(sb, sf)
