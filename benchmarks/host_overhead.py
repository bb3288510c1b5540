"""Host cost per iteration: the runtime against torch DDP where there is nothing to win.

World size 1 on gloo, one compute thread, a stack of ``Linear(8, 8)`` layers (50, 400 and
2,000 parameters: compute is negligible, so what is measured is the host time each arm adds
per iteration). Arms, all in one process, timed side by side in rounds that rotate their
order (background load falls on all alike):

* ``plain``: the model and AdamW, no data parallelism (the floor);
* ``ddp``: torch's ``DistributedDataParallel`` (default buckets); ``ddp-per-tensor``: DDP
  with one bucket per tensor (``bucket_cap_mb`` below the smallest tensor);
* ``fsdp2``: ``fully_shard`` (FSDP2) at world size 1, where it runs;
* the runtime (:class:`usbyte_opt.runtime.DistributedOptimizer`, ``verify=False``) on the
  default plan (DDP's buckets), on ``best``'s plan for the model (planned from a synthetic
  two-rank profile, ``usbyte_opt.runtime.profile_from_model``) and on one block per tensor,
  each in overlap and fence mode.

An iteration is forward, backward, ``step()``, ``zero_grad()``; each phase is timed on its
own (in overlap mode the updates run in the next forward, so they count there). Reported per
arm: ms per iteration (median of the round medians), its ratio to DDP per round (median and
range over rounds), µs per parameter over DDP, the phases, and Python function calls per
iteration (``cProfile``, a separate untimed pass). ``--runs 3`` repeats the whole run in fresh
processes; the table gives the median over runs and their range.

    python benchmarks/host_overhead.py                   # 3 runs, writes host_overhead.md/.json
    python benchmarks/host_overhead.py --quick           # 1 short run, prints only
    git worktree add /tmp/usbyte-before a6ca2c7          # the runtime before, side by side:
    python benchmarks/host_overhead.py --before /tmp/usbyte-before

``--before TREE`` also runs the same arms with ``TREE`` (another checkout of this repository)
first on ``PYTHONPATH``, each run in its own process, and adds its figures as "before" rows.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_MD, OUT_JSON = HERE / "host_overhead.md", HERE / "host_overhead.json"
SIZES = (50, 400, 2000)
RUNTIME_ARMS = [f"{plan}/{mode}" for plan in ("default", "best", "per-tensor")
                for mode in ("overlap", "fence")]
BASE_ARMS = ["plain", "ddp", "ddp-per-tensor", "fsdp2"]
PHASES = ("forward", "backward", "step", "zero_grad")


def worker(n: int, rounds: int, iters: int, fsdp2_max: int = 400) -> dict[str, Any]:
    """One process, world size 1: every arm on a model of ``n`` parameters (FSDP2 up to
    ``fsdp2_max`` parameters: one ``fully_shard`` unit per layer costs it about 8x DDP's
    time, so larger models take most of a run for one known figure)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import warnings

    warnings.simplefilter("ignore")
    from usbyte_opt.formats import Mode
    from usbyte_opt.planning.planner import compare
    from usbyte_opt.planning.problem import Problem
    from usbyte_opt.runtime import DistributedOptimizer, default_schedule, profile_from_model

    x = torch.randn(4, 8)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n // 2)])

    def schedule(plan: str, m: nn.Module) -> Any:
        if plan == "default":
            return default_schedule(m, 1)
        prof = profile_from_model(m, 2)
        if plan == "best":
            return compare(prof, ["ddp", "best"]).schedule("best")
        pb = Problem.from_profile(prof)
        lay = pb.layout()
        return pb.schedule("per-tensor", lay, [lay.whole(i) for i in pb.ready_order()])

    arms: dict[str, tuple[Any, Any]] = {}
    notes: dict[str, str] = {}
    blocks: dict[str, int] = {}
    for arm in BASE_ARMS + RUNTIME_ARMS:
        m = model()
        try:
            if arm == "plain":
                arms[arm] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3))
            elif arm.startswith("ddp"):
                kw = {"bucket_cap_mb": 64 * 4 / 2**20} if arm == "ddp-per-tensor" else {}
                arms[arm] = (nn.parallel.DistributedDataParallel(m, **kw),
                             torch.optim.AdamW(m.parameters(), lr=1e-3))
            elif arm == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                if n > fsdp2_max:
                    raise RuntimeError(f"not run above {fsdp2_max} parameters (--fsdp2-max): "
                                       "about 8x DDP's time at every size measured")

                for layer in m:
                    fully_shard(layer)
                fully_shard(m)
                arms[arm] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3))
            else:
                plan, mode = arm.split("/")
                s = schedule(plan, m)
                s = dataclasses.replace(s, mode=Mode.FENCE if mode == "fence" else Mode.OVERLAP)
                blocks[arm] = len(s.blocks)
                opt = DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), m,
                                           schedule=s, verify=False)
                arms[arm] = (m, opt)
        except Exception as e:  # noqa: BLE001 - an arm that cannot run here is reported
            notes[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"

    def one(net: Any, opt: Any) -> list[float]:
        t0 = time.perf_counter()
        out = net(x).sum()
        t1 = time.perf_counter()
        out.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

    for net, opt in arms.values():   # warm: the first iterations build state
        for _ in range(3):
            one(net, opt)
    names = list(arms)
    per_round: dict[str, list[list[float]]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            net, opt = arms[k]
            samples = [one(net, opt) for _ in range(iters)]
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            per_round[k].append([statistics.median(s[i] for s in samples) * 1e3
                                 for i in range(4)]
                                + [statistics.median(sum(s) for s in samples) * 1e3])
    calls: dict[str, float] = {}
    for k in names:
        net, opt = arms[k]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            one(net, opt)
        prof.disable()
        calls[k] = pstats.Stats(prof).total_calls / 5   # type: ignore[attr-defined]
        if hasattr(opt, "synchronize"):
            opt.synchronize()
    dist.destroy_process_group()
    return {"n": n, "rounds": per_round, "calls": calls, "notes": notes, "blocks": blocks}


def summarize(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per arm: median ms per iteration and per phase, and the ratio to DDP per round."""
    rounds = res["rounds"]
    ddp = [r[4] for r in rounds["ddp"]]
    out = {}
    for k, rs in rounds.items():
        ratio = [r[4] / d for r, d in zip(rs, ddp)]
        out[k] = {"ms": statistics.median(r[4] for r in rs),
                  "ratio": statistics.median(ratio), "ratio_lo": min(ratio),
                  "ratio_hi": max(ratio), "calls": res["calls"].get(k, 0.0),
                  **{p: statistics.median(r[i] for r in rs) for i, p in enumerate(PHASES)}}
    return out


def run_once(n: int, rounds: int, iters: int, tree: str | None,
             fsdp2_max: int = 400) -> dict[str, Any]:
    """:func:`worker` in a fresh process (``tree`` first on its path)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                        f"{n},{rounds},{iters},{fsdp2_max}"], env=env, capture_output=True,
                       text=True, cwd=tree or str(HERE.parent), timeout=1800)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    if p.returncode != 0 or not line:
        raise SystemExit(f"worker failed ({tree or 'this tree'}, n={n}):\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT"):])


