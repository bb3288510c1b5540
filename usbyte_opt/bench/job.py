"""The job of a benchmark run: what every rank does, typed, and the file it travels in.

:meth:`usbyte_opt.bench.BenchConfig.job` makes it from the user's options and
:func:`usbyte_opt.bench.run_bench` writes it to ``job.json`` in the output folder; every rank
(:mod:`usbyte_opt.bench.worker`) reads it back with :meth:`Job.load`, which checks every field,
so a rank never works from a default of its own.

Example::

    >>> job = Job(model="cnn", name="cnn", batch_size=None, strategies=("ddp", "best"),
    ...           iterations=4, rounds=2, warmup=1, out_dir="out", device=None,
    ...           optimizer="sgd", threads=1, profile=None, profile_warmup=3, profile_repeats=10,
    ...           comm_points=10, comm_repeats=5, stable_s=20.0, time_budget_s=0.6,
    ...           trace=True, pg_timeout_s=600.0)
    >>> Job.from_dict(job.to_dict(), "job.json") == job
    True
    >>> Job.from_dict({**job.to_dict(), "iterations": "4"}, "job.json")
    Traceback (most recent call last):
    ...
    usbyte_opt.errors.FormatError: job.json: iterations: expected int, got '4'
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """Everything a rank of ``usbyte-opt bench`` needs to know."""

    model: str
    """The model spec every rank builds (a lab model's factory spec, for a lab model)."""
    name: str
    """The profile's name."""
    batch_size: int | None
    """Per-rank batch size; ``None``: the model's own."""
    strategies: tuple[str, ...]
    """What to train, in order: registered strategies, and ``no-comm`` for the reference."""
    iterations: int
    """Timed iterations per turn."""
    rounds: int
    """Turns each strategy takes."""
    warmup: int
    """Untimed iterations at the start of each turn."""
    out_dir: str
    """Where rank 0 writes ``raw.json``, ``profile.json``, schedules and traces."""
    device: str | None
    """``cpu`` or ``cuda``; ``None``: CUDA when available."""
    optimizer: str
    """The optimizer profiled and trained with."""
    threads: int
    """Torch threads per rank."""
    profile: str | None
    """A profile to use instead of profiling."""
    profile_warmup: int
    profile_repeats: int
    comm_points: int
    comm_repeats: int
    stable_s: float
    """Time cap of the profile's extra sweep and probe rounds."""
    time_budget_s: float
    """Local-search seconds of ``best``."""
    trace: bool
    """Record the runtime strategies' measured timelines."""
    pg_timeout_s: float
    """The process group's timeout."""
    comm_sizes: tuple[int, ...] | None = None
    """The all-reduce sweep's sizes; ``None``: the profiler's own."""
    first_warmup: int = 3
    """Untimed iterations of each strategy's first turn."""
    probe: bool = True
    """With a profile that has no probe, measure all-reduce under compute before training."""
    verify: bool = False
    """Let the runtime verify its plan against the DDP-like fallback (``--verify``); off, every
    strategy is measured as planned."""
    probe_points: int = 5
    """Sizes of that probe."""
    probe_repeats: int = 4
    """Repeats of that probe."""

    def to_dict(self) -> dict[str, Any]:
        """The job as the JSON object of its file."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, doc: Any, source: str) -> Job:
        """The job of a JSON object; :class:`~usbyte_opt.errors.FormatError` names the field of
        ``source`` that is missing, unknown or of the wrong type."""
        if not isinstance(doc, Mapping):
            raise FormatError(source, "", "a JSON object", type(doc).__name__)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in doc:
            if key not in fields:
                raise FormatError(source, str(key), "a field of a bench job ("
                                  + ", ".join(fields) + ")")
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in doc:
                if f.default is dataclasses.MISSING:
                    raise FormatError(source, name, f"a value ({f.type})")
                continue
            value = doc[name]
            if not _fits(value, str(f.type)):
                raise FormatError(source, name, str(f.type), value)
            if isinstance(value, list):
                value = tuple(value)
            values[name] = float(value) if str(f.type) == "float" else value
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Job:
        """The job in the file at ``path``."""
        from ..formats import read_json

        return cls.from_dict(read_json(path), str(path))


_KINDS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float),
                                       "bool": (bool,)}


def _fits(value: Any, annotation: str) -> bool:
    """Whether ``value`` (read from JSON) fits a field annotated ``annotation``: ``str``,
    ``int``, ``float``, ``bool``, ``tuple[X, ...]`` (a list), each optionally ``| None``."""
    for option in (t.strip() for t in annotation.split("|")):
        if option == "None":
            if value is None:
                return True
        elif option.startswith("tuple["):
            inner = option[len("tuple["):].split(",")[0]
            if isinstance(value, (list, tuple)) and all(_fits(v, inner) for v in value):
                return True
        elif isinstance(value, _KINDS[option]) and (option == "bool" or not isinstance(value, bool)):
            return True
    return False


__all__ = ["Job"]
