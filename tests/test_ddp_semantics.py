"""DDP's semantics, exactly (usbyte_opt/runtime/semantics.py): module buffers and optimizers.

Two gloo ranks run every scenario in one spawned run. Each trains the same model twice, once
under torch's ``DistributedDataParallel`` and once under usbyte-opt (the wrapper, or the
Horovod-style optimizer), with the same loop, on rank-dependent data, and compares on *every*
rank what a user can read afterwards: parameters, buffers (BatchNorm statistics), eval
outputs, an EMA model, the optimizer's state dict. Equal means bitwise (``torch.equal``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import play, played
from torch.nn.parallel import DistributedDataParallel as DDP

import usbyte_opt
from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import Mode, Schedule
from usbyte_opt.launcher import run_local
from usbyte_opt.planning.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer
from usbyte_opt.runtime.default_plan import profile_from_model, split_blocks

STEPS = 6

# -- models, data, schedules ------------------------------------------------------------------


def make_net() -> nn.Module:
    """The issue's repro model: Linear-BatchNorm1d-ReLU-Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * rank + step)
    return torch.randn(8, 6, generator=g) * (1 + rank), torch.randn(8, 3, generator=g)


def overlap_schedule(model: nn.Module, ws: int = 2) -> Schedule:
    """Every tensor in two blocks, issued in forward order: several blocks, overlap mode."""
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    return pb.schedule("split", lay, split_blocks(pb, lay, 2, pb.need_order()))


def sharded_schedule(model: nn.Module, ws: int = 2) -> Schedule:
    return dataclasses.replace(overlap_schedule(model, ws), mode=Mode.SHARDED)


def fence_schedule(model: nn.Module, ws: int = 2) -> Schedule:
    return dataclasses.replace(overlap_schedule(model, ws), mode=Mode.FENCE)


# -- optimizers that are not per-parameter ------------------------------------------------------


class Lamb(torch.optim.Optimizer):
    """LAMB-style: every update is scaled by the *global* gradient norm (computed inside
    ``step()`` over every parameter it holds), and the step count is a group int."""

    def __init__(self, params: Any, lr: float = 0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.setdefault("m", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad / (norm + 1e-6))
                p.add_(buf, alpha=-g["lr"] / g["step"] ** 0.5)


class TensorStep(torch.optim.Optimizer):
    """Keeps its step count as a tensor in the param group, incremented in place."""

    def __init__(self, params: Any, lr: float = 0.05):
        super().__init__(params, {"lr": lr, "step": torch.zeros(())})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            g["step"] += 1
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] / float(g["step"]))


class Unknown(torch.optim.Optimizer):
    """A plain SGD of the user's, not declared per-parameter: stepped whole."""

    def __init__(self, params: Any, lr: float = 0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


@usbyte_opt.per_parameter
class SignSGD(Unknown):
    """Declared per-parameter (and it is): stepped on subsets in overlap mode."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-g["lr"])


@usbyte_opt.per_parameter
class DeclaredWrongly(Unknown):
    """Declared per-parameter, but counts its steps in the group: refused."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            g["calls"] = g.get("calls", 0) + 1
        super().step()


def hooked_sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with a step post-hook that counts its calls (under DDP: once per step)."""
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    opt.hook_calls = 0  # type: ignore[attr-defined]

    def count(o: Any, args: Any, kwargs: Any) -> None:
        o.hook_calls += 1

    opt.register_step_post_hook(count)
    return opt


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "lamb": Lamb, "tensor_step": TensorStep, "unknown": Unknown, "sign_sgd": SignSGD,
    "declared_wrongly": DeclaredWrongly, "hooked_sgd": hooked_sgd,
}

# -- comparing ----------------------------------------------------------------------------------


def state_equal(a: Any, b: Any) -> bool:
    """Nested state (dicts, lists, tensors, numbers) equal, tensors bitwise."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def compare(ref: nn.Module, mod: nn.Module) -> dict[str, Any]:
    """Which of the parameters and buffers differ on this rank, and by how much."""
    out: dict[str, Any] = {"params_equal": True, "buffers_equal": True, "worst": 0.0,
                           "differs": []}
    for kind, a, b in (("params", ref.named_parameters(), mod.named_parameters()),
                       ("buffers", ref.named_buffers(), mod.named_buffers())):
        for (n, x), (_, y) in zip(a, b):
            if not torch.equal(x, y):
                out[f"{kind}_equal"] = False
                out["differs"].append(n)
                out["worst"] = max(out["worst"], (x.double() - y.double()).abs().max().item())
    return out


# -- the loops: the same code under DDP and under usbyte-opt ------------------------------------


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def loop_bn_average(model: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int,
                    seen: list[torch.Tensor]) -> None:
    """After each step: average the BN buffers over the ranks (as image trainers do before
    evaluating), then an eval forward."""
    for step in range(STEPS):
        train_step(model, opt, rank, step)
        for b in model.module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b)
                b /= ws
        model.eval()
        with torch.no_grad():
            seen.append(model(batch(99, step)[0]))
        model.train()


