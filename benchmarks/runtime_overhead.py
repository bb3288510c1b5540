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
    python benchmarks/runtime_overhead.py --only contract   # wait_in_backward's section only

``wait_in_backward=True`` (DDP's gradient contract, what the trainer integrations use) is
timed against the default and DDP, three arms side by side, in its own section.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from usbyte_opt.launcher import run_local, values
from usbyte_opt.models import build, make_batches
from usbyte_opt.planning.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer, default_schedule, profile_from_model
from usbyte_opt.runtime.default_plan import split_blocks

HERE = Path(__file__).resolve().parent
OUT = HERE / "runtime_overhead.md"


def schedule_for(kind: str, model: nn.Module, ws: int):
    if kind == "default":
        return default_schedule(model, ws)
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    if kind == "wfbp":
        return pb.schedule("wfbp-like", lay, [lay.whole(i) for i in pb.ready_order()])
    if kind == "split4-forward":
        return pb.schedule("split4-forward", lay, split_blocks(pb, lay, 4, pb.need_order()))
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# 2 ranks: DDP against the runtime
# --------------------------------------------------------------------------------------------


def side_by_side(rank: int, ws: int, model_name: str, batch_size: int, schedule: str,
                 pairs: int, rounds: int, per_round: int, compiled: bool = False) -> dict:
    """Both arms in these processes. ``pairs``: one DDP iteration and one runtime iteration
    followed by ``synchronize()`` (fence mode: no overlap with the next forward, the update
    inside the timed region), alternating, so that load on the machine hits both alike.
    ``rounds``: blocks of ``per_round`` iterations each, steady state with overlap. With
    ``compiled``, both models go through ``torch.compile`` (DDP as ``torch.compile(DDP(m))``)."""
    torch.manual_seed(0)
    base, inputs, loss_fn = build(model_name, batch_size)
    torch.manual_seed(0)
    twin, _, _ = build(model_name, batch_size)
    ddp = nn.parallel.DistributedDataParallel(base)
    o_ddp = torch.optim.AdamW(base.parameters(), lr=1e-3)
    o_usb = DistributedOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-3), twin,
                                 schedule=schedule_for(schedule, twin, ws), verify=False)
    net_ddp, net_usb = (torch.compile(ddp), torch.compile(twin)) if compiled else (ddp, twin)
    batches = [(x, None) for x in make_batches(inputs, rank, per_round)]

    def one(net, opt, x, y, fence):
        t0, c0 = time.perf_counter(), time.process_time()
        loss_fn(net(*x)).backward()
        opt.step()
        opt.zero_grad()
        if fence:
            opt.synchronize()
        return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3

    # 1. Pairs, fence mode. Wall time, and CPU time of the process (all its threads, gloo's
    #    included): the work done, which load from other processes barely disturbs.
    pair_ratio: list[float] = []
    pair_cpu: list[float] = []
    for i in range(pairs + 2):
        x, y = batches[i % per_round]
        arms = [(net_ddp, o_ddp, False), (net_usb, o_usb, True)]
        if i % 2:
            arms.reverse()
        dist.barrier()
        got = {id(net): one(net, opt, x, y, fence) for net, opt, fence in arms}
        if i >= 2:
            pair_ratio.append(got[id(net_usb)][0] / got[id(net_ddp)][0])
            pair_cpu.append(got[id(net_usb)][1] / got[id(net_ddp)][1])

    # 2. Blocks, steady state.
    block_ratio: list[float] = []
    times: dict[str, list[float]] = {"ddp": [], "usbyte": []}
    for r in range(rounds + 1):  # round 0: warm-up
        cur: dict[str, list[float]] = {"ddp": [], "usbyte": []}
        order = [("ddp", net_ddp, o_ddp), ("usbyte", net_usb, o_usb)]
        if r % 2:
            order.reverse()
        for key, net, opt in order:
            dist.barrier()  # both ranks start the block together, nothing in flight
            for i, (x, y) in enumerate(batches):
                dt = one(net, opt, x, y, False)[0]
                if r > 0 and i >= 2:  # the first two of a block refill the pipeline
                    cur[key].append(dt)
                    times[key].append(dt)
            if key == "usbyte":
                opt.synchronize()
        if r > 0:
            block_ratio.append(statistics.median(cur["usbyte"]) / statistics.median(cur["ddp"]))
    nparams = sum(p.numel() for p in twin.parameters())
    return {"pairs": pair_ratio, "pairs_cpu": pair_cpu, "blocks": block_ratio, "ddp": times["ddp"],
            "usbyte": times["usbyte"], "tensors": len(o_usb._state.grads.names),
            "nblocks": len(o_usb.schedule.blocks), "params": nparams}


