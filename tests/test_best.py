"""The lower bound, the exact solvers and `best`: validity, never worse, close to optimal."""

import dataclasses
import random

import pytest
from helpers import random_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.formats import CommSpec, Profile, TensorSpec, check_coverage
from usbyte_opt.planning.bounds import lower_bound
from usbyte_opt.planning.exact import solve_brute, solve_exact
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem, UpdateRule
from usbyte_opt.planning.strategies import get
from usbyte_opt.planning.synthetic import chain_profile, random_profile


def tiny(seed: int, n: int, ratio: float = 1.0, alpha: float = 0.5) -> Problem:
    rng = random.Random(seed)
    return Problem.from_profile(random_profile(rng, n, comm_ratio=ratio, alpha_ms=alpha))


def test_bound_is_exact_for_one_tensor():
    # One tensor ready when backward ends, needed at the start of forward:
    # T = B + alpha + w + F exactly, and the bound must say so.
    prof = Profile("one", 4.0, 6.0, (TensorSpec("w", (250_000,), "float32", 6.0, 0.0),),
                   CommSpec("analytic", 2, 1.0, 1.0))
    pb = Problem.from_profile(prof)
    plan = get("wfbp").plan(pb)
    assert evaluate(pb, plan.layout, plan.blocks) == 12.0
    assert lower_bound(pb) == 12.0


def test_bound_counts_alphas_when_latency_bound():
    # 20 small tensors ready 1 ms apart, alpha 5 ms: two-block reasoning gives about
    # 0 + 2 * 5 + tiny; batching forces more blocks, and the bound must see it.
    prof = chain_profile([1000] * 20, forward_ms=2.0, backward_ms=20.0, alpha_ms=5.0,
                         algbw_gbs=10.0, compute=[1] * 20)
    pb = Problem.from_profile(prof)
    best = get("best").plan(pb)
    T = evaluate(pb, best.layout, best.blocks)
    lb = lower_bound(pb)
    assert lb <= T + 1e-9
    assert lb >= 20.0 + 5.0 + 2.0 - 1e-9   # the input layer's gradient alone
    assert (T - lb) / lb < 0.05


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 4), alpha=st.sampled_from([0.0, 0.2, 2.0]),
       ratio=st.sampled_from([0.3, 1.0, 3.0]))
def test_bound_below_brute_force_optimum(seed, n, alpha, ratio):
    pb = tiny(seed, n, ratio, alpha)
    lay = pb.layout()
    opt = solve_brute(pb, lay, units_per_tensor=2 if n <= 2 else 1)
    assert lower_bound(pb) <= opt.iteration_ms + 1e-9


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(2, 5))
def test_milp_equals_brute_force(seed, n):
    pb = tiny(seed, n, alpha=1.0)
    lay = pb.layout()
    milp = solve_exact(pb, lay, units_per_tensor=1, time_limit_s=30)
    brute = solve_brute(pb, lay, units_per_tensor=1)
    assert milp.optimal
    assert milp.iteration_ms == pytest.approx(brute.iteration_ms, abs=1e-6)
    check_coverage(pb.schedule("x", lay, milp.blocks, check=False), lay.numel, "milp")


@pytest.mark.parametrize("seed", range(6))
def test_best_close_to_exact_on_small_instances(seed):
    pb = tiny(seed, 6, ratio=[0.5, 1.0, 2.0][seed % 3], alpha=[0.2, 1.3][seed % 2])
    lay = pb.layout()
    opt = solve_brute(pb, lay, units_per_tensor=1)
    plan = get("best").plan(pb, exact_max_tensors=0)   # no MILP shortcut: the search itself
    T = evaluate(pb, plan.layout, plan.blocks)
    # best may cut tensors, so it can beat the whole-tensor grid; it must not be far above.
    assert T <= opt.iteration_ms * 1.03
    assert lower_bound(pb) <= T + 1e-9


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 40),
       ratio=st.sampled_from([0.2, 1.0, 4.0]), alpha=st.sampled_from([0.0, 0.1, 1.3]))
def test_best_never_slower_than_any_strategy(seed, n, ratio, alpha):
    prof = random_profile(random.Random(seed), n, comm_ratio=ratio, alpha_ms=alpha,
                          dtypes=("float32", "float16"))
    report = compare(prof)
    best = report.results["best"]
    lb = report.lower_bound_ms
    for name, r in report.results.items():
        assert best.iteration_ms <= min(r.iteration_ms, r.overlap_ms, r.fence_ms) + 1e-9, name
        assert min(r.overlap_ms, r.fence_ms) >= lb - 1e-9, name
    # Without the compute-cost option overlap mode is never slower for the same blocks.
    assert best.mode == "overlap"
    sched = report.schedule("best")
    assert sched.predicted["iteration_ms"] == best.iteration_ms and sched.mode == "overlap"
    assert 0 <= sched.predicted["gap"]


