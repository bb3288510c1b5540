"""``usbyte-opt demo``: the whole pipeline on two local ranks, as a user runs it, and the
explanation of how far its prediction was off.

(``--json`` purity and the files of a run are checked on ``bench``, which demo is built on.)
"""

from __future__ import annotations

import subprocess
import sys

from usbyte_opt.bench.report import EXPLAIN_COLUMNS, explain


def test_demo_prints_predicted_measured_and_what_the_error_means(tmp_path):
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "demo", "--model", "lab-cnn",
                        "--batch-size", "2", "--iterations", "2"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    for word in ("ddp", "best", "no-comm", "measured ms", "predicted ms", "training matches ddp",
                 "how far the prediction was off", "compute ms", "comm ms"):
        assert word in p.stdout, word
    assert "dominates the error" in p.stdout
    last = p.stdout.strip().splitlines()[-1]
    verdict = p.stdout[p.stdout.rindex("verdict"):]        # the last paragraph: best against DDP
    assert verdict.startswith(("verdict holds: best", "verdict changes: best",
                               "verdict: best against DDP: not distinguishable on this machine (±")), verdict
    assert "95% CI" in verdict and last in verdict
    assert max(len(line) for line in p.stdout.splitlines()) <= 100, p.stdout
    assert list(tmp_path.iterdir()) == []  # without --output-dir nothing is written


def runs(ddp, best, nocomm=None):
    out = [{"strategy": "ddp", "measured_ms": ddp[0], "predicted_ms": ddp[1]},
           {"strategy": "best", "measured_ms": best[0], "predicted_ms": best[1]}]
    if nocomm:
        out.append({"strategy": "no-comm", "measured_ms": nocomm[0], "predicted_ms": nocomm[1]})
    return {"runs": out}


def test_explain_splits_the_error_into_compute_and_communication():
    rows, lines = explain(runs((120.0, 100.0), (104.0, 90.0), (88.0, 75.0)))
    assert len(rows[0]) == len(EXPLAIN_COLUMNS)
    assert rows[0] == ["ddp", "120.0", "100.0", "+20.0 (+17%)", "+13.0", "+7.0"]
    assert rows[2][0] == "no-comm" and rows[2][4] == "+13.0"
    assert lines[0].startswith("compute dominates the error") and "busier or slower" in lines[0]
    assert lines[1].startswith("verdict holds: best predicted 1.11x")


def test_explain_communication_dominating_and_a_verdict_that_changes():
    rows, lines = explain(runs((100.0, 100.0), (110.0, 90.0), (70.0, 71.0)))
    assert rows[1][5] == "+21.0"
    assert lines[0].startswith("communication dominates the error: up to +21.0 ms")
    assert lines[1].startswith("verdict changes: best predicted 1.11x DDP's speed (faster than DDP), "
                               "measured 0.91x (slower than DDP)")


def test_explain_without_a_reference_run_says_so():
    rows, lines = explain(runs((100.0, 100.0), (99.5, 99.0)))
    assert rows[1][4:] == ["—", "—"]
    assert lines[0].startswith("no run without communication")
    assert lines[1].startswith("verdict holds: best") and "about as fast as DDP" in lines[1]


def test_explain_uses_the_paired_interval_when_measured():
    res = runs((120.0, 100.0), (104.0, 90.0), (88.0, 75.0))
    best = res["runs"][1]
    best["vs_ddp"] = {"ratio": 1.15, "lo": 1.08, "hi": 1.22, "pairs": 4, "confidence": 0.95,
                      "verdict": "best faster"}
    lines = explain(res)[1]
    assert lines[-1] == ("verdict holds: best predicted 1.11x DDP's speed, measured 1.15x (95% CI "
                         "1.08–1.22x, 4 rounds): faster than DDP either way")
    best["vs_ddp"] = {**best["vs_ddp"], "lo": 0.9, "verdict": "not distinguishable on this machine (±15%)"}
    lines = explain(res)[1]
    assert lines[-1].startswith("verdict: best against DDP: not distinguishable on this machine (±15%); "
                                "predicted 1.11x DDP's speed, measured 1.15x (95% CI 0.90–1.22x")


def test_a_time_below_the_lower_bound_is_called_noise():
    res = runs((120.0, 100.0), (74.0, 90.0), (70.0, 75.0))
    res["runs"][1]["vs_lower_bound"] = 0.9
    res["compute_scale"] = 0.93
    lines = explain(res)[1]
    assert any(x.startswith("best measured 74.0 ms, 0.90x the lower bound: below the lower bound: "
                            "timing noise") for x in lines)
