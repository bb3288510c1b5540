"""The bench's refined prediction: the planner's iteration model with what real training
adds, learned from measured timelines (``usbyte-opt bench``; the report's ``refined_ms``).

What it scores through the planner's own code: the blocks' times and the compute cost of
communication come from :mod:`usbyte_opt.planning.fastsim` (:func:`usbyte_opt.planning.fastsim.charged`, the
one rule of both modes) and :mod:`usbyte_opt.planning.simulate`; what it adds, on inputs the bench
measured:

1. **The optimizer step is compute** (:func:`refined_overlap`, below): in overlap mode the
   runtime applies each tensor's update on the training thread, in the forward pre-hook that
   first needs it, together with every other pending tensor whose blocks have finished by then.
   Fence-mode schedules already run the whole step on the training thread before the forward
   (the worker scores them with the simulator's fence mode).
2. **All-reduce is slower while training computes**: on a small CPU machine gloo's threads wait
   for a core at every step of the ring. The bench times all-reduce again while training
   iterations run and fits the line on absolute residuals (:func:`fit_absolute`,
   :func:`loaded_comm`), which weigh the large blocks an iteration is made of.
3. **Compute drifts**: the profile's compute is recalibrated to the side-by-side run without
   communication (:func:`scaled`).

The optimizer step:

docs/design.md §2.5 (overlap mode) charges tensor p's update only as a delay of its
availability, ``avail_p = finish_p + update_p``: when p's block finished long before the
forward reaches p, the update costs nothing. The runtime does not work that way
(``USBYTE_TRACE`` shows it): the update runs on the training thread, inside the forward
pre-hook of the module that needs p, and that hook also updates every other pending tensor
whose blocks have finished by then (one optimizer call instead of several). So the forward
pays for every update, at the gate where it happens. On loopback, where all blocks are done
before backward ends, the first gate of the forward applied the whole step (51 ms for
``cnn``, 8% of the iteration) and the prediction missed exactly that.

:func:`refined_overlap` replays the forward with that rule: walking tensors in ``need`` order,
the forward reaches p at ``max(t_prev + (need_p - need_prev), finish_p)`` if p is still
pending, then spends the update time of p and of every pending tensor finished by then.

Example (two tensors; the output-side block finishes early, the input-side one at 8 ms)::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> from usbyte_opt.planning.problem import Problem
    >>> prof = Profile("toy", forward_ms=4.0, backward_ms=6.0,
    ...     tensors=(TensorSpec("out", (250_000,), "float32", 2.0, 3.0, update_ms=1.0),
    ...              TensorSpec("inp", (250_000,), "float32", 6.0, 0.0, update_ms=1.0)),
    ...     comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
    >>> pb = Problem.from_profile(prof); lay = pb.layout()
    >>> blocks = [lay.whole(0), lay.whole(1)]
    >>> from usbyte_opt.planning.simulate import simulate_blocks
    >>> simulate_blocks(pb, lay, blocks).iteration_ms   # "inp" at max(6, 8 + 1), "out" free
    13.0
    >>> refined_overlap(pb, lay, blocks)                 # at 8 both updates run: 8 + 2 + 4
    14.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..formats import Block, CommSpec, Mode, Profile
from ..planning.cost import bandwidth_through
from ..planning.fastsim import charged
from ..planning.problem import Layout, Problem
from ..planning.simulate import simulate_blocks


def fit_absolute(samples: Sequence[tuple[int, float]], alpha_ms: float | None = None) -> tuple[float, float]:
    """``(alpha_ms, algbw_gbs)`` by least squares on *absolute* residuals (alpha >= 0).

    The profiler fits relative residuals, so that alpha is right for small messages; on a
    loaded 2-core machine one slow 4 KB sample (2.5 ms instead of 0.6) then pulls the line
    off the large blocks that make up the iteration (25.9 MB/s fitted where 4.6 MB took
    195 ms, 23.4 MB/s). For predicting an iteration, the milliseconds of the big blocks are
    what counts, and absolute residuals weigh them.

    Example::

        >>> a, bw = fit_absolute([(1e5, 4.0 + 4.0), (1e6, 4.0 + 40.0), (4e6, 4.0 + 160.0)])
        >>> round(a, 3), round(bw * 1e3, 3)      # 4 ms + 25 MB/s
        (4.0, 25.0)

    With ``alpha_ms`` given, only the bandwidth is fitted (the line through ``alpha_ms``)::

        >>> a, bw = fit_absolute([(1e5, 6.0 + 4.0), (1e6, 4.0 + 40.0), (4e6, 4.0 + 160.0)], 4.0)
        >>> a, round(bw * 1e3, 1)
        (4.0, 25.0)
    """
    n = len(samples)
    if alpha_ms is not None and n >= 1:
        bw = bandwidth_through(samples, alpha_ms)
        if bw is not None:
            return float(alpha_ms), bw
    if n < 2:
        raise ValueError("fit_absolute: expected at least two samples")
    xs = [float(b) for b, _ in samples]
    ys = [float(t) for _, t in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    alpha = my - beta * mx
    if alpha < 0 or beta <= 0:
        alpha = 0.0
        beta = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return alpha, 1.0 / (beta * 1e6)


def scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every compute time (forward, backward, ready, need, update) times
    ``factor``: the profile's compute recalibrated to what the same training measured without
    communication, side by side with the strategies (``no-comm``), so that a slow or fast spell
    of a shared machine between profiling and training does not count as a prediction error.

    Example::

        >>> from usbyte_opt.formats import TensorSpec, CommSpec
        >>> p = Profile("t", 40.0, 60.0, (TensorSpec("w", (250_000,), "float32", 30.0, 20.0, 2.0),),
        ...             CommSpec("gloo", 2, 0.1, 1.0))
        >>> q = scaled(p, 1.5)
        >>> q.forward_ms, q.backward_ms, q.tensors[0].ready_ms, q.tensors[0].update_ms
        (60.0, 90.0, 45.0, 3.0)
    """
    if factor <= 0 or factor == 1.0:
        return profile
    tensors = tuple(dataclasses.replace(t, ready_ms=t.ready_ms * factor, need_ms=t.need_ms * factor,
                                        update_ms=t.update_ms * factor) for t in profile.tensors)
    return dataclasses.replace(profile, forward_ms=profile.forward_ms * factor,
                               backward_ms=profile.backward_ms * factor, tensors=tensors)