def loop_no_sync(model: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int,
                 seen: list[torch.Tensor]) -> None:
    """Accumulation of 2 with ``no_sync()``."""
    for step in range(STEPS):
        x1, y1 = batch(rank, 2 * step)
        x2, y2 = batch(rank, 2 * step + 1)
        with model.no_sync():
            (F.mse_loss(model(x1), y1) / 2).backward()
        (F.mse_loss(model(x2), y2) / 2).backward()
        opt.step()
        opt.zero_grad()


def loop_ema(model: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int,
             seen: list[torch.Tensor]) -> None:
    """A model EMA that reads ``model.state_dict()`` after every step (buffers copied)."""
    ema = copy.deepcopy(model.module)
    for step in range(STEPS):
        train_step(model, opt, rank, step)
        msd = model.state_dict()
        with torch.no_grad():
            for k, v in ema.state_dict().items():
                src = msd["module." + k]
                if v.is_floating_point():
                    v.mul_(0.9).add_(src, alpha=0.1)
                else:
                    v.copy_(src)
    seen.extend(ema.state_dict().values())


def loop_bare_and_eval(model: nn.Module, opt: torch.optim.Optimizer, rank: int, ws: int,
                       seen: list[torch.Tensor]) -> None:
    """Forwards of the bare module (never synced) and eval forwards after a training one
    (synced at their start), then a second eval forward (not synced)."""
    for step in range(STEPS):
        train_step(model, opt, rank, step)
        if step % 2:
            model.module(batch(rank, 50 + step)[0])      # bare, training mode
        model.eval()
        with torch.no_grad():
            seen.append(model(batch(rank, 70 + step)[0]))
            seen.append(model(batch(rank, 80 + step)[0]))
        model.train()


LOOPS: dict[str, Callable[..., None]] = {
    "bn_average": loop_bn_average, "no_sync": loop_no_sync, "ema": loop_ema,
    "bare_and_eval": loop_bare_and_eval, "plain": lambda m, o, r, ws, seen: [
        train_step(m, o, r, s) for s in range(STEPS)],
}


def side_by_side(rank: int, ws: int, loop: str, optimizer: str = "sgd",
                 schedule: Callable[..., Schedule] = overlap_schedule,
                 takeover: bool = False, **kw: Any) -> dict[str, Any]:
    """``loop`` under DDP and under ``usbyte_opt.DistributedDataParallel`` (the optimizer
    passed, or taken over at its first step); what differs on this rank."""
    net = make_net()
    ref, mod = copy.deepcopy(net), copy.deepcopy(net)
    ddp = DDP(ref, **kw)
    o_ref = OPTIMIZERS[optimizer](ddp.parameters())
    o_usb = OPTIMIZERS[optimizer](mod.parameters())
    usb = usbyte_opt.DistributedDataParallel(mod, schedule=schedule(mod, ws), verify=False,
                                             optimizer=None if takeover else o_usb, **kw)
    seen_ref: list[torch.Tensor] = []
    seen_usb: list[torch.Tensor] = []
    LOOPS[loop](ddp, o_ref, rank, ws, seen_ref)
    LOOPS[loop](usb, o_usb, rank, ws, seen_usb)
    usb.optimizer.synchronize()
    out = compare(ref, mod)
    out["seen_equal"] = state_equal(seen_ref, seen_usb)
    out["optimizer_state_equal"] = state_equal(o_ref.state_dict(), o_usb.state_dict())
    out["calls"] = usb.optimizer.optimizer_calls
    out["seen_equal"] &= getattr(o_ref, "hook_calls", 0) == getattr(o_usb, "hook_calls", 0)
    return out


def hook_after_wrapping(rank: int, ws: int) -> dict[str, Any]:
    """A step hook registered on an optimizer the runtime steps per block: refused."""
    mod = make_net()
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    usb = usbyte_opt.DistributedDataParallel(mod, schedule=overlap_schedule(mod), verify=False,
                                             optimizer=opt)
    train_step(usb, opt, rank, 0)
    opt.register_step_post_hook(lambda o, a, k: None)
    train_step(usb, opt, rank, 1)
    return {}


