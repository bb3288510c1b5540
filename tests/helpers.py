"""Small builders shared by the planner and CLI tests, and scenarios played on one spawned set
of ranks."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from usbyte_opt.cli.main import main
from usbyte_opt.formats import Block, CommSpec, Profile, TensorSpec
from usbyte_opt.launcher import RankResult
from usbyte_opt.planning.problem import Layout

MB_F32 = 250_000  # float32 elements in 1 MB (1 ms at 1 GB/s)


def three_layer(update_out: float = 0.5) -> Profile:
    """F = 4, B = 6; 1 MB tensors out/mid/inp ready at 2/4/6, needed at 3/1.5/0;
    alpha 1 ms, 1 GB/s (1 MB costs 1 ms on the wire)."""
    return Profile(
        "three", forward_ms=4.0, backward_ms=6.0,
        tensors=(TensorSpec("out", (MB_F32,), "float32", 2.0, 3.0, update_out),
                 TensorSpec("mid", (MB_F32,), "float32", 4.0, 1.5),
                 TensorSpec("inp", (500, 500), "float32", 6.0, 0.0)),
        comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))


def random_blocks(rng: random.Random, layout: Layout, cuts: int) -> list[Block]:
    """Every buffer of ``layout`` cut at up to ``cuts`` random points, blocks shuffled."""
    blocks = []
    for b, total in enumerate(layout.numel):
        pts = sorted({0, total, *(rng.randrange(1, total) for _ in range(min(cuts, total - 1)))})
        blocks += [Block(b, s, e) for s, e in zip(pts, pts[1:])]
    rng.shuffle(blocks)
    return blocks


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


Scenarios = dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]
"""Name -> (a module-level function of ``(rank, world_size, *args)``, its ``args``)."""


def play(rank: int, ws: int, scenarios: Scenarios) -> dict[str, dict[str, Any]]:
    """Every scenario on this rank of one spawned run (``run_local(play, 2, args=(scenarios,))``),
    in order: ``{"value": ...}`` or, for an exception, recorded rather than raised so that the
    ranks stay in step, ``{"error_type", "error", "trace"}`` (a scenario failing on one rank
    only may still leave the other waiting: the run has a deadline). An optimizer a scenario
    left open is released after it, as at the end of a process."""
    import traceback

    from usbyte_opt.runtime.exit_hook import release_at_exit

    out: dict[str, dict[str, Any]] = {}
    for name, (fn, args) in scenarios.items():
        try:
            out[name] = {"value": fn(rank, ws, *args)}
        except Exception as e:  # noqa: BLE001 - recorded for the test
            out[name] = {"error_type": f"{type(e).__module__}.{type(e).__qualname__}",
                         "error": str(e), "trace": traceback.format_exc()}
        release_at_exit()
    return out


def played(results: list[RankResult]) -> Callable[[str], list[RankResult]]:
    """The results of :func:`play`'s run as ``outcome(name)``: one :class:`RankResult` per rank
    for that scenario (the run itself must have ended well on every rank)."""
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return lambda name: [RankResult(r.rank, **r.value[name]) for r in results]
