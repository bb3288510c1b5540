"""A complete DDP training loop, written the way popular public DDP scripts write it, adapted
with the one line the README tells users to change, trains exactly as its own DDP run.

The loop (a small GPT, as in the most copied GPT trainer): gradient accumulation through
``model.require_backward_grad_sync``, ``GradScaler`` (``scaler.unscale_`` then
``torch.nn.utils.clip_grad_norm_(model.parameters())``), AdamW with decay and no-decay groups,
a cosine learning rate with warm-up set through ``optimizer.param_groups``, evaluation and a
checkpoint on rank 0 only, and ``raw_model = model.module``. The one changed line is
``model = DDP(model)`` -> ``model = usbyte_opt.DistributedDataParallel(model)``; the schedule
comes from ``$USBYTE_SCHEDULE``, as ``usbyte-opt launch --schedule`` sets it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import usbyte_opt
from tests.test_runtime_equivalence import sched_split_forward
from usbyte_opt.env import SCHEDULE_ENV
from usbyte_opt.formats import Mode, save_schedule
from usbyte_opt.launcher import run_local

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 32, 8, 16, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.mlp_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight   # weight tying

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB),
                                                             targets.reshape(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        nodecay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": nodecay, "weight_decay": 0.0}],
                                 lr=learning_rate, betas=betas)


def get_batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + it)
    data = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def get_lr(it: int, warmup: int = 2, decay_iters: int = 10, lr: float = 6e-3,
           min_lr: float = 6e-4) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train(rank: int, use_usbyte: bool, out_dir: str, max_iters: int = 12) -> dict:
    """The script, with its one line switched by ``use_usbyte``."""
    master_process = rank == 0
    torch.manual_seed(1337)
    model = GPT()
    optimizer = model.configure_optimizers(0.1, 6e-3, (0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    if use_usbyte:
        model = usbyte_opt.DistributedDataParallel(model)      # the one changed line
    else:
        model = DDP(model)
    raw_model = model.module
    gradient_accumulation_steps, grad_clip = 2, 1.0
    X, Y = get_batch(rank, 0)
    losses = []
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % 5 == 0 and master_process:
            model.eval()
            with torch.no_grad():
                _, val = model(*get_batch(99, iter_num))
            model.train()
            losses.append(float(val))
            if iter_num > 0:
                ckpt = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter_num": iter_num}
                torch.save(ckpt, os.path.join(out_dir, f"ckpt-{int(use_usbyte)}.pt"))
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch(rank, 1 + iter_num * gradient_accumulation_steps + micro_step)
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in raw_model.named_parameters()}
    return {"params": params, "losses": losses, "scale": scaler.get_scale()}


def run_script(rank: int, ws: int, mode: str, out_dir: str) -> dict:
    sched = sched_split_forward(GPT())
    sched = dataclasses.replace(sched, mode=Mode.FENCE if mode == "fence" else
                                Mode.SHARDED if mode == "sharded" else Mode.OVERLAP)
    path = os.path.join(out_dir, f"gpt-{mode}.json")
    if rank == 0:
        save_schedule(sched, path)
    torch.distributed.barrier()
    ref = train(rank, False, out_dir)
    os.environ[SCHEDULE_ENV] = path
    try:
        got = train(rank, True, out_dir)
    except usbyte_opt.errors.UsbyteError as e:
        return {"refused": str(e)}
    finally:
        del os.environ[SCHEDULE_ENV]
    diff = max((ref["params"][n] - got["params"][n]).abs().max().item() for n in ref["params"])
    out = {"diff": diff, "losses": (ref["losses"], got["losses"]),
           "scale": (ref["scale"], got["scale"])}
    if rank == 0:
        a, b = (torch.load(os.path.join(out_dir, f"ckpt-{i}.pt")) for i in (0, 1))
        out["ckpt_model"] = max((a["model"][k] - b["model"][k]).abs().max().item()
                                for k in a["model"])
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        out["ckpt_optimizer"] = max((sa[i][k] - sb[i][k]).abs().max().item()
                                    for i in sa for k in sa[i])
    return out


MODES = ("overlap", "fence", "sharded")


def run_all(rank: int, ws: int, out_dir: str) -> dict:
    return {mode: run_script(rank, ws, mode, out_dir) for mode in MODES}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        res = run_local(run_all, 2, args=(d,), timeout_s=400, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in res]


@pytest.mark.parametrize("mode", MODES)
def test_a_public_style_ddp_loop_adapted_by_one_line_equals_its_ddp_run(runs: list[dict],
                                                                         mode: str) -> None:
    outs = [r[mode] for r in runs]
    if mode == "sharded":   # clipping model.parameters() needs the whole averaged gradients
        for o in outs:
            assert "refused" in o and "\n" not in o["refused"], o
            assert "sharded mode" in o["refused"]
        return
    for rank, o in enumerate(outs):
        assert "refused" not in o, o
        assert o["diff"] == 0.0, f"rank {rank}: parameters differ from DDP's by {o['diff']}"
        assert o["scale"][0] == o["scale"][1]
    assert outs[0]["losses"][0] == outs[0]["losses"][1]
    assert outs[0]["ckpt_model"] == 0.0 and outs[0]["ckpt_optimizer"] == 0.0
