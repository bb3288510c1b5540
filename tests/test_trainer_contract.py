"""What the trainer integrations build on: DDP's gradient contract (``wait_in_backward``),
DDP's accumulation protocol (``no_sync()``), the refusal of a model under DDP or FSDP on
every rank, and stock DDP with planned buckets from any place that builds DDP
(``planned_ddp_kwargs``, ``find_unused_parameters``, the bucket check after the rebuild).
Two gloo ranks, real DDP side by side: one spawned run plays every scenario in turn (each
with its own models, optimizers and DDP wrappers; an optimizer left open is released after
its scenario, as at the end of a process), since starting the ranks costs more than most
scenarios."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import Scenarios, play, played
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt import ddp as uddp
from usbyte_opt.errors import MismatchError, UsbyteError
from usbyte_opt.launcher import RankResult, run_local
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks
from usbyte_opt.runtime import DistributedOptimizer, UsbyteWarning, profile_from_model
from usbyte_opt.runtime.default_plan import split_blocks

needs_list = pytest.mark.skipif(not uddp.supports_bucket_list(),
                                reason="torch without bucket_cap_mb_list")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 16, 64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Nested(Net):
    """A root whose forward calls itself (as a step function calling ``self(x)``): the root
    hooks must act once, around the outer call."""

    def forward(self, x, outer: bool = True):
        return self(x, outer=False) if outer else super().forward(x)


def schedule(model: nn.Module, ws: int, mode: str, split: int = 0):
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    blocks = (split_blocks(pb, lay, split) if split else
              bucket_blocks(pb, lay, first_bucket_bytes=4000, bucket_cap_bytes=20000))
    return dataclasses.replace(pb.schedule("test", lay, blocks), mode=mode)


def batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Parameters on every rank; buffers on rank 0 (DDP's other ranks keep their last own
    statistics, the runtime installs rank 0's everywhere)."""
    ps = [(p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())]
    if torch.distributed.get_rank() == 0:
        ps += [(p.float() - q.float()).abs().max().item() for p, q in zip(a.buffers(), b.buffers())]
    return max(ps)


# --------------------------------------------------------------------------------------------
# wait_in_backward and no_sync: a trainer's loop (accumulation 3, clip at 1.0 with torch's
# own clip_grad_norm_ right after backward, the norm read) against DDP doing the same
# --------------------------------------------------------------------------------------------


def trainer_loop(rank: int, ws: int, mode: str, split: int, nested: bool = False) -> dict:
    base = Nested() if nested else Net()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(b)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt = DistributedOptimizer(oa, a, schedule=schedule(a, ws, mode, split), verify=False,
                               wait_in_backward=True)
    accum, norms, grads_equal = 3, [], True
    for i in range(8 * accum):
        x, y = batch(rank, i)
        sync = (i + 1) % accum == 0
        for net, ctx in ((a, opt.no_sync), (ref, ref.no_sync)):
            with contextlib.nullcontext() if sync else ctx():
                (F.cross_entropy(net(x), y) / accum).backward()
        # between the passes of an accumulation: a learning-rate read and a synchronize()
        # (a validation run) leave the accumulation alone
        assert opt.param_groups[0]["lr"] == 1e-2
        if not sync and i % 5 == 0:
            opt.synchronize()
        if sync:
            # p.grad read right after backward(): the average, as under DDP
            grads_equal &= all(torch.equal(p.grad, q.grad)
                               for p, q in zip(a.parameters(), b.parameters()))
            na = torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
            nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
            norms.append((na.item(), nb.item()))
            opt.step(); oa.zero_grad()
            ob.step(); ob.zero_grad()
    opt.synchronize()
    return {"diff": max_diff(a, b), "grads_equal": grads_equal, "norms": norms,
            "calls": opt.optimizer_calls}


LOOPS = [("overlap", 3, False), ("fence", 0, False), ("overlap", 2, True)]


