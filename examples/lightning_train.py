"""Train a CNN with BatchNorm in Lightning: Lightning's own DDP, or usbyte-opt's strategy.

The LightningModule is plain Lightning; only the strategy differs. ``build`` (the profiler's
factory) builds the ``--size bench`` model, so the runs that use its schedule pass
``--size bench`` (a schedule given to another size stops with an error that names both). On
two CPU ranks, from the repository root::

    PYTHONPATH=examples usbyte-opt profile lightning_train:build --nproc-per-node 2 --device cpu -o profiles/pl.json
    usbyte-opt optimize profiles/pl.json --mode fence -o schedules/pl.json             # the usbyte-opt runtime
    usbyte-opt optimize profiles/pl.json --strategy ddp-tuned -o schedules/pl-ddp.json # Lightning DDP, planned buckets
    usbyte-opt launch --schedule schedules/pl.json --nproc-per-node 2 examples/lightning_train.py --size bench
    torchrun --nproc-per-node 2 examples/lightning_train.py --size bench --baseline   # Lightning's DDP as it is

``--schedule`` overrides ``$USBYTE_SCHEDULE`` (which ``usbyte-opt launch`` sets). Every rank
starts from the same seeded weights and trains on its share (Lightning's distributed sampler)
of one seeded synthetic data set, so the baseline and the usbyte-opt runs end with the same
parameters. Rank 0 prints one summary line and, with ``--report PATH``, writes the JSON report
(per-step wall time after two warm-up steps, the slowest rank's; the sum of all parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

CLASSES = 10
#: Model and per-rank batch of each size: tiny runs in seconds on a CPU; bench has ~2.2 M
#: parameters and an iteration of ~100-300 ms on two CPU ranks.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"channels": (8, 16), "hidden": 32, "image": 8, "batch": 8},
    "bench": {"channels": (32, 64, 128), "hidden": 1024, "image": 32, "batch": 32},
}
WARMUP = 2


class CNN(pl.LightningModule):
    """Conv + BatchNorm + ReLU + max-pool blocks, then two linear layers; AdamW."""

    def __init__(self, size: str = "bench", lr: float = 1e-3):
        super().__init__()
        cfg = SIZES[size]
        layers: list[nn.Module] = []
        c_in, side = 3, cfg["image"]
        for c in cfg["channels"]:
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
            c_in, side = c, side // 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c_in * side * side, cfg["hidden"]), nn.ReLU(),
                                  nn.Linear(cfg["hidden"], CLASSES))
        self.lr = lr
        # How usbyte-opt names this model in a profile and in errors (the size is what differs).
        self.usbyte_model_name = f"lightning_train CNN --size {size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def build(batch_size: int):
    """The profiler's factory (``usbyte-opt profile lightning_train:build``): the ``bench``
    LightningModule itself, whose parameter names are the ones the strategy trains, and the
    AdamW of its ``configure_optimizers`` (whose step the profiler times)."""
    from usbyte_opt.models import RandomTargetLoss

    torch.manual_seed(0)
    model = CNN("bench")
    side = SIZES["bench"]["image"]
    x = torch.randn(batch_size, 3, side, side, generator=torch.Generator().manual_seed(1))
    return model, (x,), RandomTargetLoss(CLASSES, (batch_size,)), model.configure_optimizers()


class StepTimer(pl.Callback):
    """The wall time of each optimizer step (between two consecutive ones)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.stamps = [time.perf_counter()]
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            self.step = trainer.global_step
            self.stamps.append(time.perf_counter())

    def ms(self) -> list[float]:
        return [1000.0 * (b - a) for a, b in zip(self.stamps, self.stamps[1:])]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default=os.environ.get("USBYTE_SCHEDULE"),
                    help="schedule file or 'auto' (default: $USBYTE_SCHEDULE)")
    ap.add_argument("--baseline", action="store_true",
                    help="Lightning's own DDPStrategy, no usbyte-opt at all")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    ap.add_argument("--accum", type=int, default=1, help="accumulate_grad_batches (default: 1)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient_clip_val (default: 1.0; 0: no clipping)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size (default: tiny)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 0.001)")
    ap.add_argument("--no-verify", action="store_true",
                    help="runtime path: keep the schedule without timing it against DDP's "
                         "buckets first")
    ap.add_argument("--report", metavar="PATH", help="rank 0 writes the JSON report here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the arguments say; returns the report (on every rank)."""
    a = parse(argv)
    if a.steps <= WARMUP:
        sys.exit(f"--steps: expected more than the {WARMUP} warm-up steps, got {a.steps}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    if a.baseline:
        strategy: Any = pl.strategies.DDPStrategy()
    else:
        from usbyte_opt.integrations.lightning import UsbyteStrategy

        strategy = UsbyteStrategy(schedule=a.schedule, **({"verify": False} if a.no_verify else {}))

    torch.manual_seed(0)
    model = CNN(a.size, a.lr)
    cfg = SIZES[a.size]
    n = world * cfg["batch"] * a.accum * a.steps
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, cfg["image"], cfg["image"], generator=g),
                                          torch.randint(0, CLASSES, (n,), generator=g))
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=local,
        num_nodes=max(1, world // local), max_steps=a.steps, accumulate_grad_batches=a.accum,
        gradient_clip_val=a.clip or None, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=[timer])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=cfg["batch"]))

    ms = torch.tensor(timer.ms()[WARMUP:], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)   # the slowest rank's time of each step
    path = "baseline" if a.baseline else strategy.plan.path
    report = {"trainer": "lightning", "path": path, "steps": trainer.global_step,
              "ms_per_step": [round(v, 3) for v in ms.tolist()],
              "median_ms": round(statistics.median(ms.tolist()), 3) if len(ms) else None,
              "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
              "size": a.size, "accum": a.accum, "clip": a.clip, "world_size": world,
              "schedule": None if a.baseline else strategy.plan.source}
    if trainer.is_global_zero:
        if a.report:
            with open(a.report, "w") as f:
                json.dump(report, f, indent=1)
        print(f"lightning ({path}): {report['steps']} steps, median {report['median_ms']} ms/step "
              f"(world size {world}, size {a.size}), param checksum {report['param_checksum']:.9g}",
              flush=True)
    return report


if __name__ == "__main__":
    main()
