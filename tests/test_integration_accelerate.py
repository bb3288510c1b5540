"""``usbyte_opt.integrations.accelerate.prepare`` in the loop Accelerate's docs show
(``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_``, a
prepared DataLoader and LR scheduler, ``save_state`` / ``load_state``), against Accelerate's
own DDP, on two gloo ranks (``Accelerator(cpu=True)`` on the process group run_local made):
a runtime schedule in overlap mode and a ddp-tuned schedule with several buckets give the
same parameters and clip norms as Accelerate's DDP, bitwise; a resumed run equals the
uninterrupted one; with fp16 and a GradScaler whose first steps overflow, the steps are reported
skipped and the prepared LR scheduler leaves them out, as under DDP; everything prepared in one
call, as ``accelerator.prepare(*objects)`` takes it (any order, the LR scheduler bound to the
optimizer returned, as under DDP), on both paths and in one process; and the example runs under
``usbyte-opt launch``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("accelerate")

from usbyte_opt import ddp as uddp  # noqa: E402
from usbyte_opt.errors import UsbyteError  # noqa: E402
from usbyte_opt.formats import save_schedule  # noqa: E402
from usbyte_opt.launcher import free_port, run_local  # noqa: E402
from usbyte_opt.planning.problem import Problem  # noqa: E402
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks  # noqa: E402
from usbyte_opt.runtime import UsbyteWarning, profile_from_model  # noqa: E402
from usbyte_opt.runtime.default_plan import split_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
ACCUM, STEPS, SAVE_AT = 3, 8, 4


class Net(nn.Module):
    """BatchNorm; gradients become ready in reverse registration order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 16, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        return self.fc2(F.relu(self.fc1(F.max_pool2d(x, 2).flatten(1))))


def schedules(tmp: str, ws: int) -> dict[str, str]:
    """A runtime schedule (every tensor cut in 3 blocks, overlap mode) and a ddp-tuned one
    (4 buckets), as files."""
    pb = Problem.from_profile(profile_from_model(Net(), ws))
    lay = pb.layout()
    runtime = dataclasses.replace(pb.schedule("test", lay, split_blocks(pb, lay, 3)),
                                  mode="overlap")
    tuned = dataclasses.replace(pb.schedule("ddp-tuned", lay, bucket_blocks(
        pb, lay, first_bucket_bytes=600, bucket_cap_bytes=2000)), mode="fence")
    out = {}
    for name, s in (("runtime", runtime), ("tuned", tuned)):
        out[name] = str(save_schedule(s, os.path.join(tmp, f"{name}.json")))
    return out


