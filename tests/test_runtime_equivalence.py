"""Training with DistributedOptimizer gives the parameters of plain data parallelism (DDP).

Two gloo ranks run every case in one spawned run (process start-up dominates on a small
machine); each case trains the same model twice side by side, once under
``DistributedDataParallel`` and once under the runtime, on rank-dependent data, and reports
the largest absolute difference of any parameter (and, where it matters, buffer, eval output
or GradScaler scale) after ``synchronize()``. Tolerance: 1e-5 in fp32 (the runs agree
bitwise in practice: DDP also pre-divides by the world size and sums).
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt.env import SCHEDULE_ENV
from usbyte_opt.formats import Block, Schedule, save_schedule
from usbyte_opt.launcher import run_local
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks
from usbyte_opt.runtime import DistributedOptimizer, UsbyteWarning
from usbyte_opt.runtime.default_plan import (
    default_schedule,
    profile_from_model,
    split_blocks,
)

STEPS = 12
TOL = 1e-5

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Unused(nn.Module):
    """``never`` is used by no rank; ``sometimes`` depends on rank and step."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.sometimes = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x, use: bool):
        h = F.relu(self.a(x))
        if use:
            h = h + self.sometimes(h)
        return self.out(h)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        for p in self.stem.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(F.relu(self.mid(F.relu(self.stem(x)))))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx)))).mean(1)


class Block_(nn.Module):
    """A non-leaf module that uses its own parameter directly."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(6))
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x) * self.gamma


class Parent(nn.Module):
    """Root-owned parameter, a non-leaf owner, and a child used without its own forward."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((6,), 0.5))
        self.block = Block_()
        self.proj = nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.block(x * self.scale))
        return F.linear(h, self.proj.weight, self.proj.bias)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.fc(F.relu(self.inp(x))))
        return self.out(F.relu(self.fc(h)))


class Mixed(nn.Module):
    """fp32 and bf16 parameters: two flat buffers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.a(x)).to(torch.bfloat16)
        return self.c(F.relu(self.b(h)).float())


class TinyGPT(nn.Module):
    """nn.TransformerEncoderLayer blocks (MultiheadAttention reads ``out_proj.weight`` without
    calling ``out_proj``; eval under no_grad may take the fused fast path), tied embeddings and
    a root-owned position table."""

    def __init__(self, vocab: int = 40, dim: int = 16, seq: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]]))


# --------------------------------------------------------------------------------------------
# Data, schedules, optimizers
# --------------------------------------------------------------------------------------------


def image_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 5, generator=g)


def vec_batch(rank: int, step: int, dim: int = 6, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(5, dim, generator=g), torch.randn(5, out, generator=g)


def problem_of(model: nn.Module, world_size: int = 2) -> Problem:
    return Problem.from_profile(profile_from_model(model, world_size))


def sched_default(model: nn.Module, ws: int = 2) -> Schedule:
    return default_schedule(model, ws)


def sched_wfbp(model: nn.Module, ws: int = 2) -> Schedule:
    """One block per tensor, in ready order."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    return pb.schedule("wfbp-like", lay, [lay.whole(i) for i in pb.ready_order()])