@pytest.mark.parametrize("mode, split, nested", LOOPS)
def test_wait_in_backward_and_no_sync_train_like_ddp_in_a_trainers_loop(outcomes, mode, split, nested):
    for r in outcomes(f"trainer_loop-{mode}-{split}-{nested}"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["grads_equal"]
        assert all(x == y for x, y in r.value["norms"]), r.value["norms"]
        assert r.value["diff"] == 0.0
        assert r.value["calls"] == 8


def late_backward(rank: int, ws: int) -> str:
    m = Net()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=schedule(m, ws, "overlap", 2), verify=False)
    x, y = batch(rank, 0)
    F.cross_entropy(m(x), y).backward()
    try:
        F.cross_entropy(m(x), y).backward()   # a second pass outside no_sync()
    except UsbyteError as e:
        return str(e)
    finally:
        opt.close()
    return ""


def test_a_second_backward_outside_no_sync_names_no_sync(outcomes):
    for r in outcomes("late_backward"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert "no_sync()" in r.value and "\n" not in r.value


# --------------------------------------------------------------------------------------------
# A model under DDP or FSDP: one clear error on every rank, no hang
# --------------------------------------------------------------------------------------------


def misuse(rank: int, ws: int, how: str) -> str:
    m = Net()
    sched = schedule(m, ws, "overlap", 2)
    try:
        if how == "ddp":
            DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), DDP(m), schedule=sched)
        elif how == "inside":   # a DDP built first, the runtime after it, a forward through it
            d = DDP(m)
            opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                                       schedule=sched, verify=False)
            x, y = batch(rank, 0)
            try:
                F.cross_entropy(d(x), y).backward()
            finally:
                opt.close()
        elif how == "later":   # a trainer wraps the model after the optimizer was built
            opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                                       schedule=sched, verify=False)
            wrapped = DDP(m)
            x, y = batch(rank, 0)
            try:
                F.cross_entropy(wrapped(x), y).backward()
            finally:
                opt.close()
        elif how == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(m)
            DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule=sched)
    except UsbyteError as e:
        return str(e)
    return ""


MISUSES = [
    ("ddp", "the model is wrapped in DistributedDataParallel"),
    ("inside", "runs inside DistributedDataParallel"),
    ("later", "runs inside DistributedDataParallel"),
    ("fsdp2", "FSDP2"),
]


@pytest.mark.parametrize("how, match", MISUSES)
def test_a_model_under_ddp_or_fsdp_is_refused_on_every_rank(outcomes, how, match):
    rs = outcomes(f"misuse-{how}")
    for r in rs:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert match in r.value, r.value
        assert "\n" not in r.value
    assert len({r.value for r in rs}) == 1   # the same error on every rank


# --------------------------------------------------------------------------------------------
# Stock DDP with planned buckets from anywhere: planned_ddp_kwargs, find_unused_parameters,
# the check at the iteration the docs name, and the check by itself after the rebuild
# --------------------------------------------------------------------------------------------


class Chain(nn.Module):
    """Gradients become ready exactly in reverse registration order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(F.relu(self.l0(x)))))))


def tuned(model: nn.Module, ws: int):
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    blocks = bucket_blocks(pb, lay, first_bucket_bytes=5000, bucket_cap_bytes=9000)
    return dataclasses.replace(pb.schedule("ddp-tuned", lay, blocks), mode="fence")


def stock(rank: int, ws: int, find_unused: bool) -> dict:
    base = Chain()
    sched = tuned(base, ws)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    kw = uddp.planned_ddp_kwargs(sched, a, find_unused_parameters=find_unused)
    da, db = DDP(a, **kw), DDP(b, find_unused_parameters=find_unused)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    early = ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UsbyteWarning)   # watch_buckets would warn
        uddp.watch_buckets(da, sched)
        for i in range(2):
            if i == 1 and not find_unused:
                try:
                    uddp.check_buckets(da, sched)
                except MismatchError as e:
                    early = str(e)
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + i))
            for net, o in ((da, oa), (db, ob)):
                net(x).pow(2).mean().backward()
                o.step(); o.zero_grad()
        uddp.check_buckets(da, sched)       # right after the second iteration
    return {"sizes": uddp.rebuilt_bucket_sizes(da), "early": early, "kw": sorted(kw),
            "planned": [(k.end - k.start) * 4 for k in sched.blocks], "diff": max_diff(a, b)}


@needs_list
@pytest.mark.parametrize("find_unused", [False, True])
def test_planned_ddp_kwargs_give_the_planned_buckets_with_or_without_find_unused(outcomes, find_unused):
    for r in outcomes(f"stock-{find_unused}"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert len(r.value["planned"]) >= 2
        assert r.value["sizes"] == r.value["planned"]
        assert r.value["diff"] == 0.0
        if not find_unused:
            assert "has not rebuilt its buckets yet" in r.value["early"]


class Shuffled(nn.Module):
    """Registered in an order the gradients do not follow."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, 16)
        self.early = nn.Linear(16, 16)

    def forward(self, x):
        return self.late(F.relu(self.early(x)))


