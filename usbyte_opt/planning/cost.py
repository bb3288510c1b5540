"""Collective cost models: the :class:`CostModel` interface that planning asks for costs, and
its linear implementation :class:`LinearCost`, ``c(b) = alpha_ms + b / (algbw_gbs * 1e6)``
(docs/design.md §2.2), which every profile gets today (:func:`cost_model`).

``algbw`` is the nccl-tests "algorithm bandwidth" (bytes of the buffer over time), so one
number covers any world size once measured there. To move a profile to another cluster,
:func:`retarget` assumes a ring all-reduce over ``n`` ranks:

    t(b) = 2 (n - 1) * hop_ms  +  (2 (n - 1) / n) * b / busbw

so ``alpha = 2 (n - 1) * hop_ms`` and ``algbw = busbw * n / (2 (n - 1))``, where ``busbw`` is
the per-link bandwidth (``--bandwidth-gbps X`` gives ``busbw = X / 8`` GB/s) and ``hop_ms`` the
latency of one ring step (``--latency-us``). Values not given are derived from the profile's
own measurement at its own world size.

Sharded data parallel replaces a block's all-reduce by a reduce-scatter in backward and an
all-gather in the next forward. On the same ring each is half an all-reduce:

    t(b) = (n - 1) * hop_ms  +  ((n - 1) / n) * b / busbw

with ``b`` the whole (unsharded) block's bytes, so ``alpha = (n - 1) * hop_ms`` and
``algbw = busbw * n / (n - 1)``. A profile that measured them (``comm.reduce_scatter``,
``comm.all_gather``) has its own lines, which :func:`retarget` moves with the same formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UsbyteError
from ..formats import CollectiveCost, CommSpec


class CostModel(Protocol):
    """What planning asks of an all-reduce cost model: the milliseconds of one collective.

    Strategies, the scorer and the bounds ask the problem's model (``Problem.cost``) and
    nothing else, so a model other than a line (piecewise linear from the profile's samples,
    per-link hierarchical) fits in by implementing these methods. An algorithm whose
    proof or rule needs a line (the lower bound, best's alpha-aware rule, US-Byte's unit
    rule, the dynamic programmes over runs) says so and reads :meth:`linear_bound`; with a
    model that is not a line (:attr:`is_linear` false) it still returns a valid plan, and its
    candidates are scored by :meth:`allreduce_ms` through the one scorer.

    :meth:`reduce_scatter_ms` and :meth:`all_gather_ms` cost the two collectives of sharded
    data parallel (:mod:`usbyte_opt.planning.sharded`), :meth:`shard_bounds` their lines at or
    below.
    """

    @property
    def is_linear(self) -> bool:
        """Whether :meth:`allreduce_ms` is exactly the line of :meth:`linear_bound`."""
        ...

    def allreduce_ms(self, nbytes: float) -> float:
        """Milliseconds of one all-reduce of ``nbytes``."""
        ...

    def allreduce_ms_array(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`allreduce_ms` of every entry of ``nbytes`` (the scorer's vectorised form)."""
        ...

    def linear_bound(self) -> tuple[float, float]:
        """``(alpha_ms, beta_ms_per_byte)`` of a line at or below :meth:`allreduce_ms` at
        every size, ``alpha + beta * nbytes <= allreduce_ms(nbytes)``, as tight as the model
        allows: what the lower bound may charge per block and per byte."""
        ...

    def reduce_scatter_ms(self, nbytes: float) -> float:
        """Milliseconds of one reduce-scatter of a block of ``nbytes`` (whole, unsharded)."""
        ...

    def all_gather_ms(self, nbytes: float) -> float:
        """Milliseconds of one all-gather into a block of ``nbytes`` (whole, unsharded)."""
        ...

    def shard_bounds(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """``((alpha, beta) of reduce-scatter, (alpha, beta) of all-gather)``: lines at or
        below :meth:`reduce_scatter_ms` and :meth:`all_gather_ms` at every size, as
        :meth:`linear_bound` is for all-reduce (the sharded lower bound charges them)."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCost:
    """The linear :class:`CostModel`: ``alpha_ms + nbytes / (algbw_gbs * 1e6)``.

    Reduce-scatter and all-gather of a block (``nbytes`` its whole, unsharded size) cost their
    own lines ``(alpha_ms, algbw_gbs)`` where given (a profile that measured them), else half
    an all-reduce each: what a ring gives (module docstring), with half the latency and twice
    the algorithm bandwidth.

    Example::

        >>> c = LinearCost(alpha_ms=0.5, algbw_gbs=2.0)
        >>> c.allreduce_ms(4_000_000)   # 0.5 + 4e6 / 2e6
        2.5
        >>> c.linear_bound(), c.is_linear
        ((0.5, 5e-07), True)
        >>> c.reduce_scatter_ms(4_000_000), c.all_gather_ms(4_000_000)   # half of 2.5 each
        (1.25, 1.25)
        >>> m = LinearCost(0.5, 2.0, reduce_scatter=(0.2, 5.0), all_gather=(0.3, 4.0))
        >>> m.reduce_scatter_ms(4_000_000), m.all_gather_ms(4_000_000), m.allreduce_ms(4_000_000)
        (1.0, 1.3, 2.5)
    """

    alpha_ms: float
    algbw_gbs: float
    reduce_scatter: tuple[float, float] | None = None
    """``(alpha_ms, algbw_gbs)`` of reduce-scatter; ``None``: half an all-reduce."""
    all_gather: tuple[float, float] | None = None
    """``(alpha_ms, algbw_gbs)`` of all-gather; ``None``: half an all-reduce."""

    @property
    def beta_ms_per_byte(self) -> float:
        return 1.0 / (self.algbw_gbs * 1e6)

    @property
    def is_linear(self) -> bool:
        return True

    def allreduce_ms(self, nbytes: float) -> float:
        return self.alpha_ms + nbytes / (self.algbw_gbs * 1e6)

    def allreduce_ms_array(self, nbytes: np.ndarray) -> np.ndarray:
        return self.alpha_ms + nbytes * self.beta_ms_per_byte

    def linear_bound(self) -> tuple[float, float]:
        return self.alpha_ms, self.beta_ms_per_byte

    def reduce_scatter_ms(self, nbytes: float) -> float:
        if self.reduce_scatter is None:
            return 0.5 * self.allreduce_ms(nbytes)
        alpha, algbw = self.reduce_scatter
        return alpha + nbytes / (algbw * 1e6)

    def all_gather_ms(self, nbytes: float) -> float:
        if self.all_gather is None:
            return 0.5 * self.allreduce_ms(nbytes)
        alpha, algbw = self.all_gather
        return alpha + nbytes / (algbw * 1e6)

    def shard_bounds(self) -> tuple[tuple[float, float], tuple[float, float]]:
        half = (0.5 * self.alpha_ms, 0.5 * self.beta_ms_per_byte)

        def line(c: tuple[float, float] | None) -> tuple[float, float]:
            return half if c is None else (c[0], 1.0 / (c[1] * 1e6))
        return line(self.reduce_scatter), line(self.all_gather)

    @classmethod
    def from_comm(cls, comm: CommSpec) -> LinearCost:
        def line(c: CollectiveCost | None) -> tuple[float, float] | None:
            return None if c is None else (c.alpha_ms, c.algbw_gbs)
        return cls(comm.alpha_ms, comm.algbw_gbs, line(comm.reduce_scatter), line(comm.all_gather))


def cost_model(comm: CommSpec) -> CostModel:
    """The cost model of a profile's ``comm``: :class:`LinearCost` (its ``alpha_ms`` and
    ``algbw_gbs``; reduce-scatter and all-gather from ``comm.reduce_scatter`` and
    ``comm.all_gather`` when the profile measured them, else half an all-reduce each).

    Example::

        >>> from usbyte_opt.formats import CollectiveCost
        >>> old = cost_model(CommSpec("gloo", 2, 1.0, 0.5))              # no sharded lines
        >>> old.allreduce_ms(1e6), old.reduce_scatter_ms(1e6), old.all_gather_ms(1e6)
        (3.0, 1.5, 1.5)
        >>> new = cost_model(CommSpec("gloo", 2, 1.0, 0.5, reduce_scatter=CollectiveCost(0.4, 1.0)))
        >>> new.allreduce_ms(1e6), new.reduce_scatter_ms(1e6), new.all_gather_ms(1e6)
        (3.0, 1.4, 1.5)
    """
    return LinearCost.from_comm(comm)


def fit_samples(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Fit ``(alpha_ms, algbw_gbs)`` to raw ``(bytes, ms)`` all-reduce measurements.

    Two steps. First a line by least squares on *relative* residuals (scipy), so that the small
    messages (where alpha shows) weigh as much as the large ones (where bandwidth shows);
    alpha is kept >= 0. Real channels are not quite a line: on gloo a chain of small
    all-reduces costs a flat few milliseconds each, while large ones cost their bytes at the
    link rate plus well under a millisecond, and the one-line compromise was 20% fast on the
    large messages and 40% fast on the small ones. So then **alpha** is re-read from the
    latency-bound sizes (the smallest, and any whose bytes take under a quarter of alpha on the
    first line: the median of their time less their bytes), and **bandwidth** from the
    others, by least squares on absolute residuals through that alpha
    (:func:`bandwidth_through`). On a true line both steps give the line.

    Example::

        >>> a, bw = fit_samples([(b, 0.2 + b / 3e6) for b in (4096, 65536, 1 << 20, 1 << 24)])
        >>> round(a, 3), round(bw, 3)
        (0.2, 3.0)
        >>> flat = [(4096, 3.9), (16384, 3.8), (65536, 3.6), (1 << 20, 42.0), (4 << 20, 168.0)]
        >>> a, bw = fit_samples(flat)       # 25 MB/s and ~0.5 ms on the large ones
        >>> round(a, 1), round(bw * 1e3, 1)
        (3.5, 25.6)
        >>> a, bw = fit_samples([(4096, 3.0), (1 << 20, 3.0), (16 << 20, 3.0)])  # no slope at all
        >>> bw < 10 * (16 << 20) / 3.0 / 1e6
        True
    """
    from scipy.optimize import least_squares

    if len(samples) < 2:
        raise UsbyteError("fitting all-reduce cost needs at least two samples")
    b = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    # Start from the two-point line through the smallest and largest message.
    i, j = int(np.argmin(b)), int(np.argmax(b))
    beta0 = max((t[j] - t[i]) / max(b[j] - b[i], 1.0), 1e-12)
    alpha0 = max(t[i] - beta0 * b[i], 0.0)

    def resid(x):
        return (x[0] + x[1] * 1e-9 * b - t) / t

    res = least_squares(resid, x0=[alpha0, beta0 * 1e9], bounds=([0.0, 1e-9], [np.inf, np.inf]))
    alpha, beta = float(res.x[0]), float(res.x[1]) * 1e-9
    # Latency-bound: bytes that take under a quarter of alpha on the first line (at least the
    # smallest message); the rest set the bandwidth.
    latency = b * beta <= alpha / 4
    latency[int(np.argmin(b))] = True
    bw = 1.0 / (beta * 1e6)
    if (~latency).any():
        alpha = max(0.0, float(np.median(t[latency] - b[latency] * beta)))
        bw = bandwidth_through([(float(x), float(y)) for x, y in zip(b[~latency], t[~latency])],
                               alpha) or bw
    # Large messages that took hardly longer than alpha (noise on a busy host) give a line
    # of near-infinite bandwidth. A bandwidth ten times what the fastest sample moved over its
    # whole time is that, not the channel: then the line through zero stands in.
    fastest = float(np.max(b / t)) / 1e6
    if not math.isfinite(bw) or bw > 10 * fastest:
        bw = bandwidth_through([(float(x), float(y)) for x, y in zip(b, t)], 0.0) or fastest
    return alpha, bw


