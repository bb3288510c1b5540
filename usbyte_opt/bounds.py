"""A lower bound on the overlap-mode iteration time of *any* schedule of a profile.

Notation (docs/design.md §2.5, and :mod:`usbyte_opt.fastsim` for the closed form): tensor p has
release ``r_p = ready_p``, transfer time ``w_p = bytes_p * beta`` and tail
``q_p = update_p + F - need_p``. For every schedule,

    T = max(B + F, finish_last, max_p (finish of the last block covering p) + q_p).

**Claim.** For every non-empty set S of tensors, with ``W_S = sum_{p in S} w_p``,

    T >= W_S + min( max_{p in S} r_p + alpha + max_{p in S} q_p ,
                    min_{p in S} r_p + 2 alpha + min_{p in S} q_p ).

*Proof.* Every byte of S travels in some block, a block touching p starts no earlier than
r_p, the channel runs one block at a time, and each block costs alpha plus its bytes times
beta. Let k be the last block (in issue order) carrying bytes of S, and p a tensor of S in k,
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

With ``S = {the last-ready tensor}`` this gives the classic bound
``B + alpha + w_first + F - need_first`` when the input layer is ready last (backward must
end, its gradient cross the network, and the whole forward follow), which is stronger than
``B + F`` whenever communication matters; with ``S`` = everything it is the total
communication time. The maximum is taken over the O(n²) sets
``S(i, k) = {p : r_p >= r_i} ∩ {the first k tensors by descending tail}``, vectorised with
numpy (a few ms for 600 tensors). Every such S is a valid set, so the maximum is a valid bound.

Example::

    >>> from usbyte_opt.synthetic import chain_profile
    >>> from usbyte_opt.problem import Problem
    >>> pb = Problem.from_profile(chain_profile([250_000, 250_000], forward_ms=4.0,
    ...     backward_ms=6.0, alpha_ms=1.0, algbw_gbs=1.0, compute=[1, 1]))
    >>> lower_bound(pb)     # input layer ready at 6, 1 + 1 ms to send, then 4 ms forward
    12.0
"""

from __future__ import annotations

import numpy as np

from .problem import Problem


def lower_bound(problem: Problem) -> float:
    """The lower bound of the module docstring, in ms (overlap mode; without the compute-cost
    option fence mode is never lower).

    With the compute-cost option the bound is taken on the problem stretched for one block:
    a schedule has at least one, and stretching compute never makes a schedule faster.
    """
    if problem.charges_cpu:
        problem = problem.stretched(problem.stretch(1))
    r = np.asarray(problem.ready, dtype=float)
    q = np.asarray([u + problem.F - nd for u, nd in zip(problem.update, problem.need)], dtype=float)
    w = np.asarray([problem.nbytes(i) for i in range(problem.n)], dtype=float)
    w *= problem.cost.beta_ms_per_byte
    alpha = problem.cost.alpha_ms
    best = problem.B + problem.F

    order = np.argsort(-q, kind="stable")  # columns: tensors by descending tail
    r_c, q_c, w_c = r[order], q[order], w[order]
    thresholds = np.unique(r)
    # Rows: release thresholds. Chunked so memory stays small for very large models.
    for lo in range(0, len(thresholds), 256):
        th = thresholds[lo:lo + 256, None]
        member = r_c[None, :] >= th                      # p in S(i, .) before the tail cut
        W = np.cumsum(np.where(member, w_c[None, :], 0.0), axis=1)
        count = np.cumsum(member, axis=1)
        rmax = np.maximum.accumulate(np.where(member, r_c[None, :], -np.inf), axis=1)
        # max tail of S: the first member in descending-tail order.
        first = np.argmax(member, axis=1)
        qmax = q_c[first][:, None]
        # min tail of S(i, k) is at least q of column k (columns sorted by descending tail);
        # min release is at least the threshold.
        one_block = rmax + alpha + qmax
        two_blocks = th + 2 * alpha + q_c[None, :]
        val = W + np.minimum(one_block, two_blocks)
        val = np.where(count > 0, val, -np.inf)
        best = max(best, float(val.max()))
    return max(best, _batching_bound(r, q, w, alpha))


def _batching_bound(r: np.ndarray, q: np.ndarray, w: np.ndarray, alpha: float,
                    n_theta: int = 48) -> float:
    """Claim 2 over ``S = {q >= theta}`` for up to ``n_theta`` tail thresholds."""
    thetas = np.unique(q)
    if len(thetas) > n_theta:
        thetas = np.unique(np.quantile(q, np.linspace(0, 1, n_theta), method="lower"))
    best = -np.inf
    for theta in thetas:
        sel = q >= theta
        order = np.argsort(r[sel], kind="stable")
        best = max(best, _batch_makespan(r[sel][order].tolist(), w[sel][order].tolist(), alpha)
                   + float(theta))
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
