"""A lower bound on the overlap-mode iteration time of *any* schedule of a profile.

Notation (DESIGN.md §2, and :mod:`usbyte_opt.fastsim` for the closed form): tensor p has
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
    """The lower bound of the module docstring, in ms (overlap mode; fence mode is never lower)."""
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
    return best
