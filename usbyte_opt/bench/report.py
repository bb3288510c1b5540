"""From the ranks' raw timings to the benchmark's result: statistics, errors, speedups, the
Markdown report and the side-by-side traces. Pure Python (no torch).

Definitions, per strategy:

* ``measured_ms``: the median of the steady-state iteration times (each the mean over ranks
  of one iteration, forward start to forward start); ``p10_ms``/``p90_ms`` their spread.
* ``predicted_ms``: the planner's prediction (docs/planner.md, with the profile's compute-cost
  option when it carries one) on the profile, in ``predicted_mode``, the mode the schedule
  runs in (fence for PyTorch DDP); for ``no-comm`` forward + backward + optimizer step;
  ``None`` where nothing is predicted (``fsdp2``, torch's own).
* ``error``: ``(measured - predicted) / measured`` (positive: slower than predicted).
* ``refined_ms`` / ``refined_error``: the same with the runtime's update rule (overlap mode),
  the all-reduce cost measured while training computes and the training-thread costs the
  bench measured, charged by the planner's rule (:mod:`usbyte_opt.bench.refine`), on compute
  recalibrated to the side-by-side ``no-comm`` run (``compute_scale`` = its measured median
  over the profile's forward + backward + step; 1 without it).
* ``speedup_vs_ddp``: DDP's time over this one's, from the paired windows (each turn's median,
  a strategy's turn paired with DDP's of the same round: :mod:`usbyte_opt.verdict`), with
  ``vs_ddp`` holding its 95% interval (``lo``, ``hi``), the ``pairs`` and the ``verdict``
  ("<strategy> faster", "DDP faster" or "not distinguishable on this machine (±X%)");
  without windows (fewer than 2 pairs), DDP's measured median over this one and no interval
  (``predicted_speedup_vs_ddp``: the same with predictions).
* ``vs_lower_bound``: measured over the proven lower bound; below 1 the measurement is timing
  noise (:func:`below_bound` says so, and why).
* ``state_bytes``: the optimizer state's bytes on the rank holding most of it, after training
  (its peak: the optimizers trained with only grow their state); ``state_bytes_by_rank`` per
  rank. The whole model's under DDP, about ``1 / world_size`` of it under ``fsdp2`` and the
  runtime's sharded strategies. ``predicted_state_bytes``: the planner's, where it predicts it.

:func:`explain` (what ``usbyte-opt demo`` prints) splits how far each prediction was off into
the part compute explains and the part communication does, and says whether the verdict
against DDP holds.

Example::

    >>> stats([10.0, 12.0, 11.0, 30.0, 11.0])
    {'median_ms': 11.0, 'p10_ms': 10.4, 'p90_ms': 22.8, 'mean_ms': 14.8}
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..collectives.sweep import median
from ..errors import plural
from ..profiler.timing import quantile
from ..verdict import Budget, Ratio
from .worker import DDP_TUNED, REFERENCE, TORCH_DDP, TORCH_FSDP2

#: Largest parameter difference from the reference that still counts as "same training":
#: absolute for parameters of magnitude up to 1, relative above (``max_param_diff`` is
#: ``max |a - b| / max(1, |b|)``), so large weights in reduced precision are not judged by
#: an absolute bound (the runtime and DDP agree bitwise in practice in fp32).
PARAM_TOLERANCE = 1e-4

RUNNERS = {TORCH_DDP: "torch DDP", DDP_TUNED: "torch DDP", TORCH_FSDP2: "torch FSDP2",
           REFERENCE: "no comm"}

#: The one line that a run on one rank gets in the result (``single_rank``), the report and
#: on the terminal (``bench``, ``demo``).
SINGLE_RANK_NOTE = ("one rank: no communication to win; every prediction is compute plus the "
                    "host cost of what runs it (the runtime's or torch DDP's, per tensor and "
                    "per block: the profile's host section), not a network's")


def stats(durations: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90 and mean of ``durations`` (ms)."""
    if not durations:
        return {"median_ms": math.nan, "p10_ms": math.nan, "p90_ms": math.nan, "mean_ms": math.nan}
    return {"median_ms": round(median(durations), 6), "p10_ms": round(quantile(durations, 0.1), 6),
            "p90_ms": round(quantile(durations, 0.9), 6),
            "mean_ms": round(sum(durations) / len(durations), 6)}


