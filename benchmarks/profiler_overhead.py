"""What the profiler's timing hooks cost: a profiled iteration against an unhooked one.

    python benchmarks/profiler_overhead.py                  # built-in models (+ BERT/ResNet if installed)
    python benchmarks/profiler_overhead.py --models mlp cnn --rounds 5

For each model the same loop (:class:`usbyte_opt.profiler.timing.IterationTimer`: zero_grad,
forward, loss, backward, SGD step) runs with every hook installed (a forward pre-hook per
parameter-owning module, a post-accumulate-grad hook per tensor) and without any hook, in
alternating rounds so that drift of a shared machine hits both alike. The iteration time is
forward + backward + step; the table gives the median over all timed iterations of each
mode, and the overhead. The second table measures the choice behind ``update_ms``: one full
optimizer step against the sum of one-tensor steps.

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
sys.path.insert(0, str(REPO))

from usbyte_opt.errors import UsbyteError  # noqa: E402
from usbyte_opt.models import build  # noqa: E402
from usbyte_opt.profiler.run import make_optimizer  # noqa: E402
from usbyte_opt.profiler.timing import IterationTimer, median  # noqa: E402

#: model -> batch size used here (small enough for a 2-core CPU).
CANDIDATES = {"mlp": 64, "cnn": 16, "transformer": 8, "resnet50": 2, "densenet201": 2, "bert-base": 2}


def iteration_ms(spec: str, batch: int, hooks: bool, warmup: int, repeats: int) -> tuple[list[float], int]:
    model, inputs, loss_fn = build(spec, batch)
    opt = make_optimizer("sgd", list(model.parameters()))
    timer = IterationTimer(model, inputs, loss_fn, opt, hooks=hooks, label=spec)
    t = timer.run(warmup=warmup, repeats=repeats)
    n_hooks = len(timer.owners) + len(timer.params) if hooks else 0
    return [f + b + s for f, b, s in zip(t.forward_ms, t.backward_ms, t.step_ms)], n_hooks


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
    ap.add_argument("--rounds", type=int, default=3, help="alternating hooked/unhooked rounds")
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
        on: list[float] = []
        off: list[float] = []
        n_hooks = 0
        for _ in range(args.rounds):
            xs, _n = iteration_ms(spec, batch, False, 1, args.repeats)
            off += xs
            xs, n_hooks = iteration_ms(spec, batch, True, 1, args.repeats)
            on += xs
        m_on, m_off = median(on), median(off)
        rows.append([spec, batch, n_hooks, f"{m_off:.2f}", f"{m_on:.2f}", f"{100 * (m_on / m_off - 1):+.1f}%"])
        print("  ".join(str(x) for x in rows[-1]), flush=True)
        for opt in ("sgd", "adam"):
            full, single = step_split(spec, batch, opt, args.repeats)
            steps.append([spec, opt, f"{full:.2f}", f"{single:.2f}", f"{single / full:.2f}x"])
            print("  ".join(str(x) for x in steps[-1]), flush=True)

    head = ["model", "batch", "hooks", "unhooked ms", "profiled ms", "overhead"]
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

Iteration = forward + loss + backward + SGD-momentum step, timed with `perf_counter`; the
median of {args.rounds} alternating rounds x {args.repeats} iterations per mode (plus one
warm-up per round). "hooks" = forward pre-hooks (one per parameter-owning module) +
post-accumulate-grad hooks (one per trainable tensor). The target is a profiled iteration
within 10% of an unhooked one.

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
