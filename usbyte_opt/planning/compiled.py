"""Plans for compiled training: where a compiled graph is cut, and what the cuts cost.

Under ``torch.compile`` the runtime cuts each graph that reads the planned tensors into
pieces (:mod:`usbyte_opt.runtime.compiled`): a piece's backward hands its gradients on at
its end, and in overlap mode a gate before each piece runs the pending updates it reads.
The pieces come from the plan (:func:`plan_pieces`: tensors held by the same first and last
block go together), but a cut is not free: the compiler can no longer fuse across it, and
the tensors crossing it are materialised and kept for the backward. Measured on two CPU
cores with inductor, one cut in lab-cnn (54 ms an iteration whole) cost between 2 and 20 ms
depending on where it fell.

A compiled profile (``usbyte-opt profile --compile BACKEND``) records what each candidate
cut costs (``meta.compile.cuts``: milliseconds per iteration, by the tensor whose first use
starts the piece after the cut, in forward order; ``meta.compile.cut_default_ms`` for a cut
not measured). With them the planner predicts a plan as it will run compiled
(:func:`compiled_time`) and chooses which of the plan's pieces to cut at
(:func:`choose_cuts`): a cut that costs more than the overlap it makes possible is left out,
its pieces merged. The schedule records the choice (``cut_pieces``), and the runtime cuts
there only.

The iteration model of a cut plan (:func:`cut_problem`): every tensor of a merged piece is
ready when the last of them is (the piece's backward ends) and needed when the first of them
is (its gate runs before the piece); each cut kept adds its cost to the iteration, shared
between forward and backward as their times are, at the cut's place (the ready times after
it in backward order, the need times after it in forward order, move by its share).

No torch import.

Example (three layers of one tensor each; the cut before "mid" is dear, the one before "out"
cheap)::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> prof = Profile("toy", 6.0, 9.0, (
    ...     TensorSpec("out.w", (1_000_000,), "float32", ready_ms=1.0, need_ms=5.0),
    ...     TensorSpec("mid.w", (1_000,), "float32", ready_ms=5.0, need_ms=2.0),
    ...     TensorSpec("inp.w", (1_000,), "float32", ready_ms=9.0, need_ms=0.0)),
    ...     CommSpec("analytic", 2, 0.1, 1.0),
    ...     {"compile": {"cuts": {"mid.w": 4.0, "out.w": 0.5}, "cut_default_ms": 1.0}})
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(prof); lay = pb.layout()
    >>> blocks = [lay.whole(i) for i in pb.ready_order()]
    >>> plan_pieces(*block_membership(lay, blocks))
    [0, 1, 2]
    >>> keep, T = choose_cuts(pb, lay, blocks)
    >>> keep           # piece 1 starts a new piece (the cheap cut); piece 2 joins it
    (1,)
    >>> T < compiled_time(pb, lay, blocks, keep=(1, 2)) and T < compiled_time(pb, lay, blocks, keep=())
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..formats import Block, Mode, Runner
from .problem import Layout, Problem

#: Largest number of pieces whose cuts :func:`choose_cuts` searches one by one; beyond it the
#: search runs on groups of neighbouring pieces (each greedy step costs a simulation per cut).
SEARCH_MAX_PIECES = 16


def plan_pieces(block_tensors: Sequence[Sequence[int]], tensor_blocks: Sequence[Sequence[int]]
                ) -> list[int]:
    """The piece of each tensor: tensors go together when the same blocks, in issue order,
    first and last hold them. The first block says when the backward must have produced the
    tensor's gradient (a tensor cut between blocks is wanted when its first part goes out),
    the last when the next forward may read it (its update waits for every part). Numbered
    by (first, last) block: piece 0 is wanted first. The runtime's splitter starts a new piece
    at the first use of a tensor of another piece.

    Example::

        >>> # 4 tensors; blocks {0,1}, {2 (first part)}, {2 (rest), 3}
        >>> plan_pieces([[0, 1], [2], [2, 3]], [[0], [0], [1, 2], [2]])
        [0, 0, 1, 2]
        >>> # the first block holds the head of tensor 0, the last block its tail
        >>> plan_pieces([[0, 1], [2], [0]], [[0, 2], [0], [1]])
        [1, 0, 2]
    """
    n = len(block_tensors)
    key = [(min(bs), max(bs)) if bs else (n, n) for bs in tensor_blocks]
    rank = {k: i for i, k in enumerate(sorted(set(key)))}
    return [rank[k] for k in key]


def merged_pieces(pieces: Sequence[int], keep: Sequence[int] | None) -> list[int]:
    """Each tensor's piece once only the cuts ``keep`` are made: ``keep`` lists the pieces
    (of :func:`plan_pieces`) that start a new piece; the others join the piece before them.
    ``None``: every cut made.

    Example::

        >>> merged_pieces([0, 0, 1, 2, 3], [2])
        [0, 0, 0, 1, 1]
    """
    if keep is None:
        return list(pieces)
    starts = set(keep)
    top = max(pieces, default=-1)
    group, g = [], 0
    for p in range(top + 1):
        if p in starts and p > 0:
            g += 1
        group.append(g)
    return [group[p] for p in pieces]


def block_membership(layout: Layout, blocks: Sequence[Block]) -> tuple[list[list[int]], list[list[int]]]:
    """The tensors of each block and the blocks of each tensor (issue order)."""
    n = len(layout.pos)
    block_tensors = [layout.tensors_of(k.buffer, k.start, k.end) for k in blocks]
    tensor_blocks: list[list[int]] = [[] for _ in range(n)]
    for b, ts in enumerate(block_tensors):
        for t in ts:
            tensor_blocks[t].append(b)
    return block_tensors, tensor_blocks


def cut_costs(problem: Problem) -> tuple[dict[int, float], float] | None:
    """The compiled profile's cut costs by tensor index (the tensor whose first use starts
    the piece after the cut) and the cost of a cut not measured; ``None`` for a profile
    without them (eager, or compiled before cuts were measured)."""
    comp = problem.profile.meta.get("compile")
    if not isinstance(comp, Mapping) or not isinstance(comp.get("cuts"), Mapping):
        return None
    cuts = {problem.index[k]: float(v) for k, v in comp["cuts"].items()
            if k in problem.index and isinstance(v, (int, float))}
    default = comp.get("cut_default_ms")
    if not isinstance(default, (int, float)):
        default = sorted(cuts.values())[len(cuts) // 2] if cuts else 0.0
    return cuts, float(default)


def segments(problem: Problem, groups: Sequence[int]) -> list[int]:
    """The graph piece each tensor runs in when the tensors are in pieces ``groups``: as the
    runtime's splitter walks the graph in forward order, a module's tensors go with its
    lowest-numbered piece (one graph node reads them together), and a new piece starts at
    every change (a piece met twice with another between runs as two). Numbered in forward
    order; the forward order is the profile's need times."""
    walk = problem.cache.get("compiled-walk")
    if walk is None:   # each tensor's module, and the forward order: once per problem
        walk = problem.cache["compiled-walk"] = (
            [n.rpartition(".")[0] for n in problem.names],
            sorted(range(problem.n), key=lambda t: (problem.need[t], t)))
    module, order = walk
    low: dict[str, int] = {}
    for t, g in enumerate(groups):
        low[module[t]] = min(low.get(module[t], g), g)
    seg = [0] * problem.n
    cur, prev = -1, None
    for t in order:
        g = low[module[t]]
        if g != prev:
            cur, prev = cur + 1, g
        seg[t] = cur
    return seg


