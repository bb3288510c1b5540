"""Sharded mode's checkpoints: ``opt.sharded_state_dict()`` through
``torch.distributed.checkpoint`` (each rank saves and loads its own pieces, bitwise, training
continued after the load equal to DDP's), and a collective state-dict call made on one rank
alone failing in one line on every rank within the optimizer's timeout.

Every case runs in one spawned pair of gloo ranks.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tests.test_sharded as ts
from tests.test_runtime_equivalence import OPTIMIZERS, SmallCNN, image_batch, max_diff, mse
from usbyte_opt.errors import UsbyteError
from usbyte_opt.launcher import run_local
from usbyte_opt.runtime import DistributedOptimizer


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested) state dict."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    """The two (sharded) optimizers' states are equal, bitwise, key by key."""
    sa = [a.state.get(p, {}) for g in a.param_groups for p in g["params"]]
    sb = [b.state.get(p, {}) for g in b.param_groups for p in g["params"]]
    return len(sa) == len(sb) and all(
        x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k]))
                                     for k in x)
        for x, y in zip(sa, sb))


def case_roundtrip(opt_name: str, stage: int, root: str, rank: int, ws: int) -> dict:
    """Train 4 steps; dcp.save the model and opt.sharded_state_dict(); a fresh model and
    sharded optimizer dcp.load them; all three (DDP, the sharded run going on, the loaded one)
    continue 3 steps."""
    ts.ZERO_STAGE = stage
    make = OPTIMIZERS[opt_name]
    out = ts.train(SmallCNN, make, image_batch, rank, ws, steps=4)
    ref, mod, o_ref, o_usb, ddp = out["ref"], out["mod"], out["o_ref"], out["o_usb"], out["ddp"]
    path = os.path.join(root, f"{opt_name}-{stage}")
    sd = o_usb.sharded_state_dict()
    res: dict[str, Any] = {"diff": out["diff"], "saved_bytes": tensor_bytes(sd),
                           "shard_bytes": ts.state_bytes(o_usb.optimizer),
                           "plain_bytes": ts.state_bytes(o_ref),
                           "own_tensors": all(any(v is x for st in o_usb.optimizer.state.values()
                                                  for x in st.values())
                                              for v in sd["state"].values())}
    dcp.save({"model": mod.state_dict(), "optim": sd}, checkpoint_id=path)
    torch.manual_seed(100 + rank)
    fresh = SmallCNN()
    o2 = ts.usb(make(fresh.parameters()), fresh, verify=False,
                schedule=ts.SHARDED_CROSSCUT(fresh, ws))
    tmpl = {"model": fresh.state_dict(), "optim": o2.sharded_state_dict()}
    res["template_bytes"] = tensor_bytes(tmpl["optim"])
    dcp.load(tmpl, checkpoint_id=path)
    fresh.load_state_dict(tmpl["model"])
    o2.load_sharded_state_dict(tmpl["optim"])
    res["same_state"] = same_state(o_usb.optimizer, o2.optimizer)
    for step in range(4, 7):
        x, y = image_batch(rank, step)
        for m, o in ((ddp, o_ref), (mod, o_usb), (fresh, o2)):
            mse(m(x), y).backward()
            o.step()
            o.zero_grad()
    o_usb.synchronize()
    o2.synchronize()
    res["continued_diff"] = max(max_diff(ref, fresh), max_diff(mod, fresh))
    for o in (o_usb, o2):
        o.close()
    return res


def case_absent_and_refused(root: str, rank: int, ws: int) -> dict:
    """A fresh optimizer's dict (no state yet, every piece flagged absent) saved and loaded
    into a trained one leaves it without state; a dict of another layout is refused in one
    line."""
    ts.ZERO_STAGE = 1
    out = ts.train(SmallCNN, OPTIMIZERS["adam"], image_batch, rank, ws, steps=2)
    o_usb, mod = out["o_usb"], out["mod"]
    m2 = SmallCNN()
    fresh = ts.usb(OPTIMIZERS["adam"](m2.parameters()), m2, verify=False,
                   schedule=ts.SHARDED_CROSSCUT(m2, ws))
    path = os.path.join(root, "blank")
    blank = fresh.sharded_state_dict()
    dcp.save({"optim": blank}, checkpoint_id=path)
    tmpl = {"optim": o_usb.sharded_state_dict()}
    had = len(o_usb.optimizer.state)
    dcp.load(tmpl, checkpoint_id=path)
    o_usb.load_sharded_state_dict(tmpl["optim"])
    res: dict[str, Any] = {"had": had, "after": len(o_usb.optimizer.state),
                           "present": int(blank[f"present.{rank}"].sum())}
    other = dict(tmpl["optim"])
    other["layout"] = {**other["layout"], "world_size": 4}
    try:
        o_usb.load_sharded_state_dict(other)
        res["refused"] = ""
    except UsbyteError as e:
        res["refused"] = str(e)
    del mod
    fresh.close()
    o_usb.close()
    return res


