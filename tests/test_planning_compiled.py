"""Plans for compiled training (``usbyte_opt.planning.compiled``): where a compiled graph is
cut, what the cuts cost, and the schedule field that carries the choice.

Torch-free: synthetic profiles with measured cut costs in ``meta.compile.cuts`` (as
``usbyte-opt profile --compile`` writes them), the planner, real schedule files on disk.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from usbyte_opt.errors import FormatError
from usbyte_opt.formats import CommSpec, Mode, Profile, Runner, TensorSpec, load_schedule, save_schedule
from usbyte_opt.planning.compiled import (
    as_compiled,
    block_membership,
    choose_cuts,
    compiled_time,
    cut_problem,
    merged_pieces,
    plan_pieces,
    segments,
)
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.simulate import simulate


def cnn_like(cuts: dict[str, float] | None, default: float = 1.0) -> Profile:
    """A small CNN's shape: conv layers (weight, bias) and a large head ready first, needed
    last; ``cuts``: the measured cost of a cut before each layer's first use (ms)."""
    layers = [("conv0", 2_000, 12.0, 0.0), ("conv1", 8_000, 9.0, 3.0), ("conv2", 30_000, 6.0, 6.0),
              ("fc", 1_000_000, 2.0, 9.0), ("out", 1_000, 0.5, 11.0)]
    tensors = []
    for name, n, ready, need in layers:
        tensors.append(TensorSpec(f"{name}.weight", (n,), "float32", ready, need, 0.01))
        tensors.append(TensorSpec(f"{name}.bias", (16,), "float32", ready + 0.01, need, 0.001))
    meta = {"device": "cpu"}
    if cuts is not None:
        meta["compile"] = {"backend": "inductor", "cuts": cuts, "cut_default_ms": default}
    return Profile("cnn-like", 12.0, 12.5, tuple(tensors), CommSpec("analytic", 8, 0.05, 0.5), meta)


def blocks_per_layer(pb: Problem):
    """One block per layer (its weight and bias, adjacent in ready order), head first."""
    from usbyte_opt.formats import Block

    lay = pb.layout()
    order = pb.ready_order()
    blocks = []
    for a, b in zip(order[::2], order[1::2]):
        (ba, sa, ea), (bb, sb, eb) = lay.pos[a], lay.pos[b]
        assert ba == bb and ea == sb, (pb.names[a], pb.names[b])
        blocks.append(Block(ba, sa, eb))
    return lay, blocks


def test_segments_follow_the_forward_and_keep_a_module_whole() -> None:
    pb = Problem.from_profile(cnn_like({}))
    # fc's weight in piece 0, its bias in piece 2: one node reads both, the lower piece wins.
    groups = [2 if n.startswith(("conv0", "conv1")) else 1 if n.startswith("conv2") else 0
              for n in pb.names]
    groups[pb.index["fc.bias"]] = 2
    seg = segments(pb, groups)
    by = dict(zip(pb.names, seg))
    assert by["conv0.weight"] == by["conv1.bias"] == 0 and by["conv2.weight"] == 1
    assert by["fc.weight"] == by["fc.bias"] == by["out.weight"] == 2
    # A piece met again after another runs as a piece of its own.
    groups2 = [0 if n.startswith(("conv0", "fc")) else 1 for n in pb.names]
    assert segments(pb, groups2) == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3]


def test_a_cut_problem_coarsens_readiness_and_charges_each_cut_where_it_falls() -> None:
    pb = Problem.from_profile(cnn_like({"fc.weight": 2.0, "conv1.weight": 4.0}))
    lay, blocks = blocks_per_layer(pb)
    # Two pieces: the convs (cut before nothing), the head (cut before fc: 2 ms).
    groups = [1 if n.startswith("conv") else 0 for n in pb.names]
    cp = cut_problem(pb, groups, ({pb.index["fc.weight"]: 2.0}, 1.0))
    share_f = pb.F / (pb.F + pb.B)
    assert cp.F == pytest.approx(pb.F + 2.0 * share_f) and cp.B == pytest.approx(pb.B + 2.0 * (1 - share_f))
    r = dict(zip(pb.names, cp.ready))
    n = dict(zip(pb.names, cp.need))
    # The head's gradients all come when its last is ready; the convs' after the cut's share.
    assert r["fc.weight"] == r["out.bias"] == pytest.approx(2.01)
    assert r["conv0.weight"] == pytest.approx(12.01 + 2.0 * (1 - share_f))
    # The head is needed when its first tensor is, after the cut's forward share.
    assert n["out.weight"] == n["fc.bias"] == pytest.approx(9.0 + 2.0 * share_f)
    assert n["conv0.weight"] == 0.0
    assert not cp.compiled


