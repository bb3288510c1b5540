"""Lightning: ``UsbyteStrategy`` against Lightning's own ``DDPStrategy``, on two gloo ranks.

One spawned run (Lightning's import dominates) trains a small CNN with BatchNorm several
times: Lightning's DDP and the usbyte-opt runtime (a split-blocks schedule in overlap mode)
with ``accumulate_grad_batches=3``, ``gradient_clip_val=1.0``, validation and a checkpoint
every epoch, then a resume from the first checkpoint; a ``ddp-tuned`` schedule of three
buckets through ``Trainer(strategy="usbyte")`` and ``$USBYTE_SCHEDULE`` against DDP with
``accumulate_grad_batches=2``; manual optimization (accumulation in the strategy's
``block_backward_sync()``, clipping with ``self.clip_gradients``) on both; mixed precision with
``gradient_clip_val=1.0`` on both: Lightning's fp16 path (``MixedPrecision("16-mixed")``: fp16
autocast and a ``GradScaler``, given as a plugin with device ``"cpu"``, since
``precision="16-mixed"`` on a CPU accelerator becomes ``"bf16-mixed"``), its scale so large that
the first steps overflow and are skipped, and ``precision="16-mixed"`` as written (bf16 autocast
here). Real JSON schedule files, real process groups. Then the example under ``usbyte-opt
launch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from usbyte_opt import ddp as uddp  # noqa: E402
from usbyte_opt.env import SCHEDULE_ENV  # noqa: E402
from usbyte_opt.errors import UsbyteError  # noqa: E402
from usbyte_opt.formats import save_schedule  # noqa: E402
from usbyte_opt.integrations.lightning import UsbyteStrategy  # noqa: E402
from usbyte_opt.launcher import free_port, run_local  # noqa: E402
from usbyte_opt.planning.problem import Problem  # noqa: E402
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks  # noqa: E402
from usbyte_opt.runtime import UsbyteWarning, profile_from_model  # noqa: E402
from usbyte_opt.runtime.default_plan import split_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH, STEPS_PER_EPOCH, EPOCHS = 4, 4, 2


class Net(pl.LightningModule):
    """A small CNN with BatchNorm; ``training_step`` calls ``self(x)`` (the module's forward
    inside the step, as most LightningModules do)."""

    def __init__(self, seed: int = 0, manual: bool = False, accum: int = 1):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))
        self.automatic_optimization = not manual
        self.accum = accum
        self.val_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        x, y = batch
        if self.automatic_optimization:
            return F.cross_entropy(self(x), y)
        opt = self.optimizers()
        step = (i + 1) % self.accum == 0
        # passes that only accumulate: in no_sync(), as under DDP
        with contextlib.nullcontext() if step else self.trainer.strategy.block_backward_sync():
            loss = F.cross_entropy(self(x), y) / self.accum
            self.manual_backward(loss)
        if step:
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x), y).item())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)   # on the plain optimizer
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders(ws: int, accum: int):
    n = ws * BATCH * accum * STEPS_PER_EPOCH
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 8, 8, generator=g),
                                          torch.randint(0, 5, (n,), generator=g))
    val = torch.utils.data.TensorDataset(torch.randn(ws * 8, 3, 8, 8, generator=g),
                                         torch.randint(0, 5, (ws * 8,), generator=g))
    return (torch.utils.data.DataLoader(data, batch_size=BATCH),
            torch.utils.data.DataLoader(val, batch_size=BATCH))


def schedules(d: Path, ws: int = 2) -> dict[str, str]:
    """A runtime schedule (3 split blocks, overlap mode) and a ddp-tuned one of 3 buckets
    (fc2 | fc1 | the rest, closed at layer boundaries whatever the order within a layer)."""
    pb = Problem.from_profile(profile_from_model(Net(), ws))
    lay = pb.layout()
    over = dataclasses.replace(pb.schedule("test", lay, split_blocks(pb, lay, 3)), mode="overlap")
    tuned = dataclasses.replace(pb.schedule("ddp-tuned", lay, bucket_blocks(
        pb, lay, first_bucket_bytes=600, bucket_cap_bytes=8000)), mode="fence")
    out = {"overlap": str(d / "overlap.json"), "tuned": str(d / "tuned.json")}
    save_schedule(over, out["overlap"])
    save_schedule(tuned, out["tuned"])
    return out


class Buckets(pl.Callback):
    """DDP's buckets at the end of training (before Lightning unwraps the model)."""

    def __init__(self, schedule):
        self.schedule, self.sizes, self.check = schedule, None, None

    def on_train_end(self, trainer, module):
        ddp = trainer.strategy.model
        self.sizes = uddp.rebuilt_bucket_sizes(ddp)
        try:
            uddp.check_buckets(ddp, self.schedule)
            self.check = ""
        except Exception as e:  # noqa: BLE001 - reported to the test
            self.check = str(e)