def fresh_accelerator(**kwargs):
    """A new Accelerator: its state is process-wide (AcceleratorState, PartialState,
    GradientState), so each run in this process starts from a clean one; PartialState finds
    the process group run_local initialised and keeps it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def train(tmp: str, how: str, schedule: str | None, *, save: bool = False,
          resume: bool = False, fp16: bool = False, order: tuple[str, ...] = (),
          **accelerator_kwargs) -> dict:
    """Accelerate's loop, ``STEPS`` optimizer steps of ``ACCUM`` micro-batches (a resumed run:
    the steps after ``SAVE_AT``). ``how``: "baseline" (accelerator.prepare: Accelerate's own
    DDP) or "usbyte" (usbyte_opt's prepare). ``fp16``: ``mixed_precision="fp16"`` as
    Accelerate runs it on a GPU (fp16 autocast, a GradScaler), on CPU, where it sets up
    neither; the scale so large that the first steps overflow. ``order``: the model,
    optimizer, loader and LR scheduler prepared in one call, in this order (after another
    optimizer, so that binding the scheduler to all of them would show); else the model and
    the optimizer, then the loader and the scheduler with ``accelerator.prepare``."""
    from usbyte_opt.integrations.accelerate import prepare, runtime_optimizer, synchronize

    if fp16:
        accelerator_kwargs["mixed_precision"] = "fp16"
    acc = fresh_accelerator(gradient_accumulation_steps=ACCUM, **accelerator_kwargs)
    if fp16:
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -12,
                                          growth_interval=2)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    g = torch.Generator().manual_seed(7)
    n = 4 * ACCUM * STEPS * acc.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 8, 8, generator=g),
                                          torch.randint(0, 5, (n,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    err = io.StringIO()
    objs = {"model": model, "opt": opt, "loader": loader, "lr": lr}
    with contextlib.redirect_stderr(err):
        if order:
            other = acc.prepare(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
            args = [objs[k] for k in order]
            got = (acc.prepare(*args) if how == "baseline"
                   else prepare(acc, *args, schedule=schedule, verify=False))
            model, opt, loader, lr = (got[order.index(k)] for k in ("model", "opt", "loader", "lr"))
        elif how == "baseline":
            model, opt = acc.prepare(model, opt)
        else:
            model, opt = prepare(acc, model, opt, schedule=schedule, verify=False)
    if not order:
        loader, lr = acc.prepare(loader, lr)
    ckpt = os.path.join(tmp, f"ckpt-{os.path.basename(schedule or how)}")
    if resume:
        acc.load_state(ckpt)
        loader = acc.skip_first_batches(loader, SAVE_AT * ACCUM)
    norms, lrs, skipped = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UsbyteWarning)   # watch_buckets: DDP's buckets unplanned
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y) * 4.0
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
                opt.step()
                lr.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    lrs.append(lr.get_last_lr()[0])
                    skipped.append(opt.step_was_skipped)
            if save and acc.sync_gradients and len(norms) == SAVE_AT:
                acc.save_state(ckpt)    # mid-run, then training goes on
    synchronize(opt)
    net = acc.unwrap_model(model)
    out = {"params": [p.detach().clone() for p in net.parameters()],
           "buffers": [b.detach().clone() for b in net.buffers()],
           "norms": norms, "lrs": lrs, "skipped": skipped, "type": type(model).__name__,
           "log": err.getvalue(), "types": [type(o).__name__ for o in (model, opt, loader, lr)],
           "bound": [o is opt for o in lr.optimizers]}
    if order:
        out["bound_other"] = any(o is other for o in lr.optimizers)
    dopt = runtime_optimizer(opt)
    if dopt is not None:
        out["calls"] = dopt.optimizer_calls
        out["mode"] = dopt.mode
        # marked prepared: accelerator.prepare again wraps neither
        out["again"] = acc.prepare(model) is model and acc.prepare(opt) is opt
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        out["sizes"] = uddp.rebuilt_bucket_sizes(model)
    return out


def diff(a: dict, b: dict, rank: int) -> float:
    """Max difference of parameters and buffers (each rank's own statistics, as under DDP)."""
    ds = [(p - q).abs().max().item() for p, q in zip(a["params"], b["params"])]
    ds += [(p.float() - q.float()).abs().max().item() for p, q in zip(a["buffers"], b["buffers"])]
    return max(ds)


def misuse(tmp: str, sched: dict[str, str]) -> list[str]:
    """Setups refused in one line on every rank."""
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    from usbyte_opt.integrations.accelerate import prepare

    msgs = []
    cases = [
        ({}, lambda acc, m, o: (m, acc.prepare(o)), sched["runtime"]),
        ({"kwargs_handlers": [DistributedDataParallelKwargs(bucket_cap_mb=5)]},
         lambda acc, m, o: (m, o), sched["tuned"]),
        ({"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2,
                                                                     sync_each_batch=True)},
         lambda acc, m, o: (m, o), sched["runtime"]),
        ({}, lambda acc, m, o: (m, o), sched["runtime"], {"backward_passes_per_step": 2}),
        ({}, lambda acc, m, o: (m, o, nn.Linear(2, 2)), sched["runtime"]),
        ({}, lambda acc, m, o: (m, torch.utils.data.DataLoader(range(4))), sched["tuned"]),
    ]
    for kw, pre, s, *opts in cases:
        acc = fresh_accelerator(**kw)
        m = Net()
        objs = pre(acc, m, torch.optim.SGD(m.parameters(), lr=0.1))
        try:
            prepare(acc, *objs, schedule=s, **(opts[0] if opts else {}))
            msgs.append("")
        except UsbyteError as e:
            msgs.append(str(e))
    return msgs


def cases(rank: int, ws: int, tmp: str) -> dict:
    from usbyte_opt.formats import load_schedule

    os.environ["OMP_NUM_THREADS"] = "1"     # as run_local set torch's (Accelerate checks)
    sched = schedules(tmp, ws)
    base = train(tmp, "baseline", None)
    out: dict = {"base_norms": base["norms"], "misuse": misuse(tmp, sched)}
    for name in ("runtime", "tuned"):
        full = train(tmp, "usbyte", sched[name], save=True)
        resumed = train(tmp, "usbyte", sched[name], resume=True)
        out[name] = {k: v for k, v in full.items() if k not in ("params", "buffers")}
        out[name]["diff"] = diff(full, base, rank)
        out[name]["resume_diff"] = diff(resumed, full, rank)
        out[name]["resume_norms"] = resumed["norms"]
    # find_unused_parameters=True in the user's handler: DDP keeps its first buckets, the
    # caps follow the registration order; bf16 autocast: Accelerate's mixed precision
    from accelerate.utils import DistributedDataParallelKwargs

    unused = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    found = train(tmp, "usbyte", sched["tuned"], kwargs_handlers=unused)
    out["unused"] = {"diff": diff(found, base, rank), "norms": found["norms"] == base["norms"],
                     "sizes": found["sizes"]}
    bf16 = {"mixed_precision": "bf16"}
    base16, run16 = train(tmp, "baseline", None, **bf16), train(tmp, "usbyte", sched["runtime"], **bf16)
    out["bf16"] = {"diff": diff(run16, base16, rank), "norms": run16["norms"] == base16["norms"],
                   "vs_fp32": diff(base16, base, rank)}
    base16, run16 = train(tmp, "baseline", None, fp16=True), train(tmp, "usbyte", sched["runtime"], fp16=True)
    out["fp16"] = {"diff": diff(run16, base16, rank), "norms": repr(run16["norms"]) == repr(base16["norms"]),
                   "lrs": run16["lrs"] == base16["lrs"], "skipped": run16["skipped"],
                   "base_skipped": base16["skipped"], "first_norm": run16["norms"][0]}
    # everything in one call, as accelerator.prepare(*objects): Accelerate's order, then others
    together = ("model", "opt", "loader", "lr")
    base1 = train(tmp, "baseline", None, order=together)
    out["together"] = {"base": {k: base1[k] for k in ("types", "bound", "bound_other")},
                       "base_diff": diff(base1, base, rank)}
    for name, order in (("runtime", together), ("tuned", together),
                        ("runtime", ("lr", "loader", "opt", "model"))):
        one = train(tmp, "usbyte", sched[name], order=order)
        out["together"][f"{name} {' '.join(order)}"] = {
            "diff": diff(one, base1, rank), "norms": one["norms"] == base1["norms"],
            "lrs": one["lrs"] == base1["lrs"], "types": one["types"], "bound": one["bound"],
            "bound_other": one["bound_other"]}
    out["planned"] = [b.end - b.start for b in load_schedule(sched["tuned"]).blocks]
    out["runtime_blocks"] = len(load_schedule(sched["runtime"]).blocks)
    return out


def test_prepare_trains_like_accelerates_ddp_on_both_paths_and_resumes(tmp_path: Path):
    rs = run_local(cases, 2, args=(str(tmp_path),), timeout_s=240)
    for r in rs:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        v = r.value
        base = v["base_norms"]
        assert len(base) == STEPS and max(base) > 1.0          # clipping engaged
        rt, tu = v["runtime"], v["tuned"]
        # runtime, overlap mode: the plain model, step() only on syncing micro-batches
        assert rt["type"] == "Net" and rt["mode"] == "overlap" and rt["again"]
        assert rt["calls"] == STEPS
        # ddp-tuned: Accelerate's DDP, whose rebuilt buckets are the planned blocks
        assert tu["type"] == "DistributedDataParallel"
        assert len(v["planned"]) >= 3
        assert tu["sizes"] == [4 * n for n in v["planned"]]
        for case in (rt, tu):
            assert case["norms"] == base                       # bitwise, every step
            assert case["diff"] == 0.0
            assert case["resume_diff"] == 0.0
            assert case["resume_norms"] == base[SAVE_AT:]
        if r.rank == 0:
            assert (f"the usbyte-opt runtime, {v['runtime_blocks']} blocks in overlap mode"
                    in rt["log"])
            assert f"stock DistributedDataParallel with the schedule's {len(v['planned'])} " \
                   "planned buckets" in tu["log"]
        else:
            assert rt["log"] == tu["log"] == ""
        # find_unused_parameters=True (planned caps in registration order) and bf16 autocast
        assert v["unused"]["sizes"] == tu["sizes"] and v["unused"]["norms"]
        assert v["unused"]["diff"] == 0.0
        assert v["bf16"]["diff"] == 0.0 and v["bf16"]["norms"]
        assert v["bf16"]["vs_fp32"] > 0.0       # autocast did run
        # fp16, the first steps overflowing: reported skipped, the prepared LR scheduler
        # leaves them out, as under DDP
        f16 = v["fp16"]
        assert f16["skipped"] == f16["base_skipped"] and f16["skipped"][0] and not all(f16["skipped"])
        assert f16["lrs"] and f16["norms"] and f16["diff"] == 0.0
        assert not math.isfinite(f16["first_norm"])
        m = v["misuse"]
        assert "already prepared (AcceleratedOptimizer)" in m[0]
        assert "DistributedDataParallelKwargs(bucket_cap_mb=5)" in m[1]
        assert "sync_each_batch=True" in m[2]
        assert "backward_passes_per_step" in m[3]
        assert "exactly one model and one optimizer among its objects, got 2 module(s) and 1" in m[4]
        assert "got 1 module(s) and 0 optimizer(s)" in m[5]
        assert all(x and "\n" not in x for x in m)
        # one call with everything, in any order: as accelerator.prepare(*objects) under DDP
        tog = v["together"]
        assert tog["base"] == {"types": ["DistributedDataParallel", "AcceleratedOptimizer",
                                         "DataLoaderShard", "AcceleratedScheduler"],
                               "bound": [True], "bound_other": False}
        assert tog["base_diff"] == 0.0
        for key, case in tog.items():
            if key.startswith(("runtime", "tuned")):
                assert case["diff"] == 0.0 and case["norms"] and case["lrs"], key
                assert case["bound"] == [True] and not case["bound_other"], key
                assert case["types"][0] == ("Net" if key.startswith("runtime") else
                                            "DistributedDataParallel"), key
                assert case["types"][1:] == ["AcceleratedOptimizer", "DataLoaderShard",
                                             "AcceleratedScheduler"], key
    assert rs[0].value["misuse"] == rs[1].value["misuse"]


def test_prepare_in_one_process_is_accelerates_own_for_every_object():
    """One process (no process group): nothing to all-reduce, prepare(accelerator, *objects) is
    accelerator.prepare(*objects), in the order given; the two-argument form returns the pair."""
    from accelerate.state import AcceleratorState, GradientState

    from usbyte_opt.integrations.accelerate import prepare

    try:
        acc = fresh_accelerator()
        assert not acc.use_distributed
        m = Net()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        lr = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)
        loader = torch.utils.data.DataLoader(range(8), batch_size=2)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            got = prepare(acc, lr, loader, m, o, schedule=None)
        assert [type(x).__name__ for x in got] == ["AcceleratedScheduler", "DataLoaderShard", "Net",
                                                   "AcceleratedOptimizer"]
        assert got[0].optimizers == [got[3]] and got[3].optimizer is o
        assert "one process, nothing to all-reduce" in err.getvalue()
        m2 = Net()
        with contextlib.redirect_stderr(io.StringIO()):
            pair = prepare(acc, m2, torch.optim.SGD(m2.parameters(), lr=0.1))
        assert isinstance(pair, tuple) and len(pair) == 2 and pair[0] is m2
        with pytest.raises(UsbyteError, match="got 1 module"):
            prepare(acc, Net(), loader)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# --------------------------------------------------------------------------------------------
