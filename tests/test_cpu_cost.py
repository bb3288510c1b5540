"""The planner's compute-cost option: what all-reduce costs the training thread, per block and
per MB (the profile's ``comm.cpu_ms_per_block`` / ``comm.cpu_ms_per_mb``)."""

import dataclasses
import json
import random

import pytest
from helpers import random_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.errors import FormatError
from usbyte_opt.formats import Block, CommSpec, Profile, TensorSpec, dump_profile, load_profile, save_profile
from usbyte_opt.planning.bounds import charge_floor, lower_bound
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.planner import compare, retargeted
from usbyte_opt.planning.problem import Problem, UpdateRule
from usbyte_opt.planning.simulate import simulate_blocks
from usbyte_opt.planning.synthetic import random_profile


def with_cpu(profile: Profile, per_block: float, per_mb: float) -> Profile:
    return profile.with_comm(dataclasses.replace(profile.comm, cpu_ms_per_block=per_block,
                                                 cpu_ms_per_mb=per_mb))


def two_tensors(per_block: float = 0.0, per_mb: float = 0.0) -> Profile:
    # Two 1 MB tensors; alpha 1 ms, 1 GB/s: each block costs 2 ms on the wire.
    return Profile("toy", 4.0, 6.0,
                   (TensorSpec("out", (250_000,), "float32", 2.0, 3.0),
                    TensorSpec("inp", (250_000,), "float32", 6.0, 0.0)),
                   CommSpec("analytic", 2, 1.0, 1.0, cpu_ms_per_block=per_block,
                            cpu_ms_per_mb=per_mb))