def test_best_fuses_where_latency_dominates_and_splits_where_bandwidth_does():
    sizes = [2_000_000, 50_000, 50_000, 3_000_000, 50_000, 50_000, 4_000_000]
    lat = Problem.from_profile(chain_profile(sizes, alpha_ms=20.0, algbw_gbs=50.0))
    bw = Problem.from_profile(chain_profile(sizes, alpha_ms=0.01, algbw_gbs=1.0))
    b_lat, b_bw = get("best").plan(lat), get("best").plan(bw)
    assert len(b_lat.blocks) < len(sizes)
    w_bw = get("wfbp").plan(bw)
    assert evaluate(bw, b_bw.layout, b_bw.blocks) < evaluate(bw, w_bw.layout, w_bw.blocks)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10 ** 6))
def test_two_phase_dynamic_programme_equals_brute_force(seed):
    """Phase 2 of two_phase in O(N log N) against the definition, O(N^3)."""
    from usbyte_opt.planning.strategies.best import _phase2

    rng = random.Random(seed)
    N = rng.randint(1, 25)
    P = [0.0]
    for _ in range(N):
        P.append(P[-1] + rng.choice([0.0, rng.uniform(0, 3)]))
    Q = [rng.choice([rng.uniform(0, 10), float(rng.randint(0, 3))]) for _ in range(N)]
    buf = [rng.randint(0, 1) if rng.random() < 0.3 else 0 for _ in range(N)]
    run_lo = [0] * N
    for j in range(1, N):
        run_lo[j] = run_lo[j - 1] if buf[j] == buf[j - 1] else j
    alpha = rng.choice([0.0, 0.5, 2.0])
    x = rng.randint(0, N - 1)
    D, arg = _phase2(x, N, P, Q, run_lo, alpha)
    ref = [0.0] * (N + 1)
    for y in range(x + 1, N + 1):
        ref[y] = min(alpha + P[y] - P[z] + max(max(Q[z:y]), ref[z])
                     for z in range(max(x, run_lo[y - 1]), y))
        z = arg[y]
        assert max(x, run_lo[y - 1]) <= z < y
        assert D[y] == pytest.approx(alpha + P[y] - P[z] + max(max(Q[z:y]), D[z]), abs=1e-9)
    assert D[x + 1:] == pytest.approx(ref[x + 1:], abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_best_in_fence_mode_only_is_fence_and_never_slower_than_the_fence_strategies(seed):
    """``optimize --mode fence``: what a trainer that waits for its gradients after backward
    runs as planned."""
    prof = random_profile(random.Random(seed), 10, comm_ratio=1.5, alpha_ms=0.3)
    report = compare(prof, options={"best": {"modes": ("fence",)}})
    best = report.results["best"]
    assert best.mode == "fence" and best.plan.mode == "fence"
    for name, r in report.results.items():
        if name != "best":
            assert best.fence_ms <= r.fence_ms * (1 + 1e-9), name
    assert best.iteration_ms >= report.lower_bound_ms * (1 - 1e-9)


def test_best_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="modes: expected a non-empty subset"):
        get("best").plan(tiny(0, 4), modes=("sideways",))


def test_best_plans_against_the_updates_at_the_gates():
    prof = random_profile(random.Random(11), 20, comm_ratio=0.6)
    prof = dataclasses.replace(prof, tensors=tuple(
        dataclasses.replace(t, update_ms=0.4) for t in prof.tensors))
    report = compare(prof, update_rule=UpdateRule.GATE)
    pb = report.problem
    assert pb.update_rule == UpdateRule.GATE
    for name, r in report.results.items():
        assert r.iteration_ms == pytest.approx(evaluate(pb, r.plan.layout, r.plan.blocks, r.mode)), name
        assert report.lower_bound_ms <= r.iteration_ms + 1e-9
    best = report.results["best"].iteration_ms
    assert best <= min(r.iteration_ms for r in report.results.values()) + 1e-9


# --- claim 4 of the lower bound (nested windows) and best's bound-guided candidates -----------

