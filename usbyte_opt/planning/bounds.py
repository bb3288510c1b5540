"""A lower bound on the iteration time of *any* schedule of a profile, in either mode.

Not a model of an iteration: a proven floor under every schedule the iteration model
(:mod:`usbyte_opt.planning.simulate`, :mod:`usbyte_opt.planning.fastsim`) can time, which
``optimize`` reports each plan's gap to and ``best`` stops at. Sharded mode's bound is
:func:`usbyte_opt.planning.sharded.sharded_lower_bound`.

Notation (docs/design.md §2.5, and :mod:`usbyte_opt.planning.fastsim` for the closed form): tensor p has
release ``r_p = ready_p``, transfer time ``w_p = bytes_p * beta`` and tail
``q_p = update_p + F - need_p``. ``alpha`` and ``beta`` are the cost model's linear bound
(:meth:`usbyte_opt.planning.cost.CostModel.linear_bound`): a block costs *at least*
``alpha`` plus its bytes times ``beta``, which is all claims 1, 2 and 4 use, so they hold for
any cost model; claim 3 needs the cost to be that line (:attr:`~usbyte_opt.planning.cost.CostModel.is_linear`)
and is left out otherwise. For every schedule in overlap mode without the compute-cost
option,

    T = max(B + F, finish_last, max_p (finish of the last block covering p) + q_p).

**Claim.** For every non-empty set S of tensors, with ``W_S = sum_{p in S} w_p``,

    T >= W_S + min( max_{p in S} r_p + alpha + max_{p in S} q_p ,
                    min_{p in S} r_p + 2 alpha + min_{p in S} q_p ).

*Proof.* Every byte of S travels in some block, a block touching p starts no earlier than
r_p, the channel runs one block at a time, and each block costs at least alpha plus its bytes
times beta. Let k be the last block (in issue order) carrying bytes of S, and p a tensor of S in k,
so ``T >= finish(k) + q_p >= finish(k) + min_S q``.
(i) If one block carries all of S, it touches every p in S: it starts at or after
``max_S r``, costs at least ``alpha + W_S``, and its finish plus the tail of *each* p in S
bounds T, so ``T >= max_S r + alpha + W_S + max_S q``.
(ii) Otherwise at least two blocks carry S. The first of them starts at or after ``min_S r``,
and from then until ``finish(k)`` the channel sends at least those two blocks back to back at
best: ``finish(k) >= min_S r + 2 alpha + W_S``. In both cases T is at least the smaller of the
two expressions. Also ``T >= B + F`` (compute alone). ∎

**Claim 2 (latency-aware).** For every set S, ``T >= C*(S) + min_{p in S} q_p``, where
``C*(S)`` is the least time at which S alone can be all-reduced when a block may carry any
released bytes of S (no contiguity, any split) and costs ``alpha`` plus its bytes.

*Proof.* Drop from every block the bytes of tensors outside S, and drop blocks left empty:
blocks only get shorter, none starts earlier than the release of what it still carries, so
this is a schedule of S alone, finishing no later than the last block that carried S.
Add the tail of a tensor of S in that block. ∎

``C*(S)`` is computed exactly: moving bytes into an earlier block where they were already
released never delays the last finish, so some optimal schedule sends, at each block start,
everything of S released and unsent; the choice left is when blocks start, a dynamic
programme over S in release order, ``g(b) = min_a max(g(a), r_b) + alpha + W(a..b]``. It is
evaluated for ``S = {p : q_p >= theta}`` over up to 48 quantiles ``theta`` of the tails.
Claim 2 is what counts the per-block latency where the first claim counts at most two.

**Claim 4 (nested windows).** Claims 1 and 2 count at most two blocks, or the blocks of one
set; what they miss is that a tensor released late with a long tail (the input side, in
backward's last milliseconds) and the bulk released earlier compete for the same few blocks
around the end of backward. For a fixed T, tensor p can only travel in a block lying inside
its *window* ``[r_p, d_p]``, ``d_p = T - q_p`` (the block starts at or after ``r_p``; its
finish plus ``q_p`` is at most T). Take items ``1..G`` with ``r`` and ``q`` nondecreasing in
the index (a relaxation of the tensors, below), so that the windows are nested:
window ``j`` lies inside window ``k`` for ``j >= k``. Write ``W_k`` for the wire time of items
``k..G``. Then every schedule of time T has sets ``A``, ``C`` of indices, both holding ``G``,
such that for every k, with ``lo(k) = min(A ∩ [k, G])``, ``hi(k) = min(C ∩ [k, G])`` and
``n(k) = |A ∩ [k, G]| + |C ∩ [k, G]|``,

    r_lo(k) + q_hi(k) + alpha (n(k) - 1) + W_k <= T.                          (*)

So T is at least the least T for which some ``A``, ``C`` satisfy (*).

*Proof.* Blocks are disjoint intervals of the channel in issue order, each at least alpha plus
its bytes times beta long. For each k let ``run(k)`` be the blocks inside window k: they are
consecutive (those starting at or after ``r_k`` and finishing by ``d_k``), and not empty
(item k travels in one of them); its first block, ``first(k)``, is the first block of the
schedule that starts at or after ``r_k``, and its last, ``last(k)``, the last that finishes by
``d_k``. Every item ``j >= k`` travels inside window ``j``, which lies in window k, so
``run(k)`` carries ``W_k`` of wire time: ``W_k + alpha |run(k)| <= finish(last(k)) -
start(first(k))``. Let ``a(k) = max {a : r_a <= start(first(k))}`` and ``c(k) = max {c : q_c
<= T - finish(last(k))}``; both are at least k, and ``W_k + alpha |run(k)| <= d_c(k) -
r_a(k)``. Put ``A = {a(k)}``, ``C = {c(k)}``; ``a(G) = c(G) = G``. (i) ``lo(k) = a(k)``:
for ``j >= k``, ``first(j)`` is not before ``first(k)``, so ``a(j) >= a(k)``; for ``j < k``,
``first(j)`` is not after ``first(k)``, so ``a(j) <= a(k)``, and ``a(j) >= k`` would make
``first(j)`` start at or after ``r_k``, so ``first(j) = first(k)``. Likewise ``hi(k) =
c(k)``. (ii) ``n(k) <= |run(k)| + 1``: distinct values ``a(j) >= k`` come from distinct
blocks ``first(j)``, all in ``run(k)`` (by (i) they are ``first(k)`` or the first blocks of
runs inside it) and all at or before ``first(G)``; distinct ``c(j) >= k`` come from distinct
blocks ``last(j)`` in ``run(k)`` at or after ``last(G)``; and ``first(G)`` is not after
``last(G)``, so at most one block is counted twice. (i) and (ii) give (*). ∎

*The items.* Lowering a tensor's release or tail only widens its window, so the proof holds
for any items whose windows contain those of their tensors: tensors in release order with
each tail lowered to the least tail released at or after it (suffix minima), or in tail order
with each release lowered to the least release of a tail at or above it; the bound takes the
larger of the two. Where the tensors are nested themselves (chains: released later, needed
sooner) the bound is attained whenever its blocks can be filled with pieces of the tensors,
which is how ``best`` builds its bound-guided candidates.

*Computing it.* (*) at level k depends on the state ``(lo, hi, n)``, built from level G
down: at each level k, k may join A, C or both. Three facts make this small. (a) A state
with ``r_lo``, ``q_hi`` and ``n`` each no larger than another's can copy every continuation of
the other and stay feasible. (b) A state that satisfies (*) at level k need not add k: copy
any continuation that adds k to A (or C), postponing the addition to the first later level
where the copy breaks (*) or the original adds to A (C) again; there the copy adds the
pending sides, and its state is then at least as good (a smaller release or tail, the same
count), and before it breaks nothing. (c) A state that breaks (*) adds one side if one
suffices (then, by (b), not the other). So the states that satisfy (*) run unchanged from
level to level; the next level where one breaks (*) is found by bisection on ``W`` (it grows as
k falls), and only there does it branch. States dominated as in (a) are dropped, and beyond
:data:`NESTED_STATES` states the two with the closest tails are replaced by their
componentwise minimum, which dominates both (it can only make the programme accept more, so
the bound stays valid). Feasibility grows with T; the bound is found by bisection and
reported as the largest T found infeasible.

**Fence mode and the compute-cost option.** For the same blocks, fence mode is never faster
than overlap mode without the option (``max(B, L) + sum(update) + F`` is at least ``B + F``,
``L`` and every ``finish_k + q_k``), and the option only lengthens compute
(:mod:`usbyte_opt.planning.fastsim`: ready times, tails and ``B + F`` grow, and T is nondecreasing in
each), so claims 1, 2 and 4, taken without the option, hold for every schedule in both modes.
They also hold under the update rule ``GATE`` (:class:`~usbyte_opt.planning.problem.UpdateRule`),
which is never faster than the default: it pays each update after its tensor's last block.

**Claim 0 (the step on the thread).** Under ``GATE``, ``T >= B + F + sum(update)`` for every
schedule in both modes. *Proof.* Overlap mode: the forward starts when backward ends, at
``B`` or later, and the training thread then runs the forward's compute, at least ``F``, and
every tensor's update once (each has one pending, applied at some gate), at least
``sum(update)``, one after another. Fence mode: ``T = max(B, L) + sum(update) + F``. ∎ (With
the compute-cost option the stretch only lengthens these; with host cost ``B`` is the host
floor's.) It is the floor a CPU profile's plans meet where the updates are a large part of
the iteration, and what claims 1, 2 and 4, which see an update only as a tail, leave out.

**Claim 3 (compute cost).** With the option, block k costs the training thread
``c_k = cpu_ms_per_block + cpu_ms_per_mb * MB_k`` over its wire time ``d_k = alpha +
bytes_k * beta``, and the thread pays ``rho_k O_k`` where ``rho_k = c_k / d_k`` and ``O_k`` is
the part of ``d_k`` that overlaps its compute in the timeline without the charge. Then for
every schedule, with ``W = alpha + beta * (all gradient bytes)`` and ``C`` the charge of one
block of all of them,

    T >= B + F + W * C / (W + C).

*Proof.* (a) The charged iteration lengthens backward and forward by what they paid, so
``T >= B + F + sum_k c_k O_k / d_k``. (b) The uncharged timeline is no longer than the charged
one; in it the thread computes for at least ``B + F`` within ``[0, T]``, the wire's intervals
are disjoint and within ``[0, T]``, and ``d_k - O_k`` of each falls outside compute, so
``T >= B + F + sum_k (d_k - O_k)``. For any ``lambda`` in ``[0, 1]`` the larger of (a) and (b)
is at least their mix, ``sum_k [lambda c_k O_k / d_k + (1 - lambda)(d_k - O_k)]``, and over
``O_k`` in ``[0, d_k]`` each term is at least ``f(b_k) = min((1 - lambda) d_k, lambda c_k)``,
a concave function of the block's bytes with ``f(0) >= 0``, hence subadditive: the blocks'
sum is at least ``f`` of all bytes in one block, ``min((1 - lambda) W, lambda C)``. At
``lambda = W / (W + C)`` that is ``W C / (W + C)``. ∎ Under ``GATE`` (a) gains the step:
the thread runs backward, the forward's compute and every update one after another, each
lengthened by what it paid, so ``T >= B + F + sum(update) + sum_k c_k O_k / d_k`` with the
same ``O_k`` (the charge is read off the ``AVAIL`` timeline, and ``GATE`` is never faster than
it, so (b) holds as it is); the mix then adds ``lambda sum(update)``, and the largest value,
at ``lambda = W / (W + C)`` or 1, is ``max(sum(update), W (sum(update) + C) / (W + C))``
(:func:`charge_floor`). (The same as ``W rho / (1 + rho)`` with
the whole gradient's rate ``rho = C / W``: many small blocks do not escape it, since each pays
its alpha on the wire where it does not pay the thread.)

**Host cost.** Every plan run by a runner (:class:`~usbyte_opt.planning.problem.Runner`)
pays per tensor and per block at least that runner's ``tensor_ms`` and ``block_ms``; so a block
holding tensor p starts no earlier than ``r_p + tensor_ms #{q : r_q <= r_p} + block_ms`` (the
hooks of the tensors ready by then, and at least its own issue) and backward ends no earlier
than ``B + n tensor_ms + block_ms`` (at least one block), or, where the host runs ahead of the
device, the larger of each pair of terms. The iteration never gets shorter when releases or
backward's end grow, so the claims above, on these raised releases and ``B``
(:meth:`Problem.host_floor` of the runner), bound every plan of that runner.

**Per runner and mode.** The runtime runs both modes; torch DDP runs fence mode only, where
also (claim 5, :func:`fence_bound`) ``T >= max(B, C*) + sum(update) + F``, ``C*`` claim 2's
least time to all-reduce every gradient. :func:`lower_bound` is the smaller of the two runners'
bounds, each on its own floor and in its own modes: valid for every plan either runner can run.

With ``S = {the last-ready tensor}`` this gives the classic bound
``B + alpha + w_first + F - need_first`` when the input layer is ready last (backward must
end, its gradient cross the network, and the whole forward follow), which is stronger than
``B + F`` whenever communication matters; with ``S`` = everything it is the total
communication time. The maximum is taken over the O(n²) sets
``S(i, k) = {p : r_p >= r_i} ∩ {the first k tensors by descending tail}``, vectorised with
numpy (a few ms for 600 tensors). Every such S is a valid set, so the maximum is a valid bound.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(chain_profile([250_000, 250_000], forward_ms=4.0,
    ...     backward_ms=6.0, alpha_ms=1.0, algbw_gbs=1.0, compute=[1, 1]))
    >>> lower_bound(pb)     # input layer ready at 6, 1 + 1 ms to send, then 4 ms forward
    12.0

Claim 4 where claims 1 and 2 give 14 ms: three 2 ms tensors, alpha 2 ms. The best plan sends
``out`` alone, then ``mid`` and ``inp`` in one block after backward (6 + 2 + 4, then the 4 ms
forward): 16 ms, and claim 4 proves it::

    >>> from usbyte_opt.formats import CommSpec, Profile, TensorSpec
    >>> two_ms = 500_000                  # float32 elements: 2 MB, 2 ms at 1 GB/s
    >>> pb = Problem.from_profile(Profile("nested", 4.0, 6.0, (
    ...     TensorSpec("out", (two_ms,), "float32", 1.0, 2.0),
    ...     TensorSpec("mid", (two_ms,), "float32", 3.0, 1.0),
    ...     TensorSpec("inp", (two_ms,), "float32", 6.0, 0.0)), CommSpec("analytic", 2, 2.0, 1.0)))
    >>> r, q, w, alpha = _arrays(pb)
    >>> max(pb.B + pb.F, _set_bound(r, q, w, alpha), _batching_bound(r, q, w, alpha))
    14.0
    >>> round(lower_bound(pb), 3)
    16.0
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..formats import Mode
from .problem import Problem, Runner, UpdateRule

#: Claim 1 evaluates at most this many release thresholds (rows) and this many row x tensor
#: cells: 256 rows up to 4,000 tensors, fewer beyond (64 at 16,000), never under 32.
ROWS = 256
CELLS = 1 << 20
#: Items of claim 2's sets at most (larger sets are coarsened, :func:`_batching_bound`).
GROUPS = 512


#: The modes each runner runs a schedule in: the runtime both, torch DDP fence mode only.
RUNNER_MODES: dict[Runner, tuple[Mode, ...]] = {Runner.RUNTIME: (Mode.OVERLAP, Mode.FENCE),
                                                Runner.DDP: (Mode.FENCE,)}


def lower_bound(problem: Problem, runner: Runner | str | None = None) -> float:
    """The lower bound of the module docstring, in ms: claims 1, 2 and 4 on the problem without
    the compute-cost option, claim 3 with it, claim 0 under the update rule ``GATE``, and
    claim 5 where the runner runs fence mode only. With host cost it is the bound per runner
    (*Per runner and mode*): the claims on :meth:`Problem.host_floor` of ``runner``, in the
    modes it runs (:data:`RUNNER_MODES`); ``runner`` ``None``: the smaller of the two, valid
    for every plan of either runner in its modes. Without host cost the runners differ only in
    their modes, and the runtime, which runs both, gives the bound."""
    if runner is None:
        if not problem.host:
            return _bound(problem, Runner.RUNTIME)
        rt = _bound(problem, Runner.RUNTIME)
        return min(rt, _bound(problem, Runner.DDP, enough=rt))
    return _bound(problem, Runner(runner))


def _bound(problem: Problem, runner: Runner, enough: float = np.inf) -> float:
    """:func:`lower_bound` of one runner; it stops early, at a valid bound of at least
    ``enough``, once its claims reach that (the caller takes the smaller of two)."""
    # claim 3 reads backward's end as compute that the charge lengthens: where the host runs
    # ahead of the device, its time is not, so claim 3 takes the compute alone
    B3 = problem.B if problem.host_hidden else None
    problem = problem.host_floor(runner)
    r, q, w, alpha = _arrays(problem)
    best = problem.B + problem.F
    if problem.update_rule == UpdateRule.GATE:   # claim 0: the step on the training thread
        best += float(sum(problem.update))
    if Mode.OVERLAP not in RUNNER_MODES[runner]:
        best = max(best, fence_bound(problem))
    for claim in (_set_bound, _batching_bound):
        if best >= enough:
            return best
        best = max(best, claim(r, q, w, alpha))
    if best >= enough:
        return best
    best = max(best, nested_bound(problem, floor=best))
    return max(best, _compute_cost_bound(problem, B3))


def fence_bound(problem: Problem) -> float:
    """Claim 5: every schedule in fence mode takes at least ``max(B, C*) + sum(update) + F``,
    ``C*`` the least time to all-reduce every gradient when a block may carry any released
    bytes (claim 2's programme over all tensors).

    Example (two 1 ms tensors ready at 1 and 3 ms, alpha 1 ms: one block at 3 ends at 5)::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([250_000, 250_000], forward_ms=4.0,
        ...     backward_ms=3.0, alpha_ms=1.0, algbw_gbs=1.0, compute=[2, 1]))
        >>> fence_bound(pb)          # max(3, 5) + 0 + 4
        9.0
    """
    r, _, w, alpha = _arrays(problem)
    order = np.argsort(r, kind="stable")
    C = _batch_makespan(r[order].tolist(), w[order].tolist(), alpha) if len(r) else 0.0
    return max(problem.B, C) + float(sum(problem.update)) + problem.F


def _arrays(problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Releases, tails, wire times (bytes times beta) per tensor, and alpha."""
    r = np.asarray(problem.ready, dtype=float)
    q = np.asarray([u + problem.F - nd for u, nd in zip(problem.update, problem.need)], dtype=float)
    w = np.asarray([problem.nbytes(i) for i in range(problem.n)], dtype=float)
    alpha, beta = problem.cost.linear_bound()
    return r, q, w * beta, alpha


