"""MG-WFBP: merge neighbouring gradients when a separate all-reduce would not pay for its alpha.

Shi, Chu, Li, "MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD
Algorithms", INFOCOM 2019 (Algorithm 2, "optimal gradient merge"). Walking the tensors from
the output layer (ready order), the current group's all-reduce would start at
``tau_c = max(channel free, ready of its last tensor)``. The next gradient, ready at ``r``, is
merged into the group when

* ``tau_c > r``: the group's all-reduce could not start before the next gradient is ready, so
  sending them together costs nothing and saves one alpha; or
* ``r - tau_c < alpha``: waiting for it delays the group by less than the alpha it saves.

Both cases are the single test ``r - tau_c < alpha`` (with a linear cost, a wait of at least
one all-reduce is never below alpha, which is the paper's first guard). The rule is the
paper's for a linear cost: alpha is the cost model's linear bound's. Otherwise the group is
closed and issued, and the next tensor opens a new one. Merged tensors must be neighbours in
one flat buffer, so a group also closes when the next gradient has another dtype. The later
journal version adds a size floor (always merge tensors under 8192 elements); that is not part
of the INFOCOM rule and is left out. Fence mode, like the paper's system.

Example::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> from usbyte_opt.planning.problem import Problem
    >>> T = lambda n, r: TensorSpec(n, (250_000,), "float32", ready_ms=r, need_ms=0.0)
    >>> # alpha 1 ms, 1 GB/s: a 1 MB tensor costs 2 ms
    >>> prof = Profile("toy", 1.0, 10.0, (T("a", 1.0), T("b", 1.5), T("c", 9.0)),
    ...                CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
    >>> p = plan(Problem.from_profile(prof))
    >>> [(k.start, k.end) for k in p.blocks]    # b (0.5 ms after a) joins a; c is far away
    [(0, 500000), (500000, 750000)]
"""

from __future__ import annotations

from typing import Any

from ...formats import Block, Mode
from ..problem import Problem
from . import Plan, register


@register("mgwfbp")
def plan(problem: Problem) -> Plan:
    """Group whole tensors by MG-WFBP's merge rule over the default layout.

    Args:
        problem: the compiled profile.

    Returns:
        A fence-mode :class:`Plan`; ``info["groups"]`` is the number of merged groups.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> # 10 equal layers, alpha 5 ms (> 2 ms between gradients): everything merges
        >>> pb = Problem.from_profile(chain_profile([1000] * 10, alpha_ms=5.0))
        >>> len(plan(pb).blocks)
        1
    """
    layout = problem.layout()
    cost, ready = problem.cost, problem.ready
    alpha, _ = cost.linear_bound()
    blocks: list[Block] = []
    chan = 0.0                      # when the channel is free (finish of the last closed group)
    grp: list[Any] | None = None    # [buffer, start element, end element, ready of last tensor]
    for i in problem.ready_order():
        b, s, e = layout.pos[i]
        if grp is not None:
            tau_c = grp[3] if grp[3] > chan else chan
            if grp[0] == b and grp[2] == s and ready[i] - tau_c < alpha:
                grp[2] = e
                grp[3] = ready[i]
                continue
            chan = tau_c + cost.allreduce_ms((grp[2] - grp[1]) * layout.itemsize[grp[0]])
            blocks.append(Block(grp[0], grp[1], grp[2]))
        grp = [b, s, e, ready[i]]
    assert grp is not None
    blocks.append(Block(grp[0], grp[1], grp[2]))
    return Plan(layout, blocks, Mode.FENCE, {"groups": len(blocks)})
