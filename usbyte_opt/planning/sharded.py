"""Sharded mode's iteration model (walked and in closed form), its lower bound, its all-gathers.

The sharded-mode part of the one iteration model: :func:`simulate_sharded` walks it step by
step, as :mod:`usbyte_opt.planning.simulate` walks overlap and fence mode (and dispatches
sharded mode here), on the same :class:`~usbyte_opt.planning.timeline.Timeline`;
:func:`sharded_time` is its closed form, the same number (tests check it), what the planner
scores sharded plans with, as :mod:`usbyte_opt.planning.fastsim` is for the other modes.

Sharded mode (:attr:`~usbyte_opt.formats.Mode.SHARDED`, ZeRO-1) replaces each block's
all-reduce by a reduce-scatter in backward and an all-gather of the updated parameters before
the next forward needs them (docs/planner.md, "Sharded mode"). Time origin is the start of
backward; milliseconds and bytes; one channel, one collective at a time.

* **Reduce-scatters**, one per block in issue order: ``start_k = max(ready_k, finish_{k-1})``,
  ``finish_k = start_k + rs(bytes_k)`` (``rs``: the cost model's
  :meth:`~usbyte_opt.planning.cost.CostModel.reduce_scatter_ms`, of the whole block's bytes).
* **The shard step** runs on the training thread once backward has ended and every
  reduce-scatter has finished; each rank steps ``1 / world_size`` of every tensor, so it takes
  ``u = sum(update) / world_size``: ``t_s = max(B, finish_last) + u``.
* **All-gathers**, one per group of blocks (:attr:`Schedule.gathers
  <usbyte_opt.formats.Schedule.gathers>`), issued at ``t_s`` in their order, back to back:
  ``finish_g = t_s + sum_{h <= g} ag(bytes_h)``. Tensor p is available once every group
  holding its blocks has finished: ``avail_p = max_g finish_g``.
* **Forward** starts at ``t_s`` and waits at each tensor for its availability, as overlap mode
  does: ``t_p = max(t_prev + need_p - need_prev, avail_p)``, ending at ``t_last + F - need_last``.
  ``T = max(forward end, finish of the last all-gather)``.

Unrolling the forward as in :mod:`usbyte_opt.planning.fastsim` gives the closed form

    T = max(B, finish_last) + u + A,    A = max(F, max_g (AG_g + q_g))

where ``AG_g`` is the all-gathers' cumulative time up to group g and ``q_g = max_{p in g}
(F - need_p)``: the reduce-scatter phase and the all-gather phase add. **Compute cost of
communication** (the profile's ``cpu_ms_per_block``/``cpu_ms_per_mb``): one rule, as in the
other modes: each collective costs the training thread :meth:`Problem.block_cpu_ms` of its
bytes spread over its wire time, the thread pays the part that overlaps its compute
(backward for the reduce-scatters, the step and the forward's compute for the all-gathers),
backward and forward are lengthened by what they paid and the iteration is evaluated again.

**Lower bound** (:func:`sharded_lower_bound`), valid for every sharded schedule: with the
cost model's lines at or below each collective
(:meth:`~usbyte_opt.planning.cost.CostModel.shard_bounds`),

    T >= max(B, C*_rs) + u + A*

*Proof.* ``finish_last >= C*_rs``, the least time at which every gradient can be
reduce-scattered when a block may carry any released bytes (claim 2 of
:mod:`usbyte_opt.planning.bounds`, with the reduce-scatter line). For the all-gather phase,
relax: any bytes may go in any group, a group costs ``alpha_ag + beta_ag * bytes``. Given any
grouping, refill the same group sizes with the bytes sorted by descending tail ``q``; every
``AG_g`` is unchanged, and the tail of group g becomes the tail of the first byte after the
``P_{g-1}`` bytes of groups before g. Only ``P_{g-1}`` bytes have a larger tail, so some group
``h >= g`` of the original held a byte of at least that tail, and ``AG_h >= AG_g``: no term
grows. In the sorted order a tensor split between two groups can move wholly into the later
one (the earlier finishes sooner, no tail grows), so ``A*``, the best grouping of whole tensors
contiguous in descending-tail order, is at most ``A`` of every schedule. ``A*`` is computed
exactly (:func:`gather_grouping`). The compute-cost option only lengthens compute, and T is
nondecreasing in every compute time, so the bound without it holds with it. ∎

With the compute-cost option and collectives that cost exactly their lines, also
``T >= B + F + u + max_lambda sum_j min((1 - lambda) D_j, lambda C)``, with ``D_j`` the wire
time of one reduce-scatter (j = 1) and one all-gather (j = 2) of every byte and ``C`` the
thread's charge of one block of every byte (:func:`usbyte_opt.planning.bounds.charge_floor`).
*Proof*, as claim 3 of :mod:`usbyte_opt.planning.bounds`: the charged iteration is at least
``B + F + u`` plus what the collectives' overlap with compute charged, the uncharged one, no
longer, at least ``B + F + u`` plus their wire time outside compute; a mix of the two is at
least, per collective, a concave function of each block's bytes that is not negative at zero,
so at least its value for one block of every byte, since the blocks of each collective carry
every byte once. ∎

No torch import.

Example (two tensors; all-reduce alpha 1 ms at 1 GB/s, so each collective half of that)::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> from usbyte_opt.planning.problem import Problem
    >>> prof = Profile("toy", forward_ms=4.0, backward_ms=6.0,
    ...     tensors=(TensorSpec("out", (250_000,), "float32", ready_ms=2.0, need_ms=3.0),
    ...              TensorSpec("inp", (250_000,), "float32", ready_ms=6.0, need_ms=0.0)),
    ...     comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
    >>> pb = Problem.from_profile(prof); lay = pb.layout()
    >>> blocks = [lay.whole(0), lay.whole(1)]       # reduce-scatters: 2-3, then 6-7
    >>> tl = simulate_sharded(pb, lay, blocks, [(1,), (0,)])
    >>> [(g.start_ms, g.finish_ms) for g in tl.gathers]   # "inp" first: the forward needs it first
    [(7.0, 8.0), (8.0, 9.0)]
    >>> tl.iteration_ms             # forward from 7, waits for "inp" until 8, "out" ready at 11
    12.0
    >>> sharded_lower_bound(pb)     # max(6, 7) + 0 + (0.5 + 1 ms for "inp" + 4 ms of forward)
    12.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import MismatchError
from ..formats import Block, Mode
from .bounds import _batch_makespan, charge_floor
from .problem import Layout, Problem
from .timeline import BlockTiming, ForwardGate, GatherTiming, Timeline, with_compute_charge

#: Optimizer state per element, in units of the parameter's element size, by the profile's
#: ``meta.optimizer``: SGD with momentum keeps a momentum buffer, Adam and AdamW two moments.
STATE_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2}
#: What :func:`state_slots` assumes when a profile does not say which optimizer it timed.
DEFAULT_OPTIMIZER = "adam"


def state_slots(problem: Problem, optimizer: str | None = None) -> int:
    """Optimizer state per element (in element sizes) of ``optimizer``, by default the one the
    profile timed (``meta.optimizer``), else :data:`DEFAULT_OPTIMIZER`.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([10, 10]))
        >>> state_slots(pb), state_slots(pb, "sgd")
        (2, 1)
    """
    name = optimizer or str(problem.profile.meta.get("optimizer") or DEFAULT_OPTIMIZER)
    return STATE_SLOTS.get(name, STATE_SLOTS[DEFAULT_OPTIMIZER])


def state_bytes(problem: Problem, layout: Layout, blocks: Sequence[Block] | None,
                slots: int) -> int:
    """Optimizer-state bytes on the rank that holds the most: ``slots`` element sizes per
    element of the gradients, all of them unsharded (``blocks`` None), or in sharded mode
    the ``ceil(L / world_size)`` elements of each block that the runtime gives rank 0.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([10, 5], world_size=2)); lay = pb.layout()
        >>> state_bytes(pb, lay, None, 2), state_bytes(pb, lay, [Block(0, 0, 15)], 2)
        (120, 64)
    """
    if blocks is None:
        return slots * problem.total_bytes
    ws = problem.profile.comm.world_size
    return slots * sum(-(-(k.end - k.start) // ws) * layout.itemsize[k.buffer] for k in blocks)


@dataclass(slots=True)
class _Blocks:
    """Per block: ready time, bytes, tensor indices, tail ``max (F - need)``."""

    ready: list[float]
    nbytes: list[int]
    tensors: list[list[int]]
    tail: list[float]


def _blocks(problem: Problem, layout: Layout, blocks: Sequence[Block]) -> _Blocks:
    F = problem.F
    out = _Blocks([], [], [], [])
    covered = [False] * problem.n
    for blk in blocks:
        idx = layout.tensors_of(blk.buffer, blk.start, blk.end)
        for i in idx:
            covered[i] = True
        out.ready.append(max(problem.ready[i] for i in idx))
        out.nbytes.append((blk.end - blk.start) * layout.itemsize[blk.buffer])
        out.tensors.append(idx)
        out.tail.append(max(F - problem.need[i] for i in idx))
    if not all(covered):
        raise MismatchError(f"tensor {problem.names[covered.index(False)]!r} is covered by no block")
    return out


def _check_gathers(gathers: Sequence[Sequence[int]], n: int) -> None:
    seen = sorted(k for g in gathers for k in g)
    if seen != list(range(n)):
        raise MismatchError(f"gathers: expected every block index 0..{n - 1} exactly once, "
                            f"got {[list(g) for g in gathers]}")


def default_gathers(n_blocks: int) -> list[tuple[int, ...]]:
    """One all-gather per block, in reverse block order (what a schedule without ``gathers``
    runs, :meth:`usbyte_opt.formats.Schedule.gather_groups`)."""
    return [(k,) for k in reversed(range(n_blocks))]


def sharded_time(problem: Problem, layout: Layout, blocks: Sequence[Block],
                 gathers: Sequence[Sequence[int]] | None = None) -> float:
    """Iteration time of ``blocks`` (reduce-scatters, issue order) and ``gathers`` in sharded
    mode: the closed form of the module docstring (the same number as
    :func:`simulate_sharded`, which the tests check)."""
    if problem.charges_cpu:
        return simulate_sharded(problem, layout, blocks, gathers).iteration_ms
    gathers = default_gathers(len(blocks)) if gathers is None else gathers
    st = _blocks(problem, layout, blocks)
    cost = problem.cost
    t = 0.0
    for r, b in zip(st.ready, st.nbytes):
        t = (r if r > t else t) + cost.reduce_scatter_ms(b)
    t_s = max(problem.B, t) + sum(problem.update) / problem.profile.comm.world_size
    acc, worst = 0.0, problem.F
    for g in gathers:
        acc += cost.all_gather_ms(sum(st.nbytes[k] for k in g))
        worst = max(worst, acc + max(st.tail[k] for k in g))
    return t_s + worst


def simulate_sharded(problem: Problem, layout: Layout, blocks: Sequence[Block],
                     gathers: Sequence[Sequence[int]] | None = None) -> Timeline:
    """The step-by-step timeline of sharded mode (module docstring): its ``blocks`` are the
    reduce-scatters, its ``gathers`` the all-gathers, ``update_ms`` the shard step, and
    ``forward_start_ms`` the end of the step. With the compute-cost option it is the charged
    iteration's, ``meta["cpu_charge_ms"]`` holding what backward and forward paid."""
    gathers = default_gathers(len(blocks)) if gathers is None else [tuple(g) for g in gathers]
    _check_gathers(gathers, len(blocks))
    tl = _walk(problem, layout, blocks, gathers)
    if not problem.charges_cpu:
        return tl
    return with_compute_charge(problem, tl, lambda pb: _walk(pb, layout, blocks, gathers))


