"""Run the strategies on a profile, score them side by side, and build the chosen schedule.

This is the domain code behind ``usbyte-opt optimize``: no printing, no torch. Every plan
carries the mode its schedule runs in (fence: every block, then every update, as DDP;
overlap: each update gated in the next forward), and every prediction is the one scorer's
(:class:`usbyte_opt.planning.fastsim.Scorer`) in that mode.

Example::

    >>> import random
    >>> from usbyte_opt.planning.synthetic import random_profile
    >>> report = compare(random_profile(random.Random(0), 30))
    >>> list(report.results)
    ['wfbp', 'ddp', 'ddp-tuned', 'mgwfbp', 'bytescheduler', 'usbyte', 'best']
    >>> [str(r.mode) for r in report.results.values()]
    ['fence', 'fence', 'fence', 'fence', 'overlap', 'overlap', 'overlap']
    >>> report.results["best"].iteration_ms <= min(r.iteration_ms for r in report.results.values())
    True
    >>> report.schedule("best").predicted["iteration_ms"] == report.results["best"].iteration_ms
    True
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError, UsbyteError
from ..formats import Block, Mode, Profile, Runner, Schedule, ddp_buckets
from .bounds import lower_bound
from .compiled import choose_cuts, compiled_time
from .cost import HierCost, retarget
from .fastsim import scorer_for
from .problem import Problem, UpdateRule
from .sharded import sharded_lower_bound, sharded_time, state_bytes, state_slots
from .strategies import NotApplicable, Plan, load_builtin, load_sharded

#: ``progress(event, name, seconds)``: ``("start", name, 0.0)`` before a strategy (or the
#: lower bound, named ``"lower bound"``) runs and ``("done", name, seconds)`` after it.
Progress = Callable[[str, str, float], None]


@dataclass(slots=True)
class StrategyResult:
    """One strategy's plan and its predicted times."""

    name: str
    plan: Plan
    mode: Mode
    """The mode the plan's schedule runs in (``plan.mode``)."""
    iteration_ms: float
    """Predicted time in that mode: what the schedule is predicted to take."""
    overlap_ms: float
    """The plan's blocks all-reduced in overlap mode (for a sharded plan too: what its blocks
    would take unsharded)."""
    fence_ms: float
    solve_s: float
    state_bytes: int = 0
    """Optimizer-state bytes on the rank holding the most (:func:`usbyte_opt.planning.sharded.state_bytes`):
    every gradient's worth unsharded, about ``1 / world_size`` of it sharded."""
    cut_pieces: tuple[int, ...] | None = None
    """A compiled profile's plan run by the runtime: the pieces it cuts before
    (:func:`usbyte_opt.planning.compiled.choose_cuts`), which :attr:`iteration_ms` charges;
    ``None`` otherwise."""
    hier: bool = False
    """Planned under the hierarchical model (:class:`~usbyte_opt.planning.cost.HierCost`):
    each of its blocks all-reduced hierarchically where that is cheaper; ``False``: every
    block flat."""

    @property
    def blocks(self) -> int:
        return len(self.plan.blocks)

    @property
    def gathers(self) -> int:
        """All-gathers of a sharded plan (0 otherwise)."""
        return len(self.plan.gathers or ())