def sched_split_forward(model: nn.Module, ws: int = 2) -> Schedule:
    """Every tensor in three blocks, issued in forward (need) order."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    return pb.schedule("split-forward", lay, split_blocks(pb, lay, 3, pb.need_order()))


def sched_two_phase(model: nn.Module, ws: int = 2) -> Schedule:
    """US-Byte's shape: the first part of each tensor in ready order, the rest in forward
    order (each tensor's remainder one block)."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    first, rest = [], {}
    for i in pb.ready_order():
        b, s, e = lay.pos[i]
        cut = s + max(1, (e - s) // 3) if e - s > 1 else e
        first.append(Block(b, s, cut))
        if cut < e:
            rest[i] = Block(b, cut, e)
    second = [rest[i] for i in pb.need_order() if i in rest]
    return pb.schedule("two-phase", lay, first + second)


def sched_fuse(model: nn.Module, ws: int = 2) -> Schedule:
    """Neighbours fused: DDP-style buckets with tiny caps (2 KiB first, then 8 KiB)."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    return pb.schedule("fuse", lay, bucket_blocks(pb, lay, first_bucket_bytes=2048,
                                                bucket_cap_bytes=8192))


def sched_crosscut(model: nn.Module, ws: int = 2) -> Schedule:
    """Blocks cut without regard to tensor boundaries (fusing parts of neighbours), issued in
    a scrambled order."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    blocks = []
    for b, n in enumerate(lay.numel):
        cuts = sorted({0, n, *(n * j // 7 + j for j in range(1, 7) if n * j // 7 + j < n)})
        blocks += [Block(b, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    order = blocks[1::2] + blocks[::2][::-1]
    return pb.schedule("crosscut", lay, order)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "default": sched_default, "wfbp": sched_wfbp, "split_forward": sched_split_forward,
    "two_phase": sched_two_phase, "fuse": sched_fuse, "crosscut": sched_crosscut,
}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_wd": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def max_diff(a: nn.Module, b: nn.Module, buffers: bool = False) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    d = max((pa[n].detach().float() - pb[n].detach().float()).abs().max().item() for n in pa)
    if buffers:
        ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
        for n in ba:
            d = max(d, (ba[n].double() - bb[n].double()).abs().max().item())
    return d


def twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    m = make()
    return copy.deepcopy(m), copy.deepcopy(m)


# --------------------------------------------------------------------------------------------
# Cases: each returns {"diff": float, ...}
# --------------------------------------------------------------------------------------------


def run_plain(make: Callable[[], nn.Module], opt: Callable, schedule: Callable | None,
              batch: Callable[[int, int], tuple], loss_fn: Callable, rank: int, ws: int,
              ddp_kwargs: dict | None = None, usb_kwargs: dict | None = None,
              forward: Callable | None = None, set_to_none: bool = True) -> dict:
    """The usual loop, DDP and runtime side by side."""
    ref, mod = twins(make)
    ddp = DDP(ref, **(ddp_kwargs or {}))
    o_ref = opt(ref.parameters())
    kw = {"verify": False, **(usb_kwargs or {})}  # the schedule under test, every step
    if schedule is not None:
        kw["schedule"] = schedule(mod, ws)
    o_usb = DistributedOptimizer(opt(mod.parameters()), mod, **kw)
    fwd = forward or (lambda m, x, step: m(x))
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss_fn(fwd(ddp, x, step), y).backward()
        o_ref.step()
        o_ref.zero_grad(set_to_none=set_to_none)
        loss_fn(fwd(mod, x, step), y).backward()
        o_usb.step()
        o_usb.zero_grad(set_to_none=set_to_none)
    o_usb.synchronize()
    return {"diff": max_diff(ref, mod)}


def mse(out, y):
    return F.mse_loss(out.float(), y)


def case_matrix(opt_name: str, sched_name: str, rank: int, ws: int) -> dict:
    return run_plain(SmallCNN, OPTIMIZERS[opt_name], SCHEDULES[sched_name], image_batch, mse,
                     rank, ws)


def unused_forward(m, x, step):
    use = (step % 2 == 0) if dist.get_rank() == 0 else (step % 3 == 0)  # both off at 1, 5, 7..
    return m(x, use)


def case_unused(rank: int, ws: int) -> dict:
    return run_plain(Unused, OPTIMIZERS["adamw_wd"], sched_two_phase, vec_batch, mse, rank, ws,
                     ddp_kwargs={"find_unused_parameters": True}, forward=unused_forward)


def case_unused_zero_grads(rank: int, ws: int) -> dict:
    """zero_grad(set_to_none=False): tensors that had a gradient keep a zero one and are
    stepped with it (weight decay, momentum), as under DDP."""
    return run_plain(Unused, OPTIMIZERS["adamw_wd"], sched_fuse, vec_batch, mse, rank, ws,
                     ddp_kwargs={"find_unused_parameters": True}, forward=unused_forward,
                     set_to_none=False)


def case_frozen(rank: int, ws: int) -> dict:
    return run_plain(Frozen, OPTIMIZERS["adamw_wd"], sched_split_forward,
                     lambda r, s: vec_batch(r, s, 6, 3), mse, rank, ws)


def token_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * rank + step)
    return torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 20, generator=g)


def case_tied(rank: int, ws: int) -> dict:
    return run_plain(Tied, OPTIMIZERS["adam"], sched_two_phase, token_batch, mse, rank, ws)


def case_parent(rank: int, ws: int) -> dict:
    return run_plain(Parent, OPTIMIZERS["sgd_momentum"], sched_split_forward, vec_batch, mse,
                     rank, ws)


def case_twice(rank: int, ws: int) -> dict:
    return run_plain(Twice, OPTIMIZERS["adamw_wd"], sched_crosscut,
                     lambda r, s: vec_batch(r, s, 6, 3), mse, rank, ws)


def case_mixed_dtypes(rank: int, ws: int) -> dict:
    return run_plain(Mixed, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                     sched_two_phase, vec_batch, mse, rank, ws)


def case_batchnorm(rank: int, ws: int) -> dict:
    """Parameters, rank 0's running statistics, and an eval output after training."""
    ref, mod = twins(lambda: SmallCNN(bn=True))
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["sgd_momentum"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["sgd_momentum"](mod.parameters()), mod,
                                 schedule=sched_two_phase(mod))
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        mse(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        mse(mod(x), y).backward(); o_usb.step(); o_usb.zero_grad()
    o_usb.synchronize()
    return batchnorm_agreement(ref, mod, ddp, rank, max_diff(ref, mod))


def batchnorm_agreement(ref: nn.Module, mod: nn.Module, ddp: nn.Module, rank: int,
                        diff: float) -> dict[str, Any]:
    """After training a BatchNorm model (``mod.bn``) beside DDP (``ddp`` over ``ref``):
    ``diff`` widened by this rank's buffers (each rank keeps the statistics of its own last
    forward, as under DDP) and by an eval forward (which starts from rank 0's, as DDP's
    does), and whether the buffers equal DDP's bitwise on this rank."""
    out: dict[str, Any] = {"diff": max(diff, max_diff(ref, mod, buffers=True))}
    out["buffers_equal_ddp"] = all(torch.equal(a, b) for a, b in
                                   zip(ref.buffers(), mod.buffers()))
    xe, _ = image_batch(99, 0)
    ddp.eval(); mod.eval()
    with torch.no_grad():
        out["diff"] = max(out["diff"], (ddp(xe) - mod(xe)).abs().max().item())
    out["buffers_equal_ddp_after_eval"] = all(torch.equal(a, b) for a, b in
                                              zip(ref.buffers(), mod.buffers()))
    return out


def case_accumulation(rank: int, ws: int) -> dict:
    """backward_passes_per_step=2 against DDP's no_sync() on the first micro-batch."""
    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adam"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adam"](mod.parameters()), mod,
                                 schedule=sched_split_forward(mod), backward_passes_per_step=2)
    for step in range(STEPS):
        (x1, y1), (x2, y2) = image_batch(rank, 2 * step), image_batch(rank, 2 * step + 1)
        with ddp.no_sync():
            (mse(ddp(x1), y1) / 2).backward()
        (mse(ddp(x2), y2) / 2).backward()
        o_ref.step(); o_ref.zero_grad()
        (mse(mod(x1), y1) / 2).backward()
        (mse(mod(x2), y2) / 2).backward()
        o_usb.step(); o_usb.zero_grad()
    o_usb.synchronize()
    return {"diff": max_diff(ref, mod)}


def case_eval_no_grad(rank: int, ws: int) -> dict:
    """Eval forwards under no_grad right after step(), without synchronize(): they see the
    updated parameters (and rank 0's BatchNorm statistics)."""
    ref, mod = twins(lambda: SmallCNN(bn=True))
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod,
                                 schedule=sched_two_phase(mod))
    xe, _ = image_batch(99, 1)
    worst = 0.0
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        mse(ddp(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        mse(mod(x), y).backward(); o_usb.step(); o_usb.zero_grad()
        ddp.eval(); mod.eval()
        with torch.no_grad():
            worst = max(worst, (ddp(xe) - mod(xe)).abs().max().item())
        ddp.train(); mod.train()
    o_usb.synchronize()
    return {"diff": max(worst, max_diff(ref, mod))}


def case_transformer_eval(rank: int, ws: int) -> dict:
    """Transformer training with an eval forward under no_grad after every step()."""
    ref, mod = twins(TinyGPT)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod,
                                 schedule=sched_two_phase(mod))
    probe = torch.randint(0, 40, (3, 8), generator=torch.Generator().manual_seed(5))
    worst = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        idx, tgt = torch.randint(0, 40, (4, 8), generator=g), torch.randint(0, 40, (4, 8), generator=g)
        for net, o in ((ddp, o_ref), (mod, o_usb)):
            F.cross_entropy(net(idx).reshape(-1, 40), tgt.reshape(-1)).backward()
            o.step()
            o.zero_grad()
        ddp.eval(); mod.eval()
        with torch.no_grad():
            worst = max(worst, (ddp(probe) - mod(probe)).abs().max().item())
        ddp.train(); mod.train()
    o_usb.synchronize()
    return {"diff": max(worst, max_diff(ref, mod))}


def case_checkpoint(rank: int, ws: int) -> dict:
    """Save at step 10 (model, optimizer, LR scheduler), then (a) keep training, (b) load into
    a fresh model and a new DistributedOptimizer, (c) load back into the live one; all three
    must end where DDP does after 20 steps."""
    def sched_of(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s))

    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    s_ref = sched_of(o_ref)
    schedule = sched_split_forward(mod)
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod, schedule=schedule)
    s_usb = sched_of(o_usb)

    def train(m, o, s, steps):
        for step in steps:
            x, y = image_batch(rank, step)
            mse(m(x), y).backward(); o.step(); s.step(); o.zero_grad()

    def save(m, o, s) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()}, buf)
        return buf.getvalue()

    def load(blob: bytes, m, o, s) -> None:
        ck = torch.load(io.BytesIO(blob), weights_only=False)
        m.load_state_dict(ck["model"]); o.load_state_dict(ck["opt"]); s.load_state_dict(ck["sched"])

    train(ddp, o_ref, s_ref, range(10))
    train(mod, o_usb, s_usb, range(10))
    o_usb.synchronize()
    blob = save(mod, o_usb, s_usb)
    train(ddp, o_ref, s_ref, range(10, STEPS))
    train(mod, o_usb, s_usb, range(10, STEPS))
    o_usb.synchronize()
    d_cont = max_diff(ref, mod)
    # (b) a fresh process's view: new model (other init), new optimizer, new wrapper.
    torch.manual_seed(123)
    fresh = SmallCNN()
    o_new = OPTIMIZERS["adamw_wd"](fresh.parameters())
    s_new = sched_of(o_new)
    load(blob, fresh, o_new, s_new)
    o_fresh = DistributedOptimizer(o_new, fresh, schedule=schedule)
    train(fresh, o_fresh, s_new, range(10, STEPS))
    o_fresh.synchronize()
    d_fresh = max_diff(ref, fresh)
    # (c) back into the live wrapper, without synchronize() first (the hooks settle).
    train(mod, o_usb, s_usb, range(3))
    load(blob, mod, o_usb, s_usb)
    train(mod, o_usb, s_usb, range(10, STEPS))
    o_usb.synchronize()
    d_live = max_diff(ref, mod)
    return {"diff": max(d_cont, d_fresh, d_live), "continued": d_cont, "fresh": d_fresh,
            "live": d_live}


