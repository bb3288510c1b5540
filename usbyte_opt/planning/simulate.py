"""The iteration model, walked step by step: the reference definition (docs/design.md §2).

What one iteration of a schedule takes, block by block and gate by gate, as a
:class:`~usbyte_opt.planning.timeline.Timeline` (for traces, ``usbyte-opt simulate`` and the
bench). This walk is the truth; the planner scores plans with
:mod:`usbyte_opt.planning.fastsim`, its closed form, which gives the same numbers (tests check
them against this walk on random schedules, in every mode and option). Sharded mode's walk is
:func:`usbyte_opt.planning.sharded.simulate_sharded`, which :func:`simulate` dispatches to.

Time origin is the start of backward; milliseconds and bytes.

* Channel: one collective at a time, in issue order. ``ready(k)`` is the largest ``ready_p``
  of the tensors block k touches; ``start(k) = max(ready(k), finish(k-1))``;
  ``finish(k) = start(k) + c(bytes_k)``.
* Overlap mode: ``avail_p`` = finish of the last block covering p + ``update_p``. Walking the
  tensors in ``need`` order, forward reaches the first at ``max(B + need_first, avail_first)``
  and each next at ``t_p = max(t_prev + (need_p - need_prev), avail_p)``; forward ends at
  ``t_last + F - need_last``. ``T = max(forward end, finish(last block))``.
  With the problem's update rule ``GATE`` (:class:`~usbyte_opt.planning.problem.UpdateRule`,
  the runtime's), the updates run at the gates instead: forward reaches p at
  ``t_prev + (need_p - need_prev)``; if p's update is pending it waits for p's last block, then
  applies the update of p and of every pending tensor whose blocks have finished by then.
* Fence mode (DDP, Horovod, WFBP, MG-WFBP): ``T = max(B, finish(last)) + sum(update) + F``.
* Compute cost of communication (an option, on when the profile's ``comm`` carries
  ``cpu_ms_per_block`` / ``cpu_ms_per_mb``; see docs/planner.md), one rule in both modes: a
  block costs the training thread :meth:`Problem.block_cpu_ms`, spread over its time on the
  wire, and the thread pays the part that overlaps its own compute (backward, and in overlap
  mode the forward's compute between its waits); waiting costs nothing. The timeline without
  the charge gives what each phase paid; backward's and forward's times are lengthened by it
  (:meth:`Problem.stretched`) and the iteration is simulated again. The charge is read off
  the timeline of the default update rule under both rules. The walk reads the overlaps off
  the timeline itself, interval by interval
  (:func:`~usbyte_opt.planning.timeline.with_compute_charge`, the same rule as sharded mode's);
  :mod:`usbyte_opt.planning.fastsim` computes the same in closed form (tests check they agree).
* Host cost (the profile's ``host`` section; docs/planner.md): the runner of the blocks (the
  runtime, or torch DDP for the ``ddp`` and ``ddp-tuned`` strategies) pays per tensor and per
  block on the host. Walking the blocks in issue order, block k is issued at ``P_k``, the
  largest ready time of it and the blocks before it, after the hooks of the tensors ready by
  then and the issues of blocks ``0..k``: it starts no earlier than ``P_k`` plus that host
  time (with the host running ahead of the device: the larger of the two), and backward ends
  at ``B`` plus every tensor's and every block's host time (or the larger). The compute-cost
  option stretches the compute, not the host's time.

Deterministic, no torch import. :func:`~usbyte_opt.planning.timeline.chrome_trace` (importable
from here too, with the timeline's types) turns a :class:`Timeline` into a trace that Perfetto
(ui.perfetto.dev) or ``chrome://tracing`` opens.

Example (two tensors, one block each; alpha 1 ms, 1 GB/s)::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> prof = Profile("toy", forward_ms=4.0, backward_ms=6.0,
    ...     tensors=(TensorSpec("out", (250_000,), "float32", ready_ms=2.0, need_ms=3.0),
    ...              TensorSpec("inp", (250_000,), "float32", ready_ms=6.0, need_ms=0.0)),
    ...     comm=CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1.0))
    >>> from usbyte_opt.planning.problem import Problem
    >>> pb = Problem.from_profile(prof); lay = pb.layout()
    >>> blocks = [lay.whole(0), lay.whole(1)]
    >>> tl = simulate_blocks(pb, lay, blocks)
    >>> [(b.start_ms, b.finish_ms) for b in tl.blocks]   # each costs 1 + 1e6 / 1e6 = 2 ms
    [(2.0, 4.0), (6.0, 8.0)]
    >>> tl.iteration_ms       # forward waits for "inp" until 8, then runs 4 ms
    12.0
    >>> simulate_blocks(pb, lay, blocks, mode="fence").iteration_ms   # max(6, 8) + 0 + 4
    12.0
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from ..errors import MismatchError
from ..formats import Block, Mode, Profile, Schedule, check_against
from .cost import HierCost
from .problem import Layout, Problem, Runner, UpdateRule, runner_of
from .sharded import simulate_sharded
from .timeline import (
    BlockTiming,
    ForwardGate,
    GatherTiming,
    Timeline,
    chrome_trace,
    compute_charge,
    compute_windows,
    with_compute_charge,
)

#: The modes the planner models (sharded mode's model is :mod:`usbyte_opt.planning.sharded`).
MODES = (Mode.OVERLAP, Mode.FENCE, Mode.SHARDED)


def simulate_blocks(problem: Problem, layout: Layout, blocks: Sequence[Block],
                    mode: Mode = Mode.OVERLAP, runner: Runner | str = Runner.RUNTIME) -> Timeline:
    """Simulate ``blocks`` (issue order) over ``layout``, run by ``runner`` (what host cost it
    pays); blocks must cover every buffer once.

    With the compute-cost option the timeline is that of the charged iteration, and its
    ``meta["cpu_charge_ms"]`` holds what backward and forward paid; with host cost,
    ``meta["host_ms"]`` how much later backward ended for it."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if mode == Mode.SHARDED:
        return simulate_sharded(problem, layout, blocks)
    gated = problem.update_rule == UpdateRule.GATE and mode == Mode.OVERLAP
    tl = _walk(problem, layout, blocks, mode, gated and not problem.charges_cpu, runner)
    if not problem.charges_cpu:
        return tl
    return with_compute_charge(problem, tl,
                               lambda pb: _walk(pb, layout, blocks, mode, gated, runner))


