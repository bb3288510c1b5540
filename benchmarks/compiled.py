"""Compiled training against eager: does the plan keep its gain under ``torch.compile``?

For each model (``lab-cnn``, ``lab-transformer``) it runs ``usbyte-opt bench`` twice on the
same link, strategies ``ddp`` and ``best``: by default an emulated link (one rank,
``--emulate 8x1gbit``: every collective occupies one serial channel as on a ring of 8 ranks at
1 Gbit/s); with ``--lab RATE`` (root) the lab, two real ranks over a shaped veth link
(``bench -n 2 --bandwidth RATE``):

* **eager**: as ``bench`` runs by default;
* **compiled**: ``bench --compile BACKEND``: the profile timed compiled (graphs split at every
  tensor's first use), torch DDP compiled with its own DDPOptimizer, ``best`` compiled on the
  runtime, which splits each graph at its plan's blocks.

Each bench times its strategies side by side in interleaved turns; the ratio quoted is DDP's
time over best's from those paired turns (``vs DDP``, >1 is faster), beside the lower bound
(no schedule can beat it) and the prediction. ``--runs N`` repeats the whole set; the table
gives each figure's range over the runs. The goal (issue 42): compiled best keeps at least 95%
of the eager ratio's gain, its prediction within 10%, training equal.

    python benchmarks/compiled.py                       # 2 runs, inductor; writes compiled.md/.json
    python benchmarks/compiled.py --backend aot_eager --runs 1 --models lab-cnn
    sudo python benchmarks/compiled.py --lab 200mbit    # the lab half (root); keeps the other

Each set of rows (a link and a backend) is kept apart in ``compiled.json`` (a run replaces
only its own set's) and gets a table of its own in ``compiled.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_MD, OUT_JSON = HERE / "compiled.md", HERE / "compiled.json"
MODELS = ("lab-cnn", "lab-transformer")


def link_args(link: str) -> list[str]:
    """The bench's arguments for a link: ``emulate 8x1gbit`` (one rank) or ``lab 200mbit``."""
    kind, spec = link.split(" ", 1)
    return ["-n", "1", "--emulate", spec] if kind == "emulate" else ["-n", "2", "--bandwidth", spec]


def bench(model: str, compile_backend: str | None, link: str, iterations: int,
          timeout_s: float) -> dict[str, Any]:
    """One ``usbyte-opt bench`` (``--json``): the figures of ``ddp`` and ``best``."""
    out = tempfile.mkdtemp(prefix="usbyte-compiled-")
    argv = [sys.executable, "-m", "usbyte_opt", "bench", model, *link_args(link),
            "-s", "ddp,best", "--iterations", str(iterations), "-o", out, "--json"]
    if compile_backend:
        argv += ["--compile", compile_backend]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise SystemExit(f"bench {model} ({compile_backend or 'eager'}) failed: {p.stderr[-2000:]}")
    r = json.loads(p.stdout)
    runs = {x["strategy"]: x for x in r["runs"]}
    best, ddp = runs["best"], runs["ddp"]
    vs = best.get("vs_ddp") or {}
    return {"model": model, "compile": compile_backend, "link": link, "wall_s": round(time.perf_counter() - t0, 1),
            "ddp_ms": ddp["measured_ms"], "best_ms": best["measured_ms"],
            "speedup": best["speedup_vs_ddp"], "lo": vs.get("lo"), "hi": vs.get("hi"),
            "predicted_speedup": best["predicted_speedup_vs_ddp"], "error": best["error"],
            "bound_ms": r["lower_bound_ms"], "vs_bound": best["vs_lower_bound"],
            "equal": r["correct"], "max_param_diff": best["max_param_diff"],
            "split": (r.get("compile") or {}).get("split"), "notes": r.get("notes") or []}