def case_lr_scheduler(rank: int, ws: int, on_inner: bool) -> dict:
    """StepLR stepped right after step(): the lazy updates use the LR in force at step()."""
    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["sgd_momentum"](ref.parameters())
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=3, gamma=0.5)
    inner = OPTIMIZERS["sgd_momentum"](mod.parameters())
    o_usb = DistributedOptimizer(inner, mod, schedule=sched_two_phase(mod))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s_usb = torch.optim.lr_scheduler.StepLR(inner if on_inner else o_usb, step_size=3,
                                                gamma=0.5)
        for step in range(STEPS):
            x, y = image_batch(rank, step)
            mse(ddp(x), y).backward(); o_ref.step(); s_ref.step(); o_ref.zero_grad()
            mse(mod(x), y).backward(); o_usb.step(); s_usb.step(); o_usb.zero_grad()
        o_usb.synchronize()
    sched_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return {"diff": max_diff(ref, mod), "lr": inner.param_groups[0]["lr"],
            "lr_ref": o_ref.param_groups[0]["lr"], "warnings": sched_warnings}


def case_bf16_autocast(rank: int, ws: int) -> dict:
    def fwd(m, x, step):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)
    return run_plain(SmallCNN, OPTIMIZERS["adamw_wd"], sched_two_phase, image_batch, mse, rank,
                     ws, forward=fwd)


