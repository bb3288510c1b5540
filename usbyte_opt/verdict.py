"""Which of two ways of training is faster, on a machine that may be too noisy to tell: the one
rule behind every measured comparison usbyte-opt prints or acts on (``usbyte-opt demo``,
``usbyte-opt bench``, the runtime's ``verify=True``). Pure Python: no torch, no scipy.

**Measurements.** A and B take turns in *windows* of a few iterations each, interleaved and
the order alternating (A B, B A, A B, ...); each window is reduced to one number, the median
of its iteration times. Window ``i`` of A and window ``i`` of B make a *pair*: they ran next to
each other, so a slow spell of the machine (another job, a throttled core) hits both, and the
pair's ratio cancels it where the raw times would not.

**Method** (:func:`compare`): for each pair, ``d = ln(b / a)``; the ratio reported is
``exp(mean d)`` (the geometric mean of the pairs' B/A), its confidence interval
``exp(mean d ± t * sd(d) / sqrt(n))`` with Student's t at ``n - 1`` degrees of freedom (a
paired t-interval on log ratios: log ratios of window medians are close to normal, and an
interval on the log scale stays positive and reads the same from either side). Fewer than 2
pairs give no interval (0 to infinity).

**Verdict** (:meth:`Ratio.verdict`): B is faster when the whole interval of B/A lies below 1,
A when it lies above; otherwise "not distinguishable on this machine (±X%)", X being the
interval's half-width: differences smaller than that are beyond what this machine measures.

**How many windows** (:class:`Budget`): at least ``min_pairs``; then the interval is looked at
after ``min_pairs``, ``2 * min_pairs``, ``4 * min_pairs``, ... pairs and after ``max_pairs``,
and windows are added until it excludes 1, or ``max_pairs`` or ``max_s`` is reached. Looking
more than once and stopping when the answer suits would make a 95% interval wrong more than
5% of the time, so each look uses the level ``1 - 0.05 / L`` for ``L`` looks at most
(Bonferroni): the intervals of all looks together hold at 95%, and that is what is printed
as "95% CI". With several comparisons at once (several strategies against DDP) the level
holds for each, not for all together.

Example::

    >>> a = [100.0, 104.0, 98.0, 101.0, 103.0, 99.0]      # ms per iteration, window medians
    >>> b = [90.0, 95.0, 88.0, 91.0, 92.0, 90.0]
    >>> r = compare(a, b)
    >>> print(r)
    0.90x (95% CI 0.89–0.91x)
    >>> r.verdict("DDP", "best")
    'best faster'
    >>> compare(a, [101.0, 99.0, 103.0, 97.0, 104.0, 100.0]).verdict("DDP", "best")
    'not distinguishable on this machine (±4%)'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The confidence of every interval printed.
CONFIDENCE = 0.95


def t_quantile(level: float, df: int) -> float:
    """The ``t`` with ``P(|T| < t) = level`` for Student's T with ``df`` degrees of freedom
    (the two-sided quantile of a ``level`` interval), from the closed form of its distribution
    at whole ``df`` (Abramowitz and Stegun 26.7.3-4), inverted by bisection.

    Example::

        >>> round(t_quantile(0.95, 1), 3), round(t_quantile(0.95, 2), 3), round(t_quantile(0.95, 30), 3)
        (12.706, 4.303, 2.042)
    """
    if not 0.0 < level < 1.0 or df < 1:
        raise ValueError(f"t_quantile: expected 0 < level < 1 and df >= 1, got {level}, {df}")

    def within(theta: float) -> float:  # P(|T| < sqrt(df) * tan(theta))
        c2 = math.cos(theta) ** 2
        term = total = 1.0
        if df % 2:
            for k in range(1, (df - 1) // 2):
                term *= c2 * (2 * k) / (2 * k + 1)
                total += term
            extra = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
            return 2.0 / math.pi * (theta + extra)
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return math.sin(theta) * total

    lo, hi = 0.0, math.pi / 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if within(mid) < level:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan(0.5 * (lo + hi))


@dataclass(frozen=True, slots=True)
class Ratio:
    """B's time over A's, measured in paired windows, with its interval (:func:`compare`)."""

    ratio: float
    """The geometric mean of the pairs' B/A (below 1: B takes less time)."""
    lo: float
    """Lower end of the interval (0 with fewer than 2 pairs)."""
    hi: float
    """Upper end (infinity with fewer than 2 pairs)."""
    pairs: int
    """Pairs of windows it rests on."""
    confidence: float = CONFIDENCE
    """The confidence the interval is printed with (over every look, :class:`Budget`)."""

    @property
    def distinguishable(self) -> bool:
        """Whether the interval excludes 1: one of the two is measurably faster."""
        return self.hi < 1.0 or self.lo > 1.0

    @property
    def half_width(self) -> float:
        """The interval's half-width, relative: ``sqrt(hi / lo) - 1`` (infinity without one).

        Example::

            >>> round(Ratio(1.0, 0.94, 1.0638, 6).half_width, 3)
            0.064
        """
        if self.lo <= 0.0 or math.isinf(self.hi):
            return math.inf
        return math.sqrt(self.hi / self.lo) - 1.0

    def noise(self) -> str:
        """``±X%``: how close two times may be and still look alike on this machine (``within
        a factor of N`` past ±100%).

        Example::

            >>> Ratio(1.0, 0.94, 1.0638, 6).noise(), Ratio(0.6, 0.1, 4.4, 4).noise()
            ('±6%', 'within a factor of 6.6')
        """
        w = self.half_width
        if math.isinf(w):
            return "too few windows to tell"
        return f"±{max(1, round(100 * w))}%" if w < 1.0 else f"within a factor of {1 + w:.1f}"

    def verdict(self, a: str = "A", b: str = "B") -> str:
        """``"<b> faster"``, ``"<a> faster"`` or ``"not distinguishable on this machine (±X%)"``.

        Example::

            >>> Ratio(1.2, 1.1, 1.3, 5).verdict("DDP", "best")
            'DDP faster'
            >>> Ratio(1.0, 0.0, math.inf, 1).verdict()
            'not distinguishable on this machine (too few windows to tell)'
        """
        if self.hi < 1.0:
            return f"{b} faster"
        if self.lo > 1.0:
            return f"{a} faster"
        return f"not distinguishable on this machine ({self.noise()})"

    def interval(self, fmt: str = ".2f") -> str:
        """``lo–hi x`` (``—`` without an interval)."""
        if self.lo <= 0.0 or math.isinf(self.hi):
            return "—"
        return f"{self.lo:{fmt}}–{self.hi:{fmt}}x"

    def inverse(self) -> Ratio:
        """A's time over B's (the speed-up of B), same interval turned over.

        Example::

            >>> Ratio(0.8, 0.5, 1.25, 4).inverse()
            Ratio(ratio=1.25, lo=0.8, hi=2.0, pairs=4, confidence=0.95)
        """
        return Ratio(1.0 / self.ratio, 1.0 / self.hi if self.hi > 0 else math.inf,
                     1.0 / self.lo if self.lo > 0 else math.inf, self.pairs, self.confidence)

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x ({round(100 * self.confidence)}% CI {self.interval()})"

    def to_dict(self) -> dict[str, float | int | None]:
        """For JSON: ``ratio``, ``lo``, ``hi`` (``None`` without an interval), ``pairs``,
        ``confidence``."""
        ok = self.lo > 0.0 and not math.isinf(self.hi)
        return {"ratio": round(self.ratio, 6), "lo": round(self.lo, 6) if ok else None,
                "hi": round(self.hi, 6) if ok else None, "pairs": self.pairs,
                "confidence": self.confidence}