class Norms(pl.Callback):
    """The gradients' total norm where Lightning's hooks see them: after unscaling, before
    clipping (``inf``/``nan`` on a step that overflowed)."""

    def __init__(self):
        self.values: list[float] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.values.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def fp16_plugin():
    """Lightning's "16-mixed" plugin on CPU (fp16 autocast, GradScaler), its scale so large
    that the first steps overflow."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -12, growth_interval=2))


def fit(strategy, d: Path, name: str, *, accum: int, manual: bool = False, ckpt: str | None = None,
        seed: int = 0, callbacks=(), checkpoint: bool = False, val_every: int | None = None,
        precision=None, plugins=None) -> dict:
    model = Net(seed=seed, manual=manual, accum=accum)
    callbacks = list(callbacks)
    if checkpoint:
        callbacks += [pl.callbacks.ModelCheckpoint(dirpath=d, filename=name + "-{epoch}",
                                                   save_top_k=-1, every_n_epochs=1),
                      # right after an optimizer step, no validation before it, and no
                      # optimizer state read (which would apply pending updates) after it
                      pl.callbacks.ModelCheckpoint(dirpath=d, filename=name + "-{step}", save_top_k=-1,
                                                   every_n_train_steps=2, save_weights_only=True)]
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, num_nodes=1, max_epochs=EPOCHS,
        accumulate_grad_batches=1 if manual else accum, gradient_clip_val=None if manual else 1.0,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=2, enable_checkpointing=checkpoint,
        val_check_interval=val_every, callbacks=callbacks, default_root_dir=d, precision=precision,
        plugins=plugins)
    train, val = loaders(trainer.world_size, accum)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always", UsbyteWarning)
        trainer.fit(model, train, val, ckpt_path=ckpt)
    if checkpoint:
        trainer.save_checkpoint(d / f"{name}-final.ckpt")
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "val": model.val_losses, "steps": trainer.global_step,
            "opt_steps": sorted({float(st["step"]) for st in trainer.optimizers[0].state.values()}),
            "precision": trainer.precision_plugin.precision,
            "strategy": type(trainer.strategy).__name__,
            "path": getattr(getattr(trainer.strategy, "plan", None), "path", "baseline"),
            "warnings": [str(x.message) for x in w if issubclass(x.category, UsbyteWarning)]}


def train_all(rank: int, ws: int, paths: dict[str, str], out: str) -> dict:
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "usbyte-test")   # as torchrun: Lightning joins the group
    d = Path(out)
    DDP = pl.strategies.DDPStrategy
    res = {}
    # (a) the runtime in overlap mode; checkpoints every epoch, then a resume from the first
    res["ref3"] = fit(DDP(), d, "ref3", accum=3, checkpoint=True)
    res["run3"] = fit(UsbyteStrategy(schedule=paths["overlap"], verify=False), d, "run3", accum=3,
                      checkpoint=True)
    res["resumed"] = fit(UsbyteStrategy(schedule=paths["overlap"], verify=False), d, "resumed",
                         accum=3, seed=1, ckpt=str(d / "run3-epoch=0.ckpt"))
    for name in ("ref3", "run3"):
        res[name]["ckpt"] = [v for k, v in torch.load(d / f"{name}-step=2.ckpt")["state_dict"].items()
                             if "running" not in k and "num_batches" not in k]
        ck = torch.load(d / f"{name}-epoch=0.ckpt", weights_only=False)
        res[name]["ckpt_opt"] = [t for st in ck["optimizer_states"][0]["state"].values()
                                 for t in st.values()]
        res[name]["ckpt_lr"] = ck["lr_schedulers"][0]["_last_lr"]
        final = torch.load(d / f"{name}-final.ckpt", weights_only=False)   # trainer.save_checkpoint
        res[name]["final"] = [*final["state_dict"].values(),
                              *(t for st in final["optimizer_states"][0]["state"].values()
                                for t in st.values())]
    # (b) a ddp-tuned schedule by name, from $USBYTE_SCHEDULE
    res["ref2"] = fit(DDP(), d, "ref2", accum=2)
    os.environ[SCHEDULE_ENV] = paths["tuned"]
    from usbyte_opt.formats import load_schedule

    cb = Buckets(load_schedule(paths["tuned"]))
    try:
        res["tuned2"] = fit("usbyte", d, "tuned2", accum=2, callbacks=[cb])
    finally:
        del os.environ[SCHEDULE_ENV]
    res["tuned2"].update(sizes=cb.sizes, check=cb.check,
                         planned=[(b.end - b.start) * 4 for b in cb.schedule.blocks])
    # manual optimization
    # manual optimization; validation every 3 batches: between the passes of an accumulation
    res["ref_manual"] = fit(DDP(), d, "refm", accum=2, manual=True, val_every=3)
    res["run_manual"] = fit(UsbyteStrategy(schedule=paths["overlap"], verify=False), d, "runm",
                            accum=2, manual=True, val_every=3)
    # mixed precision and gradient_clip_val: fp16 with a GradScaler (overflows skipped), and
    # precision="16-mixed" as written (bf16-mixed on CPU)
    for name, strategy in (("ref_fp16", DDP()),
                           ("run_fp16", UsbyteStrategy(schedule=paths["overlap"], verify=False))):
        plugin, norms = fp16_plugin(), Norms()
        res[name] = fit(strategy, d, name, accum=1, plugins=[plugin], callbacks=[norms])
        res[name].update(norms=norms.values, scale=plugin.scaler.get_scale(),
                         plugin_class=type(plugin).__name__)
    res["ref_manual16"] = fit(DDP(), d, "refm16", accum=2, manual=True, plugins=[fp16_plugin()])
    res["run_manual16"] = fit(UsbyteStrategy(schedule=paths["overlap"], verify=False), d, "runm16",
                              accum=2, manual=True, plugins=[fp16_plugin()])
    res["ref_16"] = fit(DDP(), d, "ref16", accum=1, precision="16-mixed")
    res["run_16"] = fit(UsbyteStrategy(schedule=paths["overlap"], verify=False), d, "run16", accum=1,
                        precision="16-mixed")
    # a compiled LightningModule (Lightning compiles its forward and *_step methods one by
    # one): the runtime path as Lightning's DDP, bitwise (its updates run before each step;
    # left to the gates, AdamW's were traced into the compiled step and trained apart)
    compiled = {}
    for name, strategy in (("ref", DDP()), ("run", UsbyteStrategy(schedule=paths["overlap"], verify=False))):
        model = Net(accum=2)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=1, max_epochs=1,
                             accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=1, enable_checkpointing=False, default_root_dir=d)
        train, val = loaders(trainer.world_size, 2)
        trainer.fit(torch.compile(model, backend="eager"), train, val)
        compiled[name] = [*(p.detach().clone() for p in model.parameters()),
                          *(b.detach().clone() for b in model.buffers())]
        compiled[name + "_val"] = model.val_losses
    res["compiled"] = {"diff": max_diff(compiled["ref"], compiled["run"]),
                       "val": compiled["ref_val"] == compiled["run_val"] and len(compiled["run_val"]) == 1}
    # the example's baseline, for the launched run below
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_train

    res["example"] = lightning_train.main(["--size", "tiny", "--steps", "4", "--baseline"])
    return res


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lightning")
    paths = schedules(d)
    rs = run_local(train_all, 2, args=(paths, str(d)), timeout_s=300)
    for r in rs:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in rs]


def test_runtime_in_overlap_mode_trains_like_lightnings_ddp(runs):
    for _rank, v in enumerate(runs):
        ref, run = v["ref3"], v["run3"]
        assert run["strategy"] == "UsbyteStrategy" and run["path"] == "runtime"
        assert ref["steps"] == run["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert max_diff(ref["params"], run["params"]) == 0.0
        # every rank's own statistics, and validation (run under DDP's buffer rule), as DDP's
        assert max_diff(ref["buffers"], run["buffers"]) == 0.0
        assert ref["val"] == run["val"] and len(run["val"]) == 2 * EPOCHS  # updates applied first
    assert max_diff(runs[0]["run3"]["params"], runs[1]["run3"]["params"]) == 0.0


def test_a_compiled_lightning_module_trains_like_lightnings_ddp(runs):
    for v in runs:
        assert v["compiled"] == {"diff": 0.0, "val": True}, v["compiled"]


def test_checkpoint_holds_the_updated_weights_and_resume_equals_the_uninterrupted_run(runs):
    for _rank, v in enumerate(runs):
        assert max_diff(v["ref3"]["ckpt"], v["run3"]["ckpt"]) == 0.0   # pending updates applied
        # the wrapped optimizer's own format: the same AdamW state as under DDP
        assert len(v["run3"]["ckpt_opt"]) == 3 * len(v["run3"]["params"])
        assert max_diff(v["ref3"]["ckpt_opt"], v["run3"]["ckpt_opt"]) == 0.0
        assert v["ref3"]["ckpt_lr"] == v["run3"]["ckpt_lr"] != [1e-2]
        assert max_diff(v["ref3"]["final"], v["run3"]["final"]) == 0.0   # buffers included
        assert v["resumed"]["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert max_diff(v["resumed"]["params"], v["run3"]["params"]) == 0.0
        assert max_diff(v["resumed"]["params"], v["ref3"]["params"]) == 0.0


def test_ddp_tuned_schedule_by_name_runs_lightnings_ddp_with_the_planned_buckets(runs):
    for v in runs:
        ref, tuned = v["ref2"], v["tuned2"]
        assert tuned["strategy"] == "UsbyteStrategy" and tuned["path"] == "ddp"
        assert len(tuned["planned"]) >= 3
        assert tuned["sizes"] == tuned["planned"], (tuned["sizes"], tuned["planned"])
        assert tuned["check"] == "" and tuned["warnings"] == []
        assert ref["steps"] == tuned["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert max_diff(ref["params"], tuned["params"]) == 0.0


def test_manual_optimization_and_validation_inside_an_accumulation_train_like_lightnings_ddp(runs):
    for _rank, v in enumerate(runs):
        ref, run = v["ref_manual"], v["run_manual"]
        assert run["path"] == "runtime" and ref["steps"] == run["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert max_diff(ref["params"], run["params"]) == 0.0
        assert max_diff(ref["buffers"], run["buffers"]) == 0.0   # every rank's, as DDP's
        assert ref["val"] == run["val"] and len(run["val"]) == 2 * 2 * EPOCHS


def test_fp16_with_gradient_clipping_and_overflows_trains_like_lightnings_ddp(runs):
    steps = EPOCHS * STEPS_PER_EPOCH
    for _rank, v in enumerate(runs):
        ref, run = v["ref_fp16"], v["run_fp16"]
        assert run["path"] == "runtime" and ref["precision"] == run["precision"] == "16-mixed"
        assert ref["steps"] == run["steps"] == steps
        # the first steps overflowed: GradScaler skipped them, under DDP and the runtime alike
        assert ref["opt_steps"] == run["opt_steps"] and 0 < run["opt_steps"][0] < steps - 1
        assert not math.isfinite(run["norms"][0]) and ref["scale"] == run["scale"] < 2.0 ** 40
        # unscaled before the hooks and the clipping, as under DDP (bitwise), and clipped
        assert len(run["norms"]) == steps and repr(ref["norms"]) == repr(run["norms"])
        assert any(1.0 < n < math.inf for n in run["norms"])
        assert max_diff(ref["params"], run["params"]) == 0.0
        assert max_diff(ref["buffers"], run["buffers"]) == 0.0   # every rank's, as DDP's
        assert run["plugin_class"] == "MixedPrecision"     # Lightning's plugin, put back


def test_fp16_with_manual_optimization_and_clip_gradients_trains_like_lightnings_ddp(runs):
    for v in runs:
        ref, run = v["ref_manual16"], v["run_manual16"]
        assert run["path"] == "runtime" and ref["steps"] == run["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert ref["opt_steps"] == run["opt_steps"] and run["opt_steps"][0] < ref["steps"]
        assert max_diff(ref["params"], run["params"]) == 0.0


def test_precision_16_mixed_as_written_with_gradient_clipping_trains_like_lightnings_ddp(runs):
    for _rank, v in enumerate(runs):
        ref, run = v["ref_16"], v["run_16"]
        assert run["path"] == "runtime"
        assert ref["precision"] == run["precision"] == "bf16-mixed"   # Lightning's choice on CPU
        assert ref["steps"] == run["steps"] == EPOCHS * STEPS_PER_EPOCH
        assert max_diff(ref["params"], run["params"]) == 0.0
        assert max_diff(ref["buffers"], run["buffers"]) == 0.0   # every rank's, as DDP's


def test_the_fp16_plugin_judges_the_optimizer_the_runtime_wraps(pg):
    """On the runtime path the plugin clips a plain optimizer's gradients and refuses a fused
    one's with Lightning's own message, naming it as under DDP."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from usbyte_opt.integrations.lightning import _runtime_precision
    from usbyte_opt.runtime import DistributedOptimizer, default_schedule

    plugin = fp16_plugin()
    plugin.__class__ = _runtime_precision(MixedPrecision)
    opts = []
    for fused in (False, True):
        model = nn.Linear(4, 3)
        opts.append(DistributedOptimizer(torch.optim.AdamW(model.parameters(), fused=fused), model,
                                         schedule=default_schedule(model), verify=False))
        for p in model.parameters():
            p.grad = torch.full_like(p, 10.0)
    try:
        plugin.clip_gradients(opts[0], 1.0)
        grads = [p.grad for p in opts[0].optimizer.param_groups[0]["params"]]
        assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item() == \
            pytest.approx(1.0, rel=1e-5)
        with pytest.raises(RuntimeError, match=r"optimizer, AdamW, does not allow for gradient clipping"):
            plugin.clip_gradients(opts[1], 1.0)
        plugin.clip_gradients(opts[1], 0.0)     # no clipping asked: nothing refused
    finally:
        for o in opts:
            o.close()


