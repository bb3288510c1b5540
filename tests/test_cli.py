"""The optimize / simulate / schema commands, driven in-process and as a real subprocess."""

import json
import random
import subprocess
import sys

import pytest
from helpers import run_cli

from usbyte_opt.formats import load_schedule, save_profile
from usbyte_opt.planning.synthetic import random_profile


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "rand.json"
    save_profile(random_profile(random.Random(3), 30, name="rand"), p)
    return p


def test_optimize_writes_default_path_and_prints_table(capsys, profile, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "optimize", str(profile))
    assert code == 0
    for name in ("wfbp", "ddp", "mgwfbp", "bytescheduler", "usbyte", "best"):
        assert name in out
    assert "lower bound" in out
    sched = load_schedule(tmp_path / "schedules" / "rand.json")
    assert sched.strategy == "best"
    assert set(sched.predicted["baselines"]) >= {"wfbp", "ddp", "usbyte"}


def test_optimize_json_is_pure_json(capsys, profile, tmp_path):
    out_path = tmp_path / "s.json"
    code, out, _ = run_cli(capsys, "optimize", str(profile), "-o", str(out_path), "--json",
                           "--strategy", "usbyte", "--world-size", "16", "--bandwidth-gbps", "25")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) >= {"strategies", "lower_bound_ms", "chosen", "output"}
    assert doc["chosen"] == "usbyte" and doc["output"] == str(out_path)
    assert doc["world_size"] == 16
    for r in doc["strategies"].values():
        assert set(r) >= {"iteration_ms", "overlap_ms", "blocks", "solve_s"}
        assert doc["strategies"]["best"]["overlap_ms"] <= r["iteration_ms"] + 1e-9
    assert load_schedule(out_path).world_size == 16


def test_simulate_and_trace(capsys, profile, tmp_path):
    sched, trace = tmp_path / "s.json", tmp_path / "t.json"
    run_cli(capsys, "optimize", str(profile), "-o", str(sched), "--json")
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched), "--json", "--trace", str(trace))
    assert code == 0
    doc = json.loads(out)
    assert doc["iteration_ms"] == pytest.approx(doc["schedule_predicted_ms"])
    assert doc["lower_bound_ms"] <= doc["iteration_ms"]
    assert json.loads(trace.read_text())["traceEvents"]
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched), "--mode", "fence", "--json")
    assert json.loads(out)["iteration_ms"] >= doc["iteration_ms"] - 1e-9
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched))
    assert "iteration" in out and code == 0


def test_schema(capsys):
    code, out, _ = run_cli(capsys, "schema", "schedule")
    assert code == 0 and json.loads(out)["title"] == "usbyte-opt schedule"


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t[: len(t) // 2], "expected valid JSON"),
    (lambda t: t.replace('"forward_ms": ', '"forward_ms": "x", "_": ', 1), "forward_ms: expected"),
    (lambda t: t.replace('"ready_ms": ', '"ready_ms": -', 1), "ready_ms: expected a number in [0"),
    (lambda t: t.replace('"name": "layer1.weight"', '"name": "layer0.weight"'), "a unique name"),
])
def test_bad_profile_is_one_line_and_writes_nothing(capsys, profile, tmp_path, edit, expected):
    profile.write_text(edit(profile.read_text()))
    out_path = tmp_path / "never.json"
    code, out, err = run_cli(capsys, "optimize", str(profile), "-o", str(out_path))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err
    assert str(profile) in err and "Traceback" not in err
    assert not out_path.exists()


def test_schedule_of_another_model(capsys, profile, tmp_path):
    other = tmp_path / "other.json"
    save_profile(random_profile(random.Random(4), 12, name="other"), other)
    sched = tmp_path / "s.json"
    run_cli(capsys, "optimize", str(other), "-o", str(sched))
    code, _, err = run_cli(capsys, "simulate", str(profile), str(sched))
    assert code == 3 and err.startswith("error: ") and str(sched) in err


def test_unknown_strategy_and_bad_world_size(capsys, profile):
    code, _, err = run_cli(capsys, "optimize", str(profile), "--strategy", "nope")
    assert code == 2 and "expected one of" in err
    code, _, err = run_cli(capsys, "optimize", str(profile), "--world-size", "1")
    assert code == 2


def test_real_subprocess_and_debug_traceback(profile, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cmd = [sys.executable, "-m", "usbyte_opt", "simulate", str(bad), str(bad)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--debug"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "optimize" in p.stdout


def test_optimize_mode_fence_plans_best_in_fence_mode(capsys, profile, tmp_path):
    out_path = tmp_path / "f.json"
    code, out, _ = run_cli(capsys, "optimize", str(profile), "--mode", "fence", "-o", str(out_path))
    assert code == 0
    assert load_schedule(out_path).mode == "fence"
    code, _, err = run_cli(capsys, "optimize", str(profile), "--mode", "sideways",
                           "-o", str(tmp_path / "g.json"))
    assert code == 2 and "--mode" in err and "expected fence or overlap" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "g.json").exists()


def test_optimize_ddp_tuned_runs_with_torch_absent(profile, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from usbyte_opt.cli.main import main\n"
            f"main(['optimize', {str(profile)!r}, '-s', 'ddp-tuned', '--json', '-o', {str(tmp_path / 't.json')!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "bucket_cap_mb_list" in json.loads(r.stdout)
