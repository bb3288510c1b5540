"""Stock DDP with planned buckets (usbyte_opt.ddp): exactly the planned buckets, DDP's training,
and a clear refusal of schedules DDP cannot express."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt import ddp as uddp
from usbyte_opt.errors import UsbyteError
from usbyte_opt.formats import Block
from usbyte_opt.launcher import run_local
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks
from usbyte_opt.runtime import profile_from_model
from usbyte_opt.runtime.default_plan import split_blocks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def planned(model: nn.Module, ws: int = 2, mode: str = "fence", blocks=None):
    pb = Problem.from_profile(profile_from_model(model, ws))
    lay = pb.layout()
    if blocks is None:
        blocks = bucket_blocks(pb, lay, first_bucket_bytes=2000, bucket_cap_bytes=40000)
    elif callable(blocks):
        blocks = blocks(pb, lay)
    return dataclasses.replace(pb.schedule("test", lay, blocks), mode=mode)


def train_side_by_side(rank: int, ws: int) -> dict:
    m = mlp()
    sched = planned(m, ws)
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    tuned, plain = uddp.wrap(a, sched), DDP(b)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for i in range(8):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + i))
        for net, o in ((tuned, oa), (plain, ob)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    uddp.check_buckets(tuned, sched)
    return {"rebuilt": uddp.rebuilt_bucket_sizes(tuned),
            "planned": [(k.end - k.start) * 4 for k in sched.blocks],
            "diff": max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))}


@pytest.mark.skipif(not uddp.supports_bucket_list(), reason="torch without bucket_cap_mb_list")
def test_wrap_builds_the_planned_buckets_and_trains_like_ddp():
    for r in run_local(train_side_by_side, 2, timeout_s=120):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert len(r.value["planned"]) == 3
        assert r.value["rebuilt"] == r.value["planned"]
        assert r.value["diff"] == 0.0


@pytest.mark.parametrize("case, match", [
    ("overlap", r"mode: expected \"fence\""),
    ("cut", r"blocks\[\d+\]: expected whole tensors"),
    ("order", r"blocks\[0\]: expected a block starting at element 0"),
    ("dtypes", r"buffers: expected one buffer"),
])
def test_schedules_ddp_cannot_express_are_refused_in_one_line(case, match):
    m = mlp()
    if case == "overlap":
        s = planned(m, mode="overlap")
    elif case == "cut":
        s = planned(m, blocks=lambda pb, lay: split_blocks(pb, lay, 2))
    elif case == "order":
        s0 = planned(m)
        s = dataclasses.replace(s0, blocks=tuple(reversed(s0.blocks)))
    else:
        m[4].to(torch.float64)
        s = planned(m)
    with pytest.raises(UsbyteError, match=match) as e:
        uddp.wrap(m, s)
    assert "\n" not in str(e.value)


def test_bucket_arguments_conflict_with_the_schedule():
    m = mlp()
    with pytest.raises(UsbyteError, match="bucket_cap_mb: the schedule gives the buckets"):
        uddp.wrap(m, planned(m), bucket_cap_mb=10)


def test_caps_sit_just_under_each_bucket():
    s = planned(mlp())
    caps = uddp.bucket_caps_mb(s)
    sizes = [(k.end - k.start) * 4 for k in s.blocks]
    assert [int(c * 2**20) for c in caps] == [b - 1 for b in sizes]
    assert all(isinstance(k, Block) for k in s.blocks)
