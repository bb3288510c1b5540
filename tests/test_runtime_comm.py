"""The runtime's all-reduce channel on gloo: one block in flight, in issue order."""

from __future__ import annotations

import threading

import torch

from usbyte_opt.runtime.comm import Channel
from usbyte_opt.runtime.local import run_local


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


def test_blocks_run_one_at_a_time_in_issue_order():
    res = run_local(completion_order, 2, args=(True,), timeout_s=120, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["serial"]
        # A later block never finishes before an earlier one: gloo runs them on one thread.
        assert r.value["orders"] == [["big", "small"]] * 3
        # Averaged over the ranks (pre-divided, then summed): (1 + 2) / 2.
        assert r.value["values"] == [(1.5, 1.5)] * 3


def test_two_in_flight_on_request():
    res = run_local(completion_order, 2, args=(False,), timeout_s=120, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert not r.value["serial"]
        assert r.value["values"] == [(1.5, 1.5)] * 3
