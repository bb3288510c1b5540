"""``usbyte-opt simulate``: score a schedule on a profile (any cluster) and trace it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import console
from ..console import plural
from ..formats import Mode, load_schedule
from ..planning.bounds import lower_bound
from ..planning.problem import Problem
from ..planning.sharded import sharded_lower_bound
from ..planning.simulate import MODES
from ..planning.simulate import simulate as run_simulation
from . import common


def simulate(
    profile: Annotated[Path, typer.Argument(dir_okay=False, help="Profile JSON.")],
    schedule: Annotated[Path, typer.Argument(dir_okay=False, help="Schedule JSON.")],
    mode: Annotated[Optional[str], typer.Option(
        "--mode", help="overlap (each update gated in the next forward), fence (every block, "
                       "then every update, as DDP) or sharded (each block reduce-scattered, the "
                       "shards stepped, the parameters all-gathered before the next forward "
                       "needs them); default: the schedule's own mode, the one the runtime runs "
                       "it in.")] = None,
    world_size: common.WorldSize = None,
    bandwidth_gbps: common.BandwidthGbps = None,
    latency_us: common.LatencyUs = None,
    nodes: common.Nodes = None,
    ranks_per_node: common.RanksPerNode = None,
    intra_gbps: common.IntraGbps = None,
    inter_gbps: common.InterGbps = None,
    intra_latency_us: common.IntraLatencyUs = None,
    inter_latency_us: common.InterLatencyUs = None,
    trace: common.Trace = None,
    as_json: common.Json = False,
    wide: common.Wide = False,
) -> None:
    """Predict the iteration time of SCHEDULE on PROFILE (any cluster), with a trace.

    The prediction is the planner's (docs/planner.md), in the schedule's mode unless --mode
    says otherwise, with the profile's compute-cost fields when it has them. --world-size,
    --bandwidth-gbps and --latency-us move the profile to another cluster (ring all-reduce),
    --nodes and the --intra-/--inter- options to several nodes (docs/planner.md, "Several
    nodes"; a schedule's hierarchical blocks cost the hierarchical form, the others a flat
    ring); --trace writes the predicted timeline for Perfetto; --wide adds the other mode's
    prediction and what communication cost the compute.
    """
    modelled = [str(m) for m in MODES]
    if mode is not None and mode not in modelled:
        raise typer.BadParameter(f"expected one of {', '.join(modelled)}, got {mode!r}",
                                 param_hint="--mode")
    original, prof = common.load_retargeted(
        profile, world_size, bandwidth_gbps, latency_us,
        common.levels(nodes, ranks_per_node, intra_gbps, inter_gbps, intra_latency_us,
                      inter_latency_us))
    sched = load_schedule(schedule)
    problem = Problem.from_profile(prof)
    tl = run_simulation(problem, sched, mode=mode, source=str(schedule))
    other = Mode.FENCE if tl.mode != Mode.FENCE else Mode.OVERLAP
    other_ms = run_simulation(problem, sched, mode=other, check=False).iteration_ms
    charge = tl.meta.get("cpu_charge_ms", {"backward": 0.0, "forward": 0.0})
    sharded = tl.mode == Mode.SHARDED
    lb = sharded_lower_bound(problem) if sharded else lower_bound(problem)
    if sched.profile_name != original.name:
        console.warn(f"{schedule}: made for profile {sched.profile_name!r}, simulated on "
                     f"{original.name!r} (same tensors)")
    if sched.hierarchical and (prof.comm.nodes, prof.comm.world_size) != (sched.nodes, sched.world_size):
        hier = sum(k.hier for k in sched.blocks)
        console.warn(f"{schedule}: {plural(hier, 'hierarchical block')} planned for "
                     f"{plural(sched.nodes, 'node')} of {plural(sched.ranks_per_node, 'rank')}, "
                     f"simulated on {plural(prof.comm.nodes, 'node')} of "
                     f"{prof.comm.ranks_per_node}"
                     + ("" if prof.comm.hierarchical else ", which has no hierarchy: they are "
                        "costed as flat all-reduces")
                     + "; give --nodes, --ranks-per-node and --inter-gbps for its cluster")
    if trace is not None:
        common.write_trace(trace, tl, f"{original.name} / {sched.strategy} ({tl.mode}, predicted)")
    waits = sorted(tl.forward, key=lambda g: -g.wait_ms)[:5]
    if as_json:
        console.emit_json({
            "profile": original.name,
            "strategy": sched.strategy,
            "mode": tl.mode,
            "schedule_mode": sched.mode,
            "iteration_ms": tl.iteration_ms,
            f"{other}_ms": other_ms,
            "cpu_charge_ms": charge,
            "compute_ms": tl.compute_ms,
            "exposed_ms": tl.exposed_ms,
            "comm_busy_ms": tl.comm_busy_ms,
            "lower_bound_ms": lb,
            "blocks": len(tl.blocks),
            "all_gathers": len(tl.gathers),
            "schedule_predicted_ms": sched.predicted.get("iteration_ms"),
            "world_size": prof.comm.world_size,
            "cpu_ms_per_block": prof.comm.cpu_ms_per_block,
            "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
            "trace": str(trace) if trace else None,
        })
        return
    c = prof.comm
    rows = [
        ["iteration", f"{tl.iteration_ms:.3f} ms"],
        ["compute (F + B)", f"{tl.compute_ms:.3f} ms"],
        ["exposed communication", f"{tl.exposed_ms:.3f} ms"],
        ["channel busy", f"{tl.comm_busy_ms:.3f} ms in "
                         + (f"{plural(len(tl.blocks), 'reduce-scatter')} and {plural(len(tl.gathers), 'all-gather')}"
                            if sharded else plural(len(tl.blocks), "block"))],
        ["lower bound", f"{lb:.3f} ms (gap {100 * (tl.iteration_ms - lb) / lb:.2f}%)"],
        ["cluster", f"{plural(c.world_size, 'rank')}"
                    + (f" ({c.nodes} nodes x {c.ranks_per_node}), flat" if c.nodes > 1 else "")
                    + f", alpha {c.alpha_ms:.3f} ms, algbw {c.algbw_gbs:.3f} GB/s"
                    + common.cpu_cost_note(c)],
    ]
    if "iteration_ms" in sched.predicted:
        rows.append(["schedule's own prediction", f"{sched.predicted['iteration_ms']:.3f} ms"])
    if wide:
        rows.insert(1, [f"in {other} mode", f"{other_ms:.3f} ms"])
        if problem.charges_cpu:
            rows.insert(3, ["communication's compute cost",
                            f"backward +{charge['backward']:.3f} ms, forward +{charge['forward']:.3f} ms"])
    if sharded:
        rows.insert(3, ["shard step", f"{tl.update_ms:.3f} ms, forward from "
                                      f"{tl.forward_start_ms:.3f} ms"])
    if tl.mode != Mode.FENCE and waits and waits[0].wait_ms > 0:
        rows.append(["longest forward waits",
                     ", ".join(f"{g.name} {g.wait_ms:.2f} ms" for g in waits if g.wait_ms > 0)])
    console.table(f"{sched.strategy} schedule on {original.name} ({tl.mode} mode"
                  + (")" if tl.mode == sched.mode else f"; the schedule's own is {sched.mode})"),
                  ["", "value"], rows)
    if trace:
        console.info(f"wrote {trace}")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
