"""``usbyte-opt optimize``: score every strategy on a profile and write the chosen schedule."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import console
from ..console import plural
from ..errors import UsageError, UsbyteError
from ..formats import Mode, Runner, Schedule, save_schedule
from ..planning.planner import BEST_FLAT, Progress, compare, gc_paused
from ..planning.problem import UpdateRule
from ..planning.simulate import simulate
from ..planning.strategies import load_builtin
from . import common


def optimize(
    profile: Annotated[Path, typer.Argument(
        dir_okay=False, help="Profile JSON (see `usbyte-opt schema profile`).")],
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", dir_okay=False, callback=common.output_file,
        help="Schedule to write (default: schedules/NAME.json, NAME the profile's name). A "
             "schedule the repository ships is not replaced without --force.")] = None,
    strategy: Annotated[str, typer.Option(
        "--strategy", "-s", help="Strategy whose schedule is written: wfbp, ddp, ddp-tuned, "
                                 "mgwfbp, bytescheduler, usbyte or best (on several nodes also "
                                 "best-flat). ddp-tuned also prints the bucket_cap_mb_list that "
                                 "gives stock PyTorch DDP its buckets.")] = "best",
    world_size: common.WorldSize = None,
    bandwidth_gbps: common.BandwidthGbps = None,
    latency_us: common.LatencyUs = None,
    nodes: common.Nodes = None,
    ranks_per_node: common.RanksPerNode = None,
    intra_gbps: common.IntraGbps = None,
    inter_gbps: common.InterGbps = None,
    intra_latency_us: common.IntraLatencyUs = None,
    inter_latency_us: common.InterLatencyUs = None,
    hierarchy: Annotated[str, typer.Option(
        "--hierarchy", help="On several nodes: on (best all-reduces each block flat or "
                            "hierarchically, whichever is cheaper; best-flat is shown beside it) "
                            "or off (every block flat, as DDP over NCCL).")] = "on",
    bucket_cap_mb: Annotated[float, typer.Option(
        "--bucket-cap-mb", min=0.001, help="Bucket size of the ddp strategy, MiB (PyTorch's "
                                           "default 25).")] = 25.0,
    time_budget: Annotated[float, typer.Option(
        "--time-budget", min=0.0, help="Seconds of local search for best, at most, in processor "
                                       "time (it stops earlier when no move helps).")] = 0.6,
    mode: Annotated[Optional[str], typer.Option(
        "--mode", help="Plan best in this mode only: fence (every block done by the end of "
                       "backward: what runs in a trainer, whose clipping waits for the averaged "
                       "gradients; docs/integrations.md) or overlap. Default: the faster.")] = None,
    shard: Annotated[bool, typer.Option(
        "--shard", help="Plan sharded mode (ZeRO-1: each block reduce-scattered in backward, "
                        "each rank steps its shard, the parameters all-gathered before the "
                        "next forward needs them) with fsdp-like, dear-like and best-sharded "
                        "(--strategy best means best-sharded); the table adds each plan's "
                        "optimizer state per rank beside its time.")] = False,
    optimizer: Annotated[Optional[str], typer.Option(
        "--optimizer", help="With --shard: the optimizer whose state the memory column counts "
                            "(sgd: a momentum buffer, adam or adamw: two moments); default: the "
                            "one the profile timed.")] = None,
    trace: common.Trace = None,
    as_json: common.Json = False,
    wide: common.Wide = False,
    force: common.Force = False,
) -> None:
    """Plan PROFILE with every strategy, compare them, write the schedule of --strategy.

    The schedule (default: best's) is what `usbyte-opt launch` and DistributedOptimizer use.
    Each plan runs in a mode, written into its schedule: fence (every block, then every
    update, as DDP: wfbp, ddp, ddp-tuned, mgwfbp) or overlap (each update gated in the next
    forward: bytescheduler, usbyte); best takes whichever mode is faster for its blocks.
    ddp-tuned is stock PyTorch DDP with the best bucket sizes for the profile: with
    --strategy ddp-tuned the command also prints them as DDP's bucket_cap_mb_list (in the JSON
    with --json), and usbyte_opt.ddp.wrap(model, SCHEDULE) builds that DDP model. "predicted ms"
    is the one scorer's prediction in that mode (docs/planner.md), with the profile's
    compute-cost fields when it has them, and the host cost of what runs the schedule (the
    profile's host section, else its defaults: the usbyte-opt runtime, or torch DDP for ddp and
    ddp-tuned). best is never predicted slower than any other strategy's blocks on the
    runtime; torch DDP, whose host cost per tensor is lower, can be predicted faster where
    communication leaves little to win (a warning then says so). --wide adds both modes'
    times, the speedup over wfbp and the exposed communication. On a terminal, planning that
    takes over a second shows its progress on stderr, one line per strategy. With --shard it plans sharded mode instead
    (docs/planner.md, "Sharded mode") against that mode's own lower bound, and shows
    unsharded DDP's time and memory beside it.

    Several nodes (a profile measured on them, or --nodes with --inter-gbps): every strategy
    but best runs flat rings, best-flat is best restricted to them, and best all-reduces each
    block hierarchically where that is cheaper (the "hier/blocks" column; --hierarchy off: flat
    only). docs/planner.md, "Several nodes".
    """
    if hierarchy not in ("on", "off"):
        raise typer.BadParameter(f"expected on or off, got {hierarchy!r}", param_hint="--hierarchy")
    by_nodes = common.levels(nodes, ranks_per_node, intra_gbps, inter_gbps, intra_latency_us,
                             inter_latency_us)
    if output is not None:
        common.refuse_shipped(output, "--output", "schedule", force)
    # Reading, planning and writing allocate millions of short-lived objects and no cycles
    # that matter: the cyclic collector's passes over them would cost up to a third of the time.
    with gc_paused():
        if shard:
            _optimize_sharded(profile, output, strategy, world_size, bandwidth_gbps, latency_us,
                              optimizer, trace, as_json, force, by_nodes)
        else:
            _optimize(profile, output, strategy, world_size, bandwidth_gbps, latency_us,
                      bucket_cap_mb, time_budget, mode, optimizer, trace, as_json, wide, force,
                      by_nodes, hierarchy == "on")


def _optimize(profile: Path, output: Path | None, strategy: str, world_size: int | None,
              bandwidth_gbps: float | None, latency_us: float | None, bucket_cap_mb: float,
              time_budget: float, mode: str | None, optimizer: str | None, trace: Path | None,
              as_json: bool, wide: bool, force: bool, by_nodes: dict[str, Any] | None = None,
              hierarchy: bool = True) -> None:
    """``optimize`` without ``--shard``."""
    if optimizer is not None:
        raise typer.BadParameter("only with --shard (the memory column)", param_hint="--optimizer")
    registry = load_builtin()
    if strategy not in registry and strategy != BEST_FLAT:
        raise typer.BadParameter(f"expected one of {', '.join(registry)} (or {BEST_FLAT} on "
                                 "several nodes)", param_hint="--strategy")
    if mode is not None and mode not in (Mode.FENCE, Mode.OVERLAP):
        raise typer.BadParameter(f"expected fence or overlap, got {mode!r}", param_hint="--mode")
    original, prof = common.load_retargeted(profile, world_size, bandwidth_gbps, latency_us,
                                            by_nodes)
    out = _output(output, original, force)
    with progress_display(enabled=not as_json) as say:
        best_opts: dict[str, object] = {"time_budget_s": time_budget}
        if mode is not None:
            best_opts["modes"] = (mode,)
        # workers=2: usbyte planned in a second process beside the others (large profiles)
        report = compare(prof, options={"ddp": {"bucket_cap_mb": bucket_cap_mb},
                                        "best": best_opts},
                         progress=say, workers=2, hierarchy=hierarchy)
    if strategy in report.skipped:
        raise UsbyteError(report.skipped[strategy])
    if strategy not in report.results:
        raise UsageError(f"--strategy {strategy}: planned only on several nodes of several ranks "
                         "with --hierarchy on (this profile: "
                         f"{plural(prof.comm.nodes, 'node')} of {prof.comm.ranks_per_node}); "
                         "expected best")
    written = _write(report, strategy, original, out, trace, profile)
    if as_json:
        console.emit_json(_document(report, written, prof, original.name))
    else:
        _print(report, written, prof, original.name, wide, mode)


def _optimize_sharded(profile: Path, output: Path | None, strategy: str, world_size: int | None,
                      bandwidth_gbps: float | None, latency_us: float | None,
                      optimizer: str | None, trace: Path | None, as_json: bool, force: bool,
                      by_nodes: dict[str, Any] | None = None) -> None:
    """``optimize --shard``."""
    from ..planning.sharded import STATE_SLOTS
    from ..planning.strategies import load_sharded

    registry = load_sharded()
    strategy = "best-sharded" if strategy == "best" else strategy
    if strategy not in registry:
        raise typer.BadParameter(f"expected one of {', '.join(registry)} (or best) with --shard",
                                 param_hint="--strategy")
    if optimizer is not None and optimizer not in STATE_SLOTS:
        raise typer.BadParameter(f"expected one of {', '.join(STATE_SLOTS)}, got {optimizer!r}",
                                 param_hint="--optimizer")
    original, prof = common.load_retargeted(profile, world_size, bandwidth_gbps, latency_us,
                                            by_nodes)
    out = _output(output, original, force)
    with progress_display(enabled=not as_json) as say:
        report = compare(prof, shard=True, progress=say, optimizer=optimizer)
    if strategy in report.skipped:
        raise UsbyteError(report.skipped[strategy])
    written = _write(report, strategy, original, out, trace, profile)
    ref = report.reference
    assert ref is not None
    if as_json:
        doc = _document(report, written, prof, original.name)
        doc["reference"] = {"strategy": ref.name, "iteration_ms": ref.iteration_ms,
                            "mode": ref.mode, "state_bytes_per_rank": ref.state_bytes}
        doc["state_slots"] = report.state_slots
        console.emit_json(doc)
        return
    rows = []
    for n, r in report.results.items():
        rows.append([n + (" *" if n == strategy else ""), f"{r.iteration_ms:.2f}",
                     f"{ref.iteration_ms / r.iteration_ms:.3f}x", _mb(r.state_bytes),
                     f"{r.state_bytes / ref.state_bytes:.2f}x" if ref.state_bytes else "-",
                     r.blocks, r.gathers, f"{r.solve_s:.3f}"])
    rows.append([f"{ref.name} (unsharded, {ref.mode})", f"{ref.iteration_ms:.2f}", "1.000x",
                 _mb(ref.state_bytes), "1.00x", ref.blocks, "-", "-"])
    c = prof.comm
    w = written
    console.table(
        f"{original.name}, sharded: {plural(len(prof.tensors), 'tensor')}, compute {report.compute_ms:.2f} ms, "
        f"{plural(c.world_size, 'rank')}, all-reduce alpha {c.alpha_ms:.3f} ms, algbw {c.algbw_gbs:.3f} GB/s"
        + ("" if c.reduce_scatter or c.all_gather else " (reduce-scatter and all-gather: half "
           "an all-reduce each, not measured)") + common.cpu_cost_note(c),
        ["strategy", "predicted ms", "vs ddp", "state MB", "state vs ddp", "blocks", "gathers",
         "solve s"],
        rows, justify_right_from=1,
        caption=f"sharded mode; state MB: optimizer state per rank ({report.state_slots} x the "
                f"gradients' bytes unsharded); blocks: reduce-scatters, gathers: all-gathers; "
                f"sharded lower bound {report.lower_bound_ms:.2f} ms; {w.strategy} is "
                f"{100 * w.schedule.predicted['gap']:.2f}% above it")
    for skipped, why in report.skipped.items():
        console.warn(f"{skipped}: no plan: {why}")
    console.info(f"wrote {w.path}" + (f" and {w.trace}" if w.trace else ""))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


@dataclass(frozen=True, slots=True)
class Written:
    """What ``optimize`` wrote: the chosen strategy's schedule, where, and its extras."""

    strategy: str
    schedule: Schedule
    path: Path
    trace: Path | None
    caps: list[float] | None
    """DDP's ``bucket_cap_mb_list`` for ``ddp-tuned``, and for ``best`` where torch DDP runs it."""


