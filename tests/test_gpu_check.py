"""``benchmarks/gpu_check.py``'s own machinery on the CPU: a part past its limit is killed and
reported, the deadline holds, the report renders every part's result, the CUDA-only ones
included (a report that failed on the GPU would lose the run), comparisons pass only within
their control, and everything but the report goes into one archive."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

from helpers import load_benchmark

REPO = Path(__file__).resolve().parent.parent


check = load_benchmark("gpu_check")


def test_parts_are_ordered_by_value_and_fit_the_deadline():
    names = [n for n, _, _ in check.PARTS]
    assert names == ["imports", "tests", "sync_debug", "probes", "two_ranks", "sharded", "flow",
                     "compiled", "host_ratio"]
    assert check.DEADLINE_S <= 420   # a device call of 440 s (docs/gpu.md)
    assert all(limit <= check.DEADLINE_S for _, limit, _ in check.PARTS)
    # Each host_ratio model fits the part's limit; transformer is the flow part's run.
    assert [m for m, _, _ in check.HOST_MODELS] == ["transformer", "bert-large", "gpt2", "resnet50"]
    assert dict((m, b) for m, b, _ in check.HOST_MODELS) == {"transformer": 8, "bert-large": 8, "gpt2": 4,
                                                             "resnet50": 64}
    assert all(check.HOST_MIN_S <= limit <= dict((n, lim) for n, lim, _ in check.PARTS)["host_ratio"]
               for _, _, limit in check.HOST_MODELS)
    # The compiled part: gpt2 and resnet50 under inductor on the 16x25gbit link, within its limit.
    assert [(m, b) for m, b, _ in check.COMPILED_MODELS] == [("gpt2", 4), ("resnet50", 64)]
    assert check.COMPILED_LINK == "16x25gbit"
    assert sum(lim for _, _, lim in check.COMPILED_MODELS) <= dict((n, lim) for n, lim, _ in check.PARTS)["compiled"]


def test_a_comparison_passes_only_within_its_control():
    assert check.verdict(0.0, 0.0) and check.verdict(1e-6, 1e-6) and check.verdict(1e-7, 1e-6)
    assert not check.verdict(1e-7, 0.0) and not check.verdict(2e-4, 1e-4)
    text = check._cmp(1e-4, 0.0, "runtime", "DDP")
    assert "max |runtime - DDP| = 0.0001, control max |DDP - DDP| = 0: DIFFERS" in text
    assert check._cmp(1e-4, 1.4e-4, "runtime", "DDP").endswith(": ok")


def test_the_children_run_deterministic():
    env = check._child_env()
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["USBYTE_BENCH_DETERMINISTIC"] == "1"


def test_a_part_past_its_limit_is_killed_and_reported(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "logs").mkdir()
    r = check.run_part("imports", 0.3, tmp_path, smoke=True)   # importing torch takes longer
    assert not r["ok"] and "timed out after 0 s (killed)" in r["error"]
    assert r["part_s"] < 30


def test_the_deadline_stops_the_run_at_the_import_check(tmp_path, capsys):
    rc = check.main(["--smoke", "--deadline", "1", "--out", str(tmp_path)])
    assert rc == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "deadline passed" in res["imports"]["error"] and "tests" not in res
    assert "## imports: FAILED" in (tmp_path / "gpu_check.md").read_text()
    # The report, its JSON and the archive: nothing else under --out.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md",
                                                          check.ARCHIVE]


def test_everything_written_goes_into_one_archive(tmp_path):
    """The work folder (logs, parts, a bench's folder, a trace) packed beside the report, a
    file too large left out and named; refreshed in place."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    for rel, size in (("logs/flow.log", 10), ("parts/flow.json", 20), ("bench/traces/best.json", 30),
                      ("host_ratio/gpt2/logs/rank0.log", 5), ("trace_two_ranks.json", 40)):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("x" * size)
    check._write(out, {"when": "now", "smoke": True})
    big = work / "huge.json"
    big.write_bytes(b"0" * (check.ARCHIVE_FILE_MAX + 1))
    info = check.pack(out, work)
    assert info["files"] == 7 and info["left_out"] == ["huge.json (6.0 MiB)"]
    with tarfile.open(out / check.ARCHIVE) as tar:
        names = set(tar.getnames())
        assert {"gpu_check/logs/flow.log", "gpu_check/parts/flow.json", "gpu_check/bench/traces/best.json",
                "gpu_check/host_ratio/gpt2/logs/rank0.log", "gpu_check/trace_two_ranks.json",
                "gpu_check/gpu_check.md", "gpu_check/gpu_check.json", "gpu_check/left_out.txt"} == names
        assert tar.extractfile("gpu_check/left_out.txt").read().decode().startswith("huge.json")
    big.unlink()
    (work / "logs" / "host_ratio.log").write_text("later")
    assert check.pack(out, work)["files"] == 8
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", check.ARCHIVE]


