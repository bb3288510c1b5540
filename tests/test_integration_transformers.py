"""``UsbyteTrainer`` (usbyte_opt.integrations.transformers) against the Hugging Face Trainer's
own DDP, on two gloo ranks: a tiny BERT built from a config (dropout off), a seeded synthetic
data set, accumulation 3, clipping at 1.0, 8 optimizer steps. The runtime path (an overlap
schedule), a checkpoint and the resume from it, and the stock-DDP path (a ddp-tuned schedule
of several buckets, in BERT's real gradient-ready order) all run in one spawned run, since
starting the ranks and importing transformers is most of the cost; so does fp16 with overflows
against the Trainer's DDP (see :class:`CpuFp16`). The example script runs under ``usbyte-opt
launch``."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from usbyte_opt import ddp as uddp  # noqa: E402
from usbyte_opt.errors import UsbyteError  # noqa: E402
from usbyte_opt.formats import save_schedule  # noqa: E402
from usbyte_opt.launcher import free_port, run_local  # noqa: E402
from usbyte_opt.planning.problem import Problem  # noqa: E402
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks  # noqa: E402
from usbyte_opt.runtime import UsbyteWarning, default_schedule, profile_from_model  # noqa: E402
from usbyte_opt.runtime.default_plan import split_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ACCUM, STEPS, BATCH = 3, 8, 4


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    """Seeded token sequences with some padding, and labels."""

    def __init__(self, n: int = 2 * BATCH * ACCUM * STEPS, seq: int = 16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 100, (n, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
        self.mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def arguments(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True,
                dataloader_num_workers=0, per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUM, max_steps=STEPS, max_grad_norm=1.0,
                learning_rate=2e-3, warmup_steps=2, logging_steps=1, save_strategy="no", seed=0)
    return TrainingArguments(**{**base, **kw})


def ready_order(model: torch.nn.Module) -> list[str]:
    """The names of the trainable tensors in the order their gradients become ready, from one
    real backward pass (post-accumulate-grad hooks), on a copy."""
    m = copy.deepcopy(model)
    order: list[str] = []
    hs = [p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
          for n, p in m.named_parameters() if p.requires_grad]
    batch = torch.utils.data.default_collate([Data()[i] for i in range(BATCH)])
    m(**batch).loss.backward()
    for h in hs:
        h.remove()
    return order


def schedules(model: torch.nn.Module, ws: int, order: list[str]):
    """A runtime schedule (overlap mode, every tensor cut in 3) and a ddp-tuned one (fence
    mode, whole tensors in the real ready order, several buckets)."""
    prof = profile_from_model(model, ws)
    pb = Problem.from_profile(prof)
    lay = pb.layout()
    runtime = dataclasses.replace(pb.schedule("test", lay, split_blocks(pb, lay, 3)), mode="overlap")
    pos = {n: i for i, n in enumerate(order)}
    real = dataclasses.replace(prof, tensors=tuple(dataclasses.replace(t, ready_ms=float(pos[t.name]))
                                                   for t in prof.tensors))
    pb = Problem.from_profile(real)
    lay = pb.layout()
    blocks = bucket_blocks(pb, lay, first_bucket_bytes=8_000, bucket_cap_bytes=40_000)
    tuned = dataclasses.replace(pb.schedule("ddp-tuned", lay, blocks), mode="fence")
    return runtime, tuned


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def norms(trainer) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


class CpuFp16:
    """A Trainer mixin: ``fp16=True`` as Accelerate runs it on a GPU (fp16 autocast in the
    prepared model's forward, a ``GradScaler`` in ``accelerator.backward``, in the clipping's
    unscale and in ``AcceleratedOptimizer.step``, which reports the steps the scaler skips), on
    CPU, where Accelerate sets up neither. The scale is so large that the first steps overflow."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40,
                                                       backoff_factor=2.0 ** -12, growth_interval=2)