def horovod_accumulation(rank: int, ws: int) -> dict[str, Any]:
    """The Horovod-style optimizer with ``backward_passes_per_step=2`` against DDP's
    ``no_sync()`` on the first micro-batch, with an eval forward after each step: buffers on
    every rank as DDP's."""
    net = make_net()
    ref, mod = copy.deepcopy(net), copy.deepcopy(net)
    ddp = DDP(ref)
    o_ref = OPTIMIZERS["adamw"](ref.parameters())
    opt = DistributedOptimizer(OPTIMIZERS["adamw"](mod.parameters()), mod,
                               schedule=overlap_schedule(mod), verify=False,
                               backward_passes_per_step=2)
    seen: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        (x1, y1), (x2, y2) = batch(rank, 2 * step), batch(rank, 2 * step + 1)
        with ddp.no_sync():
            (F.mse_loss(ddp(x1), y1) / 2).backward()
        (F.mse_loss(ddp(x2), y2) / 2).backward()
        o_ref.step(); o_ref.zero_grad()
        (F.mse_loss(mod(x1), y1) / 2).backward()
        (F.mse_loss(mod(x2), y2) / 2).backward()
        opt.step(); opt.zero_grad()
        for m, s in ((ddp, seen[0]), (mod, seen[1])):
            m.eval()
            with torch.no_grad():
                s.append(m(batch(99, step)[0]))
            m.train()
    opt.synchronize()
    out = compare(ref, mod)
    out["seen_equal"] = state_equal(*seen)
    out["optimizer_state_equal"] = state_equal(o_ref.state_dict(), opt.state_dict())
    return out


def no_broadcast_buffers(rank: int, ws: int) -> dict[str, Any]:
    return side_by_side(rank, ws, "bare_and_eval", broadcast_buffers=False)