# --------------------------------------------------------------------------------------------
# 2 ranks: DDP's gradient contract (wait_in_backward) against the default
# --------------------------------------------------------------------------------------------


#: The arms of a three-arm run: DDP, the runtime as a reference, the runtime varied.
ARMS = {"contract": ("ddp", "deferred", "wait")}


def contract(rank: int, ws: int, model_name: str, batch_size: int, schedule: str, rounds: int,
             per_round: int, kind: str = "contract") -> dict:
    """Three arms in these processes, in steady-state blocks, order rotated each round: DDP,
    and two forms of the runtime (``kind``): ``contract``, the runtime as it is (communication
    in flight past ``backward()``) and with ``wait_in_backward=True`` (averaged gradients when
    ``backward()`` returns, as DDP). (The guard is no longer an option to time against: it is
    what runs each update at its first use in the next forward.)"""
    arms = {}
    for key in ARMS[kind]:
        torch.manual_seed(0)
        net, inputs, loss_fn = build(model_name, batch_size)
        if key == "ddp":
            arms[key] = (nn.parallel.DistributedDataParallel(net),
                         torch.optim.AdamW(net.parameters(), lr=1e-3))
        else:
            opt = DistributedOptimizer(
                torch.optim.AdamW(net.parameters(), lr=1e-3), net,
                schedule=schedule_for(schedule, net, ws), verify=False,
                wait_in_backward=key == "wait")
            arms[key] = (net, opt)
    batches = make_batches(inputs, rank, per_round)
    times: dict[str, list[float]] = {k: [] for k in arms}
    _, ref, var = ARMS[kind]
    ratio: dict[str, list[float]] = {f"{var}/{ref}": [], f"{var}/ddp": [], f"{ref}/ddp": []}
    keys = list(arms)
    for r in range(rounds + 1):  # round 0: warm-up
        cur: dict[str, list[float]] = {k: [] for k in arms}
        order = keys[r % 3:] + keys[:r % 3]
        for key in order:
            net, opt = arms[key]
            dist.barrier()
            for i, x in enumerate(batches):
                t0 = time.perf_counter()
                loss_fn(net(*x)).backward()
                opt.step()
                opt.zero_grad()
                if r > 0 and i >= 2:
                    cur[key].append((time.perf_counter() - t0) * 1e3)
            if isinstance(opt, DistributedOptimizer):
                opt.synchronize()
        if r > 0:
            med = {k: statistics.median(v) for k, v in cur.items()}
            for k, v in cur.items():
                times[k] += v
            for key in ratio:
                a, b = key.split("/")
                ratio[key].append(med[a] / med[b])
    return {"ratio": ratio, "times": times, "nblocks": len(arms[var][1].schedule.blocks),
            "mode": arms[var][1].mode}


SECTIONS = {
    "contract": dict(
        begin="<!-- wait_in_backward: begin -->", end="<!-- wait_in_backward: end -->",
        title="## DDP's gradient contract: `wait_in_backward=True` against the default",
        arms="DDP, the runtime as it is (communication in flight past `backward()`, updates in the "
             "next forward), and the runtime with `wait_in_backward=True` (the end of backward "
             "waits for the step's all-reduce, as DDP; what the trainer integrations use)",
        cols=("wait / default", "wait / DDP", "default / DDP", "ms/iter: DDP, default, wait"),
        configs=[("lab-cnn", 16, "default"), ("lab-cnn", 16, "split4-forward"),
                 ("transformer", 4, "default")],
        after="On loopback the wire is fast, so what waiting at the end of backward gives up, the "
              "overlap of the last blocks with the next forward, is small; it grows with the "
              "share of communication that the default overlaps with the forward (a slow "
              "network, many-block plans)."),
}


