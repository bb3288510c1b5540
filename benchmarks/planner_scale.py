"""Planner scale: how `usbyte-opt optimize` grows with the number of gradient tensors.

    python benchmarks/planner_scale.py              # writes planner_scale.md and planner_scale.json
    python benchmarks/planner_scale.py --repeats 1 --sizes 1k,5k --no-dense   # a quick look

Mixture-of-experts models have one gradient tensor per expert matrix per layer: thousands.
Each case is a profile made by :func:`usbyte_opt.planning.synthetic.moe_profile` (16 ranks, 100 Gbit/s,
analytic ring), written to a temporary file and planned by ``usbyte-opt optimize --json`` in
a fresh process, end to end (interpreter start, import, load, every strategy, the lower bound,
the schedule written). Per case it reports the wall time (range over ``--repeats`` runs, with
the 1-minute load average before each run: the machine may be shared), its processor time
(user and system, the second process it forks included: other jobs inflate it less than the
wall time), the solve time of
``best`` and ``usbyte`` inside that run, ``best`` planned alone (in this process:
``compare(profile, ["best"])``, which computes its cheap seeds itself), the peak resident
memory of the optimize process (its ``VmHWM``), best against DDP and against the lower bound, and whether
``best`` is at or below every strategy. A least-squares line through log(wall) against
log(tensors) gives the growth exponent. The shipped dense profiles are planned the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from usbyte_opt.formats import load_profile, save_profile  # noqa: E402
from usbyte_opt.planning.planner import compare  # noqa: E402
from usbyte_opt.planning.synthetic import moe_profile  # noqa: E402

#: (label, layers, experts, top_k, tokens per rank): Mixtral's 32 x 8 (top-2), DeepSeek-MoE's
#: 27 x 64, fine-grained 160-expert layers at about 10k, 11.7k and 20k tensors; tokens chosen so
#: that all-reduce takes 0.7-1.4x the compute (where the schedule matters most).
SHAPES = {
    "1k": (32, 8, 2, 16_384),
    "5k": (27, 64, 6, 32_768),
    "10k": (21, 160, 6, 65_536),
    "12k": (24, 160, 6, 65_536),
    "20k": (42, 160, 6, 65_536),
}
DENSE = ("resnet50", "resnet152", "vgg16", "densenet201", "bert-base", "gpt2")


def load1() -> float:
    return os.getloadavg()[0]


def measure(label: str, prof, repeats: int, tmp: Path) -> dict:
    path = tmp / f"{prof.name}.json"
    save_profile(prof, path)
    runs, cpus, loads, rss, planning = [], [], [], [], []
    data = None
    for _ in range(repeats):
        loads.append(load1())
        r = run_optimize_rss(path, tmp / "out.json")
        runs.append(r["wall_s"])
        cpus.append(r["cpu_s"])
        rss.append(r["maxrss_mib"])
        data = r["json"]
        planning.append(data["lower_bound_s"] + sum(v["solve_s"] for v in data["strategies"].values()))
    t0 = time.perf_counter()
    alone = compare(prof, ["best"])
    best_alone = time.perf_counter() - t0
    st = data["strategies"]
    best = st["best"]["iteration_ms"]
    row = {
        "case": label, "profile": prof.name, "tensors": len(prof.tensors),
        "gradient_gb": sum(t.nbytes for t in prof.tensors) / 1e9,
        "wall_s": runs, "cpu_s": cpus, "planning_s": planning, "load1": loads, "maxrss_mib": rss,
        "solve_s": {k: v["solve_s"] for k, v in st.items()},
        "best_alone_s": best_alone,
        "best_ms": best, "ddp_ms": st["ddp"]["iteration_ms"],
        "lower_bound_ms": data["lower_bound_ms"],
        "gap": (best - data["lower_bound_ms"]) / data["lower_bound_ms"],
        "best_le_all": all(best <= v["iteration_ms"] + 1e-9 for v in st.values()),
        "alone_ms": alone.results["best"].iteration_ms,
    }
    print(f"{label:>10} {row['tensors']:>6} tensors  wall {min(runs):6.2f}-{max(runs):6.2f} s "
          f"cpu {min(cpus):.2f}-{max(cpus):.2f} s (load {min(loads):.2f}-{max(loads):.2f})  "
          f"best {row['solve_s']['best']:.2f} s  "
          f"usbyte {row['solve_s']['usbyte']:.2f} s  alone {best_alone:.2f} s  "
          f"rss {max(rss):.0f} MiB  vs ddp {row['ddp_ms'] / best:.3f}x  gap {100 * row['gap']:.2f}%  "
          f"best<=all {row['best_le_all']}", flush=True)
    return row


#: The optimize process, as ``python -m usbyte_opt optimize ...`` runs it, reporting at exit the
#: peak resident memory of its own image (``VmHWM``: counted from its exec, so not the memory of
#: the benchmark process it was forked from) into the file named by ``USBYTE_PEAK_FILE``.
CHILD = """
import os, sys
from usbyte_opt.cli.main import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
finally:
    with open("/proc/self/status") as f:
        peak = next(l.split()[1] for l in f if l.startswith("VmHWM:"))
    with open(os.environ["USBYTE_PEAK_FILE"], "w") as f:
        f.write(peak)