def loaded_comm(comm: CommSpec, samples: Sequence[tuple[int, float]]) -> CommSpec:
    """``comm`` with its bandwidth fitted (:func:`fit_absolute`) to per-block samples taken
    under compute (:func:`comm_under_compute`), alpha kept from the profile (chained calls on
    the runtime's channel, idle). Measured alternatives did worse in the lab: a free intercept
    through the probe's large blocks came out at 5 ms where traced blocks paid 2 ms, and chains
    of 4 KiB blocks under compute cost 1.7 ms each where the traced small blocks of ``usbyte``
    paid 2-5 ms; with the profile's 2.9 ms every strategy of ``lab-vgg`` at 200 Mbit/s came within 6%.

    Example::

        >>> c = CommSpec("gloo", 2, 2.0, 0.025)
        >>> q = loaded_comm(c, [(65536, 5.1), (1 << 20, 46.0)])
        >>> round(q.alpha_ms, 2), round(q.algbw_gbs * 1e3, 1)
        (2.0, 23.8)
    """
    alpha, algbw = fit_absolute(samples, comm.alpha_ms)
    return CommSpec(comm.backend, comm.world_size, alpha, algbw, tuple(samples))


def refined_overlap(problem: Problem, layout: Layout, blocks: Sequence[Block]) -> float:
    """Iteration time in overlap mode with the runtime's update rule (see the module docstring),
    on the problem charged for what ``blocks`` cost its compute (:func:`usbyte_opt.planning.fastsim.charged`,
    as the planner scores them)."""
    problem = charged(problem, layout, blocks, Mode.OVERLAP)
    tl = simulate_blocks(problem, layout, blocks, Mode.OVERLAP)
    fin_blocks = [b.finish_ms for b in tl.blocks]
    finish = [0.0] * problem.n
    index = problem.index
    for b, f in zip(tl.blocks, fin_blocks):
        for name in b.tensors:
            i = index[name]
            finish[i] = max(finish[i], f)
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
    last = max(fin_blocks) if fin_blocks else 0.0
    return max(fwd_end, last)


__all__ = ["fit_absolute", "loaded_comm", "refined_overlap", "scaled"]
