"""Collective costs of the real process group: a sweep over message sizes and a fitted line,
for all-reduce and, for sharded data parallel, reduce-scatter and all-gather.

The sweep of one collective (:func:`sweep_collective`; :func:`sweep_allreduce` for
all-reduce), or of several together (:func:`sweep_collectives`, round-robin over every
collective and size), is described below for all-reduce; reduce-scatter (input ``b`` bytes, output
``b / world_size`` per rank, summed) and all-gather (a shard in, ``b`` bytes out) are swept
the same way, on the same channel. A sample's SIZE is always the whole, unsharded ``b``
bytes, so the three fitted lines (``c(b) = alpha_ms + b / (algbw_gbs * 1e6)``) compare
directly; reduce-scatter and all-gather sizes are multiples of ``4 * world_size`` bytes
(:func:`shard_sizes`).

Each size is all-reduced ``warmup`` times untimed and ``repeats`` times timed (three times as
many below 1 MiB, where a sample costs next to nothing and scheduler noise is largest),
round-robin over the sizes; before each timed sample the ranks meet at a barrier.

A sample below 1 MiB is a **chain** of ``CHAIN`` all-reduces issued back to back, timed whole
and divided by their number: in an iteration the blocks follow one another on the channel,
and what a block costs there is not what one isolated call costs. On gloo the runtime sends
its blocks through a one-thread group (:func:`usbyte_opt.collectives.issuers.serial_group`), where a
small all-reduce right after another costs several times what it costs alone
(``docs/bench.md``, item 10 of "What the measurements show"); the profiler therefore times
that same channel (``issue``), and the fitted alpha is what every extra block of a schedule
really costs. Ranks leave a barrier at slightly
different moments, and the first one out times its wait for the others as part of the
collective; the last one out sees only the collective itself, from "everybody has joined"
to "done", which is what the iteration model's ``c(b)`` is (waiting for a late rank is
modelled by the ready times, the maximum over ranks). So a sample's time is the
**minimum over ranks**, and each size keeps the median of its samples. ``alpha_ms`` and ``algbw_gbs``
are fitted to those medians with :func:`usbyte_opt.planning.cost.fit_samples` (scipy least squares on
relative residuals). The medians go to ``comm.samples``; every raw sample stays in
``meta.comm_sweep``.

At world size 1 there is nothing to measure: :func:`analytic_comm` gives the settings of a
realistic cluster instead (8 workers on a 25 Gbit/s Ethernet ring with alpha = 1.3 ms, the
US-Byte authors' own 8-worker fit), which the caller reports as a warning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from ..formats import CollectiveCost, CommSpec
from ..planning.cost import fit_samples, retarget
from .issuers import ISSUERS

Progress = Callable[[str, int, int], None]

#: The analytic cluster used at world size 1 and by the shipped profiles: a ring of 8
#: workers on 25 Gbit/s Ethernet with the hop latency that gives alpha = 1.3 ms.
ANALYTIC_WORLD_SIZE = 8
ANALYTIC_BANDWIDTH_GBPS = 25.0
ANALYTIC_ALPHA_MS = 1.3

#: Sizes below SMALL_BYTES get SMALL_REPEAT_FACTOR times the repeats, and each of their
#: samples is a chain of CHAIN back-to-back calls.
SMALL_BYTES = 1 << 20
SMALL_REPEAT_FACTOR = 3
CHAIN = 4

#: Issues one asynchronous collective on the measured channel: ``issue(x)`` for a sum
#: all-reduce, ``issue(output, input)`` for reduce-scatter and all-gather
#: (:mod:`usbyte_opt.collectives.issuers`).
Issue = Callable[..., Any]

#: The collectives a sweep can time (:data:`usbyte_opt.collectives.issuers.ISSUERS`).
KINDS = ("all-reduce", "reduce-scatter", "all-gather")

#: The sweep adds rounds while a size's median is less certain than this (relative half-width
#: of its 95% interval), up to its time cap.
REL_TOL = 0.05
#: Bootstrap resamples behind a fit's stated spread.
BOOTSTRAP = 40


def median(xs: Sequence[float]) -> float:
    """Median of the finite values of ``xs`` (NaN when there are none).

    Example::

        >>> median([3.0, 1.0, float("nan"), 2.0])
        2.0
    """
    v = sorted(x for x in xs if not math.isnan(x))
    if not v:
        return math.nan
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])



def robust(xs: Sequence[float], k: float = 5.0) -> list[float]:
    """``xs`` without outliers: values more than ``k`` scaled median absolute deviations from
    the median (a sample hit by a burst of load from elsewhere).

    Example::

        >>> robust([1.0, 1.1, 0.9, 1.05, 9.0])
        [1.0, 1.1, 0.9, 1.05]
    """
    ys = [x for x in xs if x == x]
    if len(ys) < 4:
        return ys
    m = median(ys)
    mad = median([abs(x - m) for x in ys]) * 1.4826
    if mad <= 0:
        return ys
    return [x for x in ys if abs(x - m) <= k * mad]


def rel_halfwidth(xs: Sequence[float]) -> float:
    """Relative half-width of an approximate 95% interval of the median of ``xs`` (the
    notch of a box plot: 1.57 IQR / sqrt(n)); infinite with fewer than 4 values.

    Example::

        >>> round(rel_halfwidth([1.0, 1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]), 3)
        0.028
    """
    ys = sorted(xs)
    n = len(ys)
    if n < 4:
        return math.inf
    q1, q3 = ys[n // 4], ys[(3 * n) // 4]
    m = median(ys)
    return 1.57 * (q3 - q1) / math.sqrt(n) / m if m > 0 else math.inf


def default_sizes(min_bytes: int = 4 << 10, max_bytes: int = 64 << 20, points: int = 12) -> list[int]:
    """``points`` log-spaced message sizes from ``min_bytes`` to ``max_bytes``, each a
    multiple of 4 bytes (one float32), without duplicates.

    Example::

        >>> default_sizes(4096, 4 << 20, 4)
        [4096, 41284, 416128, 4194304]
    """
    if min_bytes < 4 or max_bytes < min_bytes:
        raise UsbyteError(f"all-reduce sweep: expected 4 <= min bytes <= max bytes, got "
                          f"{min_bytes} and {max_bytes}")
    if points < 2:
        raise UsbyteError(f"--comm-points: expected an integer >= 2 (a line needs two sizes), got {points}")
    out: list[int] = []
    for k in range(points):
        b = min_bytes * (max_bytes / min_bytes) ** (k / (points - 1))
        b = max(4, int(round(b / 4)) * 4)
        if not out or b > out[-1]:
            out.append(b)
    return out


def shard_sizes(sizes: Sequence[int], world_size: int) -> list[int]:
    """``sizes`` rounded to the nearest multiple of ``4 * world_size`` bytes (at least one), so
    that a reduce-scatter or all-gather of that many float32 bytes splits evenly over the
    ranks; without duplicates.

    Example::

        >>> shard_sizes([4096, 41284, 416128], 2)
        [4096, 41280, 416128]
        >>> shard_sizes([4, 8, 12], 4)
        [16]
    """
    if world_size < 1:
        raise UsbyteError(f"shard sizes: expected a world size >= 1, got {world_size}")
    unit = 4 * world_size
    out: list[int] = []
    for b in sizes:
        r = max(unit, int(round(b / unit)) * unit)
        if r not in out:
            out.append(r)
    return sorted(out)


def analytic_comm(alpha_ms: float | None = None, algbw_gbs: float | None = None,
                  world_size: int = ANALYTIC_WORLD_SIZE) -> CommSpec:
    """Comm settings of the reference cluster (ring formula of :func:`usbyte_opt.planning.cost.retarget`),
    with ``alpha_ms`` / ``algbw_gbs`` overriding the derived values. No reduce-scatter or
    all-gather lines: the cost model's default for them, half an all-reduce each, is the ring
    formula already (:func:`usbyte_opt.planning.cost.cost_model`).

    Example::

        >>> c = analytic_comm()
        >>> c.backend, c.world_size, round(c.alpha_ms, 6), round(c.algbw_gbs, 4)
        ('analytic', 8, 1.3, 1.7857)
    """
    hop_us = ANALYTIC_ALPHA_MS * 1000.0 / (2 * (world_size - 1))
    c = retarget(CommSpec("analytic", 2, 1.0, 1.0), world_size=world_size,
                 bandwidth_gbps=ANALYTIC_BANDWIDTH_GBPS, latency_us=hop_us)
    if alpha_ms is not None:
        if not alpha_ms >= 0:
            raise UsbyteError(f"--alpha-ms: expected a number >= 0, got {alpha_ms}")
        c = CommSpec(c.backend, c.world_size, float(alpha_ms), c.algbw_gbs)
    if algbw_gbs is not None:
        if not algbw_gbs > 0:
            raise UsbyteError(f"--algbw-gbs: expected a number > 0, got {algbw_gbs}")
        c = CommSpec(c.backend, c.world_size, c.alpha_ms, float(algbw_gbs))
    return c


@dataclass(slots=True)
class Sweep:
    """Result of :func:`sweep_collective`: sizes (whole, unsharded bytes), raw samples
    (last-arriving rank) and medians."""

    sizes: list[int]
    raw_ms: list[list[float]] = field(default_factory=list)
    medians_ms: list[float] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)
    """Calls per sample, per size (a sample's time is per call)."""
    channel: str = "process group"
    kind: str = "all-reduce"
    """The collective timed (one of :data:`KINDS`)."""

    def samples(self) -> list[tuple[int, float]]:
        return [(b, m) for b, m in zip(self.sizes, self.medians_ms)]


def sweep_allreduce(sizes: Sequence[int], repeats: int = 5, warmup: int = 1,
                    device: torch.device | str = "cpu", group: Any = None,
                    progress: Progress | None = None, barrier: Callable[[], None] | None = None,
                    issue: Issue | None = None, chain: int = CHAIN,
                    max_seconds: float = 0.0, rel_tol: float = REL_TOL) -> Sweep:
    """Time all-reduces of float32 tensors of each size: :func:`sweep_collective` of
    ``"all-reduce"``."""
    return sweep_collective("all-reduce", sizes, repeats, warmup, device, group, progress, barrier,
                            issue, chain, max_seconds, rel_tol)


def sweep_collective(kind: str, sizes: Sequence[int], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str = "cpu", group: Any = None,
                     progress: Progress | None = None, barrier: Callable[[], None] | None = None,
                     issue: Issue | None = None, chain: int = CHAIN,
                     max_seconds: float = 0.0, rel_tol: float = REL_TOL) -> Sweep:
    """Time collectives ``kind`` (one of :data:`KINDS`) of float32 tensors of each size:
    :func:`sweep_collectives` of that one kind."""
    return sweep_collectives({kind: sizes}, repeats, warmup, device, group, progress, barrier,
                             None if issue is None else {kind: issue}, chain, max_seconds,
                             rel_tol)[kind]


def sweep_collectives(sizes: Mapping[str, Sequence[int]], repeats: int = 5, warmup: int = 1,
                      device: torch.device | str = "cpu", group: Any = None,
                      progress: Progress | None = None, barrier: Callable[[], None] | None = None,
                      issues: Mapping[str, Issue] | None = None, chain: int = CHAIN,
                      max_seconds: float = 0.0, rel_tol: float = REL_TOL) -> dict[str, Sweep]:
    """Time the collectives named by ``sizes`` (kinds of :data:`KINDS`), float32 tensors of
    each of their sizes, in one sweep (a collective: every rank calls it with the same
    arguments); one :class:`Sweep` per kind.

    A size is the whole block's bytes ``b``: an all-reduce of ``b`` bytes, a reduce-scatter of
    ``b`` bytes in (``b / world_size`` out per rank), an all-gather of ``b`` bytes out. For the
    last two every size must be a multiple of ``4 * world_size`` (:func:`shard_sizes`).

    Each round times every (kind, size) once, round-robin: a burst of load from elsewhere then
    touches every kind alike, so the lines compare (swept one after the other, a burst during
    one kind's sweep made it dearer than another's by up to 2x on a shared host). After the
    ``repeats`` rounds, while any median is less certain than ``rel_tol``
    (:func:`rel_halfwidth` of its samples, outliers removed) on any rank, that size gets
    another round, until ``max_seconds`` have passed (0: no extra rounds). The ranks agree on
    the sizes of each extra round (a max all-reduce), so they stay in step.

    ``issues[kind]`` is the channel measured: it starts one asynchronous collective and
    returns its work (default: ``kind`` on ``group``,
    :data:`usbyte_opt.collectives.issuers.ISSUERS`); ``issue(x)`` for all-reduce,
    ``issue(output, input)`` for the others. Below 1 MiB a sample is ``chain`` calls issued
    back to back, its time divided by ``chain``. On CUDA the time comes from events around
    the calls on the current stream (the NCCL stream waits on it, and ``wait()`` makes the
    current stream wait for NCCL); on CPU from ``perf_counter`` around issue and wait.

    A reduce-scatter or all-gather sample ends with one 4-byte all-reduce on the same channel
    (``issues["all-reduce"]`` when given), inside the timed span: those collectives complete
    on each rank once its own part has arrived, which can be long before another rank's (in
    the lab, one direction of a pair ran a whole block at half the rate of the other: 90 ms on
    one rank, 177 ms on the other), while the next collective on the channel waits for the
    last rank; the all-reduce completes on every rank only once every rank is done, so the
    sample (the minimum over ranks) is the collective's time on the channel, plus one small
    all-reduce.
    """
    kinds = list(sizes)
    for kind in kinds:
        if kind not in KINDS:
            raise UsbyteError(f"collective sweep: expected one of {'|'.join(KINDS)}, got {kind!r}")
    if not kinds or not all(sizes[k] for k in kinds):
        raise UsbyteError("collective sweep: expected at least one size of each collective")
    if repeats < 1:
        raise UsbyteError(f"--comm-repeats: expected an integer >= 1, got {repeats}")
    if chain < 1:
        raise UsbyteError(f"{kinds[0]} sweep: expected a chain of >= 1 calls, got {chain}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    world = dist.get_world_size(group) if kinds != ["all-reduce"] else 1
    for kind in kinds:
        unit = 4 * (world if kind != "all-reduce" else 1)
        bad = [b for b in sizes[kind] if b % unit or b <= 0]
        if bad:
            raise UsbyteError(f"{kind} sweep: expected sizes that are multiples of {unit} bytes "
                              f"(4 times the world size {world}), got {bad[0]}")
    issue = {k: (issues[k] if issues is not None and k in issues else ISSUERS[k](group)) for k in kinds}
    # The end of a reduce-scatter or all-gather sample on every rank (see above).
    Call = tuple[Issue, tuple[torch.Tensor, ...], Callable[[], Any] | None]
    sync: Callable[[], Any] | None = None
    if world > 1:
        tiny = torch.zeros(1, dtype=torch.float32, device=device)
        sum_on = issues["all-reduce"] if issues is not None and "all-reduce" in issues \
            else ISSUERS["all-reduce"](group)

        def end_everywhere() -> Any:
            return sum_on(tiny)
        sync = end_everywhere
    # One pair of buffers for every kind: the calls run one at a time.
    full = torch.zeros(max(max(sizes[k]) for k in kinds) // 4, dtype=torch.float32, device=device)
    sharded = [max(sizes[k]) for k in kinds if k != "all-reduce"]
    shard = torch.zeros(max(sharded) // 4 // world, dtype=torch.float32, device=device) \
        if sharded else full

    def arguments(kind: str, b: int) -> tuple[torch.Tensor, ...]:
        if kind == "all-reduce":
            return (full.narrow(0, 0, b // 4),)
        if kind == "reduce-scatter":   # (output shard, input block)
            return (shard.narrow(0, 0, b // 4 // world), full.narrow(0, 0, b // 4))
        return (full.narrow(0, 0, b // 4), shard.narrow(0, 0, b // 4 // world))  # all-gather

    # Every (kind, size), in sweep order.
    items = [(kind, b) for kind in kinds for b in sizes[kind]]
    # Each call with the tail that ends its sample (reduce-scatter, all-gather: see above).
    calls = [(issue[kind], arguments(kind, b), None if kind == "all-reduce" else sync)
             for kind, b in items]
    counts = [repeats * SMALL_REPEAT_FACTOR if b < SMALL_BYTES else repeats for _, b in items]
    chains = [chain if b < SMALL_BYTES else 1 for _, b in items]
    phase = kinds[0] if len(kinds) == 1 else "collectives"

    def run_chain(call: Call, k: int) -> None:
        fn, x, tail = call
        works = [fn(*x) for _ in range(k)]
        if tail is not None:
            works.append(tail())
        for w in works:
            w.wait()

    for _ in range(warmup):
        for c, k in zip(calls, chains):
            run_chain(c, k)

    def timed(c: Call, k: int) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        if barrier is not None:
            barrier()
        else:
            dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(device)   # the profiled device's, not the current one
            start.record(stream)
            run_chain(c, k)
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / k
        t = time.perf_counter()
        run_chain(c, k)
        return (time.perf_counter() - t) * 1e3 / k

    # Round-robin over the sizes, not size after size: a burst of load from elsewhere then
    # touches every size alike instead of bending the curve at the sizes it happened to hit.
    raw: list[list[float]] = [[] for _ in items]
    done, total = 0, sum(counts)
    t_start = time.perf_counter()
    for rep in range(max(counts)):
        for k, c in enumerate(calls):
            if rep < counts[k]:
                raw[k].append(timed(c, chains[k]))
                done += 1
        if progress:
            progress(phase, done, total)
    while max_seconds > 0:
        # Whether to run another round is decided together: a rank past its time cap asks
        # for nothing, and the round runs while any rank asks (its own clock alone would let
        # the ranks take different branches, each then waiting on a collective the other
        # never issues).
        over = time.perf_counter() - t_start >= max_seconds
        unsure = torch.tensor([1.0 if not over and rel_halfwidth(robust(ts)) > rel_tol else 0.0
                               for ts in raw], dtype=torch.float64)
        unsure = unsure.to(device) if cuda else unsure
        dist.all_reduce(unsure, op=dist.ReduceOp.MAX, group=group)
        again = [k for k, u in enumerate(unsure.cpu().tolist()) if u > 0]
        if not again:
            break
        for k in again:
            raw[k].append(timed(calls[k], chains[k]))
        counts = [len(ts) for ts in raw]
    # The last-arriving rank's time for every sample: one MIN all-reduce of all of them.
    flat = torch.tensor([t for ts in raw for t in ts], dtype=torch.float64)
    flat = flat.to(device) if cuda else flat
    dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=group)
    got: list[float] = flat.cpu().tolist()
    ends = [sum(counts[:i + 1]) for i in range(len(counts))]
    raw = [got[e - c:e] for e, c in zip(ends, counts)]
    out: dict[str, Sweep] = {}
    for kind in kinds:
        mine = [k for k, (kd, _) in enumerate(items) if kd == kind]
        sw = Sweep(list(sizes[kind]), kind=kind)
        sw.raw_ms = [raw[k] for k in mine]
        sw.chains = [chains[k] for k in mine]
        sw.medians_ms = [max(median(robust(ts)), 1e-6) for ts in sw.raw_ms]
        out[kind] = sw
    return out


def fit_comm(sweep: Sweep, backend: str, world_size: int) -> tuple[CommSpec, dict[str, Any]]:
    """Fit ``alpha``/``algbw`` to an all-reduce sweep's medians; return the CommSpec and a
    ``meta`` record (sizes, raw samples, the fit and its largest relative error over the
    medians)."""
    cost, record = fit_collective(sweep)
    return CommSpec(backend, world_size, cost.alpha_ms, cost.algbw_gbs, cost.samples), record


def fit_collective(sweep: Sweep) -> tuple[CollectiveCost, dict[str, Any]]:
    """Fit ``alpha``/``algbw`` to any sweep's medians (:func:`fit_comm` for all-reduce): the
    :class:`~usbyte_opt.formats.data.CollectiveCost` (with the medians as its samples) and the
    ``meta`` record of :func:`fit_comm`, which also names the collective."""
    samples = sweep.samples()
    alpha, algbw = fit_samples(samples)
    rel = [abs(alpha + b / (algbw * 1e6) - ms) / ms for b, ms in samples]
    spread = fit_spread(sweep)
    record: dict[str, Any] = {
        "method": "barrier before each sample (below 1 MiB a chain of back-to-back calls, time per "
                  "call); last-arriving (minimum) rank per sample; outliers (> 5 MADs) dropped; "
                  "median per size, rounds added while a median's 95% interval is wider than "
                  f"{100 * REL_TOL:.0f}%; usbyte_opt.planning.cost.fit_samples on the medians; spread: "
                  f"5th-95th percentiles of {BOOTSTRAP} bootstrap refits",
        "spread": spread,
        "channel": sweep.channel,
        "sizes_bytes": sweep.sizes,
        "chain": sweep.chains,
        "raw_ms": [[round(t, 6) for t in ts] for ts in sweep.raw_ms],
        "fit": {"alpha_ms": alpha, "algbw_gbs": algbw,
                "max_rel_error": max(rel) if rel else math.nan},
    }
    if sweep.kind != "all-reduce":
        record = {"collective": sweep.kind,
                  "size": "whole (unsharded) bytes of the block; each rank sends or receives "
                          "size / world_size", **record}
    return CollectiveCost(alpha, algbw, tuple((int(b), float(m)) for b, m in samples)), record


def fit_spread(sweep: Sweep, rounds: int = BOOTSTRAP, seed: int = 0) -> dict[str, list[float]]:
    """The 5th and 95th percentiles of ``alpha_ms`` and ``algbw_gbs`` over ``rounds`` refits,
    each on medians of the samples resampled with replacement: how far a repeated profile's
    fit may move. Deterministic (seeded)."""
    import random

    rng = random.Random(seed)
    alphas, bws = [], []
    kept = [robust(ts) or ts for ts in sweep.raw_ms]
    for _ in range(rounds):
        meds = [max(median([rng.choice(ts) for _ in ts]), 1e-6) for ts in kept]
        a, bw = fit_samples(list(zip(sweep.sizes, meds)))
        alphas.append(a)
        bws.append(bw)

    def pct(xs: list[float]) -> list[float]:
        ys = sorted(xs)
        return [ys[int(0.05 * (len(ys) - 1))], ys[int(math.ceil(0.95 * (len(ys) - 1)))]]
    return {"alpha_ms": pct(alphas), "algbw_gbs": pct(bws)}