def cut_problem(problem: Problem, groups: Sequence[int], costs: tuple[dict[int, float], float]
                ) -> Problem:
    """``problem`` as the plan runs compiled with the tensors in pieces ``groups`` (one per
    tensor, numbered in issue order), cut where :func:`segments` says (see the module
    docstring). The result carries no cut costs of its own."""
    seg = segments(problem, groups)
    n_seg = max(seg, default=-1) + 1
    members: list[list[int]] = [[] for _ in range(n_seg)]
    for t, j in enumerate(seg):
        members[j].append(t)
    ready_s = [max(problem.ready[t] for t in m) for m in members]
    need_s = [min(problem.need[t] for t in m) for m in members]
    measured, default = costs
    # The cut before segment j (forward order) costs what the profile measured before the
    # segment's first-used tensor.
    cut = [0.0] + [measured.get(min(members[j], key=lambda t: (problem.need[t], t)), default)
                   for j in range(1, n_seg)]
    total = sum(cut)
    compute = problem.F + problem.B
    ff = problem.F / compute if total > 0 and compute > 0 else 0.0
    fb = 1.0 - ff if total > 0 else 0.0
    # Forward: segment j starts after the cuts before segments 1..j. Backward runs the
    # segments from the last: segment j's gradients come after the cuts of the segments
    # after it.
    before, acc = [], 0.0
    for j in range(n_seg):
        acc += cut[j]
        before.append(acc)
    ready = [ready_s[seg[t]] + fb * (total - before[seg[t]]) for t in range(problem.n)]
    need = [need_s[seg[t]] + ff * before[seg[t]] for t in range(problem.n)]
    return dataclasses.replace(problem, ready=ready, need=need, B=problem.B + total * fb,
                               F=problem.F + total * ff, cache={}, _ready_order=None,
                               _need_order=None, compiled=False)