def fp16_run(cls, base, data, out: str, **kw) -> dict:
    """6 optimizer steps of fp16 with overflows, no accumulation, a linear LR decay, AdamW not
    fused (HF's default, fused AdamW, takes the scaler's verdict itself and is never reported
    skipped, under DDP as here): the LR in force after each step, the AdamW step count."""
    from transformers import TrainerCallback

    class LRs(TrainerCallback):
        def __init__(self):
            self.lrs: list[float] = []

        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            self.lrs.append(lr_scheduler.get_last_lr()[0])

    lrs = LRs()
    tr = type("Fp16" + cls.__name__, (CpuFp16, cls), {})(
        model=copy.deepcopy(base), train_dataset=data, callbacks=[lrs], **kw,
        args=arguments(out, fp16=True, optim="adamw_torch", gradient_accumulation_steps=1, max_steps=6,
                       warmup_steps=0, lr_scheduler_type="linear", logging_steps=1))
    tr.train()
    inner = tr.optimizer
    while not isinstance(inner, torch.optim.AdamW):
        inner = inner.optimizer
    return {"lrs": lrs.lrs, "params": params(tr.model), "norms": norms(tr),
            "scale": tr.accelerator.scaler.get_scale(),
            "adam_steps": sorted({float(st["step"]) for st in inner.state.values()})}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def trainers(rank: int, ws: int, tmp: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import Trainer

    from usbyte_opt.integrations.transformers import UsbyteTrainer
    from usbyte_opt.runtime import DistributedOptimizer

    lines = Lines()
    logging.getLogger("usbyte_opt.integrations").addHandler(lines)
    logging.getLogger("usbyte_opt.integrations").setLevel(logging.INFO)
    base, data = tiny_bert(), Data()
    runtime, tuned = schedules(base, ws, ready_order(base))
    rpath, tpath = os.path.join(tmp, "runtime.json"), os.path.join(tmp, "tuned.json")
    if rank == 0:
        save_schedule(runtime, rpath)
        save_schedule(tuned, tpath)
    dist.barrier()
    out: dict = {"planned": [(b.end - b.start) * 4 for b in tuned.blocks]}

    # 1. The plain HF Trainer with its own DDP (find_unused_parameters=True, HF's default).
    ref = Trainer(model=copy.deepcopy(base), args=arguments(os.path.join(tmp, "ref")), train_dataset=data)
    ref.train()
    out["ref_wrapped"] = type(ref.model_wrapped).__name__
    want, want_norms = params(ref.model), norms(ref)

    # 2. The runtime path, overlap mode, with a checkpoint at step 4.
    run = UsbyteTrainer(model=copy.deepcopy(base), train_dataset=data, eval_dataset=Data(8), schedule=rpath,
                        args=arguments(os.path.join(tmp, "run"), save_strategy="steps", save_steps=4,
                                       eval_strategy="steps", eval_steps=4),
                        runtime_options={"verify": False})
    run.train()
    opt = run.usbyte_optimizer
    out.update(run_path=run.usbyte_plan.path, run_plain=run.model_wrapped is run.model
               and not isinstance(run.model_wrapped, DDP), run_mode=opt.mode,
               run_is_runtime=isinstance(opt, DistributedOptimizer), run_calls=opt.optimizer_calls,
               run_diff=diff(params(run.model), want), run_norms=norms(run), ref_norms=want_norms,
               evals=len([e for e in run.state.log_history if "eval_loss" in e]),
               lr_equal=[e.get("learning_rate") for e in run.state.log_history if "loss" in e]
               == [e.get("learning_rate") for e in ref.state.log_history if "loss" in e])
    ckpt = os.path.join(tmp, "run", "checkpoint-4")
    out["ckpt_files"] = sorted(os.listdir(ckpt)) if rank == 0 else []
    saved = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True) if rank == 0 else None
    out["ckpt_steps"] = sorted({float(s["step"]) for s in saved["state"].values()}) if saved else []
    dist.barrier()

    # 3. Resume from the checkpoint: equals the uninterrupted run. The optimizer is passed
    #    in (optimizers=), the one the Trainer would build (fused AdamW, HF's two groups).
    m = copy.deepcopy(base)
    decay = set(ref.get_decay_parameter_names(m))
    groups = [{"params": [p for n, p in m.named_parameters() if (n in decay) == d], "weight_decay": 0.0}
              for d in (True, False)]
    own = torch.optim.AdamW(groups, lr=2e-3, fused=True)
    res = UsbyteTrainer(model=m, train_dataset=data, schedule=rpath, optimizers=(own, None),
                        args=arguments(os.path.join(tmp, "res")), runtime_options={"verify": False})
    res.train(resume_from_checkpoint=ckpt)
    out.update(res_diff=diff(params(res.model), params(run.model)), res_calls=res.usbyte_optimizer.optimizer_calls,
               res_norms=norms(res), res_own=res.usbyte_optimizer.optimizer is own)

    # 4. The stock-DDP path: the Trainer's DDP with the planned buckets.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UsbyteWarning)
        ddp = UsbyteTrainer(model=copy.deepcopy(base), train_dataset=data, schedule=tpath,
                            args=arguments(os.path.join(tmp, "ddp")))
        ddp.train()
    wrapped = ddp.model_wrapped
    out.update(ddp_path=ddp.usbyte_plan.path, ddp_is_ddp=isinstance(wrapped, DDP),
               ddp_find_unused=bool(wrapped.find_unused_parameters), ddp_sizes=uddp.rebuilt_bucket_sizes(wrapped),
               ddp_diff=diff(params(ddp.model), want), ddp_norms=norms(ddp),
               ddp_warnings=[str(w.message) for w in caught if issubclass(w.category, UsbyteWarning)])
    uddp.check_buckets(wrapped, tuned)

    # 5. fp16, the first steps overflowing: the Trainer's DDP, then the runtime path (the
    #    runtime's default plan in overlap mode: one block, for time's sake).
    ref16 = fp16_run(Trainer, base, data, os.path.join(tmp, "ref16"))
    run16 = fp16_run(UsbyteTrainer, base, data, os.path.join(tmp, "run16"),
                     schedule=default_schedule(base, ws), runtime_options={"verify": False})
    out["fp16"] = {"ref": {k: v for k, v in ref16.items() if k != "params"},
                   "run": {k: v for k, v in run16.items() if k != "params"},
                   "diff": diff(run16["params"], ref16["params"])}

    # 6. Misuse: a bad runtime option, bucket caps of one's own with a ddp-tuned schedule.
    errors = []
    for kw in ({"schedule": rpath, "runtime_options": {"wait_in_backward": False}},
               {"schedule": tpath, "args": arguments(os.path.join(tmp, "x"), ddp_bucket_cap_mb=10)},
               {"schedule": tpath, "args": arguments(os.path.join(tmp, "x"), ddp_find_unused_parameters=True)}):
        try:
            UsbyteTrainer(model=copy.deepcopy(base), train_dataset=data,
                          **{"args": arguments(os.path.join(tmp, "x")), **kw})
        except UsbyteError as e:
            errors.append(str(e))
    out["errors"] = errors

    # 7. torch_compile (aot_eager) on the runtime path: Accelerate hands the compiled module to
    #    no_sync() on the micro-batches that must not sync (it was refused: "got a gradient in
    #    backward pass 2 of a step").
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    refc = Trainer(model=copy.deepcopy(base), train_dataset=data,
                   args=arguments(os.path.join(tmp, "refc"), **compiled))
    refc.train()
    runc = UsbyteTrainer(model=copy.deepcopy(base), train_dataset=data, schedule=rpath,
                         args=arguments(os.path.join(tmp, "runc"), **compiled), runtime_options={"verify": False})
    runc.train()
    out["compiled"] = {"ref": type(refc.model_wrapped).__name__, "run": type(runc.model_wrapped).__name__,
                       "diff": diff(params(runc.model), params(refc.model))}
    out["lines"] = lines.lines
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf"))
    rs = run_local(trainers, 2, args=(tmp,), timeout_s=300)
    for r in rs:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in rs]