def case_grad_scaler(rank: int, ws: int) -> dict:
    """GradScaler (CPU flavour; the CUDA one takes the same path): a non-finite gradient on
    rank 1 only at step 5 must skip that step on both ranks, and the scale must follow."""
    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adam"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adam"](mod.parameters()), mod,
                                 schedule=sched_fuse(mod))
    sc_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=4)
    sc_usb = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=4)
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        if step == 5 and rank == 1:
            x = x * float("inf")
        for m, o, sc in ((ddp, o_ref, sc_ref), (mod, o_usb, sc_usb)):
            sc.scale(mse(m(x), y)).backward()
            sc.step(o)
            sc.update()
            o.zero_grad()
    o_usb.synchronize()
    return {"diff": max(max_diff(ref, mod), abs(sc_ref.get_scale() - sc_usb.get_scale())),
            "scale": sc_usb.get_scale(), "scale_ref": sc_ref.get_scale()}


def case_clip(rank: int, ws: int) -> dict:
    """Gradient clipping: synchronize() after backward gives the averaged gradients."""
    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["sgd_momentum"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["sgd_momentum"](mod.parameters()), mod,
                                 schedule=sched_split_forward(mod))
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        mse(ddp(x), y).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        o_ref.step(); o_ref.zero_grad()
        mse(mod(x), y).backward()
        o_usb.synchronize()
        nn.utils.clip_grad_norm_(mod.parameters(), 0.05)
        o_usb.step(); o_usb.zero_grad()
    o_usb.synchronize()
    return {"diff": max_diff(ref, mod)}


