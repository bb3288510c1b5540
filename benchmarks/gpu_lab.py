"""DDP, the paper's US-Byte strategy and ``best`` on an emulated link, measured side by side.

    python benchmarks/gpu_lab.py --device cuda      # gpt2, bert-large, resnet50 at 16x25gbit, 128x100gbit
    python benchmarks/gpu_lab.py                    # on CPU: lab-cnn and transformer at 8x1gbit
    python benchmarks/gpu_lab.py --render           # gpu_lab.md again from gpu_lab.json

Each case is one ``usbyte-opt bench MODEL --nproc-per-node 1 --emulate LINK`` (:func:`usbyte_opt.bench.run_bench`
with ``emulate``): one rank trains, every collective occupies an emulated link of N ranks
(:mod:`usbyte_opt.collectives.emulate`: one serial channel, ``alpha + 2(N-1)/N * b / rate`` per
all-reduce; a side stream of sleep kernels on CUDA, a host thread on CPU), and the planner plans
for N ranks on that link. PyTorch DDP (``ddp``, its buckets through a communication hook), the
paper's US-Byte schedule (``usbyte``) and the planner's ``best`` (both on the usbyte-opt runtime)
take turns on the same link; per strategy: measured iteration time, predicted, the prediction's
error ((measured − predicted) / measured), the speed against DDP (paired turns) and the distance
to the planner's lower bound. Training must match DDP's (the bench's own check).

Results of each device are kept under their own key of ``gpu_lab.json``, so the GPU run adds its
table beside the CPU one; ``gpu_lab.md`` shows both, with the command that made each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import labruns  # noqa: E402  (beside this script)

from usbyte_opt.bench import BenchConfig, run_bench  # noqa: E402
from usbyte_opt.formats import write_json  # noqa: E402
from usbyte_opt.profiler.options import ProfileOptions  # noqa: E402

HERE = Path(__file__).resolve().parent
STRATEGIES = ("ddp", "usbyte", "best")
#: Per device: (model, batch per rank or None for the model's own, link) cases, and the
#: timed iterations and rounds of each.
CASES = {
    "cuda": {"cases": [(m, None, link) for link in ("16x25gbit", "128x100gbit")
                       for m in ("gpt2", "resnet50", "bert-large")],
             "iterations": 20, "rounds": 4, "reference": False},
    "cpu": {"cases": [("lab-cnn", 8, "8x1gbit"), ("transformer", None, "8x1gbit")],
            "iterations": 8, "rounds": 3, "reference": True},
}


def run_case(model: str, batch: int | None, link: str, device: str, iterations: int,
             rounds: int, out: Path, reference: bool) -> dict:
    load0 = os.getloadavg()
    t0 = time.time()
    res = run_bench(BenchConfig(model=model, nproc=1, emulate=link, device=device,
                                batch_size=batch, iterations=iterations, rounds=rounds,
                                max_rounds=rounds, warmup=1, strategies=STRATEGIES,
                                reference=reference, out_dir=out, plot=False,
                                profiling=ProfileOptions(comm_points=4)),
                    progress=lambda s: print(f"  {s}", file=sys.stderr)
                    if not s.startswith("round") else None)
    keep = ("model", "name", "world_size", "network", "emulated", "emulated_link", "device",
            "batch_size", "torch", "forward_ms", "backward_ms", "update_ms", "comm",
            "gradient_bytes", "lower_bound_ms", "iterations", "rounds", "correct", "wall_s",
            "phases_s")
    return labruns.slim(res, keep, load0, t0)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f}%"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def table(section: dict) -> list[str]:
    lines = ["| model | link | strategy | measured ms | predicted ms | error | refined error "
             "| vs DDP | vs bound | training |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for run in section["runs"]:
        first = True
        for s in STRATEGIES:
            r = labruns.by_strategy(run).get(s)
            if r is None:
                continue
            vs = r.get("vs_ddp") or {}
            vs_ddp = (f"{vs['ratio']:.2f}x ({vs['lo']:.2f}–{vs['hi']:.2f})"
                      if vs.get("ratio") and vs.get("lo") else _f(r.get("speedup_vs_ddp"), ".2f"))
            lines.append(
                f"| {run['name'] if first else ''} | {run['emulated'] if first else ''} | {s} "
                f"| {_f(r['measured_ms'])} | {_f(r['predicted_ms'])} | {_pct(r['error'])} "
                f"| {_pct(r.get('refined_error'))} | {vs_ddp if s != 'ddp' else '1'} "
                f"| {_f(r.get('vs_lower_bound'), '.2f')} "
                f"| {'equal' if r.get('max_param_diff') == 0.0 else _f(r.get('max_param_diff'), '.1e')} |")
            first = False
        lines.append(f"| | | bound | | {_f(run['lower_bound_ms'])} | | | | | |")
    return lines


def markdown(doc: dict) -> str:
    lines = ["# DDP, US-Byte and best on an emulated link, one rank", "",
             "One rank trains; every collective occupies an emulated link of N ranks "
             "(`usbyte-opt bench MODEL --nproc-per-node 1 --emulate NxRATE`, docs/bench.md, "
             "\"The emulated link\"): one serial channel, busy alpha + 2(N−1)/N · bytes / rate per "
             "all-reduce (alpha 50 µs). The planner plans for N ranks on that link. Measured: the "
             "median iteration; error = (measured − predicted) / measured; refined: the planner's "
             "model with compute rescaled to the run; vs DDP: DDP's time over the strategy's, "
             "paired turns, 95% interval; vs bound: measured over the planner's lower bound; "
             "training: the largest parameter difference from DDP's after the run.", ""]
    for device in ("cuda", "cpu"):
        section = doc.get(device)
        if not section:
            if device == "cuda":
                lines += ["## GPU", "", "Not run yet: `python benchmarks/gpu_lab.py --device cuda` "
                          "(gpt2, bert-large, resnet50 at 16x25gbit and 128x100gbit) fills it.", ""]
            continue
        head = "GPU" if device == "cuda" else "CPU (until a GPU is lent)"
        fails = [f"- {f['model']} at {f['link']} failed: {f['error']}"
                 for f in section.get("failed", [])]
        if not section["runs"]:
            lines += [f"## {head}", "", *fails, ""]
            continue
        lines += [f"## {head}", "",
                  f"`python benchmarks/gpu_lab.py {section['argv']}`".replace(" `", "`")
                  + f" on {section['host']}, torch {section['runs'][0].get('torch', '?')}, "
                  f"{section['iterations']} timed iterations x {section['rounds']} turns per "
                  f"strategy, {section['wall_s']:.0f} s in all; load average "
                  f"{section['runs'][0]['load_before'][0]:.1f} before, "
                  f"{section['runs'][-1]['load_after'][0]:.1f} after"
                  + (" (a 2-core machine shared with other jobs: a burst of load slows compute "
                     "several times over, and a profile taken in one plans for the wrong "
                     "balance)." if device == "cpu" else "."), ""]
        lines += table(section)
        lines += ["", *fails] if fails else [""]
        lines += [f"- {n}" for n in section.get("notes", [])]
        for run in section["runs"]:
            c = run["comm"]
            whole = c["alpha_ms"] + run["gradient_bytes"] / (c["algbw_gbs"] * 1e6)
            lines.append(f"- {run['name']} at {run['emulated']}: compute "
                         f"{run['forward_ms'] + run['backward_ms']:.1f} ms + update "
                         f"{run['update_ms']:.1f} ms, {run['gradient_bytes'] / 1e6:.1f} MB of "
                         f"gradients ({whole:.1f} ms on the link in one all-reduce); the link carried "
                         f"{run['emulated_link']['collectives']} collectives, busy "
                         f"{run['emulated_link']['busy_s']:.1f} s; training "
                         f"{'matched DDP' if run['correct'] else 'DIFFERED from DDP'}.")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated models to run (default: all)")
    ap.add_argument("--links", default=None,
                    help="comma-separated links to run, in this order (default: all)")
    ap.add_argument("--out", type=Path, default=Path("bench-results") / "gpu_lab")
    ap.add_argument("--render", action="store_true", help="gpu_lab.md from gpu_lab.json, no run")
    ap.add_argument("--results", type=Path, default=HERE,
                    help="folder of gpu_lab.json and gpu_lab.md (default: beside this script)")
    args = ap.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "gpu_lab.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    if not args.render:
        spec = CASES[args.device]
        its = args.iterations or spec["iterations"]
        rounds = args.rounds or spec["rounds"]
        only = set(args.only.split(",")) if args.only else None
        t0 = time.time()
        runs: list[dict] = []
        failed: list[dict] = []
        cases = [c for c in spec["cases"] if not only or c[0] in only]
        if args.links:
            links = args.links.split(",")
            cases = sorted((c for c in cases if c[2] in links), key=lambda c: links.index(c[2]))
        for model, batch, link in cases:
            print(f"{model} at {link}", file=sys.stderr)
            try:
                runs.append(run_case(model, batch, link, args.device, its, rounds,
                                     args.out / f"{model}-{link}", spec["reference"]))
            except Exception as exc:  # one case's failure is a result; the others still run
                failed.append({"model": model, "link": link, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  failed: {failed[-1]['error']}", file=sys.stderr)
            # written after every case, so a run cut short keeps what it measured
            doc[args.device] = {"argv": " ".join(sys.argv[1:]), "host": f"{platform.node()}: "
                                f"{os.cpu_count()} cores", "iterations": its, "rounds": rounds,
                                "wall_s": time.time() - t0, "runs": runs, "failed": failed}
            write_json(path, doc)
    (args.results / "gpu_lab.md").write_text(markdown(doc))
    print(f"wrote {args.results / 'gpu_lab.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
