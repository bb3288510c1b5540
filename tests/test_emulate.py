"""The emulated interconnect (usbyte_opt.collectives.emulate): the spec, the link's model,
the host link's order and timing, the DDP hook and the runtime's issuer at world size 1.

Timing checks are functional, not benchmarks: lower bounds are tight (the link never
finishes early), upper bounds loose (a loaded two-core machine wakes threads late).
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt.collectives.agree import wait as agree_wait
from usbyte_opt.collectives.emulate import (
    DEFAULT_ALPHA_S,
    EmulatedHookState,
    EmulatedLink,
    LinkSpec,
    emulated_allreduce_hook,
    emulated_sum_issuer,
    install_on_channel,
    parse_emulate,
)
from usbyte_opt.errors import DistributedError, UsageError, UsbyteError

# ------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, ranks, bits, alpha", [
    ("8x1gbit", 8, 1e9, DEFAULT_ALPHA_S),
    ("16x25gbit", 16, 25e9, DEFAULT_ALPHA_S),
    ("128x100gbit", 128, 100e9, DEFAULT_ALPHA_S),
    ("4x200mbit", 4, 200e6, DEFAULT_ALPHA_S),
    ("8x1gbit@50us", 8, 1e9, 50e-6),
    ("2x1.5Gbit/s@0.2ms", 2, 1.5e9, 200e-6),
    (" 4 x 500kbit @ 0us ", 4, 500e3, 0.0),
    ("3x1tbit@1s", 3, 1e12, 1.0),
])
def test_parse_good(text, ranks, bits, alpha):
    s = parse_emulate(text)
    assert (s.ranks, s.bytes_per_s, s.alpha_s) == (ranks, pytest.approx(bits / 8), pytest.approx(alpha))
    assert parse_emulate(str(s)) == s     # str() gives the spec back


@pytest.mark.parametrize("text, expected", [
    ("", "expected RANKSxRATE[@ALPHA]"),
    ("8x1GB", "expected RANKSxRATE[@ALPHA]"),        # bytes: refused
    ("8x1gbps", "expected RANKSxRATE[@ALPHA]"),
    ("8x1gbit@5", "expected RANKSxRATE[@ALPHA]"),    # alpha without a unit
    ("8x1gbit@-5us", "expected RANKSxRATE[@ALPHA]"),
    ("x1gbit", "expected RANKSxRATE[@ALPHA]"),
    ("8", "expected RANKSxRATE[@ALPHA]"),
    ("1x1gbit", "expected at least 2 ranks, got 1"),
    ("8x0gbit", "expected a finite link rate above 0"),
])
def test_parse_bad_is_one_line_naming_the_value(text, expected):
    with pytest.raises(UsageError) as e:
        parse_emulate(text)
    assert isinstance(e.value, UsbyteError)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"--emulate {text!r}: ") and expected in msg
    with pytest.raises(UsbyteError, match=r"^emulated link spec '8x1GB': "):
        parse_emulate("8x1GB", what="emulated link spec")


@pytest.mark.parametrize("n", [2, 3, 8, 128])
def test_link_spec_ring_bytes(n):
    s = LinkSpec(n, 1e9, 0.0)
    b = 3_000_000
    assert s.allreduce_s(b) == pytest.approx(2 * (n - 1) / n * b / 1e9)
    assert s.reduce_scatter_s(b) == pytest.approx((n - 1) / n * b / 1e9)
    assert s.all_gather_s(b) == pytest.approx((n - 1) / n * b / 1e9)
    # An all-reduce is a reduce-scatter and an all-gather, less one alpha.
    a = LinkSpec(n, 1e9, 1e-4)
    assert a.allreduce_s(b) + a.alpha_s == pytest.approx(a.reduce_scatter_s(b) + a.all_gather_s(b))
    assert a.allreduce_s(0) == a.alpha_s
    assert a.collective_s("all-gather", b) == a.all_gather_s(b)


def test_link_spec_examples_and_bad_values():
    s = parse_emulate("8x1gbit@50us")                    # 125 MB/s
    assert s.allreduce_s(125_000_000) == pytest.approx(50e-6 + 1.75)
    assert s.reduce_scatter_s(125_000_000) == pytest.approx(50e-6 + 0.875)
    for bad in [dict(ranks=1, bytes_per_s=1.0, alpha_s=0.0), dict(ranks=2, bytes_per_s=0.0, alpha_s=0.0),
                dict(ranks=2, bytes_per_s=float("inf"), alpha_s=0.0),
                dict(ranks=2, bytes_per_s=1.0, alpha_s=-1.0)]:
        with pytest.raises(UsbyteError):
            LinkSpec(**bad)
    with pytest.raises(UsbyteError, match="collective 'broadcast'"):
        s.collective_s("broadcast", 1)
    with pytest.raises(UsbyteError, match="bytes >= 0"):
        s.allreduce_s(-1)


# ------------------------------------------------------------------------------------------
# The host link
# ------------------------------------------------------------------------------------------


def test_host_link_serial_order_and_timing():
    n, d = 5, 0.005
    done: list[tuple[int, float]] = []
    lock = threading.Lock()
    with EmulatedLink() as link:
        t0 = time.perf_counter()
        works = [link.submit(d, value=i) for i in range(n)]
        for i, w in enumerate(works):
            w.get_future().add_done_callback(
                lambda f, i=i: (lock.acquire(), done.append((i, time.perf_counter())), lock.release()))
        for w in works:
            assert w.wait() is True
        elapsed = time.perf_counter() - t0
        assert link.count == n and link.submitted_s == pytest.approx(n * d)
    assert [w.get_future().wait() for w in works] == list(range(n))
    # One after another, each d long on the schedule, in issue order, never early.
    assert works[0].start_s >= t0
    for a, b in zip(works, works[1:]):
        assert b.start_s == pytest.approx(a.end_s, abs=1e-9)
    for w in works:
        assert w.end_s - w.start_s == pytest.approx(d, abs=1e-9)
    assert [i for i, _ in done] == list(range(n))
    assert all(t >= w.end_s for (_, t), w in zip(done, works))
    assert elapsed >= n * d
    assert elapsed < n * d + 0.25


def test_host_link_sub_millisecond_times():
    n, d = 40, 300e-6
    with EmulatedLink() as link:
        t0 = time.perf_counter()
        works = [link.submit(d) for _ in range(n)]
        works[-1].wait()
        elapsed = time.perf_counter() - t0
    assert all(w.is_completed() for w in works)
    assert elapsed >= n * d
    assert elapsed < n * d + 0.1


def test_host_link_starts_after_the_real_work_and_when_idle():
    real: torch.futures.Future = torch.futures.Future()
    with EmulatedLink() as link:
        t0 = time.perf_counter()
        threading.Timer(0.03, lambda: real.set_result("reduced")).start()
        w = link.submit(0.01, real)
        assert not w.is_completed()
        assert w.wait(timedelta(seconds=5))
        t1 = time.perf_counter()
        assert w.get_future().wait() == "reduced"    # the real collective's value
        assert t1 - t0 >= 0.04 and w.start_s >= t0 + 0.03
        # An idle link starts a submission when it comes, not at the last one's end.
        time.sleep(0.02)
        t2 = time.perf_counter()
        w2 = link.submit(0.002)
        w2.wait()
        assert w2.start_s >= t2 and w2.start_s >= w.end_s + 0.015


def test_host_link_timeout_and_failure_are_runtime_errors():
    with EmulatedLink() as link:
        slow = link.submit(0.3)
        with pytest.raises(RuntimeError, match="timed out"):
            slow.wait(timedelta(milliseconds=10))
        with pytest.raises(DistributedError, match="rank 0: block 3 failed: emulated link: timed out"):
            agree_wait(slow, "block 3", 0, timedelta(milliseconds=10))
        assert slow.wait(1.0) and slow.exception() is None
        bad: torch.futures.Future = torch.futures.Future()
        bad.set_exception(RuntimeError("peer closed"))
        w = link.submit(0.001, bad)
        with pytest.raises(RuntimeError, match="peer closed"):
            w.wait()
        assert w.is_completed() and isinstance(w.exception(), RuntimeError)
        with pytest.raises(RuntimeError, match="peer closed"):
            w.get_future().wait()
        assert link.submit(0.001).wait()          # the link goes on
    with pytest.raises(UsbyteError, match="after close"):
        link.submit(0.001)
    link.close()                                  # again: nothing
    with pytest.raises(UsbyteError, match="ctas"):
        EmulatedLink(ctas=4)
    with pytest.raises(UsbyteError, match="seconds"):
        EmulatedLink().submit(-1.0)


# ------------------------------------------------------------------------------------------
# DDP's communication hook and the runtime's blocks, at world size 1 on gloo
# ------------------------------------------------------------------------------------------

#: 4 ranks at 50 Mbit/s (6.25 MB/s): the model's 0.8 MB of gradients take ~0.2 s per step,
#: far more than its compute (a few ms), so the step grows by about the link's time.
SLOW = "4x50mbit@100us"


@pytest.fixture
def one_thread():
    """One intra-op thread: the link's thread and the compute share two (busy) cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 256, generator=g) for _ in range(n)]


