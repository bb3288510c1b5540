"""Cost model: the linear formula, a model that is not a line, the scipy fit, ring retargeting."""

import dataclasses
import math
import random

import numpy as np
import pytest

from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import CollectiveCost, CommSpec
from usbyte_opt.planning.bounds import lower_bound
from usbyte_opt.planning.cost import LinearCost, cost_model, fit_samples, retarget
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.simulate import simulate_blocks
from usbyte_opt.planning.strategies import load_builtin
from usbyte_opt.planning.synthetic import random_profile


def test_linear_cost():
    c = LinearCost(alpha_ms=0.3, algbw_gbs=1.5)
    assert c.allreduce_ms(0) == 0.3
    assert c.allreduce_ms(1_500_000) == pytest.approx(1.3)


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


def test_sharded_collectives_default_to_half_an_allreduce():
    comm = CommSpec("gloo", 2, alpha_ms=1.0, algbw_gbs=0.5, cpu_ms_per_block=0.2)
    m = cost_model(comm)
    for b in (0, 4096, 1 << 20, 64 << 20):
        assert m.reduce_scatter_ms(b) == m.all_gather_ms(b) == pytest.approx(0.5 * m.allreduce_ms(b))
    # Existing answers unchanged by the new lines: the model's all-reduce, bound and array.
    sharded = cost_model(dataclasses.replace(comm, reduce_scatter=CollectiveCost(0.2, 4.0),
                                             all_gather=CollectiveCost(0.3, 2.0)))
    sizes = np.array([0.0, 4096.0, 1e6, 6.4e7])
    assert sharded.linear_bound() == m.linear_bound() and sharded.is_linear
    assert list(sharded.allreduce_ms_array(sizes)) == list(m.allreduce_ms_array(sizes))
    assert sharded.allreduce_ms(1e6) == m.allreduce_ms(1e6) == pytest.approx(3.0)
    # Measured lines where given.
    assert sharded.reduce_scatter_ms(4e6) == pytest.approx(0.2 + 1.0)
    assert sharded.all_gather_ms(4e6) == pytest.approx(0.3 + 2.0)


def test_the_ring_default_is_the_ring_formula_of_reduce_scatter():
    # A ring of n ranks: reduce-scatter is (n - 1) hops and (n - 1) / n of the bytes over the
    # bus bandwidth, exactly half the all-reduce's 2 (n - 1) hops and 2 (n - 1) / n.
    n, hop_ms, busbw = 8, 0.05, 3.125
    c = retarget(CommSpec("analytic", 2, 1.0, 1.0), world_size=n, bandwidth_gbps=busbw * 8,
                 latency_us=hop_ms * 1e3)
    b = 32e6
    ring = (n - 1) * hop_ms + (n - 1) / n * b / (busbw * 1e6)
    assert cost_model(c).reduce_scatter_ms(b) == pytest.approx(ring)
    assert cost_model(c).all_gather_ms(b) == pytest.approx(ring)


def test_retarget_moves_measured_sharded_lines_by_their_own_ring():
    rs, ag = CollectiveCost(0.3, 2.0, ((4096, 0.3),)), CollectiveCost(0.4, 1.0)
    c = CommSpec("gloo", 2, 1.0, 1.0, reduce_scatter=rs, all_gather=ag)
    assert retarget(c) is c
    same = retarget(c, world_size=2)
    assert (same.reduce_scatter.alpha_ms, same.reduce_scatter.algbw_gbs) == pytest.approx((0.3, 2.0))
    assert same.reduce_scatter.samples == ()   # measured at another size: dropped as comm.samples
    r = retarget(c, world_size=16)
    # Hop 0.3 ms, busbw 2.0 * 1/2 GB/s at 2 ranks; 15 hops and busbw * 16/15 at 16.
    assert r.reduce_scatter.alpha_ms == pytest.approx(15 * 0.3)
    assert r.reduce_scatter.algbw_gbs == pytest.approx(1.0 * 16 / 15)
    assert r.all_gather.alpha_ms == pytest.approx(15 * 0.4)
    r = retarget(c, world_size=4, bandwidth_gbps=80, latency_us=20)
    for x in (r.reduce_scatter, r.all_gather):
        assert x.alpha_ms == pytest.approx(3 * 0.02) and x.algbw_gbs == pytest.approx(10 * 4 / 3)
    assert retarget(CommSpec("gloo", 2, 1.0, 1.0), world_size=8).reduce_scatter is None


def test_retarget_rejects_one_rank():
    with pytest.raises(UsbyteError, match="world size 1"):
        retarget(CommSpec("nccl", 8, 1.0, 1.0), world_size=1)


class SteppedCost:
    """A cost model that is not a line: the linear cost plus 0.5 ms per started MB (a stand-in
    for a piecewise model); its linear bound is the line under it."""

    def __init__(self, alpha_ms: float, algbw_gbs: float):
        self.line = LinearCost(alpha_ms, algbw_gbs)

    @property
    def is_linear(self) -> bool:
        return False

    def allreduce_ms(self, nbytes: float) -> float:
        return self.line.allreduce_ms(nbytes) + 0.5 * math.ceil(nbytes / 1e6)

    def allreduce_ms_array(self, nbytes: np.ndarray) -> np.ndarray:
        return self.line.allreduce_ms_array(nbytes) + 0.5 * np.ceil(nbytes / 1e6)

    def linear_bound(self) -> tuple[float, float]:
        return self.line.linear_bound()


def test_planning_takes_a_cost_model_that_is_not_a_line():
    prof = random_profile(random.Random(3), 14, comm_ratio=1.5)
    cost = SteppedCost(prof.comm.alpha_ms, prof.comm.algbw_gbs)
    pb = Problem.from_profile(prof, cost)
    assert pb.cost is cost
    lay = pb.layout()
    blocks = [lay.whole(i) for i in pb.ready_order()]
    for mode in ("overlap", "fence"):
        assert evaluate(pb, lay, blocks, mode) == pytest.approx(
            simulate_blocks(pb, lay, blocks, mode).iteration_ms, rel=1e-12)
    lb = lower_bound(pb)
    results, plans = {}, []
    for name, s in load_builtin().items():
        p = s.plan(pb, seeds=plans) if name == "best" else s.plan(pb)
        plans.append(p)
        pb.schedule(name, p.layout, p.blocks, check=True)
        results[name] = evaluate(pb, p.layout, p.blocks, p.mode)
        assert lb <= results[name] + 1e-9, name
        if "iteration_ms" in p.info:      # each strategy's own prediction is the scorer's
            assert p.info["iteration_ms"] == pytest.approx(results[name], rel=1e-9), name
    assert results["best"] <= min(results.values()) + 1e-9
