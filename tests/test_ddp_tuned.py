"""``ddp-tuned``: stock DDP's buckets chosen by an exact dynamic programme, the list DDP takes,
and the buckets DDP really builds on 2 gloo ranks."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import play, played, run_cli
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt import console
from usbyte_opt import ddp as uddp
from usbyte_opt.errors import MismatchError
from usbyte_opt.formats import Block, CommSpec, Profile, Schedule, TensorSpec, load_schedule, save_profile
from usbyte_opt.launcher import RankResult, run_local
from usbyte_opt.planning.fastsim import scorer_for
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.strategies import STRATEGIES, NotApplicable, ddp_tuned, get
from usbyte_opt.planning.synthetic import chain_profile, random_profile
from usbyte_opt.runtime import profile_from_model


def with_cpu(profile: Profile, per_block: float, per_mb: float) -> Profile:
    return profile.with_comm(dataclasses.replace(profile.comm, cpu_ms_per_block=per_block,
                                                 cpu_ms_per_mb=per_mb))


def fence(pb: Problem, layout, blocks) -> float:
    sc = scorer_for(pb, layout)
    return sc.score(sc.stats(blocks), "fence")


def brute_force(pb: Problem) -> float:
    """The least fence-mode time over every way to cut the ready-ordered buffer between
    tensors of different ready times, each scored by the scorer."""
    lay = pb.layout()
    ends, last = [], None
    for i in lay.members[0]:
        if pb.ready[i] == last:
            ends[-1] = lay.pos[i][2]
        else:
            ends.append(lay.pos[i][2])
        last = pb.ready[i]
    best = float("inf")
    for mask in range(1 << (len(ends) - 1)):
        cut = [e for k, e in enumerate(ends[:-1]) if mask >> k & 1] + [ends[-1]]
        blocks = [Block(0, s, e) for s, e in zip([0] + cut[:-1], cut)]
        best = min(best, fence(pb, lay, blocks))
    return best


cpu_costs = st.sampled_from([(0.0, 0.0), (0.3, 3.6), (0.6, 9.6), (2.0, 0.0), (0.0, 40.0)])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 9), ratio=st.sampled_from([0.2, 1.0, 3.0]),
       alpha=st.sampled_from([0.0, 0.05, 1.3]), cpu=cpu_costs)
def test_the_programme_equals_brute_force(seed, n, ratio, alpha, cpu):
    prof = with_cpu(random_profile(random.Random(seed), n, comm_ratio=ratio, alpha_ms=alpha), *cpu)
    pb = Problem.from_profile(prof)
    p = ddp_tuned.plan(pb, prefer_default=0.0)   # the programme's own optimum
    T = fence(pb, p.layout, p.blocks)
    assert p.info["exact"]
    assert p.info["iteration_ms"] == pytest.approx(T, rel=1e-9)
    assert T == pytest.approx(brute_force(pb), rel=1e-9, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 60), ratio=st.sampled_from([0.2, 1.0, 3.0]),
       alpha=st.sampled_from([0.0, 0.05, 1.3]), cpu=cpu_costs)
def test_never_slower_than_default_ddp_buckets_and_best_never_slower_than_it(seed, n, ratio, alpha,
                                                                             cpu):
    prof = with_cpu(random_profile(random.Random(seed), n, comm_ratio=ratio, alpha_ms=alpha), *cpu)
    pb = Problem.from_profile(prof)
    # With the compute-cost option the claim holds when DDP's buckets keep tensors of equal
    # ready time together (ddp-tuned never separates them); without it, always.
    assume(not pb.charges_cpu or len(set(pb.ready)) == pb.n)
    p, d = ddp_tuned.plan(pb), get("ddp").plan(pb)
    assert p.mode == "fence"
    assert fence(pb, p.layout, p.blocks) <= fence(pb, d.layout, d.blocks) * (1 + 1e-12) + 1e-12
    report = compare(prof, ["ddp", "ddp-tuned", "best"])
    res = report.results
    assert res["ddp-tuned"].iteration_ms <= res["ddp"].iteration_ms * (1 + 1e-12) + 1e-12
    assert res["best"].iteration_ms <= res["ddp-tuned"].iteration_ms * (1 + 1e-12) + 1e-12
    # best alone (its own cheap seeds) is no slower either
    alone = get("best").plan(pb, time_budget_s=0.05)
    assert fence(pb, p.layout, p.blocks) >= min(
        fence(pb, alone.layout, alone.blocks),
        scorer_for(pb, alone.layout).score(scorer_for(pb, alone.layout).stats(alone.blocks),
                                           alone.mode)) - 1e-9


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 40), cpu=cpu_costs)
def test_plans_are_exactly_what_stock_ddp_takes(seed, n, cpu):
    prof = with_cpu(random_profile(random.Random(seed), n), *cpu)
    report = compare(prof, ["ddp-tuned"])
    sched = report.schedule("ddp-tuned")
    buckets = uddp.planned_buckets(sched)
    caps = uddp.bucket_caps_mb(sched)
    sizes = [(k.end - k.start) * 4 for k in sched.blocks]
    assert [sum(prof.tensor(nm).nbytes for nm in b) for b in buckets] == sizes
    assert [int(c * 2 ** 20) for c in caps] == [s - 1 for s in sizes]
    assert sched.mode == "fence" and len(sched.buffers) == 1


def test_tensors_of_equal_ready_time_share_a_bucket():
    # weight and bias of each layer become ready together; a large alpha-free channel would
    # otherwise send every tensor alone
    def T(nm, n, r, nd):
        return TensorSpec(nm, (n,), "float32", r, nd)
    prof = Profile("ties", 3.0, 6.0, (T("l0.w", 250_000, 6.0, 0.0), T("l0.b", 1000, 6.0, 0.0),
                                      T("l1.w", 250_000, 4.0, 1.0), T("l1.b", 1000, 4.0, 1.0),
                                      T("l2.w", 250_000, 2.0, 2.0), T("l2.b", 1000, 2.0, 2.0)),
                   CommSpec("analytic", 2, alpha_ms=0.0, algbw_gbs=1.0))
    pb = Problem.from_profile(prof)
    p = ddp_tuned.plan(pb, prefer_default=0.0)
    lay = p.layout
    groups = [[pb.names[i] for i in lay.tensors_of(0, k.start, k.end)] for k in p.blocks]
    assert len(groups) == 3
    for g in groups:
        assert {nm.split(".")[0] for nm in g} == {g[0].split(".")[0]} and len(g) == 2


def test_several_dtypes_are_refused_in_one_line_and_skipped_in_the_comparison(tmp_path, capsys):
    prof = random_profile(random.Random(4), 12, dtypes=("float32", "float16"), name="mixed")
    assert len({t.dtype for t in prof.tensors}) == 2
    with pytest.raises(NotApplicable, match=r"tensors: expected one dtype") as e:
        ddp_tuned.plan(Problem.from_profile(prof))
    assert "\n" not in str(e.value)
    report = compare(prof)
    assert "ddp-tuned" not in report.results and "ddp-tuned" in report.skipped
    assert report.results["best"].iteration_ms <= report.results["ddp"].iteration_ms + 1e-9
    path = tmp_path / "mixed.json"
    save_profile(prof, path)
    code, out, err = run_cli(capsys, "optimize", str(path), "-o", str(tmp_path / "s.json"),
                             "--strategy", "ddp-tuned")
    assert code != 0 and "expected one dtype" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s.json").exists()
    code, out, err = run_cli(capsys, "optimize", str(path), "-o", str(tmp_path / "s.json"))
    assert code == 0 and "ddp-tuned: no plan" in err


def test_registered_in_fence_mode_after_ddp():
    pb = Problem.from_profile(chain_profile([1000, 2000, 3000]))
    assert STRATEGIES["ddp-tuned"].plan(pb).mode == "fence"
    names = list(STRATEGIES)
    assert names.index("ddp-tuned") == names.index("ddp") + 1


def test_large_uncharged_profiles_take_one_pass():
    # 2,000 tensors: the O(n log n) programme, no search
    prof = chain_profile([random.Random(1).randrange(1000, 10 ** 6) for _ in range(2000)],
                         alpha_ms=0.5)
    pb = Problem.from_profile(prof)
    p = ddp_tuned.plan(pb)
    assert p.info["exact"]
    assert fence(pb, p.layout, p.blocks) <= fence(pb, *_ddp(pb)) + 1e-9


def _ddp(pb):
    d = get("ddp").plan(pb)
    return d.layout, d.blocks


def test_a_capped_search_still_returns_a_plan_no_slower_than_its_seeds():
    prof = with_cpu(random_profile(random.Random(11), 60, comm_ratio=1.0, alpha_ms=0.5), 2.0, 0.0)
    pb = Problem.from_profile(prof)
    full = ddp_tuned.plan(pb)
    capped = ddp_tuned.plan(pb, max_work=10)
    assert not capped.info["exact"]
    assert fence(pb, capped.layout, capped.blocks) >= fence(pb, full.layout, full.blocks) - 1e-9
    assert fence(pb, capped.layout, capped.blocks) <= fence(pb, *_ddp(pb)) + 1e-9


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


@pytest.fixture
def screen(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=buf, width=200, highlight=False,
                                                soft_wrap=True))
    return buf


def test_optimize_prints_the_bucket_list_and_the_wrap_line_within_80_columns(tmp_path, screen,
                                                                             capsys, monkeypatch):
    prof = random_profile(random.Random(3), 30, name="rand", alpha_ms=1.0)
    monkeypatch.chdir(tmp_path)   # short paths: the wrap line names the schedule file
    path = Path("rand.json")
    save_profile(prof, path)
    out_path = Path("schedules") / "rand.json"
    for wide in ([], ["--wide"]):
        screen.seek(0)
        screen.truncate()
        code, _, err = run_cli(capsys, "optimize", str(path), "-o", str(out_path),
                               "--strategy", "ddp-tuned", *wide)
        assert code == 0, err
        text = screen.getvalue()
        # the default table and every line around it fit 80 columns (--wide adds columns)
        lines = [ln for ln in text.splitlines()
                 if not wide or not any(c in ln for c in "┏┃┡│└━─")]   # (a table, borders or not)
        assert max(len(line) for line in lines) <= 80, text
        assert "ddp-tuned *" in text
        flat = " ".join(text.split())
        assert "DistributedDataParallel(model, bucket_cap_mb_list=[" in flat
        assert f'usbyte_opt.ddp.wrap(model, "{out_path}")' in flat
    sched = load_schedule(out_path)
    assert sched.strategy == "ddp-tuned" and sched.mode == "fence"
    # the printed list gives DDP the same byte limits as bucket_caps_mb
    printed = flat.split("bucket_cap_mb_list=")[1].split("]")[0] + "]"
    assert [int(c * 2 ** 20) for c in json.loads(printed)] == \
        [int(c * 2 ** 20) for c in uddp.bucket_caps_mb(sched)]


def test_optimize_json_has_the_bucket_list(tmp_path, capsys):
    prof = random_profile(random.Random(5), 20, name="rand", alpha_ms=1.0)
    path = tmp_path / "rand.json"
    save_profile(prof, path)
    code, out, _ = run_cli(capsys, "optimize", str(path), "-o", str(tmp_path / "s.json"), "--json",
                           "--strategy", "ddp-tuned")
    assert code == 0
    doc = json.loads(out)
    assert doc["chosen"] == "ddp-tuned" and doc["mode"] == "fence"
    assert doc["bucket_cap_mb_list"] == uddp.bucket_caps_mb(load_schedule(tmp_path / "s.json"))
    assert doc["strategies"]["best"]["iteration_ms"] <= \
        doc["strategies"]["ddp-tuned"]["iteration_ms"] + 1e-9
    code, out, _ = run_cli(capsys, "optimize", str(path), "-o", str(tmp_path / "b.json"), "--json")
    assert "bucket_cap_mb_list" not in json.loads(out)


# --------------------------------------------------------------------------------------------
# Stock DDP on 2 gloo ranks
# --------------------------------------------------------------------------------------------


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def planned(path, reverse: bool = False) -> None:
    """ddp-tuned's schedule of :func:`model`'s profile (the channel chosen so that the plan
    has several buckets of different sizes); ``reverse``: a profile whose ready order is the
    opposite of the real one."""
    prof = profile_from_model(model(), 2, alpha_ms=1.0, algbw_gbs=0.01)
    if reverse:
        ts = prof.tensors
        prof = dataclasses.replace(prof, tensors=tuple(
            dataclasses.replace(t, ready_ms=u.ready_ms) for t, u in zip(ts, reversed(ts))))
    report = compare(prof, ["ddp", "ddp-tuned"])
    sched = report.schedule("ddp-tuned")
    from usbyte_opt.formats import save_schedule

    save_schedule(sched, path)
    return sched


def train_side_by_side(rank: int, ws: int, path: str) -> dict:
    sched = load_schedule(path)
    m = model()
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    tuned, plain = uddp.wrap(a, path), DDP(b)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for i in range(6):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + i))
        for net, o in ((tuned, oa), (plain, ob)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    try:
        uddp.check_buckets(tuned, sched)
        mismatch = None
    except MismatchError as e:
        mismatch = str(e)
    return {"rebuilt": uddp.rebuilt_bucket_sizes(tuned), "mismatch": mismatch,
            "diff": max((p - q).abs().max().item() for p, q in zip(a.parameters(),
                                                                   b.parameters()))}


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory) -> dict[str, tuple[Schedule, list[RankResult]]]:
    """Both schedules (``tuned``: :func:`planned`; ``wrong``: planned for the reversed ready
    order) trained by :func:`train_side_by_side` in one spawned run of two ranks."""
    d = tmp_path_factory.mktemp("ddp_tuned")
    scheds = {"tuned": planned(d / "tuned.json"), "wrong": planned(d / "wrong.json", reverse=True)}
    outcome = played(run_local(play, 2, args=({k: (train_side_by_side, (str(d / f"{k}.json"),))
                                               for k in scheds},), timeout_s=300))
    return {k: (s, outcome(k)) for k, s in scheds.items()}


@pytest.mark.skipif(not uddp.supports_bucket_list(), reason="torch without bucket_cap_mb_list")
def test_stock_ddp_builds_the_planned_buckets_and_trains_like_default_ddp(side_by_side):
    sched, results = side_by_side["tuned"]
    sizes = [(k.end - k.start) * 4 for k in sched.blocks]
    assert len(set(sizes)) >= 2, sizes        # several buckets, not all alike
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["mismatch"] is None, r.value["mismatch"]
        assert r.value["rebuilt"] == sizes
        assert r.value["diff"] == 0.0


@pytest.mark.skipif(not uddp.supports_bucket_list(), reason="torch without bucket_cap_mb_list")
def test_a_profile_whose_ready_order_is_not_the_models_gives_other_buckets(side_by_side):
    sched, results = side_by_side["wrong"]
    assert len(sched.blocks) >= 2
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["mismatch"] is not None and "another order" in r.value["mismatch"]
        assert r.value["diff"] == 0.0        # DDP's arithmetic is the same whatever buckets


def test_a_gain_within_the_models_error_keeps_ddps_own_buckets():
    """The optimum predicted faster than DDP's buckets by less than PREFER_DEFAULT: DDP's own."""
    from usbyte_opt.planning.strategies import ddp

    for seed in range(40):
        pb = Problem.from_profile(random_profile(random.Random(seed), 12, comm_ratio=1.0))
        own = ddp_tuned.plan(pb, prefer_default=0.0)
        kept = ddp_tuned.plan(pb)
        default = ddp.buckets(pb, kept.layout)
        if own.info["iteration_ms"] * (1 + ddp_tuned.PREFER_DEFAULT) >= fence(pb, kept.layout, default):
            assert kept.blocks == default and kept.info["default_buckets"]
        else:
            assert kept.blocks == own.blocks and not kept.info["default_buckets"]
