"""``usbyte-opt demo``: the whole pipeline on this machine's CPU in about a minute.

Two gloo ranks on loopback profile a built-in model, the planner scores every strategy, and
the same model is trained for a few iterations with PyTorch DDP and with the ``best``
schedule on the runtime; predicted and measured times are printed side by side. It is
``usbyte-opt bench`` with small defaults (:func:`usbyte_opt.bench.run_bench`); how far the
prediction was off is :func:`usbyte_opt.bench.report.explain`, printed here. The strategies
and DDP take turns of 3 timed iterations, at least 4 rounds and, while one of them and DDP are
not distinguishable (:mod:`usbyte_opt.verdict`), up to 12 rounds or 90 s of timed turns; the
last line is the verdict against DDP, with its interval, or "not distinguishable on this
machine (±X%)" when the machine is too noisy to tell.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import console
from ..bench.worker import BEST, TORCH_DDP
from ..planning.strategies import load_builtin
from . import common


def demo(
    model: Annotated[str, typer.Option(
        "--model", "-m", help="Model to train (a built-in CPU model: cnn, transformer, mlp, "
                              "lab-cnn, ...).")] = "cnn",
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
    from .bench import render

    render(result, "demo", wide=wide)
    console.info("next: `usbyte-opt bench lab-cnn --bandwidth 200mbit` (as root) trains on an "
                 "emulated 200 Mbit/s network" + (f"; files in {out}" if keep else ""))
    rows, lines = explain(result)
    console.table("how far the prediction was off (measured − predicted, per iteration)",
                  EXPLAIN_COLUMNS, rows, justify_right_from=1,
                  caption="compute: the run without communication against the profile, common "
                  "to every strategy; comm: the rest")
    for line in lines:   # the verdicts against DDP last
        console.paragraph(line)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
