"""``usbyte-opt optimize``: score every strategy on a profile and write the chosen schedule."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from .. import console
from ..formats import save_schedule
from ..planner import compare
from ..simulate import simulate
from ..strategies import load_builtin
from . import common


def optimize(
    profile: Path = typer.Argument(..., help="Profile JSON (see `usbyte-opt schema profile`).",
                                   dir_okay=False),
    output: Optional[Path] = typer.Option(None, "--output", "-o", dir_okay=False,
                                          callback=common.output_file, help="Schedule to write (default: schedules/NAME.json, NAME the profile's name)."),
    strategy: str = typer.Option("best", "--strategy", "-s",
                                 help="Strategy whose schedule is written: wfbp, ddp, mgwfbp, "
                                 "bytescheduler, usbyte or best."),
    world_size: Optional[int] = common.WorldSize,
    bandwidth_gbps: Optional[float] = common.BandwidthGbps,
    latency_us: Optional[float] = common.LatencyUs,
    bucket_cap_mb: float = typer.Option(25.0, "--bucket-cap-mb", min=0.001,
                                        help="Bucket size of the ddp strategy, MiB (PyTorch's default 25)."),
    time_budget: float = typer.Option(0.6, "--time-budget", min=0.0,
                                      help="Seconds of local search for best."),
    trace: Optional[Path] = common.Trace,
    as_json: bool = common.Json,
) -> None:
    """Plan PROFILE with every strategy, compare them, write the schedule of --strategy.

    The schedule (default: best's) is what `usbyte-opt launch` and DistributedOptimizer use.
    Times are predicted by the simulator of docs/design.md §2: "native" is each strategy's own mode
    (fence for wfbp, ddp, mgwfbp: all blocks before the optimizer step; overlap for the others:
    updates gated per tensor in the next forward); "overlap" is the same plan run the way
    usbyte-opt's runtime runs it.
    """
    registry = load_builtin()
    if strategy not in registry:
        raise typer.BadParameter(f"expected one of {', '.join(registry)}", param_hint="--strategy")
    original, prof = common.load_retargeted(profile, world_size, bandwidth_gbps, latency_us)
    report = compare(prof, options={"ddp": {"bucket_cap_mb": bucket_cap_mb},
                                    "best": {"time_budget_s": time_budget}})
    sched = report.schedule(strategy)
    sched = dataclasses.replace(sched, profile_digest=original.digest())
    out = output if output is not None else Path("schedules") / f"{original.name}.json"
    save_schedule(sched, out)
    if trace is not None:
        common.write_trace(trace, simulate(report.problem, sched, check=False),
                           f"{original.name} / {strategy} (predicted)")
    res = report.results
    lb = report.lower_bound_ms
    if as_json:
        console.emit_json({
            "profile": original.name,
            "world_size": prof.comm.world_size,
            "alpha_ms": prof.comm.alpha_ms,
            "algbw_gbs": prof.comm.algbw_gbs,
            "cpu_ms_per_block": prof.comm.cpu_ms_per_block,
            "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
            "compute_ms": report.compute_ms,
            "strategies": {n: {"iteration_ms": r.iteration_ms, "native_mode": r.native_mode,
                               "overlap_ms": r.overlap_ms, "fence_ms": r.fence_ms,
                               "blocks": r.blocks, "solve_s": r.solve_s}
                           for n, r in res.items()},
            "lower_bound_ms": lb,
            "gap": sched.predicted["gap"],
            "chosen": strategy,
            "output": str(out),
            "trace": str(trace) if trace else None,
        })
        return
    wfbp = res["wfbp"].iteration_ms
    ddp = res["ddp"].iteration_ms
    rows = []
    for n, r in res.items():
        mark = " *" if n == strategy else ""
        rows.append([n + mark, r.native_mode, f"{r.iteration_ms:.2f}", f"{r.overlap_ms:.2f}",
                     f"{wfbp / r.iteration_ms:.3f}x", f"{ddp / r.iteration_ms:.3f}x",
                     f"{r.iteration_ms - report.compute_ms:.2f}", r.blocks, f"{r.solve_s:.3f}"])
    c = prof.comm
    console.table(
        f"{original.name}: {len(prof.tensors)} tensors, compute {report.compute_ms:.2f} ms "
        f"(F {prof.forward_ms:.2f} + B {prof.backward_ms:.2f}), {c.world_size} ranks, "
        f"alpha {c.alpha_ms:.3f} ms, algbw {c.algbw_gbs:.3f} GB/s" + common.cpu_cost_note(c),
        ["strategy", "mode", "native ms", "overlap ms", "vs wfbp", "vs ddp", "exposed ms",
         "blocks", "solve s"],
        rows,
        justify_right_from=2,
        caption=f"lower bound {lb:.2f} ms; {strategy} is {100 * sched.predicted['gap']:.2f}% above it",
    )
    console.info(f"wrote {out}" + (f" and {trace}" if trace else ""))


def register(app: typer.Typer) -> None:
    app.command("optimize")(optimize)