def rng(xs: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi, med = min(xs), max(xs), statistics.median(xs)
    if len(xs) == 1 or fmt.format(lo) == fmt.format(hi):
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``runs[label]``: one worker result per run (the same size)."""
    lines = ["| tree | arm | blocks | ms/iter | vs DDP (range over runs) | µs/param over DDP | "
             "forward | backward | step | zero_grad | Python calls/iter |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for label, results in runs.items():
        sums = [summarize(r) for r in results]
        n = results[0]["n"]
        for arm in BASE_ARMS + RUNTIME_ARMS:
            got = [s[arm] for s in sums if arm in s]
            if not got:
                note = results[0]["notes"].get(arm, "not run")
                lines.append(f"| {label} | {arm} | | | does not run here: {note} | | | | | | |")
                continue
            ddp = [s["ddp"]["ms"] for s in sums if arm in s]
            extra = [(g["ms"] - d) * 1e3 / n for g, d in zip(got, ddp)]
            lines.append(
                f"| {label} | {arm} | {results[0]['blocks'].get(arm, '')} | "
                f"{rng([g['ms'] for g in got])} | **{rng([g['ratio'] for g in got], '{:.3f}')}** | "
                f"{rng(extra, '{:+.1f}')} | " + " | ".join(rng([g[p] for g in got]) for p in PHASES)
                + f" | {rng([g['calls'] for g in got], '{:.0f}')} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--before", default=None, help="another checkout, run as 'before'")
    ap.add_argument("--fsdp2-max", type=int, default=400,
                    help="run FSDP2 up to this many parameters (it is about 8x DDP's time)")
    ap.add_argument("--quick", action="store_true", help="1 run, 4 rounds, print only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # N,ROUNDS,ITERS,FSDP2_MAX
    a = ap.parse_args()
    if a.worker:   # one process of run_once(): the arms, a JSON line on stdout
        n, rounds, iters, fsdp2_max = (int(v) for v in a.worker.split(","))
        print("RESULT" + json.dumps(worker(n, rounds, iters, fsdp2_max)), flush=True)
        return
    if a.quick:
        a.runs, a.rounds = 1, 4
    sizes = [int(s) for s in a.sizes.split(",")]
    trees = ([("before", a.before)] if a.before else []) + [("after", None)]
    load0 = os.getloadavg()[0]
    t0 = time.time()
    data: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for n in sizes:
        data[str(n)] = {label: [] for label, _ in trees}
        for run in range(a.runs):
            for label, tree in trees:
                print(f"n={n} run {run + 1}/{a.runs} {label} ...", file=sys.stderr, flush=True)
                data[str(n)][label].append(run_once(n, a.rounds, a.iters, tree, a.fsdp2_max))
    load1 = os.getloadavg()[0]
    import torch

    head = ["# Host cost per iteration: the runtime against torch DDP, world size 1",
            "",
            f"Written by `python benchmarks/host_overhead.py"
            f"{' --before TREE' if a.before else ''}` ({time.strftime('%Y-%m-%d')}, torch "
            f"{torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU "
            f"cores, {platform.machine()}; 1-minute load average {load0:.1f} at the start and "
            f"{load1:.1f} at the end, {time.time() - t0:.0f} s; {a.runs} runs of {a.rounds} "
            f"rounds of {a.iters} iterations per arm).",
            "",
            (__doc__ or "").split("\n\n")[1].replace("\n", " "),
            ""]
    body: list[str] = []
    for n in sizes:
        body += [f"## {n} parameters ({n // 2} × `Linear(8, 8)`)", ""] + table(data[str(n)]) + [""]
    text = "\n".join(head + body)
    print(text)
    if not a.quick:
        OUT_MD.write_text(text + "\n")
        OUT_JSON.write_text(json.dumps({"sizes": sizes, "runs": a.runs, "load": [load0, load1],
                                        "data": data}, indent=1) + "\n")


if __name__ == "__main__":
    main()
