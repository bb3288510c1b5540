"""The shared rule for measured comparisons (``usbyte_opt.verdict``), on deterministic
synthetic windows: clearly faster, clearly slower, overlapping, and how many windows to take."""

from __future__ import annotations

import math
import random

import pytest

from usbyte_opt.verdict import Budget, Ratio, compare, t_quantile


def windows(n: int, ratio: float, noise: float, seed: int) -> tuple[list[float], list[float]]:
    """``n`` pairs of window medians: A around 100 ms drifting as a busy machine does, B the
    same drift times ``ratio``, each window with its own relative noise."""
    rng = random.Random(seed)
    a, b = [], []
    for i in range(n):
        load = 1.0 + 0.3 * math.sin(i / 2.0)   # the machine's slow spells hit both of a pair
        a.append(100.0 * load * (1 + rng.gauss(0, noise)))
        b.append(100.0 * ratio * load * (1 + rng.gauss(0, noise)))
    return a, b


def test_clearly_faster():
    a, b = windows(8, 0.85, 0.02, 1)
    r = compare(a, b)
    assert r.hi < 1.0 and r.distinguishable and r.lo < 0.85 < r.hi
    assert r.verdict("ddp", "best") == "best faster"
    assert str(r).startswith("0.8") and "95% CI" in str(r)


def test_clearly_slower():
    a, b = windows(8, 1.2, 0.02, 2)
    r = compare(a, b)
    assert r.lo > 1.0 and r.verdict("ddp", "best") == "ddp faster"
    s = r.inverse()                  # the speed-up of B: below 1, the same interval turned over
    assert s.hi < 1.0 and s.lo == pytest.approx(1 / r.hi)


def test_overlapping_is_not_distinguishable():
    a, b = windows(8, 1.01, 0.08, 3)
    r = compare(a, b)
    assert r.lo < 1.0 < r.hi and not r.distinguishable
    v = r.verdict("ddp", "best")
    assert v.startswith("not distinguishable on this machine (±") and v.endswith("%)")
    assert f"±{round(100 * r.half_width)}%" in v


def test_pairing_cancels_what_hits_both():
    """Raw times spread by 30% with the machine's load; their ratio does not."""
    a, b = windows(8, 0.95, 0.005, 4)
    assert max(a) / min(a) > 1.3
    assert compare(a, b).verdict() == "B faster"


def test_too_few_pairs_and_bad_values():
    assert compare([], []).pairs == 0
    one = compare([10.0], [5.0])
    assert one.pairs == 1 and not one.distinguishable and one.interval() == "—"
    assert one.to_dict()["lo"] is None
    r = compare([10.0, math.nan, 0.0, 10.0, 11.0], [9.0, 9.0, 9.0, 9.1, 9.9])
    assert r.pairs == 3                           # NaN and 0 pairs left out


def test_t_quantile_table_values():
    assert t_quantile(0.95, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile(0.95, 5) == pytest.approx(2.5706, abs=1e-4)
    assert t_quantile(0.99, 10) == pytest.approx(3.1693, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_budget_looks_and_level():
    b = Budget(min_pairs=3, max_pairs=8)
    assert b.looks() == [3, 6, 8]
    assert b.level() == pytest.approx(1 - 0.05 / 3)
    assert Budget(min_pairs=4, max_pairs=4).looks() == [4]
    # The level of a look widens the interval against one look alone.
    a, b2 = windows(6, 0.95, 0.03, 5)
    assert b.compare(a, b2).hi > compare(a, b2).hi


def test_budget_rule_adds_windows_until_sure_or_out_of_budget():
    budget = Budget(min_pairs=4, max_pairs=12, max_s=100.0)
    a, b = windows(12, 0.8, 0.02, 6)
    taken = 0
    while budget.more(taken, 0.0, budget.compare(a[:taken], b[:taken])):
        taken += 1
    assert taken == 4                             # clear at the first look
    a, b = windows(12, 1.0, 0.05, 7)
    taken = 0
    while budget.more(taken, 0.0, budget.compare(a[:taken], b[:taken])):
        taken += 1
    assert taken == 12 and not budget.compare(a, b).distinguishable   # out of pairs
    taken = 0
    while budget.more(taken, 30.0 * taken, budget.compare(a[:taken], b[:taken])):
        taken += 1
    assert taken == 4                             # out of time (4 pairs: 120 s)
    # Several comparisons: more while any is unsure.
    assert budget.more(8, 0.0, Ratio(0.8, 0.7, 0.9, 8), Ratio(1.0, 0.9, 1.1, 8))
    assert not budget.more(8, 0.0, Ratio(0.8, 0.7, 0.9, 8), Ratio(1.3, 1.2, 1.4, 8))