@needs_list
def test_find_unused_parameters_with_another_ready_order_is_refused_in_one_line():
    # the synthetic profile's ready order is Shuffled's registration order reversed
    # (early, late), while its gradients really come late first: a plan for a reordered
    # model, given to DDP's registration-order buckets
    plan = Shuffled()
    s = tuned(plan, 2)
    swapped = Shuffled()
    swapped.late, swapped.early = swapped.early, swapped.late
    swapped._modules = dict(reversed(list(swapped._modules.items())))
    with pytest.raises(UsbyteError, match="find_unused_parameters=True: DDP then never rebuilds") as e:
        uddp.planned_ddp_kwargs(s, swapped, find_unused_parameters=True)
    assert "\n" not in str(e.value) and "position 0" in str(e.value)
    with pytest.raises(UsbyteError, match="pass the model"):
        uddp.planned_ddp_kwargs(s, find_unused_parameters=True)
    assert uddp.planned_ddp_kwargs(s, plan, find_unused_parameters=True)["find_unused_parameters"]


def mismatch_warns(rank: int, ws: int) -> list[str]:
    m = Chain()
    s = tuned(m, ws)
    s = dataclasses.replace(s, blocks=(dataclasses.replace(s.blocks[0], end=s.blocks[1].end),
                                       *s.blocks[2:]))   # one bucket fewer than DDP will build
    kw = uddp.planned_ddp_kwargs(tuned(m, ws))
    d = DDP(m, **kw)
    uddp.watch_buckets(d, s)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(4):
            d(torch.randn(4, 32)).sum().backward()
    return [str(x.message) for x in w if issubclass(x.category, UsbyteWarning)]


@needs_list
def test_watch_buckets_warns_once_after_the_rebuild(outcomes):
    for r in outcomes("mismatch_warns"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert len(r.value) == 1 and "the schedule planned" in r.value[0]


def test_expressible_says_why_not():
    m = Chain()
    s = tuned(m, 2)
    assert uddp.expressible(s) == ("" if uddp.supports_bucket_list() else uddp.expressible(s))
    assert "mode" in uddp.expressible(dataclasses.replace(s, mode="overlap"))


def no_caps(rank: int, ws: int) -> str:
    m = Chain()
    d = DDP(m)   # built without the planned caps
    for _ in range(2):
        d(torch.randn(4, 32)).sum().backward()
    try:
        uddp.check_buckets(d, tuned(m, ws))
    except MismatchError as e:
        return str(e)
    return ""


@needs_list
def test_check_buckets_names_a_ddp_built_without_the_caps(outcomes):
    for r in outcomes("no_caps"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert "built without the schedule's bucket_cap_mb_list" in r.value, r.value


# --------------------------------------------------------------------------------------------
# The one spawned run
# --------------------------------------------------------------------------------------------


def scenarios() -> Scenarios:
    """The scenarios of the spawned run, in the order they run."""
    out: Scenarios = {}
    for mode, split, nested in LOOPS:
        out[f"trainer_loop-{mode}-{split}-{nested}"] = (trainer_loop, (mode, split, nested))
    out["late_backward"] = (late_backward, ())
    for how, _ in MISUSES:
        out[f"misuse-{how}"] = (misuse, (how,))
    if uddp.supports_bucket_list():
        for find_unused in (False, True):
            out[f"stock-{find_unused}"] = (stock, (find_unused,))
        out["mismatch_warns"] = (mismatch_warns, ())
        out["no_caps"] = (no_caps, ())
    return out


@pytest.fixture(scope="module")
def outcomes() -> Callable[[str], list[RankResult]]:
    """``outcomes(name)``: one :class:`RankResult` per rank for that scenario."""
    return played(run_local(play, 2, args=(scenarios(),), timeout_s=600, pg_timeout_s=60))