def test_bad_options_are_refused_in_one_line(tmp_path):
    with pytest.raises(UsbyteError, match="runtime option 'bogus'"):
        UsbyteStrategy(bogus=1)
    with pytest.raises(UsbyteError, match="wait_in_backward=False"):
        UsbyteStrategy(wait_in_backward=False)
    with pytest.raises(UsbyteError, match="the schedule gives the buckets"):
        UsbyteStrategy(ddp_kwargs={"bucket_cap_mb": 25})
    with pytest.raises(UsbyteError, match="nope.json"):
        UsbyteStrategy(schedule=str(tmp_path / "nope.json"))
    assert "usbyte" in pl.strategies.StrategyRegistry.available_strategies()


@pytest.mark.slow
def test_example_under_usbyte_opt_launch_writes_its_report(runs, tmp_path):
    """(Slow, as the other trainers' examples under launch: the default run trains Lightning
    on both paths in-process.)"""
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_train

    pb = Problem.from_profile(profile_from_model(lightning_train.CNN("tiny"), 2))
    lay = pb.layout()
    sched = tmp_path / "tiny.json"
    save_schedule(dataclasses.replace(pb.schedule("test", lay, split_blocks(pb, lay, 2)),
                                      mode="overlap"), sched)
    report = tmp_path / "report.json"
    res = subprocess.run(
        [sys.executable, "-m", "usbyte_opt", "launch", "--schedule", str(sched),
         "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(ROOT / "examples" / "lightning_train.py"),
         "--size", "tiny", "--steps", "4", "--report", str(report)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}"
    r = json.loads(report.read_text())
    assert r["trainer"] == "lightning" and r["path"] == "runtime" and r["steps"] == 4
    assert r["schedule"] == str(sched.resolve()) or r["schedule"] == str(sched)
    assert len(r["ms_per_step"]) == 2 and all(t > 0 for t in r["ms_per_step"])
    assert r["median_ms"] > 0
    base = runs[0]["example"]
    assert base["path"] == "baseline" and base["steps"] == 4
    assert r["param_checksum"] == base["param_checksum"]   # the same training as Lightning's DDP
    assert "lightning (runtime): 4 steps" in res.stdout
    assert "usbyte-opt (Lightning): the usbyte-opt runtime, " in res.stderr
