"""Run the strategies on a profile, score them side by side, and build the chosen schedule.

This is the domain code behind ``usbyte-opt optimize``: no printing, no torch.

Example::

    >>> import random
    >>> from usbyte_opt.synthetic import random_profile
    >>> report = compare(random_profile(random.Random(0), 30))
    >>> list(report.results)
    ['wfbp', 'ddp', 'mgwfbp', 'bytescheduler', 'usbyte', 'best']
    >>> report.results["best"].overlap_ms <= min(r.iteration_ms for r in report.results.values())
    True
    >>> report.schedule("best").predicted["iteration_ms"] == report.results["best"].overlap_ms
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .bounds import lower_bound
from .cost import CostModel, retarget
from .errors import UsbyteError
from .fastsim import evaluate
from .formats import Profile, Schedule
from .problem import Problem
from .strategies import Plan, load_builtin


@dataclass(slots=True)
class StrategyResult:
    """One strategy's plan and its predicted times."""

    name: str
    plan: Plan
    native_mode: str
    iteration_ms: float
    """Predicted time in the strategy's native mode."""
    overlap_ms: float
    fence_ms: float
    solve_s: float

    @property
    def blocks(self) -> int:
        return len(self.plan.blocks)


@dataclass(slots=True)
class Report:
    problem: Problem
    lower_bound_ms: float
    results: dict[str, StrategyResult] = field(default_factory=dict)

    @property
    def compute_ms(self) -> float:
        return self.problem.B + self.problem.F

    def baselines(self) -> dict[str, float]:
        """Every strategy's predicted ms in its native mode."""
        return {n: r.iteration_ms for n, r in self.results.items()}

    def schedule(self, name: str) -> Schedule:
        """The schedule of strategy ``name``; ``predicted.iteration_ms`` is in overlap mode,
        the way the runtime runs every schedule."""
        r = self.results[name]
        lb = self.lower_bound_ms
        predicted = {
            "iteration_ms": r.overlap_ms,
            "lower_bound_ms": lb,
            "gap": max(0.0, (r.overlap_ms - lb) / lb) if lb > 0 else 0.0,
            "compute_ms": self.compute_ms,
            "native_mode": r.native_mode,
            "native_ms": r.iteration_ms,
            "baselines": self.baselines(),
        }
        comm = self.problem.profile.comm
        info = {k: v for k, v in r.plan.info.items() if isinstance(v, (int, float, str, bool))}
        extra = {"comm": {"alpha_ms": comm.alpha_ms, "algbw_gbs": comm.algbw_gbs,
                          "world_size": comm.world_size}, "info": info}
        if self.problem.charges_cpu:
            extra["comm"].update(cpu_ms_per_block=comm.cpu_ms_per_block,
                                 cpu_ms_per_mb=comm.cpu_ms_per_mb)
        return self.problem.schedule(name, r.plan.layout, r.plan.blocks, predicted, extra)


def retargeted(profile: Profile, world_size: int | None = None, bandwidth_gbps: float | None = None,
               latency_us: float | None = None) -> Profile:
    """``profile`` with its comm moved to another cluster (see :func:`usbyte_opt.cost.retarget`)."""
    return profile.with_comm(retarget(profile.comm, world_size, bandwidth_gbps, latency_us))


def compare(profile: Profile, strategies: Sequence[str] | None = None,
            options: Mapping[str, Mapping[str, Any]] | None = None) -> Report:
    """Plan ``profile`` with each strategy (default: all registered, ``best`` last).

    ``best`` is seeded with every other plan, so it is never predicted slower than any of
    them in overlap mode (and, without the profile's compute-cost option, in fence mode
    either: see docs/planner.md). ``options`` maps a strategy name to keyword arguments of its plan.
    """
    registry = load_builtin()
    names = list(strategies) if strategies is not None else list(registry)
    for n in names:
        if n not in registry:
            raise UsbyteError(f"strategy {n!r}: expected one of {', '.join(registry)}")
    problem = Problem.from_profile(profile, CostModel.from_comm(profile.comm))
    report = Report(problem, lower_bound(problem))
    options = options or {}
    ordered = [n for n in names if n != "best"] + (["best"] if "best" in names else [])
    for n in ordered:
        st = registry[n]
        kw = dict(options.get(n, {}))
        if n == "best":
            kw.setdefault("seeds", [r.plan for r in report.results.values()])
        t0 = time.perf_counter()
        plan = st.plan(problem, **kw)
        solve = time.perf_counter() - t0
        plan.info.setdefault("strategy", n)
        ov = evaluate(problem, plan.layout, plan.blocks, "overlap")
        fe = evaluate(problem, plan.layout, plan.blocks, "fence")
        native = fe if st.native_mode == "fence" else ov
        report.results[n] = StrategyResult(n, plan, st.native_mode, native, ov, fe, solve)
    # Keep the report in registry order.
    report.results = {n: report.results[n] for n in names}
    return report