def _nested_exhaustive(items, alpha):
    """The least T of claim 4's (*) over every A, C (both holding the top item): the
    definition, against which the programme's pruning is checked."""
    import itertools

    G = len(items.R)
    best = float("inf")
    rest = range(G - 1)
    subsets = [set(c) | {G - 1} for m in range(G) for c in itertools.combinations(rest, m)]
    for A in subsets:
        for C in subsets:
            T = max(items.R[min(a for a in A if a >= k)] + items.Q[min(c for c in C if c >= k)]
                    + alpha * (sum(a >= k for a in A) + sum(c >= k for c in C) - 1) + items.Wsuf[k]
                    for k in range(G))
            best = min(best, T)
    return best


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), G=st.integers(1, 6), alpha=st.sampled_from([0.0, 0.5, 3.0]))
def test_nested_programme_equals_its_definition(seed, G, alpha):
    import numpy as np

    from usbyte_opt.planning.bounds import _nested_search, nested_config, nested_items

    rng = random.Random(seed)
    r = np.array([rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(G)])
    q = np.array([rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(G)])
    w = np.array([rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(G)])
    items = nested_items(r, q, w, rng.choice(["ready", "tail"]))
    exact = _nested_exhaustive(items, alpha)
    lo, hi = _nested_search(items, alpha, 0.0)
    assert lo <= exact + 1e-9 and exact <= hi + 1e-6 * max(1.0, hi)
    cfg = nested_config(items, alpha, hi)
    assert cfg is not None
    assert items.R.size == 0 or (cfg[0][-1] == cfg[1][-1] == len(items.R) - 1)


def test_nested_bound_is_the_optimum_where_the_old_claims_are_not():
    # out (2 MB, ready 1, needed at 2), mid (2 MB, ready 3, needed at 1), inp (2 MB, ready 6,
    # needed at 0); alpha 2 ms, 1 GB/s, F = 4, B = 6. Claims 1-2 give 14; the best plan
    # sends out alone, then mid and inp together after backward: 6 + 2 + 4 + 4 = 16.
    mb2 = 500_000
    prof = Profile("nested", 4.0, 6.0, (TensorSpec("out", (mb2,), "float32", 1.0, 2.0),
                                        TensorSpec("mid", (mb2,), "float32", 3.0, 1.0),
                                        TensorSpec("inp", (mb2,), "float32", 6.0, 0.0)),
                   CommSpec("analytic", 2, 2.0, 1.0))
    pb = Problem.from_profile(prof)
    opt = solve_brute(pb, pb.layout(), units_per_tensor=2)
    assert opt.iteration_ms == pytest.approx(16.0)
    assert lower_bound(pb) == pytest.approx(16.0, abs=1e-4)
    assert lower_bound(pb) <= opt.iteration_ms
    best = get("best").plan(pb, exact_max_tensors=0)
    assert evaluate(pb, best.layout, best.blocks, best.mode) == pytest.approx(16.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 30), shuffle=st.sampled_from([0.0, 1.0]),
       alpha=st.sampled_from([0.0, 0.3, 3.0]))
def test_nested_bound_below_random_schedules(seed, n, shuffle, alpha):
    """Claim 4 holds for arbitrary schedules, nested profiles or not (shuffled need times)."""
    from usbyte_opt.planning.bounds import nested_bound

    rng = random.Random(seed)
    pb = Problem.from_profile(random_profile(rng, n, comm_ratio=rng.choice([0.5, 2.0]), alpha_ms=alpha,
                                             dtypes=("float32", "float16"), shuffle_need=shuffle))
    lb = nested_bound(pb)
    lay = pb.layout()
    for _ in range(8):
        blocks = random_blocks(rng, lay, rng.randint(0, 2 * n))
        assert lb <= evaluate(pb, lay, blocks) + 1e-9


@pytest.mark.parametrize("alpha", [2.0, 8.0])
def test_bound_guided_candidate_is_valid_and_close_to_the_bound(alpha):
    """On a chain (nested windows) the bound's blocks, filled, come within 1% of the bound; the
    layout built for them is a valid schedule."""
    from usbyte_opt.planning.strategies.best import bound_guided, chained_layout

    sizes = [3_000_000, 200_000, 800_000, 5_000_000, 300_000, 1_500_000, 600_000, 4_000_000]
    prof = chain_profile(sizes, forward_ms=30.0, backward_ms=60.0, alpha_ms=alpha, algbw_gbs=1.5)
    pb = Problem.from_profile(prof)
    lb = lower_bound(pb)
    built = [chained_layout(pb, bound_guided(pb, 1.0, fill, hold, uncut))
             for fill, hold, uncut in [("split", False, True), ("split", False, False), ("skip", False, False)]]
    for lay, blocks in built:
        pb.schedule("best", lay, blocks)                  # validates coverage and the layout
    T = min(evaluate(pb, lay, blocks) for lay, blocks in built)
    assert lb <= T + 1e-9
    assert T <= lb * 1.01
    best = get("best").plan(pb)
    assert evaluate(pb, best.layout, best.blocks, best.mode) <= T + 1e-9