def _set_bound(r: np.ndarray, q: np.ndarray, w: np.ndarray, alpha: float,
               max_rows: int | None = None) -> float:
    """Claim 1 over the sets ``S(i, k)``: rows are release thresholds (every distinct release
    up to ``max_rows``, by default :data:`ROWS` within :data:`CELLS`; beyond, the latest
    quarter of them and quantiles of the rest, since a subset of valid sets still gives a
    valid bound), columns the tensors by descending tail."""
    if max_rows is None:
        max_rows = max(32, min(ROWS, CELLS // max(len(r), 1)))
    order = np.argsort(-q, kind="stable")  # columns: tensors by descending tail
    r_c, q_c, w_c = r[order], q[order], w[order]
    thresholds = np.unique(r)
    if len(thresholds) > max_rows:
        late = max_rows // 4
        spread = np.quantile(thresholds[:-late], np.linspace(0, 1, max_rows - late), method="lower")
        thresholds = np.unique(np.concatenate([spread, thresholds[-late:]]))
    best = -np.inf
    # Chunked so that memory stays small for very large models, in chunks of some 64k cells:
    # each pass below then reads and writes arrays that stay in the processor's cache (twice
    # as fast at 10,000 tensors as one chunk of a million cells; each row is computed alike).
    chunk = max(1, (1 << 16) // max(len(r), 1))
    for lo in range(0, len(thresholds), chunk):
        th = thresholds[lo:lo + chunk, None]
        member = r_c[None, :] >= th                      # p in S(i, .) before the tail cut
        W = np.cumsum(np.where(member, w_c[None, :], 0.0), axis=1)
        rmax = np.maximum.accumulate(np.where(member, r_c[None, :], -np.inf), axis=1)
        # max tail of S: the first member in descending-tail order.
        first = np.argmax(member, axis=1)
        qmax = q_c[first][:, None]
        # min tail of S(i, k) is at least q of column k (columns sorted by descending tail);
        # min release is at least the threshold.
        one_block = rmax + alpha + qmax
        two_blocks = th + 2 * alpha + q_c[None, :]
        val = W + np.minimum(one_block, two_blocks)
        val = np.where(rmax > -np.inf, val, -np.inf)
        best = max(best, float(val.max()))
    return best


def _compute_cost_bound(problem: Problem, B: float | None = None) -> float:
    """Claim 3 (``-inf`` without the compute-cost option, or with a cost model that is not a
    line: the proof takes each block's wire time as exactly ``alpha + bytes * beta``);
    ``B``: backward's end to read (default the problem's)."""
    if not problem.charges_cpu or not problem.cost.is_linear:
        return -np.inf
    alpha, beta = problem.cost.linear_bound()
    total = float(problem.total_bytes)
    W = alpha + beta * total
    # Under GATE the thread also runs the whole step (claims 0 and 3 together, module docstring).
    u = float(sum(problem.update)) if problem.update_rule == UpdateRule.GATE else 0.0
    return (problem.B if B is None else B) + problem.F + charge_floor([W], problem.block_cpu_ms(total), u)


def charge_floor(wires: Sequence[float], C: float, thread: float = 0.0) -> float:
    """``max over lambda in [0, 1] of lambda * thread + sum_j min((1 - lambda) wires[j],
    lambda C)``: claim 3's least extra time (module docstring) for collectives each carrying
    every byte once, ``wires`` their wire times as one block, ``C`` the thread's charge of one
    block of every byte, ``thread`` what else the training thread runs beside compute (under
    ``GATE``: the step). The function of ``lambda`` is concave and piecewise linear, so its
    maximum is at a breakpoint ``wires[j] / (wires[j] + C)`` or at 1.

    Example::

        >>> charge_floor([3.0], 21.0)          # W C / (W + C)
        2.625
        >>> round(charge_floor([3.0, 3.0], 21.0), 3)   # two collectives: 2 W C / (W + C)
        5.25
        >>> charge_floor([3.0], 21.0, 2.0), charge_floor([3.0], 21.0, 5.0)   # W (u + C) / (W + C); u
        (2.875, 5.0)
    """
    best = max(0.0, thread)
    for w in wires:
        if w + C <= 0:
            continue
        lam = w / (w + C)
        best = max(best, lam * thread + sum(min((1.0 - lam) * d, lam * C) for d in wires))
    return best


def _batching_bound(r: np.ndarray, q: np.ndarray, w: np.ndarray, alpha: float,
                    n_theta: int = 48, groups: int = GROUPS) -> float:
    """Claim 2 over ``S = {q >= theta}`` for up to ``n_theta`` tail thresholds.

    A set of more than ``groups`` tensors is first coarsened: releases are bucketed by
    ``delta = (latest release) / groups``, and each bucket becomes one item released at its
    earliest member with their bytes. Releasing bytes earlier never slows the best schedule,
    so ``C*`` of the coarse set is still a lower bound, and it is at most ``delta`` below the
    fine one (delaying the coarse optimum by ``delta`` makes it feasible)."""
    thetas = np.unique(q)
    if len(thetas) > n_theta:
        thetas = np.unique(np.quantile(q, np.linspace(0, 1, n_theta), method="lower"))
    order = np.argsort(r, kind="stable")
    r, q, w = r[order], q[order], w[order]
    delta = float(r[-1]) / groups if len(r) else 0.0
    best = -np.inf
    for theta in thetas:
        sel = q >= theta
        rs, ws = r[sel], w[sel]
        if len(rs) > groups and delta > 0:
            bucket = np.floor(rs / delta)
            cut = np.flatnonzero(np.diff(bucket)) + 1
            starts = np.concatenate([[0], cut])
            rs, ws = rs[starts], np.add.reduceat(ws, starts)
        best = max(best, _batch_makespan(rs.tolist(), ws.tolist(), alpha) + float(theta))
    return float(best)


def _batch_makespan(rs: list[float], ws: list[float], alpha: float) -> float:
    """``C*(S)`` of claim 2 in O(|S|): ``g(b) = alpha + P_b + min_a (max(g(a), r_b) - P_a)``.

    ``g`` is nondecreasing, so the ``a`` with ``g(a) <= r_b`` form a prefix ``[0, a*]`` whose
    best member is ``a*`` (largest ``P_a``); beyond it the term is ``g(a) - P_a``, whose
    minimum over the window ``(a*, b)`` a monotone deque keeps as ``a*`` only moves right.
    """
    from collections import deque

    n = len(rs)
    g = [0.0] * (n + 1)
    P = [0.0] * (n + 1)
    for i, x in enumerate(ws):
        P[i + 1] = P[i] + x
    dq: deque[int] = deque()  # indices a in (a*, b) with increasing g(a) - P_a
    a_star = 0
    for b in range(1, n + 1):
        a = b - 1
        h = g[a] - P[a]
        while dq and g[dq[-1]] - P[dq[-1]] >= h:
            dq.pop()
        dq.append(a)
        rb = rs[b - 1]
        while a_star + 1 < b and g[a_star + 1] <= rb:
            a_star += 1
        while dq and dq[0] <= a_star:
            dq.popleft()
        v = rb - P[a_star] if g[a_star] <= rb else g[a_star] - P[a_star]
        if dq:
            v = min(v, g[dq[0]] - P[dq[0]])
        g[b] = alpha + P[b] + v
    return g[n]


# --- claim 4 ----------------------------------------------------------------------------------

#: Claim 4 keeps at most this many states per level (beyond, neighbours are merged into their
#: componentwise minimum, which keeps the bound valid).
NESTED_STATES = 64


@dataclass(frozen=True, slots=True)
class NestedItems:
    """The items of claim 4: releases ``R`` and tails ``Q`` nondecreasing, wire times ``W``
    (ms), ``Wsuf[k] = W[k:].sum()``, and ``members[k]``: the tensors of item k."""

    R: np.ndarray
    Q: np.ndarray
    W: np.ndarray
    Wsuf: np.ndarray
    members: list[list[int]]
    _lists: list = field(default_factory=list, repr=False, compare=False)

    def lists(self) -> tuple[list[float], list[float], list[float]]:
        """``R``, ``Q``, ``Wsuf`` as Python lists (the programme reads them element by element)."""
        if not self._lists:
            self._lists.extend([self.R.tolist(), self.Q.tolist(), self.Wsuf.tolist(),
                                self.Wsuf[::-1].tolist()])
        return self._lists[0], self._lists[1], self._lists[2]

    def inc_list(self) -> list[float]:
        """``Wsuf`` reversed (nondecreasing), as a list."""
        self.lists()
        return self._lists[3]


def nested_items(r: np.ndarray, q: np.ndarray, w: np.ndarray, by: str = "ready") -> NestedItems:
    """Tensors as the items of claim 4: in release order with each tail lowered to the least
    tail released at or after it (``by="ready"``), or in tail order with each release lowered
    to the least release at or above its tail (``by="tail"``); tensors with equal release and
    tail share an item."""
    if by == "ready":
        order = np.lexsort((q, r))
        R, Q = r[order], np.minimum.accumulate(q[order][::-1])[::-1]
    elif by == "tail":
        order = np.lexsort((r, q))
        R, Q = np.minimum.accumulate(r[order][::-1])[::-1], q[order]
    else:
        raise ValueError(f"by: expected 'ready' or 'tail', got {by!r}")
    W = w[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (R[1:] != R[:-1]) | (Q[1:] != Q[:-1])
    starts = np.flatnonzero(new)
    Wg = np.add.reduceat(W, starts) if len(starts) else W
    # one conversion to a list, then slices (a split into thousands of small arrays costs
    # more than the whole programme)
    ids, cuts = order.tolist(), starts.tolist() + [len(order)]
    members = [ids[a:b] for a, b in zip(cuts, cuts[1:])] if len(starts) else []
    Wsuf = np.cumsum(Wg[::-1])[::-1].copy()
    return NestedItems(R[starts], Q[starts], Wg, Wsuf, members)


def nested_feasible(items: NestedItems, alpha: float, T: float) -> bool:
    """Whether some ``A``, ``C`` satisfy (*) of claim 4 at ``T`` (the programme of the module
    docstring)."""
    return _programme(items, alpha, T, False) is not None


def nested_config(items: NestedItems, alpha: float, T: float) -> tuple[list[int], list[int]] | None:
    """Sets ``(A, C)`` (ascending) that satisfy (*) of claim 4 at ``T``, or ``None`` when the
    programme finds none. (Where it merged states, beyond :data:`NESTED_STATES`, the sets are
    those of one of the merged states: a guide for ``best``, not a certificate.)"""
    return _programme(items, alpha, T, True)


def _programme(items: NestedItems, alpha: float, T: float,
               config: bool) -> tuple[list[int], list[int]] | None:
    """The programme of claim 4 at ``T``: ``None`` when no ``A``, ``C`` satisfy (*), else
    such sets (with ``config``; else two empty lists)."""
    R, Q, Wsuf = items.lists()
    G = len(R)
    if G == 0:
        return [], []
    slack = T + alpha + 1e-9 * max(1.0, abs(T))
    inc = items.inc_list()                 # Wsuf reversed: nondecreasing
    top = G - 1

    def breaks_at(key: float) -> int:
        """The highest level at which (*) breaks for a state of this key (-1: none)."""
        return G - 1 - bisect_right(inc, slack - key)

    # A state: (key, lo, hi, n, A, C) with key = R[lo] + Q[hi] + alpha * n; A and C as linked
    # lists (level, rest) for the configuration.
    key0 = R[top] + Q[top] + 2 * alpha
    if key0 > slack - Wsuf[top]:
        return None
    states: list[tuple] = [(key0, top, top, 2, (top, None), (top, None))]
    level = [breaks_at(key0)]
    while True:
        k = max(level)
        if k < 0:
            if not config:
                return [], []
            s = min(states, key=lambda x: x[3])
            return _unlink(s[4]), _unlink(s[5])
        budget = slack - Wsuf[k]
        nxt: list[tuple] = []
        for st, at in zip(states, level):
            if at < k:
                nxt.append(st)
                continue
            _, lo, hi, n, A, C = st
            one = False
            key = R[k] + Q[hi] + alpha * (n + 1)
            if key <= budget:
                nxt.append((key, k, hi, n + 1, (k, A), C))
                one = True
            key = R[lo] + Q[k] + alpha * (n + 1)
            if key <= budget:
                nxt.append((key, lo, k, n + 1, A, (k, C)))
                one = True
            key = R[k] + Q[k] + alpha * (n + 2)
            if not one and key <= budget:
                nxt.append((key, k, k, n + 2, (k, A), (k, C)))
        if not nxt:
            return None
        states = _pareto(nxt, R, Q, alpha) if len(nxt) > 1 else nxt
        level = [breaks_at(st[0]) for st in states]


def _pareto(states: list, R: list[float], Q: list[float], alpha: float) -> list:
    """``states`` without those dominated (release, tail and count each no smaller than
    another's); beyond :data:`NESTED_STATES`, neighbours by tail merged into their minimum."""
    states.sort(key=lambda s: (s[3], R[s[1]], Q[s[2]]))
    kept: list = []
    front: list[tuple[float, float]] = []      # (release, tail) of the kept, counts no larger
    for s in states:
        r, q = R[s[1]], Q[s[2]]
        if not any(a <= r and b <= q for a, b in front):
            kept.append(s)
            front.append((r, q))
    while len(kept) > NESTED_STATES:
        kept.sort(key=lambda s: Q[s[2]])
        i = min(range(len(kept) - 1), key=lambda j: Q[kept[j + 1][2]] - Q[kept[j][2]])
        a, b = kept[i], kept[i + 1]
        lo = a[1] if R[a[1]] <= R[b[1]] else b[1]
        hi = a[2] if Q[a[2]] <= Q[b[2]] else b[2]
        n = min(a[3], b[3])
        kept[i:i + 2] = [(R[lo] + Q[hi] + alpha * n, lo, hi, n, a[4], a[5])]
    return kept


def _unlink(lst) -> list[int]:
    out = []
    while lst is not None:
        out.append(lst[0])
        lst = lst[1]
    return sorted(out)


def _nested_search(items: NestedItems, alpha: float, floor: float,
                   rel: float = 1e-6) -> tuple[float, float]:
    """``(lo, hi)``: the largest T found infeasible for (*) (``floor`` when ``floor`` is
    feasible) and a feasible T within ``rel`` above it: steps from ``floor`` growing by half
    each, then bisection."""
    if len(items.R) == 0 or nested_feasible(items, alpha, floor):
        return floor, floor
    top = float(items.R[-1] + items.Q[-1] + alpha + items.Wsuf[0])   # one block at the end
    lo, step = floor, 1e-3 * max(abs(floor), 1.0)
    while True:
        hi = min(lo + step, top) if top > lo else lo + step
        if nested_feasible(items, alpha, hi):
            break
        lo, step = hi, step * 1.5
    while hi - lo > rel * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if nested_feasible(items, alpha, mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def nested_bound(problem: Problem, floor: float = 0.0) -> float:
    """Claim 4: the larger of its two relaxations (by release and by tail), at least
    ``floor`` (a valid bound the caller has: the search starts there). Kept in
    ``problem.cache["nested_bound"]``: for each relaxation, its items, its bound (at least the
    floor of the first call) and a T at most a hair above it at which the programme finds
    blocks."""
    key = "nested_bound"
    hit = problem.cache.get(key)
    if hit is None:
        r, q, w, alpha = _arrays(problem)
        hit = {}
        ready = nested_items(r, q, w, "ready")
        hit["ready"] = (ready, *_nested_search(ready, alpha, max(floor, problem.B + problem.F)))
        tail = nested_items(r, q, w, "tail")
        if not _same(tail, ready):     # else nested already: both are the tensors themselves
            _, lo, hi = hit["ready"]
            if nested_feasible(tail, alpha, hi):
                hit["tail"] = (tail, lo, hi)           # no better (within the tolerance)
            else:                                      # hi is infeasible: a bound, start there
                hit["tail"] = (tail, *_nested_search(tail, alpha, hi))
        problem.cache[key] = hit
    return max(floor, max(v[1] for v in hit.values()))


def _same(a: NestedItems, b: NestedItems) -> bool:
    return len(a.R) == len(b.R) and bool(np.array_equal(a.R, b.R) and np.array_equal(a.Q, b.Q)
                                          and np.allclose(a.W, b.W, rtol=1e-12, atol=0.0))