@dataclass(slots=True)
class Report:
    problem: Problem
    lower_bound_ms: float
    results: dict[str, StrategyResult] = field(default_factory=dict)
    bound_s: float = 0.0
    """Time taken by the lower bound."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Strategies that have no plan for this profile, with the reason (one line each), e.g.
    ``ddp-tuned`` on tensors of several dtypes."""
    sharded: bool = False
    """Whether these are sharded-mode plans (``compare(shard=True)``); the lower bound is then
    sharded mode's (:func:`usbyte_opt.planning.sharded.sharded_lower_bound`)."""
    reference: StrategyResult | None = None
    """Sharded reports: unsharded DDP's plan, its time and state, to weigh them against."""
    state_slots: int = 0
    """Optimizer state per element, in element sizes, that ``state_bytes`` counts."""

    @property
    def compute_ms(self) -> float:
        return self.problem.B + self.problem.F

    @property
    def hierarchical(self) -> bool:
        """Whether blocks may be hierarchical here (several nodes of several ranks, hierarchy
        on): then the known strategies and ``best-flat`` are flat, ``best`` is not."""
        c = self.problem.cost
        return isinstance(c, HierCost) and c.hierarchy

    def hier_blocks(self, name: str) -> int:
        """How many blocks of strategy ``name`` are hierarchical (before alignment)."""
        r = self.results[name]
        c = self.problem.cost
        if not (r.hier and isinstance(c, HierCost)):
            return 0
        lay = r.plan.layout
        return sum(c.is_hier((k.end - k.start) * lay.itemsize[k.buffer]) for k in r.plan.blocks)

    def baselines(self) -> dict[str, float]:
        """Every strategy's predicted ms, each in its plan's mode."""
        return {n: r.iteration_ms for n, r in self.results.items()}

    def schedule(self, name: str, profile_digest: str | None = None) -> Schedule:
        """The schedule of strategy ``name``, in its plan's mode; ``predicted.iteration_ms``
        is the prediction in that mode. ``profile_digest``: the digest to record (default:
        the planned profile's; a retargeted plan records the file's)."""
        r = self.results[name]
        lb = self.lower_bound_ms
        predicted = {
            "iteration_ms": r.iteration_ms,
            "mode": r.mode,
            "lower_bound_ms": lb,
            "gap": max(0.0, (r.iteration_ms - lb) / lb) if lb > 0 else 0.0,
            "compute_ms": self.compute_ms,
            "overlap_ms": r.overlap_ms,
            "fence_ms": r.fence_ms,
            "baselines": self.baselines(),
            "state_bytes_per_rank": r.state_bytes,
        }
        if self.reference is not None:
            predicted["reference"] = {"strategy": self.reference.name,
                                      "iteration_ms": self.reference.iteration_ms,
                                      "state_bytes_per_rank": self.reference.state_bytes}
        comm = self.problem.profile.comm
        cost = self.problem.cost
        hier = cost.is_hier if r.hier and isinstance(cost, HierCost) else None
        # Wall-clock figures stay out: the file depends on the profile alone, so planning it
        # again writes the same bytes.
        info = {k: v for k, v in r.plan.info.items()
                if isinstance(v, (int, float, str, bool)) and k != "solve_s"}
        extra: dict[str, Any] = {"comm": {"alpha_ms": comm.alpha_ms, "algbw_gbs": comm.algbw_gbs,
                                          "world_size": comm.world_size}, "info": info}
        if self.problem.charges_cpu:
            extra["comm"].update(cpu_ms_per_block=comm.cpu_ms_per_block,
                                 cpu_ms_per_mb=comm.cpu_ms_per_mb)
        if self.hierarchical:
            extra["comm"].update(nodes=comm.nodes, ranks_per_node=comm.ranks_per_node)
        sched = self.problem.schedule(name, r.plan.layout, r.plan.blocks, predicted, extra,
                                      mode=r.mode, profile_digest=profile_digest,
                                      gathers=r.plan.gathers, hier=hier)
        if r.cut_pieces is not None:
            # The pieces of the schedule's own blocks (alignment may have moved a cut).
            keep = r.cut_pieces if tuple(sched.blocks) == tuple(r.plan.blocks) else choose_cuts(
                self.problem, self.problem.layout(sched.buffers), sched.blocks, r.mode)[0]
            sched = dataclasses.replace(sched, cut_pieces=keep)
        if r.plan.runner is Runner.DDP:
            # torch DDP runs it with the planned buckets where it can express them (one dtype:
            # DDP's own buckets of several dtypes are left to the runtime's file)
            try:
                ddp_buckets(sched)
            except FormatError:
                pass
            else:
                sched = dataclasses.replace(sched, runner=Runner.DDP)
        if self.hierarchical:
            n_hier = sum(k.hier for k in sched.blocks)
            sched = dataclasses.replace(sched, predicted={
                **sched.predicted, "blocks_hier": n_hier, "blocks_flat": len(sched.blocks) - n_hier})
        return sched


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was after it.

    Planning a large profile allocates millions of small objects (blocks, heap entries,
    candidate lists) and frees them by reference counting; none of it forms cycles that
    matter. With the collector on, every 700 allocations start a collection, and the full ones
    walk every live object: on 10,000+ tensors that was a fifth to a third of ``usbyte-opt
    optimize``'s time. Nested uses are fine (the outermost one restores the state).

    Example::

        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def retargeted(profile: Profile, world_size: int | None = None, bandwidth_gbps: float | None = None,
               latency_us: float | None = None, **levels: Any) -> Profile:
    """``profile`` with its comm moved to another cluster (see
    :func:`usbyte_opt.planning.cost.retarget`; ``levels``: its keyword-only options, nodes and
    per-level bandwidths and latencies)."""
    return profile.with_comm(retarget(profile.comm, world_size, bandwidth_gbps, latency_us,
                                      **levels))