def case_world_size_warning(rank: int, ws: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_plain(SmallCNN, OPTIMIZERS["adam"], lambda m, _: sched_wfbp(m, 4), image_batch,
                        mse, rank, ws)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UsbyteWarning)]
    return out


def case_env_schedule(rank: int, ws: int) -> dict:
    """No schedule argument: $USBYTE_SCHEDULE names the file."""
    torch.manual_seed(0)
    path = os.path.join(tempfile.mkdtemp(), "s.json")
    save_schedule(sched_two_phase(SmallCNN()), path)
    os.environ[SCHEDULE_ENV] = path
    try:
        out = run_plain(SmallCNN, OPTIMIZERS["adam"], None, image_batch, mse, rank, ws)
    finally:
        del os.environ[SCHEDULE_ENV]
    return out


def case_default_plan(rank: int, ws: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_plain(SmallCNN, OPTIMIZERS["adam"], None, image_batch, mse, rank, ws)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UsbyteWarning)]
    return out


def case_strategy(name: str, rank: int, ws: int) -> dict:
    """Schedules from the planner's strategies, when registered."""
    try:
        from usbyte_opt.planning import strategies
        strat = strategies.get(name)
    except Exception as e:  # noqa: BLE001 - the strategy is not there (yet)
        return {"skip": f"strategy {name!r} unavailable: {e}"}

    def make_sched(m, w):
        pb = problem_of(m, w)
        plan = strat.plan(pb)
        return pb.schedule(name, plan.layout, plan.blocks)
    return run_plain(SmallCNN, OPTIMIZERS["adamw_wd"], make_sched, image_batch, mse, rank, ws)


# --------------------------------------------------------------------------------------------
# The loops people write: where and how gradients are zeroed, accumulation, clipping
# --------------------------------------------------------------------------------------------

LOOP_STEPS = 8


def zero_with(how: str, set_to_none: bool, opt: Any, model: nn.Module) -> None:
    """Zero gradients the way ``how`` says: the optimizer the user holds (for the runtime:
    the DistributedOptimizer), the wrapped optimizer, the model, or ``p.grad = None``."""
    if how == "opt":
        opt.zero_grad(set_to_none=set_to_none)
    elif how == "inner":
        getattr(opt, "optimizer", opt).zero_grad(set_to_none=set_to_none)
    elif how == "model":
        model.zero_grad(set_to_none=set_to_none)
    else:
        for p in model.parameters():
            p.grad = None


