"""What communication costs the training thread: all-reduce while training computes.

On a GPU server the training thread only launches kernels and a collective runs on its own
stream; on a CPU rank (or a GPU host short of cores) the cores that compute also run the
backend's threads and the network stack, so every block in flight slows forward and backward.
:func:`comm_under_compute` measures it: chains of blocks on the runtime's channel while
training iterations run beside them, and the iterations' lost time fitted to a cost per block
and per MB (:func:`fit_cpu_cost`). ``usbyte-opt profile`` records both in the profile's
``comm.cpu_ms_per_block`` / ``comm.cpu_ms_per_mb`` (the planner's compute-cost option,
docs/planner.md) and the samples in ``meta.cpu_probe``; ``usbyte-opt bench`` reads the loaded
bandwidth from the same samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.issuers import backend_for, sum_issuer
from ..collectives.sweep import CHAIN, default_sizes, median, robust

#: Blocks in the chain that reads the per-block cost (4 KiB each); every other chain has the
#: sweep's ``CHAIN``.
SMALL_CHAIN = 32


def probe_sizes(total_bytes: int, points: int = 5) -> tuple[list[int], list[int]]:
    """Sizes (bytes of one chain) and chain lengths of the probe for a gradient of
    ``total_bytes``: a chain of 32 blocks of 4 KiB, then chains of 4 blocks from 256 KiB to
    the whole gradient (at least 1 MiB), ``points`` sizes log-spaced.

    Example::

        >>> sizes, parts = probe_sizes(4_900_000, 3)
        >>> sizes[0] == 32 * 4096, parts
        (True, [32, 4, 4, 4])
    """
    sizes = [SMALL_CHAIN * 4096] + default_sizes(256 << 10, max(1 << 20, int(total_bytes)), points)
    return sizes, [SMALL_CHAIN] + [CHAIN] * (len(sizes) - 1)


@dataclass(frozen=True, slots=True)
class CommProbe:
    """What :func:`comm_under_compute` measured."""

    samples: tuple[tuple[int, float], ...]
    """``(bytes, ms)``: all-reduce time of one block while training iterations run (median,
    min over ranks; a chain of ``parts`` blocks divided by ``parts``)."""
    step_alone_ms: float
    """A training iteration without any communication in flight (median, max over ranks)."""
    cpu_ms_per_mb: float
    """Training-thread time lost per MB all-reduced (max over ranks): iterations that ran
    while all-reduce was in flight, less as many iterations alone, per MB moved (the part
    that grows with bytes, when ``cpu_ms_per_block`` is fitted beside it)."""
    cpu_ms_per_block: float = 0.0
    spread: Any = None
    """5th-95th percentiles of ``cpu_ms_per_block`` and ``cpu_ms_per_mb`` (bootstrap)."""
    passes: int = 0
    """Passes over the sizes that were run."""
    """Training-thread time lost per block (collective) issued, fitted beside
    ``cpu_ms_per_mb`` over the probe's sizes (non-negative least squares)."""


