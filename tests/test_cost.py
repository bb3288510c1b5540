"""Cost model: the linear formula, the scipy fit, ring retargeting."""

import random

import pytest

from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import CommSpec
from usbyte_opt.planning.cost import CostModel, fit_samples, retarget


def test_linear_cost():
    c = CostModel(alpha_ms=0.3, algbw_gbs=1.5)
    assert c(0) == 0.3
    assert c(1_500_000) == pytest.approx(1.3)


def test_fit_recovers_noisy_line():
    rng = random.Random(0)
    sizes = [4096 * 2 ** k for k in range(15)]
    samples = [(b, (0.3 + b / 1.5e6) * rng.uniform(0.95, 1.05)) for b in sizes]
    alpha, algbw = fit_samples(samples)
    assert alpha == pytest.approx(0.3, rel=0.15)
    assert algbw == pytest.approx(1.5, rel=0.1)
    # Within a factor of 2 of every raw sample.
    for b, ms in samples:
        assert 0.5 <= (alpha + b / (algbw * 1e6)) / ms <= 2.0


def test_fit_needs_two_samples():
    with pytest.raises(UsbyteError):
        fit_samples([(4096, 0.1)])


def test_retarget_ring_formula():
    c = CommSpec("nccl", 8, alpha_ms=1.4, algbw_gbs=5.0)
    same = retarget(c)
    assert same is c
    r = retarget(c, world_size=8)
    assert (r.alpha_ms, r.algbw_gbs) == pytest.approx((1.4, 5.0))
    r = retarget(c, world_size=128, bandwidth_gbps=100, latency_us=10)
    assert r.alpha_ms == pytest.approx(2 * 127 * 0.010)
    assert r.algbw_gbs == pytest.approx(12.5 * 128 / 254)
    assert r.world_size == 128 and r.backend == "analytic"


def test_retarget_rejects_one_rank():
    with pytest.raises(UsbyteError, match="world size 1"):
        retarget(CommSpec("nccl", 8, 1.0, 1.0), world_size=1)
