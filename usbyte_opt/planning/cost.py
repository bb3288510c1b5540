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

Several nodes of several ranks (a profile with ``comm.intra`` and ``comm.inter``, or one moved
there by :func:`retarget_nodes`) get :class:`HierCost`: each block all-reduced flat or
hierarchically, whichever is cheaper (docs/planner.md, "Several nodes").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UsageError, UsbyteError
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


def ring_line(n: int, hop_ms: float, busbw_gbs: float) -> tuple[float, float]:
    """``(alpha_ms, algbw_gbs)`` of a ring all-reduce over ``n`` ranks with ``hop_ms`` per
    ring step and ``busbw_gbs`` of bus bandwidth (nccl-tests' convention, ``busbw = algbw *
    2 (n - 1) / n``): ``alpha = 2 (n - 1) hop``, ``algbw = busbw n / (2 (n - 1))``.

    Example::

        >>> ring_line(8, 0.001, 150.0)          # 14 steps of 1 µs; 150 * 8 / 14 GB/s
        (0.014, 85.71428571428571)
    """
    steps = 2 * (max(n, 2) - 1)
    return steps * hop_ms, busbw_gbs * max(n, 2) / steps


@dataclass(frozen=True, slots=True)
class HierCost:
    """The :class:`CostModel` of ``nodes`` nodes of ``ranks_per_node`` ranks each, where a
    block is all-reduced either **flat** (one ring over all ``n = nodes * ranks_per_node``
    ranks: the line ``flat``) or **hierarchically**: reduce-scatter inside each node, one
    all-reduce of ``b / G`` per rank across the nodes (the ``G`` of a node at once, sharing
    the node's link), all-gather inside. By the bus-bandwidth convention of nccl-tests the
    two halves inside a node cost one intra-node all-reduce and the ``G`` concurrent pieces
    one inter-node all-reduce of the whole block, so

        hier(b) = intra(b) + inter(b) = (alpha_i + alpha_e) + b / algbw_i + b / algbw_e

    with ``intra`` the all-reduce line on the ranks of one node and ``inter`` the one on one
    rank per node (docs/planner.md, "Several nodes"). The planner picks, per block, the
    cheaper form: :meth:`allreduce_ms` is ``min(flat, hier)`` (``hierarchy=False``: flat
    only), :meth:`is_hier` says which. The minimum of two lines is not a line
    (:attr:`is_linear` false unless one form is cheaper at every size); :meth:`linear_bound`
    is ``(min alpha, min beta)``, at or below both lines, and the lowest line that is.

    Sharded mode reduce-scatters and all-gathers flat (half the flat all-reduce each, or the
    profile's measured lines); :meth:`hier_reduce_scatter_ms` and
    :meth:`hier_all_gather_ms` cost the hierarchical forms (half of each level) for
    comparison.

    Example (2 nodes of 4 ranks; lines in ``(alpha_ms, algbw_gbs)``)::

        >>> c = HierCost(flat=(0.7, 2.0), intra=(0.06, 100.0), inter=(0.2, 5.0), nodes=2,
        ...              ranks_per_node=4)
        >>> round(c.flat_ms(10e6), 6), round(c.hier_ms(10e6), 6)   # 0.7 + 5; 0.26 + 0.1 + 2
        (5.7, 2.36)
        >>> round(c.allreduce_ms(10e6), 6), c.is_hier(10e6), c.is_hier(1_000)
        (2.36, True, True)
        >>> c.crossover_bytes(), c.is_linear   # hier has the lower alpha and beta: always
        (inf, True)
        >>> d = HierCost(flat=(0.1, 2.0), intra=(0.06, 100.0), inter=(0.2, 5.0), nodes=2,
        ...              ranks_per_node=4)
        >>> round(d.crossover_bytes())       # 0.16 ms / 0.29e-6 ms per byte
        551724
        >>> d.is_hier(500_000), d.is_hier(600_000)
        (False, True)
        >>> e = HierCost(flat=(0.7, 5.0), intra=(0.06, 10.0), inter=(0.2, 5.0), nodes=2,
        ...              ranks_per_node=4)    # a slow ring inside: hierarchical below
        >>> round(e.crossover_bytes()), e.is_hier(1_000_000), e.is_hier(5_000_000)
        (4400000, True, False)
        >>> [round(x, 12) for x in d.linear_bound()], d.is_linear    # (min alpha, min beta)
        ([0.1, 2.1e-07], False)
        >>> round(d.flat_only().allreduce_ms(10e6), 6)   # the flat ring alone: 0.1 + 5 ms
        5.1
        >>> round(d.reduce_scatter_ms(10e6), 6), round(d.hier_reduce_scatter_ms(10e6), 6)
        (2.55, 1.18)
    """

    flat: tuple[float, float]
    """``(alpha_ms, algbw_gbs)`` of the flat all-reduce (one ring over every rank)."""
    intra: tuple[float, float]
    """``(alpha_ms, algbw_gbs)`` of the all-reduce on the ranks of one node."""
    inter: tuple[float, float]
    """``(alpha_ms, algbw_gbs)`` of the all-reduce on one rank per node (the node's link)."""
    nodes: int = 2
    ranks_per_node: int = 2
    hierarchy: bool = True
    """Whether a block may be hierarchical (``False``: every block flat)."""
    reduce_scatter: tuple[float, float] | None = None
    """Measured flat reduce-scatter line; ``None``: half the flat all-reduce."""
    all_gather: tuple[float, float] | None = None
    """Measured flat all-gather line; ``None``: half the flat all-reduce."""

    @property
    def hier_alpha_ms(self) -> float:
        return self.intra[0] + self.inter[0]

    @property
    def hier_beta_ms_per_byte(self) -> float:
        return 1.0 / (self.intra[1] * 1e6) + 1.0 / (self.inter[1] * 1e6)

    @property
    def flat_beta_ms_per_byte(self) -> float:
        return 1.0 / (self.flat[1] * 1e6)

    def flat_ms(self, nbytes: float) -> float:
        """Milliseconds of a flat all-reduce of ``nbytes``."""
        return self.flat[0] + nbytes / (self.flat[1] * 1e6)

    def hier_ms(self, nbytes: float) -> float:
        """Milliseconds of a hierarchical all-reduce of ``nbytes``."""
        return self.hier_alpha_ms + nbytes * self.hier_beta_ms_per_byte

    def is_hier(self, nbytes: float) -> bool:
        """Whether a block of ``nbytes`` is all-reduced hierarchically: allowed, and strictly
        cheaper than flat (a tie stays flat)."""
        return self.hierarchy and self.hier_ms(nbytes) < self.flat_ms(nbytes)

    def crossover_bytes(self) -> float:
        """The block size at which flat and hierarchical cost the same (``inf``: none above
        zero, one form is the cheaper at every size). Hierarchical is the cheaper above it when
        its beta is the smaller (a slow link between nodes), below it when its alpha is the
        smaller and its beta the larger (a slow ring inside each node): :meth:`is_hier`."""
        da = self.hier_alpha_ms - self.flat[0]
        db = self.flat_beta_ms_per_byte - self.hier_beta_ms_per_byte
        if db == 0 or not da / db > 0:
            return math.inf
        return da / db

    def _dominated(self) -> bool:
        """Whether one line is at or below the other at every size (the minimum is a line)."""
        fa, fb = self.flat[0], self.flat_beta_ms_per_byte
        ha, hb = self.hier_alpha_ms, self.hier_beta_ms_per_byte
        return (fa <= ha and fb <= hb) or (ha <= fa and hb <= fb)

    @property
    def is_linear(self) -> bool:
        return not self.hierarchy or self._dominated()

    def allreduce_ms(self, nbytes: float) -> float:
        f = self.flat_ms(nbytes)
        return min(f, self.hier_ms(nbytes)) if self.hierarchy else f

    def allreduce_ms_array(self, nbytes: np.ndarray) -> np.ndarray:
        f = self.flat[0] + nbytes * self.flat_beta_ms_per_byte
        if not self.hierarchy:
            return f
        return np.minimum(f, self.hier_alpha_ms + nbytes * self.hier_beta_ms_per_byte)

    def linear_bound(self) -> tuple[float, float]:
        if not self.hierarchy:
            return self.flat[0], self.flat_beta_ms_per_byte
        return (min(self.flat[0], self.hier_alpha_ms),
                min(self.flat_beta_ms_per_byte, self.hier_beta_ms_per_byte))

    def flat_only(self) -> LinearCost:
        """The model of flat rings only (what DDP over NCCL and every known strategy run)."""
        return LinearCost(self.flat[0], self.flat[1], self.reduce_scatter, self.all_gather)

    def reduce_scatter_ms(self, nbytes: float) -> float:
        return self.flat_only().reduce_scatter_ms(nbytes)

    def all_gather_ms(self, nbytes: float) -> float:
        return self.flat_only().all_gather_ms(nbytes)

    def shard_bounds(self) -> tuple[tuple[float, float], tuple[float, float]]:
        return self.flat_only().shard_bounds()

    def hier_reduce_scatter_ms(self, nbytes: float) -> float:
        """A hierarchical reduce-scatter of a block of ``nbytes``: reduce-scatter inside the
        node, then across nodes, half of each level's all-reduce."""
        return 0.5 * self.hier_ms(nbytes)

    def hier_all_gather_ms(self, nbytes: float) -> float:
        """A hierarchical all-gather into a block of ``nbytes`` (half of each level)."""
        return 0.5 * self.hier_ms(nbytes)

    @classmethod
    def from_comm(cls, comm: CommSpec, hierarchy: bool = True) -> HierCost:
        """The model of a ``comm`` with both level lines (``comm.intra``, ``comm.inter``)."""
        if comm.intra is None or comm.inter is None:
            raise ValueError("HierCost.from_comm: expected a comm with intra and inter lines")

        def line(c: CollectiveCost | None) -> tuple[float, float] | None:
            return None if c is None else (c.alpha_ms, c.algbw_gbs)
        return cls((comm.alpha_ms, comm.algbw_gbs), (comm.intra.alpha_ms, comm.intra.algbw_gbs),
                   (comm.inter.alpha_ms, comm.inter.algbw_gbs), comm.nodes, comm.ranks_per_node,
                   hierarchy, line(comm.reduce_scatter), line(comm.all_gather))


