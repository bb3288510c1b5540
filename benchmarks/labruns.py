"""What the lab benchmarks (``sharded_lab.py``, ``multinode_lab.py``) share: the slim record
of one bench run that their ``.json`` keeps, and the ranges their tables print.

Example::

    >>> value_range([1.0, 1.25, None], ".2f"), value_range([2.0, 2.0], ".1f"), value_range([], "g")
    ('1.00–1.25', '2.0', '—')
    >>> by_strategy({"runs": [{"strategy": "ddp", "ms": 3}]})
    {'ddp': {'strategy': 'ddp', 'ms': 3}}
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence


def slim(res: dict, keep: Sequence[str], load0: Iterable[float], t0: float) -> dict:
    """The fields ``keep`` of bench result ``res``, its runs without schedules and traces, the
    load average before (``load0``) and now, and the start time ``t0``."""
    out = {k: res[k] for k in keep if k in res}
    out["runs"] = [{k: v for k, v in r.items() if k not in ("schedule", "trace")}
                   for r in res["runs"]]
    out["load_before"] = [round(x, 2) for x in load0]
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out["started"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))
    return out


def value_range(values: Iterable[float | None], fmt: str) -> str:
    """``lo–hi`` of the values that are not ``None`` (one value when they format alike, ``—``
    when there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    lo, hi = format(min(vals), fmt), format(max(vals), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def by_strategy(run: dict) -> dict[str, dict]:
    """A bench run's results by strategy name."""
    return {r["strategy"]: r for r in run["runs"]}
