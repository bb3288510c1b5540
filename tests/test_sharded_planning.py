"""Planning sharded mode: the iteration model by hand, closed form against the timeline, the
all-gather grouping and the whole plan against exhaustive search on tiny instances, the
lower bound under every strategy, and ``optimize --shard`` / ``simulate`` end to end."""

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from helpers import run_cli

from usbyte_opt.formats import Block, CommSpec, Mode, Profile, TensorSpec, load_profile, load_schedule
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.sharded import (
    gather_grouping,
    sharded_lower_bound,
    sharded_time,
    simulate_sharded,
    state_bytes,
)
from usbyte_opt.planning.simulate import simulate
from usbyte_opt.planning.synthetic import random_profile

ROOT = Path(__file__).resolve().parents[1]


def _toy(world_size=2, update=(0.0, 0.0), cpu=(0.0, 0.0)):
    """Three tensors of 1 MB (250k float32): all-reduce 1 ms + 1 ms/MB, so a reduce-scatter
    or an all-gather of one tensor costs 0.5 + 0.5 = 1 ms."""
    ts = (TensorSpec("c", (250_000,), "float32", ready_ms=1.0, need_ms=6.0, update_ms=update[0]),
          TensorSpec("b", (250_000,), "float32", ready_ms=3.0, need_ms=3.0, update_ms=update[1]),
          TensorSpec("a", (250_000,), "float32", ready_ms=8.0, need_ms=0.0))
    return Profile("toy", forward_ms=8.0, backward_ms=8.0, tensors=ts,
                   comm=CommSpec("analytic", world_size, 1.0, 1.0, cpu_ms_per_block=cpu[0],
                                 cpu_ms_per_mb=cpu[1]))


def test_timeline_by_hand():
    pb = Problem.from_profile(_toy(world_size=4, update=(2.0, 2.0)))
    lay = pb.layout()                    # ready order: c, b, a
    blocks = [Block(0, 0, 500_000), Block(0, 500_000, 750_000)]   # {c, b}, {a}
    # reduce-scatters: {c,b} ready at 3, 3 -> 4.5 (0.5 + 1 ms for 2 MB); {a} ready 8 -> 9.
    # step: 4 ms of updates / 4 ranks = 1 ms, 9 -> 10. All-gathers from 10: {a} first, 10 -> 11,
    # then {c,b} 11 -> 12.5. Forward from 10: a at 11 (waits 1), b at 14, c at 17; ends 19.
    tl = simulate_sharded(pb, lay, blocks, [(1,), (0,)])
    assert [(b.start_ms, b.finish_ms) for b in tl.blocks] == [(3.0, 4.5), (8.0, 9.0)]
    assert tl.update_ms == 1.0 and tl.forward_start_ms == 10.0
    assert [(g.start_ms, g.finish_ms) for g in tl.gathers] == [(10.0, 11.0), (11.0, 12.5)]
    assert [(g.name, g.reach_ms, g.wait_ms) for g in tl.forward] == [("a", 11.0, 1.0),
                                                                   ("b", 14.0, 0.0),
                                                                   ("c", 17.0, 0.0)]
    assert tl.iteration_ms == 19.0 == sharded_time(pb, lay, blocks, [(1,), (0,)])
    # Both in one all-gather: 10 -> 12 (0.5 + 1.5 ms), forward waits for a until 12: 20.
    assert sharded_time(pb, lay, blocks, [(0, 1)]) == 20.0
    # The default: one per block in reverse block order, as the runtime runs a file without it.
    assert sharded_time(pb, lay, blocks) == 19.0


def test_compute_charge_by_hand():
    # One block of all three tensors: reduce-scatter 8 -> 10 (0.5 + 1.5 ms) after backward
    # ends, all-gather 10 -> 12 while the forward waits: nothing overlaps compute, no charge.
    pb = Problem.from_profile(_toy(cpu=(1.0, 0.0)))
    lay = pb.layout()
    one = [Block(0, 0, 750_000)]
    tl = simulate_sharded(pb, lay, one, [(0,)])
    assert tl.meta["cpu_charge_ms"] == {"backward": 0.0, "forward": 0.0}
    assert tl.iteration_ms == 12.0 + 8.0
    # Per tensor: c's reduce-scatter (1 -> 2) lies inside backward: it pays c's 1 ms there.
    # b's (3 -> 4) too; a's (8 -> 9) after it. All-gathers a (9 -> 10), b, c: b's (10 -> 11)
    # overlaps the forward's compute (a reached at 10, b needed at 13), c's (11 -> 12) too.
    per = [Block(0, 0, 250_000), Block(0, 250_000, 500_000), Block(0, 500_000, 750_000)]
    tl = simulate_sharded(pb, lay, per, [(2,), (1,), (0,)])
    assert tl.meta["cpu_charge_ms"] == {"backward": 2.0, "forward": 2.0}
    # Backward x (1 + 2/8): ready 1.25, 3.75, 10; forward x (1 + 2/8): F 10, needs 0, 3.75, 7.5.
    # Reduce-scatters end at 11, all-gathers 11 -> 14, forward from 11: a at 12, ends 22.
    assert tl.iteration_ms == pytest.approx(22.0)
    assert sharded_time(pb, lay, per, [(2,), (1,), (0,)]) == tl.iteration_ms


