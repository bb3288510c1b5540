"""``usbyte_opt.DistributedDataParallel``: DDP's surface over the runtime (one process; the
two-rank runs are tests/test_real_loop.py and tests/test_contract.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import usbyte_opt
from usbyte_opt.errors import UsbyteError
from usbyte_opt.runtime import DistributedOptimizer, default_schedule


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5, accum: int = 2,
          sched: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    for step in range(steps):
        for micro in range(accum):
            model.require_backward_grad_sync = micro == accum - 1
            x, y = batch(step * accum + micro)
            F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def test_ddp_surface_and_training_equal_to_ddp(pg):
    ref, mod = net(), net()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, 2, 0.5)
    ddp = DDP(ref)
    model = usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod))
    with torch.no_grad():            # an evaluation before the optimizer exists: plain module
        assert torch.equal(model(batch(99)[0]), ddp(batch(99)[0]))
    o_usb = torch.optim.AdamW(model.parameters(), lr=1e-2)   # created after wrapping
    s_usb = torch.optim.lr_scheduler.StepLR(o_usb, 2, 0.5)   # an LR scheduler on it first
    train(ddp, o_ref, sched=s_ref)
    train(model, o_usb, sched=s_usb)
    assert model.module is mod and isinstance(model.optimizer, DistributedOptimizer)
    assert type(o_usb).__name__ == "AdamW" and isinstance(o_usb, torch.optim.AdamW)
    assert list(model.state_dict()) == list(ddp.state_dict())       # "module." keys
    for a, b in zip(ref.parameters(), mod.parameters()):
        assert torch.equal(a, b)
    assert o_usb.state_dict()["state"][0]["step"] == o_ref.state_dict()["state"][0]["step"]
    assert o_usb.param_groups[0]["lr"] == o_ref.param_groups[0]["lr"]
    with model.no_sync():
        assert not model.require_backward_grad_sync
    assert model.require_backward_grad_sync


def test_the_optimizer_is_found_at_its_first_step_or_named(pg):
    mod = net()
    model = usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod))
    model(batch(0)[0]).sum().backward()     # no optimizer yet: torch DDP trains
    assert model.runs_torch_ddp and model.optimizer is None
    mod.zero_grad()
    a, b = torch.optim.SGD(mod.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    model(batch(0)[0]).sum().backward()
    a.step()                                 # the first to step is taken over, after its step
    assert model.optimizer is not None and model.optimizer.optimizer is a
    with pytest.raises(UsbyteError, match="2 optimizers over the model's parameters step"):
        b.step()
    named = usbyte_opt.DistributedDataParallel(copy.deepcopy(mod), optimizer=None,
                                               schedule=default_schedule(mod))
    assert named.optimizer is None
    with pytest.raises(UsbyteError, match="register_comm_hook"):
        model.register_comm_hook(None, None)
    other = copy.deepcopy(mod)
    given = torch.optim.SGD(other.parameters(), lr=0.1)
    now = usbyte_opt.DistributedDataParallel(other, optimizer=given,
                                             schedule=default_schedule(other))
    assert now.optimizer is not None and not now.runs_torch_ddp   # the runtime from the start
    for rt in (model.optimizer, now.optimizer):
        rt.close()


def test_find_unused_parameters_false_is_dds_default_and_refuses_an_unused_one(pg):
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    mod = Unused()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    model = usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod), optimizer=opt)
    with pytest.raises(UsbyteError, match="'unused.(weight|bias)' and 1 more got no gradient"):
        model(batch(0)[0]).sum().backward()
    del opt