def contract_section(rounds: int, per_round: int, repeat: int = 3,
                     kind: str = "contract") -> list[str]:
    """Run :func:`contract` ``repeat`` times on each model of section ``kind`` and return its
    Markdown section (each run's median ratio; the table gives their range)."""
    sec: dict[str, Any] = SECTIONS[kind]
    _, ref, var = ARMS[kind]
    keys = [f"{var}/{ref}", f"{var}/ddp", f"{ref}/ddp"]
    load_before = os.getloadavg()[0]
    rows = []
    for model, bs, sched in sec["configs"]:
        runs: dict[str, list[float]] = {k: [] for k in keys}
        ms: dict[str, list[float]] = {k: [] for k in ARMS[kind]}
        for _ in range(repeat):
            res = values(run_local(contract, 2, args=(model, bs, sched, rounds, per_round, kind),
                                   timeout_s=1800, threads=1))
            for k in runs:
                runs[k].append(statistics.median(res[0]["ratio"][k] + res[1]["ratio"][k]))
            for k in ms:
                ms[k].append(statistics.median(res[0]["times"][k] + res[1]["times"][k]))
            print(f"{kind} {model:12s} {sched:15s} "
                  + " ".join(f"{k} {runs[k][-1]:.3f}" for k in keys)
                  + " (ms: " + ", ".join(f"{k} {ms[k][-1]:.1f}" for k in ms) + ")", flush=True)
        got = {k: (statistics.median(v), min(v), max(v)) for k, v in runs.items()}
        med = {k: statistics.median(v) for k, v in ms.items()}
        rows.append((model, bs, sched, res[0]["nblocks"], res[0]["mode"], got, med))
    cols = sec["cols"]
    lines = [
        sec["begin"], sec["title"], "",
        f"Written by `python benchmarks/runtime_overhead.py --only {kind}` "
        f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}; 1-minute load average "
        f"{load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end). Two gloo ranks "
        "on loopback, AdamW; three arms in the same two processes, in steady-state blocks of "
        f"{per_round} iterations (the first 2 dropped), {rounds} rounds, the order rotated each "
        f"round, {repeat} runs: {sec['arms']}. Ratios of the blocks' medians per round, their "
        "median over rounds and both ranks in each run: the median of the runs, and their range.",
        "",
        f"| model | batch | schedule | blocks | mode | {cols[0]} (range) | {cols[1]} | {cols[2]} | "
        f"{cols[3]} |",
        "|---|---:|---|---:|---|---|---|---|---|",
    ]
    for model, bs, sched, nb, mode, got, med in rows:
        a, b, c = (got[k] for k in keys)
        lines.append(f"| {model} | {bs} | {sched} | {nb} | {mode} | **{a[0]:.3f}** ({a[1]:.3f} – "
                     f"{a[2]:.3f}) | {b[0]:.3f} ({b[1]:.3f} – {b[2]:.3f}) | {c[0]:.3f} "
                     f"({c[1]:.3f} – {c[2]:.3f}) | "
                     + ", ".join(f"{med[k]:.1f}" for k in ARMS[kind]) + " |")
    lines += ["", sec["after"], sec["end"], ""]
    return lines


def _write_contract(lines: list[str], kind: str = "contract") -> None:
    """Put a section into runtime_overhead.md, replacing an earlier one."""
    begin, end = SECTIONS[kind]["begin"], SECTIONS[kind]["end"]
    text = OUT.read_text() if OUT.exists() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + "\n".join(lines) + tail
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    OUT.write_text(text)


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
                    "default" if tag == "fused" else "wfbp", net, 1), verify=False)
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