def single_rank(profile: Profile) -> Profile:
    """``profile`` as one rank runs it: nothing to communicate (world size 1, all-reduce at
    no cost: the line ``alpha = 0`` at the format's largest bandwidth, so that 100 MB cost
    0.001 ms), the host cost kept, so that every plan is predicted as compute plus the host
    cost of what runs it (the runtime's or DDP's own work per tensor and per block, which its
    one-rank collectives are part of). What ``usbyte-opt bench`` and ``demo`` predict on one
    rank.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> single_rank(chain_profile([1000, 1000])).comm.world_size
        1
    """
    from ..formats import MAX_ALGBW_GBS, CommSpec

    return profile.with_comm(CommSpec(profile.comm.backend, 1, 0.0, MAX_ALGBW_GBS))


def compare(profile: Profile, strategies: Sequence[str] | None = None,
            options: Mapping[str, Mapping[str, Any]] | None = None,
            progress: Progress | None = None,
            update_rule: UpdateRule | None = None, shard: bool = False,
            optimizer: str | None = None, workers: int = 1, hierarchy: bool = True) -> Report:
    """Plan ``profile`` with each strategy (default: all registered, ``best`` last).

    ``best`` is seeded with every other plan and searches both modes, so it is never
    predicted slower than any of them run on the runtime (DDP's buckets included), whatever
    the profile's compute-cost fields. Each plan is scored with the host cost of its runner
    (:attr:`~usbyte_opt.planning.strategies.Plan.runner`): torch DDP's for ``ddp`` and
    ``ddp-tuned``, the runtime's for the others and ``best``; where DDP's is the lower, torch
    DDP can be predicted faster than ``best`` (by at most the difference). ``options`` maps a
    strategy name to keyword arguments of its plan; ``progress`` is told when each strategy
    starts and ends (:data:`Progress`). ``update_rule``: where
    the iteration model puts the optimizer updates (:class:`~usbyte_opt.planning.problem.UpdateRule`);
    every plan is scored and chosen under it. The default is the rule the runtime follows on
    the profile's device (:meth:`~usbyte_opt.planning.problem.UpdateRule.of`): ``GATE``, the
    optimizer step on the training thread at the forward's gates, for a profile of CPU ranks;
    ``AVAIL`` on NCCL and for a profile that names no device. A strategy that has no
    plan for the profile (:class:`~usbyte_opt.planning.strategies.NotApplicable`) is left out
    of ``results`` and named in ``skipped``.

    ``shard=True`` plans sharded mode instead (:data:`~usbyte_opt.planning.strategies.SHARDED_STRATEGIES`:
    ``fsdp-like``, ``dear-like``, ``best-sharded``, the last seeded with the others), scored
    by :func:`usbyte_opt.planning.sharded.sharded_time` against sharded mode's lower bound,
    with unsharded DDP as the report's ``reference``. Every result's ``state_bytes`` counts
    the optimizer state of ``optimizer`` (``sgd``, ``adam``, ``adamw``; default: the one the
    profile timed, :func:`usbyte_opt.planning.sharded.state_slots`).

    ``workers=2`` plans :data:`FORKED` (the longest of the strategies that ``best`` is seeded
    with) in a forked child process while this one plans the others and the candidates of
    ``best`` that do not depend on its seeds (:func:`usbyte_opt.planning.strategies.best.prepare`),
    on a profile of at least :data:`FORK_TENSORS` tensors, on a Linux machine of two cores or
    more: the same plans, sooner (what ``usbyte-opt optimize`` does).
    Where the child fails, this process plans them after all.

    Several nodes (a profile whose comm has nodes and both level lines,
    :class:`~usbyte_opt.planning.cost.HierCost`): the known strategies are planned and scored
    with flat rings only (what they run; DDP over NCCL is flat), ``best-flat`` is ``best``
    restricted to flat blocks, seeded with them, and ``best`` plans under the cheaper of flat
    and hierarchical per block, seeded with all of them, so ``best <= best-flat <=`` every
    other; the two share ``best``'s time budget. The lower bound, under the cheaper form, holds
    for both. ``hierarchy=False`` (and sharded mode) plans flat rings only, as on one node.
    """
    with gc_paused():
        return _compare(profile, strategies, options, progress, update_rule, shard, optimizer,
                        workers, hierarchy)


