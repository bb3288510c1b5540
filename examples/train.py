"""Train a model on synthetic data with PyTorch DDP or the usbyte-opt runtime.

``--model`` takes exactly what ``usbyte-opt profile`` takes (the same registry,
:mod:`usbyte_opt.models`): a built-in name (``cnn``, ``transformer``, ``mlp``, ``resnet50``,
``vgg16``, ...) or ``package.module:factory``. So the model trained here is the model that
was profiled, and its schedule fits it. The three steps, on two CPU ranks::

    usbyte-opt profile cnn --nproc-per-node 2 --device cpu -o profiles/mine.json
    usbyte-opt optimize profiles/mine.json -o schedules/mine.json
    usbyte-opt launch --schedule schedules/mine.json --nproc-per-node 2 examples/train.py --model cnn

and the same training with PyTorch DDP, for comparison::

    torchrun --nproc-per-node 2 examples/train.py --model cnn --mode ddp

It also runs alone (world size 1). Every rank trains on its own synthetic batches, shaped
like the factory's inputs; the loss is the factory's. Rank 0 prints one line per iteration
(wall time of forward + backward + step, loss) and the median at the end. ``--schedule``
overrides ``$USBYTE_SCHEDULE`` (which ``usbyte-opt launch`` sets); without either the
runtime uses its default DDP-like plan, which ``--write-schedule PATH`` writes out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from usbyte_opt.models import build, make_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="cnn",
                    help="built-in name or package.module:factory, as for `usbyte-opt profile` "
                         "(default: cnn)")
    ap.add_argument("--mode", choices=["ddp", "usbyte"], default="usbyte",
                    help="PyTorch DDP, or the usbyte-opt runtime (default: usbyte)")
    ap.add_argument("--schedule", help="schedule file (default: $USBYTE_SCHEDULE, else a default plan)")
    ap.add_argument("--steps", type=int, default=30, help="training iterations (default: 30)")
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the median (default: 5)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="per-rank batch size (default: the model's own, as for `usbyte-opt profile`)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 0.001)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--write-schedule", metavar="PATH",
                    help="write the runtime's default plan for --model to PATH and exit")
    a = ap.parse_args()

    # Set up: one process per rank (torchrun), or world size 1 on its own.
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model, inputs, loss_fn = build(a.model, a.batch_size, device)
    if a.write_schedule:
        from usbyte_opt.formats import save_schedule
        from usbyte_opt.runtime import default_schedule

        ws = int(os.environ.get("WORLD_SIZE", "2"))
        print(f"wrote {save_schedule(default_schedule(model, ws), a.write_schedule)}")
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    data = make_batches(inputs, rank)

    # Build: the only difference between the two modes.
    if a.mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=a.lr)
    else:
        from usbyte_opt.runtime import DistributedOptimizer

        net = model
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=a.lr), model,
                                   schedule=a.schedule)

    # Run. An iteration's time is from its start to the next one's. On a GPU the stamps are
    # CUDA events and losses stay on the device until the end: a host synchronize per
    # iteration would wait for the all-reduce too, and take away the runtime's overlap.
    cuda = device.type == "cuda"
    stamps, losses = [], []
    for step in range(a.steps + 1):
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            stamps.append(ev)
        else:
            stamps.append(time.perf_counter())
        if step == a.steps:
            break
        x = data[step % len(data)]
        loss = loss_fn(net(*x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if rank == 0 and not cuda:
            print(f"iter {step:4d}  {(time.perf_counter() - stamps[-1]) * 1e3:8.2f} ms  "
                  f"loss {loss.item():.4f}", flush=True)
    if a.mode == "usbyte":
        opt.synchronize()
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(stamps, stamps[1:])]
        if rank == 0:
            for step, (dt, loss) in enumerate(zip(times, losses)):
                print(f"iter {step:4d}  {dt:8.2f} ms  loss {loss.item():.4f}")
    else:
        times = [(e - s) * 1e3 for s, e in zip(stamps, stamps[1:])]
    if rank == 0:
        kept = times[a.warmup:] or times
        print(f"{a.mode} {a.model}: median {statistics.median(kept):.2f} ms/iter over "
              f"{len(kept)} iterations, world size {dist.get_world_size()}")

    # Tear down.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