class Encoder(nn.Module):
    """An embedding, two ``nn.TransformerEncoderLayer`` and a head: layers with an inference
    fast path (``torch._transformer_encoder_layer_fwd``) that a forward hook on any of their
    modules, or a ``__torch_function__`` tensor among their parameters, turns off; under CPU
    autocast that fast path computes in fp32 (its autocast check asks about CUDA only) and the
    other path in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(64, 2, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.head = nn.Linear(64, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.enc(self.emb(x))), -1).flatten(0, 1)


def eval_fast_path(rank: int, ws: int, how: str) -> dict[str, Any]:
    """Training under CPU bf16 autocast, and after each step an eval forward under
    ``inference_mode`` and autocast, as Lightning's validation loop runs it: ``auto`` (the
    tuner measures its iterations with module hooks: they must not be on in the eval forward)
    through the model, or ``overlap`` (updates pending after ``step()``) through the encoder
    alone, called as a submodule (its pending updates run before it chooses its path)."""
    import tempfile

    torch.manual_seed(0)
    net = Encoder()
    ref, mod = copy.deepcopy(net), copy.deepcopy(net)
    ddp = DDP(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    o_usb = torch.optim.SGD(mod.parameters(), lr=0.1)
    if how == "auto":
        usb = usbyte_opt.DistributedDataParallel(mod, schedule="auto", optimizer=o_usb,
                                                 auto_dir=tempfile.mkdtemp())
    else:
        usb = usbyte_opt.DistributedDataParallel(mod, schedule=overlap_schedule(mod, ws),
                                                 optimizer=o_usb, verify=False)
    ac: dict[str, Any] = dict(device_type="cpu", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(99)
    xv, hv = torch.randint(0, 50, (8, 35), generator=g), torch.randn(8, 35, 64, generator=g)
    seen: list[list[torch.Tensor]] = [[], []]
    for model, net_, opt, out in ((ddp, ref, o_ref, seen[0]), (usb, mod, o_usb, seen[1])):
        gen = torch.Generator().manual_seed(1 + rank)
        for _ in range(STEPS):
            x = torch.randint(0, 50, (8, 35), generator=gen)
            model.train()
            with torch.autocast(**ac):
                loss = F.nll_loss(model(x), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.inference_mode(), torch.autocast(**ac):
                out.append((model(xv) if how == "auto" else net_.enc(hv)).clone())
    usb.optimizer.synchronize()
    res = compare(ref, mod)
    res["seen_equal"] = state_equal(*seen)
    res["optimizer_state_equal"] = state_equal(o_ref.state_dict(), o_usb.state_dict())
    return res


def encoder_layer_root(rank: int, ws: int) -> dict[str, Any]:
    """The model is an ``nn.TransformerEncoderLayer`` itself: refused (hooks on it turn its
    inference fast path off)."""
    layer = nn.TransformerEncoderLayer(16, 2, 16, dropout=0.0, batch_first=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    usb = usbyte_opt.DistributedDataParallel(layer, schedule=overlap_schedule(layer, ws),
                                             verify=False, optimizer=opt)
    for _ in range(2):
        usb(torch.randn(4, 3, 16)).sum().backward()
        opt.step()
    return {}


SCENARIOS = {
    **{f"{loop}": (side_by_side, (loop,)) for loop in LOOPS},
    "bn_average_takeover": (side_by_side, ("bn_average", "sgd", overlap_schedule, True)),
    "no_sync_takeover": (side_by_side, ("no_sync", "adamw", overlap_schedule, True)),
    "bn_average_fence": (side_by_side, ("bn_average", "adamw", fence_schedule)),
    "bn_average_sharded": (side_by_side, ("bn_average", "adamw", sharded_schedule)),
    "ema_sharded": (side_by_side, ("ema", "sgd", sharded_schedule)),
    "no_broadcast_buffers": (no_broadcast_buffers, ()),
    "horovod_accumulation": (horovod_accumulation, ()),
    **{f"optimizer_{name}": (side_by_side, ("plain", name)) for name in
       ("lamb", "tensor_step", "unknown", "sign_sgd", "declared_wrongly", "hooked_sgd")},
    "hook_after_wrapping": (hook_after_wrapping, ()),
    "optimizer_lamb_takeover": (side_by_side, ("plain", "lamb", overlap_schedule, True)),
    "eval_fast_path_auto": (eval_fast_path, ("auto",)),
    "eval_fast_path_submodule": (eval_fast_path, ("overlap",)),
    "encoder_layer_root": (encoder_layer_root, ()),
}


@pytest.fixture(scope="module")
def outcome() -> Callable[[str], list[Any]]:
    return played(run_local(play, 2, args=(SCENARIOS,), timeout_s=300, pg_timeout_s=60))


EQUAL_CASES = [n for n in SCENARIOS if n not in ("optimizer_declared_wrongly", "hook_after_wrapping",
                                                  "encoder_layer_root")]


@pytest.mark.parametrize("name", EQUAL_CASES)
def test_equal_to_ddp_on_every_rank(outcome: Callable[[str], list[Any]], name: str) -> None:
    for r in outcome(name):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        got = r.value
        assert got["params_equal"] and got["buffers_equal"], \
            f"rank {r.rank}: {got['differs']} differ (max {got['worst']:.3g})"
        assert got["seen_equal"], f"rank {r.rank}: outputs/EMA differ from DDP's"
        assert got["optimizer_state_equal"], f"rank {r.rank}: optimizer state differs"


@pytest.mark.parametrize("name", ["optimizer_lamb", "optimizer_tensor_step", "optimizer_unknown",
                                  "optimizer_hooked_sgd"])
def test_not_per_parameter_is_stepped_whole_once(outcome: Callable[[str], list[Any]],
                                                 name: str) -> None:
    """One optimizer call per step (the overlap plan's per-block calls would be several)."""
    for r in outcome(name):
        assert r.value["calls"] == STEPS, r.value


def test_declared_per_parameter_is_stepped_on_subsets(outcome: Callable[[str], list[Any]]) -> None:
    assert all(r.value["calls"] > STEPS for r in outcome("optimizer_sign_sgd"))


def test_declared_wrongly_is_refused_on_every_rank(outcome: Callable[[str], list[Any]]) -> None:
    for r in outcome("optimizer_declared_wrongly"):
        assert not r.ok and r.error_type == "usbyte_opt.errors.UsbyteError", (r.error_type, r.error)
        assert "changed param_groups[0]['calls']" in r.error and "\n" not in r.error


def test_step_hook_after_wrapping_is_refused_on_every_rank(
        outcome: Callable[[str], list[Any]]) -> None:
    for r in outcome("hook_after_wrapping"):
        assert not r.ok and "step hook was registered on SGD" in r.error, (r.error_type, r.error)


def test_per_parameter_classes() -> None:
    from usbyte_opt.runtime import steps_per_parameter

    p = [nn.Parameter(torch.ones(2))]
    assert steps_per_parameter(torch.optim.Adam(p, foreach=True))
    assert steps_per_parameter(torch.optim.SGD(p, lr=0.1))
    assert not steps_per_parameter(torch.optim.LBFGS(p))
    assert not steps_per_parameter(Lamb(p))

    class MyAdam(torch.optim.Adam):   # a subclass keeping Adam's step: still per-parameter
        pass

    class Clipped(torch.optim.Adam):  # its own step: unknown
        def step(self, closure: Any = None) -> None:
            super().step(closure)

    assert steps_per_parameter(MyAdam(p)) and not steps_per_parameter(Clipped(p))
    with pytest.raises(UsbyteError):
        usbyte_opt.per_parameter(int)


def test_an_encoder_layer_as_the_model_is_refused_on_every_rank(
        outcome: Callable[[str], list[Any]]) -> None:
    for r in outcome("encoder_layer_root"):
        assert not r.ok and r.error_type == "usbyte_opt.errors.UsbyteError", (r.rank, r.error)
        assert "TransformerEncoderLayer" in r.error and "fast path" in r.error, r.error
