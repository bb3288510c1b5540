"""The simulator against hand-computed timelines (docs/design.md §2), both modes, and the trace."""

import dataclasses
import random

import pytest
from helpers import MB_F32, random_blocks, three_layer
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.bench.refine import refined_overlap
from usbyte_opt.errors import MismatchError
from usbyte_opt.formats import Block, CommSpec, Profile, TensorSpec
from usbyte_opt.planning.bounds import lower_bound
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem, UpdateRule
from usbyte_opt.planning.simulate import chrome_trace, simulate, simulate_blocks
from usbyte_opt.planning.synthetic import random_profile


def setup():
    pb = Problem.from_profile(three_layer())
    lay = pb.layout()
    assert [pb.names[i] for i in lay.members[0]] == ["out", "mid", "inp"]
    return pb, lay


def test_fused_and_split_blocks_overlap_mode():
    pb, lay = setup()
    # out+mid fused (2 MB), then inp in two halves.
    blocks = [Block(0, 0, 2 * MB_F32), Block(0, 2 * MB_F32, 2 * MB_F32 + MB_F32 // 2),
              Block(0, 2 * MB_F32 + MB_F32 // 2, 3 * MB_F32)]
    tl = simulate_blocks(pb, lay, blocks)
    # k0: ready max(2, 4) = 4, 1 + 2 ms -> [4, 7]; k1: ready 6, waits for k0 -> [7, 8.5];
    # k2 -> [8.5, 10].
    assert [(b.ready_ms, b.start_ms, b.finish_ms) for b in tl.blocks] == [
        (4.0, 4.0, 7.0), (6.0, 7.0, 8.5), (6.0, 8.5, 10.0)]
    assert tl.blocks[0].tensors == ("out", "mid") and tl.blocks[0].nbytes == 2_000_000
    # avail: inp 10, mid 7, out 7 + 0.5 update = 7.5. Forward: inp at max(6 + 0, 10) = 10,
    # mid at max(10 + 1.5, 7) = 11.5, out at max(11.5 + 1.5, 7.5) = 13, ends 13 + 4 - 3 = 14.
    assert [(g.name, g.reach_ms, g.wait_ms) for g in tl.forward] == [
        ("inp", 10.0, 4.0), ("mid", 11.5, 0.0), ("out", 13.0, 0.0)]
    assert tl.iteration_ms == 14.0
    assert tl.exposed_ms == 4.0
    assert tl.comm_busy_ms == 6.0


def test_fused_and_split_blocks_fence_mode():
    pb, lay = setup()
    blocks = [Block(0, 0, 2 * MB_F32), Block(0, 2 * MB_F32, 3 * MB_F32)]
    # [4, 7], then inp [7, 9]; fence: max(6, 9) + 0.5 update + 4 forward.
    assert simulate_blocks(pb, lay, blocks, mode="fence").iteration_ms == 13.5


def test_issue_order_is_static_a_ready_block_waits_its_turn():
    pb, lay = setup()
    half = 2 * MB_F32 + MB_F32 // 2
    blocks = [Block(0, 2 * MB_F32, half), Block(0, half, 3 * MB_F32), Block(0, 0, 2 * MB_F32)]
    tl = simulate_blocks(pb, lay, blocks)
    # inp halves first: [6, 7.5], [7.5, 9]; out+mid was ready at 4 but waits: [9, 12].
    assert [(b.start_ms, b.finish_ms) for b in tl.blocks] == [(6.0, 7.5), (7.5, 9.0), (9.0, 12.0)]
    # inp at max(6, 9) = 9; mid at max(10.5, 12) = 12; out at max(13.5, 12.5) = 13.5; end 14.5.
    assert tl.iteration_ms == 14.5
    assert simulate_blocks(pb, lay, blocks, mode="fence").iteration_ms == 16.5


def test_finish_of_last_block_can_set_the_iteration_time():
    pb, lay = setup()
    # Send out last, after inp and mid: its block ends after the forward has ended.
    blocks = [Block(0, 2 * MB_F32, 3 * MB_F32), Block(0, MB_F32, 2 * MB_F32), Block(0, 0, MB_F32)]
    tl = simulate_blocks(pb, lay, blocks)
    # inp [6, 8], mid [8, 10], out [10, 12] (+0.5 update -> 12.5). Forward: inp 8, mid
    # max(9.5, 10) = 10, out max(11.5, 12.5) = 12.5, ends 13.5.
    assert tl.forward_end_ms == 13.5 and tl.iteration_ms == 13.5


def test_uncovered_tensor_is_an_error():
    pb, lay = setup()
    with pytest.raises(MismatchError, match="inp"):
        simulate_blocks(pb, lay, [Block(0, 0, 2 * MB_F32)])


def test_simulate_checks_the_schedule_against_the_profile():
    pb, lay = setup()
    sched = pb.schedule("hand", lay, [Block(0, 0, 3 * MB_F32)])
    assert simulate(three_layer(), sched).iteration_ms == pytest.approx(6 + 1 + 3 + 4)
    other = random_profile(random.Random(0), 3)
    with pytest.raises(MismatchError, match="not in profile"):
        simulate(other, sched)


def test_chrome_trace_has_compute_and_channel_tracks():
    pb, lay = setup()
    tl = simulate_blocks(pb, lay, [Block(0, 0, 2 * MB_F32), Block(0, 2 * MB_F32, 3 * MB_F32)])
    doc = chrome_trace(tl)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    comm = [e for e in xs if e["tid"] == 2]
    assert [(e["ts"], e["dur"]) for e in comm] == [(4000.0, 3000.0), (7000.0, 2000.0)]
    waits = [e for e in xs if e["name"].startswith("wait")]
    assert [(e["name"], e["ts"], e["dur"]) for e in waits] == [("wait inp", 6000.0, 3000.0)]
    fwd = [e for e in xs if e["name"] == "forward"]
    assert sum(e["dur"] for e in fwd) == pytest.approx(4000.0)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(tl.iteration_ms * 1000)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), cuts=st.integers(0, 30))
def test_fast_scorer_equals_simulator(seed, n, cuts):
    rng = random.Random(seed)
    pb = Problem.from_profile(random_profile(rng, n, dtypes=("float32", "bfloat16")))
    lay = pb.layout()
    blocks = random_blocks(rng, lay, cuts)
    for mode in ("overlap", "fence"):
        full = simulate_blocks(pb, lay, blocks, mode).iteration_ms
        assert evaluate(pb, lay, blocks, mode) == pytest.approx(full, rel=1e-12, abs=1e-9)
    assert simulate_blocks(pb, lay, blocks, "overlap").iteration_ms <= \
        simulate_blocks(pb, lay, blocks, "fence").iteration_ms + 1e-9


# --------------------------------------------------------------------------------------------
# The update rule of the iteration model: updates as availability delays, or at the gates
# --------------------------------------------------------------------------------------------


def gate_toy() -> Problem:
    # "out" finishes early (block [2, 4]), "inp" at 8; 1 ms of update each.
    return Problem.from_profile(Profile(
        "toy", forward_ms=4.0, backward_ms=6.0,
        tensors=(TensorSpec("out", (250_000,), "float32", 2.0, 3.0, update_ms=1.0),
                 TensorSpec("inp", (250_000,), "float32", 6.0, 0.0, update_ms=1.0)),
        comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0)))