#: ``compare(workers=2)`` forks only for profiles of at least this many tensors (below, the
#: strategies take less than starting a process costs).
FORK_TENSORS = 2000
#: The strategies a forked child plans (``compare(workers=2)``), in this order.
FORKED = ("bytescheduler", "usbyte")
#: On several nodes: ``best`` restricted to flat blocks, reported beside the others.
BEST_FLAT = "best-flat"
#: ``best``'s default local-search budget (its ``time_budget_s``), seconds.
BEST_BUDGET_S = 0.6


def _compare(profile: Profile, strategies: Sequence[str] | None,
             options: Mapping[str, Mapping[str, Any]] | None, progress: Progress | None,
             update_rule: UpdateRule | None, shard: bool, optimizer: str | None,
             workers: int = 1, hierarchy: bool = True) -> Report:
    """:func:`compare` itself (which runs it with the garbage collector paused,
    :func:`gc_paused`): the problem, the lower bound, then each strategy in turn
    (:func:`_plan_one`), ``best`` last."""
    registry = load_sharded() if shard else load_builtin()
    names = list(strategies) if strategies is not None else list(registry)
    for n in names:
        if n not in registry:
            raise UsbyteError(f"strategy {n!r}: expected one of {', '.join(registry)}"
                              + (" (sharded mode)" if shard else ""))
    say = progress or (lambda event, name, seconds: None)
    problem = Problem.from_profile(profile, update_rule=update_rule)
    if isinstance(problem.cost, HierCost) and (shard or not hierarchy):
        problem = problem.with_cost(problem.cost.flat_only())
    slots = state_slots(problem, optimizer)
    forked = [n for n in FORKED if n in names]
    child = None
    if (workers > 1 and not shard and forked and problem.n >= FORK_TENSORS
            and sys.platform.startswith("linux") and (os.cpu_count() or 1) > 1):
        child = _Forked({n: (registry[n].plan, dict((options or {}).get(n, {}))) for n in forked},
                        _flat(problem))
    try:
        say("start", "lower bound", 0.0)
        t0 = time.perf_counter()
        report = Report(problem, (sharded_lower_bound if shard else lower_bound)(problem),
                        sharded=shard, state_slots=slots)
        report.bound_s = time.perf_counter() - t0
        say("done", "lower bound", report.bound_s)
        if shard:
            report.reference = _result("ddp", load_builtin()["ddp"].plan(problem), problem, slots, 0.0)
        best = "best-sharded" if shard else "best"
        ordered = [n for n in names if n != best] + ([best] if best in names else [])
        if isinstance(problem.cost, HierCost) and best in names:
            ordered.insert(-1, BEST_FLAT)
            names = names[:names.index(best)] + [BEST_FLAT] + names[names.index(best):]
        first_forked = next((n for n in ordered if n in forked), None)
        run = _Planning(report, registry, options or {}, best, say, child, forked,
                        first_forked if child is not None and best in names else None)
        for n in ordered:
            _plan_one(run, n)
    finally:
        if child is not None:
            child.close()
    # Keep the report in registry order.
    report.results = {n: report.results[n] for n in names if n in report.results}
    return report