def test_the_baseline_is_the_trainers_own_ddp(results):
    assert all(v["ref_wrapped"] == "DistributedDataParallel" for v in results)


def test_runtime_path_trains_bitwise_like_the_trainers_ddp(results):
    for v in results:
        assert v["run_path"] == "runtime" and v["run_is_runtime"] and v["run_mode"] == "overlap"
        assert v["run_plain"]                         # never wrapped in DDP
        assert v["run_calls"] == STEPS
        assert v["run_diff"] == 0.0, v["run_diff"]
        assert v["lr_equal"]
        assert v["evals"] == 2                        # evaluation at steps 4 and 8, mid-training


def test_logged_grad_norm_is_the_trainers_ddp_value(results):
    for v in results:
        assert len(v["ref_norms"]) == STEPS
        assert v["run_norms"] == v["ref_norms"]
        assert v["ddp_norms"] == v["ref_norms"]
        assert any(n > 1.0 for n in v["ref_norms"])  # clipping at 1.0 did something


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(results):
    r0 = results[0]
    assert "optimizer.pt" in r0["ckpt_files"] and "scheduler.pt" in r0["ckpt_files"]
    assert r0["ckpt_steps"] == [4.0]                  # the wrapped optimizer's own format
    for v in results:
        assert v["res_own"]                           # the optimizer given, wrapped
        assert v["res_calls"] == STEPS - 4
        assert v["res_diff"] == 0.0, v["res_diff"]
        assert v["res_norms"] == v["run_norms"]       # the checkpoint's log history, then its own