def test_updates_at_the_gates_hand_computed():
    pb = gate_toy()
    lay = pb.layout()
    blocks = [lay.whole(0), lay.whole(1)]
    assert pb.update_rule == UpdateRule.AVAIL
    assert simulate_blocks(pb, lay, blocks).iteration_ms == 13.0     # "inp" at 8 + 1, "out" free
    gated = pb.with_update_rule(UpdateRule.GATE)
    tl = simulate_blocks(gated, lay, blocks)
    # forward reaches "inp" at 6, waits to 8, applies both updates (2 ms), then runs 4 ms
    assert tl.iteration_ms == 14.0
    assert [(g.name, g.wait_ms, g.update_ms, g.reach_ms) for g in tl.forward] == [
        ("inp", 2.0, 2.0, 10.0), ("out", 0.0, 0.0, 13.0)]
    assert evaluate(gated, lay, blocks) == 14.0
    assert refined_overlap(pb, lay, blocks) == 14.0
    assert lower_bound(gated) <= 14.0
    # fence mode runs the whole step before the forward under both rules
    assert simulate_blocks(gated, lay, blocks, "fence").iteration_ms == \
        simulate_blocks(pb, lay, blocks, "fence").iteration_ms == evaluate(gated, lay, blocks, "fence")


def test_the_bound_counts_the_step_on_the_thread_under_gate():
    # a fast link, 3 ms of update per tensor: under GATE the thread runs backward, forward and
    # the whole step one after another (claim 0: 6 + 4 + 6); under AVAIL an update is a tail
    pb = Problem.from_profile(Profile(
        "toy", forward_ms=4.0, backward_ms=6.0,
        tensors=(TensorSpec("out", (250,), "float32", 2.0, 3.0, update_ms=3.0),
                 TensorSpec("inp", (250,), "float32", 6.0, 0.0, update_ms=3.0)),
        comm=CommSpec("analytic", 2, alpha_ms=0.01, algbw_gbs=100.0)))
    gated = pb.with_update_rule(UpdateRule.GATE)
    lay = pb.layout()
    assert lower_bound(pb) < 13.5
    assert lower_bound(gated) == pytest.approx(16.0)
    for blocks in ([lay.whole(0), lay.whole(1)], [lay.whole(1), lay.whole(0)]):
        for mode in ("overlap", "fence"):
            assert evaluate(gated, lay, blocks, mode) >= 16.0 - 1e-9