def budget_of(job: dict[str, Any]) -> Budget:
    """The budget of rounds the bench took (:class:`~usbyte_opt.verdict.Budget`): its level is
    that of the intervals it decided on, and reported.

    Example::

        >>> budget_of({"rounds": 4, "iterations": 12, "max_rounds": 12}).looks()
        [4, 8, 12]
        >>> budget_of({"rounds": 2, "iterations": 8}).level()     # no round added: one look
        0.95
    """
    least = max(1, min(int(job.get("rounds", 1)), int(job.get("iterations", 1))))
    return Budget(least, max(least, int(job.get("max_rounds", 0))))


def vs_ddp(ddp_windows: Sequence[float], windows: Sequence[float], budget: Budget) -> Ratio:
    """DDP's time over a strategy's (its speed-up) from paired windows, with the interval.

    Example::

        >>> r = vs_ddp([100.0, 104.0, 98.0, 101.0], [90.0, 95.0, 88.0, 91.0], Budget(4, 4))
        >>> print(r)
        1.11x (95% CI 1.09–1.12x)
    """
    from ..verdict import compare

    n = min(len(ddp_windows), len(windows))
    return compare(ddp_windows[:n], windows[:n], budget.level(), budget.confidence).inverse()


def summarize(raw: dict[str, Any], network: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The result document (what ``--json`` prints) from the rank-0 ``raw`` record."""
    predicted = raw["planned"]["predicted"]
    runs = []
    ddp = raw["runs"].get(TORCH_DDP)
    ddp_ms = stats(ddp["durations_ms"])["median_ms"] if ddp else None
    budget = budget_of(raw["job"])
    ddp_pred = predicted[TORCH_DDP]["ms"] if TORCH_DDP in predicted else None
    lb_all = raw["planned"]["lower_bound_ms"]
    lb_sharded = raw["planned"].get("sharded_lower_bound_ms")
    for s, run in raw["runs"].items():
        st = stats(run["durations_ms"])
        p = predicted[s]
        m = st["median_ms"]
        p_ms = p["ms"]
        # A sharded schedule is held against sharded mode's bound; fsdp2 (ZeRO-3) against none.
        lb = lb_sharded if p["mode"] == "sharded" else (None if p["mode"] == "none" else lb_all)
        refined = p.get("refined_ms")
        refined = p_ms if refined is None else refined
        rt = run.get("runtime") or {}
        by_rank = run.get("state_bytes_by_rank") or []
        paired = None
        if ddp and s not in (TORCH_DDP, REFERENCE) and ddp.get("windows_ms") and run.get("windows_ms"):
            r = vs_ddp(ddp["windows_ms"], run["windows_ms"], budget)
            if r.pairs >= 2:
                paired = {**r.to_dict(), "verdict": r.inverse().verdict("DDP", s)}
        speedup = (paired["ratio"] if paired else
                   round(ddp_ms / m, 6) if ddp_ms and m and s != REFERENCE else None)
        runner = RUNNERS.get(s, "runtime" if p["mode"] != "sharded" else
                             f"runtime sharded, ZeRO-{(rt.get('memory') or {}).get('zero_stage', 1)}")
        row = {
            "strategy": s,
            "runner": runner,
            "measured_ms": m,
            "p10_ms": st["p10_ms"],
            "p90_ms": st["p90_ms"],
            "spread": round((st["p90_ms"] - st["p10_ms"]) / m, 6) if m else None,
            "iterations": len(run["durations_ms"]),
            "state_bytes": max(by_rank) if by_rank else None,
            "state_bytes_by_rank": by_rank or None,
            "predicted_state_bytes": p.get("state_bytes"),
            # Sharded mode, rank 0: gradient memory held for the whole run (ZeRO-1's flat
            # buffers; ZeRO-2: none) and the most held at once in backward.
            "gradient_kept_bytes": (rt.get("memory") or {}).get("kept"),
            "gradient_backward_peak_bytes": (rt.get("memory") or {}).get("backward_peak"),
            "predicted_ms": None if p_ms is None else round(p_ms, 6),
            "predicted_mode": p["mode"],
            "error": round((m - p_ms) / m, 6) if m and p_ms is not None else None,
            "refined_ms": None if refined is None else round(refined, 6),
            "refined_error": round((m - refined) / m, 6) if m and refined is not None else None,
            "speedup_vs_ddp": speedup,
            "vs_ddp": paired,
            "predicted_speedup_vs_ddp": (round(ddp_pred / p_ms, 6)
                                         if ddp_pred and p_ms and s != REFERENCE else None),
            "vs_lower_bound": round(m / lb, 6) if m and lb and s != REFERENCE else None,
            "runtime_chosen": rt.get("chosen"),
            "blocks": p["blocks"],
            "final_loss": run["final_loss"],
            "max_param_diff": run["max_param_diff"],
            # In the lab: bytes sent on the shaped links per iteration, every node's together.
            "link_bytes_per_iteration": run.get("link_bytes_per_iteration"),
            "schedule": raw["schedules"].get(s),
            "trace": raw["traces"].get(s),
        }
        runs.append(row)
    checked = [r["max_param_diff"] for r in runs if r["max_param_diff"] is not None]
    return {
        "model": raw["job"]["model"],
        "name": raw["profile_name"],
        "world_size": raw["world_size"],
        "network": network,
        "device": raw["device"],
        "backend": raw["backend"],
        "threads_per_rank": raw["threads"],
        # deterministic kernels in the whole rank, profile and trainees ($USBYTE_BENCH_DETERMINISTIC)
        "deterministic": raw.get("deterministic", False),
        "batch_size": raw["batch_size"],
        "torch": raw["torch"],
        "profile": raw["profile"],
        "forward_ms": raw["forward_ms"],
        "backward_ms": raw["backward_ms"],
        "update_ms": raw["planned"]["update_ms"],
        "comm": {k: raw["comm"][k] for k in ("backend", "alpha_ms", "algbw_gbs", "cpu_ms_per_block",
                                            "cpu_ms_per_mb", "nodes", "intra", "inter")
                 if k in raw["comm"]},
        "loaded_comm": ({**{k: raw["loaded_comm"].get(k) for k in ("alpha_ms", "algbw_gbs", "cpu_ms_per_mb",
                                                                     "cpu_ms_per_block", "step_alone_ms",
                                                                     "samples")},
                         # with sharded strategies: their collectives under compute too
                         **{k: v for k, v in raw["loaded_comm"].items()
                            if k in ("reduce_scatter", "all_gather")}}
                        if raw.get("loaded_comm") else None),
        "gradient_bytes": raw["gradient_bytes"],
        "allreduce_all_ms": raw["comm"]["alpha_ms"] + raw["gradient_bytes"] / (raw["comm"]["algbw_gbs"] * 1e6),
        "lower_bound_ms": raw["planned"]["lower_bound_ms"],
        "sharded_lower_bound_ms": raw["planned"].get("sharded_lower_bound_ms"),
        "compute_scale": raw.get("compute_scale", 1.0),
        "iterations": raw["job"]["iterations"],
        "rounds": raw["job"]["rounds"],
        "reference": raw["reference"],
        "correct": all(d <= PARAM_TOLERANCE for d in checked) if checked else None,
        "param_tolerance": PARAM_TOLERANCE,
        "runs": runs,
        "phases_s": raw["phases_s"],
        "out_dir": str(out_dir),
        "single_rank": SINGLE_RANK_NOTE if raw["world_size"] == 1 and not raw.get("emulated") else None,
        # the emulated link (--emulate): its spec, and the link in words (network.description)
        "emulated": raw.get("emulated"),
        "emulated_link": raw.get("emulated_link"),
        "compile": raw.get("compile"),
        "host": _host_of(raw.get("profile")),
    }


def _host_of(path: Any) -> dict[str, Any] | None:
    """The host cost the predictions charged: the profile's ``host`` section (with
    ``defaulted`` where the profile has none), ``None`` where the profile cannot be read."""
    import dataclasses

    from ..errors import UsbyteError
    from ..formats import load_profile

    try:
        host = load_profile(path).host if path else None
    except (UsbyteError, OSError):
        return None
    return None if host is None else dataclasses.asdict(host)


def _f(x: Any, fmt: str = ".1f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:{fmt}}{suffix}"


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The report's table, one row per strategy (shared by Markdown and the terminal)."""
    rows = []
    for r in result["runs"]:
        state = r.get("state_bytes")
        rows.append([r["strategy"], r["runner"], _f(r["measured_ms"]),
                     f"{_f(r['p10_ms'])}–{_f(r['p90_ms'])}",
                     _f(None if state is None else state / 1e6, ".2f"), _f(r["predicted_ms"]),
                     r["predicted_mode"], _f(None if r["error"] is None else 100 * r["error"], "+.1f", "%"),
                     _f(r["refined_ms"]),
                     _f(None if r["refined_error"] is None else 100 * r["refined_error"], "+.1f", "%"),
                     _vs_ddp_cell(r), _f(r["predicted_speedup_vs_ddp"], ".2f", "x"),
                     _bound_cell(r.get("vs_lower_bound")), _f(r["blocks"], "d"),
                     _f(r["max_param_diff"], ".1e")])
    return rows