def _walk(problem: Problem, layout: Layout, blocks: Sequence[Block],
          gathers: Sequence[tuple[int, ...]]) -> Timeline:
    st = _blocks(problem, layout, blocks)
    cost, names = problem.cost, problem.names
    rs: list[BlockTiming] = []
    prev = busy = 0.0
    for k, blk in enumerate(blocks):
        start = max(st.ready[k], prev)
        dur = cost.reduce_scatter_ms(st.nbytes[k])
        prev = start + dur
        busy += dur
        rs.append(BlockTiming(k, blk.buffer, blk.start, blk.end, st.nbytes[k],
                              tuple(names[i] for i in st.tensors[k]), st.ready[k], start, prev))
    u = sum(problem.update) / problem.profile.comm.world_size
    t_s = max(problem.B, prev) + u
    avail = [t_s] * problem.n
    ag: list[GatherTiming] = []
    t = t_s
    for g_i, grp in enumerate(gathers):
        nbytes = sum(st.nbytes[k] for k in grp)
        dur = cost.all_gather_ms(nbytes)
        ts = sorted({i for k in grp for i in st.tensors[k]})
        ag.append(GatherTiming(g_i, tuple(grp), nbytes, tuple(names[i] for i in ts), t, t + dur))
        t += dur
        busy += dur
        for i in ts:
            avail[i] = max(avail[i], t)
    gates: list[ForwardGate] = []
    reach: float | None = None
    prev_need = 0.0
    for i in problem.need_order():
        least = t_s + problem.need[i] if reach is None else reach + (problem.need[i] - prev_need)
        reach = max(least, avail[i])
        gates.append(ForwardGate(names[i], problem.need[i], avail[i], reach, reach - least))
        prev_need = problem.need[i]
    fwd_end = (t_s if reach is None else reach) + problem.F - prev_need
    return Timeline(Mode.SHARDED, max(fwd_end, t), problem.B, problem.F, t_s, fwd_end, busy,
                    tuple(rs), tuple(gates), u, gathers=tuple(ag))


