"""Chrome trace-event documents: what Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open.

One writer for the two timelines usbyte-opt draws: the simulator's prediction
(:func:`usbyte_opt.planning.simulate.chrome_trace`, ``usbyte-opt simulate --trace``) and the
runtime's measurement (:meth:`usbyte_opt.runtime.trace.Recorder.chrome`). A document holds
processes (``pid``), each with named tracks (``tid``: the compute thread, the all-reduce
channel), complete events (``"ph": "X"``, a start and a duration) on those tracks, and
``otherData``, free-form facts about the run. Times are given in the caller's unit and
written in microseconds (``unit_us``: microseconds per unit). No torch import.

Example::

    >>> tr = ChromeTrace(unit_us=1000.0, other={"mode": "overlap"})   # times in ms
    >>> tr.process(1, "toy", {1: "compute", 2: "all-reduce"})
    >>> tr.complete(1, 1, "backward", 0.0, 6.0)
    >>> tr.complete(1, 2, "#0 w", 2.0, 2.0, {"bytes": 8})
    >>> doc = tr.to_dict()
    >>> [(e["ph"], e["name"], e.get("ts"), e.get("dur")) for e in doc["traceEvents"]]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('M', 'process_name', None, None), ('M', 'thread_name', None, None),
     ('M', 'thread_name', None, None), ('X', 'backward', 0.0, 6000.0),
     ('X', '#0 w', 2000.0, 2000.0)]
    >>> doc["displayTimeUnit"], doc["otherData"]
    ('ms', {'mode': 'overlap'})
    >>> import json, os, tempfile
    >>> path = tr.write(os.path.join(tempfile.mkdtemp(), "trace.json"))   # atomic
    >>> json.loads(path.read_text()) == doc
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .files import write_json

__all__ = ["ChromeTrace"]


class ChromeTrace:
    """A Chrome trace-event document being built.

    Args:
        unit_us: microseconds per unit of the times given to :meth:`complete` (1000 for
            milliseconds, 1e6 for seconds).
        other: the document's ``otherData`` (more may be added to :attr:`other` later).
    """

    def __init__(self, unit_us: float = 1.0, other: Mapping[str, Any] | None = None):
        self.unit_us = unit_us
        self.events: list[dict[str, Any]] = []
        #: The document's ``otherData``.
        self.other: dict[str, Any] = dict(other or {})

    def us(self, t: float) -> float:
        """``t`` (in the trace's unit) in microseconds."""
        return t * self.unit_us

    def process(self, pid: int, name: str, tracks: Mapping[int, str]) -> None:
        """Name process ``pid`` and its tracks (``tid`` to name), in the order given."""
        self.events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        for tid, track in tracks.items():
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                                "args": {"name": track}})

    def complete(self, pid: int, tid: int, name: str, start: float, duration: float,
                 args: Mapping[str, Any] | None = None) -> None:
        """A slice on track ``tid`` of process ``pid`` from ``start`` for ``duration`` (the
        trace's unit); ``args``: what Perfetto shows when the slice is selected."""
        u = self.unit_us
        ev: dict[str, Any] = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": start * u,
                              "dur": duration * u}
        if args is not None:
            ev["args"] = dict(args)
        self.events.append(ev)

    def to_dict(self) -> dict[str, Any]:
        """The document: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``."""
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms",
                "otherData": dict(self.other)}

    def write(self, path: str | os.PathLike) -> Path:
        """Write the document to ``path`` atomically (:func:`usbyte_opt.formats.write_json`)."""
        return write_json(path, self.to_dict())
