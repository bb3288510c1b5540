"""How far `usbyte-opt demo`'s predictions are off on this machine, run after run.

    python benchmarks/demo_prediction.py                 # 5 runs of the demo (cnn, 2 CPU ranks)
    python benchmarks/demo_prediction.py --runs 3 --model lab-cnn
    python benchmarks/demo_prediction.py --render        # the .md again from the committed .json

Each run is `usbyte-opt demo --json --output-dir DIR` as a user types it (profile, plan, then
DDP, `best` and `no-comm` in interleaved turns). Per run the table gives the profiled compute
against the `no-comm` run (the compute the prediction assumed), DDP's and `best`'s measured
and predicted times, and `best`'s predicted speedup over DDP against the one measured side by
side (with its 95% interval). Beside `best`'s prediction, the same schedule is scored under the
update rule the planner used on every profile before it followed the runtime's
(`UpdateRule.AVAIL`: each update a delay of its tensor's availability, where the runtime on
CPU ranks runs the step on the training thread at the forward's gates, `UpdateRule.GATE`).
Written to `benchmarks/demo_prediction.md` and `.json`.

What to look for: `no-comm`'s error (compute) and the speedup's error stay within 10%; the
absolute errors of DDP and `best` carry the loopback all-reduce's drift between the profile
and training, which this 2-core machine does not hold still (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NAME = "demo_prediction"


def one_run(model: str, out: Path) -> dict:
    """One demo run and what it predicted and measured."""
    from usbyte_opt.formats import load_profile, load_schedule
    from usbyte_opt.planning.problem import Problem, UpdateRule
    from usbyte_opt.planning.simulate import simulate

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "usbyte_opt", "demo", "--model", model, "--json",
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"demo failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout)
    runs = {r["strategy"]: r for r in res["runs"]}
    prof = load_profile(out / "profile.json")
    pb = Problem.from_profile(prof)
    best = runs["best"]
    avail = simulate(pb.with_update_rule(UpdateRule.AVAIL), load_schedule(out / "schedules" / "best.json"),
                     best["predicted_mode"]).iteration_ms
    v = best.get("vs_ddp") or {}
    row = {"load": [load0, os.getloadavg()[0]], "wall_s": time.perf_counter() - t0,
           "update_rule": str(pb.update_rule),
           "alpha_ms": prof.comm.alpha_ms, "algbw_gbs": prof.comm.algbw_gbs,
           "cpu_ms_per_block": prof.comm.cpu_ms_per_block, "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
           "best_avail_ms": avail, "best_avail_error": (best["measured_ms"] - avail) / best["measured_ms"],
           "speedup": best.get("speedup_vs_ddp"), "speedup_lo": v.get("lo"), "speedup_hi": v.get("hi"),
           "predicted_speedup": best.get("predicted_speedup_vs_ddp"),
           "predicted_speedup_avail": runs["ddp"]["predicted_ms"] / avail}
    for s in ("ddp", "best", "no-comm"):
        r = runs[s]
        row[s] = {k: r[k] for k in ("measured_ms", "predicted_ms", "error", "predicted_mode", "blocks")}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--render", action="store_true",
                    help="rewrite the .md from the committed .json; no runs")
    a = ap.parse_args()
    if a.render:
        old = json.loads((HERE / f"{NAME}.json").read_text())
        write(old["model"], old["runs"], old["when"])
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            r = one_run(a.model, Path(tmp) / f"r{i}")
            rows.append(r)
            print(f"run {i + 1}: compute {100 * r['no-comm']['error']:+.1f}%, ddp "
                  f"{100 * r['ddp']['error']:+.1f}%, best {100 * r['best']['error']:+.1f}% "
                  f"(AVAIL {100 * r['best_avail_error']:+.1f}%), speedup predicted "
                  f"{r['predicted_speedup']:.2f}x measured {r['speedup']:.2f}x "
                  f"(load {r['load'][0]:.1f}, {r['wall_s']:.0f} s)", flush=True)
    write(a.model, rows, time.strftime("%Y-%m-%d %H:%M"))


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def write(model: str, rows: list[dict], when: str) -> None:
    """Write demo_prediction.json and .md from the runs."""
    def speed_err(r: dict, key: str) -> float | None:
        return None if not r["speedup"] or not r[key] else r[key] / r["speedup"] - 1.0

    summary = {}
    for name, get in (("compute (no-comm)", lambda r: r["no-comm"]["error"]),
                      ("ddp", lambda r: r["ddp"]["error"]), ("best", lambda r: r["best"]["error"]),
                      ("best, same schedule under AVAIL", lambda r: r["best_avail_error"]),
                      ("speedup over DDP", lambda r: speed_err(r, "predicted_speedup")),
                      ("speedup over DDP under AVAIL", lambda r: speed_err(r, "predicted_speedup_avail"))):
        vals = [x for x in map(get, rows) if x is not None]
        summary[name] = {"min": min(vals), "max": max(vals),
                         "within_10pct": sum(abs(x) <= 0.10 for x in vals), "runs": len(vals)}
    doc = {"model": model, "runs": rows, "summary": summary, "when": when}
    (HERE / f"{NAME}.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# How far `usbyte-opt demo`'s predictions are off: `{model}`, 2 CPU ranks", "",
             f"Written by `python benchmarks/demo_prediction.py --model {model} --runs {len(rows)}` "
             f"({when}, {os.cpu_count()} cores, shared machine: load average at each run's "
             "start below). Error = (measured − predicted) / measured; compute: the profile "
             "against the side-by-side `no-comm` run; speedup: `best`'s predicted speedup over "
             "DDP against the one measured side by side (95% interval), error = predicted / "
             "measured − 1. AVAIL: the same `best` schedule scored with each update as a delay "
             "of its tensor's availability, the planner's rule before it followed the "
             "runtime's on CPU ranks (GATE).", "",
             "| run | load | compute | DDP ms (error) | best ms (error) | best mode, blocks "
             "| best under AVAIL | speedup measured [95%] | predicted | under AVAIL |",
             "|---:|---:|---:|---|---|---|---:|---|---:|---:|"]
    for i, r in enumerate(rows):
        d, b = r["ddp"], r["best"]
        lo, hi = r["speedup_lo"], r["speedup_hi"]
        ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
        lines.append(
            f"| {i + 1} | {r['load'][0]:.1f} | {_pct(r['no-comm']['error'])} | "
            f"{d['measured_ms']:.1f} / {d['predicted_ms']:.1f} ({_pct(d['error'])}) | "
            f"{b['measured_ms']:.1f} / {b['predicted_ms']:.1f} ({_pct(b['error'])}) | "
            f"{b['predicted_mode']}, {b['blocks']} | {_pct(r['best_avail_error'])} | "
            f"{r['speedup']:.2f}x{ci} | {r['predicted_speedup']:.2f}x | "
            f"{r['predicted_speedup_avail']:.2f}x |")
    lines += ["", "| error of | min | max | runs within ±10% |", "|---|---:|---:|---:|"]
    for k, v in summary.items():
        lines.append(f"| {k} | {_pct(v['min'])} | {_pct(v['max'])} | {v['within_10pct']} of {v['runs']} |")
    lines.append("")
    (HERE / f"{NAME}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