def case_loop(how: str, set_to_none: bool, where: str, passes: int, rank: int, ws: int,
              make: Callable[[], nn.Module] = SmallCNN, schedule: Callable = sched_two_phase,
              clip: float | None = None, forward: Callable | None = None,
              ddp_kwargs: dict | None = None, batch: Callable | None = None) -> dict:
    """One loop shape, DDP and runtime side by side: zeroing ``how`` (``set_to_none``),
    ``where`` in the loop (``after_step`` or ``before_backward``), ``passes`` backward passes
    per step, optional clipping of the averaged gradients."""
    ref, mod = twins(make)
    ddp = DDP(ref, **(ddp_kwargs or {}))
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod,
                                 schedule=schedule(mod, ws), backward_passes_per_step=passes,
                                 verify=False)
    fwd = forward or (lambda m, x, step: m(x))
    batch = batch or (image_batch if make is SmallCNN else vec_batch)
    for step in range(LOOP_STEPS):
        for net, o, inner in ((ddp, o_ref, ref), (mod, o_usb, mod)):
            if where == "before_backward":
                zero_with(how, set_to_none, o, inner)
            for j in range(passes):
                x, y = batch(rank, passes * step + j)
                last = j == passes - 1
                if net is ddp and not last:
                    with ddp.no_sync():
                        (mse(fwd(net, x, step), y) / passes).backward()
                else:
                    (mse(fwd(net, x, step), y) / passes).backward()
            if clip is not None:
                if net is ddp:
                    nn.utils.clip_grad_norm_(ref.parameters(), clip)
                else:
                    o_usb.clip_grad_norm_(clip)
            o.step()
            if where == "after_step":
                zero_with(how, set_to_none, o, inner)
    o_usb.synchronize()
    return {"diff": max_diff(ref, mod)}


def case_collective_between_backward_and_step(one_in_flight: bool | None, rank: int,
                                              ws: int) -> dict:
    """A parameter only some ranks use, and the user's own all-reduce between backward() and
    step() on the default group: every rank issued all of its step when backward returned, so
    the collectives cannot interleave (with ``one_in_flight=False`` the blocks share the
    default group with the user's all-reduce, as on NCCL)."""
    ref, mod = twins(Unused)
    ddp = DDP(ref, find_unused_parameters=True)
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), mod,
                                 schedule=sched_wfbp(mod, ws), one_in_flight=one_in_flight)
    losses = []
    for step in range(LOOP_STEPS):
        x, y = vec_batch(rank, step)
        for net, o in ((ddp, o_ref), (mod, o_usb)):
            loss = mse(unused_forward(net, x, step), y)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
            o.step()
            o.zero_grad()
    o_usb.synchronize()
    return {"diff": max(max_diff(ref, mod), max(abs(a - b) for a, b in
                                                 zip(losses[::2], losses[1::2])))}


LOOPS: dict[str, Callable[[int, int], dict]] = {}
for _how, _stns in (("opt", (True, False)), ("inner", (True, False)), ("model", (True, False)),
                    ("none_by_hand", (True,))):
    for _stn in _stns:
        for _where in ("after_step", "before_backward"):
            for _k in (1, 3):
                LOOPS[f"loop-{_how}-{'none' if _stn else 'zeros'}-{_where}-k{_k}"] = \
                    (lambda h, n, w, k: lambda r, ws: case_loop(h, n, w, k, r, ws))(
                        _how, _stn, _where, _k)
LOOPS.update({
    # Tensors only some ranks use, zeroed to None by every route (DDP then skips the ones no
    # rank used).
    **{f"loop-unused-{h}-none": (lambda h: lambda r, ws: case_loop(
        h, True, "after_step", 1, r, ws, make=Unused, forward=unused_forward,
        ddp_kwargs={"find_unused_parameters": True}))(h)
       for h in ("opt", "inner", "model", "none_by_hand")},
    "loop-clip": lambda r, ws: case_loop("model", True, "after_step", 1, r, ws, clip=0.05),
    "loop-clip-accumulate": lambda r, ws: case_loop("opt", True, "before_backward", 2, r, ws,
                                                    clip=0.05, schedule=sched_crosscut),
    "loop-channels-last": lambda r, ws: case_loop(
        "opt", True, "after_step", 1, r, ws,
        make=lambda: SmallCNN(bn=True).to(memory_format=torch.channels_last),
        forward=lambda m, x, step: m(x.to(memory_format=torch.channels_last)), batch=image_batch),
    "collective_between_backward_and_step": lambda r, ws:
        case_collective_between_backward_and_step(None, r, ws),
    "collective_between_backward_and_step_same_group": lambda r, ws:
        case_collective_between_backward_and_step(False, r, ws),
})


def sched_aligned(model: nn.Module, ws: int = 2) -> Schedule:
    """Crosscut blocks with their cuts inside tensors moved to 16-byte multiples of the
    tensor's start (what the planner writes for an NCCL profile)."""
    from usbyte_opt.planning.problem import align_cuts

    s = sched_crosscut(model, ws)
    pb = problem_of(model, ws)
    lay = pb.layout(s.buffers)
    return pb.schedule("aligned", lay, align_cuts(lay, s.blocks, 16))


