"""The planner at mixture-of-experts scale: a 10,000-tensor generated profile, every strategy.

No timing here: how long planning takes is measured by ``benchmarks/planner_scale.py``.
"""

import pytest

from usbyte_opt.formats import check_coverage
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.synthetic import moe_profile


def test_ten_thousand_tensors_best_at_most_every_strategy_and_covers_the_buffers():
    prof = moe_profile(layers=21, experts=160, top_k=6)
    assert len(prof.tensors) >= 10_000
    report = compare(prof)
    best = report.results["best"]
    for name, r in report.results.items():
        assert best.iteration_ms <= r.iteration_ms + 1e-9, name
        assert report.lower_bound_ms <= min(r.overlap_ms, r.fence_ms) + 1e-9, name
    sched = report.schedule("best")          # validated against the profile when built
    check_coverage(sched, sched.buffer_numel, "best")
    assert sum(k.end - k.start for k in sched.blocks) == sum(t.numel for t in prof.tensors)
    assert sched.mode == best.mode and sched.predicted["iteration_ms"] == best.iteration_ms


def _digest(report):
    return {n: (r.iteration_ms, r.mode, [(k.buffer, k.start, k.end) for k in r.plan.blocks],
                {k: v for k, v in r.plan.info.items() if k != "solve_s"})
            for n, r in report.results.items()}


def test_a_forked_child_gives_the_same_report(monkeypatch):
    """``compare(workers=2)`` plans bytescheduler and usbyte in a forked child while the parent
    prepares best's candidates that its seeds do not change: the same plans as in one process,
    the default layout shared, also in one mode; and where the child fails, the parent plans
    them itself."""
    import os
    import random
    import sys

    from usbyte_opt.planning import planner
    from usbyte_opt.planning.fastsim import MODES
    from usbyte_opt.planning.strategies import STRATEGIES, Strategy, load_builtin
    from usbyte_opt.planning.synthetic import random_profile

    if not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2:
        pytest.skip("compare forks on Linux with two cores or more")
    monkeypatch.setattr(planner, "FORK_TENSORS", 10)
    prof = random_profile(random.Random(3), 80)
    alone = compare(prof)
    forked = compare(prof, workers=2)
    assert _digest(forked) == _digest(alone)
    assert forked.results["usbyte"].plan.layout is forked.problem.layout()
    assert ("best-prepared", tuple(MODES)) in forked.problem.cache
    fence = {"best": {"modes": ("fence",)}}
    assert _digest(compare(prof, options=fence, workers=2)) == _digest(compare(prof, options=fence))
    parent = os.getpid()
    real = load_builtin()["usbyte"].plan

    def fails_in_child(problem, **kw):
        if os.getpid() != parent:
            raise RuntimeError("child fails")
        return real(problem, **kw)

    monkeypatch.setitem(STRATEGIES, "usbyte", Strategy("usbyte", fails_in_child))
    assert _digest(compare(prof, workers=2)) == _digest(alone)
    monkeypatch.undo()

    # An error in this process after the fork stops and reaps the child (no process left
    # waiting on a pipe nobody reads).
    def fails(problem, **kw):
        raise RuntimeError("wfbp fails")

    def children() -> set[str]:   # this process's children (other tests may leave some)
        import glob

        out = set()
        for f in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = open(f).read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                out.add(f)
        return out

    before = children()
    monkeypatch.setattr(planner, "FORK_TENSORS", 10)
    monkeypatch.setitem(STRATEGIES, "wfbp", Strategy("wfbp", fails))
    with pytest.raises(RuntimeError, match="wfbp fails"):
        compare(prof, workers=2)
    assert children() <= before
