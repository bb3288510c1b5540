"""Profiling a model across ranks: build it, time it on every rank, sweep all-reduce (and
reduce-scatter and all-gather), aggregate across ranks, return a :class:`usbyte_opt.formats.Profile`.

Cross-rank aggregation: each rank reduces its own repeats to medians; the profile takes,
for every number (forward, backward, each tensor's ready/need/update), the **maximum over
ranks** of those medians. An all-reduce can start only when the slowest rank has produced
the gradient, and the next forward on every rank waits for the slowest block, so the
slowest rank is the one the schedule has to fit. Medians first keep one noisy repeat from
setting the maximum. Each rank's own forward/backward medians are kept in ``meta.per_rank``.

Because every rank receives every rank's numbers (``all_gather_object``), every rank returns
the same profile; only the caller decides who writes it (the CLI: rank 0).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import math
import os
import platform
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from .. import __version__
from ..collectives.agree import agree
from ..collectives.issuers import _SERIAL_IDS, backend_for, block_issuers, wants_serial
from ..collectives.sweep import Sweep, analytic_comm, fit_collective, fit_comm, shard_sizes, sweep_collectives
from ..device import resolve_device
from ..errors import UsageError, UsbyteError, first_line
from ..formats import COMM_BACKENDS, DTYPE_SIZES, CollectiveCost, CommSpec, HostCost, Profile, TensorSpec
from ..formats.probe_record import CpuProbeRecord
from ..group import barrier
from ..models import MODEL_NAME_ATTR, Factory, build_with_optimizer, model_name, resolve
from ..planning.cost import fit_samples
from .optimizers import OPTIMIZERS, make_optimizer, optimizer_name
from .options import STABLE_S, ProfileOptions
from .timing import (
    ROUND,
    GateStamps,
    IterationTimer,
    Progress,
    Summary,
    Timings,
    fill_need,
    make_clock,
    summarize,
)
from .topology import Place, Topology, place_from_env, topology


class ProfileWarning(UserWarning):
    """Something the user should know about a profile (e.g. analytic comm at world size 1)."""


def _r(x: float) -> float:
    return round(float(x), 6)  # ns resolution: keeps distinct ready times distinct


@dataclass(frozen=True, slots=True)
class RankMedians:
    """One rank's medians over its repeats (:class:`~.timing.Summary`), where and when it
    measured them, as every rank receives them."""

    medians: Summary
    host: str
    created: str
    place: Place = Place()
    """Its node and the ranks on that node, as torchrun told it (:mod:`.topology`)."""


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Every rank's medians and, for every number, the maximum over ranks."""

    every: list[RankMedians]
    topology: Topology
    """The nodes of the world (from every rank's :class:`~.topology.Place`)."""
    forward_ms: float
    backward_ms: float
    ready_ms: list[float]
    need_ms: list[float]
    update_ms: list[float]


@dataclass(slots=True)
class Measured:
    """The communication part of a profile: its cost, the record of how it was found, the
    probe's record (with more than one rank and the probe on) and the warnings."""

    comm: CommSpec
    sweep: dict[str, Any]
    probe: CpuProbeRecord | None = None
    notes: list[str] = field(default_factory=list)