def cost_model(comm: CommSpec, hierarchy: bool = True) -> CostModel:
    """The cost model of a profile's ``comm``: :class:`HierCost` when it spans several nodes
    of several ranks and carries both level lines (``comm.intra``, ``comm.inter``; with
    ``hierarchy=False`` it charges flat rings only), else :class:`LinearCost` (its
    ``alpha_ms`` and ``algbw_gbs``; reduce-scatter and all-gather from
    ``comm.reduce_scatter`` and ``comm.all_gather`` when the profile measured them, else half
    an all-reduce each): every profile of one node plans exactly as before.

    Example::

        >>> from usbyte_opt.formats import CollectiveCost
        >>> old = cost_model(CommSpec("gloo", 2, 1.0, 0.5))              # no sharded lines
        >>> old.allreduce_ms(1e6), old.reduce_scatter_ms(1e6), old.all_gather_ms(1e6)
        (3.0, 1.5, 1.5)
        >>> new = cost_model(CommSpec("gloo", 2, 1.0, 0.5, reduce_scatter=CollectiveCost(0.4, 1.0)))
        >>> new.allreduce_ms(1e6), new.reduce_scatter_ms(1e6), new.all_gather_ms(1e6)
        (3.0, 1.4, 1.5)
        >>> two = CommSpec("nccl", 8, 0.7, 2.0, nodes=2, intra=CollectiveCost(0.06, 100.0),
        ...                inter=CollectiveCost(0.2, 5.0))
        >>> type(cost_model(two)).__name__, round(cost_model(two).allreduce_ms(10e6), 6)
        ('HierCost', 2.36)
    """
    if comm.hierarchical and comm.intra is not None and comm.inter is not None:
        return HierCost.from_comm(comm, hierarchy)
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
             latency_us: float | None = None, *, nodes: int | None = None,
             ranks_per_node: int | None = None, intra_gbps: float | None = None,
             inter_gbps: float | None = None, intra_latency_us: float | None = None,
             inter_latency_us: float | None = None) -> CommSpec:
    """Move ``comm`` to another world size, link bandwidth (Gbit/s) or hop latency (µs).

    Ring all-reduce, see the module docstring; a measured reduce-scatter or all-gather line
    moves with its own ring formula (its own hop latency and bus bandwidth, unless given),
    and stays absent when absent. With nothing given, ``comm`` is returned as is.

    ``nodes``, ``ranks_per_node`` and the per-level options, or a profile measured on
    several nodes, move it by nodes instead (:func:`retarget_nodes`).

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
    levels = (nodes, ranks_per_node, intra_gbps, inter_gbps, intra_latency_us, inter_latency_us)
    if any(v is not None for v in levels) or comm.nodes > 1:
        if bandwidth_gbps is not None or latency_us is not None:
            flag = "--bandwidth-gbps" if bandwidth_gbps is not None else "--latency-us"
            raise UsageError(f"{flag}: one ring's links; with several nodes give each level's "
                             "instead (--intra-gbps/--inter-gbps, --intra-latency-us/"
                             "--inter-latency-us)")
        return retarget_nodes(comm, world_size, *levels)
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


def level_parameters(cost: CollectiveCost, n: int) -> tuple[float, float]:
    """``(hop_ms, busbw_gbs)`` of a ring all-reduce line measured on ``n`` ranks."""
    n = max(n, 2)
    steps = 2 * (n - 1)
    return cost.alpha_ms / steps, cost.algbw_gbs * steps / n


def retarget_nodes(comm: CommSpec, world_size: int | None = None, nodes: int | None = None,
                   ranks_per_node: int | None = None, intra_gbps: float | None = None,
                   inter_gbps: float | None = None, intra_latency_us: float | None = None,
                   inter_latency_us: float | None = None) -> CommSpec:
    """Move ``comm`` to ``nodes`` nodes of ``ranks_per_node`` ranks (docs/planner.md,
    "Several nodes"). Bandwidths are bus bandwidths in Gbit/s (nccl-tests' convention; inter:
    the node's link), latencies per ring step in µs.

    Unset values come from the profile: the number of ranks per node from its own (a profile
    of one node: its world size, or ``world_size / nodes``), the nodes from ``world_size / G``
    or its own; each level's hop latency and bus bandwidth from its ``intra`` and ``inter``
    lines, and for a profile of one node the intra level from its whole-group line (measured
    inside that node). A profile of one node has no link between nodes to read: moving it to
    several needs ``inter_gbps`` (:class:`~usbyte_opt.errors.UsageError` otherwise); its
    inter latency defaults to the intra one. The flat line is the ring over all ranks on the
    slower level (``2 (n - 1)`` steps of the larger hop, the smaller bus bandwidth), the
    level lines each level's ring; a profile moved to its own shape keeps its measured
    lines. Reduce-scatter and all-gather are then half a flat all-reduce each.

    Example (one node of 8, retargeted to 4 nodes of 8 with 100 Gbit/s between them)::

        >>> one = CommSpec("nccl", 8, alpha_ms=0.014, algbw_gbs=85.0)
        >>> r = retarget_nodes(one, nodes=4, inter_gbps=100, inter_latency_us=5)
        >>> r.world_size, r.nodes, r.ranks_per_node, r.backend
        (32, 4, 8, 'analytic')
        >>> round(r.inter.alpha_ms, 6), round(r.inter.algbw_gbs, 6)  # 6 hops of 5 µs; 12.5*4/6
        (0.03, 8.333333)
        >>> round(r.intra.alpha_ms, 6), round(r.intra.algbw_gbs, 6)  # the node as measured
        (0.014, 85.0)
        >>> round(r.alpha_ms, 6), round(r.algbw_gbs, 4)   # 62 hops of 5 µs; 12.5 * 32 / 62
        (0.31, 6.4516)
        >>> retarget_nodes(one, nodes=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: --nodes 4: the profile was measured on one node ...
    """
    N0, G0 = max(comm.nodes, 1), comm.ranks_per_node
    _check_level_options(nodes, ranks_per_node, intra_gbps, inter_gbps, intra_latency_us,
                         inter_latency_us)
    N, G = _shape(N0, G0, world_size, nodes, ranks_per_node)
    n = N * G
    given = (intra_gbps, inter_gbps, intra_latency_us, inter_latency_us)
    if N == N0 and G == G0 and all(v is None for v in given):
        return comm
    (hop_i, bw_i), (hop_e, bw_e) = _levels(comm, N, intra_gbps, inter_gbps, intra_latency_us,
                                           inter_latency_us)
    intra = inter = None
    if N == 1:
        flat = ring_line(n, hop_i, bw_i)
    elif G == 1:
        flat = ring_line(n, hop_e, bw_e)
    else:
        flat = ring_line(n, max(hop_i, hop_e), min(bw_i, bw_e))
        intra = CollectiveCost(*ring_line(G, hop_i, bw_i))
        inter = CollectiveCost(*ring_line(N, hop_e, bw_e))
    return CommSpec("analytic", n, flat[0], flat[1], (), comm.cpu_ms_per_block,
                    comm.cpu_ms_per_mb, None, None, N, intra, inter)


def _check_level_options(nodes: int | None, ranks_per_node: int | None,
                         intra_gbps: float | None, inter_gbps: float | None,
                         intra_latency_us: float | None, inter_latency_us: float | None) -> None:
    """:func:`retarget_nodes`' options each in range, or a one-line
    :class:`~usbyte_opt.errors.UsageError` naming the flag."""
    for flag, v in (("--intra-gbps", intra_gbps), ("--inter-gbps", inter_gbps)):
        if v is not None and not v > 0:
            raise UsageError(f"{flag}: expected a number > 0, got {v}")
    for flag, v in (("--intra-latency-us", intra_latency_us),
                    ("--inter-latency-us", inter_latency_us)):
        if v is not None and not v >= 0:
            raise UsageError(f"{flag}: expected a number >= 0, got {v}")
    for flag, w in (("--nodes", nodes), ("--ranks-per-node", ranks_per_node)):
        if w is not None and w < 1:
            raise UsageError(f"{flag}: expected a whole number >= 1, got {w}")


def _shape(N0: int, G0: int, world_size: int | None, nodes: int | None,
           ranks_per_node: int | None) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of :func:`retarget_nodes` from its options and the
    profile's own ``N0`` nodes of ``G0``: a one-line error where they disagree, or where a
    single rank is left."""
    if ranks_per_node is not None:
        G = ranks_per_node
    elif nodes is not None and world_size is not None:
        if world_size % nodes:
            raise UsageError(f"--world-size {world_size}: expected a multiple of --nodes {nodes}")
        G = world_size // nodes
    else:
        G = G0
    if nodes is not None:
        N = nodes
    elif world_size is not None:
        if world_size % G:
            raise UsageError(f"--world-size {world_size}: expected a multiple of the ranks per "
                             f"node ({G}; --ranks-per-node)")
        N = world_size // G
    else:
        N = N0
    n = N * G
    if world_size is not None and world_size != n:
        raise UsageError(f"--world-size {world_size}: expected --nodes x --ranks-per-node "
                         f"({N} x {G} = {n})")
    if n < 2:
        raise UsbyteError(f"world size {n}: a single rank has no all-reduce to schedule "
                          "(expected --world-size >= 2)")
    return N, G


def _levels(comm: CommSpec, N: int, intra_gbps: float | None, inter_gbps: float | None,
            intra_latency_us: float | None, inter_latency_us: float | None,
            ) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((hop_ms, busbw_gbs) inside a node, (hop_ms, busbw_gbs) between nodes)`` for
    :func:`retarget_nodes` on ``N`` nodes: the profile's level lines (or its whole-group
    line where it has no such level), the options given replacing them."""
    N0, G0 = max(comm.nodes, 1), comm.ranks_per_node
    # the intra level: the profile's intra line, else (one node, or one rank per node) its
    # whole-group line
    if comm.intra is not None:
        hop_i, bw_i = level_parameters(comm.intra, G0)
    else:
        hop_i, bw_i = ring_parameters(comm)
    if comm.inter is not None:
        hop_e, bw_e = level_parameters(comm.inter, N0)
    elif N0 > 1:                      # one rank per node: the whole group is the inter level
        hop_e, bw_e = ring_parameters(comm)
    else:
        if N > 1 and inter_gbps is None:
            raise UsageError(f"--nodes {N}: the profile was measured on one node and has no "
                             "link between nodes to read; add --inter-gbps X (each node's "
                             "network bus bandwidth, Gbit/s) and --inter-latency-us Y")
        hop_e, bw_e = hop_i, bw_i
    if intra_gbps is not None:
        bw_i = intra_gbps / 8.0
    if intra_latency_us is not None:
        hop_i = intra_latency_us / 1000.0
    if inter_gbps is not None:
        bw_e = inter_gbps / 8.0
    if inter_latency_us is not None:
        hop_e = inter_latency_us / 1000.0
    elif N0 == 1 and comm.inter is None and intra_latency_us is not None:
        hop_e = hop_i
    return (hop_i, bw_i), (hop_e, bw_e)


def retarget_warning(comm: CommSpec, world_size: int | None, nodes: int | None,
                     ranks_per_node: int | None = None) -> str | None:
    """The one line to print when a profile of one node is moved to a larger world size
    without saying the nodes (the ring then assumes every link as fast as the measured one),
    else ``None``.

    Example::

        >>> print(retarget_warning(CommSpec("nccl", 8, 0.014, 85.0), 64, None))  # doctest: +ELLIPSIS
        --world-size 64 on a profile measured on one node of 8 ranks: assuming all 64 ranks ...
        >>> retarget_warning(CommSpec("nccl", 8, 0.014, 85.0), 64, 8) is None
        True
    """
    if (comm.nodes > 1 or world_size is None or world_size <= comm.world_size
            or nodes is not None or ranks_per_node is not None):
        return None
    return (f"--world-size {world_size} on a profile measured on one node of {comm.world_size} "
            f"ranks: assuming all {world_size} ranks on links as fast as the measured ones (one "
            "node); for several nodes give --nodes N and --inter-gbps X")