def test_ddp_tuned_schedule_runs_the_trainers_ddp_with_the_planned_buckets(results):
    for v in results:
        assert v["ddp_path"] == "ddp" and v["ddp_is_ddp"]
        assert not v["ddp_find_unused"]               # HF's default True is not the plan's
        assert len(v["planned"]) >= 3
        assert v["ddp_sizes"] == v["planned"]
        assert v["ddp_warnings"] == []
        assert v["ddp_diff"] == 0.0, v["ddp_diff"]


def test_fp16_overflow_steps_leave_the_lr_scheduler_alone_as_under_the_trainers_ddp(results):
    for v in results:
        ref, run = v["fp16"]["ref"], v["fp16"]["run"]
        assert len(ref["lrs"]) == len(run["lrs"]) == 6
        # GradScaler skipped the first steps (the runtime skips the update itself); the
        # scheduler stepped only after the others, as under DDP
        assert ref["adam_steps"] == run["adam_steps"] and 0 < run["adam_steps"][0] < 5
        assert not math.isfinite(run["norms"][0]) and ref["scale"] == run["scale"]
        assert run["lrs"] == ref["lrs"]
        assert run["lrs"][0] == 2e-3 and len(set(run["lrs"])) == 1 + run["adam_steps"][0]
        assert repr(run["norms"]) == repr(ref["norms"])
        assert v["fp16"]["diff"] == 0.0, v["fp16"]["diff"]


def test_torch_compile_on_the_runtime_path_trains_bitwise_like_the_trainers_compiled_ddp(results):
    for r in results:
        assert r["compiled"] == {"ref": "OptimizedModule", "run": "OptimizedModule", "diff": 0.0}, r["compiled"]


def test_the_run_says_which_path_once_on_rank_0(results):
    lines0 = results[0]["lines"]
    assert sum("the usbyte-opt runtime, " in ln and "overlap mode" in ln for ln in lines0) == 4   # +compiled
    assert sum("stock DistributedDataParallel with the schedule's" in ln for ln in lines0) == 1
    assert results[1]["lines"] == []


def test_misuse_is_one_line(results):
    for v in results:
        a, b, c = v["errors"]
        assert "wait_in_backward=False" in a
        assert "ddp_bucket_cap_mb=10" in b and "leave ddp_bucket_cap_mb unset" in b
        # BERT's gradients are not ready in reverse registration order: DDP with
        # find_unused_parameters=True (never rebuilding its buckets) cannot keep the plan
        assert "find_unused_parameters=True: DDP then never rebuilds" in c
        assert "\n" not in a + b + c


# --------------------------------------------------------------------------------------------
# The example, under `usbyte-opt launch`
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_runs_under_usbyte_opt_launch(tmp_path: Path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from usbyte_opt.runtime import default_schedule

    sched = tmp_path / "s.json"
    save_schedule(dataclasses.replace(default_schedule(hf_train.model("tiny"), 2), mode="overlap"), sched)
    report = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "launch", "--schedule", str(sched),
                          "--nproc-per-node", "2", "--master-port", str(free_port()),
                          str(ROOT / "examples" / "hf_train.py"), "--size", "tiny", "--steps", "4",
                          "--report", str(report)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-4000:]}"
    rep = json.loads(report.read_text())
    assert rep["trainer"] == "transformers" and rep["path"] == "runtime" and rep["steps"] == 4
    assert len(rep["ms_per_step"]) == 2 and rep["median_ms"] > 0
    assert isinstance(rep["param_checksum"], float)
    assert "usbyte-opt (transformers): the usbyte-opt runtime" in res.stderr
