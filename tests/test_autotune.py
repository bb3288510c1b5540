"""Planning and verifying inside the user's run (schedule="auto", verify=True), 2 gloo ranks:
every rank switches at the same iteration, decisions are identical on every rank, training
equals DDP throughout, and what an auto run writes is a profile and schedule the CLI reads.
The two-rank scenarios run in one spawned run (:func:`helpers.play`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import play, played
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt.env import AUTO, SCHEDULE_ENV
from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import load_profile, load_schedule
from usbyte_opt.launcher import RankResult, run_local
from usbyte_opt.runtime import DistributedOptimizer
from usbyte_opt.runtime.autotune import CLEAN, MAX_ROUNDS, MIN_ROUNDS, OVERLAP, WARMUP, WINDOW
from usbyte_opt.verdict import Budget

sys.path.insert(0, os.path.dirname(__file__))
from test_runtime_equivalence import OPTIMIZERS, SmallCNN, image_batch, max_diff, mse, sched_wfbp, twins  # noqa: E402

STEPS = WARMUP + CLEAN + OVERLAP + 2 * MAX_ROUNDS * WINDOW + 4
#: The steps a verification can settle at: after a look of the budget (in rounds).
LOOKS = [2 * k * WINDOW for k in Budget(MIN_ROUNDS, MAX_ROUNDS).looks()]


def train(rank: int, ws: int, kind: str, auto_dir: str | None = None,
          skew_ms: float = 0.0) -> dict:
    """DDP and the runtime side by side; ``kind``: "auto" or "verify" (a per-tensor plan).
    ``skew_ms``: rank 1 sleeps this long in every iteration of the plan (verify windows)."""
    ref, mod = twins(lambda: SmallCNN(bn=True))
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    kw = ({"schedule": "auto", "auto_dir": auto_dir} if kind == "auto"
          else {"schedule": sched_wfbp(mod, ws)})
    opt = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod, **kw)
    switches = []
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        mse(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        before = opt.schedule
        if skew_ms and rank == 1 and before.strategy != "ddp-like":
            time.sleep(skew_ms / 1e3)
        mse(mod(x), y).backward(); opt.step(); opt.zero_grad()
        if opt.schedule is not before:
            switches.append((step, opt.schedule.strategy, opt.schedule.mode))
    opt.synchronize()
    return {"diff": max_diff(ref, mod), "switches": switches, "report": opt.report()}


def check_same_on_every_rank(res) -> list[dict]:
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    vals = [r.value for r in res]
    for v in vals:
        assert v["diff"] <= 1e-5, v
    assert vals[0]["switches"] == vals[1]["switches"]
    for key in ("chosen", "measured_ms", "settled_at_step", "summary", "vs_ddp_buckets"):
        assert vals[0]["report"][key] == vals[1]["report"][key], key
    return vals


def test_auto_plans_switches_everywhere_at_once_and_trains_like_ddp(outcomes, auto_dir):
    vals = check_same_on_every_rank(outcomes("auto"))
    rep = vals[0]["report"]
    assert rep["auto"] and rep["auto_settled_at_step"] == WARMUP + CLEAN + OVERLAP
    assert rep["settled_at_step"] - (WARMUP + CLEAN + OVERLAP) in LOOKS
    assert rep["chosen"] in ("plan", "fallback") and rep["phase"] == "settled"
    # Kept only when measurably faster; the summary says which, and never "fallback".
    v = rep["vs_ddp_buckets"]
    assert (rep["chosen"] == "plan") == (v["hi"] is not None and v["hi"] < 1.0)
    assert rep["summary"].startswith("kept the plan best" if rep["chosen"] == "plan"
                                     else "running DDP's buckets: the plan best")
    assert "fallback" not in rep["summary"]
    assert vals[0]["switches"][0][:2] == (WARMUP + CLEAN + OVERLAP - 1, "best")
    # What it wrote is what optimize and simulate read.
    prof = load_profile(auto_dir / "profile.json")
    sched = load_schedule(auto_dir / "schedule.json")
    assert sched.strategy == "best" and sched.fingerprint == prof.fingerprint()
    assert prof.comm.world_size == 2 and prof.comm.samples


def test_verify_decision_is_identical_on_every_rank_even_when_one_rank_is_skewed(outcomes):
    vals = check_same_on_every_rank(outcomes("verify_skewed"))
    rep = vals[0]["report"]
    assert rep["chosen"] == "fallback"          # the plan's windows were made 40 ms slower
    assert rep["measured_ms"]["plan"] > rep["measured_ms"]["fallback"]
    assert rep["settled_at_step"] in LOOKS
    assert rep["summary"].startswith("running DDP's buckets: the plan wfbp")
    assert "95% CI" in rep["summary"] and rep["vs_ddp_buckets"]["ratio"] > 1.0
    # Its fallback is not torch DDP: the summary says so, and what that costs.
    assert "the runtime on DDP's buckets, not torch DDP itself: about" in rep["summary"]
    assert "ms more host time per iteration than torch DDP" in rep["summary"]


def wrapper_verify(rank: int, ws: int, skew_ms: float) -> dict:
    """The DDP loop with its one line changed to ``usbyte_opt.DistributedDataParallel`` and a
    schedule given: torch DDP trains until the optimizer's first step, which takes it over;
    the plan is then timed against that DDP (rank 1 sleeps in the plan's windows, so DDP wins),
    and DDP runs from then on, the runtime's hooks off."""
    import usbyte_opt

    ref, mod = twins(lambda: SmallCNN(bn=True))
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    model = usbyte_opt.DistributedDataParallel(mod, schedule=sched_wfbp(mod, ws))
    opt = OPTIMIZERS["adamw_wd"](mod.parameters())
    sides = []
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        mse(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        sides.append(model.runs_torch_ddp)
        if skew_ms and rank == 1 and not model.runs_torch_ddp:
            time.sleep(skew_ms / 1e3)
        mse(model(x), y).backward(); opt.step(); opt.zero_grad()
    rt = model.optimizer
    assert rt is not None
    rt.synchronize()
    return {"diff": max_diff(ref, mod), "switches": [i for i in range(1, len(sides))
                                                     if sides[i] != sides[i - 1]],
            "report": rt.report(), "on_ddp": model.runs_torch_ddp,
            "hooks": len(rt._state.handles), "both": sides[:2 * WINDOW + 1]}


def test_wrapper_falls_back_to_torch_ddp_itself(outcomes):
    vals = check_same_on_every_rank(outcomes("wrapper_skewed"))
    rep = vals[0]["report"]
    assert rep["chosen"] == "fallback" and vals[0]["on_ddp"] and vals[0]["hooks"] == 0
    # DDP until the first step, then the plan's window, then DDP's
    assert vals[0]["both"] == [True] + [False] * WINDOW + [True] * WINDOW
    assert rep["summary"].startswith("running torch DDP: the plan wfbp")
    assert vals[0]["diff"] == 0.0        # every window, the runtime's and DDP's: DDP's numbers


def nothing_planned(rank: int, ws: int) -> dict:
    import usbyte_opt

    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = usbyte_opt.DistributedDataParallel(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model(torch.randn(4, 4)).sum().backward(); opt.step(); opt.zero_grad()
    return {"ddp": model.runs_torch_ddp, "optimizer": model.optimizer,
            "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters()),
            "cls": type(opt).__module__}


def test_wrapper_without_a_schedule_is_torch_ddp(outcomes):
    for r in outcomes("nothing_planned"):
        assert r.ok, r.trace
        assert r.value == {"ddp": True, "optimizer": None, "hooks": 0, "cls": "torch.optim.sgd"}


def one_rank_replan_needs_a_tuner(rank: int, ws: int) -> str:
    m = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, verify=False)
    try:
        opt.replan()
    except UsbyteError as e:
        return str(e)
    return ""


def test_replan_without_planning_or_verifying_is_an_error():
    res = run_local(one_rank_replan_needs_a_tuner, 1, timeout_s=60)
    assert "replan(): this optimizer neither plans nor verifies" in res[0].value


def env_auto(rank: int, ws: int) -> dict:
    os.environ[SCHEDULE_ENV] = AUTO
    try:
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
        return opt.report()
    finally:
        del os.environ[SCHEDULE_ENV]


def test_env_auto_starts_on_the_fallback(outcomes):
    for r in outcomes("env_auto"):
        assert r.ok, r.trace
        assert r.value["auto"] and r.value["schedule"]["strategy"] == "ddp-like"
        assert r.value["schedule"]["mode"] == "fence"


def drift(rank: int, ws: int) -> dict:
    """The plan is kept (DDP's buckets' windows are made slower on every rank); its prediction
    is far off, so the drift check warns once on rank 0 and, asked to, verifies again. The
    loop ends on the tuner's state, which every rank holds alike (same steps everywhere)."""
    import dataclasses
    import warnings

    from usbyte_opt.runtime import default_schedule

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    plan = dataclasses.replace(default_schedule(m, ws), predicted={"iteration_ms": 0.01})
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), m, schedule=plan,
                               check_every=5, replan_on_drift=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2 * MAX_ROUNDS * WINDOW + 12):
            if opt.schedule.strategy == "ddp-like":
                time.sleep(0.02)
            m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
            rep = opt.report()
            if rep.get("drift") and rep["phase"] == "verify":
                break
    rep = opt.report()
    return {"chosen": rep["chosen"], "summary": rep["summary"], "drift": rep.get("drift"), "phase": rep["phase"],
            "warnings": [str(w.message) for w in caught if "off its prediction" in str(w.message)]}


def test_drift_from_the_prediction_warns_once_and_can_replan(outcomes):
    res = outcomes("drift")
    for r in res:
        assert r.ok, r.trace
        assert r.value["chosen"] == "plan"
        assert r.value["summary"].startswith("verifying the plan default")   # again, after the drift
        assert r.value["drift"]["predicted_ms"] == 0.01
        assert r.value["phase"] == "verify"      # replan_on_drift started a new verification
    assert len(res[0].value["warnings"]) == 1 and not res[1].value["warnings"]


@pytest.fixture(scope="module")
def auto_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("autotune") / "auto"


@pytest.fixture(scope="module")
def outcomes(auto_dir: Path) -> Callable[[str], list[RankResult]]:
    """``outcomes(name)``: one :class:`RankResult` per rank for that scenario."""
    scenarios = {"auto": (train, ("auto", str(auto_dir))), "verify_skewed": (train, ("verify", None, 40.0)),
                 "wrapper_skewed": (wrapper_verify, (40.0,)), "nothing_planned": (nothing_planned, ()),
                 "env_auto": (env_auto, ()), "drift": (drift, ())}
    return played(run_local(play, 2, args=(scenarios,), timeout_s=600))