def _summary(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(sorted(xs), n=4)
    return statistics.median(xs), q[0], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description="DistributedOptimizer against DDP on 2 gloo ranks")
    ap.add_argument("--quick", action="store_true", help="fewer iterations; print only")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--only", choices=["contract"],
                    help="run only one section and replace it in the report (contract: "
                         "wait_in_backward against the default)")
    a = ap.parse_args()
    pairs, rounds = (8, 2) if a.quick else (a.pairs, a.rounds)
    per_round = 6
    if a.only:
        section = contract_section(rounds, per_round, 1 if a.quick else 3, a.only)
        if not a.quick:
            _write_contract(section, a.only)
            print(f"wrote {OUT}")
        return
    configs = [("lab-cnn", 16, "default", False), ("lab-cnn", 16, "split4-forward", False),
               ("transformer", 4, "default", False), ("transformer", 4, "split4-forward", False),
               ("lab-cnn", 16, "default", True), ("transformer", 4, "default", True)]
    load_before = os.getloadavg()[0]
    rows = []
    for model, bs, sched, compiled in configs:
        res = values(run_local(side_by_side, 2,
                               args=(model, bs, sched, pairs, rounds, per_round, compiled),
                               timeout_s=1800, threads=1))
        pair = _summary(res[0]["pairs"] + res[1]["pairs"])
        cpu = _summary(res[0]["pairs_cpu"] + res[1]["pairs_cpu"])
        block = _summary(res[0]["blocks"] + res[1]["blocks"])
        ddp = statistics.median(res[0]["ddp"] + res[1]["ddp"])
        usb = statistics.median(res[0]["usbyte"] + res[1]["usbyte"])
        label = f"{model} (compiled)" if compiled else model
        rows.append((label, bs, sched, res[0]["tensors"], res[0]["nblocks"], res[0]["params"],
                     pair, block, ddp, usb, cpu))
        print(f"{label:22s} batch {bs:2d} {sched:15s} {res[0]['tensors']:3d} tensors "
              f"{res[0]['nblocks']:4d} blocks | fence pairs {pair[0]:.3f} [{pair[1]:.3f}, "
              f"{pair[2]:.3f}] cpu {cpu[0]:.3f} [{cpu[1]:.3f}, {cpu[2]:.3f}] | "
              f"blocks {block[0]:.3f} [{block[1]:.3f}, {block[2]:.3f}] "
              f"(DDP {ddp:.1f} ms, runtime {usb:.1f} ms)", flush=True)
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
        f"{platform.python_version()}, {os.cpu_count()} CPU cores, {platform.machine()}; "
        f"1-minute load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at "
        "the end: the machine was shared with other jobs).",
        "",
        "Two gloo ranks on loopback, no emulated bandwidth limit, one compute thread per rank, "
        "AdamW, built-in models of `usbyte_opt.models` (those `examples/train.py` trains). "
        "Rows marked compiled run both arms through `torch.compile` (DDP as "
        "`torch.compile(DDP(model))`; the runtime applies every pending update before a "
        "compiled forward, so its updates do not overlap it). Both arms live in the same two processes "
        "and are timed side by side in one run, so that load on the (shared) machine falls on "
        "both alike:",
        "",
        f"- **fence pairs**: {pairs} pairs of one DDP iteration and one runtime iteration "
        "followed by `synchronize()`, alternating which goes first. The runtime iteration then "
        "contains all of its communication and its update (no overlap with the next forward), "
        "so the ratio is its overhead over DDP, pessimistic by the overlap it gives up. Given "
        "as wall time and as CPU time of the rank's process (all threads, gloo's included): "
        "the work done, which load from other processes on the machine barely disturbs.",
        f"- **blocks**: {rounds} rounds of {per_round} DDP iterations and {per_round} runtime "
        "iterations in steady state (updates applied in the next forward), order swapped each "
        "round, the first 2 of each block dropped. The ratio of the two blocks of a round is "
        "taken; blocks last seconds, so this is the noisier of the two.",
        "",
        "An iteration is forward + backward + `step()` + `zero_grad()`. Ratios are runtime / "
        "DDP: median over pairs (or rounds) and both ranks, with the quartiles. The last two "
        "columns are the pooled medians of the steady-state iterations, for scale.",
        "",
        "| model | batch | schedule | tensors | blocks | parameters | fence pairs, wall: "
        "runtime / DDP (quartiles) | fence pairs, CPU: runtime / DDP (quartiles) | blocks, "
        "wall: runtime / DDP (quartiles) | DDP ms/iter | runtime ms/iter |",
        "|---|---:|---|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:,} | "
                     f"**{r[6][0]:.3f}** ({r[6][1]:.3f} – {r[6][2]:.3f}) | "
                     f"**{r[10][0]:.3f}** ({r[10][1]:.3f} – {r[10][2]:.3f}) | "
                     f"**{r[7][0]:.3f}** ({r[7][1]:.3f} – {r[7][2]:.3f}) | {r[8]:.1f} | "
                     f"{r[9]:.1f} |")
    lines += [
        "",
        "`default` is the runtime's DDP-like plan (1 MiB, then 25 MiB buckets); "
        "`split4-forward` cuts every tensor in 4 blocks issued input side first (many small "
        "collectives: a stress test of the per-block cost, not a plan to use on loopback).",
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
    lines += contract_section(rounds, per_round, 1 if a.quick else 3)
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