def _vs_ddp_cell(row: dict[str, Any]) -> str:
    """``1.05x (0.98–1.12)``: the speed-up against DDP and its interval, when measured in
    paired windows."""
    v = row.get("vs_ddp")
    if v and v.get("lo") is not None:
        return f"{v['ratio']:.2f}x ({v['lo']:.2f}–{v['hi']:.2f})"
    return _f(row.get("speedup_vs_ddp"), ".2f", "x")


def _bound_cell(x: float | None) -> str:
    """Measured over the lower bound; ``noise`` below 1 (:func:`below_bound`), never rounded
    up to 1.

    Example::

        >>> _bound_cell(1.234), _bound_cell(0.9995), _bound_cell(None)
        ('1.23x', '0.99x noise', '—')
    """
    if x is not None and x < 1.0:
        return f"{math.floor(100 * x) / 100:.2f}x noise"
    return _f(x, ".2f", "x")


def below_bound(result: dict[str, Any]) -> list[str]:
    """One sentence per strategy measured faster than its proven lower bound: that is timing
    noise, not a speed, and why it can happen here.

    Example::

        >>> res = {"compute_scale": 0.8, "runs": [
        ...     {"strategy": "best", "vs_lower_bound": 0.83, "measured_ms": 83.0}]}
        >>> print(below_bound(res)[0])  # doctest: +NORMALIZE_WHITESPACE
        best measured 83.0 ms, 0.83x the lower bound: below the lower bound: timing noise (the
        bound holds for the profiled compute, and this run's compute took x0.80 of it)
    """
    out = []
    scale = result.get("compute_scale") or 1.0
    for r in result["runs"]:
        x = r.get("vs_lower_bound")
        if x is None or x >= 1.0:
            continue
        why = (f"the bound holds for the profiled compute, and this run's compute took x{scale:.2f} of it"
               if scale < 1.0 else "the machine's speed changed while it was measured")
        out.append(f"{r['strategy']} measured {r['measured_ms']:.1f} ms, {_bound_cell(x)[:-6]} the lower bound: "
                   f"below the lower bound: timing noise ({why})")
    return out


