"""Train a CNN with BatchNorm in a Hugging Face Accelerate loop, with usbyte-opt or without.

The loop is the one Accelerate's docs show (``accelerator.accumulate``,
``accelerator.backward``, ``accelerator.clip_grad_norm_``, a prepared DataLoader and LR
scheduler); the one usbyte-opt line is ``prepare(accelerator, model, optimizer)`` in place of
``accelerator.prepare(model, optimizer)``. The schedule decides the path: a ``ddp-tuned``
schedule runs Accelerate's own DDP with the planned buckets, any other the usbyte-opt
runtime. ``build`` (the profiler's factory) builds the ``--size bench`` model, so the runs that
use its schedule pass ``--size bench`` (a schedule given to another size stops with an error
that names both). On two CPU ranks, from the repository root::

    PYTHONPATH=examples usbyte-opt profile accelerate_train:build --nproc-per-node 2 --device cpu -o profiles/acc.json
    usbyte-opt optimize profiles/acc.json --mode fence -o schedules/acc.json               # the runtime
    usbyte-opt optimize profiles/acc.json --strategy ddp-tuned -o schedules/acc-ddp.json   # stock DDP
    usbyte-opt launch --schedule schedules/acc.json --nproc-per-node 2 examples/accelerate_train.py --size bench
    torchrun --nproc-per-node 2 examples/accelerate_train.py --size bench --baseline       # Accelerate's DDP

(Accelerate's docs start scripts with ``accelerate launch``, which on GPUs runs torchrun;
``torchrun`` and ``usbyte-opt launch`` start them alike, with ``--schedule`` or
``$USBYTE_SCHEDULE``.) Rank 0 prints one summary line and, with ``--report PATH``, writes the
measurements as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

#: (channels, hidden units, image side) per size: tiny runs in seconds on a CPU; bench
#: (4.2 M parameters, most in fc1) takes 0.1-0.3 s an iteration on two CPU ranks.
SIZES = {"tiny": (8, 32, 8), "bench": (32, 1024, 32)}
CLASSES = 10
BATCH = {"tiny": 4, "bench": 8}
LR = 1e-3


class Net(nn.Module):
    """Three conv + BatchNorm layers and two linear ones."""

    def __init__(self, channels: int, hidden: int, side: int):
        super().__init__()
        c = channels
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c)
        self.fc1 = nn.Linear(2 * c * (side // 4) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(size: str) -> Net:
    """The model of ``size``, seeded: every run starts from the same weights."""
    torch.manual_seed(0)
    net = Net(*SIZES[size])
    net.usbyte_model_name = f"accelerate_train Net --size {size}"  # how usbyte-opt names it (profile, errors)
    return net


def build(batch_size: int | None = None):
    """The ``--size bench`` model for ``usbyte-opt profile accelerate_train:build`` (the
    profiler's factory protocol): ``(model, inputs, loss_fn, optimizer)``, the optimizer the
    loop's (AdamW), whose step the profiler times."""
    batch_size = batch_size or BATCH["bench"]
    model = make_model("bench")
    side = SIZES["bench"][2]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, 3, side, side, generator=g)
    y = torch.randint(0, CLASSES, (batch_size,), generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y.to(out.device))

    return model, (x,), loss_fn, torch.optim.AdamW(model.parameters(), lr=LR)


def dataset(size: str, samples: int) -> torch.utils.data.TensorDataset:
    """Seeded synthetic images and labels."""
    side = SIZES[size][2]
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(samples, 3, side, side, generator=g),
                                          torch.randint(0, CLASSES, (samples,), generator=g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default=os.environ.get("USBYTE_SCHEDULE"),
                    help="schedule file or 'auto' (default: $USBYTE_SCHEDULE)")
    ap.add_argument("--baseline", action="store_true",
                    help="Accelerate's own DDP, no usbyte-opt at all")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation (default: 1)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (default: 1.0)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size (default: tiny)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-rank batch size")
    ap.add_argument("--no-verify", action="store_true",
                    help="runtime path: run the schedule as given, without timing it against DDP's buckets")
    ap.add_argument("--report", help="rank 0 writes the measurements here (JSON)")
    a = ap.parse_args()

    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    # Accelerate picks the device from LOCAL_RANK and initialises the process group (nccl on
    # GPUs, gloo on CPUs) from torchrun's variables.
    accelerator = Accelerator(cpu=not cuda, gradient_accumulation_steps=a.accum)
    batch = a.batch_size or BATCH[a.size]
    model = make_model(a.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    if a.baseline:
        path = "baseline"
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        from usbyte_opt.integrations.accelerate import prepare, runtime_optimizer

        model, optimizer = prepare(accelerator, model, optimizer, schedule=a.schedule,
                                   **({"verify": False} if a.no_verify else {}))
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        # "single": one process, nothing to all-reduce (prepare() is then Accelerate's own)
        path = "runtime" if runtime_optimizer(optimizer) is not None else "ddp" if ddp else "single"
    samples = batch * a.accum * a.steps * accelerator.num_processes
    loader = torch.utils.data.DataLoader(dataset(a.size, samples), batch_size=batch)
    loader, scheduler = accelerator.prepare(loader, scheduler)

    stamps: list[float] = []
    losses = []
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and a.clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), a.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(loss.detach())
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
    if not a.baseline:
        from usbyte_opt.integrations.accelerate import synchronize

        synchronize(optimizer)       # every update applied before the checksum
    net = accelerator.unwrap_model(model)
    checksum = float(sum(p.detach().double().sum().item() for p in net.parameters()))
    # per optimizer step, after 2 warm-up steps; the slowest rank's time
    ms = [(e - s) * 1e3 for s, e in zip(stamps[1:], stamps[2:])]
    t = torch.tensor(ms or [0.0], dtype=torch.float64, device=accelerator.device)
    ms = accelerator.reduce(t, reduction="max").tolist() if ms else []
    median = statistics.median(ms) if ms else 0.0
    if accelerator.is_main_process:
        if a.report:
            with open(a.report, "w") as f:
                json.dump({"trainer": "accelerate", "path": path, "steps": len(stamps),
                           "ms_per_step": ms, "median_ms": median, "param_checksum": checksum}, f)
        print(f"accelerate {path}: {len(stamps)} steps, median {median:.2f} ms/step after 2 "
              f"warm-up steps, world size {accelerator.num_processes}, final loss "
              f"{losses[-1].item():.4f}, param checksum {checksum:.6f}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