def test_choose_cuts_keeps_the_cut_that_pays_and_drops_the_dear_one() -> None:
    cheap_head = cnn_like({"fc.weight": 0.2, "conv1.weight": 30.0, "conv2.weight": 30.0,
                           "out.weight": 30.0, "conv0.bias": 30.0})
    pb = Problem.from_profile(cheap_head)
    lay, blocks = blocks_per_layer(pb)
    pieces = plan_pieces(*block_membership(lay, blocks))
    keep, T = choose_cuts(pb, lay, blocks, Mode.OVERLAP)
    # The plan's pieces are the 5 layers, head first; only the cut before fc pays.
    assert max(pieces) == 4
    seg = segments(pb, merged_pieces(pieces, keep))
    assert max(seg) == 1, (keep, seg)
    assert seg[pb.index["fc.weight"]] == 1 and seg[pb.index["conv2.weight"]] == 0
    every = compiled_time(pb, lay, blocks, Mode.OVERLAP, keep=None)
    none = compiled_time(pb, lay, blocks, Mode.OVERLAP, keep=())
    assert T < every and T < none
    # Free cuts: every one kept pays at least as well as any subset.
    free = Problem.from_profile(cnn_like({}, default=0.0))
    keep_free, T_free = choose_cuts(free, lay, blocks, Mode.OVERLAP)
    assert T_free == pytest.approx(compiled_time(free, lay, blocks, Mode.OVERLAP, keep=None))


def test_a_profile_without_cut_costs_plans_as_before() -> None:
    plain = cnn_like(None)
    pb = Problem.from_profile(plain)
    assert not pb.compiled
    lay, blocks = blocks_per_layer(pb)
    assert as_compiled(pb, lay, blocks) is pb
    rep = compare(plain, ["ddp", "best"])
    assert all(r.cut_pieces is None for r in rep.results.values())
    assert rep.schedule("best").cut_pieces is None


def test_compare_charges_the_cuts_and_the_schedule_carries_the_choice(tmp_path) -> None:
    prof = cnn_like({"fc.weight": 0.3, "conv1.weight": 6.0, "conv2.weight": 6.0, "out.weight": 6.0,
                     "conv0.bias": 6.0})
    rep = compare(prof, ["ddp", "wfbp", "best"])
    plain = compare(cnn_like(None), ["ddp", "wfbp", "best"])
    # torch DDP cuts at every bucket (DDPOptimizer): a plan of several buckets pays its cuts.
    ddp = rep.results["ddp"]
    assert ddp.cut_pieces is None and ddp.iteration_ms >= plain.results["ddp"].iteration_ms
    # wfbp's one block per tensor, run by the runtime, keeps only the cuts that pay.
    w = rep.results["wfbp"]
    assert w.cut_pieces is not None and w.iteration_ms <= compiled_time(
        Problem.from_profile(prof), w.plan.layout, w.plan.blocks, w.mode, keep=None) + 1e-9
    best = rep.schedule("best")
    assert rep.results["best"].iteration_ms <= min(r.iteration_ms for r in rep.results.values()) + 1e-9
    if rep.results["best"].plan.runner is Runner.RUNTIME:
        assert best.cut_pieces is not None
    # The schedule's prediction is what simulating it on the profile gives (cuts charged).
    assert simulate(prof, best).iteration_ms == pytest.approx(best.predicted["iteration_ms"], rel=1e-9)
    # Round trip through a file.
    path = tmp_path / "best.json"
    save_schedule(dataclasses.replace(best, cut_pieces=(1, 3)), path)
    back = load_schedule(path)
    assert back.cut_pieces == (1, 3)
    assert json.loads(path.read_text())["cut_pieces"] == [1, 3]


@pytest.mark.parametrize("value, field, expected", [
    ([3, 1], "cut_pieces[1]", "ascending"),
    ([0], "cut_pieces", "integers >= 1"),
    ([1, 10_000], "cut_pieces[1]", "below the number of"),
])
def test_a_malformed_cut_pieces_names_the_field(tmp_path, value, field, expected) -> None:
    prof = cnn_like({"fc.weight": 0.3})
    sched = compare(prof, ["wfbp"]).schedule("wfbp")
    path = tmp_path / "s.json"
    save_schedule(sched, path)
    d = json.loads(path.read_text())
    d["cut_pieces"] = value
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        load_schedule(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and expected in msg, msg


def test_sharded_schedules_take_no_cut_pieces(tmp_path) -> None:
    prof = cnn_like({"fc.weight": 0.3})
    sched = compare(prof, ["wfbp"]).schedule("wfbp")
    path = tmp_path / "s.json"
    save_schedule(sched, path)
    d = json.loads(path.read_text())
    d["cut_pieces"], d["mode"] = [1], "sharded"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match="cut_pieces"):
        load_schedule(path)


@pytest.mark.parametrize("seed", range(4))
def test_best_is_never_predicted_slower_than_another_strategy_with_cuts(seed) -> None:
    """Every strategy's prediction charges its cuts; best weighs the others' plans with theirs
    (random cut costs over the cnn-like profile)."""
    import random

    rng = random.Random(seed)
    names = ["conv0.bias", "conv1.weight", "conv2.weight", "fc.weight", "out.weight"]
    prof = cnn_like({n: rng.uniform(0.0, 8.0) for n in names}, default=rng.uniform(0.0, 4.0))
    rep = compare(prof)
    best = rep.results["best"].iteration_ms
    others = {n: r.iteration_ms for n, r in rep.results.items() if n != "best"}
    assert best <= min(others.values()) * (1 + 1e-9), (best, others)