def comm_under_compute(step: Callable[[], None], sizes: Sequence[int], repeats: int = 3,
                       group: Any = None, device: Any = "cpu", alone: int = 3,
                       issue: Callable[[Any], Any] | None = None,
                       parts: int | Sequence[int] = 1, max_seconds: float = 0.0,
                       tail: Callable[[], Any] | None = None) -> CommProbe:
    """All-reduce cost while the training thread computes: ``(bytes, ms)`` per size (median).

    The profiler's sweep times each all-reduce on idle ranks. In training, blocks run while
    forward and backward keep every core busy, and on a small CPU machine gloo's threads wait
    for a core at every step of the ring (docs/bench.md, "blocks during backward", has the
    measured traces). Here each sample issues one async all-reduce of
    ``size`` bytes right after a barrier and runs ``step()`` (a training iteration without
    communication) until the future reports completion; the time is issue to completion, the
    minimum over ranks (as in the sweep: the last rank to arrive sees the collective alone).
    A collective call: every rank must call it with the same sizes. ``device``: where the
    buffers live (the training device under NCCL, the CPU under gloo).

    It also measures what communication costs the training thread (the cores that compute are
    the ones that run gloo and the network stack): ``alone`` iterations first and one more
    after every sample, every iteration of the probe, and per size the time lost against the
    median iteration alone; a per-block and a per-MB cost are fitted to those losses
    (non-negative least squares), so chains of small blocks (whose cost is per collective:
    hooks, issue, gloo's polling event loop) and of large ones (copies, reductions, the
    network stack) both count.

    ``issue`` is the channel (default: ``dist.all_reduce`` on ``group``); the profiler and the
    bench pass the runtime's (:func:`usbyte_opt.collectives.issuers.block_issuer`), whose gloo event loop polls
    while a chain of blocks is on the wire and takes its core from the training thread. With
    ``parts`` > 1 a sample is that many equal blocks issued back to back, as the blocks of
    an iteration are (one number for every size, or one per size). ``tail``: issued after each
    chain, its completion ends the sample (a small all-reduce, for collectives that complete on
    each rank at a different moment: see :func:`usbyte_opt.collectives.sweep.sweep_collectives`).

    Samples hit by a burst of load from elsewhere are dropped (:func:`.comm.robust`). After
    ``repeats`` passes over the sizes, passes are added while the last one moved the fit by
    more than :data:`STABLE`, up to ``max_seconds`` (the ranks agree on each pass), and the
    fit's spread is stated (bootstrap, ``CommProbe.spread``).
    """
    dev = torch.device(device)
    # Buffers on the GPU when NCCL reduces GPU tensors on this group; else on the host.
    if not (dev.type == "cuda" and backend_for(group, dev) == "nccl"):
        dev = torch.device("cpu")
    counts = [max(1, int(p)) for p in (parts if isinstance(parts, Sequence) else [parts] * len(sizes))]
    if len(counts) != len(sizes):
        raise ValueError(f"comm_under_compute: {len(counts)} part counts for {len(sizes)} sizes")
    sampler = _Sampler(step, group, dev, issue if issue is not None else sum_issuer(group),
                       sizes, counts, tail)
    dist.barrier(group=group)
    for _ in range(alone):
        sampler.timed_step(sampler.solo)
    if sampler.clock is not None:
        sampler.clock.resolve()
    passes = sampler.until_stable(repeats, max_seconds)
    return sampler.result(passes)