def test_profile_round_trip_keeps_the_costs_and_old_profiles_keep_their_digest(tmp_path):
    plain = two_tensors()
    assert "cpu_ms_per_block" not in dump_profile(plain)["comm"]   # absent when zero
    costly = two_tensors(0.5, 4.0)
    save_profile(costly, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert (back.comm.cpu_ms_per_block, back.comm.cpu_ms_per_mb) == (0.5, 4.0)
    assert back.digest() == costly.digest() != plain.digest()
    # Retargeting the link keeps the host's costs.
    r = retargeted(costly, world_size=8)
    assert (r.comm.cpu_ms_per_block, r.comm.cpu_ms_per_mb) == (0.5, 4.0)


def test_a_negative_cost_is_a_one_line_error(tmp_path):
    d = dump_profile(two_tensors(0.5, 4.0))
    d["comm"]["cpu_ms_per_block"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match=r"bad\.json.*comm\.cpu_ms_per_block") as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_hand_computed_one_rule_in_both_modes():
    pb = Problem.from_profile(two_tensors(per_block=1.0, per_mb=10.0))
    lay = pb.layout()
    # Each block costs the training thread 1 + 10 x 1 MB = 11 ms over its 2 ms on the wire.
    assert pb.block_cpu_ms(1_000_000) == pytest.approx(11.0)
    out_first = [lay.whole(0), lay.whole(1)]
    # Without the charge: "out" [2, 4] inside backward, "inp" [6, 8] while the thread waits
    # (for it in overlap mode, for every block in fence mode). Backward pays 11 ms in both
    # modes: 6 ms become 17, "out" is ready at 2 x 17 / 6 and "inp" at 17.
    for mode in ("overlap", "fence"):
        tl = simulate_blocks(pb, lay, out_first, mode)
        assert tl.meta["cpu_charge_ms"] == pytest.approx({"backward": 11.0, "forward": 0.0})
        assert tl.backward_ms == pytest.approx(17.0)
        assert [b.start_ms for b in tl.blocks] == pytest.approx([2 * 17 / 6, 17.0])
        assert tl.iteration_ms == pytest.approx(19.0 + 4.0)   # "inp" done at 19, then forward
    # "inp" first: [6, 8], then "out" [8, 10]. Overlap mode: the forward waits for "inp" until
    # 8, then computes while "out" is on the wire: forward pays 11 ms (4 ms become 15).
    inp_first = [lay.whole(1), lay.whole(0)]
    tl = simulate_blocks(pb, lay, inp_first)
    assert tl.meta["cpu_charge_ms"] == pytest.approx({"backward": 0.0, "forward": 11.0})
    assert tl.iteration_ms == pytest.approx(8.0 + 15.0)
    # Fence mode: both blocks go while the thread waits for them, so nothing is charged.
    fence = simulate_blocks(pb, lay, inp_first, "fence")
    assert fence.meta["cpu_charge_ms"] == pytest.approx({"backward": 0.0, "forward": 0.0})
    assert fence.iteration_ms == pytest.approx(10.0 + 4.0)
    # The fast scorer agrees, and without the option both are the plain model.
    for blocks in (out_first, inp_first):
        for mode in ("overlap", "fence"):
            assert evaluate(pb, lay, blocks, mode) == pytest.approx(
                simulate_blocks(pb, lay, blocks, mode).iteration_ms)
    # Claim 3 of the bound: one block of all 2 MB is W = 3 ms on the wire and C = 21 ms on the
    # thread, so T >= B + F + W C / (W + C) = 10 + 63 / 24, under every plan (the least is 14);
    # the smallest rate of any block (1 ms per ms, a tiny block's) would give 10 + 1.5 only.
    assert lower_bound(pb) == pytest.approx(10.0 + 63.0 / 24.0)
    b, s0, e = lay.pos[1]
    thirds = [Block(b, s0 + k * (e - s0) // 3, s0 + (k + 1) * (e - s0) // 3) for k in range(3)]
    for blocks in (out_first, inp_first, [lay.whole(0), *thirds], [*thirds[::-1], lay.whole(0)]):
        for mode in ("overlap", "fence"):
            assert lower_bound(pb) <= evaluate(pb, lay, blocks, mode) + 1e-9
    # Under GATE the thread also runs the step (1 ms per tensor here): claims 0 and 3 together
    # give B + F + W (u + C) / (W + C) = 10 + 3 x 23 / 24, above claim 0's 10 + 2.
    stepped = dataclasses.replace(two_tensors(per_block=1.0, per_mb=10.0), tensors=tuple(
        dataclasses.replace(t, update_ms=1.0) for t in two_tensors().tensors))
    gated = Problem.from_profile(stepped, update_rule=UpdateRule.GATE)
    assert charge_floor([3.0], 21.0, 2.0) == pytest.approx(69.0 / 24.0)
    assert lower_bound(gated) >= 10.0 + 69.0 / 24.0 - 1e-9
    for blocks in (out_first, inp_first, [lay.whole(0), *thirds], [*thirds[::-1], lay.whole(0)]):
        for mode in ("overlap", "fence"):
            assert lower_bound(gated) <= evaluate(gated, lay, blocks, mode) + 1e-9
    plain = Problem.from_profile(two_tensors())
    assert simulate_blocks(plain, lay, out_first).iteration_ms == pytest.approx(12.0)
    assert "cpu_charge_ms" not in simulate_blocks(plain, lay, out_first).meta



def test_the_compute_cost_bound_counts_the_step_under_gate():
    # A 2 MB tensor ready early and a tiny one ready last: the wire claims stay near 12, and
    # claim 3 binds: B + F + W C / (W + C) under AVAIL; under GATE, with the step on the
    # thread (1 ms per tensor), B + F + W (u + C) / (W + C), above claim 0's B + F + u = 12.
    prof = Profile("toy", 4.0, 6.0,
                   (TensorSpec("out", (500_000,), "float32", 2.0, 3.0, update_ms=1.0),
                    TensorSpec("inp", (250,), "float32", 6.0, 0.0, update_ms=1.0)),
                   CommSpec("analytic", 2, 1.0, 1.0, cpu_ms_per_block=1.0, cpu_ms_per_mb=10.0))
    W, C = 1.0 + 2.001, 1.0 + 10.0 * 2.001
    avail = Problem.from_profile(prof)
    gated = Problem.from_profile(prof, update_rule=UpdateRule.GATE)
    assert lower_bound(avail) == pytest.approx(10.0 + W * C / (W + C))
    assert lower_bound(gated) == pytest.approx(10.0 + W * (2.0 + C) / (W + C))
    lay = avail.layout()
    rng = random.Random(3)
    for _ in range(40):
        blocks = random_blocks(rng, lay, rng.randint(0, 12))
        for mode in ("overlap", "fence"):
            assert lower_bound(gated) <= evaluate(gated, lay, blocks, mode) + 1e-9
            assert lower_bound(avail) <= evaluate(avail, lay, blocks, mode) + 1e-9


costs = st.tuples(st.sampled_from([0.0, 0.1, 0.7, 3.0]) | st.floats(0.0, 3.0),
                  st.sampled_from([0.0, 1.0, 6.0, 20.0]) | st.floats(0.0, 20.0))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20), cuts=st.integers(0, 20), cost=costs)
def test_fast_scorer_equals_simulator_and_bound_holds_with_the_option(seed, n, cuts, cost):
    per_block, per_mb = cost
    rng = random.Random(seed)
    pb = Problem.from_profile(with_cpu(random_profile(rng, n, dtypes=("float32", "bfloat16")),
                                       per_block, per_mb))
    plain = Problem.from_profile(random_profile(random.Random(seed), n, dtypes=("float32", "bfloat16")))
    lay = pb.layout()
    blocks = random_blocks(rng, lay, cuts)
    lb = lower_bound(pb)
    for mode in ("overlap", "fence"):
        full = simulate_blocks(pb, lay, blocks, mode).iteration_ms
        assert evaluate(pb, lay, blocks, mode) == pytest.approx(full, rel=1e-12, abs=1e-9)
        # Charging compute never makes an iteration faster, and the bound holds in both modes.
        assert full >= simulate_blocks(plain, lay, blocks, mode).iteration_ms - 1e-9
        assert lb <= full + 1e-9


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 25), cost=costs,
       ratio=st.sampled_from([0.3, 1.0, 3.0]), alpha=st.sampled_from([0.0, 0.05, 1.3]))
