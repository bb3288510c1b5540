"""``best-sharded``: unequal reduce-scatter blocks and all-gather groups, planned together.

In sharded mode the iteration is ``max(B, end of the reduce-scatters) + shard step + A``
(:mod:`usbyte_opt.planning.sharded`): the reduce-scatter phase wants few blocks that end soon
after backward, the all-gather phase wants small groups for the tensors the forward needs
first, and the all-gather groups are unions of reduce-scatter blocks. The search:

1. the all-gather groupings of the tensors from the best one (which reaches the phase's
   part of the lower bound) to a single group (:func:`~usbyte_opt.planning.sharded.gather_groupings`);
2. for each, the reduce-scatter blocks that end soonest with a cut wherever the grouping
   needs one (:func:`~usbyte_opt.planning.sharded.partition`), the grouping on those blocks;
3. beside them: the blocks that end the reduce-scatters soonest with no forced cut, one block
   per tensor, one block per buffer issued once backward has ended (nothing overlaps compute:
   what wins when communication costs the training thread dearly), and the seeds
   (``fsdp-like``, ``dear-like`` plans), each with the best grouping of its blocks
   (:func:`~usbyte_opt.planning.sharded.best_gathers`);

and keeps the fastest by the sharded scorer. It is never slower than a seed.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> from usbyte_opt.planning.sharded import sharded_lower_bound, sharded_time
    >>> pb = Problem.from_profile(chain_profile([250_000] * 6, alpha_ms=0.5, algbw_gbs=1.0))
    >>> p = plan(pb)
    >>> T = sharded_time(pb, p.layout, p.blocks, p.gathers)
    >>> sharded_lower_bound(pb) <= T + 1e-9, p.mode
    (True, <Mode.SHARDED: 'sharded'>)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...formats import Block, Mode
from ..problem import Layout, Problem
from ..sharded import (
    best_gathers,
    gather_groupings,
    one_dtype_each,
    partition,
    sequence,
    sharded_time,
    sort_by_ready,
)
from . import Plan, register


def _grouped(problem: Problem, layout: Layout, groups: Sequence[Sequence[int]],
             ) -> tuple[list[Block], list[tuple[int, ...]]]:
    """Blocks with a cut wherever neighbours in the layout are in different groups of tensors,
    and the groups as all-gathers of those blocks."""
    group_of = [0] * problem.n
    for g, members in enumerate(groups):
        for i in members:
            group_of[i] = g
    seq = sequence(layout)
    forced = [j > 0 and group_of[t] != group_of[seq[j - 1][1]] for j, (_, t) in enumerate(seq)]
    blocks = partition(problem, layout, forced)
    by_group: list[list[int]] = [[] for _ in groups]
    for k, blk in enumerate(blocks):
        by_group[group_of[layout.tensors_of(blk.buffer, blk.start, blk.end)[0]]].append(k)
    return blocks, one_dtype_each(layout, blocks, [tuple(ks) for ks in by_group if ks])


@register("best-sharded", sharded=True)
def plan(problem: Problem, seeds: Sequence[Plan] = (), groupings: int = 16,
         lower_bound_ms: float | None = None) -> Plan:
    """The fastest sharded plan of the search of the module docstring.

    Args:
        problem: the compiled profile.
        seeds: sharded plans to start from (the planner passes the other sharded strategies').
        groupings: how many all-gather groupings step 1 tries.
        lower_bound_ms: stop once a plan is this close to it (the sharded lower bound).

    Returns:
        A sharded-mode :class:`Plan`; ``info["origin"]`` says which candidate won.
    """
    layout = problem.layout()
    (_, _), (a_ag, b_ag) = problem.cost.shard_bounds()
    tails = [problem.F - nd for nd in problem.need]
    nbytes = [problem.nbytes(i) for i in range(problem.n)]
    cands: list[tuple[str, Layout, list[Block], list[tuple[int, ...]]]] = []
    for g_i, groups in enumerate(gather_groupings(nbytes, tails, a_ag, b_ag, problem.F,
                                                  count=groupings)):
        blocks, gathers = _grouped(problem, layout, groups)
        cands.append((f"grouping {g_i}", layout, blocks, gathers))
    fewest = partition(problem, layout)
    per_tensor = sort_by_ready(problem, layout, [layout.whole(i) for i in range(problem.n)])
    # Every buffer in one block, the last one backward finishes first: nothing overlaps
    # backward (what pays when communication costs the training thread dearly).
    after = sorted((Block(b, 0, n) for b, n in enumerate(layout.numel)),
                   key=lambda k: -max(problem.ready[i] for i in layout.members[k.buffer]))
    cands.append(("after backward", layout, after, [tuple(range(len(after)))]))
    for origin, lay, blocks in [("fewest", layout, fewest), ("per tensor", layout, per_tensor),
                                ("after backward, grouped", layout, after)] + \
            [(str(s.info.get("strategy", "seed")), s.layout, list(s.blocks)) for s in seeds]:
        cands.append((origin, lay, blocks, best_gathers(problem, lay, blocks)))
    for s in seeds:
        if s.gathers is not None:
            cands.append((f"{s.info.get('strategy', 'seed')} as planned", s.layout,
                          list(s.blocks), list(s.gathers)))
    best = None
    for origin, lay, blocks, gathers in cands:
        T = sharded_time(problem, lay, blocks, gathers)
        if best is None or T < best[0] - 1e-12:
            best = (T, origin, lay, blocks, gathers)
        if lower_bound_ms is not None and T <= lower_bound_ms * (1 + 1e-9):
            break
    assert best is not None
    T, origin, lay, blocks, gathers = best
    return Plan(lay, blocks, Mode.SHARDED, {"origin": origin, "candidates": len(cands)},
                gathers=gathers)
