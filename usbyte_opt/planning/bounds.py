"""A lower bound on the iteration time of *any* schedule of a profile, in either mode.

Notation (docs/design.md §2.5, and :mod:`usbyte_opt.planning.fastsim` for the closed form): tensor p has
release ``r_p = ready_p``, transfer time ``w_p = bytes_p * beta`` and tail
``q_p = update_p + F - need_p``. ``alpha`` and ``beta`` are the cost model's linear bound
(:meth:`usbyte_opt.planning.cost.CostModel.linear_bound`): a block costs *at least*
``alpha`` plus its bytes times ``beta``, which is all claims 1 and 2 use, so they hold for any
cost model; claim 3 needs the cost to be that line (:attr:`~usbyte_opt.planning.cost.CostModel.is_linear`)
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

**Fence mode and the compute-cost option.** For the same blocks, fence mode is never faster
than overlap mode without the option (``max(B, L) + sum(update) + F`` is at least ``B + F``,
``L`` and every ``finish_k + q_k``), and the option only lengthens compute
(:mod:`usbyte_opt.planning.fastsim`: ready times, tails and ``B + F`` grow, and T is nondecreasing in
each), so claims 1 and 2, taken without the option, hold for every schedule in both modes.
They also hold under the update rule ``GATE`` (:class:`~usbyte_opt.planning.problem.UpdateRule`),
which is never faster than the default: it pays each update after its tensor's last block.

**Claim 3 (compute cost).** With the option, block k costs the training thread
``c_k = cpu_ms_per_block + cpu_ms_per_mb * MB_k`` over its wire time ``d_k = alpha +
bytes_k * beta``, and the thread pays ``rho_k O_k`` where ``rho_k = c_k / d_k`` and ``O_k`` is
the part of ``d_k`` that overlaps its compute in the timeline without the charge. Then for
every schedule, with ``W = alpha + beta * (all gradient bytes)`` and ``rho`` the smallest rate
any block can have,

    T >= B + F + W * rho / (1 + rho).

*Proof.* Let ``O = sum_k O_k`` and ``D = sum_k d_k >= W`` (at least one block carries all
bytes). (a) The charged iteration lengthens backward and forward by what they paid, so
``T >= B + F + sum_k rho_k O_k >= B + F + rho O``. (b) The uncharged timeline is no longer
than the charged one; in it the thread computes for at least ``B + F`` within ``[0, T]``, the
wire's intervals are disjoint and within ``[0, T]``, and ``D - O`` of wire time falls outside
compute, so ``T >= B + F + D - O >= B + F + W - O``. The larger of (a) and (b) is smallest when
``rho O = W - O``. ``rho_k`` is a ratio of two affine functions of the bytes, so monotone in
them: ``rho = min(cpu_ms_per_block / alpha, rate of one block of every byte)``. ∎

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
"""

from __future__ import annotations

import numpy as np

from .problem import Problem

#: Claim 1 evaluates at most this many release thresholds (rows) and this many row x tensor
#: cells: 256 rows up to 4,000 tensors, fewer beyond (64 at 16,000), never under 32.
ROWS = 256
CELLS = 1 << 20
#: Items of claim 2's sets at most (larger sets are coarsened, :func:`_batching_bound`).
GROUPS = 512


def lower_bound(problem: Problem) -> float:
    """The lower bound of the module docstring, in ms: claims 1 and 2 on the problem without
    the compute-cost option, and claim 3 with it. Valid for every schedule in both modes."""
    r = np.asarray(problem.ready, dtype=float)
    q = np.asarray([u + problem.F - nd for u, nd in zip(problem.update, problem.need)], dtype=float)
    w = np.asarray([problem.nbytes(i) for i in range(problem.n)], dtype=float)
    alpha, beta = problem.cost.linear_bound()
    w *= beta
    best = problem.B + problem.F

    best = max(best, _set_bound(r, q, w, alpha))
    return max(best, _batching_bound(r, q, w, alpha), _compute_cost_bound(problem))


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
    # Chunked so that memory stays small for very large models.
    chunk = max(1, (1 << 22) // max(len(r), 1))
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


def _compute_cost_bound(problem: Problem) -> float:
    """Claim 3 (``-inf`` without the compute-cost option, or with a cost model that is not a
    line: the proof takes each block's wire time as exactly ``alpha + bytes * beta``)."""
    if not problem.charges_cpu or not problem.cost.is_linear:
        return -np.inf
    alpha, beta = problem.cost.linear_bound()
    total = float(problem.total_bytes)
    W = alpha + beta * total
    whole = problem.block_cpu_ms(total) / W if W > 0 else np.inf
    if alpha > 0:
        small = problem.cpu_ms_per_block / alpha
    else:
        small = np.inf if problem.cpu_ms_per_block > 0 else problem.cpu_ms_per_mb / (1e6 * beta)
    rho = min(small, whole)
    share = 1.0 if rho == np.inf else rho / (1.0 + rho)
    return problem.B + problem.F + W * share


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