def bandwidth_through(samples: Sequence[tuple[float, float]], alpha_ms: float) -> float | None:
    """``algbw_gbs`` of the line through ``alpha_ms`` closest to ``samples`` in absolute
    milliseconds (so the large messages, which take most of an iteration, weigh most), or
    ``None`` when no sample lies above ``alpha_ms``.

    Example::

        >>> round(bandwidth_through([(1e6, 4.0 + 40.0), (4e6, 4.0 + 160.0)], 4.0) * 1e3, 3)
        25.0
    """
    num = sum(float(b) * (float(t) - alpha_ms) for b, t in samples)
    den = sum(float(b) ** 2 for b, _ in samples)
    if num > 0 and den > 0:
        return den / num / 1e6
    return None


def ring_parameters(comm: CommSpec) -> tuple[float, float]:
    """``(hop_ms, busbw_gbs)`` of a ring all-reduce that matches ``comm`` at its world size."""
    n = comm.world_size
    if n <= 1:
        # One rank measures nothing: read alpha/algbw as if taken at two ranks.
        n = 2
    steps = 2 * (n - 1)
    return comm.alpha_ms / steps, comm.algbw_gbs * steps / n


def ring_shard_parameters(cost: CollectiveCost, world_size: int) -> tuple[float, float]:
    """``(hop_ms, busbw_gbs)`` of a ring reduce-scatter or all-gather that matches ``cost`` at
    ``world_size`` ranks (``(n - 1)`` steps; module docstring).

    Example::

        >>> hop, busbw = ring_shard_parameters(CollectiveCost(0.7, 4.0), 8)   # 7 hops
        >>> round(hop, 6), busbw                                            # 4 * 7 / 8
        (0.1, 3.5)
    """
    n = max(world_size, 2)
    steps = n - 1
    return cost.alpha_ms / steps, cost.algbw_gbs * steps / n