def case_lone_state_dict(rank: int, ws: int) -> dict:
    """``if rank == 0: save(opt.state_dict())``: rank 0 (timeout 3 s) raises within its
    timeout; rank 1 (no timeout of its own: the process group's 60 s) goes on training and
    fails in its next step's wait, as soon as rank 0 gives up, naming the cause."""
    ts.ZERO_STAGE = 1
    m = SmallCNN()
    o = DistributedOptimizer(OPTIMIZERS["adam"](m.parameters()), m, verify=False,
                             timeout=3 if rank == 0 else None,
                             schedule=ts.SHARDED_CROSSCUT(m, ws))
    x, y = image_batch(rank, 0)
    mse(m(x), y).backward()
    o.step()
    t = time.monotonic()
    msg = ""
    try:
        if rank == 0:
            o.state_dict()
        else:
            for step in range(1, 4):
                x, y = image_batch(rank, step)
                mse(m(x), y).backward()
                o.step()
    except UsbyteError as e:
        msg = str(e)
    return {"msg": msg, "s": time.monotonic() - t}


CASES: dict[str, Callable[[str, int, int], dict]] = {
    "adam-zero1": lambda root, r, w: case_roundtrip("adam", 1, root, r, w),
    "sgd_momentum-zero2": lambda root, r, w: case_roundtrip("sgd_momentum", 2, root, r, w),
    "adamw_wd-zero1": lambda root, r, w: case_roundtrip("adamw_wd", 1, root, r, w),
    "absent": case_absent_and_refused,
    "lone": lambda root, r, w: case_lone_state_dict(r, w),   # last: its optimizer is broken
}


def run_cases(rank: int, ws: int, root: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        try:
            out[name] = case(root, rank, ws)
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    with tempfile.TemporaryDirectory(prefix="usbyte-dcp-") as root:
        res = run_local(run_cases, 2, args=(root,), timeout_s=180, pg_timeout_s=60)
    for r in res:
        assert r.error_type is None, r.error
    return [r.value for r in res]


@pytest.mark.parametrize("case", ["adam-zero1", "sgd_momentum-zero2", "adamw_wd-zero1"])
def test_dcp_round_trip_is_bitwise_and_holds_only_the_shard(results: list[dict[str, dict]],
                                                             case: str) -> None:
    for r in results:
        got = r[case]
        assert "error" not in got, got
        assert got["diff"] == 0.0
        assert got["same_state"]
        assert got["continued_diff"] == 0.0
        # What DCP is given per rank: the shard's own state tensors (no copy), plus one
        # int8 flag per piece; about half of the unsharded state on 2 ranks.
        assert got["own_tensors"]
        assert got["shard_bytes"] <= got["saved_bytes"] <= got["shard_bytes"] + 64
        assert got["template_bytes"] == got["saved_bytes"]
        assert got["saved_bytes"] < 0.6 * got["plain_bytes"]


def test_dcp_absent_state_and_another_layout(results: list[dict[str, dict]]) -> None:
    for r in results:
        got = r["absent"]
        assert "error" not in got, got
        assert got["had"] > 0 and got["after"] == 0 and got["present"] == 0
        assert got["refused"].startswith("sharded state dict: saved with world_size 4, this "
                                         "run has 2: load it with the same world size"), got
        assert len(got["refused"].splitlines()) == 1


def test_state_dict_on_one_rank_alone_fails_on_every_rank_soon(
        results: list[dict[str, dict]]) -> None:
    r0, r1 = results[0]["lone"], results[1]["lone"]
    assert r0["msg"].startswith("rank 0: opt.state_dict() called on this rank alone: in sharded "
                                "mode it is a collective (it gathers every rank's shards): call "
                                "it on every rank and save on rank 0; rank 1 did not call it "
                                "within 3 s"), r0
    assert "rank 0 called opt.state_dict() alone" in r1["msg"] and \
        r1["msg"].startswith("rank 1: "), r1
    for r in (r0, r1):
        assert len(r["msg"].splitlines()) == 1
        assert r["s"] < 20, r   # the process group's own timeout is 60 s
