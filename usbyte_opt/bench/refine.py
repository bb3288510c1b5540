"""The bench's refined prediction: the planner's iteration model with what real training
adds, learned from measured timelines (``usbyte-opt bench``; the report's ``refined_ms``).

Everything is scored by the planner's own code: the compute cost of communication as the one
scorer charges it (:func:`usbyte_opt.planning.fastsim.charged`), the iteration by
:mod:`usbyte_opt.planning.simulate`. What it changes, on inputs the bench measured (the
measurements behind each rule: docs/bench.md, "Why the refined prediction is as it is"):

1. **The optimizer step is compute** (:func:`refined_overlap`): in overlap mode the iteration
   model's update rule ``GATE`` (:class:`usbyte_opt.planning.problem.UpdateRule`), as the
   runtime runs it: each tensor's update on the training thread in the forward pre-hook that
   first needs it, together with every other pending tensor whose blocks have finished by
   then, paid by the forward. The planner's default rule charges an update only as a delay of
   its tensor's availability. Fence-mode schedules already run the whole step on the training
   thread before the forward (the worker scores them with the simulator's fence mode).
2. **All-reduce is slower while training computes**: the bench times all-reduce again while
   training iterations run and fits the bandwidth on absolute residuals (:func:`fit_absolute`,
   :func:`loaded_comm`), which weigh the large blocks an iteration is made of.
3. **Compute drifts**: the profile's compute is recalibrated to the side-by-side run without
   communication (:func:`scaled`).

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

from ..formats import Block, CollectiveCost, CommSpec, Mode, Profile
from ..planning.cost import bandwidth_through
from ..planning.fastsim import charged
from ..planning.problem import Layout, Problem, UpdateRule
from ..planning.simulate import simulate_blocks


def fit_absolute(samples: Sequence[tuple[int, float]], alpha_ms: float | None = None) -> tuple[float, float]:
    """``(alpha_ms, algbw_gbs)`` by least squares on *absolute* residuals (alpha >= 0).

    The profiler fits relative residuals, so that alpha is right for small messages; under
    load a single slow small sample then pulls that line off the large blocks that make up
    the iteration. For predicting an iteration, the milliseconds of the big blocks are what
    counts, and absolute residuals weigh them.

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
    meta = profile.meta
    comp = meta.get("compile")
    if isinstance(comp, dict) and isinstance(comp.get("cuts"), dict):
        # A compiled profile's cut costs are compute too.
        comp = dict(comp, cuts={k: v * factor for k, v in comp["cuts"].items()})
        if isinstance(comp.get("cut_default_ms"), (int, float)):
            comp["cut_default_ms"] *= factor
        meta = {**meta, "compile": comp}
    return dataclasses.replace(profile, forward_ms=profile.forward_ms * factor,
                               backward_ms=profile.backward_ms * factor, tensors=tensors, meta=meta)


def loaded_comm(comm: CommSpec, samples: Sequence[tuple[int, float]],
                reduce_scatter: Sequence[tuple[int, float]] = (),
                all_gather: Sequence[tuple[int, float]] = ()) -> CommSpec:
    """``comm`` with its bandwidth fitted (:func:`fit_absolute`) to per-block samples taken
    under compute (:func:`usbyte_opt.profiler.probe.comm_under_compute`), alpha kept from the
    profile (chained calls on the runtime's channel, idle): the alternatives measured in the
    lab (a free intercept, the latency of small blocks under compute) predicted worse. The
    reduce-scatter and all-gather lines likewise from their own samples under compute (of the
    whole block's bytes, as their lines are), where given; else the profile's, kept; and the
    profile's topology (``nodes``, ``intra``, ``inter``), kept.

    Example::

        >>> c = CommSpec("gloo", 2, 2.0, 0.025, reduce_scatter=CollectiveCost(1.0, 0.05))
        >>> q = loaded_comm(c, [(65536, 5.1), (1 << 20, 46.0)])
        >>> round(q.alpha_ms, 2), round(q.algbw_gbs * 1e3, 1), q.reduce_scatter.algbw_gbs
        (2.0, 23.8, 0.05)
        >>> q = loaded_comm(c, [(65536, 5.1)], reduce_scatter=[(1 << 20, 30.0)])
        >>> round(q.reduce_scatter.alpha_ms, 2), round(q.reduce_scatter.algbw_gbs * 1e3, 1)
        (1.0, 36.2)
    """
    alpha, algbw = fit_absolute(samples, comm.alpha_ms)

    def line(old: CollectiveCost | None, got: Sequence[tuple[int, float]]) -> CollectiveCost | None:
        if not got:
            return old
        a0 = old.alpha_ms if old is not None else 0.5 * comm.alpha_ms
        a, bw = fit_absolute(got, a0)
        return CollectiveCost(a, bw, tuple(got))

    # The topology (nodes, the lines inside a node and across nodes) is kept: a hierarchical
    # block is costed on those, as the planner costs it.
    return CommSpec(comm.backend, comm.world_size, alpha, algbw, tuple(samples),
                    reduce_scatter=line(comm.reduce_scatter, reduce_scatter),
                    all_gather=line(comm.all_gather, all_gather),
                    nodes=comm.nodes, intra=comm.intra, inter=comm.inter)


def refined_overlap(problem: Problem, layout: Layout, blocks: Sequence[Block]) -> float:
    """Iteration time of ``blocks`` in overlap mode under the runtime's update rule
    (:class:`~usbyte_opt.planning.problem.UpdateRule` ``GATE``, see the module docstring),
    on the problem charged for what they cost its compute as the one scorer charges them
    (:func:`usbyte_opt.planning.fastsim.charged`)."""
    gated = charged(problem.with_update_rule(UpdateRule.GATE), layout, blocks, Mode.OVERLAP)
    return simulate_blocks(gated, layout, blocks, Mode.OVERLAP).iteration_ms


__all__ = ["fit_absolute", "loaded_comm", "refined_overlap", "scaled"]
