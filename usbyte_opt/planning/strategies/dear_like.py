"""DeAR-like: fused blocks of a tuned size, reduce-scattered in backward, all-gathered in the
next forward.

Zhang, Shi, Tang, Chu, "DeAR: Accelerating Distributed Deep Learning with Fine-Grained
All-Reduce Pipelining", ICDCS 2023: all-reduce decoupled into a reduce-scatter overlapped with
backward and an all-gather overlapped with the next forward, on tensors fused into buckets
of a size threshold that the system tunes (by Bayesian optimisation). This strategy fills
blocks with whole tensors in ready order until they reach the threshold, uses the same blocks
for both collectives (all-gathers in forward order), and tunes the threshold over a grid of
sizes (4 KiB to the whole model, doubling) by the sharded scorer.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> p = plan(Problem.from_profile(chain_profile([1000] * 8, alpha_ms=5.0)))
    >>> p.mode, len(p.blocks) < 8       # alpha 5 ms: fusing pays
    (<Mode.SHARDED: 'sharded'>, True)
"""

from __future__ import annotations

from ...formats import Mode
from ..ddp import buckets
from ..problem import Problem
from ..sharded import forward_gathers, sharded_time, sort_by_ready
from . import Plan, register


@register("dear-like", sharded=True)
def plan(problem: Problem, thresholds: list[int] | None = None) -> Plan:
    """Fused blocks at the best threshold of ``thresholds`` (bytes; default: 4 KiB doubling
    below the whole gradient, and the whole gradient).

    Returns:
        A sharded-mode :class:`Plan`; ``info["threshold_bytes"]`` is the threshold chosen.
    """
    layout = problem.layout()
    if thresholds is None:
        thresholds, t = [], 4096
        while t < problem.total_bytes:
            thresholds.append(t)
            t *= 2
        thresholds.append(max(problem.total_bytes, 1))
    best = None
    for th in thresholds:
        # Whole tensors in ready order, a block closed once it holds th bytes: DDP's bucket
        # rule with one cap for every bucket, each issued once its gradients are final.
        blocks = sort_by_ready(problem, layout, buckets(problem, layout, first_bucket_bytes=th,
                                                        bucket_cap_bytes=th))
        gathers = forward_gathers(problem, layout, blocks)
        T = sharded_time(problem, layout, blocks, gathers)
        if best is None or T < best[0] - 1e-12:
            best = (T, th, blocks, gathers)
    assert best is not None
    _, th, blocks, gathers = best
    return Plan(layout, blocks, Mode.SHARDED, {"threshold_bytes": th}, gathers=gathers)