def case_aligned(rank: int, ws: int, schedule: Callable) -> dict:
    """Flat buffers with every tensor on a 16-byte boundary (what CUDA gets); with aligned
    cuts every block starts on one too."""
    out = run_plain(SmallCNN, OPTIMIZERS["adam"], schedule, image_batch, mse, rank, ws,
                    usb_kwargs={"align_bytes": 16})
    torch.manual_seed(0)
    m = SmallCNN()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule(m, ws),
                               verify=False, align_bytes=16)
    g = opt._state.grads
    out["block_offsets_bytes"] = [v.data_ptr() - g.flats[0].data_ptr() for v in g.block_views]
    out["tensor_offsets_bytes"] = [v.data_ptr() - g.flats[0].data_ptr() for v in g.views]
    return out


STRATEGY_NAMES = ("wfbp", "ddp", "mgwfbp", "bytescheduler", "usbyte")

CASES: dict[str, Callable[[int, int], dict]] = {}
for _o in OPTIMIZERS:
    for _s in SCHEDULES:
        CASES[f"{_o}-{_s}"] = (lambda o, s: lambda r, w: case_matrix(o, s, r, w))(_o, _s)
CASES.update({
    "unused": case_unused,
    "unused_zero_grads": case_unused_zero_grads,
    "frozen": case_frozen,
    "tied": case_tied,
    "parent_params": case_parent,
    "module_twice": case_twice,
    "mixed_dtypes": case_mixed_dtypes,
    "batchnorm": case_batchnorm,
    "accumulation": case_accumulation,
    "eval_no_grad": case_eval_no_grad,
    "transformer_eval": case_transformer_eval,
    "checkpoint": case_checkpoint,
    "lr_scheduler_on_wrapper": lambda r, w: case_lr_scheduler(r, w, on_inner=False),
    "lr_scheduler_on_inner": lambda r, w: case_lr_scheduler(r, w, on_inner=True),
    "bf16_autocast": case_bf16_autocast,
    "grad_scaler": case_grad_scaler,
    "clip_after_synchronize": case_clip,
    "world_size_warning": case_world_size_warning,
    "env_schedule": case_env_schedule,
    "default_plan": case_default_plan,
    # Blocks on the process group itself (gloo: up to two in flight) instead of the one-thread
    # group the runtime uses on gloo by default.
    "two_in_flight": lambda r, w: run_plain(SmallCNN, OPTIMIZERS["adam"], sched_crosscut,
                                            image_batch, mse, r, w,
                                            usb_kwargs={"one_in_flight": False}),
    "aligned_buffers": lambda r, w: case_aligned(r, w, sched_crosscut),
    "aligned_buffers_and_cuts": lambda r, w: case_aligned(r, w, sched_aligned),
})
for _n in STRATEGY_NAMES:
    CASES[f"strategy-{_n}"] = (lambda n: lambda r, w: case_strategy(n, r, w))(_n)
CASES.update(LOOPS)