@pytest.mark.parametrize("device, backend, rule", [
    ("cpu", "gloo", UpdateRule.GATE),                 # the runtime's HostUpdates
    ("cuda", "gloo", UpdateRule.GATE),                # gloo carrying CUDA tensors waits on the host
    ("cuda", "nccl", UpdateRule.AVAIL),               # a CUDA update stream waits for the blocks
    ("cuda (V100-class, rescaled)", "analytic", UpdateRule.AVAIL),   # the shipped profiles
    (None, "analytic", UpdateRule.AVAIL),             # no device named
])
def test_the_update_rule_is_the_runtimes_on_the_profiles_device(device, backend, rule):
    base = gate_toy().profile
    prof = dataclasses.replace(base, comm=dataclasses.replace(base.comm, backend=backend),
                               meta={} if device is None else {"device": device})
    assert UpdateRule.of(prof) == rule
    pb = Problem.from_profile(prof)
    assert pb.update_rule == rule
    # the planner, simulate() of a profile and an explicit override agree with it
    report = compare(prof, ["wfbp", "best"])
    assert report.problem.update_rule == rule
    lay = pb.layout()
    blocks = [lay.whole(0), lay.whole(1)]
    assert simulate_blocks(pb, lay, blocks).iteration_ms == (14.0 if rule == UpdateRule.GATE else 13.0)
    wfbp = report.results["wfbp"]
    assert simulate(prof, report.schedule("wfbp")).iteration_ms == pytest.approx(wfbp.iteration_ms)
    assert compare(prof, ["wfbp"], update_rule=UpdateRule.AVAIL).problem.update_rule == UpdateRule.AVAIL


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), cuts=st.integers(0, 30),
       cpu=st.sampled_from([(0.0, 0.0), (0.3, 0.0), (0.5, 6.0)]))
def test_updates_at_the_gates_scorer_equals_simulator_and_bound_holds(seed, n, cuts, cpu):
    rng = random.Random(seed)
    prof = random_profile(rng, n, dtypes=("float32", "bfloat16"))
    prof = prof.with_comm(dataclasses.replace(prof.comm, cpu_ms_per_block=cpu[0], cpu_ms_per_mb=cpu[1]))
    pb = Problem.from_profile(prof)
    gated = Problem.from_profile(prof, update_rule=UpdateRule.GATE)
    lay = pb.layout()
    blocks = random_blocks(rng, lay, cuts)
    full = simulate_blocks(gated, lay, blocks, "overlap").iteration_ms
    assert evaluate(gated, lay, blocks, "overlap") == pytest.approx(full, rel=1e-12, abs=1e-9)
    # never faster than updates as availability delays; the lower bound holds
    assert full >= simulate_blocks(pb, lay, blocks, "overlap").iteration_ms - 1e-9
    assert lower_bound(gated) <= full + 1e-9
    # the bench's refined prediction is this rule
    assert refined_overlap(pb, lay, blocks) == pytest.approx(full, rel=1e-12, abs=1e-9)
    assert evaluate(gated, lay, blocks, "fence") == evaluate(pb, lay, blocks, "fence")
