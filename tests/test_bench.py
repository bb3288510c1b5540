"""``usbyte-opt bench``: report arithmetic, a loopback run and (as root) a short lab run.

The runs assert what must hold on any machine — training matches DDP, every file of the
report is written, ``--json`` is pure JSON, the lab is gone afterwards — never timings.
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

from usbyte_opt.bench import BenchConfig, ProfileOptions, run_bench
from usbyte_opt.bench.lab import list_namespaces
from usbyte_opt.bench.report import compare_trace, markdown, stats, summarize
from usbyte_opt.errors import UsbyteError
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
        "runs": {"ddp": {"durations_ms": list(ddp), "final_loss": 1.0, "max_param_diff": 0.0},
                 "best": {"durations_ms": list(best), "final_loss": 1.0, "max_param_diff": diff}},
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


def check_result(res: dict, out: Path, strategies: list[str]) -> None:
    assert [r["strategy"] for r in res["runs"]] == strategies
    assert res["correct"] is True, [(r["strategy"], r["max_param_diff"]) for r in res["runs"]]
    for r in res["runs"]:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["iterations"] >= 2
        assert math.isfinite(r["final_loss"])
    for name in ("report.md", "result.json", "profile.json", "raw.json", "logs/rank0.log"):
        assert (out / name).exists(), name
    md = (out / "report.md").read_text()
    for s in strategies:
        assert f"| {s} |" in md


def test_loopback_bench_json_is_pure_and_training_matches_ddp(tmp_path):
    out = tmp_path / "b"
    p = cli("bench", "lab-cnn", "--batch-size", "2", "--iterations", "2", "--strategies", "ddp,best",
            "--no-reference", "--json", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)  # nothing but JSON on stdout
    assert res["network"]["kind"] == "loopback" and res["world_size"] == 2
    check_result(res, out, ["ddp", "best"])
    assert (out / "schedules" / "best.json").exists()
    trace = json.loads((out / "traces" / "best.compare.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert {0, 1, 2} <= pids  # predicted, rank 0 and rank 1 measured


@pytest.mark.skipif(LAB_SKIP is not None, reason=f"lab: {LAB_SKIP}")
def test_short_lab_run(tmp_path):
    out = tmp_path / "lab"
    cfg = BenchConfig(model="lab-cnn", bandwidth="200mbit", batch_size=2, iterations=2,
                      strategies=("ddp", "usbyte"), out_dir=out, rounds=1, warmup=1,
                      profiling=ProfileOptions(warmup=1, repeats=2, comm_points=4, comm_repeats=1,
                                               stable_s=0.0, probe_points=2, probe_repeats=1),
                      timeout_s=240.0)
    res = run_bench(cfg)
    check_result(res, out, ["ddp", "usbyte", "no-comm"])
    assert res["network"]["kind"] == "lab" and res["network"]["tbf"]["rate_bps"] == 200_000_000
    assert res["comm"]["algbw_gbs"] < 0.05  # measured on the shaped link (25 MB/s), not loopback
    assert res["loaded_comm"] is not None and res["loaded_comm"]["algbw_gbs"] < 0.05
    assert not [n for n in list_namespaces() if n.startswith(f"usbyte-{os.getpid()}-")]


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
def test_short_lab_run_with_auto_and_stock_ddp_planned(tmp_path):
    """``auto`` (the runtime planning in the run, no profile given to it) and, when the planner
    registers it, ``ddp-tuned`` (stock DDP with the planned buckets): they run and the report
    has their rows; timings are not checked."""
    from usbyte_opt.planning.strategies import load_builtin

    strategies = ("ddp", "auto") + (("ddp-tuned",) if "ddp-tuned" in load_builtin() else ())
    out = tmp_path / "lab"
    cfg = BenchConfig(model="lab-cnn", bandwidth="200mbit", batch_size=2, iterations=2,
                      strategies=strategies, out_dir=out, rounds=1, warmup=1, reference=False,
                      profiling=ProfileOptions(warmup=1, repeats=2, comm_points=4, comm_repeats=1,
                                               stable_s=0.0, probe_points=2, probe_repeats=1),
                      timeout_s=300.0)
    res = run_bench(cfg)
    check_result(res, out, list(strategies))
    auto = next(r for r in res["runs"] if r["strategy"] == "auto")
    assert auto["runtime_chosen"] in ("plan", "fallback")
    assert all(r["vs_lower_bound"] > 0 for r in res["runs"])


def test_gpu_check_smoke_runs_its_two_rank_and_flow_parts_on_cpu(tmp_path):
    """The prepared GPU check's own code (parts 3 and 4, on the CPU; the flow at one rank)."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "max |runtime - DDP| = 0" in text and "matches DDP: True" in text


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