def rng(xs: list[float], fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | run | best vs DDP (x) | bound vs DDP (x) | predicted (x) | best's error | "
             "best vs bound | training | split (best) |", "|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for comp in dict.fromkeys(r["compile"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["compile"] == comp]
            split = rs[-1]["split"] or {}
            b = split.get("best")
            where = "-" if b is None else f"{b['pieces']} pieces, {b['graphs']} graph(s)" + (
                "" if b["gated"] else " (updates before the forward)")
            lines.append(
                f"| {model} | {comp or 'eager'} | {rng([r['speedup'] for r in rs])} | "
                f"{rng([r['ddp_ms'] / r['bound_ms'] for r in rs])} | "
                f"{rng([r['predicted_speedup'] for r in rs])} | "
                f"{rng([100 * r['error'] for r in rs], '{:+.0f}%')} | "
                f"{rng([r['vs_bound'] for r in rs])} | "
                f"{'equal' if all(r['equal'] for r in rs) else 'DIFFERS'} | {where} |")
    return "\n".join(lines)


def gains(rows: list[dict[str, Any]]) -> list[str]:
    """Per model and run: compiled best's gain over DDP as a share of the eager gain."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        e = [r for r in rows if r["model"] == model and not r["compile"]]
        c = [r for r in rows if r["model"] == model and r["compile"]]
        shares = []
        for a, b in zip(e, c):
            if a["speedup"] and b["speedup"]:
                shares.append((b["speedup"] - 1) / (a["speedup"] - 1) if abs(a["speedup"] - 1) > 0.02
                              else None)
        known = [s for s in shares if s is not None]
        out.append(f"{model}: compiled gain / eager gain per run: "
                   + (", ".join(f"{s:.2f}" for s in known) if known else
                      "not defined (eager best within 2% of DDP: nothing to keep)"))
        # The gain each run could have had at most: DDP's time over the bound.
        def reached(r: dict[str, Any]) -> str:
            room = r["ddp_ms"] / r["bound_ms"] - 1
            return f"{(r['ddp_ms'] / r['best_ms'] - 1) / room:.2f}" if room > 0.02 else "-"
        out.append(f"{model}: best's gain / the most any schedule could win (DDP's time over the "
                   f"bound), per run: eager {', '.join(map(reached, e))}; compiled "
                   f"{', '.join(map(reached, c))}")
    return out


def _set_of(row: dict[str, Any], meta: dict[str, Any]) -> str:
    """A row's set, ``"LINK, BACKEND"`` (rows written before sets were recorded: the file's
    emulated link and backend)."""
    if row.get("set"):
        return row["set"]
    return f"{row.get('link') or 'emulate ' + meta.get('emulate', '8x1gbit')}, {meta.get('backend', 'inductor')}"


def section(key: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The Markdown of one set of rows (a link and a backend): how they ran, the command, the
    table, the gains."""
    link, backend = key.split(", ", 1)
    kind, spec = link.split(" ", 1)
    where = (f"one rank on an emulated link (`--emulate {spec}`)" if kind == "emulate" else
             f"two ranks in the lab, a veth link shaped to {spec} (`bench -n 2 --bandwidth {spec}`, root)")
    cmd = (f"python benchmarks/compiled.py --backend {backend} --runs {meta['runs']}"
           + (f" --models {meta['models']}" if meta.get("models") and meta["models"] != ",".join(MODELS)
              else "")
           + (f" --emulate {spec}" if kind == "emulate" and spec != "8x1gbit" else "")
           + (f" --lab {spec}" if kind == "lab" else ""))
    return (f"## {'Emulated link' if kind == 'emulate' else 'The lab'}: {spec}, {backend}\n\n"
            f"{meta['runs']} run(s) on {meta['date']}, torch {meta['torch']}, {meta['cpus']} CPU cores "
            f"(load average at the end {meta['load_avg'][0]:.1f}), {where}, `--compile "
            f"{backend}` for the compiled rows, {meta['iterations']} timed iterations per "
            f"strategy at least. Ranges over runs.\n\n    {'sudo ' if kind == 'lab' else ''}{cmd}\n\n"
            + table(rows) + "\n\n" + "\n".join(f"- {g}" for g in gains(rows)) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--emulate", default="8x1gbit", help="the emulated link (one rank)")
    ap.add_argument("--lab", default=None, metavar="RATE",
                    help="instead: two ranks in the lab at this rate (200mbit; root)")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    link = f"lab {a.lab}" if a.lab else f"emulate {a.emulate}"
    rows = []
    for run in range(a.runs):
        for model in a.models.split(","):
            for comp in (None, a.backend):
                r = bench(model, comp, link, a.iterations, a.timeout_s)
                r["run"] = run + 1
                rows.append(r)
                print(f"run {run + 1} {model} {comp or 'eager'}: best {r['speedup']:.3f}x DDP "
                      f"(predicted {r['predicted_speedup']:.3f}x), {r['wall_s']} s", flush=True)
    print(table(rows))
    for line in gains(rows):
        print(line)
    if a.no_write:
        return
    meta = {"torch": __import__("torch").__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "backend": a.backend,
            "emulate": a.emulate, "iterations": a.iterations, "runs": a.runs,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    # Keep the other sets' rows (another link, another backend) and how they ran.
    key = f"{link}, {a.backend}"
    meta["models"] = a.models
    for r in rows:
        r["set"] = key
    old = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {"rows": []}
    old_meta = old.get("meta", {})
    sets = {(k if ", " in k else f"{k}, {m.get('backend', 'inductor')}"): m
            for k, m in (old.get("sets") or old.get("links") or (
                {f"emulate {old_meta.get('emulate', '8x1gbit')}": old_meta} if old_meta else {})).items()}
    kept = [dict(r, set=_set_of(r, old_meta)) for r in old.get("rows", [])]
    kept = [r for r in kept if r["set"] != key]
    sets[key] = meta
    doc = {"sets": sets, "rows": kept + rows}
    OUT_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    parts = [section(k, m, [r for r in doc["rows"] if r["set"] == k])
             for k, m in sorted(sets.items(), key=lambda km: (km[0].startswith("lab"), km[0]))]
    OUT_MD.write_text("# Compiled training against eager (`benchmarks/compiled.py`)\n\n"
                      + "\n".join(parts))


if __name__ == "__main__":
    main()
