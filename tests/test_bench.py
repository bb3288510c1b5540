"""``usbyte-opt bench``: report arithmetic, a loopback run and (as root) a short lab run.

The runs assert what must hold on any machine — training matches DDP, every file of the
report is written, ``--json`` is pure JSON, the lab is gone afterwards, FSDP2 and the sharded
runtime hold about half of DDP's optimizer state on each of 2 ranks — never timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_lab import SKIP as LAB_SKIP

from usbyte_opt.bench import SHARDED_STRATEGIES, BenchConfig, ProfileOptions, run_bench
from usbyte_opt.bench.netlab import list_namespaces
from usbyte_opt.bench.report import COLUMNS, compare_trace, markdown, stats, summarize, table_rows
from usbyte_opt.errors import UsbyteError
from usbyte_opt.launcher import run_local, values
from usbyte_opt.models import make_batches

REPO = Path(__file__).resolve().parents[1]


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# --------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------


def raw_record(ddp=(100.0, 110.0, 105.0), best=(80.0, 84.0, 82.0), diff=0.0):
    return {
        "job": {"model": "m:f", "iterations": 3, "rounds": 1},
        "profile": "p.json", "profile_name": "toy", "world_size": 2, "backend": "gloo",
        "device": "cpu", "threads": 1, "torch": "x", "batch_size": 4,
        "forward_ms": 30.0, "backward_ms": 50.0,
        "comm": {"backend": "gloo", "alpha_ms": 0.5, "algbw_gbs": 0.025},
        "gradient_bytes": 1_000_000,
        "planned": {"lower_bound_ms": 80.0, "compute_ms": 80.0, "update_ms": 2.0, "all": {},
                    "predicted": {"ddp": {"ms": 110.0, "refined_ms": 110.0, "mode": "fence", "blocks": 2},
                                  "best": {"ms": 82.0, "refined_ms": 84.0, "mode": "overlap",
                                           "blocks": 5}}},
        "schedules": {}, "traces": {},
        "runs": {"ddp": {"durations_ms": list(ddp), "final_loss": 1.0, "max_param_diff": 0.0,
                         "state_bytes_by_rank": [4_000_000, 4_000_000]},
                 "best": {"durations_ms": list(best), "final_loss": 1.0, "max_param_diff": diff,
                          "state_bytes_by_rank": [2_000_004, 1_999_996]}},
        "phases_s": {"profile": 1.0, "plan": 0.1, "train": 2.0},
        "reference": "ddp",
    }


def test_stats_median_and_spread():
    s = stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median_ms"] == 3.0 and s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(61.6)
    assert math.isnan(stats([])["median_ms"])


def test_summarize_errors_and_speedups(tmp_path):
    res = summarize(raw_record(), {"kind": "loopback", "short": "loopback", "description": "lo"}, tmp_path)
    by = {r["strategy"]: r for r in res["runs"]}
    assert by["ddp"]["measured_ms"] == 105.0 and by["ddp"]["speedup_vs_ddp"] == 1.0
    assert by["best"]["speedup_vs_ddp"] == pytest.approx(105.0 / 82.0)
    assert by["best"]["predicted_speedup_vs_ddp"] == pytest.approx(110.0 / 82.0)
    assert by["ddp"]["error"] == pytest.approx((105.0 - 110.0) / 105.0)
    assert by["best"]["error"] == 0.0
    assert by["best"]["refined_error"] == pytest.approx((82.0 - 84.0) / 82.0, abs=1e-6)
    assert res["correct"] is True
    md = markdown(res)
    assert "| best | runtime | 82.0 |" in md and "same parameters as `ddp`" in md
    # Optimizer state: the rank holding most, and every rank's.
    assert by["best"]["state_bytes"] == 2_000_004
    assert by["best"]["state_bytes_by_rank"] == [2_000_004, 1_999_996]
    rows = {r[0]: r for r in table_rows(res)}
    assert rows["ddp"][COLUMNS.index("state MB")] == "4.00"
    assert rows["best"][COLUMNS.index("state MB")] == "2.00"


def test_speedup_from_paired_windows_with_its_interval(tmp_path):
    """Each turn's median, paired with DDP's of the same round: the speed-up, its interval
    (at the level of the budget's looks) and the verdict; DDP's own row has none."""
    raw = raw_record()
    raw["job"].update(rounds=4, iterations=12, max_rounds=12)
    raw["runs"]["ddp"]["windows_ms"] = [100.0, 130.0, 104.0, 98.0]   # a slow spell in round 2
    raw["runs"]["best"]["windows_ms"] = [80.0, 105.0, 83.0, 79.0]
    res = summarize(raw, {"kind": "x", "short": "x", "description": "x"}, tmp_path)
    by = {r["strategy"]: r for r in res["runs"]}
    v = by["best"]["vs_ddp"]
    assert v["pairs"] == 4 and v["lo"] < by["best"]["speedup_vs_ddp"] == v["ratio"] < v["hi"]
    assert v["lo"] > 1.0 and v["verdict"] == "best faster"
    assert by["ddp"]["vs_ddp"] is None and by["ddp"]["speedup_vs_ddp"] == 1.0
    cell = {r[0]: r for r in table_rows(res)}["best"][COLUMNS.index("vs DDP")]
    assert cell == f"{v['ratio']:.2f}x ({v['lo']:.2f}–{v['hi']:.2f})"
    raw["runs"]["best"]["windows_ms"] = [80.0, 140.0, 110.0, 79.0]     # noise: no verdict
    res = summarize(raw, {"kind": "x", "short": "x", "description": "x"}, tmp_path)
    v = next(r for r in res["runs"] if r["strategy"] == "best")["vs_ddp"]
    assert v["lo"] < 1.0 < v["hi"] and v["verdict"].startswith("not distinguishable on this machine (±")


def test_a_strategy_without_prediction_has_none_not_nan(tmp_path):
    raw = raw_record()
    raw["planned"]["predicted"]["fsdp2"] = {"ms": None, "mode": "none", "blocks": None}
    raw["runs"]["fsdp2"] = {"durations_ms": [90.0, 91.0], "final_loss": 1.0, "max_param_diff": 0.0}
    res = summarize(raw, {"kind": "x", "short": "x", "description": "x"}, tmp_path)
    row = next(r for r in res["runs"] if r["strategy"] == "fsdp2")
    assert row["runner"] == "torch FSDP2" and row["speedup_vs_ddp"] == pytest.approx(105.0 / 90.5)
    assert row["predicted_ms"] is row["error"] is row["refined_ms"] is row["state_bytes"] is None
    json.dumps(res, allow_nan=False)  # valid JSON: no NaN
    assert "| fsdp2 | torch FSDP2 | 90.5 |" in markdown(res)


def test_a_parameter_difference_is_reported_as_incorrect(tmp_path):
    res = summarize(raw_record(diff=0.5), {"kind": "x", "short": "x", "description": "x"}, tmp_path)
    assert res["correct"] is False
    assert "differs by 0.5 from `ddp`" in markdown(res)


def test_compare_trace_aligns_measured_to_backward_start():
    predicted = {"traceEvents": [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "p"}},
                                 {"ph": "X", "pid": 1, "tid": 1, "name": "backward", "ts": 0.0, "dur": 5.0}]}
    begins = [0.0, 100_000.0, 200_000.0]
    measured = {"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "name": "forward", "ts": 0.0,
                                 "dur": 30_000.0},
                                {"ph": "X", "pid": 1, "tid": 2, "name": "#0", "ts": 10_000_000.0, "dur": 1.0}],
                "otherData": {"forward_begin_us": begins, "forward_end_us": [b + 30_000 for b in begins]}}
    doc = compare_trace(predicted, [measured], 100.0)
    xs = [(e["pid"], e["name"], e["ts"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (0, "backward", 0.0) in xs
    assert (1, "forward", -30_000.0) in xs        # the first iteration is picked; its forward ends at 0
    assert all(name != "#0" for _, name, _ in xs)  # far outside the window


def test_batches_differ_by_rank_and_repeat():
    inputs = (torch.zeros(2, 3), torch.tensor([[0, 7]]))
    a, b = make_batches(inputs, 0), make_batches(inputs, 1)
    assert not torch.equal(a[0][0], b[0][0]) and not torch.equal(a[0][0], a[1][0])
    assert torch.equal(a[0][0], make_batches(inputs, 0)[0][0])
    assert int(a[0][1].max()) <= 7 and a[0][1].dtype == torch.int64


def test_config_errors():
    with pytest.raises(UsbyteError, match="--strategies: 'nope'"):
        BenchConfig(model="cnn", strategies=("ddp", "nope")).job(Path("x"))
    with pytest.raises(UsbyteError, match="unknown model"):
        run_bench(BenchConfig(model="no-such-model", out_dir=Path("/nonexistent/x")))
    assert "fsdp2" in BenchConfig(model="cnn", strategies=("ddp", "fsdp2")).job(Path("x")).strategies


def test_fsdp2_is_refused_in_one_line_on_a_torch_without_it(monkeypatch):
    import usbyte_opt.bench.train as train

    monkeypatch.setattr(train, "fsdp2_missing", lambda: "fsdp2 needs torch.distributed.fsdp."
                        "fully_shard (torch >= 2.6); this is torch 2.3")
    with pytest.raises(UsbyteError, match=r"^--strategies: fsdp2 needs .*torch >= 2\.6[^\n]*$"):
        BenchConfig(model="cnn", strategies=("ddp", "fsdp2")).job(Path("x"))


def test_sharded_names_are_planned_in_sharded_mode():
    """The planner's sharded strategies (``compare(..., shard=True)``): every one a schedule in
    sharded mode, with a predicted per-rank state; the all-reduce ones as before."""
    import random

    from usbyte_opt.bench.worker import plan
    from usbyte_opt.formats import Mode
    from usbyte_opt.planning.synthetic import random_profile

    prof = random_profile(random.Random(0), 20)
    planned = plan(prof, ["ddp", *SHARDED_STRATEGIES, "no-comm"], 0.1)
    for s in SHARDED_STRATEGIES:
        assert planned.schedules[s].mode == Mode.SHARDED, s
        assert planned.predicted[s].ms > 0 and planned.predicted[s].state_bytes > 0, s
    assert planned.schedules["ddp"].mode == Mode.FENCE


def test_bandwidth_without_root_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    from usbyte_opt.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "lab-cnn", "--bandwidth", "200mbit", "-o", str(tmp_path / "out")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "needs root" in err[0]


# --------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------


def check_result(res: dict, out: Path, strategies: list[str], logs: bool = True,
                 profiled: bool = True) -> None:
    assert [r["strategy"] for r in res["runs"]] == strategies
    assert res["correct"] is True, [(r["strategy"], r["max_param_diff"]) for r in res["runs"]]
    for r in res["runs"]:
        assert r["measured_ms"] > 0 and r["iterations"] >= 2
        # fsdp2 is torch's own: nothing planned, nothing predicted.
        assert r["predicted_ms"] is None if r["strategy"] == "fsdp2" else r["predicted_ms"] > 0
        assert math.isfinite(r["final_loss"])
        assert len(r["state_bytes_by_rank"]) == res["world_size"]
        assert r["state_bytes"] == max(r["state_bytes_by_rank"]) > 0
    for name in ("report.md", "result.json", *(["profile.json"] * profiled), "raw.json",
                 *(["logs/rank0.log"] * logs)):
        assert (out / name).exists(), name
    md = (out / "report.md").read_text()
    for s in strategies:
        assert f"| {s} |" in md


def half_of(state: list[int], whole: list[int]) -> bool:
    """Every rank holds about half of ``whole``'s state (2 ranks; shard padding aside)."""
    return all(abs(s / w - 0.5) < 0.01 for s, w in zip(state, whole, strict=True))


def test_loopback_bench_json_is_pure_and_training_matches_ddp(tmp_path, sharded_bench):
    """DDP, the runtime and FSDP2 (``fsdp2``: torch's ``fully_shard``, which runs on CPU with
    gloo): training matches DDP's, FSDP2 holding half of DDP's optimizer state per rank. The
    profile is given (``--profile``: the one :func:`sharded_bench` measured of the same model
    and ranks), so the command trains and reports without profiling first."""
    out = tmp_path / "b"
    given = sharded_bench[1] / "profile.json"
    p = cli("bench", "lab-cnn", "--batch-size", "2", "--iterations", "2", "--strategies",
            "ddp,best,fsdp2", "--no-reference", "--rounds", "1", "--json", "--output-dir", str(out),
            "--profile", str(given))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)  # nothing but JSON on stdout
    assert res["network"]["kind"] == "loopback" and res["world_size"] == 2
    check_result(res, out, ["ddp", "best", "fsdp2"], profiled=False)
    assert Path(res["profile"]).resolve() == given.resolve()
    by = {r["strategy"]: r for r in res["runs"]}
    assert by["fsdp2"]["runner"] == "torch FSDP2" and by["fsdp2"]["max_param_diff"] is not None
    # The whole model's momentum on every rank under DDP and the all-reduce runtime; FSDP2's
    # DTensor state is counted by its local shards.
    assert by["best"]["state_bytes_by_rank"] == by["ddp"]["state_bytes_by_rank"]
    assert half_of(by["fsdp2"]["state_bytes_by_rank"], by["ddp"]["state_bytes_by_rank"])
    assert "| state MB |" in (out / "report.md").read_text()
    assert (out / "schedules" / "best.json").exists()
    trace = json.loads((out / "traces" / "best.compare.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert {0, 1, 2} <= pids  # predicted, rank 0 and rank 1 measured


def test_probe_times_chains_of_blocks_on_the_given_channel():
    """comm_under_compute on a real (one-rank) gloo group: each size goes out as ``parts``
    blocks through ``issue``, and a sample is the time of one block."""
    import torch.distributed as dist

    from usbyte_opt.profiler.probe import comm_under_compute

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        issued = []

        def issue(x):
            issued.append(x.numel() * 4)
            return dist.all_reduce(x, async_op=True)

        a = torch.randn(64, 64)
        probe = comm_under_compute(lambda: a @ a, [1 << 16, 1 << 18], repeats=2, issue=issue,
                                   parts=[8, 4])
    finally:
        dist.destroy_process_group()
    # Round robin over the sizes, one sample of each per pass (two passes: no time for more).
    assert issued == ([1 << 13] * 8 + [1 << 16] * 4) * 2 and probe.passes == 2
    assert probe.spread["cpu_ms_per_mb"][0] <= probe.spread["cpu_ms_per_mb"][1]
    assert [b for b, _ in probe.samples] == [1 << 13, 1 << 16]
    assert probe.cpu_ms_per_block >= 0 and probe.cpu_ms_per_mb >= 0
    assert all(ms > 0 for _, ms in probe.samples) and probe.step_alone_ms > 0


@pytest.mark.skipif(LAB_SKIP is not None, reason=f"lab: {LAB_SKIP}")
def test_short_lab_run(tmp_path):
    """One short run in the lab (one profile on the shaped link serves every strategy): the
    comm lines are measured on the link, the lab is gone afterwards; ``usbyte``, ``auto``
    (the runtime planning in the run, no profile given to it) and, when the planner registers
    it, ``ddp-tuned`` (stock DDP with the planned buckets) run beside DDP and the run without
    communication, and the report has their rows; timings are not checked."""
    from usbyte_opt.planning.strategies import load_builtin

    strategies = ("ddp", "usbyte", "auto") + (("ddp-tuned",) if "ddp-tuned" in load_builtin() else ())
    out = tmp_path / "lab"
    cfg = BenchConfig(model="lab-cnn", bandwidth="200mbit", batch_size=2, iterations=2,
                      strategies=strategies, out_dir=out, rounds=1, max_rounds=1, warmup=1,
                      profiling=ProfileOptions(warmup=1, repeats=2, comm_points=4, comm_repeats=1,
                                               stable_s=0.0, probe_points=2, probe_repeats=1),
                      timeout_s=300.0)
    res = run_bench(cfg)
    check_result(res, out, [*strategies, "no-comm"])
    assert res["network"]["kind"] == "lab" and res["network"]["tbf"]["rate_bps"] == 200_000_000
    assert res["comm"]["algbw_gbs"] < 0.05  # measured on the shaped link (25 MB/s), not loopback
    assert res["loaded_comm"] is not None and res["loaded_comm"]["algbw_gbs"] < 0.05
    assert not [n for n in list_namespaces() if n.startswith(f"usbyte-{os.getpid()}-")]
    auto = next(r for r in res["runs"] if r["strategy"] == "auto")
    assert auto["runtime_chosen"] in ("plan", "fallback")
    assert all(r["vs_lower_bound"] > 0 for r in res["runs"] if r["strategy"] in strategies)


def bench_rank(rank: int, world: int, cfg: BenchConfig):
    """One rank of a bench under torchrun's variables (``run_bench`` on this process group)."""
    return run_bench(cfg)


@pytest.fixture(scope="module")
def sharded_bench(tmp_path_factory) -> tuple[dict, Path]:
    """A bench of DDP, ``best-sharded`` and ``best-sharded-zero2`` on two ranks started as
    torchrun starts them (``run_bench`` in each): its result and output folder."""
    out = tmp_path_factory.mktemp("bench") / "s"
    names = ["ddp", "best-sharded", "best-sharded-zero2"]
    cfg = BenchConfig(model="lab-cnn", batch_size=2, iterations=2, strategies=tuple(names),
                      out_dir=out, rounds=1, max_rounds=1, warmup=1, reference=False, plot=False,
                      profiling=ProfileOptions(warmup=1, repeats=2, comm_points=4, comm_repeats=1,
                                               stable_s=0.0, probe_points=2, probe_repeats=1),
                      timeout_s=240.0)
    return values(run_local(bench_rank, 2, args=(cfg,), timeout_s=300))[0], out


def test_sharded_runtime_trainee_holds_half_the_state(sharded_bench):
    """The planner's best-sharded schedule trained on the runtime (its wrapped optimizer holds
    this rank's shard only): training matches DDP's, with about half of DDP's optimizer state
    per rank, predicted, refined and held against sharded mode's bound, the profile sweeping
    reduce-scatter and all-gather; and as ZeRO-2 (``best-sharded-zero2``): the same schedule
    and training, with no flat gradient buffer (less gradient memory at its peak)."""
    res, out = sharded_bench
    names = ["ddp", "best-sharded", "best-sharded-zero2"]
    check_result(res, out, names, logs=False)  # torchrun's ranks: no logs/
    by = {r["strategy"]: r for r in res["runs"]}
    bs, z2 = by["best-sharded"], by["best-sharded-zero2"]
    assert bs["runner"] == "runtime sharded, ZeRO-1" and bs["predicted_mode"] == "sharded"
    assert z2["runner"] == "runtime sharded, ZeRO-2" and z2["predicted_ms"] == bs["predicted_ms"]
    assert z2["max_param_diff"] == 0.0
    assert z2["gradient_kept_bytes"] == 0 < bs["gradient_kept_bytes"]
    assert z2["state_bytes_by_rank"] == bs["state_bytes_by_rank"]
    assert bs["refined_ms"] > 0 and bs["predicted_state_bytes"] > 0
    assert bs["vs_lower_bound"] == pytest.approx(bs["measured_ms"] / res["sharded_lower_bound_ms"],
                                                 rel=1e-3)
    sched = json.loads((out / "schedules" / "best-sharded.json").read_text())
    assert sched["mode"] == "sharded" and "gathers" in sched
    prof = json.loads((out / "profile.json").read_text())
    assert "reduce_scatter" in prof["comm"] and "all_gather" in prof["comm"]
    # Probed under compute beside all-reduce, for the refined sharded predictions.
    for key in ("reduce_scatter", "all_gather"):
        line = res["loaded_comm"][key]
        assert line["algbw_gbs"] > 0 and len(line["samples"]) >= 2
    assert half_of(bs["state_bytes_by_rank"], by["ddp"]["state_bytes_by_rank"])


def unseeded_factory(batch_size: int):
    """A factory that does not seed itself (random weights on every call)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, (torch.randn(batch_size, 8),), lambda out: out.pow(2).mean()


def test_trainees_of_a_factory_that_does_not_seed_start_from_the_same_weights():
    from usbyte_opt.bench.train import Trainee

    torch.manual_seed(123)
    a = Trainee("x", "local", unseeded_factory, 4, torch.device("cpu"), "sgd")
    torch.randn(100)   # whatever ran in between
    b = Trainee("y", "local", unseeded_factory, 4, torch.device("cpu"), "sgd")
    assert all(torch.equal(p, q) for p, q in zip(a.plain.parameters(), b.plain.parameters()))


def test_no_comm_time_is_the_slowest_ranks_and_coupled_runs_the_mean_over_ranks():
    from types import SimpleNamespace

    from usbyte_opt.bench.worker import REFERENCE, TORCH_DDP, _runs

    def rank(durations, windows):
        return {"durations_ms": durations, "windows_ms": windows, "max_param_diff": None,
                "losses": [1.0], "steps": len(durations), "state_bytes": 0, "runtime": None}

    fast = rank([100.0, 102.0, 98.0], [[100.0, 102.0], [98.0]])
    slow = rank([110.0, 111.0, 109.0], [[110.0, 111.0], [109.0]])
    every = [{REFERENCE: fast, TORCH_DDP: fast}, {REFERENCE: slow, TORCH_DDP: slow}]
    runs = _runs([REFERENCE, TORCH_DDP], every, 2, SimpleNamespace(predicted={}))
    # uncoupled ranks: the slowest one, as the profile states compute
    assert runs[REFERENCE]["durations_ms"] == [110.0, 111.0, 109.0]
    assert runs[REFERENCE]["windows_ms"] == [110.5, 109.0]
    assert runs[REFERENCE]["durations_by_rank_ms"] == [fast["durations_ms"], slow["durations_ms"]]
    # coupled by collectives: the mean over ranks, iteration by iteration
    assert runs[TORCH_DDP]["durations_ms"] == [105.0, 106.5, 103.5]
    assert runs[TORCH_DDP]["windows_ms"] == [105.75, 103.5]