COLUMNS = ["strategy", "runs on", "measured ms", "p10–p90", "state MB", "predicted ms", "mode", "error",
           "refined ms", "refined error", "vs DDP", "predicted vs DDP", "vs bound", "blocks",
           "max |Δparam|"]


def training_verdict(result: dict) -> str:
    """The equality line: every strategy has the "same parameters as" the reference (the
    largest difference within the tolerance), or which one "differs by" how much.

    Example::

        >>> r = {"reference": "ddp", "param_tolerance": 1e-5, "runs": [
        ...     {"strategy": "best", "max_param_diff": 0.0},
        ...     {"strategy": "wfbp", "max_param_diff": 0.38}]}
        >>> training_verdict(r)
        'wfbp differs by 0.38 from `ddp` (more than 1e-05 in some parameter)'
        >>> training_verdict({**r, "runs": r["runs"][:1]})
        'same parameters as `ddp` in every run (largest difference 0)'
    """
    ref, tol = result["reference"], result["param_tolerance"]
    checked = [(r["max_param_diff"], r["strategy"]) for r in result["runs"]
               if r.get("max_param_diff") is not None]
    bad = [(d, s) for d, s in checked if d > tol]
    if bad:
        d, s = max(bad)
        others = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return f"{s} differs by {d:.3g} from `{ref}`{others} (more than {tol:g} in some parameter)"
    worst = max((d for d, _ in checked), default=0.0)
    return f"same parameters as `{ref}` in every run (largest difference {worst:.3g})"


