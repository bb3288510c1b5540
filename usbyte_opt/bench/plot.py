"""The benchmark's PNG: measured against predicted per strategy, and one iteration's timeline.

matplotlib is an optional extra (``pip install 'usbyte-opt[plot]'``); without it
:func:`plot` returns ``None`` and the caller says so.

Left panel: per strategy, the measured median (bar, p10–p90 whisker) beside the predicted
time. Right panel: one steady-state iteration of the fastest runtime strategy, predicted
(simulator) against measured (rank 0's ``USBYTE_TRACE``), compute and all-reduce lanes, time
0 at the start of backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import plural


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: no plot
        return False
    return True


def _lanes(doc: dict[str, Any], pid: int) -> dict[int, list[tuple[float, float, str]]]:
    lanes: dict[int, list[tuple[float, float, str]]] = {}
    for e in doc.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") == pid:
            lanes.setdefault(e["tid"], []).append((e["ts"] / 1e3, e["dur"] / 1e3, e["name"]))
    return lanes


def plot(result: dict[str, Any], path: Path, compare: dict[str, Any] | None = None,
         compare_label: str = "") -> Path | None:
    """Draw ``result`` (and the side-by-side trace ``compare``) to ``path``; ``None`` without
    matplotlib."""
    if not available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: Sequence[dict[str, Any]] = result["runs"]
    fig, axes = plt.subplots(1, 2 if compare else 1, figsize=(13 if compare else 6.5, 4.2),
                             gridspec_kw={"width_ratios": [1, 1.6]} if compare else None)
    ax = axes[0] if compare else axes
    names = [r["strategy"] for r in runs]
    x = range(len(runs))
    meas = [r["measured_ms"] for r in runs]
    lo = [r["measured_ms"] - r["p10_ms"] for r in runs]
    hi = [r["p90_ms"] - r["measured_ms"] for r in runs]
    ax.bar([i - 0.2 for i in x], meas, 0.4, yerr=[lo, hi], capsize=3, label="measured (median, p10–p90)",
           color="#4C72B0")
    # No bar where nothing is predicted (fsdp2).
    ax.bar([i + 0.2 for i in x], [math.nan if r["predicted_ms"] is None else r["predicted_ms"]
                                  for r in runs], 0.4, label="predicted", color="#DD8452")
    for i, r in enumerate(runs):
        if r["error"] is not None and r["predicted_ms"] is not None:
            ax.annotate(f"{100 * r['error']:+.0f}%", (i, max(r["measured_ms"], r["predicted_ms"])),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"{result['name']}, {plural(result['world_size'], 'rank')}, {result['network']['short']}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    if compare:
        ax2 = axes[1]
        pred = _lanes(compare, 0)
        mes = _lanes(compare, 1)
        rows = [("predicted compute", pred.get(1, [])), ("predicted all-reduce", pred.get(2, [])),
                ("measured compute", mes.get(1, [])), ("measured all-reduce", mes.get(2, []))]
        colors = {"forward": "#55A868", "backward": "#C44E52", "update": "#8172B2"}
        for y, (_, evs) in enumerate(rows):
            for ts, dur, name in evs:
                key = name.split()[0]
                c = colors.get(key, "#CCB974" if key == "wait" else "#4C72B0")
                ax2.barh(y, dur, left=ts, height=0.6, color=c, edgecolor="white", linewidth=0.3)
        ax2.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax2.invert_yaxis()
        ax2.axvline(0, color="grey", lw=0.5)
        ax2.set_xlabel("ms from the start of backward")
        ax2.set_title(f"one iteration of {compare_label}: forward (green), backward (red), "
                      "waits (yellow), blocks (blue)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


__all__ = ["available", "plot"]