def _write(report: Any, strategy: str, original: Any, out: Path, trace: Path | None,
           profile: Path | None = None) -> Written:
    """Write the schedule of ``strategy`` (and its predicted trace, when asked). The schedule
    records where its profile is (``profile_path``, relative to the schedule's folder), so
    that ``launch`` finds it under any name to re-predict another world size."""
    sched = dataclasses.replace(report.schedule(strategy, profile_digest=original.digest()),
                                model=planned_model(original))
    if profile is not None:
        where = os.path.relpath(Path(profile).resolve(), out.resolve().parent)
        sched = dataclasses.replace(sched, extra={**sched.extra, "profile_path": where})
    caps = None
    if strategy == "ddp-tuned" or (sched.runner is Runner.DDP and strategy != "ddp"):
        # stock DDP with the planned buckets (ddp-tuned, or best where torch DDP runs it)
        caps = sched.bucket_cap_mb_list(str(out))
    save_schedule(sched, out)
    if trace is not None:
        common.write_trace(trace, simulate(report.problem, sched, check=False),
                           f"{original.name} / {strategy} ({sched.mode}, predicted)")
    return Written(strategy, sched, out, trace, caps)


def _output(output: Path | None, original: Any, force: bool) -> Path:
    """Where the schedule goes: ``output``, else ``schedules/NAME.json``, checked before any
    planning (a shipped schedule is not replaced without ``--force``)."""
    if output is not None:
        return output
    out = Path("schedules") / f"{original.name}.json"
    common.refuse_shipped(out, "default output", "schedule", force)
    return common.check_output_file(out, "default output")