def markdown(result: dict[str, Any], notes: Sequence[str] = ()) -> str:
    """The Markdown report of one benchmark run."""
    net = result["network"]
    c = result["comm"]
    host = result.get("host")
    lines = [
        f"# usbyte-opt bench: {result['name']} on {plural(result['world_size'], 'rank')}, {net['description']}",
        "",
        *([f"- {result['single_rank']}"] if result.get("single_rank") else []),
        *([f"- one rank trains; its collectives occupy the emulated link `{result['emulated']}`, "
           "and the profile's communication, the predictions and the lower bound are that "
           "link's (compute and host cost profiled on this rank)"] if result.get("emulated") else []),
        f"- model `{result['model']}`, batch {result['batch_size']} per rank, "
        f"{result['gradient_bytes'] / 1e6:.2f} MB of gradients; {result['device']} / "
        f"{result['backend']}, {result['threads_per_rank']} thread(s) per rank, torch {result['torch']}"
        + ("; deterministic kernels (profile and training)" if result.get("deterministic") else ""),
        f"- profile `{result['profile']}`: forward {result['forward_ms']:.1f} ms, backward "
        f"{result['backward_ms']:.1f} ms, optimizer step {result['update_ms']:.1f} ms; "
        + ("no all-reduce planned with (one rank)" if result.get("single_rank") else
           f"all-reduce alpha {c['alpha_ms']:.3f} ms, algbw {c['algbw_gbs'] * 1e3:.1f} MB/s "
           f"({'emulated link' if result.get('emulated') else c['backend']}): all gradients in one "
           f"all-reduce {result['allreduce_all_ms']:.1f} ms")
        + (f"; host cost {host['runtime_tensor_us']:.1f} µs per tensor + "
           f"{host['runtime_block_us']:.1f} µs per block on the runtime, "
           f"{host['ddp_tensor_us']:.1f} + {host['ddp_bucket_us']:.1f} µs on DDP"
           + (" (defaults: the profile has no host section)" if host.get("defaulted") else "")
           + ("" if host["launch_bound"] else ", hidden behind the GPU where below compute")
           if host else "")
        + (f"; training thread {c['cpu_ms_per_block']:.2f} ms per block + {c['cpu_ms_per_mb']:.1f} ms "
           "per MB (the planner's compute-cost option)" if c.get("cpu_ms_per_block") or c.get("cpu_ms_per_mb") else ""),
        *([f"- all-reduce while training computes (for the refined prediction): alpha "
           f"{result['loaded_comm']['alpha_ms']:.3f} ms, algbw {result['loaded_comm']['algbw_gbs'] * 1e3:.1f} MB/s; "
           f"training-thread time lost to communication {result['loaded_comm']['cpu_ms_per_mb'] or 0:.1f} ms per MB "
           f"and {result['loaded_comm'].get('cpu_ms_per_block') or 0:.2f} ms per block"]
          if result.get("loaded_comm") else []),
        f"- {result['iterations']} timed iterations per strategy in {result['rounds']} interleaved "
        "rounds (more while a strategy and DDP were not distinguishable); iteration = forward start "
        "to forward start, mean over ranks; median and p10–p90; vs DDP: DDP's time over the "
        "strategy's from each round's pair of turns, with its 95% interval (`usbyte_opt.verdict`)",
        "- state MB: the optimizer state's bytes (1 MB = 10^6 bytes) on the rank holding most "
        "of it, after training, which is its peak (SGD, Adam and AdamW only grow their state); "
        "every rank's in result.json (`state_bytes_by_rank`)",
        f"- predicted: the planner on the profile, in the mode each schedule runs in (fence for "
        "DDP; with the profile's compute-cost option when it has one); "
        f"lower bound {result['lower_bound_ms']:.1f} ms"
        + (f" (sharded mode's: {result['sharded_lower_bound_ms']:.1f} ms, what the sharded "
           "schedules are held against)" if result.get("sharded_lower_bound_ms") else "")
        + "; error = (measured − predicted) / measured; "
        "refined: the same with every optimizer step on the training thread (overlap mode), as the runtime runs it, "
        "the all-reduce cost measured while training computes, compute charged for what "
        "communication costs the training thread, and compute recalibrated to the side-by-side "
        f"no-comm run (x{result.get('compute_scale', 1.0):.3f}); neither for fsdp2 (torch's own, "
        "nothing planned)",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(COLUMNS) - 2)) + "|",
    ]
    for row in table_rows(result):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if result["correct"] is not None:
        lines.append(f"Training: {training_verdict(result)}.")
    ref = next((r for r in result["runs"] if r["strategy"] == REFERENCE), None)
    if ref is not None:
        lines.append(f"Compute alone (`no-comm`: every rank trains without communication, side by side): "
                     f"measured {ref['measured_ms']:.1f} ms against {ref['predicted_ms']:.1f} ms profiled.")
    wire = [(r["strategy"], r["link_bytes_per_iteration"]) for r in result["runs"]
            if r.get("link_bytes_per_iteration") is not None and r["strategy"] != REFERENCE]
    if wire:
        lines.append("Bytes on the shaped links per iteration, every node's together (the "
                     "kernel's counter of each node's link, around every turn): "
                     + ", ".join(f"{s} {b / 1e6:.2f} MB" for s, b in wire) + ".")
    for n in notes:
        lines.append(n)
    lines.append("")
    traced = [r["strategy"] for r in result["runs"] if r.get("trace")]
    if traced:
        lines.append("Traces, predicted and measured side by side (open in ui.perfetto.dev): "
                     + ", ".join(f"`traces/{s}.compare.json`" for s in traced) + ".")
        lines.append("")
    ph = result["phases_s"]
    lines.append(f"Wall time: profile {ph['profile']:.0f} s, all-reduce under compute "
                 f"{ph.get('probe', 0):.0f} s, plan {ph['plan']:.0f} s, training "
                 f"{ph['train']:.0f} s.")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Side-by-side traces