# --------------------------------------------------------------------------------------------
# The all-gather phase: the best grouping
# --------------------------------------------------------------------------------------------


def gather_grouping(nbytes: Sequence[float], tails: Sequence[float], alpha: float, beta: float,
                    F: float = 0.0, cost: Sequence[Sequence[float]] | None = None,
                    ) -> tuple[float, list[tuple[int, ...]]]:
    """The best grouping of items for the all-gather phase, and its length ``A``.

    Items (blocks, or tensors for the bound) are all available at once; they are taken in
    descending ``tails`` order and cut into contiguous groups, a group costing ``alpha + beta
    * bytes``; ``A = max(F, max_g (AG_g + max tail in g))``. Returns ``(A, groups)``, each
    group the item indices in issue order. Exact over contiguous groupings in that order
    (which :func:`sharded_lower_bound`'s proof shows optimal for whole items): a binary search
    on ``A`` whose test is a dynamic programme, the fewest groups that cover the first j
    items within ``A`` (fewer groups so far never hurt later ones).

    Example::

        >>> gather_grouping([1e6, 1e6, 1e6], [5.0, 4.0, 0.0], alpha=1.0, beta=1e-6)
        (8.0, [(0, 1), (2,)])
    """
    n = len(nbytes)
    if n == 0:
        return F, []
    order, q, P = _by_tail(nbytes, tails, beta)
    lo = max(F, alpha + float(P[n]) + float(q[-1]), alpha + float(P[1]) + float(q[0]))
    hi = max(F, alpha + float(P[n]) + float(q[0]))
    best = _fewest_groups(P, q, alpha, hi)
    assert best is not None
    for _ in range(48):
        if hi - lo <= 1e-7 * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        got = _fewest_groups(P, q, alpha, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    groups = _groups(order, best)
    return _phase_length(nbytes, tails, groups, alpha, beta, F), groups


def gather_groupings(nbytes: Sequence[float], tails: Sequence[float], alpha: float,
                     beta: float, F: float = 0.0, count: int = 16) -> list[list[tuple[int, ...]]]:
    """Groupings of the items (as :func:`gather_grouping`) from the best one to one group:
    the fewest groups within ``count`` phase lengths evenly spaced between the two, coarser
    each (what ``best-sharded`` trades against the reduce-scatters' latency)."""
    n = len(nbytes)
    if n == 0:
        return [[]]
    a_star, first = gather_grouping(nbytes, tails, alpha, beta, F)
    order, q, P = _by_tail(nbytes, tails, beta)
    top = max(F, alpha + float(P[n]) + float(q[0]))
    out, seen = [first], {tuple(first)}
    for target in np.linspace(a_star, top, count + 1)[1:]:
        cuts = _fewest_groups(P, q, alpha, float(target))
        if cuts is None:
            continue
        g = _groups(order, cuts)
        if tuple(g) not in seen:
            seen.add(tuple(g))
            out.append(g)
    return out


def _by_tail(nbytes: Sequence[float], tails: Sequence[float], beta: float,
             ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The items in descending tail order (ties: index), their tails, and the prefix sums of
    their wire times ``beta * bytes`` (``P[0] = 0``)."""
    order = sorted(range(len(nbytes)), key=lambda i: (-tails[i], i))
    q = np.asarray([tails[i] for i in order], dtype=float)
    w = np.asarray([nbytes[i] for i in order], dtype=float) * beta
    return order, q, np.concatenate([[0.0], np.cumsum(w)])


def _groups(order: Sequence[int], starts: Sequence[int]) -> list[tuple[int, ...]]:
    ends = list(starts[1:]) + [len(order)]
    return [tuple(order[i] for i in range(a, b)) for a, b in zip(starts, ends)]


def _fewest_groups(P: np.ndarray, q: np.ndarray, alpha: float,
                   target: float) -> list[int] | None:
    """Where the groups start, for the fewest groups (contiguous, items in the order of ``q``,
    prefix sums of their wire times ``P``) whose every ``AG_g + tail_g <= target``; None if
    none do. ``f[j]``, the fewest groups covering items ``[0, j)``, is all later groups care
    about: fewer groups so far never delay one."""
    n = len(q)
    f = np.full(n + 1, np.inf)
    f[0] = 0
    cut = np.zeros(n + 1, dtype=np.int64)
    lim = target + 1e-9
    # With alpha 0 an unreachable prefix (inf) gives inf * 0 = nan, which fails the test as inf
    # would: unreachable either way, so numpy's warning says nothing.
    with np.errstate(invalid="ignore"):
        for j in range(1, n + 1):
            cand = f[:j] + 1
            ok = cand * alpha + P[j] + q[:j] <= lim
            if not ok.any():
                continue
            cand = np.where(ok, cand, np.inf)
            i = int(np.argmin(cand))
            f[j], cut[j] = cand[i], i
    if f[n] == np.inf:
        return None
    starts, j = [], n
    while j > 0:
        starts.append(int(cut[j]))
        j = starts[-1]
    return starts[::-1]


def _phase_length(nbytes: Sequence[float], tails: Sequence[float],
                  groups: Sequence[Sequence[int]], alpha: float, beta: float, F: float) -> float:
    acc, worst = 0.0, F
    for g in groups:
        acc += alpha + beta * sum(nbytes[i] for i in g)
        worst = max(worst, acc + max(tails[i] for i in g))
    return worst


def sharded_lower_bound(problem: Problem) -> float:
    """The lower bound of the module docstring, in ms: no sharded schedule of ``problem``
    runs faster (its compute-cost option included)."""
    (a_rs, b_rs), (a_ag, b_ag) = problem.cost.shard_bounds()
    order = problem.ready_order()
    rs_end = _batch_makespan([problem.ready[i] for i in order],
                             [problem.nbytes(i) * b_rs for i in order], a_rs)
    u = sum(problem.update) / problem.profile.comm.world_size
    tails = [problem.F - nd for nd in problem.need]
    a_star, _ = gather_grouping([problem.nbytes(i) for i in range(problem.n)], tails,
                                a_ag, b_ag, problem.F)
    return max(max(problem.B, rs_end) + u + a_star, _compute_cost_bound(problem, u))


def _compute_cost_bound(problem: Problem, u: float) -> float:
    """Claim 3 of :mod:`usbyte_opt.planning.bounds` for sharded mode (module docstring);
    ``-inf`` without the compute-cost option or with collectives that are not lines."""
    if not problem.charges_cpu or not problem.cost.is_linear:
        return -math.inf
    total = float(problem.total_bytes)
    wires = [alpha + beta * total for alpha, beta in problem.cost.shard_bounds()]
    return problem.B + problem.F + u + charge_floor(wires, problem.block_cpu_ms(total))


def one_dtype_each(layout: Layout, blocks: Sequence[Block],
                   gathers: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """``gathers`` with every group that mixes dtypes split into one group per dtype, in place
    (one all-gather moves one dtype: the runtime gathers a group through one tensor).

    Example::

        >>> from usbyte_opt.formats import Buffer
        >>> lay = Layout((Buffer("float32", ("a",)), Buffer("float16", ("b",))), [[0], [1]],
        ...              [[0], [0]], [4, 4], [4, 2], [(0, 0, 4), (1, 0, 4)])
        >>> one_dtype_each(lay, [Block(0, 0, 4), Block(1, 0, 4)], [(1, 0)])
        [(1,), (0,)]
    """
    out: list[tuple[int, ...]] = []
    for g in gathers:
        by: dict[str, list[int]] = {}
        for k in g:
            by.setdefault(layout.buffers[blocks[k].buffer].dtype, []).append(k)
        out += [tuple(ks) for ks in by.values()]
    return out


def best_gathers(problem: Problem, layout: Layout,
                 blocks: Sequence[Block]) -> list[tuple[int, ...]]:
    """The best all-gather grouping of ``blocks`` (:func:`gather_grouping` over the blocks,
    with the cost model's all-gather line; a group of several dtypes split,
    :func:`one_dtype_each`), checked against one all-gather per block in
    reverse order by the cost model itself (it may not be a line)."""
    st = _blocks(problem, layout, blocks)
    _, (a_ag, b_ag) = problem.cost.shard_bounds()
    _, groups = gather_grouping(st.nbytes, st.tail, a_ag, b_ag, problem.F)
    groups = one_dtype_each(layout, blocks, groups)
    if problem.cost.is_linear:
        return groups
    alt = default_gathers(len(blocks))
    return min((groups, alt), key=lambda g: sharded_time(problem, layout, blocks, g))


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# --------------------------------------------------------------------------------------------
# Building sharded plans
# --------------------------------------------------------------------------------------------


def forward_gathers(problem: Problem, layout: Layout,
                    blocks: Sequence[Block]) -> list[tuple[int, ...]]:
    """One all-gather per block, in the order the forward needs them (descending tail; ties:
    the later block first): what FSDP and DeAR issue."""
    st = _blocks(problem, layout, blocks)
    return [(k,) for k in sorted(range(len(blocks)), key=lambda k: (-st.tail[k], -k))]


def sequence(layout: Layout) -> list[tuple[int, int]]:
    """Every tensor of ``layout`` as ``(buffer, tensor index)``, buffers one after the other."""
    return [(b, t) for b, members in enumerate(layout.members) for t in members]


def partition(problem: Problem, layout: Layout, forced: Sequence[bool] | None = None,
              ) -> list[Block]:
    """Whole-tensor reduce-scatter blocks over ``layout``, contiguous in its order, that end
    the reduce-scatters soonest (the recurrence of claim 2 of :mod:`usbyte_opt.planning.bounds`
    with the reduce-scatter line), with a cut wherever ``forced[i]`` says before the i-th
    tensor of :func:`sequence` (and always between buffers). Issue order: by ready time."""
    seq = sequence(layout)
    n = len(seq)
    (alpha, beta), _ = problem.cost.shard_bounds()
    r = np.asarray([problem.ready[t] for _, t in seq], dtype=float)
    w = np.asarray([problem.nbytes(t) for _, t in seq], dtype=float) * beta
    P = np.concatenate([[0.0], np.cumsum(w)])
    g = np.zeros(n + 1)
    back = np.zeros(n + 1, dtype=np.int64)
    lo = 0
    for b in range(1, n + 1):
        i = b - 1
        if i > 0 and (seq[i][0] != seq[i - 1][0] or (forced is not None and forced[i])):
            lo = i
        rel = np.maximum.accumulate(r[lo:b][::-1])[::-1]  # release of block (a, b]: its max
        cand = np.maximum(g[lo:b], rel) + alpha + (P[b] - P[lo:b])
        a = int(np.argmin(cand))
        g[b], back[b] = cand[a], lo + a
    runs, b = [], n
    while b > 0:
        runs.append((int(back[b]), b))
        b = runs[-1][0]
    out = []
    for a, b in reversed(runs):
        buf = seq[a][0]
        out.append(Block(buf, layout.pos[seq[a][1]][1], layout.pos[seq[b - 1][1]][2]))
    return sort_by_ready(problem, layout, out)


def sort_by_ready(problem: Problem, layout: Layout, blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` in the order their gradients are final (ties: layout order)."""
    def key(k: Block) -> tuple[float, int, int]:
        return (max(problem.ready[i] for i in layout.tensors_of(k.buffer, k.start, k.end)),
                k.buffer, k.start)
    return sorted(blocks, key=key)
