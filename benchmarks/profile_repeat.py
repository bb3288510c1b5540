"""Profiles that do not flip: the same model profiled several times, and optimize's verdict.

    python benchmarks/profile_repeat.py                 # 5 runs of `cnn` on 2 CPU ranks
    python benchmarks/profile_repeat.py --runs 3 --model lab-cnn

Each run is `usbyte-opt profile MODEL --nproc-per-node 2 --device cpu` as a user types it
(the sweep and the probe repeat until stable, within `--stable-s`), then the planner as
`usbyte-opt optimize` runs it. The table gives each run's fitted numbers with the spread the
profile states for them (5th-95th percentiles of bootstrap refits), the verdict (the mode of
`best` and whether it beats DDP's buckets), and the machine's load. Written to
`benchmarks/profile_repeat.md` and `.json`.

What to look for: the verdicts are the same in every run, and each fitted number's range over
the runs is within the spread a single profile states for it.
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


def one_run(model: str, out: Path, stable_s: float) -> dict:
    from usbyte_opt.formats import load_profile
    from usbyte_opt.planning.planner import compare

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "usbyte_opt", "profile", model, "--nproc-per-node", "2",
           "--device", "cpu", "-o", str(out), "--stable-s", str(stable_s)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"profile failed: {proc.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    prof = load_profile(out)
    rep = compare(prof)
    best, ddp = rep.results["best"], rep.results["ddp"]
    c = prof.comm
    sweep = prof.meta.get("comm_sweep", {})
    probe = prof.meta.get("cpu_probe", {})
    return {
        "wall_s": wall, "load": [load0, os.getloadavg()[0]],
        "alpha_ms": c.alpha_ms, "algbw_gbs": c.algbw_gbs,
        "cpu_ms_per_block": c.cpu_ms_per_block, "cpu_ms_per_mb": c.cpu_ms_per_mb,
        "spread": {**sweep.get("spread", {}), **probe.get("spread", {})},
        "sweep_samples": [len(r) for r in sweep.get("raw_ms", [])],
        "probe_passes": probe.get("passes"),
        "forward_ms": prof.forward_ms, "backward_ms": prof.backward_ms,
        "best_mode": best.mode, "best_ms": best.iteration_ms, "ddp_ms": ddp.iteration_ms,
        "beats_ddp": best.iteration_ms < 0.98 * ddp.iteration_ms,
        "lower_bound_ms": rep.lower_bound_ms,
        "warnings": prof.meta.get("warnings", []),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stable-s", type=float, default=20.0)
    ap.add_argument("--render", action="store_true",
                    help="rewrite the .md from the committed .json; no runs")
    a = ap.parse_args()
    if a.render:
        old = json.loads((HERE / "profile_repeat.json").read_text())
        a.model, a.runs = old["model"], len(old["runs"])
        write(a, old["runs"], old["when"])
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            r = one_run(a.model, Path(tmp) / f"p{i}.json", a.stable_s)
            runs.append(r)
            print(f"run {i + 1}: alpha {r['alpha_ms']:.3f} ms, algbw {r['algbw_gbs']:.4f} GB/s, "
                  f"cpu {r['cpu_ms_per_block']:.3f} ms/block + {r['cpu_ms_per_mb']:.3f} ms/MB; "
                  f"best {r['best_mode']} {r['best_ms']:.1f} ms vs ddp {r['ddp_ms']:.1f} ms "
                  f"(load {r['load'][0]:.1f}); {r['wall_s']:.0f} s", flush=True)
    write(a, runs, time.strftime("%Y-%m-%d %H:%M"))


def write(a: argparse.Namespace, runs: list[dict], when: str) -> None:
    """Write profile_repeat.json and .md from the runs."""
    keys = ("alpha_ms", "algbw_gbs", "cpu_ms_per_block", "cpu_ms_per_mb")
    summary = {}
    for k in keys:
        vals = [r[k] for r in runs]
        widths = [r["spread"][k][1] - r["spread"][k][0] for r in runs if k in r["spread"]]
        summary[k] = {"min": min(vals), "max": max(vals), "range": max(vals) - min(vals),
                      "median_stated_spread": sorted(widths)[len(widths) // 2] if widths else None}
    verdicts = {(r["best_mode"], r["beats_ddp"]) for r in runs}
    res = {"model": a.model, "runs": runs, "summary": summary,
           "same_verdict": len(verdicts) == 1, "when": when}
    (HERE / "profile_repeat.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Repeated profiles of `{a.model}` (2 CPU ranks)", "",
             f"Written by `python benchmarks/profile_repeat.py --model {a.model} --runs {a.runs}` "
             f"({res['when']}, {os.cpu_count()} cores, shared machine: load averages per run "
             "below). Each run is `usbyte-opt profile` as a user runs it, then the planner as "
             "`optimize` runs it.", "",
             "| run | load | alpha ms [stated spread] | algbw GB/s [spread] | cpu ms/block [spread] "
             "| cpu ms/MB [spread] | best (mode) | DDP | verdict |",
             "|---:|---:|---|---|---|---|---:|---:|---|"]

    def fmt(r: dict, k: str, p: int) -> str:
        lo_hi = r["spread"].get(k)
        sp = f" [{lo_hi[0]:.{p}f}, {lo_hi[1]:.{p}f}]" if lo_hi else ""
        return f"{r[k]:.{p}f}{sp}"
    for i, r in enumerate(runs):
        lines.append(f"| {i + 1} | {r['load'][0]:.1f} | {fmt(r, 'alpha_ms', 3)} | "
                     f"{fmt(r, 'algbw_gbs', 4)} | {fmt(r, 'cpu_ms_per_block', 3)} | "
                     f"{fmt(r, 'cpu_ms_per_mb', 3)} | {r['best_ms']:.1f} ({r['best_mode']}) | "
                     f"{r['ddp_ms']:.1f} | {'beats DDP' if r['beats_ddp'] else 'not faster than DDP'} |")
    lines += ["", "| number | min | max | range over runs | median stated spread (95th - 5th) "
              "| range within the spread |", "|---|---:|---:|---:|---:|---|"]
    for k, v in summary.items():
        sp = v["median_stated_spread"]
        within = "-" if sp is None else ("yes" if v["range"] <= sp else
                                         f"no ({v['range'] / sp:.2f}x the spread)")
        lines.append(f"| {k} | {v['min']:.4f} | {v['max']:.4f} | {v['range']:.4f} | "
                     f"{'-' if sp is None else f'{sp:.4f}'} | {within} |")
    said = ", ".join(f"{m} mode, " + ("beats DDP" if b else "not faster than DDP")
                     for m, b in sorted(verdicts))
    lines += ["", f"Same verdict in every run: **{'yes' if res['same_verdict'] else 'no'}** "
              f"({said}).", ""]
    (HERE / "profile_repeat.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
