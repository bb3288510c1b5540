"""The runtime's all-reduce channel on gloo: one block in flight, in issue order."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from helpers import play, played

from usbyte_opt.launcher import RankResult, run_local
from usbyte_opt.runtime.comm import Channel


def completion_order(rank: int, ws: int, serial: bool) -> dict:
    """Issue a big block, then a small one, three times; the order their futures complete."""
    chan = Channel(None, torch.device("cpu"), None, serial)
    orders, values = [], []
    for _ in range(3):
        big = torch.full((4 * 2**20,), float(rank + 1))   # 16 MB
        small = torch.full((256,), float(rank + 1))
        done: list[str] = []
        lock = threading.Lock()

        def note(name: str):
            def cb(_f):
                with lock:
                    done.append(name)
            return cb
        w_big = chan.all_reduce_block(big)
        w_small = chan.all_reduce_block(small)
        w_big.get_future().add_done_callback(note("big"))
        w_small.get_future().add_done_callback(note("small"))
        chan.wait(w_big, "big")
        chan.wait(w_small, "small")
        w_big.get_future().wait()
        w_small.get_future().wait()
        orders.append(list(done))
        values.append((big[0].item(), small[-1].item()))
    return {"serial": chan.serial is not None, "orders": orders, "values": values}


@pytest.fixture(scope="module")
def orders() -> Callable[[str], list[RankResult]]:
    """:func:`completion_order` with one block in flight (``serial``) and with two, in one
    spawned run of two ranks."""
    return played(run_local(play, 2, args=({"serial": (completion_order, (True,)),
                                            "two": (completion_order, (False,))},),
                            timeout_s=180, pg_timeout_s=60))


def test_blocks_run_one_at_a_time_in_issue_order(orders):
    for r in orders("serial"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["serial"]
        # A later block never finishes before an earlier one: gloo runs them on one thread.
        assert r.value["orders"] == [["big", "small"]] * 3
        # Summed over the ranks (the runtime scales gradients as it puts them in the buffers).
        assert r.value["values"] == [(3.0, 3.0)] * 3


def test_two_in_flight_on_request(orders):
    for r in orders("two"):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert not r.value["serial"]
        assert r.value["values"] == [(3.0, 3.0)] * 3


def threads() -> int:
    import os
    return len(os.listdir("/proc/self/task"))


def release_at_exit(rank: int, ws: int) -> dict:
    """Train, then run the exit hook while rank 1 holds back its blocks: with no grace it
    leaves the optimizer alone (a collective in flight); with the default grace it waits for
    rank 1 and releases the channel. ``synchronize()`` leaves nothing in flight."""
    import time

    from usbyte_opt.errors import UsbyteError
    from usbyte_opt.runtime import DistributedOptimizer, default_schedule
    from usbyte_opt.runtime.exit_hook import OPEN as _OPEN
    from usbyte_opt.runtime.exit_hook import release_at_exit as _release_at_exit

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m, ws))
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.synchronize()
    # Blocks, usage map, buffers: all finished.
    idle = all(w.is_completed() for w in opt._state.comm.in_flight())
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(1.0)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()                       # the last call of a script: nothing waits for the blocks
    kept = None
    if rank == 0:                    # rank 1 has not issued yet: in flight, left alone
        _release_at_exit(0.0)
        kept = opt._chan.serial is not None and opt in _OPEN
    before = threads()
    _release_at_exit()               # waits for rank 1's blocks, then releases
    after = threads()
    try:
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        closed_error = None
    except UsbyteError as e:
        closed_error = str(e)
    return {"idle": idle, "kept": kept, "released": opt._chan.serial is None and opt not in _OPEN,
            "threads": (before, after), "closed_error": closed_error}


def test_exit_hook_waits_for_collectives_then_releases_the_one_thread_group():
    res = run_local(release_at_exit, 2, timeout_s=120, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        v = r.value
        assert v["idle"]
        if r.rank == 0:
            assert v["kept"] is True
        assert v["released"]
        before, after = v["threads"]
        assert after < before       # the group's worker (and its device loop) joined
        assert "closed DistributedOptimizer" in v["closed_error"]