def _random_plan(rng, pb):
    lay = pb.layout()
    blocks = []
    for b, n in enumerate(lay.numel):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
        edges = [0, *cuts, n]
        blocks += [Block(b, s, e) for s, e in zip(edges, edges[1:])]
    rng.shuffle(blocks)
    ks = list(range(len(blocks)))
    rng.shuffle(ks)
    gathers, i = [], 0
    while i < len(ks):
        j = i + rng.randint(1, 3)
        gathers.append(tuple(ks[i:j]))
        i = j
    return lay, blocks, gathers


def test_closed_form_equals_the_timeline():
    rng = random.Random(3)
    for _ in range(60):
        prof = random_profile(rng, rng.randint(1, 12), comm_ratio=rng.choice([0.3, 2.0]),
                              dtypes=rng.choice([("float32",), ("float32", "float16")]))
        pb = Problem.from_profile(prof)
        lay, blocks, gathers = _random_plan(rng, pb)
        fast = sharded_time(pb, lay, blocks, gathers)
        assert fast == pytest.approx(simulate_sharded(pb, lay, blocks, gathers).iteration_ms,
                                     rel=1e-12)


def _ordered_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _ordered_partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [p[i] + (first,)] + p[i + 1:]
        for i in range(len(p) + 1):
            yield p[:i] + [(first,)] + p[i:]


def _phase(nbytes, tails, groups, alpha, beta, F):
    acc, worst = 0.0, F
    for g in groups:
        acc += alpha + beta * sum(nbytes[i] for i in g)
        worst = max(worst, acc + max(tails[i] for i in g))
    return worst


def test_gather_grouping_is_the_best_of_every_grouping():
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(1, 6)
        nbytes = [rng.choice([1e5, 1e6, 4e6]) for _ in range(n)]
        tails = [rng.uniform(0, 10) for _ in range(n)]
        alpha, F = rng.choice([0.1, 1.0, 3.0]), rng.uniform(0, 12)
        got, groups = gather_grouping(nbytes, tails, alpha, 1e-6, F)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert got == pytest.approx(_phase(nbytes, tails, groups, alpha, 1e-6, F))
        brute = min(_phase(nbytes, tails, p, alpha, 1e-6, F)
                    for p in _ordered_partitions(list(range(n))))
        assert got == pytest.approx(brute, rel=1e-6)


def _exhaustive(pb):
    """Every whole-tensor sharded schedule of a one-buffer problem: contiguous blocks, any
    issue order, any ordered grouping of the blocks into all-gathers."""
    lay = pb.layout()
    mem = lay.members[0]
    best = math.inf
    for mask in range(1 << (pb.n - 1)):
        cuts = [0] + [i + 1 for i in range(pb.n - 1) if mask >> i & 1] + [pb.n]
        blocks = [Block(0, lay.pos[mem[a]][1], lay.pos[mem[b - 1]][2]) for a, b in zip(cuts, cuts[1:])]
        for order in itertools.permutations(blocks):
            for g in _ordered_partitions(list(range(len(order)))):
                best = min(best, sharded_time(pb, lay, list(order), g))
    return best


def test_best_sharded_is_optimal_on_tiny_instances_and_the_bound_below():
    rng = random.Random(1)
    for _ in range(25):
        prof = random_profile(rng, rng.randint(2, 4), comm_ratio=rng.choice([0.3, 1.0, 3.0]),
                              alpha_ms=rng.choice([0.05, 0.5, 2.0]))
        pb = Problem.from_profile(prof)
        opt = _exhaustive(pb)
        report = compare(prof, shard=True)
        assert sharded_lower_bound(pb) <= opt + 1e-9
        assert report.results["best-sharded"].iteration_ms == pytest.approx(opt, rel=1e-9)


def test_the_bound_is_below_every_sharded_strategy():
    rng = random.Random(11)
    for trial in range(30):
        prof = random_profile(rng, rng.randint(2, 60), comm_ratio=rng.choice([0.2, 1.0, 5.0]),
                              alpha_ms=rng.choice([0.01, 0.2, 2.0]),
                              dtypes=rng.choice([("float32",), ("float32", "float16")]))
        c = prof.comm
        if trial % 3 == 0:   # the compute-cost option
            prof = prof.with_comm(CommSpec(c.backend, rng.choice([2, 4, 8]), c.alpha_ms,
                                           c.algbw_gbs, cpu_ms_per_block=0.05, cpu_ms_per_mb=0.2))
        report = compare(prof, shard=True)
        lb = report.lower_bound_ms
        times = {n: r.iteration_ms for n, r in report.results.items()}
        assert all(t >= lb - 1e-9 for t in times.values()), (trial, lb, times)
        assert times["best-sharded"] <= min(times.values()) + 1e-9
        # A random schedule too (the bound is for every schedule, not only planned ones).
        pb = report.problem
        lay, blocks, gathers = _random_plan(rng, pb)
        assert sharded_time(pb, lay, blocks, gathers) >= lb - 1e-9


