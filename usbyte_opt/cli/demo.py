"""``usbyte-opt demo``: the whole pipeline on this machine's CPU in about a minute.

Two gloo ranks on loopback profile a built-in model, the planner scores every strategy, and
the same model is trained for a few iterations with PyTorch DDP and with the ``best``
schedule on the runtime; predicted and measured times are printed side by side. It is
``usbyte-opt bench`` with small defaults (:func:`usbyte_opt.bench.run_bench`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional

import typer

from .. import console
from . import common


def demo(
    model: str = typer.Option("cnn", "--model", "-m", help="Model to train (a built-in CPU model: "
                              "cnn, transformer, mlp, lab-cnn, ...)."),
    iterations: int = typer.Option(8, "--iterations", "-k", min=1,
                                   help="Timed iterations per strategy."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", min=1,
                                             help="Per-rank batch size (default: the model's own)."),
    strategies: str = typer.Option("ddp,best", "--strategies", "-s",
                                   help="Comma-separated strategies to train with."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", file_okay=False,
                                              help="Keep the report, plot, traces and schedules here "
                                              "(default: nothing is written)."),
    as_json: bool = common.Json,
) -> None:
    """Profile, plan and train a small model on 2 local ranks; print predicted and measured."""
    from ..bench import BenchConfig, run_bench

    keep = output_dir is not None
    if keep:
        common.check_output_dir(output_dir, "--output-dir")
    out = output_dir if keep else Path(tempfile.mkdtemp(prefix="usbyte-demo-"))
    cfg = BenchConfig(model=model, nproc=2, iterations=iterations, batch_size=batch_size,
                      strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
                      out_dir=out, rounds=2, warmup=1, reference=False, plot=keep, trace=keep,
                      profile_warmup=2, profile_repeats=5, comm_points=8, comm_repeats=3,
                      timeout_s=600.0, extra={"probe_points": 3, "probe_repeats": 2})
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
    from .bench import render

    render(result, "demo")
    runs = {r["strategy"]: r for r in result["runs"]}
    if "ddp" in runs:
        for s, r in runs.items():
            if s != "ddp" and r["speedup_vs_ddp"]:
                console.info(f"{s}: {r['speedup_vs_ddp']:.2f}x DDP's speed measured, "
                             f"{r['predicted_speedup_vs_ddp']:.2f}x predicted; prediction "
                             f"{100 * abs(r['error']):.0f}% off")
    console.info("next: `usbyte-opt bench lab-cnn --bandwidth 200mbit` (as root) trains on an "
                 "emulated 200 Mbit/s network" + (f"; files in {out}" if keep else ""))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