def retarget(comm: CommSpec, world_size: int | None = None, bandwidth_gbps: float | None = None,
             latency_us: float | None = None) -> CommSpec:
    """Move ``comm`` to another world size, link bandwidth (Gbit/s) or hop latency (µs).

    Ring all-reduce, see the module docstring; a measured reduce-scatter or all-gather line
    moves with its own ring formula (its own hop latency and bus bandwidth, unless given),
    and stays absent when absent. With nothing given, ``comm`` is returned as is.

    Example::

        >>> c = CommSpec("nccl", 8, alpha_ms=1.4, algbw_gbs=5.0)
        >>> r = retarget(c, world_size=16)
        >>> round(r.alpha_ms, 3), round(r.algbw_gbs, 3)   # 30 hops instead of 14
        (3.0, 4.667)
        >>> round(retarget(c, bandwidth_gbps=100).algbw_gbs, 3)   # 12.5 GB/s * 8 / 14
        7.143
        >>> s = CommSpec("gloo", 2, 2.0, 1.0, reduce_scatter=CollectiveCost(1.0, 2.0))
        >>> rs = retarget(s, world_size=8).reduce_scatter   # 7 hops of 1 ms; busbw 1 GB/s
        >>> round(rs.alpha_ms, 3), round(rs.algbw_gbs, 4), retarget(s, world_size=8).all_gather
        (7.0, 1.1429, None)
    """
    if world_size is None and bandwidth_gbps is None and latency_us is None:
        return comm
    n = world_size if world_size is not None else max(comm.world_size, 2)
    if n < 2:
        raise UsbyteError(f"world size {n}: a single rank has no all-reduce to schedule "
                          "(expected --world-size >= 2)")
    if bandwidth_gbps is not None and not bandwidth_gbps > 0:
        raise UsbyteError(f"--bandwidth-gbps: expected a number > 0, got {bandwidth_gbps}")
    if latency_us is not None and not latency_us >= 0:
        raise UsbyteError(f"--latency-us: expected a number >= 0, got {latency_us}")
    hop, busbw = ring_parameters(comm)
    if bandwidth_gbps is not None:
        busbw = bandwidth_gbps / 8.0
    if latency_us is not None:
        hop = latency_us / 1000.0
    steps = 2 * (n - 1)
    backend = comm.backend if world_size is None else "analytic"

    def shard(cost: CollectiveCost | None) -> CollectiveCost | None:
        if cost is None:
            return None
        h, bw = ring_shard_parameters(cost, comm.world_size)
        h = latency_us / 1000.0 if latency_us is not None else h
        bw = bandwidth_gbps / 8.0 if bandwidth_gbps is not None else bw
        return CollectiveCost(h * (n - 1), bw * n / (n - 1))

    # The training thread's share of a collective is the host's, not the link's: kept.
    return CommSpec(backend, n, hop * steps, busbw * n / steps, (), comm.cpu_ms_per_block,
                    comm.cpu_ms_per_mb, shard(comm.reduce_scatter), shard(comm.all_gather))
