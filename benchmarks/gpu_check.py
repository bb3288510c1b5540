"""The prepared GPU check of the runtime's CUDA path: one command, one GPU, at most 7 minutes.

On the GPU machine, from the repository root, with the wheels of
``python benchmarks/gpu_bundle.py --python-version 3.12 --dest .whl`` carried along (no
install of the project, no network)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
      PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu_check.py --out $OUT

(one shell command: the line ends in ``&&``; through the device tool, carry ``.whl``).

It writes three files and nothing else under ``OUT`` (the device tool returns at most 8):
``gpu_check.md`` (the report, also printed), ``gpu_check.json`` and :data:`ARCHIVE`, one
archive of everything else the check wrote (each part's log and result, the two-rank part's
``torch.profiler`` trace, the benches' folders; a file over :data:`ARCHIVE_FILE_MAX` is left
out and named). The parts write into a work folder (``--work``, default a temporary one);
the report and the archive are rewritten after every part, so a part that hangs loses only
itself. Each part runs in a process of its own (``python3 benchmarks/gpu_check.py --part
NAME``; the same interpreter and flags, ``PYTHONPATH`` made absolute with the repository
first), with its own time limit, under a global deadline of :data:`DEADLINE_S` seconds, after
an import check of a few seconds that stops everything when the bundle is missing; a part the
deadline leaves no time for is reported "skipped: no time left" (and the exit code is 1).

**Numbers that can be believed.** Every part that compares numbers runs deterministic kernels
(:func:`deterministic`: cuDNN deterministic, its benchmark off, TF32 off for matmul and cuDNN,
``torch.use_deterministic_algorithms(True, warn_only=True)``, with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in every part's environment, so set before CUDA starts; an
op without a deterministic implementation warns and is named in the report; the benches'
trainees get the same through ``USBYTE_BENCH_DETERMINISTIC=1``). The first run without them
saw the runtime differ from DDP by 1.4e-4 (``two_ranks``) and 1.1e-4 (``sharded``); with
them, 0. Each comparison is made beside a control, the reference trained a second time under
the same settings (DDP against DDP, the plain optimizer against itself), and fails only when
the runtime differs from the reference by more than the control does (:func:`verdict`; the
report gives both numbers). A planted difference shows that the comparison can see one:
``two_ranks`` also trains a runtime whose one gradient is scaled by :data:`PLANT_SCALE` at
step :data:`PLANT_STEP` (:func:`_plant`), and the part fails unless that runtime is reported
as differing from DDP. The benches (``flow``, ``host_ratio``) hold the runtime to the bench's
own tolerance (``PARAM_TOLERANCE``): they train DDP once, so they have no control.

A machine with one GPU runs NCCL only at world size 1 (NCCL refuses two ranks on one device),
where the all-reduce is an identity; gloo, which copies CUDA tensors through the host on
streams of its own, carries them between 2 ranks on the same GPU. The parts, by value:

0. ``imports``: torch, CUDA, ``usbyte_opt.runtime`` (so pydantic), pulp and jsonschema, with
   the version and location of each.
1. ``tests``: ``tests/test_runtime_cuda.py`` (NCCL, world size 1) with deterministic
   settings: the runtime's stream handling against the plain optimizer (side streams, bf16
   autocast, GradScaler in both modes, fused or not). Catches wrong stream waits and broken
   AMP paths; cannot catch anything that needs a second rank.
2. ``sync_debug``: steady-state forward, backward, ``step()`` and ``zero_grad()`` under
   ``torch.cuda.set_sync_debug_mode("error")`` for more than ``check_every`` steps (the drift
   check runs inside), AdamW and fused AdamW + GradScaler (fp16), overlap and fence mode.
   Catches every host sync the runtime adds; cannot see syncs of world size > 1 only. (It
   compares no numbers: it runs the kernels training runs.)
3. ``probes``: the two races a review found, made visible by a sleep kernel queued on the
   update stream before each ``step()``: GradScaler's ``found_inf`` freed while a fused
   optimizer on the update stream still reads it (the compute stream then refills the
   memory with 1.0, and the step is skipped), and a parent module reading a child's weight
   before calling the child (the guard now runs a tensor's update at its first read). Each
   is run as the runtime does it, beside a plain-against-plain control, and once with its fix
   undone, which must differ by more than the control, so that a pass says the probe can see
   the race (a probe that cannot undo its fix, the runtime's internals having moved, says so
   and proves nothing).
4. ``two_ranks`` (gloo carrying CUDA tensors): the runtime against DDP over the same
   transport, beside DDP against DDP, and the planted difference; optimizer calls per
   iteration, and a ``torch.profiler`` trace of steady-state iterations: the time other
   streams (gloo's copies) are busy during the compute stream's forward
   (``record_function`` ranges), that is step N's communication and updates overlapping
   forward N+1.
5. ``sharded``: sharded mode (ZeRO-1) on CUDA: at world size 1 on NCCL against the plain
   optimizer, then 2 ranks on gloo carrying CUDA tensors against DDP, each beside its control,
   with the planner's ``best-sharded`` schedule (grouped all-gathers) and SGD with momentum
   and AdamW, and AdamW with ``zero_stage=2`` (ZeRO-2: no flat gradient buffer); the wrapped
   optimizer's state bytes per rank beside DDP's, the runtime's gradient memory
   (``report()["memory"]``) and the CUDA allocator's peak while the runtime trains (ZeRO-2
   against ZeRO-1). Catches a CUDA reduce-scatter or all-gather the backends refuse, a
   staging copy on the wrong stream, a gate that lets the forward read a parameter before its
   all-gather, a block's gradient storage freed while its reduce-scatter still reads it.
6. ``flow``: ``python3 -m usbyte_opt bench transformer --device cuda -n 1 -s ddp,best``
   (:data:`HOST_ITERATIONS` timed iterations in :data:`HOST_ROUNDS` rounds, no added rounds):
   profile -> optimize -> train of a small transformer (tied embedding), DDP side by side,
   CUDA-event timing, deterministic kernels. At world size 1 it measures no communication.
7. ``compiled``: ``bench MODEL --device cuda -n 1 --emulate 16x25gbit --compile inductor -s
   ddp,best`` on ``gpt2`` (batch 4) and ``resnet50`` (batch 64): the profile timed compiled,
   torch DDP compiled with its DDPOptimizer beside ``best`` on the runtime, whose graphs are
   split at its plan's blocks; best's speed over DDP's, its prediction, its distance to the
   bound and the pieces it ran. Catches a split, a gate or a compiled backward that breaks
   on CUDA, and tells whether the compiled gain measured on the CPU holds there.
8. ``host_ratio``: the same bench on ``bert-large`` (batch 8), ``gpt2`` (batch 4 x 1024) and
   ``resnet50`` (batch 64), the transformer's taken from ``flow``: the runtime's measured time
   over DDP's, per model, against the goal of at least :data:`HOST_GOAL` of DDP's speed
   (runtime_ms <= DDP_ms / 0.98), reported as met or not but a measurement: it fails no part
   (a bench that fails or does not match DDP does). Each model has its own time limit
   (:data:`HOST_MODELS`), and is skipped, saying so, when less than :data:`HOST_MIN_S` seconds
   are left.

``--smoke`` runs the same parts on the CPU where they can (``imports``; ``tests``, which skip;
``probes``' parent-reads-child case without the sleep; ``two_ranks``, ``sharded``, ``flow`` and
``host_ratio`` on gloo with small models and few iterations, the planted difference
included; ``compiled`` on lab-cnn with ``aot_eager``): it checks this script, and
``tests/test_gpu_rehearsal.py`` runs it from a clean copy with only the image's packages and
the bundle, so that a GPU session is not spent on the script's own bugs. It says nothing of the CUDA path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The whole check's deadline (seconds), from the start of the import check.
DEADLINE_S = 420.0

#: (name, time limit in seconds, runs under --smoke), in order of value. The limits add up to
#: more than the deadline: each part gets its limit or what is left, whichever is less.
PARTS: list[tuple[str, float, bool]] = [
    ("imports", 30.0, True),
    ("tests", 60.0, True),
    ("sync_debug", 30.0, False),
    ("probes", 35.0, True),
    ("two_ranks", 60.0, True),
    ("sharded", 45.0, True),
    ("flow", 90.0, True),
    ("compiled", 150.0, True),
    ("host_ratio", 220.0, True),
]

#: A sleep queued on the update stream before each step of the probes (GPU cycles, ~50 ms).
SLEEP_CYCLES = 100_000_000

#: The one archive of everything the check writes besides its report (logs, the parts'
#: results, traces, the benches' folders), refreshed after every part.
ARCHIVE = "gpu_check_evidence.tar.gz"
#: Files larger than this stay out of the archive (listed in its ``left_out.txt``): the
#: device tool returns files of at most 16 MiB.
ARCHIVE_FILE_MAX = 6 << 20

#: The planted difference of ``two_ranks``: one parameter's gradient scaled by this, at this
#: step, in a runtime trained beside the others (it must be seen as a difference).
PLANT_SCALE, PLANT_STEP = 1.0001, 3

#: ``host_ratio``: (model, per-rank batch size, time limit in seconds) on CUDA; ``transformer``
#: is the ``flow`` part's run (the same command), read from its result.
HOST_MODELS: list[tuple[str, int, float]] = [
    ("transformer", 8, 60.0), ("bert-large", 8, 70.0), ("gpt2", 4, 70.0), ("resnet50", 64, 60.0)]
#: ``host_ratio --smoke``: a tiny model on the CPU.
HOST_MODELS_SMOKE: list[tuple[str, int, float]] = [("mlp", 64, 60.0), ("lab-cnn", 2, 60.0)]
#: Timed iterations and rounds of each ``host_ratio`` (and ``flow``) bench (CPU: fewer).
HOST_ITERATIONS, HOST_ROUNDS = 10, 2
#: A model is skipped when less than this is left before the part's limit.
HOST_MIN_S = 25.0
#: The goal of ``host_ratio``: the runtime at least this fraction of DDP's speed
#: (runtime_ms <= DDP_ms / HOST_GOAL). A measurement: it fails no part.
HOST_GOAL = 0.98

#: ``compiled``: (model, per-rank batch size, time limit in seconds) on CUDA, each trained
#: compiled by inductor on the emulated link :data:`COMPILED_LINK`; under ``--smoke`` a tiny
#: model on the CPU, compiled by ``aot_eager`` (inductor's C++ build takes minutes there).
COMPILED_MODELS: list[tuple[str, int, float]] = [("gpt2", 4, 75.0), ("resnet50", 64, 70.0)]
COMPILED_MODELS_SMOKE: list[tuple[str, int, float]] = [("lab-cnn", 2, 150.0)]
COMPILED_LINK = "16x25gbit"
#: Timed iterations and rounds of each ``compiled`` bench (compiling takes most of its time),
#: and the places its profile times a cut at (each one more compile of the model), within a
#: time cap (seconds).
COMPILED_ITERATIONS, COMPILED_ROUNDS = 6, 1
COMPILED_CUT_PROBES, COMPILED_CUT_PROBE_S = 3, 15.0

#: When the running part must be done (``time.monotonic()``; set in the part's process).
_PART_DEADLINE = float("inf")


def _child_env() -> dict[str, str]:
    """The parts' environment: ``PYTHONPATH`` absolute, the repository first; deterministic
    cuBLAS (``CUBLAS_WORKSPACE_CONFIG``, read when CUDA initialises, so set before the part's
    process starts) and deterministic kernels in the benches' trainees
    (``USBYTE_BENCH_DETERMINISTIC``)."""
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != str(ROOT)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1",
                CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
                USBYTE_BENCH_DETERMINISTIC="1")


def deterministic() -> list[str]:
    """Deterministic kernels in this process (cuDNN deterministic, its benchmark off, TF32
    off for matmul and cuDNN, ``use_deterministic_algorithms(True, warn_only=True)``: an op
    without a deterministic implementation warns; :func:`_alerts` collects those warnings),
    with ``CUBLAS_WORKSPACE_CONFIG`` as this process got it (:func:`_child_env` sets it before
    the process starts). Returns the settings, for the report."""
    import torch

    from usbyte_opt.bench.train import deterministic_kernels

    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    deterministic_kernels()
    return [f"CUBLAS_WORKSPACE_CONFIG={cublas}", "cudnn.deterministic", "cudnn.benchmark off",
            "TF32 off", f"deterministic algorithms {torch.are_deterministic_algorithms_enabled()} "
            "(warn only)"]


def _alerts(caught: list[Any]) -> list[str]:
    """The distinct "no deterministic implementation" warnings among ``caught``."""
    out: list[str] = []
    for w in caught:
        text = str(w.message).splitlines()[0][:160]
        if "deterministic" in text and text not in out:
            out.append(text)
    return out[:6]


def _with_alerts(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` (a dict) with the "no deterministic implementation" warnings it raised
    added under ``nondeterministic_ops``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fn(*args)
    res["nondeterministic_ops"] = _alerts(caught)
    return res  # type: ignore[no-any-return]


def verdict(diff: float, control: float) -> bool:
    """A comparison passes when the runtime differs from the reference by no more than the
    control (the reference against itself, trained twice under the same settings) differs.

    Example::

        >>> verdict(0.0, 0.0), verdict(1e-7, 0.0), verdict(1e-6, 2e-6)
        (True, False, True)
    """
    return diff <= control


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


def _probe_found_inf(dev: Any, undo_fix: bool, steps: int = 6) -> tuple[float, float]:
    """Fused AdamW + GradScaler, runtime against the plain optimizer; after each
    ``scaler.step`` the compute stream grabs every free small block and fills it with 1.0.
    Returns max |runtime - plain| and the control max |plain - plain| (a second plain copy
    trained alike)."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer
    from usbyte_opt.runtime.updates import StreamUpdates

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    mod, ctl = copy.deepcopy(ref), copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    o_ctl = torch.optim.AdamW(ctl.parameters(), lr=1e-3, fused=True)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-3, fused=True), mod,
                               schedule=_schedule(mod, 1), verify=False)
    upd = opt._state.updates
    assert isinstance(upd, StreamUpdates)
    if undo_fix:
        with _undoing("found_inf_kept_alive"):
            getattr(upd, "_keep_alive")   # noqa: B009 - there, or the probe cannot undo it
            upd._keep_alive = lambda: None  # type: ignore[method-assign]
    s_ref, s_mod, s_ctl = (torch.amp.GradScaler("cuda") for _ in range(3))
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=g).to(dev)
        y = torch.randint(0, 10, (64,), generator=g).to(dev)
        for net, o, sc in ((ref, o_ref, s_ref), (ctl, o_ctl, s_ctl), (mod, opt, s_mod)):
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
    return diff, _same(ref, ctl)


