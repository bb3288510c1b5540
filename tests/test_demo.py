"""``usbyte-opt demo``: the whole pipeline on two local ranks, as a user runs it, and the
explanation of how far its prediction was off.

(``--json`` purity and the files of a run are checked on ``bench``, which demo is built on.)
"""

from __future__ import annotations

import subprocess
import sys

from usbyte_opt.bench.report import EXPLAIN_COLUMNS, explain
from usbyte_opt.cli.demo import outcome


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
    won = p.stdout[p.stdout.rindex("won:"):]              # what was won, or why it cannot tell
    assert won.startswith(("won: best ran", "won: nothing: best", "won: cannot tell: best")), won
    assert last in won and "measured without communication" in " ".join(won.split())  # wrapped at 80
    assert max(len(line) for line in p.stdout.splitlines()) <= 80, p.stdout
    assert [line for line in p.stderr.splitlines() if len(line) > 100] == []   # progress, next
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


def result(vs_ddp=None, speedup=1.12, predicted=1.1, world=2, nocomm=(100.0, 104.0)):
    best = {"strategy": "best", "measured_ms": 90.0, "predicted_ms": 95.0,
            "speedup_vs_ddp": speedup, "predicted_speedup_vs_ddp": predicted, "vs_ddp": vs_ddp}
    out = [{"strategy": "ddp", "measured_ms": 100.0, "predicted_ms": 104.5}, best]
    if nocomm:
        out.append({"strategy": "no-comm", "measured_ms": nocomm[0], "predicted_ms": nocomm[1]})
    return {"world_size": world, "single_rank": None, "runs": out}


def paired(ratio, lo, hi, verdict="best faster"):
    return {"ratio": ratio, "lo": lo, "hi": hi, "pairs": 6, "confidence": 0.95, "verdict": verdict}


def test_the_last_line_says_what_was_won_with_its_interval_and_the_prediction():
    lines = outcome(result(paired(1.12, 1.05, 1.19)))
    assert lines == ["won: best ran 1.12x DDP's speed (95% CI 1.05–1.19x, 6 rounds), predicted "
                     "1.10x (profiled compute 104.0 ms, +4% off the 100.0 ms measured without "
                     "communication)"]


def test_a_strategy_slower_than_ddp_won_nothing():
    line = outcome(result(paired(0.9, 0.85, 0.95, "DDP faster"), nocomm=None))[0]
    assert line == ("won: nothing: best ran 0.90x DDP's speed, slower than DDP (95% CI "
                    "0.85–0.95x, 6 rounds), predicted 1.10x")


def test_a_noisy_machine_cannot_tell_and_says_by_how_much():
    v = paired(1.03, 0.95, 1.12, "not distinguishable on this machine (±8%)")
    assert outcome(result(v, nocomm=None)) == [
        "won: cannot tell: best against DDP is not distinguishable on this machine (±8%); "
        "measured 1.03x DDP's speed, predicted 1.10x"]
    v = paired(1.03, 0.95, 1.12, "")   # no ±X% in the verdict: the interval's half-width
    assert "(±9%)" in outcome(result(v, nocomm=None))[0]


def test_too_few_rounds_for_an_interval():
    line = outcome(result(None, speedup=1.2, predicted=None, nocomm=None))[0]
    assert line == ("won: cannot tell: best ran 1.20x DDP's speed in too few rounds for an "
                    "interval (rerun with more --iterations)")


def test_world_size_1_has_no_communication_to_win():
    assert outcome(result(paired(1.0, 0.9, 1.1), world=1))[0].startswith(
        "won: nothing to win at world size 1: no communication to schedule")


def test_without_a_ddp_run_there_is_nothing_to_hold_it_against():
    res = result(paired(1.12, 1.05, 1.19))
    res["runs"] = [r for r in res["runs"] if r["strategy"] != "ddp"]
    assert outcome(res) == ["won: cannot tell: no DDP run to hold the strategies against (add ddp "
                            "to --strategies)"]