def profile_model(model: str | Factory, batch_size: int | None = None,
                  options: ProfileOptions | None = None, *, name: str | None = None,
                  device: str | torch.device | None = None, group: Any = None,
                  progress: Progress | None = None, host_link: Any = None) -> Profile:
    """Profile ``model`` on this rank and, when a process group is initialised, on all ranks.

    Every rank of ``group`` must call this with the same arguments (it runs collectives).
    Without a process group (or at world size 1) the communication settings are analytic
    (:func:`usbyte_opt.collectives.sweep.analytic_comm`, overridable with the options'
    ``alpha_ms`` / ``algbw_gbs``) and a :class:`ProfileWarning` is issued. Nothing is printed
    or written.

    Phases: build the model on every rank (:func:`_build`), time its iterations
    (:class:`~.timing.IterationTimer`), take the maximum over ranks (:func:`_aggregate`),
    measure all-reduce (:func:`_measure_comm`, or :func:`_analytic` at world size 1), measure
    the host cost of the runtime and of DDP (:func:`_host`), and assemble the profile
    (:func:`_assemble`).

    Args:
        model: a built-in name, ``package.module:factory`` or a factory callable
            (see :mod:`usbyte_opt.models` for the protocol).
        batch_size: per-rank batch size; ``None`` takes the model's default.
        options: how to measure (:class:`~.options.ProfileOptions`: iterations, optimizer,
            the all-reduce sweep, the probe of what all-reduce costs the training thread,
            whose samples go to ``meta.cpu_probe``); default ``ProfileOptions()``.
        name: the profile's name; default from the model spec.
        device: ``"cpu"`` or ``"cuda"``; default CUDA when available.
        group: process group; default the world.
        progress: ``progress(phase, done, total)`` after each step, for a progress bar.
        host_link: the emulated link (a :class:`~usbyte_opt.collectives.emulate.LinkSpec`)
            the host-cost probe's collectives also go through (``bench --emulate``), or
            ``None``.

    Returns:
        The profile, identical on every rank.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     p = profile_model("mlp", 4, ProfileOptions(warmup=1, repeats=2))
        >>> len(p.tensors), p.comm.backend, p.meta["world_size"], p.host.launch_bound
        (8, 'analytic', 1, True)
        >>> all(0 <= t.ready_ms <= p.backward_ms and 0 <= t.need_ms <= p.forward_ms for t in p.tensors)
        True

    Under ``torchrun`` (or inside any initialised process group) call it on every rank::

        >>> dist.init_process_group("gloo")                # doctest: +SKIP
        >>> p = profile_model("cnn", batch_size=16)        # doctest: +SKIP
        >>> if dist.get_rank() == 0: save_profile(p, "profiles/cnn.json")  # doctest: +SKIP
    """
    opts = options or ProfileOptions()
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    dev = resolve_device(device)
    label = model if isinstance(model, str) else model_name(model)
    if opts.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer: expected one of {'|'.join(OPTIMIZERS)}, got {opts.optimizer!r}")
    (net, inputs, loss_fn), own_opt = _build(model, batch_size, dev, world, group)
    backend = backend_for(group, dev) if world > 1 else "none"

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        barrier(group, dev, backend)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    if own_opt is not None and opts.factory_optimizer:
        opt, opt_name, opt_from = own_opt, optimizer_name(own_opt), "the model's factory"
    else:
        opt = make_optimizer(opts.optimizer, [p for p in net.parameters() if p.requires_grad])
        opt_name, opt_from = opts.optimizer, "--optimizer"
    split = None
    if opts.compile:
        timer, split, eager = _compiled_timer(net, inputs, loss_fn, opt, dev,
                                              sync if world > 1 else None, label, opts.compile)
    else:
        timer = IterationTimer(net, inputs, loss_fn, opt, dev, sync=sync if world > 1 else None,
                               label=label)
    try:
        prof = _profile_timed(opts, timer, split, eager if split is not None else None, net,
                              inputs, loss_fn, opt, dev, group, world, backend, progress,
                              host_link, model, batch_size, name, label, opt_name, opt_from)
    finally:
        if split is not None:
            split.unregister()
    return prof


def _compiled_timer(net: torch.nn.Module, inputs: Sequence[Any],
                    loss_fn: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer,
                    dev: torch.device, sync: Callable[[], None] | None, label: str,
                    backend: str) -> tuple[IterationTimer, Any, Any]:
    """``--compile``: an eager pass (the gradients' order; the need times of tensors no gate
    reads), then the model compiled with ``backend``, its graphs split at every tensor's
    first use in that order (:class:`usbyte_opt.runtime.compiled.PlanSplit`, gates that run
    nothing but are stamped: the need times, :class:`.timing.GateStamps`), for the timed
    iterations."""
    from ..runtime.compiled import PlanSplit, own_forward, split_available

    if not split_available():
        raise UsbyteError(f"--compile: this torch ({torch.__version__}) has no DDP hook in "
                          "dynamo to split the compiled graphs at")
    eager = IterationTimer(net, inputs, loss_fn, opt, dev, sync=sync, label=label).run(1, 2)
    ready = summarize(eager).ready_ms
    order = sorted(range(len(ready)), key=lambda i: ready[i])
    pieces = [0] * len(ready)
    for k, i in enumerate(order):
        pieces[i] = k
    params = [p for p in net.parameters() if p.requires_grad]
    # The steady-state iterations (the total the shares are scaled to) train a copy compiled
    # whole: the runtime cuts the graph at its plan's blocks, a few pieces, not at every
    # tensor (on two CPU cores inductor ran lab-cnn about 2x slower cut at each of 8 tensors).
    # Its own forward code, so that dynamo compiles it apart.

    try:
        twin, twin_opt = copy.deepcopy((net, opt))
        own_forward(twin)
    except Exception:  # noqa: BLE001 - a model that cannot be copied: the split one's speed
        twin = twin_opt = None
    gates = GateStamps()
    split = PlanSplit(net, params, pieces, gates, accept_rounding=True)
    split.register()
    try:
        compiled = torch.compile(net, backend=backend)
        whole = torch.compile(twin, backend=backend) if twin is not None else None
    except Exception as e:
        split.unregister()
        raise UsbyteError(f"--compile {backend}: torch.compile raised {type(e).__name__}: "
                          f"{first_line(e, '')}") from e
    return (IterationTimer(net, inputs, loss_fn, opt, dev, sync=sync, label=label,
                           compiled=compiled,
                           steady_with=(whole, twin_opt) if whole is not None else None,
                           gates=gates),
            split, eager)