def compare(a: Sequence[float], b: Sequence[float], level: float = CONFIDENCE,
            confidence: float = CONFIDENCE) -> Ratio:
    """B's time over A's from paired windows (``a[i]`` and ``b[i]`` ran next to each other;
    each a window's median, ms); pairs with a value that is not a positive number are left
    out. ``level``: the interval's own level (:meth:`Budget.level` when windows were added
    while looking); ``confidence``: what it is printed as.

    Example::

        >>> r = compare([10.0, 11.0, 10.5], [12.0, 13.0, 12.5])
        >>> round(r.ratio, 3), round(r.lo, 3), round(r.hi, 3), r.pairs
        (1.191, 1.168, 1.214, 3)
        >>> compare([10.0], [9.0]).distinguishable      # one pair: no interval
        False
    """
    d = [math.log(y / x) for x, y in zip(a, b)
         if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)]
    n = len(d)
    if n == 0:
        return Ratio(1.0, 0.0, math.inf, 0, confidence)
    mean = sum(d) / n
    if n < 2:
        return Ratio(math.exp(mean), 0.0, math.inf, n, confidence)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, confidence)


@dataclass(frozen=True, slots=True)
class Budget:
    """How many pairs of windows to take (see the module): at least ``min_pairs``, at most
    ``max_pairs``, no more once ``max_s`` seconds have gone; in between, more while an
    interval contains 1.

    Example::

        >>> b = Budget(min_pairs=4, max_pairs=12)
        >>> b.looks(), round(b.level(), 4)
        ([4, 8, 12], 0.9833)
    """

    min_pairs: int = 4
    max_pairs: int = 12
    max_s: float = math.inf
    confidence: float = CONFIDENCE

    def looks(self) -> list[int]:
        """The pair counts at which the interval is looked at: ``min_pairs`` doubling, and
        ``max_pairs``."""
        lo = max(1, self.min_pairs)
        hi = max(lo, self.max_pairs)
        out = []
        n = lo
        while n < hi:
            out.append(n)
            n *= 2
        return out + [hi]

    def level(self) -> float:
        """Each look's level: ``1 - (1 - confidence) / looks``, so that all looks together
        hold at ``confidence``."""
        return 1.0 - (1.0 - self.confidence) / len(self.looks())

    def compare(self, a: Sequence[float], b: Sequence[float]) -> Ratio:
        """:func:`compare` at this budget's level (printed as its ``confidence``)."""
        return compare(a, b, self.level(), self.confidence)

    def more(self, pairs: int, elapsed_s: float, *ratios: Ratio) -> bool:
        """Whether to take another pair of windows, after ``pairs`` pairs and ``elapsed_s``
        seconds, the comparisons standing at ``ratios`` (:meth:`compare`).

        Example::

            >>> b = Budget(min_pairs=4, max_pairs=12, max_s=60.0)
            >>> unsure, sure = Ratio(1.0, 0.9, 1.1, 4), Ratio(0.8, 0.7, 0.9, 4)
            >>> b.more(3, 1.0, sure)            # below the minimum
            True
            >>> b.more(4, 1.0, sure), b.more(4, 1.0, unsure)
            (False, True)
            >>> b.more(5, 1.0, sure)            # not a look: no stopping on a lucky draw
            True
            >>> b.more(12, 1.0, unsure), b.more(6, 61.0, unsure)   # out of pairs, of time
            (False, False)
        """
        if pairs < self.min_pairs:
            return True
        if pairs >= self.max_pairs or elapsed_s >= self.max_s:
            return False
        if pairs not in self.looks():
            return True
        return any(not r.distinguishable for r in ratios)


__all__ = ["CONFIDENCE", "Budget", "Ratio", "compare", "t_quantile"]