# --------------------------------------------------------------------------------------------


#: Columns of :func:`explain`'s table.
EXPLAIN_COLUMNS = ["strategy", "measured ms", "predicted ms", "off ms", "compute ms", "comm ms"]

#: Measured and predicted speed-ups closer than this to 1 count as "about as fast as DDP".
TIE = 0.02


def _verdict(ratio: float) -> str:
    if ratio > 1 + TIE:
        return "faster than DDP"
    if ratio < 1 - TIE:
        return "slower than DDP"
    return "about as fast as DDP"


def _measured_verdict(s: str, pred: float, v: dict[str, Any]) -> str:
    """The verdict line of ``s`` against DDP from its paired windows ``v`` (``vs_ddp``)."""
    meas = (f"measured {v['ratio']:.2f}x ({round(100 * v['confidence'])}% CI "
            f"{v['lo']:.2f}–{v['hi']:.2f}x, {plural(v['pairs'], 'round')})")
    a = _verdict(pred)
    if v["lo"] > 1.0:
        b = "faster than DDP"
    elif v["hi"] < 1.0:
        b = "slower than DDP"
    else:
        return (f"verdict: {s} against DDP: {v['verdict']}; predicted {pred:.2f}x DDP's speed, "
                f"{meas}: its interval contains 1, this machine is too noisy to tell")
    if a == b:
        return f"verdict holds: {s} predicted {pred:.2f}x DDP's speed, {meas}: {b} either way"
    return (f"verdict changes: {s} predicted {pred:.2f}x DDP's speed ({a}), {meas} ({b}). Trust "
            "the measurement on this machine; a profile taken when the machine is as loaded as "
            "in training predicts it better.")