# The example, under `usbyte-opt launch` (torchrun with $USBYTE_SCHEDULE)
# --------------------------------------------------------------------------------------------


def example_module():
    spec = importlib.util.spec_from_file_location("accelerate_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def start(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_example_runs_under_usbyte_opt_launch_like_accelerates_ddp(tmp_path: Path):
    ex = example_module()
    model = ex.make_model("tiny")
    pb = Problem.from_profile(profile_from_model(model, 2))
    lay = pb.layout()
    sched = dataclasses.replace(pb.schedule("test", lay, split_blocks(pb, lay, 2)),
                                mode="overlap")
    path = save_schedule(sched, tmp_path / "s.json")
    args = ("--size", "tiny", "--steps", "4", "--accum", "2", "--report")
    # usbyte-opt launch (torchrun, $USBYTE_SCHEDULE) and, side by side, plain torchrun --baseline
    runs = {"usbyte": start("usbyte_opt", "launch", "--schedule", str(path), "--nproc-per-node", "2",
                            "--master-port", str(free_port()), str(EXAMPLE), *args,
                            str(tmp_path / "usbyte.json")),
            "baseline": start("torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              str(free_port()), str(EXAMPLE), *args, str(tmp_path / "baseline.json"),
                              "--baseline")}
    outs = {k: p.communicate(timeout=240) for k, p in runs.items()}
    for k, p in runs.items():
        assert p.returncode == 0, f"{k}: stdout: {outs[k][0][-2000:]}\nstderr: {outs[k][1][-3000:]}"
    r, b = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("usbyte", "baseline"))
    assert r["trainer"] == b["trainer"] == "accelerate"
    assert (r["path"], b["path"]) == ("runtime", "baseline")
    assert r["steps"] == b["steps"] == 4
    assert len(r["ms_per_step"]) == 2 and r["median_ms"] > 0
    assert isinstance(r["param_checksum"], float)
    assert r["param_checksum"] == b["param_checksum"]          # same training, bitwise
    out, err = outs["usbyte"]
    assert f"the usbyte-opt runtime, {len(sched.blocks)} blocks in overlap mode" in err
    assert "accelerate runtime: 4 steps" in out and "accelerate baseline: 4 steps" in outs["baseline"][0]