def _flat(problem: Problem) -> Problem:
    """``problem`` on flat rings only (several nodes: what every strategy but ``best`` runs)."""
    return problem.with_cost(problem.cost.flat_only()) if isinstance(problem.cost, HierCost) else problem


@dataclass(slots=True)
class _Planning:
    """One :func:`compare` under way: its report so far and how it plans each strategy."""

    report: Report
    registry: Mapping[str, Any]
    options: Mapping[str, Mapping[str, Any]]
    best: str
    say: Progress
    child: _Forked | None
    """The forked child planning :data:`FORKED` (``workers=2``), if any."""
    forked: list[str]
    prepare_before: str | None
    """The strategy before which ``best``'s seed-free candidates are prepared (the first the
    child plans: this process does that work while the child runs)."""


def _plan_one(run: _Planning, n: str) -> None:
    """Plan strategy ``n`` (or :data:`BEST_FLAT`) into ``run.report``: ``best`` seeded with
    the results so far, a forked strategy's plan from the child, a strategy without a plan
    for the profile into ``report.skipped``."""
    report, best, options, child, say = run.report, run.best, run.options, run.child, run.say
    problem = report.problem
    hier = isinstance(problem.cost, HierCost)
    kw = dict(options.get(best if n == BEST_FLAT else n, {}))
    if n in (best, BEST_FLAT):
        kw.setdefault("seeds", [r.plan for r in report.results.values()])
        kw.setdefault("lower_bound_ms", report.lower_bound_ms)
        if hier:       # best-flat and best share the budget of one
            kw["time_budget_s"] = 0.5 * float(kw.get("time_budget_s", BEST_BUDGET_S))
    if n == run.prepare_before:
        # before waiting for the child (in the default order, the strategies it plans come
        # last before best), the candidates of best that its seeds do not change
        from .strategies.best import prepare

        prepare(problem, **{k: v for k, v in options.get(best, {}).items() if k == "modes"})
    say("start", n, 0.0)
    t0 = time.perf_counter()
    on = problem if n == best else _flat(problem)
    try:
        if child is not None and n in run.forked:
            plan, solve = child.result(n)
        else:
            plan = run.registry[best if n == BEST_FLAT else n].plan(on, **kw)
            solve = time.perf_counter() - t0
    except NotApplicable as e:
        report.skipped[n] = str(e)
        say("done", n, time.perf_counter() - t0)
        return
    if n == BEST_FLAT:
        plan.info["strategy"] = n
    plan.info.setdefault("strategy", n)
    if plan.runner is Runner.DDP:
        on = _flat(problem)          # torch DDP all-reduces its buckets flat
    result = _result(n, plan, on, report.state_slots, solve)
    result.hier = hier and n == best and plan.runner is not Runner.DDP
    if result.hier and BEST_FLAT in report.results:
        # best under the cheaper form is never slower than best-flat (its seed): kept so
        # where the compute-cost charge would make it so
        bf = report.results[BEST_FLAT]
        if result.iteration_ms > bf.iteration_ms:
            result = dataclasses.replace(bf, name=n, solve_s=solve)
    report.results[n] = result
    say("done", n, solve)


