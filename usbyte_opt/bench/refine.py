"""A refinement of overlap mode learned from measured timelines: the optimizer step is compute.

DESIGN.md §2 (overlap mode) charges tensor p's update only as a delay of its availability,
``avail_p = finish_p + update_p``: when p's block finished long before the forward reaches p,
the update costs nothing. The runtime does not work that way (``USBYTE_TRACE`` shows it): the
update runs on the training thread, inside the forward pre-hook of the module that needs p,
and that hook also updates every other pending tensor whose blocks have finished by then
(one optimizer call instead of several). So the forward pays for every update, at the gate
where it happens. On loopback, where all blocks are done before backward ends, the first
gate of the forward applied the whole step (51 ms for ``cnn``, 8% of the iteration) and the
prediction missed exactly that.

:func:`refined_overlap` replays the forward with that rule: walking tensors in ``need`` order,
the forward reaches p at ``max(t_prev + (need_p - need_prev), finish_p)`` if p is still
pending, then spends the update time of p and of every pending tensor finished by then.

Example (two tensors; the output-side block finishes early, the input-side one at 8 ms)::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> from usbyte_opt.problem import Problem
    >>> prof = Profile("toy", forward_ms=4.0, backward_ms=6.0,
    ...     tensors=(TensorSpec("out", (250_000,), "float32", 2.0, 3.0, update_ms=1.0),
    ...              TensorSpec("inp", (250_000,), "float32", 6.0, 0.0, update_ms=1.0)),
    ...     comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
    >>> pb = Problem.from_profile(prof); lay = pb.layout()
    >>> blocks = [lay.whole(0), lay.whole(1)]
    >>> from usbyte_opt.simulate import simulate_blocks
    >>> simulate_blocks(pb, lay, blocks).iteration_ms   # "inp" at max(6, 8 + 1), "out" free
    13.0
    >>> refined_overlap(pb, lay, blocks)                 # at 8 both updates run: 8 + 2 + 4
    14.0
"""

from __future__ import annotations

from typing import Sequence

from ..formats import Block
from ..problem import Layout, Problem
from ..simulate import simulate_blocks


def refined_overlap(problem: Problem, layout: Layout, blocks: Sequence[Block]) -> float:
    """Iteration time in overlap mode with the runtime's update rule (see the module docstring)."""
    tl = simulate_blocks(problem, layout, blocks, "overlap")
    finish = [0.0] * problem.n
    index = problem.index
    for b in tl.blocks:
        for name in b.tensors:
            i = index[name]
            finish[i] = max(finish[i], b.finish_ms)
    upd, need = problem.update, problem.need
    order = problem.need_order()
    pending = set(range(problem.n))
    by_finish = sorted(range(problem.n), key=lambda i: finish[i])
    ptr = 0
    t = None
    prev_need = 0.0
    for i in order:
        reach = problem.B + need[i] if t is None else t + (need[i] - prev_need)
        t = reach
        if i in pending:
            t = max(reach, finish[i])
            cost = 0.0
            while ptr < len(by_finish) and finish[by_finish[ptr]] <= t:
                j = by_finish[ptr]
                ptr += 1
                if j in pending:
                    pending.discard(j)
                    cost += upd[j]
            if i in pending:  # finished exactly at t but ordered after: update it too
                pending.discard(i)
                cost += upd[i]
            t += cost
        prev_need = need[i]
    fwd_end = t + problem.F - prev_need if t is not None else problem.B + problem.F
    last = tl.blocks[-1].finish_ms if tl.blocks else 0.0
    return max(fwd_end, last)


__all__ = ["refined_overlap"]
