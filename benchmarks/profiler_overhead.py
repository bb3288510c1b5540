"""What the profiler's timing hooks cost: a profiled iteration against an unhooked one.

    python benchmarks/profiler_overhead.py                  # built-in models (+ BERT/ResNet if installed)
    python benchmarks/profiler_overhead.py --models mlp cnn --rounds 5

For each model the same loop (zero_grad, forward, loss, backward, SGD step) runs with the
profiler's hooks installed (:meth:`usbyte_opt.profiler.timing.IterationTimer.install`: a
forward pre-hook per parameter-owning module, a post-accumulate-grad hook per tensor) and
without, in rounds that alternate the order; the overhead is the median over rounds of the
paired ratio. Each iteration is timed in this thread's CPU time (robust on a shared
machine) and in wall time. The second table measures the choice behind ``update_ms``: one
full optimizer step against the sum of one-tensor steps.

Prints both tables and writes them, with the machine and the method, to
``benchmarks/profiler_overhead.md``. Not a timed test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from usbyte_opt.errors import UsbyteError  # noqa: E402
from usbyte_opt.models import build  # noqa: E402
from usbyte_opt.profiler.optimizers import make_optimizer  # noqa: E402
from usbyte_opt.profiler.timing import IterationTimer, median  # noqa: E402

#: model -> batch size used here (small enough for a 2-core CPU).
CANDIDATES = {"mlp": 64, "cnn": 16, "transformer": 8, "resnet50": 2, "densenet201": 2, "bert-base": 2}


def iteration_ms(spec: str, batch: int, hooks: bool, warmup: int, repeats: int
                 ) -> tuple[list[float], list[float], int]:
    """Per-iteration (wall ms, this thread's CPU ms) of forward + loss + backward + step.

    The hooks are exactly the profiler's (``IterationTimer.install``); the loop around them
    is the same in both modes. CPU time of the (single) compute thread is what the hooks
    add to; unlike wall time it does not grow when another process takes the core.
    """
    model, inputs, loss_fn = build(spec, batch)
    opt = make_optimizer("sgd", list(model.parameters()))
    timer = IterationTimer(model, inputs, loss_fn, opt, label=spec)
    if hooks:
        timer.install()
    wall, cpu = [], []
    try:
        for i in range(warmup + repeats):
            opt.zero_grad(set_to_none=True)
            timer.calls.clear()
            w0, c0 = time.perf_counter(), time.thread_time()
            loss_fn(model(*inputs)).backward()
            opt.step()
            w1, c1 = time.perf_counter(), time.thread_time()
            if i >= warmup:
                wall.append((w1 - w0) * 1e3)
                cpu.append((c1 - c0) * 1e3)
    finally:
        timer.remove()
    return wall, cpu, (len(timer.owners) + len(timer.params)) if hooks else 0


def step_split(spec: str, batch: int, optimizer: str, repeats: int) -> tuple[float, float]:
    """(full step ms, sum of one-tensor steps ms), medians over ``repeats``."""
    model, inputs, loss_fn = build(spec, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    full = make_optimizer(optimizer, params)
    singles = [make_optimizer(optimizer, [p]) for p in params]
    loss_fn(model(*inputs)).backward()
    full.step()
    for o in singles:
        o.step()  # state (momentum, Adam moments) allocated before timing
    a, b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        full.step()
        a.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for o in singles:
            o.step()
        b.append((time.perf_counter() - t) * 1e3)
    return median(a), median(b)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="profiler hook overhead")
    ap.add_argument("--models", nargs="*", default=list(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=6, help="alternating hooked/unhooked rounds")
    ap.add_argument("--repeats", type=int, default=5, help="timed iterations per round")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "profiler_overhead.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, steps = [], []
    for spec in args.models:
        batch = CANDIDATES.get(spec, 8)
        try:
            build(spec, 1)
        except UsbyteError as e:
            print(f"skip {spec}: {e}", file=sys.stderr)
            continue
        walls: dict[bool, list[float]] = {True: [], False: []}
        cpus: dict[bool, list[float]] = {True: [], False: []}
        wall_ratio: list[float] = []
        cpu_ratio: list[float] = []
        n_hooks = 0
        for r in range(args.rounds):
            # Alternate which mode goes first and compare within a round (paired), so that
            # drift of a shared machine shows as spread between rounds, not as overhead.
            got = {}
            for hooked in ((False, True) if r % 2 == 0 else (True, False)):
                w, c, n = iteration_ms(spec, batch, hooked, 1, args.repeats)
                got[hooked] = (median(w), median(c))
                walls[hooked] += w
                cpus[hooked] += c
                n_hooks = max(n_hooks, n)
            wall_ratio.append(got[True][0] / got[False][0])
            cpu_ratio.append(got[True][1] / got[False][1])

        def pct(x: float) -> str:
            return f"{100 * (x - 1):+.1f}%"

        rows.append([spec, batch, n_hooks, f"{median(cpus[False]):.2f}", f"{median(cpus[True]):.2f}",
                     pct(median(cpu_ratio)), f"{pct(min(cpu_ratio))} .. {pct(max(cpu_ratio))}",
                     f"{median(walls[False]):.2f}", f"{median(walls[True]):.2f}", pct(median(wall_ratio))])
        print("  ".join(str(x) for x in rows[-1]), flush=True)
        for opt in ("sgd", "adam"):
            full, single = step_split(spec, batch, opt, args.repeats)
            steps.append([spec, opt, f"{full:.2f}", f"{single:.2f}", f"{single / full:.2f}x"])
            print("  ".join(str(x) for x in steps[-1]), flush=True)

    head = ["model", "batch", "hooks", "unhooked CPU ms", "profiled CPU ms", "overhead (CPU)",
            "range over rounds", "unhooked wall ms", "profiled wall ms", "overhead (wall)"]
    shead = ["model", "optimizer", "full step ms", "sum of one-tensor steps ms", "ratio"]

    def md(h: list[str], rs: list[list]) -> str:
        lines = ["| " + " | ".join(h) + " |", "|" + "|".join("---" for _ in h) + "|"]
        lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rs]
        return "\n".join(lines)

    machine = (f"{platform.machine()} {platform.processor() or ''}".strip()
               + f", {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
               f"python {platform.python_version()}")
    text = f"""# Profiler hook overhead

Generated by `python benchmarks/profiler_overhead.py` on {dt.date.today().isoformat()}
({machine}). Not a timed test: rerun it on your machine.

Iteration = forward + loss + backward + SGD-momentum step with one torch thread. The hooks
are the profiler's own (`IterationTimer.install`: a forward pre-hook per parameter-owning
module, a post-accumulate-grad hook per trainable tensor, each taking a `perf_counter`
stamp); the loop around them is identical in both modes. {args.rounds} rounds of
{args.repeats} iterations per mode (after one warm-up), the order alternating between
rounds. Each iteration is timed twice: the compute thread's CPU time (`time.thread_time`),
which is what the hooks add to and which does not grow when other processes take the
core, and wall time. "overhead" is the median over rounds of the ratio of the two modes'
medians within a round (paired), with its range over rounds for CPU time. On a shared
machine the wall-clock column is dominated by other jobs; the CPU-time column is the
measurement. The target is a profiled iteration within 10% of an unhooked one.

{md(head, rows)}

## Full optimizer step against one-tensor steps

Why `update_ms` apportions one timed full step by element count instead of timing one
step per tensor: the per-tensor steps carry a fixed cost each (Python, state lookup,
kernel launches), so their sum overstates the step the training loop actually takes.

{md(shead, steps)}
"""
    args.out.write_text(text)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