class _Forked:
    """Each ``plan(problem, **kw)`` of ``plans`` (name to function and keywords) in a forked
    child process, started now, one after the other; :meth:`result` waits for them. The child
    sends back each plan's blocks, mode and notes (and its layout, unless it is the problem's
    default one, which this process has already), or the
    :class:`~usbyte_opt.planning.strategies.NotApplicable` it raised; where anything else goes
    wrong, :meth:`result` plans here instead, so the result is the same either way."""

    def __init__(self, plans: dict[str, tuple[Callable[..., Plan], dict[str, Any]]],
                 problem: Problem):
        self.plans, self.problem = plans, problem
        self.msgs: dict[str, tuple] | None = None
        self.pid = -1
        read, write = os.pipe()
        try:
            self.pid = os.fork()
        except OSError:
            os.close(read)
            os.close(write)
            return
        if self.pid == 0:                       # the child: plan, send, leave at once
            code = 1
            try:
                os.close(read)
                msgs: dict[str, tuple] = {}
                for name, (fn, kw) in plans.items():
                    t0 = time.perf_counter()
                    try:
                        p = fn(problem, **kw)
                        default = p.layout is problem.layout()
                        msgs[name] = ("plan", [(b.buffer, b.start, b.end) for b in p.blocks],
                                      None if default else p.layout, str(p.mode), p.info,
                                      p.gathers, time.perf_counter() - t0)
                    except NotApplicable as e:
                        msgs[name] = ("skip", str(e))
                with os.fdopen(write, "wb") as f:
                    pickle.dump(msgs, f, protocol=pickle.HIGHEST_PROTOCOL)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self.read = read

    def close(self) -> None:
        """Stop and reap the child if its results were not read (this process is leaving
        :func:`compare` on an error): it must not wait on a pipe nobody reads."""
        if self.msgs is None and self.pid > 0:
            self.msgs = {}
            os.close(self.read)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)

    def _wait(self) -> dict[str, tuple]:
        if self.msgs is None:
            self.msgs = {}
            if self.pid > 0:
                try:
                    with os.fdopen(self.read, "rb") as f:
                        data = f.read()
                finally:
                    os.waitpid(self.pid, 0)
                try:
                    self.msgs = pickle.loads(data) if data else {}
                except Exception:   # a child that died half-way: plan here
                    self.msgs = {}
        return self.msgs

    def result(self, name: str) -> tuple[Plan, float]:
        """``(plan, solve seconds)`` of ``name``; raises the child's ``NotApplicable``."""
        msg = self._wait().get(name)
        if msg is None:
            fn, kw = self.plans[name]
            t0 = time.perf_counter()
            plan = fn(self.problem, **kw)
            return plan, time.perf_counter() - t0
        if msg[0] == "skip":
            raise NotApplicable(msg[1])
        _, blocks, layout, mode, info, gathers, solve = msg
        lay = self.problem.layout() if layout is None else layout
        return Plan(lay, [Block(*b) for b in blocks], Mode(mode), info, gathers), solve


def _result(name: str, plan: Plan, problem: Problem, slots: int, solve: float) -> StrategyResult:
    """``plan`` scored in its mode (and its blocks all-reduced in both others), with its
    optimizer state per rank."""
    sc = scorer_for(problem, plan.layout)
    stats = sc.stats(plan.blocks)
    ov, fe = sc.score(stats, Mode.OVERLAP, plan.runner), sc.score(stats, Mode.FENCE, plan.runner)
    if plan.mode == Mode.SHARDED:
        T = sharded_time(problem, plan.layout, plan.blocks, plan.gathers)
        state = state_bytes(problem, plan.layout, plan.blocks, slots)
    else:
        T = fe if plan.mode == Mode.FENCE else ov
        state = state_bytes(problem, plan.layout, None, slots)
    cuts = None
    if problem.compiled and plan.mode != Mode.SHARDED:
        # Compiled: the cuts the plan's pieces need cost compute (planning.compiled); torch
        # DDP's DDPOptimizer cuts at every bucket, the runtime where the cut pays.
        if plan.runner is Runner.DDP:
            T = compiled_time(problem, plan.layout, plan.blocks, plan.mode, plan.runner)
        elif plan.cut_pieces is not None:   # chosen by the strategy already (best)
            cuts = plan.cut_pieces
            T = compiled_time(problem, plan.layout, plan.blocks, plan.mode, plan.runner, cuts)
        else:
            cuts, T = choose_cuts(problem, plan.layout, plan.blocks, plan.mode, plan.runner)
    return StrategyResult(name, plan, plan.mode, T, ov, fe, solve, state, cut_pieces=cuts)


