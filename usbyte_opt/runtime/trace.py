"""The measured timeline of the runtime: ``DistributedOptimizer(..., trace=path)`` (or
``USBYTE_TRACE=path`` in the environment, for a script that does not pass it) records a
Chrome trace.

With a trace file given when a :class:`~usbyte_opt.runtime.DistributedOptimizer` is created,
a :class:`Recorder` notes, on every rank, with ``time.perf_counter``:

* each forward of the model (a forward pre-hook that runs before the runtime's own, and a
  forward hook), and each ``step()``: the compute track shows ``forward`` and ``backward``
  (from the end of the model's forward to ``step()``, so the loss is in it);
* each block's **issue** (when the runtime hands it to ``dist.all_reduce``) and **finish**
  (a done-callback on the work's future, so the real completion time, not the time the
  runtime happened to wait for it);
* in sharded mode, each **all-gather** of the parameters (one per group of the schedule's
  ``gather_groups()``), issue and finish as for a block, on the same channel track;
* each **forward gate**: a module's pre-hook that waited for the blocks of its tensors
  (``wait``), then applied their update (``update``), nested in the forward slice (on the
  host path; on CUDA the updates run on their own stream and gates only wait for events).

On CUDA every time is a CUDA event, not a host clock: the host runs ahead of the GPU, a
collective's future completes when it is enqueued on NCCL, and ``torch.cuda.synchronize()``
would wait for NCCL and so change what is measured. Events are recorded on the current stream
(forward, ``step()``, issue) or, for a block's finish, on a side stream that waits for the
collective; they are turned into times when the trace is written, against one reference
event whose host time is known. A collective that is not NCCL's (gloo carrying CUDA tensors)
gets its finish from its future's done-callback on the host clock instead: its ``wait()``
would block the host inside the gradient hook, and so change what is measured.

On the all-reduce track a block is drawn from ``max(issue, finish of the previous block)``
to its finish, the single channel of docs/design.md §2.4; its arguments keep the issue time and
how long it queued. Timestamps are ``perf_counter`` microseconds, the same clock in every
process of the machine, so the ranks of one run line up (one ``pid`` per rank).

The file is written (atomically) at :func:`flush_all`, at ``close()`` of the recorder and
at interpreter exit. Rank 0 writes ``path``; rank r > 0 writes ``<stem>.rank<r><suffix>``,
unless ``path`` contains ``{rank}``, which is replaced. Unset, nothing is recorded and the
runtime pays one ``is None`` test per event.

Example::

    >>> rec = Recorder("/tmp/t.json", rank=0, names=["w"], block_bytes=[4], block_tensors=[[0]])
    >>> rec.forward_begin(None, ()); rec.forward_end(None, (), None); rec.step()
    >>> [e["name"] for e in rec.chrome()["traceEvents"] if e["ph"] == "X"]
    ['forward', 'backward']
    >>> path_for_rank("out/trace.json", 1), path_for_rank("t-{rank}.json", 3)
    ('out/trace.rank1.json', 't-3.json')
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..formats.chrome import ChromeTrace

if TYPE_CHECKING:
    from ..formats import Schedule
    from .buffers import FlatGrads
    from .comm import Channel

#: Records kept per recorder at most (a long training run keeps its first ones).
MAX_RECORDS = 200_000

_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
_atexit_done = False
_lock = threading.Lock()


def path_for_rank(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``USBYTE_TRACE=path``."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}"))


class Recorder:
    """Collects the runtime's events of one rank and writes them as a Chrome trace.

    Args:
        path: the file to write.
        rank: this rank (the trace's ``pid`` is ``rank + 1``).
        names: tensor names, by runtime tensor index.
        block_bytes: bytes of each block, in issue order.
        block_tensors: tensor indices each block touches.
        label: the process name shown in Perfetto.
        gathers: sharded mode: the blocks of each all-gather, in issue order.
    """

    def __init__(self, path: str, rank: int, names: Sequence[str], block_bytes: Sequence[int],
                 block_tensors: Sequence[Sequence[int]], label: str | None = None,
                 device: Any = None, host_finish: bool = False,
                 gathers: Sequence[Sequence[int]] = ()):
        self.path = path
        self.rank = rank
        self.names = list(names)
        self.block_bytes = list(block_bytes)
        self.block_tensors = [list(ts) for ts in block_tensors]
        self.gathers = [tuple(g) for g in gathers]
        self.label = label or f"rank {rank} (measured)"
        self.records: list[tuple] = []
        self.handles: list[Any] = []
        self.written = False
        self.clock = _CudaClock(device) if getattr(device, "type", None) == "cuda" else None
        #: Finish times from the work's future on the host (collectives that are not NCCL's).
        self.host_finish = host_finish
        #: Record nothing while set (the bench times iterations untraced, as DDP's).
        self.paused = False

    # -- recording (called by the runtime) ---------------------------------------------------

    def now(self) -> Any:
        """A time stamp: ``perf_counter`` seconds, or a CUDA event on the current stream."""
        return self.clock.mark() if self.clock is not None else time.perf_counter()

    def _add(self, rec: tuple) -> None:
        if len(self.records) < MAX_RECORDS:
            self.records.append(rec)  # list.append is atomic: safe from the comm threads

    def forward_begin(self, module: Any, args: Any) -> None:
        if not self.paused:
            self._add(("F0", self.now()))

    def forward_end(self, module: Any, args: Any, output: Any) -> None:
        if not self.paused:
            self._add(("F1", self.now()))

    def step(self) -> None:
        if not self.paused:
            self._add(("S", self.now()))

    def issue(self, k: int, work: Any) -> None:
        """Block ``k`` was handed to the collective ``work``."""
        self._issued("I", "D", k, work)

    def gather(self, i: int, work: Any) -> None:
        """Sharded mode: all-gather ``i`` (of ``gathers``) was handed to ``work``."""
        self._issued("A", "E", i, work)

    def _issued(self, kind: str, done: str, k: int, work: Any) -> None:
        if self.paused:
            return
        self._add((kind, k, self.now()))
        if self.clock is not None and not self.host_finish:
            self._add((done, k, self.clock.done(work)))
            return
        try:
            work.get_future().add_done_callback(
                lambda _f, k=k: self._add((done, k, time.perf_counter())))
        except Exception:  # noqa: BLE001 - a backend without futures: issue times only
            pass

    def gate(self, need: Sequence[int], t0: float, t1: float) -> None:
        """Forward waited for the blocks of ``need`` from ``t0`` to ``t1``, then updated until now."""
        if self.paused:
            return
        self._add(("G", tuple(need), t0, t1, time.perf_counter()))

    def install(self, model: Any) -> None:
        """Hooks of its own on ``model``: forward start (before the runtime's pre-hook) and end."""
        self.handles.append(model.register_forward_pre_hook(self.forward_begin, prepend=True))
        self.handles.append(model.register_forward_hook(self.forward_end))

    # -- output ------------------------------------------------------------------------------

    def chrome(self) -> dict[str, Any]:
        """The Chrome trace-event document of what was recorded so far."""
        return self._document().to_dict()

    def _document(self) -> ChromeTrace:
        if self.clock is not None:
            self.records = self.clock.resolve(self.records)
        pid = self.rank + 1
        tr = ChromeTrace(unit_us=1e6)
        us = tr.us
        tr.process(pid, self.label, {1: "compute", 2: "all-reduce"})
        recs = sorted(self.records, key=lambda r: r[-1] if r[0] != "G" else r[2])
        self._compute_events(tr, pid, recs)
        self._channel_events(tr, pid)
        tr.other.update({"source": "usbyte-opt runtime (USBYTE_TRACE)", "rank": self.rank,
                         "clock": ("CUDA events against a reference event, microseconds"
                                   if self.clock is not None else "time.perf_counter, microseconds"),
                         "forward_begin_us": [us(r[1]) for r in recs if r[0] == "F0"],
                         "forward_end_us": [us(r[1]) for r in recs if r[0] == "F1"],
                         "step_us": [us(r[1]) for r in recs if r[0] == "S"],
                         "blocks": len(self.block_bytes)})
        return tr

    def _compute_events(self, tr: ChromeTrace, pid: int, recs: list[tuple[Any, ...]]) -> None:
        """The compute thread (``recs`` in time order): forward, backward, and each update's
        wait and run."""
        fwd_open: float | None = None
        bwd_open: float | None = None
        for r in recs:
            kind = r[0]
            if kind == "F0":
                fwd_open = r[1]
            elif kind == "F1" and fwd_open is not None:
                tr.complete(pid, 1, "forward", fwd_open, r[1] - fwd_open)
                fwd_open, bwd_open = None, r[1]
            elif kind == "S" and bwd_open is not None:
                tr.complete(pid, 1, "backward", bwd_open, r[1] - bwd_open)
                bwd_open = None
            elif kind == "G":
                need, t0, t1, t2 = r[1], r[2], r[3], r[4]
                label = ", ".join([self.names[t] for t in need[:3]]
                                  + ([f"+{len(need) - 3}"] if len(need) > 3 else []))
                if t1 - t0 > 0:
                    tr.complete(pid, 1, f"wait {label}", t0, t1 - t0,
                                {"tensors": [self.names[t] for t in need]})
                tr.complete(pid, 1, "update", t1, max(t2 - t1, 0.0))

    def _channel_events(self, tr: ChromeTrace, pid: int) -> None:
        """The channel: blocks (and all-gathers) in issue order; each starts when issued and
        the previous is done."""
        us = tr.us
        issued = [(r[2], r[0], r[1]) for r in self.records if r[0] in ("I", "A")]
        done: dict[tuple[str, int], list[float]] = {}
        for r in self.records:
            if r[0] in ("D", "E"):
                done.setdefault(("I" if r[0] == "D" else "A", r[1]), []).append(r[2])
        seen: dict[tuple[str, int], int] = {}
        prev_done = 0.0
        for t_issue, kind, k in sorted(issued):
            i = seen.get((kind, k), 0)
            seen[(kind, k)] = i + 1
            ds = done.get((kind, k), [])
            if i >= len(ds):
                continue  # never completed (or no futures): nothing to draw
            t_done = ds[i]
            start = max(t_issue, prev_done)
            prev_done = max(prev_done, t_done)
            name, tensors, nbytes, extra = self._collective(kind, k)
            tr.complete(pid, 2, name, start, max(t_done - start, 0.0),
                        {"bytes": nbytes, "issued_us": us(t_issue), "done_us": us(t_done),
                         "queued_ms": (start - t_issue) * 1e3,
                         "tensors": [self.names[t] for t in tensors], **extra})

    def _collective(self, kind: str, k: int) -> tuple[str, list[int], int | None, dict[str, Any]]:
        """An all-gather (``kind`` ``"A"``) or block's event: its name, tensors, bytes and
        extra arguments."""
        if kind == "A":
            blocks = list(self.gathers[k]) if k < len(self.gathers) else []
            tensors = sorted({t for b in blocks if b < len(self.block_tensors)
                              for t in self.block_tensors[b]})
            nbytes = sum(self.block_bytes[b] for b in blocks if b < len(self.block_bytes))
            return (f"all-gather {k} (blocks {', '.join(map(str, blocks))})", tensors, nbytes,
                    {"gather": k, "blocks": blocks})
        tensors = list(self.block_tensors[k]) if k < len(self.block_tensors) else []
        shown = ", ".join(self.names[t] for t in tensors[:3]) \
            + (f" +{len(tensors) - 3}" if len(tensors) > 3 else "")
        return (f"#{k} {shown}", tensors, self.block_bytes[k] if k < len(self.block_bytes)
                else None, {})

    def save(self) -> Path | None:
        """Write the trace (atomically); ``None`` when nothing was recorded."""
        if not self.records:
            return None
        self.written = True
        return self._document().write(self.path)

    def close(self) -> Path | None:
        """Remove the hooks and write the trace."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        return self.save()


def attach(path: str, schedule: Schedule, grads: FlatGrads, chan: Channel) -> Recorder:
    """A recorder of the runtime running ``schedule`` on the flat buffers ``grads`` over the
    channel ``chan``, writing ``path`` (per rank, :func:`path_for_rank`); registered for
    :func:`flush_all` and exit. Its model hooks are :meth:`Recorder.install`'s."""
    import torch.distributed as dist

    global _atexit_done
    rank = dist.get_rank(chan.group) if dist.is_initialized() else 0
    sizes = [(b.end - b.start) * v.element_size() for b, v in zip(schedule.blocks, grads.block_views)]
    from ..collectives.issuers import backend_for

    device = chan.device
    host_finish = device.type == "cuda" and backend_for(chan.group, device) != "nccl"
    from ..formats import Mode

    rec = Recorder(path_for_rank(path, rank), rank, list(grads.names), sizes,
                   [list(ts) for ts in grads.block_tensors],
                   f"rank {rank} (measured, {schedule.strategy})", device=device,
                   host_finish=host_finish,
                   gathers=schedule.gather_groups() if schedule.mode == Mode.SHARDED else ())
    with _lock:
        _recorders.add(rec)
        if not _atexit_done:
            atexit.register(flush_all)
            _atexit_done = True
    return rec


def flush_all() -> list[Path]:
    """Write every live recorder's trace; returns the files written."""
    out = []
    for rec in list(_recorders):
        p = rec.save()
        if p is not None:
            out.append(p)
    return out


class _CudaClock:
    """Time stamps as CUDA events (see the module's notes), resolved when the trace is made."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(device))
        self.ref_host = time.perf_counter()

    def mark(self) -> Any:
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record(self.torch.cuda.current_stream(self.device))
        return ev

    def done(self, work: Any) -> Any:
        """An event that completes when ``work`` does (recorded on a side stream that waits
        for the collective)."""
        ev = self.torch.cuda.Event(enable_timing=True)
        with self.torch.cuda.stream(self.side):
            work.wait()
            ev.record(self.side)
        return ev

    def resolve(self, records: list[tuple]) -> list[tuple]:
        """Replace every event in ``records`` by its time (seconds on the host clock)."""
        self.torch.cuda.synchronize(self.device)
        ref, base = self.ref, self.ref_host
        out = []
        for rec in records:
            out.append(tuple(base + ref.elapsed_time(v) / 1e3
                             if isinstance(v, self.torch.cuda.Event) else v for v in rec))
        return out


__all__ = ["MAX_RECORDS", "Recorder", "attach", "flush_all", "path_for_rank"]