def test_report_renders_every_part_as_the_gpu_would_give_it(tmp_path):
    res = {
        "when": "now", "smoke": False,
        "imports": {"ok": True, "torch": "2.11.0+cu130", "gpu": "NVIDIA H200", "python": "3.12.3",
                    "ddp_bucket_cap_mb_list": True,
                    "modules": {"torch": {"version": "2.11.0", "from": "/x"},
                                "pydantic": {"error": "ModuleNotFoundError: no"}}, "part_s": 4.0},
        "tests": {"ok": False, "summary": "1 failed, 9 passed", "failures": ["FAILED t::x"],
                  "log_tail": "boom\nE assert 1 == 0"},
        "sync_debug": {"ok": False, "overlap/adamw": {"ok": True, "steps": 13},
                       "fence/fused_adamw_grad_scaler": {"ok": False, "where": "step 3",
                                                         "error": "called a synchronizing CUDA op"}},
        "probes": {"ok": True, "found_inf_kept_alive": {"fixed": 0.0, "fix_undone": 0.01, "ok": True,
                                                        "control": 0.0, "race_visible": True},
                   "parent_reads_child_weight": {"fixed": 0.0, "fix_undone": 0.0, "ok": True,
                                                 "control": 0.0, "race_visible": False},
                   "deterministic": ["cudnn.deterministic"],
                   "nondeterministic_ops": ["adaptive_avg_pool2d_backward_cuda does not have a "
                                            "deterministic implementation"]},
        "two_ranks": {"ok": True, "planted_seen": True, "ranks": [
            {"diff": 0.0, "control": 0.0, "planted": 3e-5, "planted_seen": True, "ok": True,
             "optimizer_calls_per_iteration": 8.0,
             "overlap": check._overlap_ms({"traceEvents": [
                 {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10e3, "args": {"stream": 7}},
                 {"ph": "X", "cat": "kernel", "ts": 12e3, "dur": 10e3, "args": {"stream": 7}},
                 {"ph": "X", "cat": "gpu_memcpy", "ts": 5e3, "dur": 10e3, "args": {"stream": 20}},
                 {"ph": "X", "cat": "gpu_user_annotation", "name": "usbyte_forward", "ts": 0,
                  "dur": 8e3, "args": {"stream": 7}}]})},
            {"error": "DistributedError: rank 1 died"}]},
        "sharded": {"ok": False, "nccl_one_rank": {"error": "RuntimeError: no reduce_scatter"},
                    "two_ranks": [{"sgd": {"diff": 0.0, "control": 0.0, "state_bytes": 10,
                                           "ref_state_bytes": 20, "blocks": 3, "all_gathers": 2,
                                           "memory": {"kept": 0, "backward_peak": 64},
                                           "cuda_peak_bytes": 512},
                                   "adamw": {"diff": 2e-6, "control": 0.0, "state_bytes": 10,
                                             "ref_state_bytes": 20, "blocks": 3, "all_gathers": 2},
                                   "nondeterministic_ops": []},
                                  {"error": "X: y"}]},
        "flow": {"ok": False, "error": "timed out after 120 s (killed)", "part_s": 120.0},
        "host_ratio": {"ok": True, "goal": 0.98, "models": {
            "transformer (batch 8)": {"ok": True, "source": "the flow part's run",
                                      "measured_ms": {"ddp": 10.0, "best": 10.1},
                                      "runtime_over_ddp": 1.01, "meets_goal": True, "matches_ddp": True,
                                      "max_param_diff": 0.0, "param_tolerance": 1e-4},
            "bert-large (batch 8)": {"ok": True, "measured_ms": {"ddp": 50.0, "best": 52.0},
                                     "runtime_over_ddp": 1.04, "meets_goal": False, "matches_ddp": True,
                                     "max_param_diff": 0.0, "param_tolerance": 1e-4, "command": "python3 -m x",
                                     "vs_ddp": {"ratio": 0.96, "lo": 0.95, "hi": 0.97, "verdict": "x"}},
            "gpt2 (batch 4)": {"ok": False, "error": "timed out after 70 s (killed)", "stderr": "boom"},
            "resnet50 (batch 64)": {"skipped": "skipped: no time left (12 s before the part's limit)"}}},
        "compiled": {"ok": True, "backend": "inductor", "link": "16x25gbit", "models": {
            "gpt2 (batch 4)": {"ok": True, "measured_ms": {"ddp": 40.0, "best": 32.0},
                               "runtime_over_ddp": 0.8, "predicted_speedup": 1.3, "vs_lower_bound": 1.02,
                               "matches_ddp": True, "max_param_diff": 1e-6, "param_tolerance": 1e-4,
                               "command": "python3 -m usbyte_opt bench gpt2",
                               "compile": {"backend": "inductor", "split": {"best": {
                                   "graphs": 1, "pieces": 6, "gated": True, "unsplit": False}}}},
            "resnet50 (batch 64)": {"skipped": "skipped: no time left (3 s before the part's limit)"}}},
        "archive": {"files": 40, "bytes": 3 << 20, "left_out": ["trace_two_ranks.json (20.0 MiB)"]},
    }
    text = check.report(res)
    assert "## tests: FAILED" in text and "- FAILED t::x" in text and "E assert 1 == 0" in text
    assert "HOST SYNC at step 3" in text and "no host sync in 13 steps" in text
    assert "NOT visible: the probe proves nothing" in text
    assert "found_inf_kept_alive: max |runtime - plain| = 0, control max |plain - plain| = 0: ok; " \
        "with the fix undone 0.01 (race visible)" in text
    assert "ops without a deterministic implementation (warned, run anyway): adaptive_avg_pool2d" in text
    assert "rank 0: max |runtime - DDP| = 0, control max |DDP - DDP| = 0: ok" in text
    assert "planted difference (one gradient x1.0001 at step 3), rank 0: max |planted - DDP| = 3e-05: seen" \
        in text
    assert "rank 0, adamw: max |sharded - reference| = 2e-06, control max |reference - reference| = 0: " \
        "DIFFERS" in text
    assert "- transformer (batch 8) (the flow part's run): DDP 10.0 ms, runtime (best) 10.1 ms: " \
        "runtime/DDP 1.010, 0.990x DDP's speed; goal >= 0.98x: met (a measurement)" in text
    assert "- bert-large (batch 8): DDP 50.0 ms, runtime (best) 52.0 ms: runtime/DDP 1.040, 0.962x " \
        "DDP's speed, 95% interval of DDP's speed 0.950-0.970x; goal >= 0.98x: NOT met (a measurement)" \
        in text
    assert "- gpt2 (batch 4): FAILED: timed out after 70 s (killed)" in text and "stderr: boom" in text
    assert "Evidence: gpu_check_evidence.tar.gz, 40 files, 3.0 MiB; left out (too large): " \
        "trace_two_ranks.json" in text
    assert "## compiled: ok" in text and "`--compile inductor` on the emulated link 16x25gbit" in text
    assert "- gpt2 (batch 4): compiled DDP 40.0 ms, compiled best 32.0 ms: 1.250x DDP, predicted 1.3x; " \
        "best at 1.02x the bound; 6 pieces in 1 graph(s); matches DDP: True" in text
    assert text.count("- resnet50 (batch 64): skipped: no time left") == 2   # compiled, host_ratio
    assert "takes bucket_cap_mb_list: True" in text
    assert "forward 8.00 ms, other streams busy 3.00 ms of it" in text   # 5..8 of 0..8
    o = res["two_ranks"]["ranks"][0]["overlap"]
    assert (o["compute_ms"], o["other_ms"], o["overlap_ms"], o["streams"]) == (20.0, 10.0, 8.0, 2)
    assert "rank 1: FAILED: DistributedError" in text and "## flow: FAILED (120 s)" in text
    assert "NCCL, world size 1, vs the plain optimizer, rank 0: FAILED: RuntimeError" in text
    assert "CUDA tensors, vs DDP, rank 0, sgd: max |sharded - reference| = 0, control max " \
        "|reference - reference| = 0: ok; optimizer state 10 bytes vs 20; 3 reduce-scatters, " \
        "2 all-gathers; gradient memory kept 0 bytes, backward peak 64; CUDA peak 512 bytes above " \
        "the start" in text
    # A result the report does not foresee still leaves a file.
    (tmp_path / "parts").mkdir()
    out = check._write(tmp_path, {"imports": {"ok": True, "modules": 3}})
    assert "report failed" in out and (tmp_path / "gpu_check.json").exists()


