"""DDP's contract, enforced: the hazard matrix.

Each pattern below is something ordinary DDP training code does that touches a gradient or a
parameter while the runtime still has it in flight (between ``backward()`` and ``step()``, or
between ``step()`` and the next forward), or that the runtime cannot average as DDP would.
Every pattern runs in every mode it applies to (overlap, fence, ZeRO-1, ZeRO-2) on two gloo
ranks, side by side with DDP on the same data, with no change to the loop. The outcome must be
the expected one of two:

* ``equal``: the parameters after the steps are DDP's, bitwise (and what the pattern logged);
* ``refused``: every rank raises the same one-line :class:`~usbyte_opt.errors.UsbyteError`.

Nothing may train silently differently. One spawned pair of ranks runs the whole matrix.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from tests.test_runtime_equivalence import sched_split_forward
from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import Mode
from usbyte_opt.launcher import run_local
from usbyte_opt.runtime import DistributedOptimizer

STEPS = 6
MODES = ("overlap", "fence", "zero1", "zero2")


class Net(nn.Module):
    def __init__(self, reentrant: str = ""):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.mid2 = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.reentrant = reentrant

    def seg(self, h: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        return torch.tanh(layer(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.reentrant == "shared":   # self.mid in two checkpointed segments
            h = checkpoint(self.seg, h, self.mid, use_reentrant=True)
            h = checkpoint(self.seg, h, self.mid, use_reentrant=True)
        elif self.reentrant == "plain":
            h = checkpoint(self.seg, h, self.mid, use_reentrant=True)
            h = checkpoint(self.seg, h, self.mid2, use_reentrant=True)
        else:
            h = self.seg(self.seg(h, self.mid), self.mid2)
        return self.out(h)


class Lora(nn.Module):
    """A frozen base with trainable low-rank adapters inside reentrant-checkpointed layers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.base = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.a = nn.ParameterList(nn.Parameter(torch.randn(8, 2) * 0.1) for _ in range(2))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(2, 8) * 0.1) for _ in range(2))
        self.out = nn.Linear(8, 3)
        for p in [*self.base.parameters(), *self.out.parameters()]:
            p.requires_grad_(False)

    def layer(self, h: torch.Tensor, i: int) -> torch.Tensor:
        return torch.tanh(self.base[i](h) + h @ self.a[i] @ self.b[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i in range(2):
            h = checkpoint(self.layer, h, i, use_reentrant=True)
        return self.out(h)


class Unused(Net):
    def __init__(self):
        super().__init__()
        self.never = nn.Linear(8, 8)


class Frozen(Net):
    def __init__(self):
        super().__init__()
        for p in self.mid2.parameters():
            p.requires_grad_(False)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def schedule_for(mode: str, model: nn.Module) -> tuple[Any, dict]:
    s = sched_split_forward(model)
    if mode == "overlap":
        return dataclasses.replace(s, mode=Mode.OVERLAP), {}
    if mode == "fence":
        return dataclasses.replace(s, mode=Mode.FENCE), {}
    return dataclasses.replace(s, mode=Mode.SHARDED), {"zero_stage": 2 if mode == "zero2" else 1}


# --------------------------------------------------------------------------------------------
# Patterns: hooks into the ordinary loop
#   forward -> backward -> after_backward(model, opt, step) -> opt.step() -> after_step(...)
#   -> opt.zero_grad()
# Each returns what it logged (compared with DDP's), or None.
# --------------------------------------------------------------------------------------------


def clip(model, opt, step):
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))


def clip_value(model, opt, step):
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)


def log_norm(model, opt, step):
    return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()
                                         if p.grad is not None])))


def surgery(model, opt, step):
    for i, p in enumerate(model.parameters()):
        if p.grad is not None:
            p.grad.mul_(0.5 + 0.1 * i).add_(0.001 * step)


def reassign(model, opt, step):
    p = next(model.parameters())
    p.grad = torch.zeros_like(p.grad)   # DDP leaves the tensor where it is (SGD, no momentum)


def drop_grad(model, opt, step):
    list(model.parameters())[1].grad = None