def explain(result: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """How far the prediction was off, per strategy, and what that means for the user.

    Returns the rows of a table (:data:`EXPLAIN_COLUMNS`: measured, predicted, how far off,
    and the parts of the difference that compute and communication explain, in ms) and
    sentences: which source of error dominates, any measurement below the lower bound (timing
    noise, :func:`below_bound`), and whether the verdict against DDP changes — from each run's
    paired windows (``vs_ddp``: "not distinguishable on this machine (±X%)" when its interval
    contains 1), else from the medians.

    The compute part is the side-by-side run without communication (``no-comm``): measured
    against the profile's forward + backward + step. It is common to every strategy, so it
    moves all predictions together and rarely changes which one is fastest; the rest
    (communication, and how it overlaps compute) differs per strategy and can.

    Example::

        >>> runs = [{"strategy": "ddp", "measured_ms": 120.0, "predicted_ms": 100.0},
        ...         {"strategy": "best", "measured_ms": 104.0, "predicted_ms": 90.0},
        ...         {"strategy": "no-comm", "measured_ms": 88.0, "predicted_ms": 75.0}]
        >>> rows, lines = explain({"runs": runs})
        >>> rows[1]
        ['best', '104.0', '90.0', '+14.0 (+13%)', '+13.0', '+1.0']
        >>> print("\\n".join(lines))  # doctest: +NORMALIZE_WHITESPACE
        compute dominates the error: +13.0 ms per iteration (88.0 ms measured without communication,
        75.0 ms profiled), against at most +7.0 ms from communication. It shifts every strategy
        alike, so it rarely changes which is fastest; the machine was busier or slower than when
        profiled.
        verdict holds: best predicted 1.11x DDP's speed, measured 1.15x: faster than DDP either way
    """
    runs = {r["strategy"]: r for r in result["runs"]}
    ref = runs.get(REFERENCE)
    compute_off = None
    if ref and ref.get("measured_ms") and ref.get("predicted_ms"):
        compute_off = ref["measured_ms"] - ref["predicted_ms"]
    rows: list[list[str]] = []
    worst_comm = 0.0  # the communication part largest in size, with its sign
    for s, r in runs.items():
        m, p = r.get("measured_ms"), r.get("predicted_ms")
        if not m or not p:
            continue
        off = m - p
        if s == REFERENCE:
            rows.append([s, f"{m:.1f}", f"{p:.1f}", f"{off:+.1f} ({100 * off / m:+.0f}%)", f"{off:+.1f}", "—"])
            continue
        comm = None if compute_off is None else off - compute_off
        if comm is not None and abs(comm) > abs(worst_comm):
            worst_comm = comm
        rows.append([s, f"{m:.1f}", f"{p:.1f}", f"{off:+.1f} ({100 * off / m:+.0f}%)",
                     "—" if compute_off is None else f"{compute_off:+.1f}",
                     "—" if comm is None else f"{comm:+.1f}"])
    lines: list[str] = []
    if compute_off is not None:
        assert ref is not None   # compute_off comes from it
        measured = (f"{ref['measured_ms']:.1f} ms measured without communication, "
                    f"{ref['predicted_ms']:.1f} ms profiled")
        if abs(compute_off) >= abs(worst_comm):
            lines.append(f"compute dominates the error: {compute_off:+.1f} ms per iteration ({measured}), "
                         f"against at most {worst_comm:+.1f} ms from communication. It shifts every "
                         "strategy alike, so it rarely changes which is fastest; the machine was "
                         + ("busier or slower" if compute_off > 0 else "quieter or faster")
                         + " than when profiled.")
        else:
            lines.append(f"communication dominates the error: up to {worst_comm:+.1f} ms per iteration, "
                         f"against {compute_off:+.1f} ms from compute ({measured}). All-reduce cost, or "
                         "its overlap with compute, differed from the profile's; that differs per "
                         "strategy and can reorder them (`usbyte-opt bench --wide` adds a prediction "
                         "with the all-reduce cost measured under load: refined).")
    else:
        lines.append("no run without communication to split the error into compute and communication")
    lines += below_bound({"runs": list(runs.values()), **{k: v for k, v in result.items() if k != "runs"}})
    ddp = runs.get(TORCH_DDP)
    if ddp and ddp.get("measured_ms") and ddp.get("predicted_ms"):
        for s, r in runs.items():
            if s in (TORCH_DDP, REFERENCE) or not r.get("measured_ms") or not r.get("predicted_ms"):
                continue
            pred = ddp["predicted_ms"] / r["predicted_ms"]
            v = r.get("vs_ddp")
            if v and v.get("lo") is not None:
                lines.append(_measured_verdict(s, pred, v))
                continue
            meas = ddp["measured_ms"] / r["measured_ms"]
            a, b = _verdict(pred), _verdict(meas)
            if a == b:
                lines.append(f"verdict holds: {s} predicted {pred:.2f}x DDP's speed, measured "
                             f"{meas:.2f}x: {b} either way")
            else:
                lines.append(f"verdict changes: {s} predicted {pred:.2f}x DDP's speed ({a}), "
                             f"measured {meas:.2f}x ({b}). Trust the measurement on this machine; "
                             "a profile taken when the machine is as loaded as in training "
                             "predicts it better.")
    return rows, lines


def pick_iteration(begins: Sequence[float], ends: Sequence[float], median_ms: float) -> int | None:
    """Index of a steady-state iteration: followed by the next forward within 1.5 medians
    (not the last of a turn) and as close to the median as possible; if none is that close
    (a short traced pass on a loaded machine), the closest of all; ``None`` without any.

    Example::

        >>> us = [0, 98_000, 205_000, 900_000, 1_001_000]     # forward starts, µs
        >>> pick_iteration(us, [t + 40_000 for t in us], 100.0)   # 98, 107, 695, 101 ms
        3
    """
    best, best_gap = None, math.inf
    near, near_gap = None, math.inf
    for i in range(len(begins) - 1):
        if i >= len(ends):
            break
        d = (begins[i + 1] - begins[i]) / 1e3
        if abs(d - median_ms) < near_gap:
            near, near_gap = i, abs(d - median_ms)
        if 0.5 * median_ms <= d <= 1.5 * median_ms and abs(d - median_ms) < best_gap:
            best, best_gap = i, abs(d - median_ms)
    return best if best is not None else near


def compare_trace(predicted: dict[str, Any], measured: Sequence[dict[str, Any]],
                  median_ms: float) -> dict[str, Any]:
    """One Chrome trace with the predicted timeline (pid 0) and the measured one of each rank,
    shifted so that a steady-state iteration's backward starts at 0, as in the prediction."""
    ev = []
    for e in predicted["traceEvents"]:
        e = dict(e, pid=0)
        if e.get("ph") == "M" and e.get("name") == "process_name":
            e["args"] = {"name": "predicted (simulator)"}
        ev.append(e)
    rank0 = measured[0]["otherData"] if measured else None
    if rank0:
        i = pick_iteration(rank0["forward_begin_us"], rank0["forward_end_us"], median_ms)
        if i is not None:
            origin = rank0["forward_end_us"][i]
            lo = rank0["forward_begin_us"][i]
            nxt = rank0["forward_begin_us"][i + 1]
            hi = nxt + (nxt - lo)
            for doc in measured:
                for e in doc["traceEvents"]:
                    if e.get("ph") == "M":
                        ev.append(e)
                    elif lo <= e["ts"] <= hi:
                        ev.append(dict(e, ts=e["ts"] - origin))
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"note": "pid 0: predicted; pid r+1: rank r measured; time 0 = start of "
                                  "backward of one steady-state iteration"}}


def load_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


__all__ = ["COLUMNS", "EXPLAIN_COLUMNS", "PARAM_TOLERANCE", "SINGLE_RANK_NOTE", "below_bound",
           "budget_of", "compare_trace", "explain", "markdown", "pick_iteration", "stats",
           "summarize", "table_rows", "vs_ddp"]
