"""Exact optimum on small instances: a MILP with pulp, and brute force to check it.

Both search the same space: each tensor is cut into ``units_per_tensor`` equal units (element
ranges, the last one taking the remainder), a block is any run of consecutive units of one
buffer (so it may fuse neighbouring tensors and cut tensors), and blocks go in any order.
The optimum over this space is the yardstick for every strategy's *true* optimality gap on
small instances (``benchmarks/planner.py``); ``best`` also uses it on tiny profiles.

MILP (reads top to bottom):

1. Variables: ``x[k, c] = 1`` when issue slot k sends candidate block c; ``s_k``, ``f_k``
   start and finish of slot k; ``T`` the iteration time.
2. Objective: minimise ``T``.
3. Constraints:
   (a) every unit is sent by exactly one chosen block;
   (b) at most one block per slot, and used slots come first (symmetry);
   (c) ``s_k >= sum_c ready_c x[k, c]`` (a block waits for its last gradient);
   (d) ``s_k >= f_{k-1}`` (one collective at a time);
   (e) ``f_k = s_k + sum_c cost_c x[k, c]``;
   (f) ``T >= f_k + sum_c tail_c x[k, c]`` and ``T >= B + F`` (the closed form of
       :mod:`usbyte_opt.planning.fastsim`).
No big-M is needed: with one block per slot every term is linear in ``x``. Each candidate's
cost is a constant read from the problem's cost model (``cost_c = allreduce_ms(bytes_c)``),
so the MILP is exact for any :class:`~usbyte_opt.planning.cost.CostModel`, linear or not; it
models overlap mode under the default update rule, without the compute-cost option.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(chain_profile([300_000, 100_000, 200_000], alpha_ms=0.5))
    >>> lay = pb.layout()
    >>> milp = solve_exact(pb, lay, units_per_tensor=1)
    >>> brute = solve_brute(pb, lay, units_per_tensor=1)
    >>> abs(milp.iteration_ms - brute.iteration_ms) < 1e-6
    True
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..formats import Block
from .fastsim import block_stats, score, tails
from .problem import Layout, Problem


@dataclass(frozen=True, slots=True)
class ExactResult:
    blocks: list[Block]
    iteration_ms: float
    optimal: bool
    """False when the solver stopped at its time limit with a feasible plan."""


def unit_grid(problem: Problem, layout: Layout, units_per_tensor: int) -> list[list[int]]:
    """Cut points of each buffer: tensor boundaries and ``units_per_tensor`` equal units."""
    grids = []
    for members in layout.members:
        pts = [0]
        for i in members:
            _, s, e = layout.pos[i]
            u = max(1, min(units_per_tensor, e - s))
            for j in range(1, u + 1):
                pts.append(s + (e - s) * j // u)
        grids.append(pts)
    return grids


def _candidates(grids: list[list[int]]) -> list[tuple[Block, tuple[int, int, int]]]:
    out = []
    for b, pts in enumerate(grids):
        for i in range(len(pts) - 1):
            for j in range(i + 1, len(pts)):
                out.append((Block(b, pts[i], pts[j]), (b, i, j)))
    return out


def solve_exact(problem: Problem, layout: Layout, units_per_tensor: int = 1,
                time_limit_s: float = 30.0) -> ExactResult | None:
    """Optimal overlap-mode schedule on the unit grid, by MILP (pulp + CBC, :func:`cbc`),
    under the default update rule and without the compute-cost option.

    Returns ``None`` when the solver found no feasible plan within the time limit, or when
    no CBC is installed.
    """
    import pulp

    grids = unit_grid(problem, layout, units_per_tensor)
    cands = _candidates(grids)
    stats = block_stats(problem, layout, [c for c, _ in cands], tails(problem))
    n_units = sum(len(p) - 1 for p in grids)
    K = n_units
    m = pulp.LpProblem("usbyte_exact", pulp.LpMinimize)
    var = _variables(pulp, m)
    # 1. variables
    x = {(k, c): var(f"x_{k}_{c}", 0, 1, pulp.LpBinary) for k in range(K) for c in range(len(cands))}
    s = [var(f"s_{k}", 0) for k in range(K)]
    f = [var(f"f_{k}", 0) for k in range(K)]
    T = var("T", problem.B + problem.F)
    # 2. objective
    m += T
    # 3(a) each unit exactly once
    for b, pts in enumerate(grids):
        for u in range(len(pts) - 1):
            m += pulp.lpSum(x[k, c] for k in range(K) for c, (_, (cb, i, j)) in enumerate(cands)
                            if cb == b and i <= u < j) == 1
    for k in range(K):
        used = pulp.lpSum(x[k, c] for c in range(len(cands)))
        # 3(b) one block per slot, used slots first
        m += used <= 1
        if k + 1 < K:
            m += pulp.lpSum(x[k + 1, c] for c in range(len(cands))) <= used
        # 3(c)-(f)
        m += s[k] >= pulp.lpSum(stats[c][0] * x[k, c] for c in range(len(cands)))
        if k:
            m += s[k] >= f[k - 1]
        m += f[k] == s[k] + pulp.lpSum(stats[c][1] * x[k, c] for c in range(len(cands)))
        m += T >= f[k] + pulp.lpSum(stats[c][2] * x[k, c] for c in range(len(cands)))
    solver = cbc(time_limit_s)
    if solver is None:
        return None
    status = m.solve(solver)
    if pulp.LpStatus[status] not in ("Optimal", "Not Solved") and m.sol_status not in (1, 2):
        return None
    blocks = []
    for k in range(K):
        for c in range(len(cands)):
            v = x[k, c].value()
            if v is not None and v > 0.5:
                blocks.append(cands[c][0])
    if sum(k.end - k.start for k in blocks) != sum(layout.numel):
        return None
    T_val = score(block_stats(problem, layout, blocks), problem.B, problem.F)
    return ExactResult(blocks, T_val, pulp.LpStatus[status] == "Optimal" and m.sol_status == 1)


def _variables(pulp, model):
    """``var(name, low, up=None, cat=continuous)``: PuLP's ``LpProblem.add_variable`` (variables
    owned by the model, the API of PuLP 3 and 4), or ``LpVariable`` where it is missing."""
    add = getattr(model, "add_variable", None)

    def var(name: str, low: float | None = None, up: float | None = None,
            cat: str = pulp.LpContinuous):
        if add is not None:
            return add(name, low, up, cat)
        return pulp.LpVariable(name, low, up, cat)

    return var


def cbc(time_limit_s: float):
    """PuLP's CBC solver (``COIN_CMD``): the ``cbc`` on the PATH (``pip install pulp[cbc]``
    provides one), else the CBC binary that PuLP < 4 ships; ``None`` when there is neither."""
    import pulp

    solver = pulp.COIN_CMD(msg=False, timeLimit=time_limit_s)
    if solver.available():
        return solver
    from pulp.apis import coin_api

    bundled = getattr(coin_api, "pulp_cbc_path", None)
    if bundled:
        solver = pulp.COIN_CMD(msg=False, timeLimit=time_limit_s, path=bundled)
        if solver.available():
            return solver
    return None


def solve_brute(problem: Problem, layout: Layout, units_per_tensor: int = 1,
                max_orders: int = 2_000_000) -> ExactResult:
    """Optimal schedule on the unit grid by enumeration (every partition, every order).

    Only for tiny instances (about 6 units); used to check :func:`solve_exact`.
    """
    grids = unit_grid(problem, layout, units_per_tensor)
    # Every way to cut each buffer into runs of units.
    per_buffer = []
    for b, pts in enumerate(grids):
        inner = pts[1:-1]
        options = []
        for mask in range(1 << len(inner)):
            cuts = [pts[0]] + [c for i, c in enumerate(inner) if mask >> i & 1] + [pts[-1]]
            options.append([Block(b, a, z) for a, z in zip(cuts, cuts[1:])])
        per_buffer.append(options)
    tail = tails(problem)
    best: tuple[float, list[Block]] | None = None
    seen = 0
    for combo in itertools.product(*per_buffer):
        blocks = [k for part in combo for k in part]
        stats = block_stats(problem, layout, blocks, tail)
        for perm in itertools.permutations(range(len(blocks))):
            seen += 1
            if seen > max_orders:
                raise ValueError("instance too large for brute force")
            v = score([stats[i] for i in perm], problem.B, problem.F)
            if best is None or v < best[0] - 1e-12:
                best = (v, [blocks[i] for i in perm])
    assert best is not None
    return ExactResult(best[1], best[0], True)
