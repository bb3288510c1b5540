"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ..formats import CommSpec, Profile, load_profile, write_json
from ..planner import retargeted
from ..simulate import Timeline, chrome_trace

WorldSize = typer.Option(None, "--world-size", "-n", min=2,
                         help="Retarget to this many ranks (ring all-reduce model).")
BandwidthGbps = typer.Option(None, "--bandwidth-gbps", min=0.0,
                             help="Retarget to this per-link bandwidth, Gbit/s.")
LatencyUs = typer.Option(None, "--latency-us", min=0.0,
                         help="Retarget to this latency per ring step, µs.")
Trace = typer.Option(None, "--trace", dir_okay=False,
                     help="Write a Chrome/Perfetto trace of the predicted timeline here.")
Json = typer.Option(False, "--json", help="Print only JSON on stdout.")


def load_retargeted(path: Path, world_size: Optional[int], bandwidth_gbps: Optional[float],
                    latency_us: Optional[float]) -> tuple[Profile, Profile]:
    """``(original, retargeted)`` profile from a file."""
    original = load_profile(path)
    return original, retargeted(original, world_size, bandwidth_gbps, latency_us)


def write_trace(path: Path, timeline: Timeline, label: str) -> Path:
    return write_json(os.fspath(path), chrome_trace(timeline, label))


def cpu_cost_note(comm: CommSpec) -> str:
    """``", training thread X ms/block + Y ms/MB"`` when the profile carries the compute-cost
    option (docs/planner.md), else ``""``.

    Example::

        >>> cpu_cost_note(CommSpec("gloo", 2, 3.0, 0.025, cpu_ms_per_block=0.4, cpu_ms_per_mb=6.0))
        ', training thread 0.40 ms/block + 6.00 ms/MB'
    """
    if not (comm.cpu_ms_per_block or comm.cpu_ms_per_mb):
        return ""
    return f", training thread {comm.cpu_ms_per_block:.2f} ms/block + {comm.cpu_ms_per_mb:.2f} ms/MB"