def _profile_timed(opts: ProfileOptions, timer: IterationTimer, split: Any, eager: Any,
                   net: torch.nn.Module, inputs: Sequence[Any],
                   loss_fn: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer,
                   dev: torch.device, group: Any, world: int, backend: str,
                   progress: Progress | None, host_link: Any, model: str | Factory,
                   batch_size: int | None, name: str | None, label: str, opt_name: str,
                   opt_from: str) -> Profile:
    """:func:`profile_model` from the timed iterations on (``split``: compiled)."""
    timings = timer.run(opts.warmup, opts.repeats, progress, steady=True)
    if eager is not None:
        fill_need(timings, eager)
    agg = _aggregate(summarize(timings), world, group)
    # What the probes train: the model as the timed iterations ran it (compiled: the split
    # compiled graphs, whose kernels all-reduce in flight slows otherwise than eager ones).
    trained = (timer.forward, inputs, loss_fn, opt)
    if world > 1:
        measured = _measure_comm(opts, timings, agg, dev, group, backend, world, progress,
                                 lambda: trained)
    else:
        measured = _analytic(opts)
    timings.steady_ms += timer.steady(ROUND)
    host, host_rec = _host(opts, dev, group, world, progress, lambda: trained, measured.notes,
                           host_link)
    # Steady-state iterations spread over the profile's phases (after the timed ones, the
    # all-reduce sweep and the host probe), so that a spell of load elsewhere during one
    # phase does not set the compute alone; every rank's medians again.
    timings.steady_ms += timer.steady(ROUND)
    agg = _aggregate(summarize(timings), world, group)
    if timings.fallback_passes:
        measured.notes.append(f"{timings.fallback_passes} of {opts.repeats} timed passes called "
                              "modules in a different order than the first; need_ms of those "
                              "passes fell back to owner pre-hooks")
    for msg in measured.notes:
        warnings.warn(msg, ProfileWarning, stacklevel=2)
    batch = batch_size if batch_size is not None else resolve(model)[1]
    named = getattr(net, MODEL_NAME_ATTR, None)
    prof = _assemble(name or model_name(model), named if isinstance(named, str) else label, opts,
                     timings, agg, measured, dev, backend, world, batch, (opt_name, opt_from))
    if split is not None:
        gated = sum(id(p) in split.state.covered for p in split.params)
        comp: dict[str, Any] = {
            "backend": opts.compile, "graphs": split.state.gated, "pieces": split.state.pieces,
            "need_ms": f"{gated} of {len(split.params)} tensors: the split forward's gate "
                       "before the piece that reads the tensor first; the others an eager "
                       "pass's, scaled to the compiled forward"}
        if opts.cut_probes > 0 and timer.steady_with is not None:
            if progress is not None:
                progress("cut costs", 0, 1)
            comp.update(_cut_costs(net, opt, inputs, loss_fn, dev, opts, eager, timer.steady_with,
                                   group if world > 1 else None))
        prof = dataclasses.replace(prof, meta={**prof.meta, "compile": comp})
    if host is None:
        return prof
    return dataclasses.replace(prof, host=host, meta={**prof.meta, "host_probe": host_rec})


#: Cut costs (``--compile``): iterations timed per turn, turns (each: the copy cut once, then
#: the copy compiled whole) and untimed iterations after compiling.
CUT_TURN, CUT_TURNS, CUT_WARMUP = 3, 4, 2