def planned_model(profile: Any) -> str:
    """The model a schedule of ``profile`` is planned for (its ``model`` field): the profile's
    ``meta.model``, else its name."""
    named = profile.meta.get("model")
    return named if isinstance(named, str) and named else profile.name


def _document(report: Any, w: Written, prof: Any, name: str) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "profile": name,
        "world_size": prof.comm.world_size,
        "alpha_ms": prof.comm.alpha_ms,
        "algbw_gbs": prof.comm.algbw_gbs,
        "cpu_ms_per_block": prof.comm.cpu_ms_per_block,
        "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
        "compute_ms": report.compute_ms,
        **({"nodes": prof.comm.nodes, "ranks_per_node": prof.comm.ranks_per_node}
           if prof.comm.nodes > 1 else {}),
        "strategies": {n: {"iteration_ms": r.iteration_ms, "mode": r.mode,
                           "runner": str(r.plan.runner),
                           "speedup_vs_ddp": _speedup(report, r.iteration_ms),
                           "overlap_ms": r.overlap_ms, "fence_ms": r.fence_ms,
                           "blocks": r.blocks, "solve_s": r.solve_s,
                           **({"blocks_hier": report.hier_blocks(n)} if report.hierarchical else {}),
                           "state_bytes_per_rank": r.state_bytes,
                           **({"all_gathers": r.gathers} if r.plan.gathers is not None else {})}
                       for n, r in report.results.items()},
        "lower_bound_ms": report.lower_bound_ms,
        "lower_bound_s": report.bound_s,
        "gap": w.schedule.predicted["gap"],
        "chosen": w.strategy,
        "mode": w.schedule.mode,
        "runner": str(w.schedule.runner),
        "output": str(w.path),
        "trace": str(w.trace) if w.trace else None,
        **({"bucket_cap_mb_list": w.caps} if w.caps is not None else {}),
        **({"skipped": report.skipped} if report.skipped else {}),
    }


