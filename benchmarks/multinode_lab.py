"""Two nodes of two ranks in the lab: flat against hierarchical all-reduce, side by side.

    sudo python benchmarks/multinode_lab.py              # writes multinode_lab.md and .json
    sudo python benchmarks/multinode_lab.py --runs 1     # one run (a smoke run)
    python benchmarks/multinode_lab.py --render          # multinode_lab.md again from the .json

Each run is one ``usbyte-opt bench --nodes 2 --nproc-per-node 2 --bandwidth 200mbit``
(:func:`usbyte_opt.bench.run_bench`) of a lab model on this machine: the two-level lab of
:mod:`usbyte_opt.bench.netlab` (one network namespace per node, the node's two ranks over its
loopback, the nodes joined by a veth pair shaped to 200 Mbit/s each way). It profiles in the
lab, plans, then trains side by side, interleaved: PyTorch DDP (one flat ring over the 4
ranks), ``best-flat`` (the planner's best with every block flat) and ``best`` (the planner's
best, free to all-reduce a block hierarchically: inside each node, across the nodes, inside
again), where the planner offers them. Per strategy: measured iteration time, the planner's
prediction and its error, the distance to the planner's lower bound, and the bytes sent on the
shaped link per iteration (the kernel's counter of each node's link, read around every turn).
Ratios are taken within a run; ranges are over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import labruns  # noqa: E402  (beside this script)
from labruns import by_strategy as _by  # noqa: E402
from labruns import value_range as _rng

from usbyte_opt.bench import BenchConfig, flat_best, run_bench  # noqa: E402
from usbyte_opt.formats import write_json  # noqa: E402
from usbyte_opt.profiler.options import ProfileOptions  # noqa: E402

MODEL = "lab-cnn"
BATCH = 8
RATE = "200mbit"
NODES, PER_NODE = 2, 2
WANTED = ("ddp", "best-flat", "best")


def strategies() -> tuple[str, ...]:
    """The strategies of :data:`WANTED` the planner offers here (``best-flat`` comes with the
    hierarchical planner, :func:`usbyte_opt.bench.flat_best`)."""
    return tuple(s for s in WANTED if s != "best-flat" or s in flat_best())


def run_case(names: tuple[str, ...], iterations: int, rounds: int, out: Path) -> dict:
    load0 = os.getloadavg()
    t0 = time.time()
    res = run_bench(BenchConfig(model=MODEL, nodes=NODES, nproc=PER_NODE, bandwidth=RATE,
                                batch_size=BATCH, iterations=iterations, rounds=rounds,
                                max_rounds=rounds, warmup=1, strategies=names, out_dir=out,
                                plot=False, profiling=ProfileOptions(comm_points=8)),
                    progress=lambda s: print(f"  {s}", file=sys.stderr)
                    if not s.startswith("round") else None)
    keep = ("model", "name", "world_size", "network", "batch_size", "torch", "forward_ms",
            "backward_ms", "comm", "gradient_bytes", "lower_bound_ms", "compute_scale",
            "iterations", "rounds", "correct", "wall_s", "phases_s")
    slim = labruns.slim(res, keep, load0, t0)
    return slim


def _line(c: dict | None) -> str:
    return f"alpha {c['alpha_ms']:.2f} ms, {c['algbw_gbs'] * 1e3:.1f} MB/s" if c else "—"


def markdown(runs: list[dict], argv: str) -> str:
    first = runs[0]
    names = [s for s in (*WANTED, "no-comm") if all(s in _by(r) for r in runs)]
    c = first.get("comm", {})
    lines = ["# Two nodes of two ranks in the lab: flat and hierarchical all-reduce", "",
             f"`python benchmarks/multinode_lab.py {argv}`".replace(" `", "`")
             + f" on {platform.node()}: {os.cpu_count()} cores, torch {first.get('torch', '?')}; "
             f"`{MODEL}`, batch {first.get('batch_size')} per rank, "
             f"{first.get('gradient_bytes', 0) / 1e6:.2f} MB of gradients; {NODES} nodes x "
             f"{PER_NODE} ranks in the two-level lab of `usbyte_opt.bench.netlab` (one network "
             "namespace per node: its two ranks talk over its loopback, the nodes over one veth "
             "pair with tbf at 200 Mbit/s on both ends), gloo. All 4 ranks share this machine's "
             "cores, so compute is slower than on 2 ranks.", "",
             "Strategies, side by side in one bench run (interleaved rounds): `ddp` PyTorch DDP "
             "(one flat ring over the 4 ranks), `best-flat` the planner's best with every block "
             "flat, `best` the planner's best free to all-reduce a block hierarchically "
             "(reduce-scatter inside each node, all-reduce across the nodes, all-gather inside), "
             "`no-comm` training without communication (the compute the prediction assumes). "
             "`predicted`: the planner's, on the profile taken in the lab; `error` = (measured − "
             "predicted) / measured; `refined error`: the same against the bench's refined "
             "prediction (compute recalibrated to the side-by-side `no-comm` run, all-reduce "
             "bandwidth measured under compute: `docs/bench.md`); `vs bound`: measured over the planner's lower bound; "
             "`link MB/it`: bytes sent on the shaped link per iteration, both nodes together "
             "(each node's first rank reads its link's counter around every turn, so warm-up "
             "iterations and the turn's barrier are in it). Ranges are over runs; ratios are "
             "within a run.", "",
             f"Profile (first run): forward {first.get('forward_ms', 0):.0f} ms + backward "
             f"{first.get('backward_ms', 0):.0f} ms; all-reduce on all 4 ranks {_line(c)}; "
             f"inside a node {_line(c.get('intra'))}; across nodes (one rank per node) "
             f"{_line(c.get('inter'))}; nodes recorded: {c.get('nodes', 1)}. Lower bound "
             f"{_rng([r.get('lower_bound_ms') for r in runs], '.0f')} ms; training matches DDP in "
             f"every run: {'yes' if all(r.get('correct') for r in runs) else 'NO'}; load average "
             f"before each run {_rng([r['load_before'][0] for r in runs], '.1f')}.", "",
             *([] if "best-flat" in names else [
                 "No `best-flat` here: the planner of this build does not report it and the "
                 "profile recorded one node, so every block of `best` is flat (DDP against best "
                 "on the two-level lab only).", ""]),
             "| strategy | measured ms | predicted ms | error | refined error | vs DDP | vs bound "
             "| link MB/it |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in names:
        rows = [_by(r)[s] for r in runs]
        lines.append(
            f"| {s} | {_rng([x['measured_ms'] for x in rows], '.0f')} | "
            f"{_rng([x['predicted_ms'] for x in rows], '.0f')} | "
            f"{_rng([None if x.get('error') is None else 100 * x['error'] for x in rows], '+.0f')}% | "
            f"{_rng([None if x.get('refined_error') is None else 100 * x['refined_error'] for x in rows], '+.0f')}% | "
            + (f"{_rng([x['speedup_vs_ddp'] for x in rows], '.2f')}x" if s != "no-comm" else "—")
            + " | "
            + (f"{_rng([x['vs_lower_bound'] for x in rows], '.2f')}x" if s != "no-comm" else "—")
            + f" | {_rng([(x.get('link_bytes_per_iteration') or 0) / 1e6 for x in rows], '.2f')} |")
    lines.append("")
    for flat in ("best-flat", "ddp"):
        pairs = [(_by(r)[flat], _by(r)["best"]) for r in runs if flat in _by(r) and "best" in _by(r)]
        if not pairs:
            continue
        wire = [a["link_bytes_per_iteration"] / b["link_bytes_per_iteration"] for a, b in pairs
                if a.get("link_bytes_per_iteration") and b.get("link_bytes_per_iteration")]
        speed = [a["measured_ms"] / b["measured_ms"] for a, b in pairs]
        lines.append(f"`best` against `{flat}`: {_rng(speed, '.2f')}x its speed (medians); "
                     f"`{flat}` put {_rng(wire, '.2f')}x `best`'s bytes on the shaped link.")
    blocks = [_by(r)["best"].get("blocks") for r in runs if "best" in _by(r)]
    if blocks:
        lines.append(f"`best` planned {_rng(blocks, 'd')} blocks.")
    lines += ["", "Bytes on the link, as the two forms send them: a flat ring over the 4 ranks "
              "(node 0's ranks 0, 1, node 1's ranks 2, 3) crosses the link twice, 1 -> 2 and "
              "3 -> 0, and every ring edge carries 2(n-1)/n = 1.5 times the block, so 3 times "
              "the gradient's bytes cross per iteration; a hierarchical block crosses as 2 "
              "concurrent all-reduces of half the block between the nodes, each sending "
              "2(N-1)/N = 1 times its half each way, so 2 times the gradient's bytes: 1.5x fewer "
              "(the measured ratio is the line above)."]
    below = [(s, x["vs_lower_bound"]) for r in runs for s, x in _by(r).items()
             if x.get("vs_lower_bound") is not None and x["vs_lower_bound"] < 1]
    if below:
        lines += ["", "Below the lower bound: " + ", ".join(f"{s} {v:.2f}x" for s, v in below)
                  + " (the bound is computed from the profile's lines; a run that measures "
                  "below it had a faster link or compute than its profile said: the bench's "
                  "report calls it timing noise)."]
    lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=12, help="timed iterations per strategy")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved turns per strategy")
    ap.add_argument("--render", action="store_true",
                    help="write multinode_lab.md again from multinode_lab.json, running nothing")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    path = out / "multinode_lab.json"
    if args.render:
        doc = json.loads(path.read_text())
        text = markdown(doc["runs"], doc.get("argv", ""))
        (out / "multinode_lab.md").write_text(text)
        print(text)
        return 0
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    names = strategies()
    runs: list[dict] = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs}: {', '.join(names)}", file=sys.stderr)
        runs.append(run_case(names, args.iterations, args.rounds,
                             ROOT / "bench-results" / "multinode_lab" / f"{MODEL}-{int(time.time())}"))
        write_json(path, {"runs": runs, "argv": shown, "strategies": list(names)})
    text = markdown(runs, shown)
    (out / "multinode_lab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
