"""Start-up checks and failures across ranks: every rank ends with one clear error, quickly.

One spawned run of two gloo ranks plays the scenarios in order (the last one kills rank 1):

* a different schedule on rank 1;
* a model that does not match the schedule on rank 1 only;
* a schedule file missing on rank 1 only;
* rank 1 late to start-up, rank 0 with ``timeout=2``;
* rank 1 crashing in the middle of training.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from usbyte_opt.collectives.agree import RECORD_BYTES
from usbyte_opt.formats import save_schedule
from usbyte_opt.launcher import run_local
from usbyte_opt.planning.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer, profile_from_model, split_blocks
from usbyte_opt.runtime.default_plan import default_schedule

LIMIT_S = 60.0


def model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def attempt(fn) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        fn()
        out: dict[str, Any] = {"error": None}
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        out = {"error": type(e).__name__, "message": str(e)}
    out["seconds"] = time.perf_counter() - t0
    return out


def scenarios(rank: int, ws: int, side_file: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pb = Problem.from_profile(profile_from_model(m, ws))
    lay = pb.layout()
    planned = pb.schedule("split", lay, split_blocks(pb, lay, 2))

    # 1. Different schedules.
    mine = planned if rank == 0 else default_schedule(m, ws)
    out["different"] = attempt(lambda: DistributedOptimizer(opt, m, schedule=mine))

    # 2. Rank 1's model does not match the schedule.
    m2 = model() if rank == 0 else model(width=9)
    out["mismatch"] = attempt(lambda: DistributedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1), m2, schedule=planned))

    # 3. A schedule file missing on rank 1.
    path = os.path.join(tempfile.mkdtemp(), "s.json")
    if rank == 0:
        save_schedule(planned, path)
    out["missing_file"] = attempt(lambda: DistributedOptimizer(opt, m, schedule=path))

    # 4. Rank 1 late: rank 0 gives up after its timeout; only then (a marker file) does rank 1
    #    complete the exchange that rank 0 left behind, so the group stays usable.
    marker = side_file + ".timed-out"
    if rank == 0:
        out["late"] = attempt(lambda: DistributedOptimizer(opt, m, schedule=planned, timeout=2))
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + LIMIT_S
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        rec = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        dist.all_gather([torch.empty_like(rec) for _ in range(ws)], rec)
    dist.barrier()

    # 5. Rank 1 dies in the middle of training.
    with open(side_file + f".{rank}", "wb") as f:
        pickle.dump(out, f)
    m3 = model()
    o3 = DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.1), m3, schedule=planned,
                              timeout=LIMIT_S)

    def train() -> None:
        for step in range(10):
            if rank == 1 and step == 3:
                os._exit(0)
            m3(torch.randn(2, 4)).sum().backward()
            o3.step()
            o3.zero_grad()
        o3.synchronize()
    out["crash"] = attempt(train)
    return out


@pytest.fixture(scope="module")
def outcome() -> list[dict[str, Any]]:
    side = os.path.join(tempfile.mkdtemp(), "side")
    res = run_local(scenarios, 2, args=(side,), timeout_s=150, pg_timeout_s=LIMIT_S)
    assert res[0].ok, f"{res[0].error_type}: {res[0].error}\n{res[0].trace}"
    assert res[1].error_type == "exit"  # it crashed on purpose in scenario 5
    with open(side + ".1", "rb") as f:
        rank1 = pickle.load(f)
    return [res[0].value, rank1]


def test_different_schedule_raises_on_every_rank(outcome):
    for out in outcome:
        got = out["different"]
        assert got["error"] == "DistributedError", got
        assert "the schedule differs across ranks" in got["message"]
        assert got["seconds"] < LIMIT_S
        assert "\n" not in got["message"]


def test_model_mismatch_on_one_rank_raises_everywhere(outcome):
    r0, r1 = outcome[0]["mismatch"], outcome[1]["mismatch"]
    assert r1["error"] == "MismatchError", r1
    assert "tensor '0.weight': expected shape [8, 4] (schedule), got [9, 4] (model)" in r1["message"]
    assert r0["error"] == "DistributedError", r0
    assert "rank 1 failed its start-up check" in r0["message"] and "'0.weight'" in r0["message"]


def test_missing_file_on_one_rank_raises_everywhere(outcome):
    assert outcome[1]["missing_file"]["error"] == "FormatError"
    assert "expected an existing file" in outcome[1]["missing_file"]["message"]
    assert outcome[0]["missing_file"]["error"] == "DistributedError"


def test_late_rank_times_out_with_clear_error(outcome):
    got = outcome[0]["late"]
    assert got["error"] == "DistributedError", got
    assert "start-up check" in got["message"] and "timed out" in got["message"].lower()
    assert got["seconds"] < 10


def test_peer_crash_is_an_error_not_a_hang(outcome):
    got = outcome[0]["crash"]
    assert got["error"] == "DistributedError", got
    assert got["message"].startswith("rank 0: ")
    assert got["seconds"] < LIMIT_S