def test_best_at_most_every_strategy_and_bound_at_most_every_prediction(seed, n, cost, ratio, alpha):
    prof = with_cpu(random_profile(random.Random(seed), n, comm_ratio=ratio, alpha_ms=alpha,
                                   dtypes=("float32", "float16")), *cost)
    report = compare(prof)
    best = report.results["best"]
    pb = Problem.from_profile(prof)
    for name, r in report.results.items():
        # best weighs every other plan in both modes, so it is at most each in either mode
        assert best.iteration_ms <= min(r.overlap_ms, r.fence_ms) + 1e-9, name
        assert report.lower_bound_ms <= min(r.overlap_ms, r.fence_ms) + 1e-9, name
        assert r.iteration_ms == (r.fence_ms if r.mode == "fence" else r.overlap_ms)
        assert r.iteration_ms == pytest.approx(evaluate(pb, r.plan.layout, r.plan.blocks, r.mode))
    sched = report.schedule("best")
    assert sched.mode == best.mode
    assert sched.predicted["iteration_ms"] == best.iteration_ms
    assert sched.predicted["iteration_ms"] <= report.results["ddp"].iteration_ms + 1e-9


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 12), cost=costs)
def test_usbyte_and_bytescheduler_weigh_their_candidates_with_the_option(seed, n, cost):
    """Each returns its grid's best under the option: no tried unit (usbyte, forward-order
    priority) or partition/credit pair (bytescheduler) is predicted faster than its plan."""
    from usbyte_opt.planning.strategies import bytescheduler, usbyte

    pb = Problem.from_profile(with_cpu(random_profile(random.Random(seed), n), *cost))
    lay = pb.layout()
    plan = usbyte.plan(pb, search_priority=False)
    T = evaluate(pb, plan.layout, plan.blocks)
    assert plan.info["iteration_ms"] == pytest.approx(T)
    model = usbyte.USByte(pb)
    units = usbyte.unit_candidates(model.numel) + [usbyte.DEFAULT_UNIT]
    for s in units:
        out = model.phases(s, model.forward_priority())
        assert T <= evaluate(pb, lay, model.blocks(out)) + 1e-9, s
    plan = bytescheduler.plan(pb, grid_points=4)
    T = evaluate(pb, plan.layout, plan.blocks)
    assert plan.info["iteration_ms"] == pytest.approx(T)
    tail = [u + pb.F - nd for u, nd in zip(pb.update, pb.need)]
    for P in bytescheduler.log_grid(*bytescheduler.PARTITION_RANGE, 4):
        parts = bytescheduler._Parts(pb, lay, P, tail)
        for C in bytescheduler.log_grid(*bytescheduler.CREDIT_RANGE, 4):
            order = bytescheduler.replay(parts, C)
            assert T <= evaluate(pb, lay, [parts.blocks[k] for k in order]) + 1e-9, (P, C)


def test_best_cuts_fewer_blocks_when_each_costs_compute():
    rng = random.Random(7)
    prof = random_profile(rng, 40, comm_ratio=0.6, alpha_ms=0.05)
    free = compare(prof, ["wfbp", "ddp", "best"])
    costly = compare(with_cpu(prof, per_block=2.0, per_mb=0.0), ["wfbp", "ddp", "best"])
    assert costly.results["best"].blocks < free.results["best"].blocks


def test_a_fence_plan_wins_where_overlap_pays_for_the_forward():
    # Random profiles where communication costs a lot of compute: the forward of overlap mode
    # pays for every block it runs beside, fence mode's does not, and best takes fence.
    prof = with_cpu(random_profile(random.Random(18), 4, comm_ratio=1.0, alpha_ms=0.5), 1.5, 12.0)
    report = compare(prof)
    best = report.results["best"]
    assert best.mode == "fence" and best.iteration_ms == best.fence_ms < best.overlap_ms
    sched = report.schedule("best")
    assert sched.mode == "fence" and sched.predicted["iteration_ms"] == best.fence_ms