def test_children_get_an_absolute_pythonpath_with_the_tree_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "rel/site")
    env = check._child_env()
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(REPO) and all(Path(p).is_absolute() for p in paths)
    assert env["CUBLAS_WORKSPACE_CONFIG"]
    assert check._python()[0] == sys.executable


def test_host_ratio_skips_a_model_when_no_time_is_left(tmp_path, monkeypatch):
    """Past the part's deadline every model but the flow part's is skipped, saying so, and
    the result so far is written after each model."""
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "flow.json").write_text(json.dumps(
        {"ok": True, "measured_ms": {"ddp": 2.0, "best": 1.9}, "runtime_over_ddp": 0.95,
         "meets_goal": True, "matches_ddp": True}))
    monkeypatch.setattr(check, "_PART_DEADLINE", 0.0)
    res = check.part_host_ratio(str(tmp_path), smoke=False)
    models = res["models"]
    assert models["transformer (batch 8)"]["source"] == "the flow part's run"
    assert all(models[k]["skipped"].startswith("skipped: no time left")
               for k in ("bert-large (batch 8)", "gpt2 (batch 4)", "resnet50 (batch 64)"))
    assert res["ok"] and json.loads((tmp_path / "parts" / "host_ratio.json").read_text()) == res


def test_a_planted_difference_not_seen_fails_the_part(monkeypatch):
    """two_ranks passes only when the runtime is within the control and the planted
    difference is seen on every rank."""
    import usbyte_opt.launcher as launcher

    class Res:
        ok, error_type, error, trace = True, None, None, None

        def __init__(self, value):
            self.value = value

    def ranks(*values):
        monkeypatch.setattr(launcher, "run_local", lambda *a, **k: [Res(v) for v in values])
        return check.part_two_ranks("unused", smoke=True)

    seen = {"diff": 0.0, "control": 0.0, "planted": 1e-4, "ok": True, "planted_seen": True}
    assert ranks(seen, seen)["ok"]
    r = ranks(seen, dict(seen, planted=0.0, planted_seen=False))
    assert not r["ok"] and "planted difference was not seen" in r["error"]
    assert not ranks(seen, dict(seen, diff=1e-6, ok=False))["ok"]


def test_a_bench_past_its_limit_is_killed_with_its_children(tmp_path, monkeypatch):
    """A bench that outlives its limit is killed, the processes it started too (its ranks),
    and reported as timed out."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    monkeypatch.setattr(check, "_python", lambda: [sys.executable, "-c", code])
    (tmp_path / "logs").mkdir()
    t0 = time.monotonic()
    r = check._bench("mlp", 2, True, str(tmp_path / "b"), tmp_path / "logs" / "b.log", 3.0)
    assert time.monotonic() - t0 < 30
    assert not r["ok"] and r["error"] == "timed out after 3 s (killed)"
    pid = int(pidfile.read_text())
    for _ in range(50):   # killed (gone, or a zombie until its new parent reaps it)
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the bench's child outlived it")
