"""Runtime overhead: iteration time with DistributedOptimizer against DDP, and hook cost.

Two gloo ranks on loopback, no emulated bandwidth limit, one compute thread per rank. Both
arms live in the same two processes and are timed side by side: rounds alternate a block of
DDP iterations and a block of runtime iterations (each block ends with its communication
drained, untimed), so background load falls on both alike. Reported: median ms per iteration
(forward + backward + step) and the ratio runtime / DDP, per model and schedule.

The hook cost is measured in one process (world size 1) on a model of many tiny tensors,
where compute is negligible: backward with the runtime's post-accumulate-grad hooks against
backward of the same model with a plain optimizer, and a forward with the runtime's pre-hooks
(nothing pending) against a forward without them, each divided by the number of tensors or
modules.

    python benchmarks/runtime_overhead.py            # writes benchmarks/runtime_overhead.md
    python benchmarks/runtime_overhead.py --quick    # fewer rounds, prints only
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from usbyte_opt.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer, default_schedule, profile_from_model
from usbyte_opt.runtime.default_plan import make_schedule, split_blocks
from usbyte_opt.runtime.local import run_local, values

HERE = Path(__file__).resolve().parent
OUT = HERE / "runtime_overhead.md"


def _examples():
    spec = importlib.util.spec_from_file_location("usbyte_examples_train",
                                                  HERE.parent / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def schedule_for(kind: str, model: nn.Module, ws: int):
    if kind == "default":
        return default_schedule(model, ws)
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    if kind == "wfbp":
        return make_schedule(pb, lay, [lay.whole(i) for i in pb.ready_order()], "wfbp-like")
    if kind == "split4-forward":
        return make_schedule(pb, lay, split_blocks(pb, lay, 4, pb.need_order()), "split4-forward")
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# 2 ranks: DDP against the runtime
# --------------------------------------------------------------------------------------------


def side_by_side(rank: int, ws: int, model_name: str, batch_size: int, schedule: str,
                 rounds: int, per_round: int) -> dict:
    ex = _examples()
    torch.manual_seed(0)
    base = ex.MODELS[model_name]()
    torch.manual_seed(0)
    twin = ex.MODELS[model_name]()
    ddp = nn.parallel.DistributedDataParallel(base)
    o_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    o_usb = DistributedOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-3), twin,
                                 schedule=schedule_for(schedule, twin, ws))
    cpu = torch.device("cpu")
    batches = [ex.batch(model_name, batch_size, s, rank, cpu) for s in range(per_round)]
    times: dict[str, list[float]] = {"ddp": [], "usbyte": []}

    def block(net, opt, key, timed):
        dist.barrier()  # both ranks start the block together (nothing in flight)
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            ex.loss_of(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if timed and i >= 2:  # the first two of a block refill the pipeline
                times[key].append(dt * 1e3)

    for r in range(rounds + 1):  # round 0: warm-up
        order = [("ddp", ddp, o_ddp), ("usbyte", twin, o_usb)]
        if r % 2:
            order.reverse()
        for key, net, opt in order:
            block(net, opt, key, timed=r > 0)
            if key == "usbyte":
                opt.synchronize()
    nparams = sum(p.numel() for p in twin.parameters())
    return {"ddp": times["ddp"], "usbyte": times["usbyte"], "tensors": len(o_usb._grads.names),
            "blocks": len(o_usb.schedule.blocks), "params": nparams}


# --------------------------------------------------------------------------------------------
# 1 rank: hook cost per tensor
# --------------------------------------------------------------------------------------------


class ManyTiny(nn.Module):
    """``n`` modules with one 16-element weight each: compute is negligible."""

    def __init__(self, n: int):
        super().__init__()
        self.cells = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(n))

    def forward(self, x):
        return sum(c(x).sum() for c in self.cells)


def hook_cost(n: int = 256, reps: int = 60) -> dict:
    """Per-tensor cost on a model of ``n`` tiny tensors, world size 1: the runtime with one
    block for all tensors (hooks and bookkeeping only) and with one block per tensor (plus one
    gloo collective issued per tensor), against a plain optimizer."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        arms = {}
        for tag in ("plain", "fused", "wfbp"):
            torch.manual_seed(0)
            net = ManyTiny(n)
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            if tag != "plain":
                opt = DistributedOptimizer(opt, net, schedule=schedule_for(
                    "default" if tag == "fused" else "wfbp", net, 1))
            arms[tag] = (net, opt)
        x = torch.randn(2, 4)
        res: dict[str, list[float]] = {f"{k}_{t}": [] for k in ("fw", "bw", "it") for t in arms}
        for r in range(reps):
            for tag, (net, opt) in arms.items():
                runtime = isinstance(opt, DistributedOptimizer)
                if runtime:
                    opt.synchronize()            # nothing pending: the pre-hooks' fast path
                t0 = time.perf_counter()
                loss = net(x)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                if runtime:
                    opt.synchronize()            # the updates, counted in the iteration
                t3 = time.perf_counter()
                if r >= 5:
                    res[f"fw_{tag}"].append(t1 - t0)
                    res[f"bw_{tag}"].append(t2 - t1)
                    res[f"it_{tag}"].append(t3 - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in res.items()}
        return {"n": n, **med,
                "hook_us": (med["bw_fused"] - med["bw_plain"]) / n,
                "issue_us": (med["bw_wfbp"] - med["bw_fused"]) / n,
                "prehook_us": (med["fw_fused"] - med["fw_plain"]) / n,
                "iter_us": (med["it_fused"] - med["it_plain"]) / n}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description="DistributedOptimizer against DDP on 2 gloo ranks")
    ap.add_argument("--quick", action="store_true", help="fewer rounds; print only")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    rounds = 2 if a.quick else a.rounds
    per_round = 8
    configs = [("cnn", 32, "default"), ("cnn", 32, "split4-forward"),
               ("transformer", 8, "default"), ("transformer", 8, "split4-forward")]
    rows = []
    for model, bs, sched in configs:
        res = values(run_local(side_by_side, 2, args=(model, bs, sched, rounds, per_round),
                               timeout_s=1800, threads=1))
        ddp = statistics.median(res[0]["ddp"] + res[1]["ddp"])
        usb = statistics.median(res[0]["usbyte"] + res[1]["usbyte"])
        row = (model, bs, sched, res[0]["tensors"], res[0]["blocks"], res[0]["params"], ddp, usb,
               usb / ddp, len(res[0]["ddp"]))
        rows.append(row)
        print(f"{model:12s} batch {bs:3d} {sched:15s} {row[3]:3d} tensors {row[4]:4d} blocks  "
              f"DDP {ddp:8.2f} ms  runtime {usb:8.2f} ms  ratio {usb / ddp:.3f}", flush=True)
    hc = hook_cost()
    print(f"hooks ({hc['n']} tensors, world size 1): post-accumulate-grad {hc['hook_us']:.2f} "
          f"us/tensor, forward pre-hook {hc['prehook_us']:.2f} us/module, whole iteration "
          f"{hc['iter_us']:.2f} us/tensor; one gloo collective per block {hc['issue_us']:.1f} us")
    if a.quick:
        return
    lines = [
        "# Runtime overhead: DistributedOptimizer against DDP",
        "",
        "Written by `python benchmarks/runtime_overhead.py` "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPU cores, {platform.machine()}).",
        "",
        "Two gloo ranks on loopback, no emulated bandwidth limit, one compute thread per rank, "
        "AdamW. Both arms run in the same two processes, side by side: rounds alternate a "
        f"block of {per_round} DDP iterations and a block of {per_round} runtime iterations "
        f"(order swapped every round, {rounds} rounds after a warm-up round, the first 2 "
        "iterations of each block dropped); an iteration is forward + backward + `step()` + "
        "`zero_grad()`, both ranks starting each block together. Medians over both ranks.",
        "",
        "| model | batch | schedule | tensors | blocks | parameters | DDP ms/iter | runtime "
        "ms/iter | runtime / DDP | samples per arm |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:,} | {r[6]:.2f} | "
                     f"{r[7]:.2f} | **{r[8]:.3f}** | {r[9]} |")
    lines += [
        "",
        "`default` is the runtime's DDP-like plan (1 MiB, then 25 MiB buckets); "
        "`split4-forward` cuts every tensor in 4 blocks issued input side first (many small "
        "collectives: a stress test of the per-block cost, not a plan anyone should use on "
        "loopback).",
        "",
        f"## Hook cost ({hc['n']} tensors of 16 elements, world size 1)",
        "",
        "The runtime with all tensors in one block (hooks and bookkeeping only) and with one "
        "block per tensor (one gloo all-reduce issued per tensor), against a plain optimizer; "
        "medians of 55 iterations.",
        "",
        "| | plain optimizer | runtime, 1 block | runtime, 1 block per tensor | cost |",
        "|---|---:|---:|---:|---:|",
        f"| backward: post-accumulate-grad hook | {hc['bw_plain']:.0f} us | {hc['bw_fused']:.0f} us "
        f"| {hc['bw_wfbp']:.0f} us | **{hc['hook_us']:.2f} us per tensor**; "
        f"**{hc['issue_us']:.1f} us per block** issued |",
        f"| forward: pre-hooks, nothing pending | {hc['fw_plain']:.0f} us | {hc['fw_fused']:.0f} us "
        f"| {hc['fw_wfbp']:.0f} us | **{hc['prehook_us']:.2f} us per module** |",
        f"| whole iteration, updates included | {hc['it_plain']:.0f} us | {hc['it_fused']:.0f} us | "
        f"{hc['it_wfbp']:.0f} us | **{hc['iter_us']:.2f} us per tensor** (1 block) |",
        "",
        "Part of the backward cost is autograd's: with a gradient already in place (a view of "
        "the flat buffer) it accumulates with an add instead of taking the new tensor, and it "
        "calls a Python hook per tensor. The per-block cost is gloo's for issuing one "
        "asynchronous all-reduce; the planner's `alpha` is where it belongs.",
        "",
        "The machine is shared; absolute times move between runs, the side-by-side ratios much "
        "less.",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