def as_compiled(problem: Problem, layout: Layout, blocks: Sequence[Block],
                keep: Sequence[int] | None = None) -> Problem:
    """``problem`` as ``blocks`` run compiled, cut before the pieces ``keep`` (``None``: every
    piece): :func:`cut_problem`; ``problem`` itself when it has no cut costs."""
    costs = cut_costs(problem) if problem.compiled else None
    if costs is None:
        return problem
    groups = merged_pieces(plan_pieces(*block_membership(layout, blocks)), keep)
    return cut_problem(problem, groups, costs)


def compiled_time(problem: Problem, layout: Layout, blocks: Sequence[Block],
                  mode: Mode | str = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME,
                  keep: Sequence[int] | None = None) -> float:
    """The iteration time of ``blocks`` run compiled, cut before the pieces ``keep``
    (:func:`merged_pieces`; ``None``: at every piece, as torch DDP's DDPOptimizer cuts at
    every bucket); the plain prediction for a problem without cut costs."""
    from .simulate import simulate_blocks

    return simulate_blocks(as_compiled(problem, layout, blocks, keep), layout, blocks, Mode(mode),
                           runner).iteration_ms


def choose_cuts(problem: Problem, layout: Layout, blocks: Sequence[Block],
                mode: Mode | str = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME
                ) -> tuple[tuple[int, ...], float]:
    """The pieces (of :func:`plan_pieces`) to cut before, and the compiled iteration time
    with those cuts: greedy, from every cut made (dropping the cut whose removal gains most,
    while one gains) and from none (adding the one that gains most), the better of the two.
    A problem without cut costs: every piece, at the plain prediction."""
    from .simulate import simulate_blocks

    pieces = plan_pieces(*block_membership(layout, blocks))
    n_pieces = max(pieces, default=0) + 1
    every = tuple(range(1, n_pieces))
    costs = cut_costs(problem) if problem.compiled else None
    if costs is None or n_pieces <= 1:
        return every, compiled_time(problem, layout, blocks, mode, runner, None)
    if n_pieces > SEARCH_MAX_PIECES:
        # Candidate cuts: evenly spaced pieces, SEARCH_MAX_PIECES of them.
        step = n_pieces / SEARCH_MAX_PIECES
        cand = tuple(sorted({max(1, round(i * step)) for i in range(1, SEARCH_MAX_PIECES)}))
    else:
        cand = every
    memo: dict[frozenset[int], float] = {}

    def t(keep: frozenset[int]) -> float:
        """The compiled iteration cut before ``keep`` (the plan's pieces and the cut costs
        found once above, not again per evaluation)."""
        if keep not in memo:
            pb = cut_problem(problem, merged_pieces(pieces, sorted(keep)), costs)
            memo[keep] = simulate_blocks(pb, layout, blocks, Mode(mode), runner).iteration_ms
        return memo[keep]

    def descend(keep: frozenset[int]) -> frozenset[int]:
        while keep:
            best = min((keep - {c} for c in keep), key=t)
            if t(best) < t(keep) - 1e-9:
                keep = best
            else:
                break
        return keep

    def ascend(keep: frozenset[int]) -> frozenset[int]:
        while True:
            rest = [c for c in cand if c not in keep]
            if not rest:
                return keep
            best = min((keep | {c} for c in rest), key=t)
            if t(best) < t(keep) - 1e-9:
                keep = best
            else:
                return keep

    options = [descend(frozenset(cand)), ascend(frozenset())]
    win = min(options, key=lambda k: (t(k), len(k)))
    return tuple(sorted(win)), t(win)


__all__ = ["SEARCH_MAX_PIECES", "as_compiled", "block_membership", "choose_cuts", "compiled_time", "cut_costs",
           "cut_problem", "merged_pieces", "plan_pieces", "segments"]
