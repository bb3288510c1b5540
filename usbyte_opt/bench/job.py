"""The job of a benchmark run: what every rank does, typed, and the file it travels in.

:meth:`usbyte_opt.bench.BenchConfig.job` makes it from the user's options and
:func:`usbyte_opt.bench.run_bench` writes it to ``job.json`` in the output folder; every rank
(:mod:`usbyte_opt.bench.worker`) reads it back with :meth:`Job.load`, which validates every
field (pydantic, strict: no coercion, no unknown field), so a rank never works from a default
of its own. How the model is profiled is the profiler's own
:class:`~usbyte_opt.profiler.options.ProfileOptions`, embedded as ``profiling``.

Example::

    >>> job = Job(model="cnn", name="cnn", batch_size=None, strategies=("ddp", "best"),
    ...           iterations=4, rounds=2, warmup=1, out_dir="out", device=None, threads=1,
    ...           profile=None, profiling=ProfileOptions(comm_points=10), time_budget_s=0.6,
    ...           trace=True, pg_timeout_s=600.0)
    >>> Job.from_dict(job.to_dict(), "job.json") == job
    True
    >>> Job.from_dict({**job.to_dict(), "iterations": "4"}, "job.json")
    Traceback (most recent call last):
    ...
    usbyte_opt.errors.FormatError: job.json: iterations: expected int, got '4'
    >>> Job.from_dict({**job.to_dict(), "profiling": {"stable_s": "x"}}, "job.json")
    Traceback (most recent call last):
    ...
    usbyte_opt.errors.FormatError: job.json: profiling.stable_s: expected float, got 'x'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..profiler.options import STRICT, ProfileOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """Everything a rank of ``usbyte-opt bench`` needs to know."""

    #: How pydantic validates a job file (a plain dict: pydantic is imported only to validate).
    __pydantic_config__ = STRICT

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
    threads: int
    """Torch threads per rank."""
    profile: str | None
    """A profile to use instead of profiling."""
    profiling: ProfileOptions
    """How to profile (its ``optimizer`` is also the one trained with); with a profile that
    has no probe, its probe settings measure all-reduce under compute before training (unless
    ``cpu_probe`` is off)."""
    time_budget_s: float
    """Local-search seconds of ``best``."""
    trace: bool
    """Record the runtime strategies' measured timelines."""
    pg_timeout_s: float
    """The process group's timeout."""
    first_warmup: int = 3
    """Untimed iterations of each strategy's first turn."""
    verify: bool = False
    """Let the runtime verify its plan against DDP's buckets (``--verify``); off, every
    strategy is measured as planned."""
    max_rounds: int = 0
    """Rounds to go up to, beyond ``rounds``, while a strategy's time against DDP's is not
    distinguishable (:mod:`usbyte_opt.verdict`); at most ``rounds``: exactly ``rounds``."""
    max_train_s: float = 600.0
    """No round is added once the timed rounds have taken this many seconds."""
    link: str | None = None
    """In the lab: the interface of each node's shaped link (``usb0``), whose sent bytes the
    first rank of every node counts during each strategy's turns; ``None``: not counted."""
    emulate: str | None = None
    """``NxRATE[@ALPHA]`` (:func:`~usbyte_opt.collectives.emulate.parse_emulate`): the one rank's
    collectives occupy this emulated link, and the profile's communication is the link's line
    (:func:`usbyte_opt.bench.emulated_profile`); ``None``: the real network."""

    def to_dict(self) -> dict[str, Any]:
        """The job as the JSON object of its file."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, doc: Any, source: str) -> Job:
        """The job of a JSON object; :class:`~usbyte_opt.errors.FormatError` names the field of
        ``source`` that is missing, unknown or of the wrong type."""
        if not isinstance(doc, Mapping):
            raise FormatError(source, "", "a JSON object", type(doc).__name__)
        from pydantic import ValidationError

        try:
            # JSON mode: an array is a tuple, an integer a float; nothing else is converted.
            return _adapter().validate_json(json.dumps(doc))
        except ValidationError as e:
            raise _format_error(e.errors()[0], source) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Job:
        """The job in the file at ``path``."""
        from ..formats import read_json

        return cls.from_dict(read_json(path), str(path))


@functools.cache
def _adapter() -> Any:
    """The pydantic validator of :class:`Job` (built once, on first use: pydantic is not
    imported with this module)."""
    from pydantic import TypeAdapter

    return TypeAdapter(Job)


def _field_type(keys: tuple[Any, ...]) -> str:
    """The annotation of the field at ``keys`` (``("profiling", "stable_s")``), as written."""
    kind: Any = Job
    text = ""
    for key in keys:
        fields = {f.name: f for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else {}
        if key not in fields:
            return ""
        text = str(fields[key].type)
        kind = ProfileOptions if text == "ProfileOptions" else None
    return text


def _format_error(err: Mapping[str, Any], source: str) -> FormatError:
    """The one line of pydantic's first error: the field, what it expects, what it got."""
    keys = tuple(err["loc"])
    path = ".".join(str(k) if not isinstance(k, int) else f"[{k}]" for k in keys).replace(".[", "[")
    path = path or "(the whole job)"
    named = tuple(k for k in keys if isinstance(k, str))
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        parent = ProfileOptions if named[:1] == ("profiling",) and len(named) > 1 else Job
        return FormatError(source, path, "a field of " + ("the profiling options" if parent is
                                                          ProfileOptions else "a bench job")
                           + " (" + ", ".join(f.name for f in dataclasses.fields(parent)) + ")")
    annotation = _field_type(named) or "a value"
    if err["type"] == "missing":
        return FormatError(source, path, f"a value ({annotation})")
    return FormatError(source, path, annotation, err.get("input"))


__all__ = ["Job"]
