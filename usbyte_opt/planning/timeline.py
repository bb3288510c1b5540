"""The timeline of one simulated iteration: its types, what its communication costs the
training thread (the compute-cost option's charge), and its Chrome trace.

The lowest layer of the iteration model: :mod:`usbyte_opt.planning.simulate` (overlap and
fence mode) and :mod:`usbyte_opt.planning.sharded` (sharded mode) walk an iteration step by
step and return a :class:`Timeline`; both charge the compute-cost option by one rule,
:func:`with_compute_charge`. No torch import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..formats import Mode
from ..formats.chrome import ChromeTrace
from .problem import Problem


@dataclass(frozen=True, slots=True)
class GatherTiming:
    """One all-gather of sharded mode: the blocks it gathers and when it ran."""

    index: int
    blocks: tuple[int, ...]
    nbytes: int
    tensors: tuple[str, ...]
    start_ms: float
    finish_ms: float


@dataclass(frozen=True, slots=True)
class BlockTiming:
    """One block's collective (an all-reduce; a reduce-scatter in sharded mode): what it
    carries, when its gradients were ready, and when it ran on the channel."""

    index: int
    buffer: int
    start: int
    end: int
    nbytes: int
    tensors: tuple[str, ...]
    ready_ms: float
    start_ms: float
    finish_ms: float


@dataclass(frozen=True, slots=True)
class ForwardGate:
    """When forward reached a tensor, and how long it waited for it (overlap mode)."""

    name: str
    need_ms: float
    avail_ms: float
    reach_ms: float
    wait_ms: float
    update_ms: float = 0.0
    """Optimizer time spent at this gate, after the wait (update rule ``GATE``; the forward
    continues at ``reach_ms``)."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """One simulated iteration: backward from 0, the channel's blocks, the forward's gates,
    the iteration time (:mod:`usbyte_opt.planning.simulate` builds it)."""

    mode: Mode
    iteration_ms: float
    backward_ms: float
    forward_ms: float
    forward_start_ms: float
    forward_end_ms: float
    comm_busy_ms: float
    blocks: tuple[BlockTiming, ...]
    forward: tuple[ForwardGate, ...]
    update_ms: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    gathers: tuple[GatherTiming, ...] = ()
    """Sharded mode: the all-gathers, after the reduce-scatters of ``blocks`` on the same
    channel."""

    @property
    def compute_ms(self) -> float:
        return self.backward_ms + self.forward_ms

    @property
    def exposed_ms(self) -> float:
        """Iteration time not covered by compute: ``T - (B + F)``."""
        return self.iteration_ms - self.compute_ms


def compute_windows(timeline: Timeline) -> list[tuple[float, float]]:
    """The intervals in which the training thread computes, in time order: backward, then the
    forward's segments between its waits (overlap mode), or the step and the forward after
    the fence."""
    out = [(0.0, timeline.backward_ms)]
    if timeline.mode == Mode.SHARDED and timeline.update_ms > 0:  # the shard step
        out.append((timeline.forward_start_ms - timeline.update_ms, timeline.forward_start_ms))
    if timeline.mode == Mode.FENCE:
        out.append((timeline.forward_start_ms - timeline.update_ms, timeline.forward_end_ms))
        return out
    t = timeline.forward_start_ms
    for g in timeline.forward:
        arrive = g.reach_ms - g.update_ms - g.wait_ms
        if arrive > t:
            out.append((t, arrive))
        if g.update_ms > 0:
            out.append((g.reach_ms - g.update_ms, g.reach_ms))
        t = g.reach_ms
    if timeline.forward_end_ms > t:
        out.append((t, timeline.forward_end_ms))
    return out


def compute_charge(problem: Problem, timeline: Timeline) -> tuple[float, float]:
    """``(backward ms, forward ms)`` that the collectives of ``timeline`` (simulated without
    the charge: its blocks, then in sharded mode its all-gathers) cost the training thread:
    each one's :meth:`Problem.block_cpu_ms` times the share of its wire time that overlaps a
    compute window (:func:`compute_windows`)."""
    wins = compute_windows(timeline)
    xb = xf = 0.0
    w = 0
    wire: tuple[BlockTiming | GatherTiming, ...] = (*timeline.blocks, *timeline.gathers)
    for b in wire:
        dur = b.finish_ms - b.start_ms
        if dur <= 0:
            continue
        rate = problem.block_cpu_ms(b.nbytes) / dur
        while w < len(wins) and wins[w][1] <= b.start_ms:
            w += 1
        j = w
        while j < len(wins) and wins[j][0] < b.finish_ms:
            lo, hi = max(wins[j][0], b.start_ms), min(wins[j][1], b.finish_ms)
            if hi > lo:
                if j == 0:
                    xb += rate * (hi - lo)
                else:
                    xf += rate * (hi - lo)
            j += 1
    return xb, (0.0 if timeline.mode == Mode.FENCE else xf)


def with_compute_charge(problem: Problem, uncharged: Timeline,
                        walk: Callable[[Problem], Timeline]) -> Timeline:
    """The compute-cost option's rule, in every mode: what the collectives of ``uncharged``
    (the timeline without the charge) cost backward and forward (:func:`compute_charge`)
    lengthens each phase (:meth:`Problem.stretched`), and ``walk`` simulates the iteration
    again on the stretched problem; the result's ``meta["cpu_charge_ms"]`` holds the two
    charges."""
    xb, xf = compute_charge(problem, uncharged)
    sb = 1.0 + xb / problem.B if problem.B > 0 else 1.0
    sf = 1.0 + xf / problem.F if problem.F > 0 else 1.0
    tl = walk(problem.stretched(sb, sf))
    return dataclasses.replace(tl, meta={**tl.meta, "cpu_charge_ms": {"backward": xb,
                                                                       "forward": xf}})


def chrome_trace(timeline: Timeline, label: str = "usbyte-opt") -> dict[str, Any]:
    """A Chrome trace-event document (``{"traceEvents": [...]}``) of a timeline.

    Track 1 is compute (backward, optimizer fence or shard step, forward segments and the
    waits that gate them), track 2 the communication channel (one slice per block; in sharded
    mode the reduce-scatters, then the all-gathers). Times in microseconds
    (:class:`usbyte_opt.formats.chrome.ChromeTrace`).
    """
    tr = ChromeTrace(unit_us=1000.0, other={"mode": timeline.mode,
                                            "iteration_ms": timeline.iteration_ms})
    sharded = timeline.mode == Mode.SHARDED
    tr.process(1, label, {1: "compute", 2: "reduce-scatter, all-gather" if sharded else "all-reduce"})
    tr.complete(1, 1, "backward", 0.0, timeline.backward_ms)
    if timeline.mode in (Mode.FENCE, Mode.SHARDED) and timeline.update_ms > 0:
        tr.complete(1, 1, "optimizer step", timeline.forward_start_ms - timeline.update_ms,
                    timeline.update_ms)
    prev_t = timeline.forward_start_ms
    for g in timeline.forward:
        seg_end = g.reach_ms - g.wait_ms
        if seg_end > prev_t + 1e-9:
            tr.complete(1, 1, "forward", prev_t, seg_end - prev_t)
        if g.wait_ms > 1e-9:
            tr.complete(1, 1, f"wait {g.name}", g.reach_ms - g.wait_ms, g.wait_ms,
                        {"tensor": g.name, "avail_ms": g.avail_ms})
        prev_t = g.reach_ms
    if timeline.forward_end_ms > prev_t:
        tr.complete(1, 1, "forward", prev_t, timeline.forward_end_ms - prev_t)
    for b in timeline.blocks:
        shown = ", ".join(b.tensors[:3]) + (f" +{len(b.tensors) - 3}" if len(b.tensors) > 3 else "")
        tr.complete(1, 2, f"{'reduce-scatter ' if sharded else ''}#{b.index} {shown}",
                    b.start_ms, b.finish_ms - b.start_ms,
                    {"buffer": b.buffer, "elements": [b.start, b.end], "bytes": b.nbytes,
                     "ready_ms": b.ready_ms, "tensors": list(b.tensors)})
    for ga in timeline.gathers:
        shown = ", ".join(ga.tensors[:3]) + (f" +{len(ga.tensors) - 3}" if len(ga.tensors) > 3 else "")
        tr.complete(1, 2, f"all-gather #{ga.index} {shown}", ga.start_ms, ga.finish_ms - ga.start_ms,
                    {"blocks": list(ga.blocks), "bytes": ga.nbytes, "tensors": list(ga.tensors)})
    return tr.to_dict()