def _speedup(report: Any, ms: float) -> float | None:
    """Speedup over ``ddp``'s predicted time (``> 1``: faster than DDP); ``None`` without it."""
    ddp = report.results.get("ddp")
    return ddp.iteration_ms / ms if ddp is not None and ms > 0 else None


def slower_than_a_row(report: Any, strategy: str, mode: str | None = None) -> str | None:
    """The warning line ``optimize`` prints when ``strategy``'s plan is predicted slower than
    another row of the table (``None`` when it is not): which row, both times, both speedups
    over DDP, and which ``--strategy`` writes the faster plan. ``mode``: the ``--mode`` that
    held best to one mode (a faster row in the other mode is then the price of that choice)."""
    res = report.results
    chosen = res[strategy].iteration_ms
    faster = [(r.iteration_ms, n) for n, r in res.items()
              if n != strategy and r.iteration_ms < chosen * (1 - 1e-9)]
    if not faster:
        return None
    ms, fastest = min(faster)
    ddp = res["ddp"].iteration_ms
    several = fastest == "ddp" and len(res["ddp"].plan.layout.buffers) > 1
    held = strategy == "best" and mode is not None and res[fastest].mode != mode
    why = (f"--mode {mode} plans best in {mode} mode only, and {fastest} runs in "
           f"{res[fastest].mode} mode: leave --mode out for the faster plan" if held else
           "torch DDP's own buckets of several dtypes are not a bucket list a schedule can give "
           "it: keep torch DDP" if strategy == "best" and several else
           "best weighs every row's blocks on both runners, so this is a planner fault: please "
           "report it" if strategy == "best" else "best is never slower than any row"
           + (" but ddp's own buckets of several dtypes" if several else ""))
    return (f"{strategy} is predicted slower than {fastest}: {chosen:.2f} ms against {ms:.2f} "
            f"({ddp / chosen:.3f}x against {ddp / ms:.3f}x speedup over ddp); {why} "
            f"(--strategy {fastest if strategy == 'best' else 'best'})")