def test_compare_shard_on_a_shipped_profile(tmp_path):
    prof = load_profile(ROOT / "profiles" / "bert-base.json")
    report = compare(prof, shard=True, optimizer="adam")
    assert list(report.results) == ["fsdp-like", "dear-like", "best-sharded"]
    assert report.sharded and report.reference is not None and report.reference.name == "ddp"
    ws = prof.comm.world_size
    for r in report.results.values():
        assert r.mode == Mode.SHARDED
        # Adam: two moments; each rank keeps about 1 / world_size of them.
        assert r.state_bytes == pytest.approx(2 * report.problem.total_bytes / ws, rel=1e-3)
    assert report.reference.state_bytes == 2 * report.problem.total_bytes
    best = report.results["best-sharded"]
    assert best.iteration_ms <= min(r.iteration_ms for r in report.results.values())
    assert (best.iteration_ms - report.lower_bound_ms) / report.lower_bound_ms < 0.03
    sched = report.schedule("best-sharded")
    path = tmp_path / "s.json"
    from usbyte_opt.formats import save_schedule

    save_schedule(sched, path)
    back = load_schedule(path)
    assert back.mode == Mode.SHARDED and back.gathers == sched.gathers
    assert sorted(k for g in back.gather_groups() for k in g) == list(range(len(back.blocks)))
    assert simulate(prof, back).iteration_ms == pytest.approx(best.iteration_ms)
    assert back.predicted["state_bytes_per_rank"] == best.state_bytes


def test_state_bytes_count_each_block_shard_rounded_up():
    prof = _toy(world_size=4)
    pb = Problem.from_profile(prof)
    lay = pb.layout()
    # 750,000 elements in blocks of 250,001 / 249,999 / 250,000: shards of 62,501, 62,500, 62,500.
    blocks = [Block(0, 0, 250_001), Block(0, 250_001, 500_000), Block(0, 500_000, 750_000)]
    assert state_bytes(pb, lay, blocks, 2) == 2 * 4 * (62_501 + 62_500 + 62_500)
    assert state_bytes(pb, lay, None, 1) == 4 * 750_000


def _json(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_optimize_shard_and_simulate_end_to_end(tmp_path, capsys):
    prof = ROOT / "profiles" / "resnet50.json"
    out, trace = tmp_path / "r.json", tmp_path / "r.trace.json"
    doc = _json(capsys, "optimize", str(prof), "--shard", "-o", str(out), "--trace", str(trace))
    assert doc["chosen"] == "best-sharded" and doc["mode"] == "sharded"
    assert doc["reference"]["strategy"] == "ddp"
    assert doc["strategies"]["best-sharded"]["state_bytes_per_rank"] < \
        doc["reference"]["state_bytes_per_rank"]
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert any(n.startswith("reduce-scatter #") for n in names)
    assert any(n.startswith("all-gather #") for n in names)
    sim = _json(capsys, "simulate", str(prof), str(out))
    assert sim["mode"] == "sharded" and sim["all_gathers"] == doc["strategies"]["best-sharded"]["all_gathers"]
    assert sim["iteration_ms"] == pytest.approx(doc["strategies"]["best-sharded"]["iteration_ms"])
    # An all-reduce schedule predicted in sharded mode (its blocks, one all-gather each).
    other = _json(capsys, "simulate", str(prof), str(ROOT / "schedules" / "resnet50.json"),
                  "--mode", "sharded")
    assert other["mode"] == "sharded"
    assert other["lower_bound_ms"] == pytest.approx(sim["lower_bound_ms"])
    # Without --shard nothing changes: the all-reduce strategies, best in overlap or fence.
    plain = _json(capsys, "optimize", str(prof), "-o", str(tmp_path / "plain.json"))
    assert plain["chosen"] == "best" and plain["mode"] in ("overlap", "fence")


@pytest.mark.parametrize("argv, words", [
    (["--shard", "-s", "usbyte"], "--strategy"),
    (["--shard", "--optimizer", "lamb"], "--optimizer"),
    (["--optimizer", "adam"], "only with --shard"),
])
def test_optimize_shard_refusals(capsys, tmp_path, argv, words):
    code, _, err = run_cli(capsys, "optimize", str(ROOT / "profiles" / "resnet50.json"),
                           "-o", str(tmp_path / "x.json"), *argv)
    assert code != 0 and words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_an_all_gather_moves_one_dtype():
    rng = random.Random(2)
    for _ in range(10):
        prof = random_profile(rng, rng.randint(4, 30), comm_ratio=3.0, alpha_ms=0.5,
                              dtypes=("float32", "float16", "bfloat16"))
        report = compare(prof, shard=True)
        for r in report.results.values():
            dts = [{r.plan.layout.buffers[r.plan.blocks[k].buffer].dtype for k in g}
                   for g in r.plan.gathers]
            assert all(len(d) == 1 for d in dts), r.name