def _probe_parent_reads_child(dev: Any, undo_fix: bool, steps: int = 6) -> tuple[float, float]:
    """A parent reading a child's weight before calling it, runtime against the plain
    optimizer, a sleep on the update stream before each step (CUDA). Returns max |runtime -
    plain| and the control max |plain - plain|."""
    import copy

    import torch
    import torch.nn.functional as F

    from usbyte_opt.runtime import DistributedOptimizer

    cuda = dev.type == "cuda"
    width = 512 if cuda else 16
    ref = _ReadsChildFirst.build(width).to(dev)
    mod, ctl = copy.deepcopy(ref), copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ctl = torch.optim.AdamW(ctl.parameters(), lr=1e-2)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-2), mod,
                               schedule=_schedule(mod, 1, pieces=3), verify=False)
    undo: list[Any] = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for step in range(steps):
        x = torch.randn(64, width, generator=g).to(dev)
        y = torch.randn(64, width, generator=g).to(dev)
        F.mse_loss(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        F.mse_loss(ctl(x), y).backward(); o_ctl.step(); o_ctl.zero_grad()
        F.mse_loss(mod(x), y).backward()
        if step == 0 and undo_fix:
            with _undoing("parent_reads_child_weight"):
                st = opt._state
                # No parameter armed at step() (the guard would run a tensor's update at its
                # first read, the parent's), and the gate back at each owning module's
                # pre-hook, where it was before.
                getattr(st.guard, "arm_params")   # noqa: B009 - there, or it cannot be undone
                st.guard.arm_params = lambda *args, **kw: None
                undo = [mod.register_forward_pre_hook(st.gates.module_hook(ts))
                        for mod, ts in st.gates.owned.values()]
        if cuda:
            with torch.cuda.stream(opt._state.updates.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
        opt.step(); opt.zero_grad()
    opt.synchronize()
    if cuda:
        torch.cuda.synchronize()
    diff = _same(ref, mod)
    for h in undo:
        h.remove()
    opt.close()
    return diff, _same(ref, ctl)


class UndoFailed(RuntimeError):
    """A probe could not undo its fix (the runtime's internals moved): it proves nothing."""


class _undoing:
    """``with _undoing(probe):`` any error inside is the undo's own, not the race's
    (:class:`UndoFailed`)."""

    def __init__(self, probe: str):
        self.probe = probe

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if err is not None and not isinstance(err, UndoFailed):
            raise UndoFailed(f"cannot undo the fix ({type(err).__name__}: {err}): update the probe "
                             "to the runtime's internals") from err


def part_probes(out_dir: str, smoke: bool) -> dict[str, Any]:
    """The probes (see the module), each beside its plain-against-plain control."""
    return _with_alerts(_probes, smoke)


def _probes(smoke: bool) -> dict[str, Any]:
    import torch.distributed as dist

    settings = deterministic()
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
                    r[label], r[f"control_{label}"] = fn(dev, undo)
                except UndoFailed as e:
                    r[label] = str(e)
                    r["undo_failed"] = True
                except Exception as e:  # noqa: BLE001 - the undone fix may fail loudly
                    r[label] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            fixed, undone = r["fixed"], r["fix_undone"]
            r["control"] = r.get("control_fixed", 0.0)
            r["ok"] = isinstance(fixed, float) and verdict(fixed, r["control"])
            # The probe sees the race when the undone fix differs by more than the control
            # (or fails, but for a failure to undo it).
            r["race_visible"] = not r.get("undo_failed") and (not isinstance(undone, float) or not verdict(
                undone, r.get("control_fix_undone", 0.0)))
            out[name] = r
    finally:
        dist.destroy_process_group()
    out["ok"] = all(v["ok"] for v in out.values())
    out["deterministic"] = settings
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


def _plant(param: Any, at_step: list[int]) -> Any:
    """The planted difference: ``param``'s gradient scaled by :data:`PLANT_SCALE` in the
    backward of step :data:`PLANT_STEP` only (``at_step[0]``: the step running); a tensor hook,
    so that the runtime's hooks receive the scaled gradient as any other."""
    return param.register_hook(lambda g: g * PLANT_SCALE if at_step[0] == PLANT_STEP else g)


def two_ranks(rank: int, ws: int, out_dir: str, device: str = "cuda") -> dict[str, Any]:
    """One rank of the two-rank part: DDP, a second DDP (the control), the runtime and the
    runtime with the planted difference (:func:`_plant`), trained side by side on the same
    batches under deterministic kernels; their differences, the runtime's optimizer calls per
    iteration and (rank 0, CUDA) the overlap in a ``torch.profiler`` trace."""
    return _with_alerts(_two_ranks, rank, ws, out_dir, device)


def _two_ranks(rank: int, ws: int, out_dir: str, device: str) -> dict[str, Any]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from usbyte_opt.runtime import DistributedOptimizer

    settings = deterministic()
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    base = _small_model()
    ref, ctl, mod, pl = (copy.deepcopy(base).to(dev) for _ in range(4))
    ddp, ddp_ctl = DDP(ref), DDP(ctl)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    o_ctl = torch.optim.AdamW(ctl.parameters(), lr=1e-3, weight_decay=0.1)
    opt = DistributedOptimizer(torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1),
                               mod, schedule=_schedule(mod, ws), verify=False)
    o_pl = DistributedOptimizer(torch.optim.AdamW(pl.parameters(), lr=1e-3, weight_decay=0.1),
                                pl, schedule=_schedule(pl, ws), verify=False)
    at_step = [-1]
    hook = _plant(next(pl.parameters()), at_step)
    g = torch.Generator(device="cpu").manual_seed(rank)
    batches = [(torch.randn(32, 3, 16, 16, generator=g).to(dev),
                torch.randint(0, 10, (32,), generator=g).to(dev)) for _ in range(4)]
    steps = 12
    calls0 = 0
    for step in range(steps):
        x, y = batches[step % 4]
        at_step[0] = step
        F.cross_entropy(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        F.cross_entropy(ddp_ctl(x), y).backward(); o_ctl.step(); o_ctl.zero_grad()
        if step == 4:
            calls0 = opt.optimizer_calls
        F.cross_entropy(mod(x), y).backward(); opt.step(); opt.zero_grad()
        F.cross_entropy(pl(x), y).backward(); o_pl.step(); o_pl.zero_grad()
    opt.synchronize()
    o_pl.synchronize()
    if cuda:
        torch.cuda.synchronize()
    hook.remove()
    o_pl.close()
    calls = (opt.optimizer_calls - calls0) / (steps - 4)   # updates of steps 4..11

    def diff(a: Any, b: Any) -> float:
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))

    res: dict[str, Any] = {"diff": diff(ref, mod), "control": diff(ref, ctl),
                           "planted": diff(ref, pl), "optimizer_calls_per_iteration": calls,
                           "deterministic": settings}
    res["ok"] = verdict(res["diff"], res["control"])
    res["planted_seen"] = not verdict(res["planted"], res["control"])
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

    res = run_local(two_ranks, 2, args=(out_dir, "cpu" if smoke else "cuda"), timeout_s=55,
                    pg_timeout_s=50)
    ranks = [r.value if r.ok else {"error": f"{r.error_type}: {r.error}",
                                   "trace": (r.trace or "")[-2000:]} for r in res]
    ok = all("error" not in v and v["ok"] for v in ranks)
    # The planted difference must be seen (else the comparison cannot see a difference).
    planted = all("error" not in v and v["planted_seen"] for v in ranks)
    out = {"ok": ok and planted, "ranks": ranks, "planted_seen": planted}
    if not planted:
        out["error"] = "the planted difference was not seen: the comparison proves nothing"
    return out


