"""``benchmarks/gpu_check.py``'s own machinery on the CPU: a part past its limit is killed and
reported, the deadline holds, and the report renders every part's result, the CUDA-only ones
included (a report that failed on the GPU would lose the run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import load_benchmark

REPO = Path(__file__).resolve().parent.parent


check = load_benchmark("gpu_check")


def test_parts_are_ordered_by_value_and_fit_the_deadline():
    names = [n for n, _, _ in check.PARTS]
    assert names == ["imports", "tests", "sync_debug", "probes", "two_ranks", "sharded", "flow"]
    assert check.DEADLINE_S <= 360
    assert all(limit <= check.DEADLINE_S for _, limit, _ in check.PARTS)


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
                                                        "race_visible": True},
                   "parent_reads_child_weight": {"fixed": 0.0, "fix_undone": 0.0, "ok": True,
                                                 "race_visible": False}},
        "two_ranks": {"ok": True, "ranks": [
            {"diff": 0.0, "optimizer_calls_per_iteration": 8.0,
             "overlap": check._overlap_ms({"traceEvents": [
                 {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10e3, "args": {"stream": 7}},
                 {"ph": "X", "cat": "kernel", "ts": 12e3, "dur": 10e3, "args": {"stream": 7}},
                 {"ph": "X", "cat": "gpu_memcpy", "ts": 5e3, "dur": 10e3, "args": {"stream": 20}},
                 {"ph": "X", "cat": "gpu_user_annotation", "name": "usbyte_forward", "ts": 0,
                  "dur": 8e3, "args": {"stream": 7}}]})},
            {"error": "DistributedError: rank 1 died"}]},
        "sharded": {"ok": False, "nccl_one_rank": {"error": "RuntimeError: no reduce_scatter"},
                    "two_ranks": [{"sgd": {"diff": 0.0, "state_bytes": 10, "ref_state_bytes": 20,
                                           "blocks": 3, "all_gathers": 2,
                                           "memory": {"kept": 0, "backward_peak": 64},
                                           "cuda_peak_bytes": 512}},
                                  {"error": "X: y"}]},
        "flow": {"ok": False, "error": "timed out after 120 s (killed)", "part_s": 120.0},
    }
    text = check.report(res)
    assert "## tests: FAILED" in text and "- FAILED t::x" in text and "E assert 1 == 0" in text
    assert "HOST SYNC at step 3" in text and "no host sync in 13 steps" in text
    assert "NOT visible: the probe proves nothing" in text
    assert "takes bucket_cap_mb_list: True" in text
    assert "forward 8.00 ms, other streams busy 3.00 ms of it" in text   # 5..8 of 0..8
    o = res["two_ranks"]["ranks"][0]["overlap"]
    assert (o["compute_ms"], o["other_ms"], o["overlap_ms"], o["streams"]) == (20.0, 10.0, 8.0, 2)
    assert "rank 1: FAILED: DistributedError" in text and "## flow: FAILED (120 s)" in text
    assert "NCCL, world size 1, vs the plain optimizer, rank 0: FAILED: RuntimeError" in text
    assert "CUDA tensors, vs DDP, rank 0, sgd: max |sharded - reference| = 0; optimizer state " \
        "10 bytes vs 20; 3 reduce-scatters, 2 all-gathers; gradient memory kept 0 bytes, " \
        "backward peak 64; CUDA peak 512 bytes above the start" in text
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
