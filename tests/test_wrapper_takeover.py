"""How ``usbyte_opt.DistributedDataParallel`` takes the user's optimizer over: found at its
first ``step()`` by torch's global optimizer step hook (torch DDP trains until then), routed
through the runtime by methods and hooks set on the object, its class unchanged, no scan of
live objects (one process; the two-rank runs, bitwise against DDP through the takeover, are
tests/test_contract.py, tests/test_real_loop.py and tests/test_autotune.py)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_wrapper import batch, net
from torch.nn.parallel import DistributedDataParallel as DDP

import usbyte_opt
from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import Mode
from usbyte_opt.runtime import DistributedOptimizer, default_schedule
from usbyte_opt.runtime import wrapper as wrapper_mod
from usbyte_opt.runtime.exit_hook import OPEN


def run(model: nn.Module, opt: torch.optim.Optimizer, sched, scaler, steps: int = 4) -> None:
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y) * (1e30 if step == 2 else 1.0)   # step 2 overflows
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()


@pytest.fixture
def no_scan(monkeypatch):
    """``gc.get_objects`` raises whoever calls it: neither the wrapper nor the runtime's
    start-up scans live objects. The callers are recorded."""
    callers: list[str] = []

    def spy(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__")
        callers.append(caller)
        raise AssertionError(f"gc.get_objects() called from {caller}")

    monkeypatch.setattr(gc, "get_objects", spy)
    return callers


@pytest.mark.parametrize("mode", ["overlap", "fence", "sharded"])
def test_taken_over_at_the_first_step_class_unchanged_no_scan(pg, no_scan, mode):
    ref, mod = net(), net()
    s = dataclasses.replace(default_schedule(mod), mode=Mode(mode))
    sides = []
    for m, wrap in ((ref, DDP), (mod, lambda m: usbyte_opt.DistributedDataParallel(
            m, schedule=s, verify=False))):
        model = wrap(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)   # created after wrapping
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)   # wraps opt.step first
        sides.append((model, opt, sched, torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no LR scheduler order warning
        for model, opt, sched, scaler in sides:
            run(model, opt, sched, scaler)
    model, opt = sides[1][0], sides[1][1]
    rt = model.optimizer
    assert isinstance(rt, DistributedOptimizer) and rt.optimizer is opt
    assert type(opt) is torch.optim.AdamW and "usbyte" not in repr(type(opt))
    assert (rt.mode == Mode.SHARDED) == (mode == "sharded")
    assert type(copy.copy(opt.param_groups)) is list    # (sharded mode: a list subclass)
    assert no_scan == []
    for a, b in zip(ref.parameters(), mod.parameters()):
        assert torch.equal(a, b)
    assert sides[0][3].get_scale() == sides[1][3].get_scale()
    full = opt.state_dict()                  # the runtime's (in sharded mode: gathered)
    assert full["state"][0]["step"] == sides[0][1].state_dict()["state"][0]["step"]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(full["state"][0][k], sides[0][1].state_dict()["state"][0][k])
    opt.load_state_dict(full)
    rt.close()                               # the optimizer is plain again
    assert type(opt) is torch.optim.AdamW
    before = [p.detach().clone() for p in mod.parameters()]
    F.mse_loss(mod(batch(9)[0]), batch(9)[1]).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, mod.parameters()))


def test_what_the_takeover_sets_on_the_object(pg):
    mod = net()
    model = usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod), verify=False)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    extra = nn.Linear(2, 2)
    opt.add_param_group({"params": [], "lr": 0.2})     # before the takeover: the optimizer's own
    F.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    assert model.runs_torch_ddp and model.optimizer is None
    opt.step()
    rt = model.optimizer
    assert rt is not None and not model.runs_torch_ddp
    assert {"step", "zero_grad", "load_state_dict", "add_param_group"} <= set(vars(opt))
    assert opt._step_supports_amp_scaling is True and type(opt.param_groups) is list
    with pytest.raises(UsbyteError, match="add_param_group on an optimizer taken over"):
        opt.add_param_group({"params": list(extra.parameters())})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)   # built after the takeover
        F.mse_loss(model(batch(1)[0]), batch(1)[1]).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    rt.synchronize()
    assert rt.optimizer_calls >= 1 and opt.state_dict()["param_groups"][0]["lr"] == 0.05
    rt.close()


def test_the_step_hooks_go_once_the_optimizer_is_found(pg):
    mod = net()
    model = usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod), verify=False)
    assert model in wrapper_mod._WATCHING and len(wrapper_mod._HOOKS) == 2
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    for i in range(2):
        F.mse_loss(model(batch(i)[0]), batch(i)[1]).backward()
        opt.step()
        opt.zero_grad()
    assert model not in wrapper_mod._WATCHING and not wrapper_mod._HOOKS
    model.optimizer.close()


def test_a_step_replaced_on_the_object_is_refused(pg):
    mod = net()
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    opt.step = lambda closure=None: None    # (not an LR scheduler's wrapper)
    open_before = len(OPEN)
    with pytest.raises(UsbyteError, match="SGD.step is replaced on the object"):
        usbyte_opt.DistributedDataParallel(mod, schedule=default_schedule(mod), optimizer=opt,
                                           verify=False)
    assert len(OPEN) == open_before          # refused before a runtime was built
