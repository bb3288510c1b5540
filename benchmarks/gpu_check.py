"""The prepared GPU check of the runtime's CUDA path: one command, one GPU, at most 6 minutes.

On the GPU machine, from the repository root, with the wheels of
``python benchmarks/gpu_bundle.py --python-version 3.12 --dest .whl`` carried along (no
install of the project, no network)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
      PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu_check.py --out $OUT

(one shell command: the line ends in ``&&``; through the device tool, carry ``.whl``).

It writes ``OUT/gpu_check.md`` (the report, also printed), ``gpu_check.json``, each part's log
under ``OUT/logs/`` and the ``torch.profiler`` trace of the two-rank part. The report is
rewritten after every part, so a part that hangs loses only itself. Each part runs in a
process of its own (``python3 benchmarks/gpu_check.py --part NAME``; the same interpreter and
flags, ``PYTHONPATH`` made absolute with the repository first), with its own time limit,
under a global deadline of :data:`DEADLINE_S` seconds, after an import check of a few seconds
that stops everything when the bundle is missing. A machine with one GPU runs NCCL only at
world size 1 (NCCL refuses two ranks on one device), where the all-reduce is an identity;
gloo, which copies CUDA tensors through the host on streams of its own, carries them between
2 ranks on the same GPU. The parts, by value:

0. ``imports``: torch, CUDA, ``usbyte_opt.runtime`` (so pydantic), pulp and jsonschema, with
   the version and location of each.
1. ``tests``: ``tests/test_runtime_cuda.py`` (NCCL, world size 1) with deterministic
   settings: the runtime's stream handling against the plain optimizer (side streams, bf16
   autocast, GradScaler in both modes, fused or not). Catches wrong stream waits and broken
   AMP paths; cannot catch anything that needs a second rank.
2. ``sync_debug``: steady-state forward, backward, ``step()`` and ``zero_grad()`` under
   ``torch.cuda.set_sync_debug_mode("error")`` for more than ``check_every`` steps (the drift
   check runs inside), AdamW and fused AdamW + GradScaler (fp16), overlap and fence mode.
   Catches every host sync the runtime adds; cannot see syncs of world size > 1 only.
3. ``probes``: the two races a review found, made visible by a sleep kernel queued on the
   update stream before each ``step()``: GradScaler's ``found_inf`` freed while a fused
   optimizer on the update stream still reads it (the compute stream then refills the
   memory with 1.0, and the step is skipped), and a parent module reading a child's weight
   before calling the child (the gate was at the child). Each is run as the runtime does it
   and once with its fix undone, which must differ, so that a pass says the probe can see
   the race.
4. ``two_ranks`` (gloo carrying CUDA tensors): training against DDP over the same transport,
   optimizer calls per iteration, and a ``torch.profiler`` trace of steady-state iterations:
   the time other streams (gloo's copies, the update stream) are busy during the compute
   stream's forward (``record_function`` ranges), that is step N's communication and
   updates overlapping forward N+1.
5. ``sharded``: sharded mode (ZeRO-1) on CUDA: at world size 1 on NCCL against the plain
   optimizer, then 2 ranks on gloo carrying CUDA tensors against DDP, with the planner's
   ``best-sharded`` schedule (grouped all-gathers) and SGD with momentum and AdamW, and AdamW
   with ``zero_stage=2`` (ZeRO-2: no flat gradient buffer); the wrapped optimizer's state
   bytes per rank beside DDP's, the runtime's gradient memory (``report()["memory"]``) and
   the CUDA allocator's peak while the runtime trains (ZeRO-2 against ZeRO-1).
   Catches a CUDA reduce-scatter or all-gather the backends refuse, a staging copy on the
   wrong stream, a gate that lets the forward read a parameter before its all-gather, a block's
   gradient storage freed while its reduce-scatter still reads it.
6. ``flow``: ``python3 -m usbyte_opt bench transformer --device cuda -n 1 -s ddp,best``:
   profile -> optimize -> train of a small transformer (tied embedding) in about 2 minutes,
   DDP side by side, CUDA-event timing. At world size 1 it measures no communication.

``--smoke`` runs the same parts on the CPU where they can (``imports``; ``tests``, which skip;
``probes``' parent-reads-child case without the sleep; ``two_ranks`` and ``flow`` on gloo with a
small model): it checks this script, and ``tests/test_gpu_rehearsal.py`` runs it from a clean
copy with only the image's packages and the bundle, so that a GPU session is not spent on the
script's own bugs. It says nothing of the CUDA path.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The whole check's deadline (seconds), from the start of the import check.
DEADLINE_S = 360.0

#: (name, time limit in seconds, runs under --smoke), in order of value.
PARTS: list[tuple[str, float, bool]] = [
    ("imports", 30.0, True),
    ("tests", 75.0, True),
    ("sync_debug", 45.0, False),
    ("probes", 45.0, True),
    ("two_ranks", 75.0, True),
    ("sharded", 50.0, True),
    ("flow", 120.0, True),
]

#: A sleep queued on the update stream before each step of the probes (GPU cycles, ~50 ms).
SLEEP_CYCLES = 100_000_000


def _child_env() -> dict[str, str]:
    """The parts' environment: ``PYTHONPATH`` absolute, the repository first; deterministic
    cuBLAS."""
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != str(ROOT)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1",
                CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))


def _python() -> list[str]:
    """This interpreter with its flags (``-I``, ``-S``, ... carry over to the parts)."""
    return [sys.executable, *subprocess._args_from_interpreter_flags()]  # type: ignore[attr-defined]


def _small_model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def _schedule(model: Any, ws: int, mode: str = "overlap", pieces: int = 2) -> Any:
    import dataclasses

    from usbyte_opt.planning.problem import Problem
    from usbyte_opt.runtime import profile_from_model, split_blocks

    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    sched = pb.schedule("split", lay, split_blocks(pb, lay, pieces, pb.need_order()))
    return dataclasses.replace(sched, mode=mode)


def _nccl_one_rank() -> Any:
    """A world-size-1 NCCL group on GPU 0 (the caller destroys it)."""
    import tempfile

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    return dev


def _gloo_one_rank() -> Any:
    import tempfile

    import torch
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------
# 0. imports
# ------------------------------------------------------------------------------------------


def part_imports(out_dir: str, smoke: bool) -> dict[str, Any]:
    import importlib
    import importlib.metadata as md

    res: dict[str, Any] = {"python": sys.version.split()[0], "modules": {}}
    missing = []
    for name, dist in (("torch", "torch"), ("numpy", "numpy"), ("scipy", "scipy"),
                       ("typer", "typer"), ("rich", "rich"),
                       ("typing_extensions", "typing-extensions"), ("attr", "attrs"),
                       ("pydantic", "pydantic"), ("pydantic_core", "pydantic-core"),
                       ("pulp", "pulp"), ("jsonschema", "jsonschema"), ("pytest", "pytest"),
                       ("usbyte_opt.runtime", "")):
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported
            missing.append(name)
            res["modules"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        try:
            ver = md.version(dist) if dist else "this tree"
        except md.PackageNotFoundError:
            ver = getattr(mod, "__version__", None)
        res["modules"][name] = {"version": str(ver) if ver is not None else None,
                                "from": str(Path(getattr(mod, "__file__", "") or "?").parent),
                                "s": round(time.perf_counter() - t0, 2)}
    res["missing"] = missing
    if "torch" not in missing:
        import inspect

        import torch
        from torch.nn.parallel import DistributedDataParallel

        res["torch"] = torch.__version__
        # usbyte_opt.ddp.wrap needs it (DDP's planned buckets): there from torch 2.11?
        res["ddp_bucket_cap_mb_list"] = "bucket_cap_mb_list" in inspect.signature(
            DistributedDataParallel.__init__).parameters
        res["cuda"] = bool(torch.cuda.is_available())
        res["gpu"] = torch.cuda.get_device_name(0) if res["cuda"] else "none"
    essential = {"torch", "pydantic", "usbyte_opt.runtime"} & set(missing)
    res["ok"] = not essential and (smoke or res.get("cuda", False))
    if essential:
        res["error"] = (f"cannot import {', '.join(sorted(essential))}: install the bundle first "
                        "(python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl) "
                        "and put it on PYTHONPATH")
    elif not smoke and not res.get("cuda"):
        res["error"] = "no CUDA device: nothing to check (--smoke runs the CPU parts)"
    return res


# ------------------------------------------------------------------------------------------
# 1. tests
# ------------------------------------------------------------------------------------------


def part_tests(out_dir: str, smoke: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([*_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                           "tests/test_runtime_cuda.py"], cwd=ROOT, capture_output=True,
                          text=True, env=_child_env())
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    Path(out_dir, "logs", "tests.log").write_text(proc.stdout + proc.stderr)
    summary = tail[-1] if tail else ""
    # Without CUDA every test skips: pytest's exit code 0 with "skipped" (5 would be "none").
    ok = proc.returncode == 0 and (smoke or "passed" in summary)
    return {"ok": ok, "summary": summary, "seconds": time.perf_counter() - t0,
            "failures": [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))][:10]}


# ------------------------------------------------------------------------------------------
# 2. sync_debug
# ------------------------------------------------------------------------------------------


def _sync_debug_one(dev: Any, mode: str, fused: bool, check_every: int) -> dict[str, Any]:
    """Steady-state training under sync debug mode "error"; where it stopped, if it did."""
    import torch
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer

    torch.manual_seed(0)
    model = _small_model().to(dev)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused), model,
                               schedule=_schedule(model, 1, mode), check_every=check_every)
    scaler = torch.amp.GradScaler("cuda") if fused else None
    x = torch.randn(32, 3, 16, 16, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)
    where = "warm-up"

    def step(i: int) -> None:
        nonlocal where
        where = f"forward {i}"
        with torch.autocast("cuda", dtype=torch.float16, enabled=fused):
            loss = F.cross_entropy(model(x), y)
        where = f"backward {i}"
        (scaler.scale(loss) if scaler is not None else loss).backward()
        where = f"step {i}"
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        where = f"zero_grad {i}"
        opt.zero_grad()

    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    n = 3 * check_every + 1
    try:
        torch.cuda.set_sync_debug_mode("error")
        for i in range(n):
            step(i)
        res: dict[str, Any] = {"ok": True, "steps": n}
    except RuntimeError as e:
        res = {"ok": False, "where": where, "error": str(e).splitlines()[0],
               "trace": traceback.format_exc()[-2000:]}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.close()
    return res


def part_sync_debug(out_dir: str, smoke: bool) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    dev = _nccl_one_rank()
    try:
        for mode in ("overlap", "fence"):
            for kind in ("adamw", "fused_adamw_grad_scaler"):
                out[f"{mode}/{kind}"] = _sync_debug_one(dev, mode, kind != "adamw", check_every=4)
    finally:
        dist.destroy_process_group()
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# ------------------------------------------------------------------------------------------
# 3. probes
# ------------------------------------------------------------------------------------------


class _ReadsChildFirst:
    """``F.linear(x, self.b.weight)`` before ``self.a`` and ``self.b``: built lazily (torch)."""

    @staticmethod
    def build(width: int) -> Any:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.a = nn.Linear(width, width)
                self.b = nn.Linear(width, width)

            def forward(self, x: Any) -> Any:
                x = torch.tanh(F.linear(x, self.b.weight))
                return self.b(torch.relu(self.a(x)))

        return Net()


def _same(a: Any, b: Any) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def _probe_found_inf(dev: Any, undo_fix: bool, steps: int = 6) -> float:
    """Fused AdamW + GradScaler, runtime against the plain optimizer; after each
    ``scaler.step`` the compute stream grabs every free small block and fills it with 1.0."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer
    from usbyte_opt.runtime.updates import StreamUpdates

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    mod = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-3, fused=True), mod,
                               schedule=_schedule(mod, 1), verify=False)
    upd = opt._state.updates
    assert isinstance(upd, StreamUpdates)
    if undo_fix:
        upd._keep_alive = lambda: None  # type: ignore[method-assign]
    s_ref, s_mod = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=g).to(dev)
        y = torch.randint(0, 10, (64,), generator=g).to(dev)
        for net, o, sc in ((ref, o_ref, s_ref), (mod, opt, s_mod)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(net(x), y)
            sc.scale(loss).backward()
            if o is opt:
                with torch.cuda.stream(upd.stream):
                    torch.cuda._sleep(SLEEP_CYCLES)
            sc.step(o)
            poison = [torch.ones(1, device=dev) for _ in range(256)] if o is opt else []
            sc.update()
            o.zero_grad()
            torch.cuda.synchronize()
            del poison
    opt.synchronize()
    torch.cuda.synchronize()
    diff = _same(ref, mod)
    opt.close()
    return diff


def _probe_parent_reads_child(dev: Any, undo_fix: bool, steps: int = 6) -> float:
    """A parent reading a child's weight before calling it, runtime against the plain
    optimizer, a sleep on the update stream before each step (CUDA)."""
    import copy

    import torch
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer

    cuda = dev.type == "cuda"
    width = 512 if cuda else 16
    ref = _ReadsChildFirst.build(width).to(dev)
    mod = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mod,
                               schedule=_schedule(mod, 1, pieces=3), verify=False)
    g = torch.Generator(device="cpu").manual_seed(0)
    for step in range(steps):
        x = torch.randn(64, width, generator=g).to(dev)
        y = torch.randn(64, width, generator=g).to(dev)
        F.mse_loss(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        F.mse_loss(mod(x), y).backward()
        if step == 0 and undo_fix:
            st = opt._state
            st.gates.root_extra.clear()   # the gate back at the child's pre-hook
            # and no guard (it would run the child's update at the parent's first read anyway)
            st.guard = st.comm.guard = st.updates.guard = None
        if cuda:
            with torch.cuda.stream(opt._state.updates.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        opt.step(); opt.zero_grad()
    opt.synchronize()
    if cuda:
        torch.cuda.synchronize()
    diff = _same(ref, mod)
    opt.close()
    return diff


def part_probes(out_dir: str, smoke: bool) -> dict[str, Any]:
    import torch.distributed as dist

    dev = _gloo_one_rank() if smoke else _nccl_one_rank()
    out: dict[str, Any] = {}
    probes = [("parent_reads_child_weight", _probe_parent_reads_child)]
    if not smoke:
        probes.insert(0, ("found_inf_kept_alive", _probe_found_inf))
    try:
        for name, fn in probes:
            r: dict[str, Any] = {}
            for label, undo in (("fixed", False), ("fix_undone", True)):
                try:
                    r[label] = fn(dev, undo)
                except Exception as e:  # noqa: BLE001 - the undone fix may fail loudly
                    r[label] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            fixed, undone = r["fixed"], r["fix_undone"]
            r["ok"] = fixed == 0.0
            # The probe sees the race when the undone fix differs (or fails).
            r["race_visible"] = not isinstance(undone, float) or undone > 0.0
            out[name] = r
    finally:
        dist.destroy_process_group()
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# ------------------------------------------------------------------------------------------
# 4. two_ranks
# ------------------------------------------------------------------------------------------


def _overlap_ms(trace: dict[str, Any]) -> dict[str, Any]:
    """From a Chrome trace of torch.profiler: busy time of the compute stream (the one with
    most kernels), of every other stream, of their intersection, and of the other streams
    inside the compute stream's ``usbyte_forward`` ranges."""
    spans: dict[Any, list[tuple[float, float]]] = {}
    kernels: dict[Any, int] = {}
    fwd: list[tuple[float, float]] = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        a, b = float(ev.get("ts", 0.0)), float(ev.get("ts", 0.0)) + float(ev.get("dur", 0.0))
        if cat == "gpu_user_annotation" and ev.get("name") == "usbyte_forward":
            fwd.append((a, b))
            continue
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        s = ev.get("args", {}).get("stream", ev.get("tid"))
        spans.setdefault(s, []).append((a, b))
        if cat == "kernel":
            kernels[s] = kernels.get(s, 0) + 1
    if not spans:
        return {"compute_ms": 0.0, "other_ms": 0.0, "overlap_ms": 0.0, "streams": 0,
                "forward_ms": 0.0, "other_in_forward_ms": 0.0}
    compute = max(kernels or spans, key=lambda s: kernels.get(s, 0))

    def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    def inter(c: list[tuple[float, float]], o: list[tuple[float, float]]) -> float:
        tot, i, j = 0.0, 0, 0
        while i < len(c) and j < len(o):
            a, b = max(c[i][0], o[j][0]), min(c[i][1], o[j][1])
            tot += max(0.0, b - a)
            if c[i][1] < o[j][1]:
                i += 1
            else:
                j += 1
        return tot

    c = union(spans[compute])
    o = union([iv for s, ivs in spans.items() if s != compute for iv in ivs])
    f = union(fwd)
    return {"compute_ms": sum(b - a for a, b in c) / 1e3, "other_ms": sum(b - a for a, b in o) / 1e3,
            "overlap_ms": inter(c, o) / 1e3, "streams": len(spans),
            "forward_ms": sum(b - a for a, b in f) / 1e3, "other_in_forward_ms": inter(f, o) / 1e3}


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
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(3):
                x, y = batches[step % 4]
                with record_function("usbyte_forward"):
                    loss = F.cross_entropy(mod(x), y)
                loss.backward(); opt.step(); opt.zero_grad()
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


def part_two_ranks(out_dir: str, smoke: bool) -> dict[str, Any]:
    from usbyte_opt.launcher import run_local

    res = run_local(two_ranks, 2, args=(out_dir, "cpu" if smoke else "cuda"), timeout_s=70,
                    pg_timeout_s=60)
    ranks = [r.value if r.ok else {"error": f"{r.error_type}: {r.error}",
                                   "trace": (r.trace or "")[-2000:]} for r in res]
    ok = all("error" not in v and v["diff"] == 0.0 for v in ranks)
    return {"ok": ok, "ranks": ranks}


# ------------------------------------------------------------------------------------------
# 5. sharded
# ------------------------------------------------------------------------------------------


def _state_bytes(opt: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v))


def sharded_run(rank: int, ws: int, dev_name: str, opt_name: str) -> dict[str, Any]:
    """Train the small model ``steps`` times in sharded mode and with the reference (DDP, or
    at world size 1 the plain optimizer): max parameter difference, state bytes of each, the
    runtime's memory report. ``opt_name``: ``sgd``, ``adamw`` or ``adamw-zero2``."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from usbyte_opt.planning.planner import compare
    from usbyte_opt.runtime import DistributedOptimizer, profile_from_model

    dev = torch.device(dev_name)
    torch.manual_seed(0)
    base = _small_model()
    ref, mod = copy.deepcopy(base).to(dev), copy.deepcopy(base).to(dev)
    fwd = DDP(ref) if ws > 1 else ref

    def make(params: Any) -> Any:
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    sched = compare(profile_from_model(mod, ws), shard=True).schedule("best-sharded")
    o_ref = make(ref.parameters())
    inner = make(mod.parameters())
    opt = DistributedOptimizer(inner, mod, schedule=sched, verify=False,
                               zero_stage=2 if opt_name.endswith("zero2") else 1)
    g = torch.Generator(device="cpu").manual_seed(rank)
    batches = [(torch.randn(32, 3, 16, 16, generator=g).to(dev),
                torch.randint(0, 10, (32,), generator=g).to(dev)) for _ in range(4)]
    for step in range(8):   # the reference first, so that the CUDA peak below is the runtime's
        x, y = batches[step % 4]
        F.cross_entropy(fwd(x), y).backward(); o_ref.step(); o_ref.zero_grad()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
    for step in range(8):
        x, y = batches[step % 4]
        F.cross_entropy(mod(x), y).backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    if cuda:
        torch.cuda.synchronize()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mod.parameters()))
    out = {"diff": diff, "state_bytes": _state_bytes(inner), "ref_state_bytes": _state_bytes(o_ref),
           "all_gathers": len(sched.gather_groups()), "blocks": len(sched.blocks),
           "memory": opt.report()["memory"]}
    if cuda:   # what the allocator saw: ZeRO-2 against ZeRO-1 on the same model
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - start
    opt.close()
    return out


#: The optimizers (and stage) the sharded part trains with.
SHARDED_OPTS = ("sgd", "adamw", "adamw-zero2")


def _sharded_two(rank: int, ws: int, device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    return {o: sharded_run(rank, ws, "cuda:0" if device == "cuda" else "cpu", o)
            for o in SHARDED_OPTS}


def part_sharded(out_dir: str, smoke: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from usbyte_opt.launcher import run_local

    res: dict[str, Any] = {}
    if not smoke:
        try:
            _nccl_one_rank()
            res["nccl_one_rank"] = {o: sharded_run(0, 1, "cuda:0", o) for o in SHARDED_OPTS}
        except Exception as e:  # noqa: BLE001 - recorded, the two-rank case still runs
            res["nccl_one_rank"] = {"error": f"{type(e).__name__}: {e}",
                                    "trace": traceback.format_exc()[-2000:]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    got = run_local(_sharded_two, 2, args=("cpu" if smoke else "cuda",), timeout_s=50,
                    pg_timeout_s=45)
    res["two_ranks"] = [r.value if r.ok else {"error": f"{r.error_type}: {r.error}",
                                              "trace": (r.trace or "")[-2000:]} for r in got]
    cases = [res["two_ranks"]] + ([[res["nccl_one_rank"]]] if "nccl_one_rank" in res else [])
    res["ok"] = all("error" not in v and all(c["diff"] == 0.0 for c in v.values())
                    for ranks in cases for v in ranks)
    return res


# ------------------------------------------------------------------------------------------
# 6. flow
# ------------------------------------------------------------------------------------------


def part_flow(out_dir: str, smoke: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    bench_dir = os.path.join(out_dir, "bench")
    device = "cpu" if smoke else "cuda"
    model, k, rounds = ("mlp", "4", "3") if smoke else ("transformer", "20", "2")
    cmd = [*_python(), "-m", "usbyte_opt", "bench", model, "--device", device, "-n", "1",
           "-k", k, "-s", "ddp,best", "--rounds", rounds, "--no-reference", "--json",
           "-o", bench_dir]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env())
    Path(out_dir, "logs", "flow.log").write_text(proc.stderr)
    out: dict[str, Any] = {"ok": proc.returncode == 0, "seconds": time.perf_counter() - t0,
                           "command": "python3 " + " ".join(cmd[cmd.index("-m"):])}
    if proc.returncode != 0:
        out["stderr"] = proc.stderr[-3000:]
        return out
    try:
        data = json.loads(proc.stdout)
        out["measured_ms"] = {r["strategy"]: round(r["measured_ms"], 2) for r in data["runs"]}
        out["predicted_ms"] = {r["strategy"]: round(r["predicted_ms"], 2) for r in data["runs"]}
        out["matches_ddp"] = data.get("correct")
        out["ok"] = bool(out["matches_ddp"])
    except (ValueError, KeyError, TypeError) as e:
        out["ok"] = False
        out["parse_error"] = str(e)
        out["stdout"] = proc.stdout[-3000:]
    return out


PART_FUNCS = {"imports": part_imports, "tests": part_tests, "sync_debug": part_sync_debug,
              "probes": part_probes, "two_ranks": part_two_ranks, "sharded": part_sharded,
              "flow": part_flow}


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def report(res: dict[str, Any]) -> str:
    lines = ["# GPU check of the runtime's CUDA path", ""]
    imp = res.get("imports", {})
    lines.append(f"torch {imp.get('torch')}, {imp.get('gpu')}, Python {imp.get('python')}, "
                 f"{res.get('when')}{' (--smoke: CPU only, says nothing of CUDA)' if res.get('smoke') else ''}")
    lines.append("")
    for name, _, _ in PARTS:
        if name not in res:
            continue
        r = res[name]
        state = "skipped" if r.get("skipped") else ("ok" if r.get("ok") else "FAILED")
        secs = f" ({r['part_s']:.0f} s)" if "part_s" in r else ""
        lines.append(f"## {name}: {state}{secs}")
        if r.get("skipped"):
            lines.append(f"- {r['skipped']}")
        if "error" in r:
            lines.append(f"- error: {r['error']}")
        if name == "imports":
            if "ddp_bucket_cap_mb_list" in r:
                lines.append(f"- DistributedDataParallel takes bucket_cap_mb_list: {r['ddp_bucket_cap_mb_list']}")
            for mod, info in r.get("modules", {}).items():
                where = info.get("error") or f"{info.get('version')} from {info.get('from')}"
                lines.append(f"- {mod}: {where}")
        elif name == "tests":
            lines.append(f"- {r.get('summary', '')}")
            lines += [f"- {f}" for f in r.get("failures", [])]
        elif name == "sync_debug":
            for key, v in r.items():
                if isinstance(v, dict):
                    lines.append(f"- {key}: " + (f"no host sync in {v.get('steps')} steps" if v.get("ok")
                                                 else f"HOST SYNC at {v.get('where')}: {v.get('error')}"))
        elif name == "probes":
            for key, v in r.items():
                if isinstance(v, dict):
                    lines.append(f"- {key}: max |runtime - plain| = {_fmt(v.get('fixed'))}; with the fix "
                                 f"undone {_fmt(v.get('fix_undone'))} (race "
                                 f"{'visible' if v.get('race_visible') else 'NOT visible: the probe proves nothing'})")
        elif name == "two_ranks":
            transport = "gloo, CPU" if res.get("smoke") else "gloo, CUDA tensors"
            for rk, v in enumerate(r.get("ranks", [])):
                if "error" in v:
                    lines.append(f"- two ranks ({transport}), rank {rk}: FAILED: {v['error']}")
                    continue
                lines.append(f"- two ranks ({transport}), rank {rk}: max |runtime - DDP| = "
                             f"{v['diff']:.3g}; optimizer calls per iteration "
                             f"{v['optimizer_calls_per_iteration']:.1f}")
                if "overlap" in v:
                    o = v["overlap"]
                    lines.append(f"- trace: compute stream busy {o['compute_ms']:.2f} ms, other streams "
                                 f"{o['other_ms']:.2f} ms, overlapping {o['overlap_ms']:.2f} ms "
                                 f"({o['streams']} streams); forward {o['forward_ms']:.2f} ms, other "
                                 f"streams busy {o['other_in_forward_ms']:.2f} ms of it")
        elif name == "sharded":
            where = [("NCCL, world size 1, vs the plain optimizer", [r["nccl_one_rank"]])] \
                if "nccl_one_rank" in r else []
            where.append(("two ranks, gloo" + (", CPU" if res.get("smoke") else ", CUDA tensors")
                          + ", vs DDP", r.get("two_ranks", [])))
            for label, ranks in where:
                for rk, v in enumerate(ranks):
                    if "error" in v:
                        lines.append(f"- {label}, rank {rk}: FAILED: {v['error']}")
                        continue
                    for o, c in v.items():
                        lines.append(f"- {label}, rank {rk}, {o}: max |sharded - reference| = "
                                     f"{c['diff']:.3g}; optimizer state {c['state_bytes']} bytes "
                                     f"vs {c['ref_state_bytes']}; {c['blocks']} reduce-scatters, "
                                     f"{c['all_gathers']} all-gathers" + (
                                         "; gradient memory kept {kept} bytes, backward "
                                         "peak {backward_peak}".format(**c["memory"])
                                         if "memory" in c else "") + (
                                         f"; CUDA peak {c['cuda_peak_bytes']} bytes above the "
                                         "start" if "cuda_peak_bytes" in c else ""))
        elif name == "flow":
            if r.get("command"):
                lines.append(f"- {r['command']}")
            if "measured_ms" in r:
                lines.append(f"- measured {r.get('measured_ms')} ms, predicted {r.get('predicted_ms')} ms, "
                             f"matches DDP: {r.get('matches_ddp')}")
            if not r.get("ok") and r.get("stderr"):
                lines.append(f"- stderr: {r['stderr'][-500:]}")
        if r.get("log_tail") and not r.get("ok"):
            lines.append("```")
            lines += r["log_tail"].splitlines()[-15:]
            lines.append("```")
        lines.append("")
    return "\n".join(lines) + "\n"


def _write(out: Path, res: dict[str, Any]) -> str:
    """Write the JSON and the Markdown report; returns the report. A report that cannot be
    made (a result of a shape not foreseen) falls back to the JSON, so nothing is lost."""
    data = json.dumps(res, indent=1, default=str)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(data)
    tmp.replace(out / "gpu_check.json")
    try:
        text = report(res)
    except Exception:  # noqa: BLE001 - the raw results instead
        text = f"# GPU check (report failed: {traceback.format_exc(limit=2)})\n\n```\n{data}\n```\n"
    (out / "gpu_check.md").write_text(text)
    return text


def run_part(name: str, limit_s: float, out: Path, smoke: bool) -> dict[str, Any]:
    """Run one part in a process of its own (its own session: a timeout kills its ranks too)."""
    result = out / "parts" / f"{name}.json"
    result.unlink(missing_ok=True)
    log = out / "logs" / f"{name}.part.log"
    cmd = [*_python(), str(Path(__file__).resolve()), "--part", name, "--out", str(out)]
    if smoke:
        cmd.append("--smoke")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    secs = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-3000:]
    if result.exists():
        r = json.loads(result.read_text())
    elif rc is None:
        r = {"ok": False, "error": f"timed out after {limit_s:.0f} s (killed)"}
    else:
        r = {"ok": False, "error": f"the part's process exited with code {rc} without a result"}
    r["part_s"] = secs
    if not r.get("ok"):
        r["log_tail"] = tail
    return r


def child(name: str, out: Path, smoke: bool) -> int:
    """``--part NAME``: run the part here and write its result."""
    try:
        r = PART_FUNCS[name](str(out), smoke)
    except Exception as e:  # noqa: BLE001 - every part is reported, whatever happens
        r = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        traceback.print_exc()
    tmp = out / "parts" / f"{name}.json.tmp"
    tmp.write_text(json.dumps(r, indent=1, default=str))
    tmp.replace(out / "parts" / f"{name}.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check"), help="output folder")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                               + ",".join(n for n, _, _ in PARTS[1:]))
    ap.add_argument("--smoke", action="store_true",
                    help="run the parts that can on the CPU: a check of this script, not of CUDA")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help=f"global deadline in seconds (default {DEADLINE_S:.0f})")
    ap.add_argument("--part", choices=sorted(PART_FUNCS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "parts").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.part:
        return child(args.part, out, args.smoke)
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {n for n, _, _ in PARTS[1:]}
    if unknown:
        print(f"gpu_check: --skip: unknown part(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    start = time.monotonic()
    res: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke}
    for name, limit, in_smoke in PARTS:
        left = args.deadline - (time.monotonic() - start)
        if name in skip:
            res[name] = {"skipped": "--skip"}
        elif args.smoke and not in_smoke:
            res[name] = {"skipped": "needs CUDA (--smoke)"}
        elif left < 5:
            res[name] = {"ok": False, "error": f"not run: the {args.deadline:.0f} s deadline passed"}
        else:
            res[name] = run_part(name, min(limit, left), out, args.smoke)
        r = res[name]
        state = "skipped" if r.get("skipped") else "ok" if r.get("ok") else "FAILED"
        print(f"[gpu_check] {name}: {state} ({r.get('part_s', 0):.0f} s)", flush=True)
        text = _write(out, res)
        if name == "imports" and not res[name].get("ok"):
            print(f"gpu_check: {res[name].get('error', 'the import check failed')}", file=sys.stderr)
            break
    print(text)
    ran = [res[n] for n, _, _ in PARTS if n in res and not res[n].get("skipped")]
    return 0 if ran and all(r.get("ok") for r in ran) and len(res) - 2 == len(PARTS) else 1


if __name__ == "__main__":
    sys.exit(main())
