"""``usbyte-opt demo``: the whole pipeline on this machine's CPU in about a minute.

Two gloo ranks on loopback profile a built-in model, the planner scores every strategy, and
the same model is trained for a few iterations with PyTorch DDP and with the ``best``
schedule on the runtime; predicted and measured times are printed side by side. It is
``usbyte-opt bench`` with small defaults (:func:`usbyte_opt.bench.run_bench`); how far the
prediction was off is :func:`usbyte_opt.bench.report.explain`, printed here. The strategies
and DDP take turns of 3 timed iterations, at least 4 rounds and, while one of them and DDP are
not distinguishable (:mod:`usbyte_opt.verdict`), up to 12 rounds or 90 s of timed turns; then
come the verdicts against DDP and, last, what was won (:func:`outcome`): "won: best ran 1.12x
DDP's speed (95% CI 1.05–1.19x, ...), predicted 1.10x", or why it cannot tell ("not
distinguishable on this machine (±8%)", "nothing to win at world size 1"), with how far the
profile's compute was from the run without communication.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import console
from ..bench.worker import BEST, REFERENCE, TORCH_DDP
from ..console import plural
from ..planning.strategies import load_builtin
from . import common


def demo(
    model: Annotated[str, typer.Option(
        "--model", "-m", help="Model to train: a built-in CPU model (cnn, transformer, mlp, "
                              "lab-cnn, ...) or package.module:factory, called as "
                              "factory(batch_size) and returning (model, inputs, loss_fn) "
                              "(docs/profiles.md, The model factory).")] = "cnn",
    iterations: Annotated[int, typer.Option(
        "--iterations", "-k", min=1, help="Timed iterations per strategy, in 4 rounds (more "
                                          "rounds while not distinguishable from DDP).")] = 12,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", min=1, help="Per-rank batch size (default: the model's own)."
    )] = None,
    strategies: Annotated[str, typer.Option(
        "--strategies", "-s",
        help="Comma-separated strategies to train with, among "
                                   f"{', '.join(load_builtin())} ({TORCH_DDP}: PyTorch DDP "
                                   "itself).")] = f"{TORCH_DDP},{BEST}",
    output_dir: Annotated[Optional[Path], typer.Option(
        "--output-dir", "-o", file_okay=False, help="Keep the report, plot, traces and schedules "
                                                    "here (default: nothing is written).")] = None,
    wide: common.Wide = False,
    as_json: common.Json = False,
) -> None:
    """Profile, plan and train a small model on 2 local ranks; print predicted and measured,
    how far the prediction was off (compute or communication) and whether the verdict
    against DDP holds (or that this machine is too noisy to tell).

    Besides the strategies, the model also trains without communication (no-comm), which
    measures the compute the prediction assumed.
    """
    from ..bench import BenchConfig, ProfileOptions, run_bench

    keep = output_dir is not None
    if output_dir is not None:
        common.check_output_dir(output_dir, "--output-dir")
    out = output_dir if output_dir is not None else Path(tempfile.mkdtemp(prefix="usbyte-demo-"))
    cfg = BenchConfig(model=model, nproc=2, iterations=iterations, batch_size=batch_size,
                      strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
                      out_dir=out, rounds=4, max_rounds=12, max_train_s=90.0, warmup=1,
                      reference=True, plot=keep, trace=keep,
                      profiling=ProfileOptions(warmup=2, repeats=5, comm_points=8, comm_repeats=3,
                                               stable_s=5.0), timeout_s=600.0)
    try:
        result = run_bench(cfg, progress=None if as_json else console.info)
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    if result is None:
        return
    if not keep:
        for key in ("report", "plot", "profile", "out_dir"):
            result[key] = None
        result["traces"] = {}
        for r in result["runs"]:
            r["schedule"] = r["trace"] = None
    if as_json:
        console.emit_json(result)
        return
    from ..bench.report import EXPLAIN_COLUMNS, explain
    from .bench import notes, render

    render(result, "demo", wide=wide)
    notes(result)
    console.info("next: `usbyte-opt bench lab-cnn --bandwidth 200mbit` (as root): the same on "
                 "an emulated link")
    if keep:
        console.info(f"files in {out}")
    rows, lines = explain(result)
    console.table("how far the prediction was off (measured − predicted, per iteration)",
                  EXPLAIN_COLUMNS, rows, justify_right_from=1,
                  caption="compute: the run without communication against the profile, common "
                  "to every strategy; comm: the rest")
    for line in lines:   # the verdicts against DDP
        console.paragraph(line)
    for line in outcome(result):   # what was won, or why it cannot tell, last
        console.paragraph(line)


def outcome(result: dict[str, Any]) -> list[str]:
    """What the run won against PyTorch DDP, one line per strategy (``won: ...``), or why it
    cannot tell: at world size 1 there is no communication to win; without a DDP run there is
    nothing to hold it against; where the paired interval contains 1 the machine was too noisy
    (``±X%``, the interval's half-width); with fewer than 2 pairs there is no interval. Read
    from the bench's result (``runs``: ``vs_ddp``, ``speedup_vs_ddp``,
    ``predicted_speedup_vs_ddp``), and, when it ran, how far the profile's compute was from
    the run without communication.

    Example::

        >>> runs = [{"strategy": "ddp", "measured_ms": 100.0},
        ...         {"strategy": "best", "measured_ms": 89.0, "predicted_speedup_vs_ddp": 1.1,
        ...          "speedup_vs_ddp": 1.12, "vs_ddp": {"ratio": 1.12, "lo": 1.05, "hi": 1.19,
        ...                                             "pairs": 6, "confidence": 0.95}}]
        >>> outcome({"world_size": 2, "runs": runs})
        ["won: best ran 1.12x DDP's speed (95% CI 1.05–1.19x, 6 rounds), predicted 1.10x"]
    """
    runs = {r["strategy"]: r for r in result.get("runs", [])}
    if result.get("world_size") == 1 or result.get("single_rank"):
        return ["won: nothing to win at world size 1: no communication to schedule (one rank "
                "measures the runtime's own cost against DDP)"]
    others = [s for s in runs if s not in (TORCH_DDP, REFERENCE)]
    if TORCH_DDP not in runs or not runs[TORCH_DDP].get("measured_ms"):
        return ["won: cannot tell: no DDP run to hold the strategies against (add "
                f"{TORCH_DDP} to --strategies)"] if others else []
    out = []
    for s in others:
        r = runs[s]
        pred = r.get("predicted_speedup_vs_ddp")
        said = f", predicted {pred:.2f}x" if pred else ""
        v = r.get("vs_ddp")
        if v and v.get("lo") is not None and v.get("hi") is not None and v["lo"] > 0:
            conf = round(100 * v.get("confidence", 0.95))
            ci = f"{conf}% CI {v['lo']:.2f}–{v['hi']:.2f}x, {plural(v['pairs'], 'round')}"
            if v["lo"] > 1.0:
                out.append(f"won: {s} ran {v['ratio']:.2f}x DDP's speed ({ci}){said}")
            elif v["hi"] < 1.0:
                out.append(f"won: nothing: {s} ran {v['ratio']:.2f}x DDP's speed, slower than "
                           f"DDP ({ci}){said}")
            else:
                out.append(f"won: cannot tell: {s} against DDP is not distinguishable on this "
                           f"machine ({_pm(v)}); measured {v['ratio']:.2f}x DDP's speed{said}")
        elif r.get("speedup_vs_ddp"):
            out.append(f"won: cannot tell: {s} ran {r['speedup_vs_ddp']:.2f}x DDP's speed in too "
                       f"few rounds for an interval (rerun with more --iterations){said}")
        else:
            out.append(f"won: cannot tell: {s} has no measured time against DDP's")
    ref = runs.get(REFERENCE)
    if out and ref and ref.get("measured_ms") and ref.get("predicted_ms"):
        off = ref["predicted_ms"] / ref["measured_ms"] - 1.0
        out[-1] += (f" (profiled compute {ref['predicted_ms']:.1f} ms, {100 * off:+.0f}% off the "
                    f"{ref['measured_ms']:.1f} ms measured without communication)")
    return out


def _pm(v: dict[str, Any]) -> str:
    """``±X%`` of a paired comparison: its verdict's, else its interval's half-width."""
    m = re.search(r"±\s*[0-9.]+%", str(v.get("verdict", "")))
    if m:
        return m.group(0)
    lo, hi = v["lo"], v["hi"]
    return f"±{100 * (math.sqrt(hi / lo) - 1.0):.0f}%" if lo > 0 and math.isfinite(hi) else "no interval"


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