def _walk(problem: Problem, layout: Layout, blocks: Sequence[Block], mode: Mode,
          gated: bool = False, runner: Runner | str = Runner.RUNTIME) -> Timeline:
    """The step-by-step timeline of the module docstring, without the compute-cost option;
    ``gated``: overlap mode with the updates at the gates; ``runner``: whose host cost."""
    host = problem.host_line(runner)
    timings, last, busy = _channel(problem, layout, blocks, runner)
    prev = timings[-1].finish_ms if timings else 0.0
    F = problem.F
    B = problem.B
    if host is not None:
        spent = problem.n * host.tensor_ms + len(blocks) * host.block_ms
        B = max(B, spent) if problem.host_hidden else B + spent
    gates: list[ForwardGate] = []
    total_upd = 0.0
    if gated:
        fwd_start, fwd_end = B, _gated_forward(problem, last, gates, B)
    elif mode == Mode.OVERLAP:
        fwd_start, fwd_end = B, _overlap_forward(problem, last, gates, B)
    else:
        total_upd = sum(problem.update)
        fwd_start = max(B, prev) + total_upd
        fwd_end = fwd_start + F
        for i in problem.need_order():
            gates.append(ForwardGate(problem.names[i], problem.need[i],
                                     last[i] + problem.update[i], fwd_start + problem.need[i], 0.0))
    T = max(fwd_end, prev)
    meta: dict[str, Any] = {"host_ms": B - problem.B} if host is not None else {}
    return Timeline(mode, T, B, F, fwd_start, fwd_end, busy, tuple(timings), tuple(gates),
                    total_upd, meta)


def _channel(problem: Problem, layout: Layout, blocks: Sequence[Block],
             runner: Runner | str) -> tuple[list[BlockTiming], list[float], float]:
    """The channel's walk over ``blocks`` in issue order, each released once ``runner`` has
    paid its host cost: ``(timings, last finish of each tensor, busy ms)``; a tensor no block
    covers is a :class:`~usbyte_opt.errors.MismatchError`."""
    cost, ready, names = problem.cost, problem.ready, problem.names
    host = problem.host_line(runner)
    hidden = problem.host_hidden
    by_ready = sorted(ready)
    last = [-1.0] * problem.n
    timings = []
    prev = 0.0
    busy = 0.0
    issued = 0.0              # P_k: when block k is issued (host cost aside)
    for k, blk in enumerate(blocks):
        idx = layout.tensors_of(blk.buffer, blk.start, blk.end)
        r = max(ready[i] for i in idx)
        nbytes = (blk.end - blk.start) * layout.itemsize[blk.buffer]
        issued = r if k == 0 or r > issued else issued
        release = r
        if host is not None:
            # the hooks of every tensor ready by then, and the issues of blocks 0..k
            spent = host.tensor_ms * bisect_right(by_ready, issued) + host.block_ms * (k + 1)
            release = max(issued, spent) if hidden else issued + spent
        start = release if release > prev else prev
        dur = cost.allreduce_ms(nbytes)
        fin = start + dur
        busy += dur
        for i in idx:
            last[i] = fin
        timings.append(BlockTiming(k, blk.buffer, blk.start, blk.end, nbytes,
                                   tuple(names[i] for i in idx), r, start, fin))
        prev = fin
    if any(v < 0 for v in last):
        missing = names[last.index(-1.0)]
        raise MismatchError(f"tensor {missing!r} is covered by no block")
    return timings, last, busy