def train(m: nn.Module, opt, data: list[torch.Tensor], end=None) -> list[float]:
    """Per-step times (the last includes ``end()``, a final synchronisation)."""
    times = []
    for i, x in enumerate(data):
        t0 = time.perf_counter()
        m(x).square().mean().backward(); opt.step(); opt.zero_grad()
        if end is not None and i == len(data) - 1:
            end()
        times.append(time.perf_counter() - t0)
    return times


def test_ddp_hook_bitwise_and_slower_by_the_link(pg, one_thread):
    spec = parse_emulate(SLOW)
    base = model()
    plain, emu = copy.deepcopy(base), copy.deepcopy(base)
    ddp_plain = DDP(plain, bucket_cap_mb=0.25)
    ddp_emu = DDP(emu, bucket_cap_mb=0.25)
    state = EmulatedHookState(spec)
    ddp_emu.register_comm_hook(state, emulated_allreduce_hook)
    data = batches(6)
    t_plain = train(ddp_plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), data)
    t_emu = train(ddp_emu, torch.optim.SGD(emu.parameters(), lr=0.1, momentum=0.9), data)
    state.close()
    for a, b in zip(plain.parameters(), emu.parameters()):
        assert torch.equal(a, b)
    link = state.link
    assert link is not None and link.count >= 2 * len(data)   # several buckets a step
    nbytes = sum(p.numel() * p.element_size() for p in emu.parameters())
    per_step = link.submitted_s / len(data)
    assert per_step >= spec.allreduce_s(nbytes)               # every byte went over the link
    # DDP waits for its buckets at the end of backward: every step takes the link's time
    # (the link is serial), and grows by about it (the compute is a few ms).
    assert min(t_emu) >= 0.95 * per_step
    assert min(t_emu) - min(t_plain) >= 0.8 * per_step
    assert statistics.median(t_emu) - statistics.median(t_plain) < 3 * per_step + 0.3


