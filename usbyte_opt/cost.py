"""All-reduce cost model: ``c(b) = alpha_ms + b / (algbw_gbs * 1e6)`` (DESIGN.md §2).

``algbw`` is the nccl-tests "algorithm bandwidth" (bytes of the buffer over time), so one
number covers any world size once measured there. To move a profile to another cluster,
:func:`retarget` assumes a ring all-reduce over ``n`` ranks:

    t(b) = 2 (n - 1) * hop_ms  +  (2 (n - 1) / n) * b / busbw

so ``alpha = 2 (n - 1) * hop_ms`` and ``algbw = busbw * n / (2 (n - 1))``, where ``busbw`` is
the per-link bandwidth (``--bandwidth-gbps X`` gives ``busbw = X / 8`` GB/s) and ``hop_ms`` the
latency of one ring step (``--latency-us``). Values not given are derived from the profile's
own measurement at its own world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import UsbyteError
from .formats import CommSpec


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear all-reduce cost of one collective of ``nbytes``.

    Example::

        >>> CostModel(alpha_ms=0.5, algbw_gbs=2.0)(4_000_000)   # 0.5 + 4e6 / 2e6
        2.5
    """

    alpha_ms: float
    algbw_gbs: float

    @property
    def beta_ms_per_byte(self) -> float:
        return 1.0 / (self.algbw_gbs * 1e6)

    def __call__(self, nbytes: float) -> float:
        return self.alpha_ms + nbytes / (self.algbw_gbs * 1e6)

    @classmethod
    def from_comm(cls, comm: CommSpec) -> "CostModel":
        return cls(comm.alpha_ms, comm.algbw_gbs)


def fit_samples(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Fit ``(alpha_ms, algbw_gbs)`` to raw ``(bytes, ms)`` all-reduce measurements.

    Least squares on *relative* residuals, so that the small messages (where alpha shows)
    weigh as much as the large ones (where bandwidth shows); alpha is kept >= 0.

    Example::

        >>> a, bw = fit_samples([(b, 0.2 + b / 3e6) for b in (4096, 65536, 1 << 20, 1 << 24)])
        >>> round(a, 3), round(bw, 3)
        (0.2, 3.0)
    """
    import numpy as np
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
    return alpha, 1.0 / (beta * 1e6)


def ring_parameters(comm: CommSpec) -> tuple[float, float]:
    """``(hop_ms, busbw_gbs)`` of a ring all-reduce that matches ``comm`` at its world size."""
    n = comm.world_size
    if n <= 1:
        # One rank measures nothing: read alpha/algbw as if taken at two ranks.
        n = 2
    steps = 2 * (n - 1)
    return comm.alpha_ms / steps, comm.algbw_gbs * steps / n


def retarget(comm: CommSpec, world_size: int | None = None, bandwidth_gbps: float | None = None,
             latency_us: float | None = None) -> CommSpec:
    """Move ``comm`` to another world size, link bandwidth (Gbit/s) or hop latency (µs).

    Ring all-reduce, see the module docstring. With nothing given, ``comm`` is returned as is.

    Example::

        >>> c = CommSpec("nccl", 8, alpha_ms=1.4, algbw_gbs=5.0)
        >>> r = retarget(c, world_size=16)
        >>> round(r.alpha_ms, 3), round(r.algbw_gbs, 3)   # 30 hops instead of 14
        (3.0, 4.667)
        >>> round(retarget(c, bandwidth_gbps=100).algbw_gbs, 3)   # 12.5 GB/s * 8 / 14
        7.143
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
    return CommSpec(backend, n, hop * steps, busbw * n / steps, ())