def run_cases(rank: int, ws: int, names: list[str]) -> dict[str, dict]:
    """Every case in this rank; an exception is recorded, not raised, so that the ranks stay
    in step (a failing case may still leave the other rank waiting: the run has a deadline)."""
    import time
    import traceback

    out = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            out[name] = CASES[name](rank, ws)
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        out[name]["seconds"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


#: Run with ``-m slow`` only: the rest of the optimizer-by-schedule matrix (the default run
#: has every schedule with SGD and momentum, and each other optimizer on one schedule that
#: cuts tensors), and the loop shapes zeroing through the wrapped optimizer or the model
#: beyond one of each (the default run has every shape zeroing through the optimizer held).
SLOW_CASES = frozenset(
    [f"{o}-{s}" for o in ("adam", "adamw_wd") for s in SCHEDULES
     if (o, s) not in (("adam", "crosscut"), ("adamw_wd", "two_phase"))]
    + [n for n in LOOPS if n.startswith(("loop-inner-", "loop-model-"))
       and n not in ("loop-inner-none-before_backward-k3", "loop-model-zeros-after_step-k1")])


def _run(names: list[str]) -> list[dict[str, dict]]:
    res = run_local(run_cases, 2, args=(names,), timeout_s=240, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in res]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return _run([c for c in CASES if c not in SLOW_CASES])


@pytest.fixture(scope="module")
def slow_results() -> list[dict[str, dict]]:
    return _run(sorted(SLOW_CASES))


@pytest.mark.parametrize("case", [c for c in CASES if c not in SLOW_CASES])
def test_matches_ddp(results: list[dict[str, dict]], case: str) -> None:
    _check(results, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_matches_ddp_slow(slow_results: list[dict[str, dict]], case: str) -> None:
    _check(slow_results, case)


def _check(results: list[dict[str, dict]], case: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        if "skip" in got:
            pytest.skip(got["skip"])
        assert "error" not in got, f"rank {rank}: {got['error']}\n{got.get('trace', '')}"
        assert got["diff"] <= TOL, f"rank {rank}: max abs difference {got['diff']:.3g} > {TOL}"


def test_aligned_buffers_start_every_tensor_and_aligned_block_on_16_bytes(
        results: list[dict[str, dict]]) -> None:
    for name in ("aligned_buffers", "aligned_buffers_and_cuts"):
        got = results[0][name]
        assert "error" not in got, got.get("trace")
        assert all(o % 16 == 0 for o in got["tensor_offsets_bytes"]), got["tensor_offsets_bytes"]
    offs = results[0]["aligned_buffers"]["block_offsets_bytes"]
    assert any(o % 16 for o in offs), "crosscut blocks should include unaligned ones"
    assert all(o % 16 == 0 for o in results[0]["aligned_buffers_and_cuts"]["block_offsets_bytes"])


def test_batchnorm_buffers_equal_ddps_on_every_rank(results: list[dict[str, dict]]) -> None:
    for r in results:
        assert r["batchnorm"]["buffers_equal_ddp"] and r["batchnorm"]["buffers_equal_ddp_after_eval"]


def test_lr_scheduler_no_order_warning(results: list[dict[str, dict]]) -> None:
    for r in results:
        for case in ("lr_scheduler_on_wrapper", "lr_scheduler_on_inner"):
            assert r[case]["lr"] == r[case]["lr_ref"]
            assert r[case]["warnings"] == [], r[case]["warnings"]


def test_grad_scaler_skipped_the_bad_step(results: list[dict[str, dict]]) -> None:
    got = results[0]["grad_scaler"]
    assert got["scale"] == got["scale_ref"]


def test_world_size_mismatch_warns_on_rank0(results: list[dict[str, dict]]) -> None:
    msgs = results[0]["world_size_warning"]["warnings"]
    assert any("planned for world size 4, running with 2" in m for m in msgs), msgs
    assert not results[1]["world_size_warning"]["warnings"]


def test_default_plan_warns(results: list[dict[str, dict]]) -> None:
    assert any("no schedule given" in m for m in results[0]["default_plan"]["warnings"])


def case_compiled(rank: int, ws: int) -> dict:
    """``torch.compile``: DDP compiled against the runtime with the model compiled before and
    after wrapping (the compiled module itself may also be passed to the runtime)."""
    import usbyte_opt.runtime.forward as fw

    torch._dynamo.reset()
    calls = []
    real_pre = fw._compiled_pre
    fw._compiled_pre = lambda gates, *a: (calls.append(1), real_pre(gates, *a))[1]
    ref, mod = twins(lambda: SmallCNN(bn=True))
    o_ref = OPTIMIZERS["adamw_wd"](ref.parameters())
    cddp = torch.compile(DDP(ref))
    cmod = torch.compile(mod)
    o_usb = DistributedOptimizer(OPTIMIZERS["adamw_wd"](mod.parameters()), cmod,
                                 schedule=sched_two_phase(mod, ws))
    for step in range(LOOP_STEPS):
        x, y = image_batch(rank, step)
        for net, o in ((cddp, o_ref), (cmod, o_usb)):
            mse(net(x), y).backward()
            o.step()
            o.zero_grad()
    o_usb.synchronize()
    fw._compiled_pre = real_pre
    xe, _ = image_batch(99, 0)
    ref.eval(); mod.eval()
    with torch.no_grad():
        out = (ref(xe) - mod(xe)).abs().max().item()
    return {"diff": max(max_diff(ref, mod), out if rank == 0 else 0.0), "compiled_calls": len(calls)}


@pytest.mark.slow
def test_torch_compile_matches_ddp() -> None:
    """(Slow: tests/test_compiled_split.py trains compiled models against compiled DDP in the
    default run.)"""
    res = run_local(case_compiled, 2, timeout_s=400, pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["diff"] <= TOL, r.value
        assert r.value["compiled_calls"] == LOOP_STEPS, r.value  # the runtime's model ran compiled