def test_runtime_issuer_bitwise_and_slower_by_the_link(pg, one_thread):
    from usbyte_opt.planning.problem import Problem
    from usbyte_opt.runtime import DistributedOptimizer, profile_from_model, split_blocks

    def schedule(m: nn.Module):
        pb = Problem.from_profile(profile_from_model(m))
        lay = pb.layout()
        return pb.schedule("split", lay, split_blocks(pb, lay, 2, pb.need_order()))

    spec = parse_emulate(SLOW)
    data = batches(6)
    runs = {}
    for name in ("plain", "emulated"):
        m = model()
        sched = schedule(m)
        opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m,
                                   schedule=sched, verify=False)
        link = install_on_channel(opt._chan, spec) if name == "emulated" else None
        times = train(m, opt, data, end=opt.synchronize)
        runs[name] = (m, times, link)
        if link is not None:
            with pytest.raises(UsbyteError, match="already installed"):
                install_on_channel(opt._chan, spec)
        opt.close()
        if link is not None:
            link.close()
    (m_plain, t_plain, _), (m_emu, t_emu, link) = runs["plain"], runs["emulated"]
    for a, b in zip(m_plain.parameters(), m_emu.parameters()):
        assert torch.equal(a, b)
    # Every block of every step went over the link, for its own bytes (float32 gradients).
    assert link is not None and link.count == len(sched.blocks) * len(data)
    per_step = sum(spec.allreduce_s((b.end - b.start) * 4) for b in sched.blocks)
    assert link.submitted_s == pytest.approx(len(data) * per_step)
    # The link is serial: the run takes at least its total. From the second step on, each
    # step's forward waits for the step before's blocks: it grows by about one step's link.
    assert sum(t_emu) >= 0.95 * link.submitted_s
    assert min(t_emu[1:]) - min(t_plain[1:]) >= 0.8 * per_step
    assert statistics.median(t_emu) - statistics.median(t_plain) < 3 * per_step + 0.3


def test_issuer_covers_the_real_work(pg):
    """The issuer's work waits for the real all-reduce (through ``inner``) and the link; its
    future carries the real work's value, and the runtime's one-line wait accepts it."""
    from usbyte_opt.collectives.issuers import sum_issuer

    spec = LinkSpec(4, 1e6, 0.0)                              # 1 MB/s: 4 kB -> 6 ms
    with EmulatedLink() as link:
        issue = emulated_sum_issuer(sum_issuer(None), link, spec)
        x = torch.arange(1000, dtype=torch.float32)
        t0 = time.perf_counter()
        w = issue(x)
        agree_wait(w, "block 0", dist.get_rank(), timedelta(seconds=10))
        assert time.perf_counter() - t0 >= 0.006 and w.is_completed()
        assert w.seconds == pytest.approx(0.006)
        out = w.get_future().wait()
        assert isinstance(out, list) and torch.equal(out[0], torch.arange(1000, dtype=torch.float32))
