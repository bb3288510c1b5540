"""The planner's compute-cost option: what all-reduce costs the training thread, per block and
per MB (the profile's ``comm.cpu_ms_per_block`` / ``comm.cpu_ms_per_mb``)."""

import dataclasses
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from usbyte_opt.bounds import lower_bound
from usbyte_opt.errors import FormatError
from usbyte_opt.fastsim import evaluate
from usbyte_opt.formats import CommSpec, Profile, TensorSpec, load_profile, save_profile
from usbyte_opt.planner import compare, retargeted
from usbyte_opt.problem import Problem
from usbyte_opt.simulate import simulate_blocks
from usbyte_opt.strategies import get
from usbyte_opt.synthetic import random_profile

from helpers import random_blocks


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
    assert "cpu_ms_per_block" not in plain.to_dict()["comm"]   # absent when zero
    costly = two_tensors(0.5, 4.0)
    save_profile(costly, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert (back.comm.cpu_ms_per_block, back.comm.cpu_ms_per_mb) == (0.5, 4.0)
    assert back.digest() == costly.digest() != plain.digest()
    # Retargeting the link keeps the host's costs.
    r = retargeted(costly, world_size=8)
    assert (r.comm.cpu_ms_per_block, r.comm.cpu_ms_per_mb) == (0.5, 4.0)


def test_a_negative_cost_is_a_one_line_error(tmp_path):
    d = two_tensors(0.5, 4.0).to_dict()
    d["comm"]["cpu_ms_per_block"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match=r"bad\.json.*comm\.cpu_ms_per_block") as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_hand_computed_overlap_and_fence():
    pb = Problem.from_profile(two_tensors(per_block=1.0, per_mb=10.0))
    lay = pb.layout()
    blocks = [lay.whole(0), lay.whole(1)]
    # Overlap: 2 MB x 10 + 2 blocks x 1 = 22 ms over 10 ms of compute: everything x 3.2.
    assert pb.stretch(2) == pytest.approx(3.2)
    tl = simulate_blocks(pb, lay, blocks)
    assert [b.start_ms for b in tl.blocks] == pytest.approx([6.4, 19.2])
    # Forward reaches "inp" at max(B' = 19.2, its block's finish 21.2), then runs F' = 12.8.
    assert tl.iteration_ms == pytest.approx(21.2 + 12.8)
    # Fence: backward 6 + the "out" block (started at 2, done at 4, all before backward ends:
    # 1 + 1 MB x 10) = 17; the "inp" block starts at 17 >= B, so it costs nothing.
    fence = simulate_blocks(pb, lay, blocks, "fence")
    assert fence.backward_ms == pytest.approx(17.0)
    assert fence.iteration_ms == pytest.approx(max(17.0, 8.0) + 4.0)
    # Without the option both are the plain model.
    plain = Problem.from_profile(two_tensors())
    assert simulate_blocks(plain, lay, blocks).iteration_ms == pytest.approx(12.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20), cuts=st.integers(0, 20),
       per_block=st.floats(0.0, 3.0), per_mb=st.floats(0.0, 20.0))
def test_fast_scorer_equals_simulator_with_the_option(seed, n, cuts, per_block, per_mb):
    rng = random.Random(seed)
    pb = Problem.from_profile(with_cpu(random_profile(rng, n, dtypes=("float32", "bfloat16")),
                                       per_block, per_mb))
    plain = Problem.from_profile(random_profile(random.Random(seed), n, dtypes=("float32", "bfloat16")))
    lay = pb.layout()
    blocks = random_blocks(rng, lay, cuts)
    for mode in ("overlap", "fence"):
        full = simulate_blocks(pb, lay, blocks, mode).iteration_ms
        assert evaluate(pb, lay, blocks, mode) == pytest.approx(full, rel=1e-12, abs=1e-9)
        # Charging compute never makes an iteration faster.
        assert full >= simulate_blocks(plain, lay, blocks, mode).iteration_ms - 1e-9
    assert lower_bound(pb) <= evaluate(pb, lay, blocks) + 1e-9


def test_best_cuts_fewer_blocks_when_each_costs_compute():
    rng = random.Random(7)
    prof = random_profile(rng, 40, comm_ratio=0.6, alpha_ms=0.05)
    free = compare(prof, ["wfbp", "ddp", "best"])
    costly_prof = with_cpu(prof, per_block=2.0, per_mb=0.0)
    costly = compare(costly_prof, ["wfbp", "ddp", "best"])
    assert costly.results["best"].blocks < free.results["best"].blocks
    pb = Problem.from_profile(costly_prof)
    for name, r in costly.results.items():
        # Every prediction charges the option, and best stays the best of them in overlap mode
        # (the runtime's). Fence mode charges only what overlaps backward, so a fence
        # schedule that sends after backward may be predicted faster, as measured in the lab.
        assert r.overlap_ms == pytest.approx(evaluate(pb, r.plan.layout, r.plan.blocks))
        assert r.fence_ms == pytest.approx(evaluate(pb, r.plan.layout, r.plan.blocks, "fence"))
        assert costly.results["best"].overlap_ms <= r.overlap_ms + 1e-9
    assert costly.lower_bound_ms <= costly.results["best"].overlap_ms + 1e-9
    # The schedule records the prediction under the option.
    sched = costly.schedule("best")
    assert sched.predicted["iteration_ms"] == pytest.approx(costly.results["best"].overlap_ms)


def test_usbyte_and_bytescheduler_are_scored_under_the_option():
    prof = with_cpu(random_profile(random.Random(3), 12), per_block=0.7, per_mb=3.0)
    pb = Problem.from_profile(prof)
    for name in ("usbyte", "bytescheduler"):
        plan = get(name).plan(pb)
        T = evaluate(pb, plan.layout, plan.blocks)
        assert T == pytest.approx(simulate_blocks(pb, plan.layout, plan.blocks).iteration_ms)
        assert T >= pb.stretch(len(plan.blocks)) * (pb.B + pb.F) - 1e-9