def _overlap_forward(problem: Problem, finish: Sequence[float], gates: list[ForwardGate],
                     B: float) -> float:
    """The forward of overlap mode, each tensor available ``update_p`` after its last block
    finished, backward ending at ``B``; appends a gate per tensor and returns the forward's
    end."""
    upd, names = problem.update, problem.names
    t = None
    prev_need = 0.0
    for i in problem.need_order():
        avail = finish[i] + upd[i]
        reach_min = B + problem.need[i] if t is None else t + (problem.need[i] - prev_need)
        t = max(reach_min, avail)
        gates.append(ForwardGate(names[i], problem.need[i], avail, t, t - reach_min))
        prev_need = problem.need[i]
    return (B if t is None else t) + problem.F - prev_need


def _gated_forward(problem: Problem, finish: Sequence[float], gates: list[ForwardGate],
                   B: float | None = None) -> float:
    """The forward of overlap mode with the updates at the gates (update rule ``GATE``), from
    each tensor's last finish, backward ending at ``B`` (default the problem's); appends a
    gate per tensor and returns the forward's end."""
    B = problem.B if B is None else B
    upd, need, names = problem.update, problem.need, problem.names
    pending = set(range(problem.n))
    by_finish = sorted(range(problem.n), key=lambda i: finish[i])
    ptr = 0
    t = None
    prev_need = 0.0
    for i in problem.need_order():
        reach = B + need[i] if t is None else t + (need[i] - prev_need)
        t = reach
        paid = 0.0
        if i in pending:
            t = max(reach, finish[i])
            while ptr < len(by_finish) and finish[by_finish[ptr]] <= t:
                j = by_finish[ptr]
                ptr += 1
                if j in pending:
                    pending.discard(j)
                    paid += upd[j]
            if i in pending:  # finished exactly at t but ordered after: update it too
                pending.discard(i)
                paid += upd[i]
        wait = t - reach
        t += paid
        gates.append(ForwardGate(names[i], need[i], finish[i], t, wait, paid))
        prev_need = need[i]
    return t + problem.F - prev_need if t is not None else B + problem.F


def simulate(profile: Profile | Problem, schedule: Schedule, mode: Mode | str | None = None,
             check: bool = True, source: str = "<schedule>",
             runner: Runner | str | None = None) -> Timeline:
    """Score ``schedule`` on ``profile`` (or a compiled :class:`Problem`, e.g. retargeted), in
    ``mode`` (default: the schedule's own, the one the runtime runs it in), run by ``runner``
    (default: the schedule's own, :attr:`~usbyte_opt.formats.Schedule.runner`; a file written
    before schedules named their runner is torch DDP's for the ``ddp`` and ``ddp-tuned``
    strategies, :func:`~usbyte_opt.planning.problem.runner_of`), whose host cost it pays.

    On several nodes (:class:`~usbyte_opt.planning.cost.HierCost`) a schedule without
    hierarchical blocks runs flat rings only; one with them is costed block by block at the
    cheaper form, which is what the planner marks hierarchical."""
    problem = profile if isinstance(profile, Problem) else Problem.from_profile(profile)
    if isinstance(problem.cost, HierCost) and not schedule.hierarchical:
        problem = problem.with_cost(problem.cost.flat_only())
    if check:
        check_against(schedule, problem.profile, source)
    layout = problem.layout(schedule.buffers)
    mode = Mode(mode or schedule.mode)
    if mode == Mode.SHARDED:
        return simulate_sharded(problem, layout, schedule.blocks, schedule.gather_groups())
    if problem.compiled:
        # A compiled profile: the cuts the schedule's pieces need (torch DDP's at every bucket).
        from .compiled import as_compiled

        problem = as_compiled(problem, layout, schedule.blocks, schedule.cut_pieces)
    return simulate_blocks(problem, layout, schedule.blocks, mode,
                           _runner(schedule) if runner is None else runner)


def _runner(schedule: Schedule) -> Runner:
    """The runner that :func:`simulate` charges ``schedule`` by default."""
    if schedule.runner is not Runner.RUNTIME:
        return schedule.runner
    return runner_of(schedule.strategy)


__all__ = ["MODES", "BlockTiming", "ForwardGate", "GatherTiming", "Timeline", "chrome_trace",
           "compute_charge", "compute_windows", "simulate", "simulate_blocks"]
