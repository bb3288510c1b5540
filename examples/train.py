"""Train a small CNN or transformer on synthetic data with DDP or the usbyte-opt runtime.

Runs under torchrun / ``usbyte-opt launch`` (one process per rank), or alone as world size 1::

    # a schedule for the model (here the default DDP-like plan; `usbyte-opt optimize` makes better)
    python examples/train.py --model cnn --write-schedule schedules/cnn.json
    # the same training, side by side
    torchrun --nproc-per-node 2 examples/train.py --model cnn --mode ddp
    usbyte-opt launch --schedule schedules/cnn.json --nproc-per-node 2 \\
        examples/train.py --model cnn --mode usbyte

Rank 0 prints one line per iteration (wall time of forward + backward + step, loss) and the
median at the end. ``--schedule`` overrides ``$USBYTE_SCHEDULE``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def cnn(num_classes: int = 10) -> nn.Module:
    """A small ResNet-like CNN for 3x32x32 images (about 0.3 M parameters)."""
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True))
    return nn.Sequential(block(3, 32), block(32, 32), nn.MaxPool2d(2), block(32, 64),
                         block(64, 64), nn.MaxPool2d(2), block(64, 128), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(128, 128), nn.ReLU(inplace=True),
                         nn.Linear(128, num_classes))


class TinyGPT(nn.Module):
    """A small decoder-only transformer: tied embeddings, learned positions (about 1 M params)."""

    def __init__(self, vocab: int = 2000, dim: int = 128, layers: int = 4, heads: int = 4,
                 seq: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        h = self.tok(idx) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


MODELS = {"cnn": cnn, "transformer": TinyGPT}


def batch(model: str, size: int, step: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    if model == "cnn":
        x, y = torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)
    else:
        tokens = torch.randint(0, 2000, (size, 65), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x.to(device), y.to(device)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="cnn")
    ap.add_argument("--mode", choices=["ddp", "usbyte"], default="usbyte")
    ap.add_argument("--schedule", help="schedule file (default: $USBYTE_SCHEDULE, else a default plan)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the median")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--write-schedule", metavar="PATH",
                    help="write the default plan for --model to PATH and exit")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = MODELS[a.model]()
    if a.write_schedule:
        from usbyte_opt.formats import save_schedule
        from usbyte_opt.runtime import default_schedule

        ws = int(os.environ.get("WORLD_SIZE", "2"))
        print(f"wrote {save_schedule(default_schedule(model, ws), a.write_schedule)}")
        return

    # Set up: one process per rank (torchrun), or world size 1 on its own.
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    model = model.to(device)

    # Build: the only difference between the two modes.
    if a.mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=a.lr)
    else:
        from usbyte_opt.runtime import DistributedOptimizer

        net = model
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=a.lr), model,
                                   schedule=a.schedule)

    # Run.
    times = []
    for step in range(a.steps):
        x, y = batch(a.model, a.batch_size, step, rank, device)
        t0 = time.perf_counter()
        loss = loss_of(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if rank == 0:
            print(f"iter {step:4d}  {dt:8.2f} ms  loss {loss.item():.4f}", flush=True)
    if a.mode == "usbyte":
        opt.synchronize()
    if rank == 0:
        kept = times[a.warmup:] or times
        print(f"{a.mode} {a.model}: median {statistics.median(kept):.2f} ms/iter over "
              f"{len(kept)} iterations, world size {dist.get_world_size()}")

    # Tear down.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