# ------------------------------------------------------------------------------------------
# 5. sharded
# ------------------------------------------------------------------------------------------


def _state_bytes(opt: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v))


def sharded_run(rank: int, ws: int, dev_name: str, opt_name: str) -> dict[str, Any]:
    """Train the small model ``steps`` times in sharded mode and with the reference (DDP, or
    at world size 1 the plain optimizer), and the reference a second time (the control): max
    parameter difference of the runtime and of the control from the reference, state bytes
    of each, the runtime's memory report. ``opt_name``: ``sgd``, ``adamw`` or
    ``adamw-zero2``."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from usbyte_opt.planning.planner import compare
    from usbyte_opt.runtime import DistributedOptimizer, profile_from_model

    dev = torch.device(dev_name)
    torch.manual_seed(0)
    base = _small_model()
    ref, ctl, mod = (copy.deepcopy(base).to(dev) for _ in range(3))
    fwd, fwd_ctl = (DDP(ref), DDP(ctl)) if ws > 1 else (ref, ctl)

    def make(params: Any) -> Any:
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    sched = compare(profile_from_model(mod, ws), shard=True).schedule("best-sharded")
    o_ref, o_ctl = make(ref.parameters()), make(ctl.parameters())
    inner = make(mod.parameters())
    opt = DistributedOptimizer(inner, mod, schedule=sched, verify=False,
                               zero_stage=2 if opt_name.endswith("zero2") else 1)
    g = torch.Generator(device="cpu").manual_seed(rank)
    batches = [(torch.randn(32, 3, 16, 16, generator=g).to(dev),
                torch.randint(0, 10, (32,), generator=g).to(dev)) for _ in range(4)]
    for step in range(8):   # the reference first, so that the CUDA peak below is the runtime's
        x, y = batches[step % 4]
        F.cross_entropy(fwd(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        F.cross_entropy(fwd_ctl(x), y).backward(); o_ctl.step(); o_ctl.zero_grad()
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
    control = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ctl.parameters()))
    out = {"diff": diff, "control": control, "state_bytes": _state_bytes(inner), "ref_state_bytes": _state_bytes(o_ref),
           "all_gathers": len(sched.gather_groups()), "blocks": len(sched.blocks),
           "memory": opt.report()["memory"]}
    if cuda:   # what the allocator saw: ZeRO-2 against ZeRO-1 on the same model
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - start
    opt.close()
    return out


#: The optimizers (and stage) the sharded part trains with.
SHARDED_OPTS = ("sgd", "adamw", "adamw-zero2")


def _sharded_two(rank: int, ws: int, device: str) -> dict[str, Any]:
    """One rank of the sharded part's two-rank case: each of :data:`SHARDED_OPTS`
    (:func:`sharded_run`), under deterministic kernels."""
    return _with_alerts(_sharded_opts, rank, ws, device)


def _sharded_opts(rank: int, ws: int, device: str) -> dict[str, Any]:
    import torch

    deterministic()
    if device == "cuda":
        torch.cuda.set_device(0)
    return {o: sharded_run(rank, ws, "cuda:0" if device == "cuda" else "cpu", o)
            for o in SHARDED_OPTS}


def _cases(v: dict[str, Any]) -> dict[str, Any]:
    """The optimizers' results of one rank's sharded value (what else it holds left out)."""
    return {k: c for k, c in v.items() if isinstance(c, dict)}


def part_sharded(out_dir: str, smoke: bool) -> dict[str, Any]:
    """Sharded mode against the reference (see the module), each case beside its control."""
    import torch.distributed as dist

    from usbyte_opt.launcher import run_local

    res: dict[str, Any] = {"deterministic": deterministic()}
    if not smoke:
        try:
            _nccl_one_rank()
            res["nccl_one_rank"] = _with_alerts(
                lambda: {o: sharded_run(0, 1, "cuda:0", o) for o in SHARDED_OPTS})
        except Exception as e:  # noqa: BLE001 - recorded, the two-rank case still runs
            res["nccl_one_rank"] = {"error": f"{type(e).__name__}: {e}",
                                    "trace": traceback.format_exc()[-2000:]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    got = run_local(_sharded_two, 2, args=("cpu" if smoke else "cuda",), timeout_s=45,
                    pg_timeout_s=40)
    res["two_ranks"] = [r.value if r.ok else {"error": f"{r.error_type}: {r.error}",
                                              "trace": (r.trace or "")[-2000:]} for r in got]
    cases = [res["two_ranks"]] + ([[res["nccl_one_rank"]]] if "nccl_one_rank" in res else [])
    res["ok"] = all("error" not in v and all(verdict(c["diff"], c["control"]) for c in _cases(v).values())
                    for ranks in cases for v in ranks)
    return res


# ------------------------------------------------------------------------------------------
# 6. flow
# ------------------------------------------------------------------------------------------


def _bench(model: str, batch: int | None, smoke: bool, bench_dir: str, log: Path,
           limit_s: float, extra: tuple[str, ...] = (), k_rounds: tuple[int, int] | None = None
           ) -> dict[str, Any]:
    """``python3 -m usbyte_opt bench MODEL --device cuda -n 1 -s ddp,best`` (CPU under
    ``--smoke``), deterministic (:func:`_child_env`), killed with its ranks past ``limit_s``
    (:func:`_kill_tree`; it stays in the part's process group, which a part killed past its own
    limit takes along); its measured and predicted times, the runtime's time over DDP's,
    whether it matches DDP. ``extra``: more arguments of the bench (``compiled``: the link and
    the backend); ``k_rounds``: its timed iterations and rounds, if not the host check's."""
    t0 = time.perf_counter()
    device = "cpu" if smoke else "cuda"
    k, rounds = (2, 1) if smoke else k_rounds or (HOST_ITERATIONS, HOST_ROUNDS)
    cmd = [*_python(), "-m", "usbyte_opt", "bench", model, "--device", device, "-n", "1",
           "-k", str(k), "-s", "ddp,best", "--rounds", str(rounds), "--max-rounds", str(rounds),
           "--no-reference", "--json", "-o", bench_dir,
           "--timeout-s", str(max(10, int(limit_s) - 3)), *extra]
    if batch is not None:
        cmd[cmd.index("-n"):cmd.index("-n")] = ["-b", str(batch)]
    out: dict[str, Any] = {"command": "python3 " + " ".join(cmd[cmd.index("-m"):])}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE,
                                stderr=err, text=True)
        try:
            stdout, _ = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            stdout = ""
            out["error"] = f"timed out after {limit_s:.0f} s (killed)"
    out["seconds"] = time.perf_counter() - t0
    if "error" not in out and proc.returncode != 0:
        out["error"] = f"exit code {proc.returncode}"
    if "error" in out:
        out["ok"] = False
        out["stderr"] = log.read_text(errors="replace")[-3000:]
        return out
    try:
        data = json.loads(stdout)
        runs = {r["strategy"]: r for r in data["runs"]}
        out["measured_ms"] = {s: round(r["measured_ms"], 3) for s, r in runs.items()}
        out["predicted_ms"] = {s: round(r["predicted_ms"], 3) for s, r in runs.items()
                               if r.get("predicted_ms") is not None}
        out["max_param_diff"] = runs["best"].get("max_param_diff")
        out["param_tolerance"] = data.get("param_tolerance")
        out["matches_ddp"] = data.get("correct")
        ddp_ms, best_ms = runs["ddp"]["measured_ms"], runs["best"]["measured_ms"]
        out["runtime_over_ddp"] = best_ms / ddp_ms
        out["meets_goal"] = best_ms <= ddp_ms / HOST_GOAL
        best = runs["best"]
        out["predicted_speedup"] = best.get("predicted_speedup_vs_ddp")
        out["vs_lower_bound"] = best.get("vs_lower_bound")
        out["lower_bound_ms"] = data.get("lower_bound_ms")
        if data.get("compile"):
            out["compile"] = data["compile"]
        if runs["best"].get("vs_ddp"):
            out["vs_ddp"] = {k: runs["best"]["vs_ddp"].get(k) for k in ("ratio", "lo", "hi", "verdict")}
        out["ok"] = bool(out["matches_ddp"])
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        out["ok"] = False
        out["parse_error"] = f"{type(e).__name__}: {e}"
        out["stdout"] = stdout[-3000:]
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descending from it (found in ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (it started a session of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def part_flow(out_dir: str, smoke: bool) -> dict[str, Any]:
    """Profile -> optimize -> train of the transformer (CPU: the MLP) with DDP beside it
    (:func:`_bench`); the run ``host_ratio`` takes its transformer figure from."""
    model, batch, _ = HOST_MODELS_SMOKE[0] if smoke else HOST_MODELS[0]
    left = _PART_DEADLINE - time.monotonic() - 2
    return _bench(model, batch, smoke, os.path.join(out_dir, "bench"),
                  Path(out_dir, "logs", "flow.log"), min(left, 120.0))


def part_host_ratio(out_dir: str, smoke: bool) -> dict[str, Any]:
    """The runtime's measured time over DDP's at world size 1 (host cost: no communication),
    deterministic kernels, each model in its own time limit, skipped when too little time is
    left; the transformer's is the ``flow`` part's run. The goal (:data:`HOST_GOAL`) is a
    measurement: the part fails only on a run that failed or did not match DDP."""
    models = HOST_MODELS_SMOKE if smoke else HOST_MODELS
    flow_file = Path(out_dir, "parts", "flow.json")
    flow = json.loads(flow_file.read_text()) if flow_file.exists() else {}

    from_flow = bool(flow.get("ok")) and "runtime_over_ddp" in flow

    def run(i: int, model: str, batch: int, limit: float) -> dict[str, Any]:
        if i == 0 and from_flow:
            return dict(flow, source="the flow part's run")
        return _bench(model, batch, smoke, os.path.join(out_dir, "host_ratio", model),
                      Path(out_dir, "logs", f"host_ratio_{model}.log"), limit)

    return _per_model({"goal": HOST_GOAL, "models": {}}, Path(out_dir, "parts", "host_ratio.json"),
                      models, run, first_free=from_flow)


def _per_model(res: dict[str, Any], result: Path, models: list[tuple[str, int, float]],
               run: Any, first_free: bool = False) -> dict[str, Any]:
    """Each model in turn (``run(i, model, batch, limit)``, within its limit or what is left
    of the part's), skipped, saying so, when less than :data:`HOST_MIN_S` seconds are left
    (``first_free``: the first model costs nothing: it is read from another part); the
    result so far written after each model, so that a part killed past its limit keeps what
    ran."""
    for i, (model, batch, limit) in enumerate(models):
        left = _PART_DEADLINE - time.monotonic() - 3
        if left < HOST_MIN_S and not (first_free and i == 0):
            r = {"skipped": f"skipped: no time left ({max(0.0, left):.0f} s before the part's limit)"}
        else:
            r = run(i, model, batch, min(limit, left))
        res["models"][f"{model} (batch {batch})"] = r
        ran = [v for v in res["models"].values() if "skipped" not in v]
        res["ok"] = all(v.get("ok") for v in ran)
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(result)
    return res


def part_compiled(out_dir: str, smoke: bool) -> dict[str, Any]:
    """Compiled training on CUDA (issue: the plan under ``torch.compile``): each model of
    :data:`COMPILED_MODELS` benched with ``--compile inductor`` on the emulated link
    :data:`COMPILED_LINK` at world size 1, torch DDP compiled with its own DDPOptimizer
    beside the runtime's ``best`` split at its plan's blocks: best's speed over DDP's, its
    prediction and distance to the bound, how the graphs were split, and whether it trained
    as DDP did (within the bench's tolerance: inductor fuses the split pieces differently).
    A measurement: the part fails only on a run that failed or did not match DDP. Under
    ``--smoke``: lab-cnn on the CPU, ``aot_eager``."""
    models = COMPILED_MODELS_SMOKE if smoke else COMPILED_MODELS
    backend = "aot_eager" if smoke else "inductor"

    def run(i: int, model: str, batch: int, limit: float) -> dict[str, Any]:
        return _bench(model, batch, smoke, os.path.join(out_dir, "compiled", model),
                      Path(out_dir, "logs", f"compiled_{model}.log"), limit,
                      extra=("--emulate", COMPILED_LINK, "--compile", backend,
                             "--cut-probes", str(COMPILED_CUT_PROBES),
                             "--cut-probe-s", str(COMPILED_CUT_PROBE_S)),
                      k_rounds=(COMPILED_ITERATIONS, COMPILED_ROUNDS))

    return _per_model({"backend": backend, "link": COMPILED_LINK, "models": {}},
                      Path(out_dir, "parts", "compiled.json"), models, run)


PART_FUNCS = {"imports": part_imports, "tests": part_tests, "sync_debug": part_sync_debug,
              "probes": part_probes, "two_ranks": part_two_ranks, "sharded": part_sharded,
              "flow": part_flow, "compiled": part_compiled, "host_ratio": part_host_ratio}


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _cmp(diff: Any, control: Any, what: str, ref: str) -> str:
    """One comparison as the report gives it: both numbers and the verdict."""
    if not isinstance(diff, float) or not isinstance(control, float):
        return f"max |{what} - {ref}| = {_fmt(diff)}"
    state = "ok" if verdict(diff, control) else "DIFFERS (more than the control)"
    return f"max |{what} - {ref}| = {diff:.3g}, control max |{ref} - {ref}| = {control:.3g}: {state}"


def _not_run(model: str, v: dict[str, Any]) -> str | None:
    """A bench's line when it has no figures (skipped, failed); ``None`` when it has."""
    if "skipped" in v:
        return f"- {model}: {v['skipped']}"
    if "runtime_over_ddp" not in v:
        return f"- {model}: FAILED: {v.get('error') or v.get('parse_error') or 'no result'}"
    return None


def _interval(v: dict[str, Any], fmt: str) -> str:
    """The paired 95% interval of a bench's speed over DDP's, as ``fmt`` gives it, or ""."""
    ci = v.get("vs_ddp") or {}
    return (fmt.format(ci["lo"], ci["hi"])
            if isinstance(ci.get("lo"), float) and isinstance(ci.get("hi"), float) else "")


def _host_line(model: str, v: dict[str, Any]) -> str:
    """One model of ``host_ratio``."""
    head = _not_run(model, v)
    if head is not None:
        return head
    ms = v.get("measured_ms", {})
    ratio = v["runtime_over_ddp"]
    interval = _interval(v, ", 95% interval of DDP's speed {:.3f}-{:.3f}x")
    goal = "met" if v.get("meets_goal") else "NOT met"
    src = f" ({v['source']})" if v.get("source") else ""
    return (f"- {model}{src}: DDP {ms.get('ddp')} ms, runtime (best) {ms.get('best')} ms: runtime/DDP "
            f"{ratio:.3f}, {1 / ratio:.3f}x DDP's speed{interval}; goal >= {HOST_GOAL}x: {goal} "
            f"(a measurement); matches DDP: {v.get('matches_ddp')} (max diff "
            f"{_fmt(v.get('max_param_diff'))}, tolerance {_fmt(v.get('param_tolerance'))})")


def _compiled_line(model: str, v: dict[str, Any]) -> str:
    """One model of ``compiled``."""
    head = _not_run(model, v)
    if head is not None:
        return head
    ms = v.get("measured_ms", {})
    interval = _interval(v, " (95% interval {:.3f}-{:.3f})")
    split = ((v.get("compile") or {}).get("split") or {}).get("best") or {}
    pieces = (f"{split.get('pieces')} pieces in {split.get('graphs')} graph(s)"
              + (", UNSPLIT" if split.get("unsplit") else "")) if split else "split not reported"
    pred, bound = v.get("predicted_speedup"), v.get("vs_lower_bound")
    return (f"- {model}: compiled DDP {ms.get('ddp')} ms, compiled best {ms.get('best')} ms: "
            f"{1 / v['runtime_over_ddp']:.3f}x DDP{interval}, predicted {_fmt(pred)}x; best at "
            f"{_fmt(bound)}x the bound; {pieces}; matches DDP: {v.get('matches_ddp')} (max diff "
            f"{_fmt(v.get('max_param_diff'))}, tolerance {_fmt(v.get('param_tolerance'))})")


def report(res: dict[str, Any]) -> str:
    """The Markdown report of the results so far (every part run, skipped or failed)."""
    lines = ["# GPU check of the runtime's CUDA path", ""]
    imp = res.get("imports", {})
    lines.append(f"torch {imp.get('torch')}, {imp.get('gpu')}, Python {imp.get('python')}, "
                 f"{res.get('when')}{' (--smoke: CPU only, says nothing of CUDA)' if res.get('smoke') else ''}")
    lines.append("")
    lines.append("Comparisons run under deterministic kernels, each beside its control (the reference "
                 "trained twice alike): a part fails when the runtime differs from the reference by "
                 f"more than the control does. Everything else the check wrote is in {ARCHIVE}.")
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
                    lines.append(f"- {key}: {_cmp(v.get('fixed'), v.get('control'), 'runtime', 'plain')}; "
                                 f"with the fix undone {_fmt(v.get('fix_undone'))} (race "
                                 f"{'visible' if v.get('race_visible') else 'NOT visible: the probe proves nothing'})")
        elif name == "two_ranks":
            transport = "gloo, CPU" if res.get("smoke") else "gloo, CUDA tensors"
            for rk, v in enumerate(r.get("ranks", [])):
                if "error" in v:
                    lines.append(f"- two ranks ({transport}), rank {rk}: FAILED: {v['error']}")
                    continue
                lines.append(f"- two ranks ({transport}), rank {rk}: "
                             f"{_cmp(v['diff'], v.get('control'), 'runtime', 'DDP')}; optimizer calls "
                             f"per iteration {v['optimizer_calls_per_iteration']:.1f}")
                if "planted" in v:
                    lines.append(f"- planted difference (one gradient x{PLANT_SCALE} at step {PLANT_STEP}), "
                                 f"rank {rk}: max |planted - DDP| = {v['planted']:.3g}: "
                                 + ("seen" if v.get("planted_seen") else "NOT SEEN: the comparison "
                                    "proves nothing"))
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
                    for o, c in _cases(v).items():
                        lines.append(f"- {label}, rank {rk}, {o}: "
                                     f"{_cmp(c['diff'], c.get('control'), 'sharded', 'reference')}; "
                                     f"optimizer state {c['state_bytes']} bytes "
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
                             f"matches DDP: {r.get('matches_ddp')} (max relative parameter difference "
                             f"{_fmt(r.get('max_param_diff'))} against the bench's tolerance "
                             f"{_fmt(r.get('param_tolerance'))}; the bench trains DDP once: no control)")
            if not r.get("ok") and r.get("stderr"):
                lines.append(f"- stderr: {r['stderr'][-500:]}")
        elif name == "compiled":
            lines.append(f"- `--compile {r.get('backend')}` on the emulated link {r.get('link')} at world "
                         "size 1: torch DDP compiled (its DDPOptimizer) against best on the runtime (graphs "
                         "split at the plan's blocks); a measurement, it fails no part")
            for model, v in r.get("models", {}).items():
                lines.append(_compiled_line(model, v))
                if v.get("command"):
                    lines.append(f"  - {v['command']}")
                if not v.get("ok") and v.get("stderr"):
                    lines.append(f"  - stderr: {v['stderr'][-300:]}")
        elif name == "host_ratio":
            lines.append(f"- the runtime's time over DDP's at world size 1, deterministic kernels; goal: "
                         f"runtime_ms <= DDP_ms / {HOST_GOAL} (a measurement, it fails no part)")
            for model, v in r.get("models", {}).items():
                lines.append(_host_line(model, v))
                if v.get("command") and "source" not in v:
                    lines.append(f"  - {v['command']}")
                if not v.get("ok") and v.get("stderr"):
                    lines.append(f"  - stderr: {v['stderr'][-300:]}")
        ops = sorted({op for v in [r, *r.get("ranks", []), *r.get("two_ranks", []),
                                   r.get("nccl_one_rank", {})] if isinstance(v, dict)
                      for op in v.get("nondeterministic_ops", [])})
        if ops:
            lines.append("- ops without a deterministic implementation (warned, run anyway): "
                         + "; ".join(ops))
        if r.get("log_tail") and not r.get("ok"):
            lines.append("```")
            lines += r["log_tail"].splitlines()[-15:]
            lines.append("```")
        lines.append("")
    if res.get("archive"):
        a = res["archive"]
        lines.append(f"Evidence: {ARCHIVE}, {a.get('files')} files, {a.get('bytes', 0) / 2**20:.1f} MiB"
                     + (f"; left out (too large): {', '.join(a['left_out'])}" if a.get("left_out") else ""))
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
    tmp = out / "gpu_check.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "gpu_check.md")
    return text


def pack(out: Path, work: Path) -> dict[str, Any]:
    """(Re)write ``out/ARCHIVE``: every file under ``work`` (logs, the parts' results, traces,
    the benches' folders) and the report, under ``gpu_check/``; files over
    :data:`ARCHIVE_FILE_MAX` are left out and named in its ``left_out.txt``. Returns its
    file count, size and what was left out."""
    left_out: list[str] = []
    files = 0
    tmp = out / (ARCHIVE + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if not path.is_file() or path.suffix == ".tmp":
                continue
            rel = path.relative_to(work).as_posix()
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size > ARCHIVE_FILE_MAX:
                left_out.append(f"{rel} ({size / 2**20:.1f} MiB)")
                continue
            try:
                tar.add(path, arcname=f"gpu_check/{rel}")
                files += 1
            except OSError:
                continue   # gone meanwhile
        for name in ("gpu_check.md", "gpu_check.json"):
            if (out / name).exists():
                tar.add(out / name, arcname=f"gpu_check/{name}")
                files += 1
        if left_out:
            data = ("\n".join(left_out) + "\n").encode()
            info = tarfile.TarInfo("gpu_check/left_out.txt")
            info.size = len(data)
            info.mtime = int(time.time())
            import io

            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out / ARCHIVE)
    return {"files": files, "bytes": (out / ARCHIVE).stat().st_size, "left_out": left_out}


def run_part(name: str, limit_s: float, work: Path, smoke: bool) -> dict[str, Any]:
    """Run one part in a process of its own (its own session: a timeout kills its ranks too),
    writing under ``work`` (``parts/NAME.json``, ``logs/NAME.part.log``)."""
    result = work / "parts" / f"{name}.json"
    result.unlink(missing_ok=True)
    log = work / "logs" / f"{name}.part.log"
    cmd = [*_python(), str(Path(__file__).resolve()), "--part", name, "--out", str(work),
           "--part-limit", f"{limit_s:.1f}"]
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
            _kill(proc)
    secs = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-3000:]
    r: dict[str, Any]
    if result.exists():
        r = json.loads(result.read_text())
        if rc is None:   # what the part wrote before it was killed
            r.update(ok=False, error=f"timed out after {limit_s:.0f} s (killed); its result so far")
    elif rc is None:
        r = {"ok": False, "error": f"timed out after {limit_s:.0f} s (killed)"}
    else:
        r = {"ok": False, "error": f"the part's process exited with code {rc} without a result"}
    r["part_s"] = secs
    if not r.get("ok"):
        r["log_tail"] = tail
    return r


def child(name: str, out: Path, smoke: bool, limit_s: float | None = None) -> int:
    """``--part NAME``: run the part here (within ``limit_s`` seconds) and write its result."""
    global _PART_DEADLINE
    if limit_s is not None:
        _PART_DEADLINE = time.monotonic() + limit_s
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
    """The check (see the module): every part in turn, the report and the archive rewritten
    after each; exit code 0 when every part that ran passed."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check"),
                    help=f"output folder: gpu_check.md, gpu_check.json and {ARCHIVE}, nothing else")
    ap.add_argument("--work", default=None,
                    help="where the parts write (logs, results, traces; packed into the archive); "
                         "default: a temporary folder, removed at the end")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                               + ",".join(n for n, _, _ in PARTS[1:]))
    ap.add_argument("--smoke", action="store_true",
                    help="run the parts that can on the CPU: a check of this script, not of CUDA")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help=f"global deadline in seconds (default {DEADLINE_S:.0f})")
    ap.add_argument("--part", choices=sorted(PART_FUNCS), help=argparse.SUPPRESS)
    ap.add_argument("--part-limit", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if args.part:
        (out / "parts").mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        return child(args.part, out, args.smoke, args.part_limit)
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {n for n, _, _ in PARTS[1:]}
    if unknown:
        print(f"gpu_check: --skip: unknown part(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    (work / "parts").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    res: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke}
    text = ""
    try:
        for name, limit, in_smoke in PARTS:
            left = args.deadline - (time.monotonic() - start)
            if name in skip:
                res[name] = {"skipped": "--skip"}
            elif args.smoke and not in_smoke:
                res[name] = {"skipped": "needs CUDA (--smoke)"}
            elif left < 5:
                res[name] = ({"ok": False, "error": f"not run: the {args.deadline:.0f} s deadline passed"}
                             if name == "imports" else
                             {"skipped": f"skipped: no time left before the {args.deadline:.0f} s deadline"})
            else:
                res[name] = run_part(name, min(limit, left), work, args.smoke)
            r = res[name]
            state = "skipped" if r.get("skipped") else "ok" if r.get("ok") else "FAILED"
            print(f"[gpu_check] {name}: {state} ({r.get('part_s', 0):.0f} s)", flush=True)
            text = _write(out, res)
            res["archive"] = pack(out, work)
            text = _write(out, res)
            if name == "imports" and not res[name].get("ok"):
                print(f"gpu_check: {res[name].get('error', 'the import check failed')}", file=sys.stderr)
                break
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    # 0: every part that ran passed, and none was cut by the deadline.
    ran = [res[n] for n, _, _ in PARTS if n in res and not res[n].get("skipped")]
    cut = [n for n, _, _ in PARTS if "no time left" in str(res.get(n, {}).get("skipped", ""))]
    return 0 if ran and all(r.get("ok") for r in ran) and all(n in res for n, _, _ in PARTS) \
        and not cut else 1


if __name__ == "__main__":
    sys.exit(main())
