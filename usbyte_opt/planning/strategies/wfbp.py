"""WFBP (wait-free backpropagation): one all-reduce per tensor, issued in ready order.

The baseline every scheduler is measured against (Zhang et al., "Poseidon", ATC 2017; the
US-Byte paper's "WFBP"): each gradient is all-reduced as soon as it is final in backward, one
collective per tensor, and the optimizer step waits for all of them (fence mode,
docs/design.md §2.6).

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(chain_profile([1000, 3000], alpha_ms=0.5))
    >>> p = plan(pb)
    >>> [(k.start, k.end) for k in p.blocks]      # output layer (ready first) goes first
    [(0, 3000), (3000, 4000)]
    >>> str(p.mode)
    'fence'
"""

from __future__ import annotations

from ...formats import Mode
from ..problem import Problem
from . import Plan, register


@register("wfbp")
def plan(problem: Problem) -> Plan:
    """One block per tensor over the default layout, in ascending ready order.

    Args:
        problem: the compiled profile.

    Returns:
        A fence-mode :class:`Plan` with ``problem.n`` blocks.

    Example::

        >>> from usbyte_opt.planning.synthetic import random_profile
        >>> import random
        >>> pb = Problem.from_profile(random_profile(random.Random(1), 5))
        >>> len(plan(pb).blocks)
        5
    """
    layout = problem.layout()
    # The default layout already holds each buffer in ready order, so walking the ready order
    # over all buffers interleaves dtypes exactly as the gradients become final.
    blocks = [layout.whole(i) for i in problem.ready_order()]
    return Plan(layout, blocks, Mode.FENCE, {"blocks": len(blocks)})
