"""The prepared GPU check of the runtime's CUDA path: one command, one GPU, under 8 minutes.

    PYTHONPATH=. python benchmarks/gpu_check.py --out OUT_DIR

It writes ``OUT_DIR/gpu_check.md`` (the report, also printed), ``gpu_check.json`` and the
``torch.profiler`` trace of part 3. A machine with one GPU can run NCCL only at world size 1
(NCCL refuses two ranks on one device), where the all-reduce is an identity; gloo, which
copies CUDA tensors through the host on streams of its own, carries them between 2 ranks on
the same GPU. The parts, and what each can and cannot catch:

1. ``tests/test_runtime_cuda.py`` (NCCL, world size 1): the runtime's stream handling against
   the plain optimizer (side streams, bf16 autocast, GradScaler). Catches wrong stream waits
   that corrupt values and broken AMP paths; cannot catch anything that needs a second rank
   (issue order, a race with a real transfer), since the all-reduce is an identity.
2. **No host synchronisation** (NCCL, world size 1): steady-state forward, backward,
   ``step()`` and ``zero_grad()`` under ``torch.cuda.set_sync_debug_mode("error")``, in
   overlap and fence mode. Catches every host sync the runtime adds (``.item()``, a
   ``cuda.synchronize``, a blocking copy); cannot see syncs that only happen at world size > 1
   (the usage map read when a rank did not use a tensor).
3. **Two ranks, gloo carrying CUDA tensors**: training against DDP over the same transport
   (overlap mode, updates on the update stream), the optimizer calls per iteration, and a
   ``torch.profiler`` trace of steady-state iterations with the time that work on other
   streams (gloo's copies, the update stream) overlaps the compute stream. Catches races
   between the update stream, the compute stream and a real transfer, and a host that
   waits per module; it runs gloo's stream handling, not NCCL's.
4. **profile -> optimize -> train** of ResNet-50 (``usbyte-opt bench resnet50 --device cuda
   -n 1``): the CLI flow on a real model, with DDP side by side and CUDA-event timing. Catches
   failures of the flow and a runtime overhead against DDP; at world size 1 it measures no
   communication.

``--smoke`` runs parts 3 and 4 on the CPU instead (gloo, a small model, no CUDA trace): it
checks the script itself, and the suite runs it, so that a GPU session is not spent on the
script's own bugs. It says nothing of the CUDA path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _small_model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def _schedule(model: Any, ws: int, mode: str = "overlap") -> Any:
    import dataclasses

    from usbyte_opt.problem import Problem
    from usbyte_opt.runtime import profile_from_model, split_blocks
    from usbyte_opt.runtime.default_plan import make_schedule

    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    sched = make_schedule(pb, lay, split_blocks(pb, lay, 2, pb.need_order()), "split")
    return dataclasses.replace(sched, mode=mode)


# ------------------------------------------------------------------------------------------
# Part 1
# ------------------------------------------------------------------------------------------


def part_tests(budget_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_runtime_cuda.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=budget_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return {"ok": proc.returncode == 0, "summary": tail[-1] if tail else "",
            "seconds": time.perf_counter() - t0,
            "failures": [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))][:10]}


# ------------------------------------------------------------------------------------------
# Part 2
# ------------------------------------------------------------------------------------------


def part_sync_debug() -> dict[str, Any]:
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer

    out: dict[str, Any] = {}
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    try:
        for mode in ("overlap", "fence"):
            torch.manual_seed(0)
            model = _small_model().to(dev)
            opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
                                       schedule=_schedule(model, 1, mode))
            x = torch.randn(32, 3, 16, 16, device=dev)
            y = torch.randint(0, 10, (32,), device=dev)
            for _ in range(5):
                F.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
            torch.cuda.synchronize()
            where = "none"
            try:
                torch.cuda.set_sync_debug_mode("error")
                for i in range(5):
                    where = f"forward {i}"
                    loss = F.cross_entropy(model(x), y)
                    where = f"backward {i}"
                    loss.backward()
                    where = f"step {i}"
                    opt.step()
                    where = f"zero_grad {i}"
                    opt.zero_grad()
                out[mode] = {"ok": True}
            except RuntimeError as e:
                out[mode] = {"ok": False, "where": where, "error": str(e).splitlines()[0],
                             "trace": traceback.format_exc()[-2000:]}
            finally:
                torch.cuda.set_sync_debug_mode(0)
            opt.close()
    finally:
        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------
# Part 3
# ------------------------------------------------------------------------------------------


def _overlap_ms(trace: dict[str, Any]) -> dict[str, float]:
    """Busy time of the compute stream (the one with most kernels), of every other stream, and
    of their intersection, from a Chrome trace of torch.profiler."""
    spans: dict[Any, list[tuple[float, float]]] = {}
    kernels: dict[Any, int] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        s = ev.get("args", {}).get("stream", ev.get("tid"))
        spans.setdefault(s, []).append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
        if ev.get("cat") == "kernel":
            kernels[s] = kernels.get(s, 0) + 1
    if not spans:
        return {"compute_ms": 0.0, "other_ms": 0.0, "overlap_ms": 0.0, "streams": 0}
    compute = max(kernels or spans, key=lambda s: kernels.get(s, 0))

    def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    c = union(spans[compute])
    o = union([iv for s, ivs in spans.items() if s != compute for iv in ivs])
    inter, i, j = 0.0, 0, 0
    while i < len(c) and j < len(o):
        a, b = max(c[i][0], o[j][0]), min(c[i][1], o[j][1])
        inter += max(0.0, b - a)
        if c[i][1] < o[j][1]:
            i += 1
        else:
            j += 1
    return {"compute_ms": sum(b - a for a, b in c) / 1e3, "other_ms": sum(b - a for a, b in o) / 1e3,
            "overlap_ms": inter / 1e3, "streams": len(spans)}


def two_ranks(rank: int, ws: int, out_dir: str, device: str = "cuda") -> dict[str, Any]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from usbyte_opt.runtime import DistributedOptimizer

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    base = _small_model()
    ref, mod = copy.deepcopy(base).to(dev), copy.deepcopy(base).to(dev)
    ddp = DDP(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1),
                               mod, schedule=_schedule(mod, ws), verify=False)
    g = torch.Generator(device="cpu").manual_seed(rank)
    batches = [(torch.randn(32, 3, 16, 16, generator=g).to(dev),
                torch.randint(0, 10, (32,), generator=g).to(dev)) for _ in range(4)]
    steps = 12
    calls0 = 0
    for step in range(steps):
        x, y = batches[step % 4]
        F.cross_entropy(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        if step == 4:
            calls0 = opt.optimizer_calls
        F.cross_entropy(mod(x), y).backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    if cuda:
        torch.cuda.synchronize()
    calls = (opt.optimizer_calls - calls0) / (steps - 4)   # updates of steps 4..11
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mod.parameters()))
    res: dict[str, Any] = {"diff": diff, "optimizer_calls_per_iteration": calls}
    if rank == 0 and cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(3):
                x, y = batches[step % 4]
                F.cross_entropy(mod(x), y).backward(); opt.step(); opt.zero_grad()
            opt.synchronize()
            torch.cuda.synchronize()
        path = os.path.join(out_dir, "trace_two_ranks.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            res["overlap"] = _overlap_ms(json.load(f))
    else:
        for step in range(3):
            x, y = batches[step % 4]
            F.cross_entropy(mod(x), y).backward(); opt.step(); opt.zero_grad()
        opt.synchronize()
    opt.close()
    return res


def part_two_ranks(out_dir: str, budget_s: float, device: str = "cuda") -> dict[str, Any]:
    from usbyte_opt.launcher import run_local

    res = run_local(two_ranks, 2, args=(out_dir, device), timeout_s=budget_s, pg_timeout_s=120)
    return {"ranks": [r.value if r.ok else {"error": f"{r.error_type}: {r.error}",
                                             "trace": (r.trace or "")[-2000:]} for r in res]}


# ------------------------------------------------------------------------------------------
# Part 4
# ------------------------------------------------------------------------------------------


def part_flow(out_dir: str, budget_s: float, device: str = "cuda") -> dict[str, Any]:
    t0 = time.perf_counter()
    bench_dir = os.path.join(out_dir, "bench")
    model, k = ("resnet50", "30") if device == "cuda" else ("mlp", "4")
    cmd = [sys.executable, "-m", "usbyte_opt", "bench", model, "--device", device, "-n", "1",
           "-k", k, "-s", "ddp,best", "--rounds", "3", "--no-reference", "--json",
           "-o", bench_dir]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out: dict[str, Any] = {"ok": proc.returncode == 0, "seconds": time.perf_counter() - t0,
                           "command": " ".join(cmd[2:])}
    if proc.returncode != 0:
        out["stderr"] = proc.stderr[-3000:]
        return out
    try:
        data = json.loads(proc.stdout)
        out["measured_ms"] = {r["strategy"]: round(r["measured_ms"], 2) for r in data["runs"]}
        out["predicted_ms"] = {r["strategy"]: round(r["predicted_ms"], 2) for r in data["runs"]}
        out["matches_ddp"] = data.get("correct")
    except (ValueError, KeyError, TypeError) as e:
        out["parse_error"] = str(e)
        out["stdout"] = proc.stdout[-3000:]
    return out


# ------------------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> str:
    lines = ["# GPU check of the runtime's CUDA path", ""]
    env = res.get("env", {})
    lines.append(f"torch {env.get('torch')}, {env.get('gpu')}, {env.get('when')}")
    lines.append("")
    p1 = res.get("tests", {})
    if "tests" in res:
        lines.append(f"1. tests/test_runtime_cuda.py: {'ok' if p1.get('ok') else 'FAILED'} "
                     f"({p1.get('summary', p1.get('error', ''))})")
    for f in p1.get("failures", []):
        lines.append(f"   - {f}")
    p2 = res.get("sync_debug", {})
    for mode in ("overlap", "fence") if "sync_debug" in res else ():
        r = p2.get(mode, {})
        state = "no host sync" if r.get("ok") else f"HOST SYNC at {r.get('where')}: {r.get('error')}"
        lines.append(f"2. sync debug mode, {mode}: {state}")
    if "error" in p2:
        lines.append(f"2. sync debug: FAILED: {p2['error']}")
    p3 = res.get("two_ranks", {})
    transport = "gloo, CUDA tensors" if "CPU" not in str(env.get("gpu")) else "gloo, CPU"
    for r, v in enumerate(p3.get("ranks", [])):
        if "error" in v:
            lines.append(f"3. two ranks ({transport}), rank {r}: FAILED: {v['error']}")
            continue
        lines.append(f"3. two ranks ({transport}), rank {r}: max |runtime - DDP| = "
                     f"{v['diff']:.3g}; optimizer calls per iteration {v['optimizer_calls_per_iteration']:.1f}")
        if "overlap" in v:
            o = v["overlap"]
            lines.append(f"   trace: compute stream busy {o['compute_ms']:.2f} ms, other streams "
                         f"{o['other_ms']:.2f} ms, overlapping {o['overlap_ms']:.2f} ms "
                         f"({o['streams']} streams)")
    if "error" in p3:
        lines.append(f"3. two ranks: FAILED: {p3['error']}")
    p4 = res.get("flow", {})
    if p4.get("ok"):
        lines.append(f"4. {p4.get('command')}: ok in {p4.get('seconds', 0):.0f} s; measured "
                     f"{p4.get('measured_ms')} ms, predicted {p4.get('predicted_ms')} ms, "
                     f"matches DDP: {p4.get('matches_ddp')}")
    else:
        lines.append(f"4. flow: FAILED: {p4.get('error') or p4.get('stderr', '')[-500:]}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check"), help="output folder")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                               "tests,sync_debug,two_ranks,flow")
    ap.add_argument("--smoke", action="store_true",
                    help="run parts 3 and 4 on the CPU: a check of this script, not of CUDA")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch

    when = time.strftime("%Y-%m-%d %H:%M")
    if args.smoke:
        res: dict[str, Any] = {"env": {"torch": torch.__version__, "gpu": "none (--smoke, CPU)",
                                       "when": when}}
        parts = [("two_ranks", lambda: part_two_ranks(args.out, 120, "cpu")),
                 ("flow", lambda: part_flow(args.out, 200, "cpu"))]
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device: nothing to check", file=sys.stderr)
        return 2
    else:
        res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "when": when}}
        parts = [("tests", lambda: part_tests(150)), ("sync_debug", part_sync_debug),
                 ("two_ranks", lambda: part_two_ranks(args.out, 150)),
                 ("flow", lambda: part_flow(args.out, 200))]
    skip = set(filter(None, args.skip.split(",")))
    for name, fn in parts:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - every part is reported, whatever happens
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(f"[gpu_check] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    text = report(res)
    Path(args.out, "gpu_check.md").write_text(text)
    print(text)
    if args.smoke:  # the script's own check: every part it ran must have worked
        ranks = res.get("two_ranks", {}).get("ranks", [])
        ok = res.get("flow", {}).get("ok") and ranks and all("error" not in r for r in ranks)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