sys.exit(code)
"""


def run_optimize_rss(path: Path, out: Path) -> dict:
    """One ``usbyte-opt optimize --json`` in a fresh process: wall time, processor time (user
    and system, the process and the child it forks), its peak resident memory (MiB) and its
    JSON."""
    with tempfile.TemporaryDirectory() as d:
        peak_file = Path(d) / "peak"
        cmd = [sys.executable, "-c", CHILD, "optimize", str(path), "-o", str(out), "--json"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, cwd=ROOT,
                              env={**os.environ, "USBYTE_PEAK_FILE": str(peak_file)})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise SystemExit(f"optimize failed on {path}: {proc.stderr.decode().strip()}")
        return {"wall_s": wall, "cpu_s": cpu, "maxrss_mib": int(peak_file.read_text()) / 1024.0,
                "json": json.loads(proc.stdout)}


def slope(rows: list[dict], key: str = "wall_s") -> float:
    """Least-squares slope of log(min of ``key``) against log(tensors)."""
    xs = [math.log(r["tensors"]) for r in rows]
    ys = [math.log(min(r[key])) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def rng_s(v: list[float], fmt: str = ".2f") -> str:
    lo, hi = min(v), max(v)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}–{hi:{fmt}}"


def markdown(moe: list[dict], dense: list[dict], repeats: int) -> str:
    cols = ("| case | tensors | gradient GB | optimize wall s | optimize CPU s | planning s | load (1 min) | "
            "best solve s | usbyte solve s | best alone s | peak RSS MiB | best vs DDP | "
            "gap to bound | best <= all |")
    sep = "|" + "---|" * 14

    def line(r: dict) -> str:
        return (f"| {r['case']} | {r['tensors']:,} | {r['gradient_gb']:.2f} | {rng_s(r['wall_s'])} | "
                f"{rng_s(r['cpu_s'])} | "
                f"{rng_s(r['planning_s'])} | {rng_s(r['load1'])} | {r['solve_s']['best']:.2f} | "
                f"{r['solve_s']['usbyte']:.2f} | "
                f"{r['best_alone_s']:.2f} | {max(r['maxrss_mib']):.0f} | "
                f"{r['ddp_ms'] / r['best_ms']:.3f}x | {100 * r['gap']:.2f}% | "
                f"{'yes' if r['best_le_all'] else 'NO'} |")

    k = slope(moe) if len(moe) >= 2 else float("nan")
    kp = slope(moe, "planning_s") if len(moe) >= 2 else float("nan")
    lines = [
        "# Planner scale",
        "",
        f"Generated by `python benchmarks/planner_scale.py` on {time.strftime('%Y-%m-%d')} "
        f"({platform.machine()}, CPython {platform.python_version()}, {os.cpu_count()} cores, "
        "shared with other jobs: the load average before each run is given).",
        "",
        "Mixture-of-experts profiles from `usbyte_opt.planning.synthetic.moe_profile` (16 ranks, 100 Gbit/s, "
        "25 µs per ring step, bf16 gradients, 100 TFLOP/s): 1k is "
        "Mixtral-shaped (32 layers x 8 experts, top-2, 16k tokens per rank), 5k DeepSeek-MoE-shaped "
        "(27 x 64, top-6, 32k tokens), 10k, 12k and 20k have 160-expert layers (21, 24 and 42 "
        "layers, top-6, 64k tokens); all-reduce takes 0.7-1.4x the compute. "
        "`optimize wall s`: `usbyte-opt optimize PROFILE --json` in a fresh process, end to end, "
        f"range over {repeats} runs; `optimize CPU s`: its processor time (user and system, with "
        "the second process it forks to plan bytescheduler and usbyte beside the others from "
        "2,000 tensors on), which other jobs on the machine inflate less than the wall time; "
        "`planning s`: the lower bound and every strategy inside those runs (summed, the second "
        "process's too; the rest is starting Python, reading the profile and writing the "
        "schedule); "
        "`best solve s` and `usbyte solve s`: inside the last of "
        "those runs; `best alone s`: `compare(profile, [\"best\"])` in the benchmark's process "
        "(best computes its cheap seeds itself); peak RSS of the optimize process (max over runs); "
        "gap: best over the lower bound of `usbyte_opt/planning/bounds.py`.",
        "",
        "## Mixture-of-experts profiles",
        "",
        cols, sep, *[line(r) for r in moe],
        "",
        f"Growth (least-squares slope of log(time) against log(tensors), fastest run of each "
        f"case): optimize's wall time as tensors^{k:.2f}, its planning as tensors^{kp:.2f}.",
        "",
    ]
    if dense:
        lines += ["## Shipped dense profiles (as shipped: 8 ranks, analytic 25 Gbit/s ring)", "",
                  cols, sep, *[line(r) for r in dense], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SHAPES), help="cases among " + ", ".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=3, help="optimize runs per case")
    ap.add_argument("--no-dense", action="store_true", help="skip the shipped dense profiles")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"),
                    help="Markdown to write (the JSON goes beside it)")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SHAPES:
            ap.error(f"--sizes: expected some of {', '.join(SHAPES)}, got {s!r}")
    moe, dense = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for s in sizes:
            layers, experts, top_k, tokens = SHAPES[s]
            moe.append(measure(s, moe_profile(layers, experts, top_k=top_k, tokens=tokens,
                                              name=f"moe-{s}"),
                               args.repeats, tmp))
        if not args.no_dense:
            for name in DENSE:
                dense.append(measure(name, load_profile(ROOT / "profiles" / f"{name}.json"),
                                     args.repeats, tmp))
    args.out.write_text(markdown(moe, dense, args.repeats))
    args.out.with_suffix(".json").write_text(json.dumps({"moe": moe, "dense": dense}, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