def _print(report: Any, w: Written, prof: Any, name: str, wide: bool,
           mode: str | None = None) -> None:
    """The comparison table and what was written, for a terminal."""
    res = report.results
    wfbp = res["wfbp"].iteration_ms
    ddp = res["ddp"].iteration_ms
    rows = []
    for n, r in res.items():
        mark = " *" if n == w.strategy else ""
        blocks = f"{report.hier_blocks(n)}/{r.blocks}" if report.hierarchical else r.blocks
        row = [n + mark, r.mode, _runner_cell(r.plan.runner), f"{r.iteration_ms:.2f}",
               f"{ddp / r.iteration_ms:.3f}x", blocks, f"{r.solve_s:.3f}"]
        if wide:
            row[5:5] = [f"{r.overlap_ms:.2f}", f"{r.fence_ms:.2f}", f"{wfbp / r.iteration_ms:.3f}x",
                        f"{r.iteration_ms - report.compute_ms:.2f}"]
        rows.append(row)
    columns = ["strategy", "mode", "runner", "predicted ms", "vs ddp",
               "hier/blocks" if report.hierarchical else "blocks", "solve s"]
    if wide:
        columns[5:5] = ["overlap ms", "fence ms", "vs wfbp", "exposed ms"]
    c = prof.comm
    console.table(
        f"{name}: {plural(len(prof.tensors), 'tensor')}, compute {report.compute_ms:.2f} ms "
        f"(F {prof.forward_ms:.2f} + B {prof.backward_ms:.2f}), {plural(c.world_size, 'rank')}"
        + (f" ({c.nodes} nodes x {c.ranks_per_node})" if c.nodes > 1 else "")
        + f", {'flat ' if c.nodes > 1 else ''}alpha {c.alpha_ms:.3f} ms, algbw {c.algbw_gbs:.3f} GB/s"
        + _levels_note(c) + common.cpu_cost_note(c),
        columns,
        rows,
        justify_right_from=3,
        caption=f"runner: what runs the plan (DDP: torch DDP's reducer with the planned buckets; "
                f"runtime: the usbyte-opt runtime); "
                f"vs ddp: speedup over ddp's predicted time (>1 is faster); lower bound "
                f"{report.lower_bound_ms:.2f} ms (per runner, in the modes it runs); {w.strategy} "
                f"({w.schedule.mode} mode, run by {_runner_name(w.schedule.runner)}) "
                f"is {100 * w.schedule.predicted['gap']:.2f}% above it"
                + ("; hier/blocks: blocks all-reduced hierarchically (inside each node, across "
                   "the nodes, inside again) of all; every strategy but best runs flat rings"
                   if report.hierarchical else
                   "; every block flat (--hierarchy off)" if c.hierarchical else "")
                + f"; host cost: {common.host_line(prof.host)}"
                + ("; overlap mode's updates on the training thread at the forward's gates "
                   "(CPU ranks)" if report.problem.update_rule == UpdateRule.GATE else ""),
    )
    if w.caps is not None:
        console.paragraph(("" if w.strategy == "ddp-tuned" else f"{w.strategy} runs on torch DDP: ")
                          + f"Stock PyTorch DDP with these {plural(len(w.caps), 'bucket')}: "
                          f"DistributedDataParallel(model, bucket_cap_mb_list={short_caps(w.caps)})")
        console.paragraph(f'or usbyte_opt.ddp.wrap(model, "{w.path}"), which also checks the model '
                          "against the schedule (docs/runtime.md)")
    for skipped, why in report.skipped.items():
        console.warn(f"{skipped}: no plan: {why}")
    line = slower_than_a_row(report, w.strategy, mode)
    if line is not None:
        console.warn(line)
    console.info(f"wrote {w.path}" + (f" and {w.trace}" if w.trace else ""))