@dataclass(slots=True)
class _Sampler:
    """The state of one :func:`comm_under_compute`: the chains of blocks, the clock, and the
    iterations timed alone (``solo``) and beside each size's samples (``beside``)."""

    step: Callable[[], None]
    group: Any
    dev: torch.device
    issue: Callable[[Any], Any]
    sizes: Sequence[int]
    counts: list[int]
    tail: Callable[[], Any] | None = None
    """Issued after each chain; its work ends the sample."""
    solo: list[float] = field(default_factory=list)
    """Iterations with nothing in flight."""
    times: list[list[float]] = field(default_factory=list)
    """Per size: issue to completion of each sample."""
    beside: list[list[list[float]]] = field(default_factory=list)
    """Per size, per sample: the iterations that ran beside it."""
    chains: list[list[torch.Tensor]] = field(default_factory=list)
    clock: _EventClock | None = None

    def __post_init__(self) -> None:
        # On CUDA every time is a pair of CUDA events, read once the sample is over: the host
        # runs ahead of the GPU, NCCL's futures complete at enqueue, and a host synchronize
        # would wait for the collective as well.
        self.clock = _EventClock(self.dev) if self.dev.type == "cuda" else None
        buf = torch.zeros(max(self.sizes) // 4, dtype=torch.float32, device=self.dev)
        for b, m in zip(self.sizes, self.counts):
            n = b // 4
            cuts = [n * k // m for k in range(m + 1)]
            self.chains.append([buf.narrow(0, lo, hi - lo) for lo, hi in zip(cuts, cuts[1:]) if hi > lo])
        self.times = [[] for _ in self.sizes]
        self.beside = [[] for _ in self.sizes]

    def timed_step(self, into: list[float]) -> None:
        if self.clock is not None:
            self.clock.span(self.step, into)
            return
        t = time.perf_counter()
        self.step()
        into.append((time.perf_counter() - t) * 1e3)

    def sample(self, k: int) -> None:
        """One sample of size ``k``: its chain issued after a barrier, training iterations
        beside it until it completes, then one iteration alone."""
        xs = self.chains[k]
        dist.barrier(group=self.group)
        ran: list[float] = []
        def chain() -> list[Any]:
            ws = [self.issue(x) for x in xs]
            return ws + [self.tail()] if self.tail is not None else ws

        if self.clock is not None:
            self.times[k].append(self.clock.collective(chain, lambda: self.timed_step(ran)))
            self.timed_step(self.solo)  # paired: a slow spell of the machine hits both sides alike
            self.clock.resolve()
        else:
            done_at: list[float] = []
            t0 = time.perf_counter()
            ws = chain()
            ws[-1].get_future().add_done_callback(lambda _f: done_at.append(time.perf_counter()))
            while not done_at:
                self.timed_step(ran)
            for w in ws:
                w.wait()
            self.times[k].append((done_at[0] - t0) * 1e3)
            self.timed_step(self.solo)
        self.beside[k].append(ran)

    def fit(self) -> tuple[float, float]:
        return _fit_losses(self.beside, self.solo, self.counts, self.sizes)

    def until_stable(self, repeats: int, max_seconds: float) -> int:
        """Passes over the sizes: ``repeats``, then more while the last moved the fit by more
        than :data:`STABLE`, up to ``max_seconds``; every rank alike. Returns the passes run."""
        t_start = time.perf_counter()
        passes = 0
        prev = (math.inf, math.inf)
        while True:
            for k in range(len(self.sizes)):
                self.sample(k)
            passes += 1
            if passes < repeats:
                continue
            cur = self.fit()
            moved = max(_moved(prev[0], cur[0]), _moved(prev[1], cur[1]))
            prev = cur
            more = torch.tensor([1.0 if moved > STABLE and time.perf_counter() - t_start < max_seconds
                                 else 0.0], dtype=torch.float64, device=self.dev)
            dist.all_reduce(more, op=dist.ReduceOp.MAX, group=self.group)
            if more.item() == 0:
                return passes

    def result(self, passes: int) -> CommProbe:
        """The samples (minimum over ranks, per block) and the fitted costs (maximum over ranks)."""
        flat = torch.tensor([t for ts in self.times for t in ts], dtype=torch.float64, device=self.dev)
        dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=self.group)
        vals = flat.cpu().tolist()
        out = []
        pos = 0
        for k, (b, m) in enumerate(zip(self.sizes, self.counts)):
            mine = vals[pos:pos + len(self.times[k])]
            pos += len(self.times[k])
            # Per block of the chain: what one block of b / parts bytes costs on the channel.
            out.append((int(b) // m, float(median(robust(mine))) / m))
        per_block, per_mb = self.fit()
        lo_hi = _spread(self.beside, self.solo, self.counts, self.sizes)
        mine_t = torch.tensor([median(robust(self.solo)), per_mb, per_block, *lo_hi],
                              dtype=torch.float64, device=self.dev)
        dist.all_reduce(mine_t, op=dist.ReduceOp.MAX, group=self.group)
        alone_ms, per_mb, per_block, b_lo, b_hi, m_lo, m_hi = mine_t.cpu().tolist()
        return CommProbe(tuple(out), float(alone_ms), float(per_mb), float(per_block),
                     {"cpu_ms_per_block": [b_lo, b_hi], "cpu_ms_per_mb": [m_lo, m_hi]}, passes)


#: The probe adds passes until one moves its fit by less than this (relative).
STABLE = 0.10


def _moved(a: float, b: float) -> float:
    """Relative change from ``a`` to ``b`` (changes below 0.01 ms count as none)."""
    if math.isinf(a):
        return math.inf
    d = abs(b - a)
    return 0.0 if d < 0.01 else d / max(abs(a), abs(b), 1e-9)


def _fit_losses(beside: Sequence[Sequence[Sequence[float]]], solo: Sequence[float],
                counts: Sequence[int], sizes: Sequence[int]) -> tuple[float, float]:
    """Per-block and per-MB cost fitted to each size's robust mean loss per sample."""
    alone = median(robust(solo))
    lost, blocks, mb = [], [], []
    for k, samples in enumerate(beside):
        per = robust([sum(it) - len(it) * alone for it in samples])
        if not per:
            continue
        lost.append(sum(per) / len(per))
        blocks.append(counts[k])
        mb.append(sizes[k] / 1e6)
    return fit_cpu_cost(lost, blocks, mb)


def _spread(beside: Sequence[Sequence[Sequence[float]]], solo: Sequence[float],
            counts: Sequence[int], sizes: Sequence[int], rounds: int = 40) -> list[float]:
    """5th-95th percentiles of the per-block and per-MB costs over bootstrap refits (samples
    resampled with replacement, per size): ``[block_lo, block_hi, mb_lo, mb_hi]``."""
    import random

    rng = random.Random(0)
    fits = []
    for _ in range(rounds):
        res = [[rng.choice(ss) for _ in ss] if ss else [] for ss in beside]
        fits.append(_fit_losses(res, [rng.choice(solo) for _ in solo], counts, sizes))

    def pct(xs: list[float]) -> tuple[float, float]:
        ys = sorted(xs)
        return ys[int(0.05 * (len(ys) - 1))], ys[int(math.ceil(0.95 * (len(ys) - 1)))]
    b_lo, b_hi = pct([f[0] for f in fits])
    m_lo, m_hi = pct([f[1] for f in fits])
    return [b_lo, b_hi, m_lo, m_hi]


class _EventClock:
    """Times on one CUDA device with events (:func:`comm_under_compute` on NCCL)."""

    #: Training iterations issued beside one collective at most (the host runs ahead).
    MAX_STEPS = 50

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.spans: list[tuple[Any, Any, list[float]]] = []

    def _event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def span(self, fn: Callable[[], None], into: list[float]) -> None:
        """Run ``fn``; its GPU time goes to ``into`` at :meth:`resolve`."""
        a = self._event()
        fn()
        self.spans.append((a, self._event(), into))

    def collective(self, issue: Callable[[], list[Any]], step: Callable[[], None]) -> float:
        """Issue the collectives, run ``step`` until they are done on the GPU (or
        :data:`MAX_STEPS` times), and return issue-to-completion in ms."""
        start = self._event()
        works = issue()
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side):
            for w in works:
                w.wait()          # the side stream waits for the collective
            done.record(self.side)
        n = 0
        while n < self.MAX_STEPS and (n == 0 or not done.query()):
            step()
            n += 1
        done.synchronize()
        return start.elapsed_time(done)

    def resolve(self) -> None:
        """Wait for the GPU, then hand every span's time to its list."""
        torch.cuda.synchronize(self.device)
        for a, b, into in self.spans:
            into.append(a.elapsed_time(b))
        self.spans.clear()


def fit_cpu_cost(lost_ms: Sequence[float], blocks: Sequence[int], mb: Sequence[float]) -> tuple[float, float]:
    """``(ms per block, ms per MB)`` >= 0 that best explain the training-thread time lost
    beside each probe size (``lost_ms[k]`` while ``blocks[k]`` collectives moved ``mb[k]`` MB),
    by non-negative least squares (scipy).

    Example::

        >>> a, b = fit_cpu_cost([4 * 1.0 + 0.1 * 5, 4 * 1.0 + 4 * 5], [4, 4], [0.1, 4.0])
        >>> round(a, 3), round(b, 3)
        (1.0, 5.0)
    """
    import numpy as np
    from scipy.optimize import nnls

    if not lost_ms:
        return 0.0, 0.0
    a = np.array([[float(n), float(m)] for n, m in zip(blocks, mb)])
    y = np.maximum(np.array([float(v) for v in lost_ms]), 0.0)
    x, _ = nnls(a, y)
    return float(x[0]), float(x[1])




__all__ = ["CommProbe", "SMALL_CHAIN", "comm_under_compute", "fit_cpu_cost", "probe_sizes"]