def _cut_costs(net: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Sequence[Any],
               loss_fn: Callable[[Any], torch.Tensor], dev: torch.device, opts: ProfileOptions,
               eager: Any, whole: tuple[Any, Any], group: Any) -> dict[str, Any]:
    """What one cut costs a compiled iteration, at each candidate place: a copy of the model
    compiled with that single cut (its graph split before the first use of a tensor, as the
    runtime splits at a plan's blocks) timed in turns beside the copy compiled whole; the
    median difference, 0 at least. Candidates: in the eager pass's order of first use, each
    tensor whose module differs from the one before (a module's weight and bias are never
    apart), evenly spaced ones when there are more than ``opts.cut_probes``. The maximum over
    ranks (every rank compiles and times the same). Returns the ``meta.compile`` entries
    ``cuts`` (ms by the name of the tensor the cut comes before), ``cut_default_ms`` (their
    median: the cost the planner gives a cut not measured) and ``cut_candidates``. No probe
    starts once ``opts.cut_probe_s`` seconds have gone (after the first), all ranks alike."""
    from ..runtime.compiled import PlanSplit, own_forward

    names = [n for n, p in net.named_parameters() if p.requires_grad]
    need = summarize(eager).need_ms
    order = sorted(range(len(names)), key=lambda i: (need[i], i))
    module = [names[i].rpartition(".")[0] for i in order]
    cands = [k for k in range(1, len(order)) if module[k] != module[k - 1]]
    places = len(cands)
    if len(cands) > opts.cut_probes:
        step = len(cands) / opts.cut_probes
        cands = [cands[min(len(cands) - 1, int(j * step + step / 2))] for j in range(opts.cut_probes)]
    whole_fwd, whole_opt = whole
    clock = make_clock(dev)

    def timed(forward: Any, o: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            clock.start_iteration()
            a = clock.stamp()
            loss_fn(forward(*inputs)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
            b = clock.stamp()
            clock.finish()
            out.append(clock.ms(a, b))
        return out

    costs: list[float] = []
    t_start = time.perf_counter()
    for k in cands:
        if costs and not _go_on(time.perf_counter() - t_start < opts.cut_probe_s, dev, group):
            break     # the time cap: every rank stops after the same probe
        twin, twin_opt = copy.deepcopy((net, opt))
        own_forward(twin)
        params = [p for p in twin.parameters() if p.requires_grad]
        before = set(order[:k])
        # Piece 1 (wanted last) holds the tensors used before the cut, piece 0 the rest.
        split = PlanSplit(twin, params, [1 if i in before else 0 for i in range(len(params))],
                          lambda ts: None, accept_rounding=True)
        split.register()
        try:
            fwd = torch.compile(twin, backend=opts.compile)
            timed(fwd, twin_opt, CUT_WARMUP)
            cut_ms, whole_ms = [], []
            for _ in range(CUT_TURNS):
                cut_ms += timed(fwd, twin_opt, CUT_TURN)
                whole_ms += timed(whole_fwd, whole_opt, CUT_TURN)
            costs.append(max(0.0, median(cut_ms) - median(whole_ms)))
        finally:
            split.unregister()
            del fwd, twin, twin_opt, split
    if group is not None and costs:
        t = torch.tensor(costs, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        costs = t.tolist()
    cuts = {names[order[k]]: round(c, 6) for k, c in zip(cands, costs)}
    if len(costs) < len(cands):
        warnings.warn(f"--compile: {len(costs)} of {len(cands)} cut places timed within the "
                      f"{opts.cut_probe_s:g} s cap (--cut-probe-s); the others cost their median",
                      ProfileWarning, stacklevel=2)
    return {"cuts": cuts, "cut_default_ms": round(median(costs), 6) if costs else 0.0,
            "cut_candidates": places,
            "cut_method": f"one cut per compiled copy, {CUT_TURNS} turns of {CUT_TURN} iterations "
                          "beside a copy compiled whole; median difference, max over ranks"}


def _go_on(mine: bool, dev: torch.device, group: Any) -> bool:
    """Whether every rank goes on (one collective with several ranks): a rank's own clock
    never decides alone what every rank must do alike."""
    if group is None:
        return mine
    t = torch.tensor([1 if mine else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _host(opts: ProfileOptions, dev: torch.device, group: Any, world: int,
          progress: Progress | None, training: Callable[[], tuple[Any, Any, Any, Any]],
          notes: list[str], link: Any = None) -> tuple[HostCost | None, dict[str, Any]]:
    """The profile's ``host`` section (:mod:`.host`): every rank measures its own, every rank
    gets the maximum over ranks; on CUDA with the real model's launch-bound verdict. Where
    any rank failed (the runtime or DDP could not be built here), no section, a note that
    says why (the planner's defaults then apply) and the same on every rank. ``(None, {})``
    with the probe off."""
    if not opts.host_probe:
        return None, {}
    from .host import host_cost, launch_bound, to_host_cost

    if progress is not None:
        progress("host cost", 0, 1)
    mine: tuple[Any, Any, Any] | str
    try:
        probe = host_cost(dev, group, link=link)
        bound: Any = None
        bound_rec: dict[str, Any] = {}
        if dev.type == "cuda":
            net, inputs, loss_fn, opt = training()

            def step() -> None:
                loss_fn(net(*inputs)).backward()
                opt.step()
                opt.zero_grad()

            bound, bound_rec = launch_bound(step, dev)
        mine = (probe, bound, bound_rec)
    except Exception as e:  # noqa: BLE001 - the profile stands without it (defaults), said once
        mine = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
    if progress is not None:
        progress("host cost", 1, 1)
    failed = next((x for x in every if isinstance(x, str)), None)
    if failed is not None:
        notes.append(f"host cost not measured ({failed}); the planner's defaults apply "
                     "(docs/profiles.md)")
        return None, {}
    backend = backend_for(group, dev) if world > 1 else ("nccl" if dev.type == "cuda" else "gloo")
    host, rec = to_host_cost([x[0] for x in every], [x[1] for x in every], dev, backend)
    if dev.type == "cuda":
        rec["launch_bound"] = [x[2] for x in every]
    return host, rec


def _build(model: str | Factory, batch_size: int | None, dev: torch.device, world: int,
           group: Any) -> tuple[tuple[torch.nn.Module, Sequence[Any], Callable[[Any], torch.Tensor]],
                                torch.optim.Optimizer | None]:
    """The model, its inputs and loss, and the factory's optimizer if it gives one; every rank
    agrees that building worked before the first timed collective (a rank that failed makes
    every rank raise)."""
    error: UsbyteError | None = None
    built: Any = None
    try:
        built = build_with_optimizer(model, batch_size, dev)
    except UsbyteError as e:
        error = e
    if world > 1:
        agree(group, None, error, dev, None)
    elif error is not None:
        raise error
    return built


def _aggregate(s: Summary, world: int, group: Any) -> Aggregate:
    """Every rank's medians and place to every rank; the slowest rank sets each number. A
    world that is not nodes of equal size numbered node by node raises on every rank alike
    (:func:`~.topology.topology`)."""
    # torchrun's place of this rank; on a group other than the world the numbering is not
    # torchrun's, so the world of that group is one node.
    place = place_from_env(os.environ) if group in (None, dist.group.WORLD) else Place()
    mine = RankMedians(s, socket.gethostname(),
                       _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), place)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        every: list[RankMedians] = gathered
    else:
        every = [mine]
    ms = [r.medians for r in every]
    F, B = max(m.forward_ms for m in ms), max(m.backward_ms for m in ms)
    ready = [max(v) for v in zip(*(m.ready_ms for m in ms))]
    need = [max(v) for v in zip(*(m.need_ms for m in ms))]
    update = [max(v) for v in zip(*(m.update_ms for m in ms))]
    k = slowest_total_scale([(m.forward_ms, m.backward_ms, m.step_ms) for m in ms])
    if k < 1.0:
        F, B = F * k, B * k
        ready, need, update = ([x * k for x in xs] for xs in (ready, need, update))
    return Aggregate(every, topology([r.place for r in every]), F, B, ready, need, update)


def slowest_total_scale(parts: Sequence[tuple[float, float, float]]) -> float:
    """What the maxima over ranks of forward, backward and step (``parts``: each rank's) are
    multiplied by so that they add up to the slowest rank's own forward + backward + step: 1
    where one rank is the slowest in all three, below 1 where noise made the slowest forward
    one rank's and the slowest backward another's (their sum is then no rank's iteration).

    Example::

        >>> slowest_total_scale([(40.0, 60.0, 10.0), (50.0, 50.0, 10.0)])
        0.9166666666666666
        >>> slowest_total_scale([(40.0, 60.0, 10.0)])
        1.0
    """
    if len(parts) < 2:
        return 1.0
    total = max(f + b + s for f, b, s in parts)
    summed = sum(max(p[i] for p in parts) for i in range(3))
    return min(1.0, total / summed) if summed > 0 else 1.0


def _measure_comm(opts: ProfileOptions, timings: Timings, agg: Aggregate, dev: torch.device,
                  group: Any, backend: str, world: int, progress: Progress | None,
                  training: Callable[[], tuple[Any, Any, Any, Any]]) -> Measured:
    """The all-reduce sweep on the runtime's channel, its fitted line, the probe (when on),
    and a warning when the fit is poor enough to change the plan."""
    # The channel the runtime's blocks take (on gloo its one-thread group), so that alpha is
    # what one more block costs there; a sharded runtime's reduce-scatters and all-gathers
    # take the same one.
    kinds = ("all-reduce", "reduce-scatter", "all-gather") if opts.shard_sweep else ("all-reduce",)
    issuers, channel = block_issuers(group, dev, kinds)
    issue = issuers["all-reduce"]
    # One sweep of all of them, round-robin, so that a burst of load touches each alike;
    # reduce-scatter and all-gather sizes are the whole block's bytes, split evenly over the
    # ranks.
    sizes = {k: opts.sweep_sizes() if k == "all-reduce" else shard_sizes(opts.sweep_sizes(), world)
             for k in kinds}
    swept = sweep_collectives(sizes, opts.comm_repeats, 1, dev, group, progress,
                              barrier=lambda: barrier(group, dev, backend), issues=issuers,
                              max_seconds=opts.stable_s)
    for sw in swept.values():
        sw.channel = channel
    # The profile format knows nccl/gloo/mpi/ucc; another backend is filed under the one it
    # stands in for on this device, and meta.backend keeps its real name.
    label_backend = backend if backend in COMM_BACKENDS else ("nccl" if dev.type == "cuda" else "gloo")
    comm, record = fit_comm(swept["all-reduce"], label_backend, world)
    if opts.shard_sweep:
        rs, record["reduce_scatter"] = fit_collective(swept["reduce-scatter"])
        ag, record["all_gather"] = fit_collective(swept["all-gather"])
        comm = dataclasses.replace(comm, reduce_scatter=rs, all_gather=ag)
    del issuers
    out = Measured(comm, record)
    if opts.cpu_probe:
        out.probe = _probe(*training(), dev, group, issue, timings, progress, opts)
        out.comm = dataclasses.replace(comm, cpu_ms_per_block=out.probe.cpu_ms_per_block,
                                       cpu_ms_per_mb=out.probe.cpu_ms_per_mb)
    del issue
    topo = agg.topology
    if topo.nodes > 1:
        out.comm = dataclasses.replace(out.comm, nodes=topo.nodes)
    if topo.hierarchical:
        intra, inter, record["intra"], record["inter"] = _measure_levels(opts, dev, backend, topo,
                                                                        progress)
        out.comm = dataclasses.replace(out.comm, intra=intra, inter=inter)
    worst = record["fit"]["max_rel_error"]
    changed = _fit_changes_verdict(timings, agg, out.comm, record["spread"]) if worst > 0.5 else ""
    if changed:
        out.notes.append(f"all-reduce medians lie up to {100 * worst:.0f}% off the fitted line, and "
                         f"within the fit's spread the plan changes ({changed}): a shared machine or "
                         "a noisy network; rerun with more --comm-repeats, or see meta.comm_sweep")
    return out


def level_repeats(comm_repeats: int) -> int:
    """Timed samples per size of the intra- and inter-node sweeps: half the main sweep's
    (rounded up), as they run after it and only feed two extra lines.

    Example::

        >>> level_repeats(5), level_repeats(1)
        (3, 1)
    """
    return max(1, (comm_repeats + 1) // 2)


def _measure_levels(opts: ProfileOptions, dev: torch.device, backend: str, topo: Topology,
                    progress: Progress | None
                    ) -> tuple[CollectiveCost, CollectiveCost, dict[str, Any], dict[str, Any]]:
    """All-reduce on each level of a world of several nodes of several ranks, on the
    runtime's channel of each level: inside every node at once (each node's ranks), then
    across the nodes (local rank 0 of each, the other ranks idle at a barrier), the main
    sweep's sizes with :func:`level_repeats` samples each and extra rounds capped at a quarter
    of ``stable_s``. The intra line is fitted to the slowest node's median at each size (every
    node's medians are kept in the record). Returns the intra and inter lines and their
    ``meta.comm_sweep`` records; the same on every rank. Collective calls of the world: every
    rank creates every subgroup, in the same order."""
    N, G = topo.nodes, topo.ranks_per_node
    rank = dist.get_rank()
    node = rank // G
    sizes = {"all-reduce": opts.sweep_sizes()}
    reps = level_repeats(opts.comm_repeats)
    cap = opts.stable_s / 4

    def phase(name: str) -> Progress | None:
        if progress is None:
            return None
        return lambda _, done, total: progress(name, done, total)

    t0 = time.perf_counter()
    intra_groups = [dist.new_group(list(range(k * G, (k + 1) * G))) for k in range(N)]
    inter_group = dist.new_group([k * G for k in range(N)])
    mine = intra_groups[node]
    issuers, channel = block_issuers(mine, dev, ("all-reduce",))
    sw = sweep_collectives(sizes, reps, 1, dev, mine, phase("intra-node"),
                           barrier=lambda: barrier(mine, dev, backend), issues=issuers,
                           max_seconds=cap)["all-reduce"]
    del issuers
    sw.channel = channel
    # Every node's medians (the sweep took the minimum over its node's ranks, so the node's
    # ranks agree); the line is fitted to the slowest node at each size.
    nodes: list[Any] = [None] * (N * G)
    dist.all_gather_object(nodes, (sw.raw_ms, sw.medians_ms))
    per_node = [nodes[k * G] for k in range(N)]
    slowest = [max(range(N), key=lambda k: per_node[k][1][i]) for i in range(len(sw.sizes))]
    intra_sw = Sweep(list(sw.sizes), [per_node[k][0][i] for i, k in enumerate(slowest)],
                     [per_node[k][1][i] for i, k in enumerate(slowest)], list(sw.chains),
                     channel)
    intra, intra_rec = fit_collective(intra_sw)
    intra_rec = {"group": f"the {G} ranks of each node, all {N} nodes at once",
                 "fit_from": "the slowest node's median at each size",
                 "slowest_node": slowest,
                 "node_medians_ms": [[_r(m) for m in meds] for _, meds in per_node],
                 "repeats": reps, "seconds": _r(time.perf_counter() - t0), **intra_rec}
    t0 = time.perf_counter()
    # Across the nodes: local rank 0 of each; the others wait at the world's barrier.
    swept: Any = None
    if rank % G == 0:
        issuers, channel = block_issuers(inter_group, dev, ("all-reduce",))
        swept = sweep_collectives(sizes, reps, 1, dev, inter_group, phase("inter-node"),
                                  barrier=lambda: barrier(inter_group, dev, backend),
                                  issues=issuers, max_seconds=cap)["all-reduce"]
        swept.channel = channel
        del issuers
    elif wants_serial(None, dev):
        # The ranks that sat out made no serial group: keep every rank's count of them in
        # step, so that a later one (the runtime's, in the same process) meets its peers.
        next(_SERIAL_IDS)
    barrier(None, dev, backend)
    box = [swept]
    dist.broadcast_object_list(box, src=0)
    inter_sw: Sweep = box[0]
    inter, inter_rec = fit_collective(inter_sw)
    inter_rec = {"group": f"local rank 0 of each of the {N} nodes, the other ranks idle",
                 "repeats": reps, "seconds": _r(time.perf_counter() - t0), **inter_rec}
    for g in (*intra_groups, inter_group):
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return intra, inter, intra_rec, inter_rec


def _analytic(opts: ProfileOptions) -> Measured:
    """World size 1: nothing to measure; the analytic cost, with the warning that says so."""
    comm = analytic_comm(opts.alpha_ms, opts.algbw_gbs)
    record = {"method": "analytic: world size 1 has no all-reduce to measure; ring of "
                        f"{comm.world_size} workers, 25 Gbit/s, alpha {comm.alpha_ms:g} ms "
                        "unless --alpha-ms/--algbw-gbs were given"}
    return Measured(comm, record, notes=[
        f"world size 1: no all-reduce to measure; using analytic settings for {comm.world_size} "
        f"workers (alpha {comm.alpha_ms:.3g} ms, algbw {comm.algbw_gbs:.3g} GB/s); run under "
        "torchrun or with --nproc-per-node to measure"])


def _assemble(name: str, label: str, opts: ProfileOptions, timings: Timings, agg: Aggregate,
              measured: Measured, dev: torch.device, backend: str, world: int,
              batch: Any, optimizer: tuple[str, str] | None = None) -> Profile:
    """The profile of the measured numbers, with the ``meta`` that says how they were found
    (``optimizer``: the name of the optimizer timed and where it came from)."""
    opt_name, opt_from = optimizer or (opts.optimizer, "--optimizer")
    F, B, every = agg.forward_ms, agg.backward_ms, agg.every
    tensors = []
    for i, n in enumerate(timings.names):
        dt = timings.dtypes[i]
        if dt not in DTYPE_SIZES:
            raise UsbyteError(f"model {label!r}: trainable tensor {n!r} has dtype {dt}; expected one of "
                              + "|".join(DTYPE_SIZES))
        tensors.append(TensorSpec(n, timings.shapes[i], dt, _r(min(agg.ready_ms[i], B)),
                                  _r(min(agg.need_ms[i], F)), _r(agg.update_ms[i])))
    dtypes = sorted(set(timings.dtypes))
    meta = {
        "source": "usbyte-opt profile",
        "usbyte_opt": __version__,
        "model": label,
        "created": every[0].created,
        "device": dev.type,
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else platform.processor() or platform.machine()),
        "backend": backend,
        "torch": torch.__version__,
        "world_size": world,
        "hosts": len({r.host for r in every}),
        "nodes": agg.topology.nodes,
        "ranks_per_node": agg.topology.ranks_per_node,
        "topology": "GROUP_RANK and LOCAL_WORLD_SIZE of every rank (torchrun's)"
                    if every[0].place.local_world else "one node (no torchrun variables)",
        "batch_size": batch,
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "optimizer": opt_name,
        "optimizer_from": opt_from,
        "warmup": opts.warmup,
        "repeats": opts.repeats,
        "threads": torch.get_num_threads(),
        "timing": "CUDA events recorded in hooks" if dev.type == "cuda" else "perf_counter in hooks",
        "compute_method": STEADY_METHOD,
        "aggregation": "median over repeats per rank, then max over ranks",
        "ready_method": "post-accumulate-grad hook (last accumulation counts)",
        "need_method": "forward pre-hooks of owning modules; first use located by a TorchFunctionMode "
                       "discovery pass (last hook before first use)",
        "update_method": "optimizer step timed whole, apportioned by element count",
        "no_grad_tensors": timings.no_grad,
        "no_grad_policy": "ready_ms = backward_ms (zero-filled at the end of backward)",
        "unused_in_forward": timings.unused,
        "unused_policy": "need_ms = forward_ms",
        "functional_use_tensors": timings.functional,
        "spread": every[0].medians.spread if world == 1 else {"rank0": every[0].medians.spread},
        "per_rank": [{"forward_ms": _r(r.medians.forward_ms), "backward_ms": _r(r.medians.backward_ms),
                      "step_ms": _r(r.medians.step_ms), **_steady_of(r.medians)} for r in every],
        "step_ms": _r(max(r.medians.step_ms for r in every)),
        "comm_sweep": measured.sweep,
    }
    if measured.probe is not None:
        meta["cpu_probe"] = measured.probe.to_dict()
    if measured.notes:
        meta["warnings"] = measured.notes
    return Profile(name, _r(F), _r(B), tuple(tensors), measured.comm, meta)


#: How forward, backward and the step are made to add up to what training pays (``meta``).
STEADY_METHOD = ("hooked iterations (each after a barrier) give the split into forward, backward, "
                 "step and every tensor's offsets; they are scaled so that forward + backward + "
                 "step is the median plain iteration of the same loop without hooks or barriers, "
                 "timed from its start to the next one's, in rounds interleaved with the hooked "
                 "ones and after the all-reduce sweep and the host probe (meta.per_rank: "
                 "hooked_ms, steady_ms, scale)")


def _steady_of(s: Summary) -> dict[str, float]:
    """A rank's hooked sum, its steady-state iteration and the scale between them, for
    ``meta.per_rank`` (nothing when no steady-state iterations were timed)."""
    sp = s.spread
    if "steady_ms" not in sp:
        return {}
    return {"hooked_ms": _r(sp["hooked_ms"]), "steady_ms": _r(sp["steady_ms"]["p50"]),
            "scale": _r(sp["scale"])}


def _fit_changes_verdict(timings: Timings, agg: Aggregate, comm: CommSpec,
                         spread: dict[str, list[float]]) -> str:
    """Whether the plan ``usbyte-opt optimize`` would choose changes anywhere within the fit's
    spread (the corners of the alpha and bandwidth intervals): the best plan's mode, or
    whether it beats DDP by more than 2%. Returns a description of the change, or ""."""
    from ..planning.planner import compare

    F, B, ready, need, update = agg.forward_ms, agg.backward_ms, agg.ready_ms, agg.need_ms, agg.update_ms

    def verdict(alpha: float, algbw: float) -> tuple[str, bool]:
        c = dataclasses.replace(comm, alpha_ms=max(alpha, 0.0), algbw_gbs=max(algbw, 1e-6))
        tensors = tuple(TensorSpec(n, timings.shapes[i], timings.dtypes[i], min(ready[i], B),
                                   min(need[i], F), update[i])
                        for i, n in enumerate(timings.names))
        r = compare(Profile("verdict", F, B, tensors, c), ["ddp", "best"]).results
        return r["best"].mode, r["best"].iteration_ms < 0.98 * r["ddp"].iteration_ms

    try:
        base = verdict(comm.alpha_ms, comm.algbw_gbs)
        for a in spread.get("alpha_ms", []):
            for bw in spread.get("algbw_gbs", []):
                v = verdict(a, bw)
                if v != base:
                    return (f"alpha {a:.3g} ms, {bw:.3g} GB/s: best in {v[0]} mode"
                            f"{'' if v[1] else ', not faster than DDP'}")
    except Exception:  # noqa: BLE001 - the check is advice; the profile stands without it
        return ""
    return ""


def _probe(net: torch.nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
           opt: torch.optim.Optimizer, dev: torch.device, group: Any, issue: Callable[[Any], Any],
           timings: Timings, progress: Progress | None, opts: ProfileOptions) -> CpuProbeRecord:
    """What all-reduce costs the training thread (:func:`.probe.comm_under_compute`), on the
    runtime's channel ``issue``, as the record kept in ``meta.cpu_probe``."""
    from .probe import comm_under_compute, probe_sizes

    total = sum(math.prod(shape) * DTYPE_SIZES.get(dt, 4)
                for shape, dt in zip(timings.shapes, timings.dtypes))
    sizes, parts = probe_sizes(total, opts.probe_points)

    def step() -> None:  # no host synchronize: on CUDA the probe times with events
        loss_fn(net(*inputs)).backward()
        opt.step()
        opt.zero_grad()

    if progress is not None:
        progress("all-reduce under compute", 0, 1)
    pr = comm_under_compute(step, sizes, opts.probe_repeats, group=group, device=dev, issue=issue,
                            parts=parts, max_seconds=opts.stable_s)
    if progress is not None:
        progress("all-reduce under compute", 1, 1)
    samples = tuple((b, _r(ms)) for b, ms in pr.samples)
    # A block's latency while training runs, recorded, not planned with (docs/bench.md,
    # "alpha under training").
    alpha = _r(fit_samples([(int(b), float(ms)) for b, ms in samples])[0]) if len(samples) >= 2 else None
    return CpuProbeRecord(
        method="chains of blocks on the runtime's channel while training iterations run; "
               "iterations' lost time fitted to a cost per block and per MB (non-negative "
               "least squares), max over ranks",
        cpu_ms_per_block=_r(pr.cpu_ms_per_block), cpu_ms_per_mb=_r(pr.cpu_ms_per_mb),
        step_alone_ms=_r(pr.step_alone_ms), chains=tuple(zip(sizes, parts)),
        repeats=opts.probe_repeats, passes=pr.passes,
        spread={k: (_r(lo_hi[0]), _r(lo_hi[1])) for k, lo_hi in (pr.spread or {}).items()},
        samples=samples, alpha_ms=alpha)


__all__ = ["STABLE_S", "Aggregate", "Measured", "ProfileWarning", "RankMedians", "profile_model"]