def ema(model, opt, step, store={}):  # noqa: B006 - one EMA per run, reset by the runner
    with torch.no_grad():
        for n, p in model.named_parameters():
            e = store.setdefault(n, p.detach().clone())
            e.mul_(0.8).add_(p, alpha=0.2)
    return sum(float(e.sum()) for e in store.values())


def snapshot(model, opt, step):
    return sum(float(v.double().sum()) for v in model.state_dict().values())


def deep_copy(model, opt, step):
    return sum(float(p.double().sum()) for p in copy.deepcopy(model).parameters())


def clamp(model, opt, step):
    for p in model.parameters():
        p.data.clamp_(-0.3, 0.3)


def grads_after_step(model, opt, step):
    """A gradient-logging callback after step(): under DDP p.grad holds the averaged gradient
    until zero_grad()."""
    return [None if p.grad is None else float(p.grad.double().sum()) for p in model.parameters()]


def foreach_ema(model, opt, step, store={}):  # noqa: B006
    ps = [p for p in model.parameters()]
    if not store:
        store["e"] = [p.detach().clone() for p in ps]
    torch._foreach_lerp_(store["e"], [p.detach() for p in ps], 0.3)
    return sum(float(e.sum()) for e in store["e"])


@dataclasses.dataclass(frozen=True)
class Pattern:
    make: Callable[[], nn.Module] = Net
    after_backward: Callable | None = None
    after_step: Callable | None = None
    before_forward: Callable | None = None       # (model, opt, step)
    opt: str = "sgd"
    find_unused: bool = True
    static_graph: bool = False   # DDP needs it for reentrant checkpointing
    zero_grad: bool = True       # the loop zeroes gradients after each step
    outcome: dict[str, str] = dataclasses.field(default_factory=dict)  # mode -> expected


def unfreeze(model, opt, step):
    if step == 2:
        for p in model.mid2.parameters():
            p.requires_grad_(True)


def add_group(model, opt, step):
    if step == 2:
        inner = opt.optimizer
        extra = nn.Parameter(torch.zeros(3))
        inner.add_param_group({"params": [extra]})


EQ = dict.fromkeys(MODES, "equal")
GRADS = {"overlap": "equal", "fence": "equal", "zero1": "refused", "zero2": "refused"}
REFUSED = dict.fromkeys(MODES, "refused")

PATTERNS: dict[str, Pattern] = {
    "plain loop": Pattern(outcome=EQ),
    "clip_grad_norm_(model.parameters())": Pattern(after_backward=clip, outcome=GRADS),
    "clip_grad_value_": Pattern(after_backward=clip_value, outcome=GRADS),
    "logged gradient norm": Pattern(after_backward=log_norm, outcome=GRADS),
    "in-place gradient surgery": Pattern(after_backward=surgery, opt="adam", outcome=GRADS),
    "p.grad = zeros_like(p.grad)": Pattern(after_backward=reassign, outcome=GRADS),
    "p.grad = None after backward": Pattern(after_backward=drop_grad, opt="adamw", outcome=EQ),
    "EMA after step": Pattern(after_step=ema, opt="adam", outcome=EQ),
    "_foreach EMA after step": Pattern(after_step=foreach_ema, opt="adam", outcome=EQ),
    "state_dict() after step": Pattern(after_step=snapshot, outcome=EQ),
    "p.grad logged after step()": Pattern(after_step=grads_after_step, opt="adam",
                                         outcome={"overlap": "equal", "fence": "equal"}),
    "no zero_grad(): gradients accumulate across steps":
        Pattern(after_step=grads_after_step, zero_grad=False,
                outcome={"overlap": "equal", "fence": "equal"}),
    "deepcopy after step": Pattern(after_step=deep_copy, outcome=EQ),
    "p.data.clamp_() after step": Pattern(after_step=clamp, opt="adam", outcome=EQ),
    "find_unused_parameters=False, a parameter no rank uses":
        Pattern(make=Unused, find_unused=False, outcome=REFUSED),
    "unfrozen after wrapping": Pattern(make=Frozen, before_forward=unfreeze, outcome=REFUSED),
    "add_param_group on the wrapped optimizer": Pattern(before_forward=add_group,
                                                        outcome=REFUSED),
    "reentrant checkpoint": Pattern(make=lambda: Net("plain"), static_graph=True, outcome=EQ),
    "reentrant checkpoint, a parameter in two segments":
        Pattern(make=lambda: Net("shared"), outcome=REFUSED),
    "reentrant checkpoint, adapters in frozen layers (LoRA)":
        Pattern(make=Lora, opt="adamw", static_graph=True, outcome=EQ),
}

OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def run_pattern(name: str, mode: str, rank: int, ws: int) -> dict:
    pat = PATTERNS[name]
    torch.manual_seed(0)
    proto = pat.make()
    ref, mod = copy.deepcopy(proto), copy.deepcopy(proto)
    ddp = DDP(ref, find_unused_parameters=pat.find_unused and not pat.static_graph,
              static_graph=pat.static_graph)
    o_ref = OPTS[pat.opt](ref.parameters())
    sched, kw = schedule_for(mode, mod)
    o_usb = DistributedOptimizer(OPTS[pat.opt](mod.parameters()), mod, schedule=sched,
                                 verify=False, find_unused_parameters=pat.find_unused,
                                 timeout=30, **kw)
    logs: list[list[Any]] = [[], []]
    # The runtime first: where DDP itself raises (an unused parameter), the runtime must too.
    for side, (model, opt, net) in ((1, (mod, o_usb, mod)), (0, (ddp, o_ref, ref))):
        for f in (pat.after_backward, pat.after_step):
            if f is not None and f.__defaults__:
                f.__defaults__[-1].clear()   # an EMA's store: one per side
        for step in range(STEPS):
            if pat.before_forward is not None:
                pat.before_forward(net, opt, step)
            x, y = batch(rank, step)
            F.mse_loss(model(x), y).backward()
            if pat.after_backward is not None:
                logs[side].append(pat.after_backward(net, opt, step))
            opt.step()
            if pat.after_step is not None:
                logs[side].append(pat.after_step(net, opt, step))
            if pat.zero_grad:
                opt.zero_grad()
    o_usb.synchronize()
    diff = max((a.detach() - b.detach()).abs().max().item()
               for a, b in zip(ref.parameters(), mod.parameters()))
    return {"diff": diff, "logs_equal": logs[0] == logs[1], "logs": logs}


def skipped_backward(rank: int, ws: int, mode: str, scaler: bool) -> dict:
    """Sharded mode, rank 1 runs no backward at step 2 (a data loader that ran dry), then
    clips with ``opt.clip_grad_norm_`` (a collective) or steps through GradScaler (whose
    non-finite flag is one). Under DDP the other rank would wait for ever; here rank 1's blocks
    go out as zeros. Against DDP with rank 1's loss times zero at that step."""
    torch.manual_seed(0)
    proto = Net()
    ref, mod = copy.deepcopy(proto), copy.deepcopy(proto)
    ddp = DDP(ref)
    o_ref = OPTS["adam"](ref.parameters())
    sched, kw = schedule_for(mode, mod)
    o_usb = DistributedOptimizer(OPTS["adam"](mod.parameters()), mod, schedule=sched,
                                 verify=False, timeout=30, **kw)
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None for _ in "ab"]
    for side, (model, opt, sc) in enumerate(((ddp, o_ref, scalers[0]), (mod, o_usb, scalers[1]))):
        for step in range(4):
            x, y = batch(rank, step)
            skip = rank == 1 and step == 2
            if not (skip and side == 1):
                loss = F.mse_loss(model(x), y) * (0.0 if skip else 1.0)
                (loss if sc is None else sc.scale(loss)).backward()
            if sc is None:
                if side == 0:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                else:
                    o_usb.clip_grad_norm_(0.05)
                opt.step()
            else:
                sc.step(opt)
                sc.update()
            opt.zero_grad()
    o_usb.synchronize()
    return {"diff": max((a.detach() - b.detach()).abs().max().item()
                        for a, b in zip(ref.parameters(), mod.parameters()))}


SKIPPED = [(m, s) for m in ("zero1", "zero2") for s in (False, True)]


