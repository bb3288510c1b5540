"""The record of the probe of what all-reduce costs the training thread: a profile's
``meta.cpu_probe`` (written by :mod:`usbyte_opt.profiler`, read by ``usbyte-opt bench``),
typed. This module imports no torch.

Example::

    >>> doc = {"method": "m", "cpu_ms_per_block": 0.2, "cpu_ms_per_mb": 1.5,
    ...        "step_alone_ms": 30.0, "chains": [{"bytes": 131072, "blocks": 32}],
    ...        "repeats": 4, "passes": 4, "spread": {"cpu_ms_per_mb": [1.0, 2.0]},
    ...        "samples": [{"bytes": 4096, "ms": 0.4}], "alpha_ms": None}
    >>> rec = CpuProbeRecord.from_dict(doc)
    >>> rec.samples, rec.to_dict() == doc
    (((4096, 0.4),), True)
    >>> CpuProbeRecord.from_dict({**doc, "samples": [{"bytes": "x"}]}, "p.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    usbyte_opt.errors.FormatError: p.json: meta.cpu_probe.samples[0]: expected {"bytes": ...
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError

#: Where the record lives in a profile.
FIELD = "meta.cpu_probe"


@dataclass(frozen=True, slots=True)
class CpuProbeRecord:
    """What :func:`usbyte_opt.profiler.probe.comm_under_compute` measured, as kept in a profile."""

    method: str
    cpu_ms_per_block: float
    """Training-thread time lost per block issued."""
    cpu_ms_per_mb: float
    """Training-thread time lost per MB all-reduced."""
    step_alone_ms: float
    """A training iteration with no communication in flight."""
    chains: tuple[tuple[int, int], ...]
    """``(bytes, blocks)`` of every chain the probe issued."""
    repeats: int
    passes: int = 0
    spread: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """5th-95th percentiles of ``cpu_ms_per_block`` and ``cpu_ms_per_mb``."""
    samples: tuple[tuple[int, float], ...] = ()
    """``(bytes, ms)``: one block's all-reduce time while training runs."""
    alpha_ms: float | None = None
    """The latency fitted to ``samples`` (recorded, not planned with)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``meta.cpu_probe``."""
        return {
            "method": self.method,
            "cpu_ms_per_block": self.cpu_ms_per_block,
            "cpu_ms_per_mb": self.cpu_ms_per_mb,
            "step_alone_ms": self.step_alone_ms,
            "chains": [{"bytes": b, "blocks": m} for b, m in self.chains],
            "repeats": self.repeats,
            "passes": self.passes,
            "spread": {k: list(v) for k, v in self.spread.items()},
            "samples": [{"bytes": b, "ms": ms} for b, ms in self.samples],
            "alpha_ms": self.alpha_ms,
        }

    @classmethod
    def from_dict(cls, doc: Any, source: str = "<profile>") -> CpuProbeRecord:
        """The record of a ``meta.cpu_probe`` object; :class:`~usbyte_opt.errors.FormatError`
        names the field of ``source`` that is missing or of the wrong type."""
        if not isinstance(doc, Mapping):
            raise FormatError(source, FIELD, "an object", doc)

        def num(key: str, optional: bool = False) -> Any:
            v = doc.get(key)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise FormatError(source, f"{FIELD}.{key}", "a number", v)
            return float(v)

        def pairs(key: str, a: str, b: str, kinds: tuple[type, type], what: str) -> tuple[Any, ...]:
            xs = doc.get(key, [])
            if not isinstance(xs, list):
                raise FormatError(source, f"{FIELD}.{key}", "an array", xs)
            out = []
            for i, x in enumerate(xs):
                ok = (isinstance(x, Mapping) and all(not isinstance(x.get(k), bool) and
                                                     isinstance(x.get(k), t)
                                                     for k, t in ((a, kinds[0]), (b, kinds[1]))))
                if not ok:
                    raise FormatError(source, f"{FIELD}.{key}[{i}]", what, x)
                out.append((x[a], kinds[1](x[b]) if kinds[1] is not int else x[b]))
            return tuple(out)

        spread = doc.get("spread", {})
        if not (isinstance(spread, Mapping) and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(y, (int, float)) for y in v)
                for v in spread.values())):
            raise FormatError(source, f"{FIELD}.spread", "an object of [low, high] pairs", spread)
        method = doc.get("method", "")
        repeats, passes = doc.get("repeats", 0), doc.get("passes", 0)
        for key, v in (("repeats", repeats), ("passes", passes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise FormatError(source, f"{FIELD}.{key}", "an integer", v)
        return cls(str(method), num("cpu_ms_per_block"), num("cpu_ms_per_mb"),
                   num("step_alone_ms"),
                   pairs("chains", "bytes", "blocks", (int, int),
                         '{"bytes": integer, "blocks": integer}'),
                   repeats, passes, {k: (float(v[0]), float(v[1])) for k, v in spread.items()},
                   pairs("samples", "bytes", "ms", (int, float), '{"bytes": integer, "ms": number}'),
                   num("alpha_ms", optional=True))

    @classmethod
    def of(cls, meta: Any, source: str = "<profile>") -> CpuProbeRecord | None:
        """The record in a profile's ``meta``, or ``None`` when it has none."""
        if not isinstance(meta, Mapping) or meta.get("cpu_probe") is None:
            return None
        return cls.from_dict(meta["cpu_probe"], source)


__all__ = ["CpuProbeRecord"]
