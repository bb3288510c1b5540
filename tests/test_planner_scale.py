"""The planner at mixture-of-experts scale: a 10,000-tensor generated profile, every strategy.

No timing here: how long planning takes is measured by ``benchmarks/planner_scale.py``.
"""

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