def wrapper_grad_scaler(rank: int, ws: int, mode: str) -> dict:
    """The DDP loop with GradScaler (``unscale_``, ``step``, ``update``), its DDP line changed
    to ``usbyte_opt.DistributedDataParallel``, in every mode: the scaler reads the taken-over
    optimizer's groups (in sharded mode the runtime shows it the gradient shards)."""
    import usbyte_opt

    torch.manual_seed(0)
    proto = Net()
    ref, mod = copy.deepcopy(proto), copy.deepcopy(proto)
    sched, kw = schedule_for(mode, mod)
    sides = []
    for net, wrap in ((ref, DDP), (mod, lambda m: usbyte_opt.DistributedDataParallel(
            m, schedule=sched, verify=False, **kw))):
        opt = OPTS["adam"](net.parameters())
        sides.append((wrap(net), opt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)))
    for model, opt, sc in sides:
        for step in range(STEPS):
            x, y = batch(rank, step)
            sc.scale(F.mse_loss(model(x), y) * (1e30 if step == 1 else 1.0)).backward()
            sc.unscale_(opt)
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    sides[1][0].optimizer.synchronize()
    return {"diff": max((a.detach() - b.detach()).abs().max().item()
                        for a, b in zip(ref.parameters(), mod.parameters())),
            "scales": (sides[0][2].get_scale(), sides[1][2].get_scale())}


def run_matrix(rank: int, ws: int) -> dict[str, dict]:
    out = {}
    for mode in MODES:
        try:
            out[f"wrapper GradScaler | {mode}"] = wrapper_grad_scaler(rank, ws, mode)
        except Exception as e:  # noqa: BLE001
            out[f"wrapper GradScaler | {mode}"] = {"error": f"{type(e).__name__}: {e}"}
    for mode, scaler in SKIPPED:
        key = f"skipped backward | {mode} | {'GradScaler' if scaler else 'clip'}"
        try:
            out[key] = skipped_backward(rank, ws, mode, scaler)
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    for name, pat in PATTERNS.items():
        for mode in MODES:
            if mode not in pat.outcome:
                continue
            key = f"{name} | {mode}"
            try:
                out[key] = run_pattern(name, mode, rank, ws)
            except UsbyteError as e:
                out[key] = {"refused": str(e)}
            except Exception as e:  # noqa: BLE001
                out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def matrix() -> list[dict[str, dict]]:
    res = run_local(run_matrix, 2, timeout_s=300, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in res]


CELLS = [(n, m) for n, p in PATTERNS.items() for m in MODES if m in p.outcome]


@pytest.mark.parametrize("name,mode", CELLS, ids=[f"{n} | {m}" for n, m in CELLS])
def test_hazard_matrix(matrix: list[dict[str, dict]], name: str, mode: str) -> None:
    expected = PATTERNS[name].outcome[mode]
    per_rank = [m[f"{name} | {mode}"] for m in matrix]
    for rank, got in enumerate(per_rank):
        assert "error" not in got, f"rank {rank}: {got['error']}"
        if expected == "refused":
            assert "refused" in got, f"rank {rank}: trained (diff {got.get('diff')}), expected " \
                                     "a refusal"
            assert "\n" not in got["refused"]
        else:
            assert "refused" not in got, f"rank {rank}: refused: {got['refused']}"
            assert got["diff"] == 0.0, f"rank {rank}: parameters differ from DDP by {got['diff']}"
            assert got["logs_equal"], f"rank {rank}: logged {got['logs'][1]}, DDP {got['logs'][0]}"
    if expected == "refused":
        assert per_rank[0]["refused"] == per_rank[1]["refused"].replace("rank 1", "rank 0")


@pytest.mark.parametrize("mode,scaler", SKIPPED)
def test_sharded_rank_that_skipped_backward_does_not_hang(matrix: list[dict[str, dict]], mode: str,
                                                          scaler: bool) -> None:
    key = f"skipped backward | {mode} | {'GradScaler' if scaler else 'clip'}"
    for rank, m in enumerate(matrix):
        got = m[key]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["diff"] < 1e-6, f"rank {rank}: parameters differ from DDP's by {got['diff']}"


@pytest.mark.parametrize("mode", MODES)
def test_wrapper_with_grad_scaler_equals_ddp(matrix: list[dict[str, dict]], mode: str) -> None:
    for rank, m in enumerate(matrix):
        got = m[f"wrapper GradScaler | {mode}"]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["diff"] == 0.0, f"rank {rank}: parameters differ from DDP's by {got['diff']}"
        assert got["scales"][0] == got["scales"][1]