def _runner_cell(runner: Runner) -> str:
    """How the table's ``runner`` column names a runner."""
    return "DDP" if runner is Runner.DDP else "runtime"


def _runner_name(runner: Runner) -> str:
    """How the caption names a runner."""
    return "torch DDP's reducer" if runner is Runner.DDP else "the usbyte-opt runtime"


def _levels_note(c: Any) -> str:
    """``", intra ..., inter ..."`` of a comm of several nodes with both level lines, else ``""``.

    Example::

        >>> from usbyte_opt.formats import CollectiveCost, CommSpec
        >>> _levels_note(CommSpec("nccl", 16, 0.3, 13.3, nodes=2, intra=CollectiveCost(0.014, 85.0),
        ...                       inter=CollectiveCost(0.02, 25.0)))
        '; intra 0.014 ms + 85.000 GB/s, inter 0.020 ms + 25.000 GB/s'
    """
    if c.intra is None or c.inter is None:
        return ""
    return (f"; intra {c.intra.alpha_ms:.3f} ms + {c.intra.algbw_gbs:.3f} GB/s, inter "
            f"{c.inter.alpha_ms:.3f} ms + {c.inter.algbw_gbs:.3f} GB/s")


def short_caps(caps: list[float]) -> str:
    """``caps`` (MiB) as a Python list, each in the fewest digits that DDP reads as the same
    number of bytes (``int(cap * 1024 * 1024)``).

    Example::

        >>> short_caps([(4 * 2**20 - 0.5) / 2**20, (1000 - 0.5) / 2**20])
        '[3.9999995, 0.000953]'
    """
    out = []
    for c in caps:
        want = int(c * 1024 * 1024)
        for digits in range(1, 18):
            text = f"{c:.{digits}g}"
            if int(float(text) * 1024 * 1024) == want:
                break
        out.append(text)
    return "[" + ", ".join(out) + "]"


@contextmanager
def progress_display(enabled: bool = True, after_s: float = 1.0) -> Iterator[Progress]:
    """A :data:`usbyte_opt.planning.planner.Progress` callback that shows rich's progress display on
    stderr, one line per strategy, once planning has run ``after_s`` seconds; nothing when
    not ``enabled`` or when stderr is not a terminal."""
    if not enabled or not console.err.is_terminal:
        yield lambda event, name, seconds: None
        return
    from rich.progress import Progress as Bar
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    lock = threading.Lock()
    state: dict[str, Any] = {"bar": None, "events": [], "tasks": {}}

    def apply(bar: Any, event: str, name: str, seconds: float) -> None:
        tasks = state["tasks"]
        if event == "start":
            tasks[name] = bar.add_task(name, total=1)
        elif name in tasks:
            bar.update(tasks[name], completed=1, description=f"{name}: {seconds:.2f} s")

    def start() -> None:
        with lock:
            bar = Bar(SpinnerColumn(finished_text="✓"), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=console.err, transient=True)
            bar.start()
            for ev in state["events"]:
                apply(bar, *ev)
            state["bar"] = bar

    def say(event: str, name: str, seconds: float) -> None:
        with lock:
            if state["bar"] is None:
                state["events"].append((event, name, seconds))
            else:
                apply(state["bar"], event, name, seconds)

    timer = threading.Timer(after_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield say
    finally:
        timer.cancel()
        with lock:
            if state["bar"] is not None:
                state["bar"].stop()


def register(app: typer.Typer) -> None:
    app.command("optimize")(optimize)
