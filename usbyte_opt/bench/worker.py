"""What every rank of ``usbyte-opt bench`` runs: profile, plan, train each strategy, report.

Started by :func:`usbyte_opt.launcher.run_ranks` as ``python -m usbyte_opt.bench.worker
JOB.json`` (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment; the job file is read back
as a :class:`usbyte_opt.bench.job.Job`), or called directly with :func:`run_rank` by
``usbyte-opt bench`` under torchrun. Every rank:

1. joins the process group (gloo on CPU, NCCL on CUDA);
2. profiles the model on it — the all-reduce sweep runs on this very group, so in the lab
   ``alpha``/``algbw`` are those of the shaped link, and all-reduce is timed again while
   training iterations run (:func:`usbyte_opt.profiler.probe.comm_under_compute`, kept in the
   profile's ``meta.cpu_probe``) — or loads ``--profile`` (probing here if it has no probe);
   with ``--emulate`` (one rank) the profile's communication becomes the emulated link's
   line (:func:`usbyte_opt.bench.emulated_profile`), and every trainee's collectives occupy
   one :class:`~usbyte_opt.collectives.emulate.EmulatedLink` of this rank (:func:`_train`);
3. rank 0 plans every strategy (:func:`usbyte_opt.planning.planner.compare`, so ``best`` is seeded
   with all of them; the sharded ones with ``shard=True``, :func:`usbyte_opt.bench.plan_reports`)
   and broadcasts the schedules;
4. trains every requested strategy side by side (:func:`usbyte_opt.bench.train.interleave`),
   adding rounds while a strategy's time against DDP's is not distinguishable
   (:mod:`usbyte_opt.verdict`);
5. compares each trainee's final parameters with the reference (DDP) and sends its timings
   and its optimizer-state bytes to rank 0, which writes ``raw.json`` in the output folder.

Rank 0 prints progress as ``@@ <text>`` lines on stderr (the launcher shows them); a failure
is recorded in the rank's torch elastic error file, which the launcher reads, and is one
``error: <message>`` line in the rank's log; the exit code is 1.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import plural
from ..formats import Mode
from ..launcher import PROGRESS_PREFIX
from .job import Job

#: The strategy trained by PyTorch DDP itself rather than by the runtime (its schedule is
#: still planned, for the prediction).
TORCH_DDP = "ddp"
#: The planner's own strategy, which ``usbyte-opt optimize`` writes by default.
BEST = "best"
#: The compute-only reference run (no communication).
REFERENCE = "no-comm"
#: Stock PyTorch DDP with the planned buckets (``usbyte_opt.ddp.wrap``).
DDP_TUNED = "ddp-tuned"
#: PyTorch FSDP2 itself (``fully_shard`` per block, :func:`usbyte_opt.bench.train.apply_fsdp2`):
#: nothing planned, nothing predicted.
TORCH_FSDP2 = "fsdp2"


def _say(rank: int) -> Callable[[str], None]:
    def say(text: str) -> None:
        if rank == 0:
            sys.stderr.write(f"{PROGRESS_PREFIX}{text}\n")
            sys.stderr.flush()
    return say


@dataclass(slots=True)
class Prediction:
    """One strategy's predicted iteration time, in the mode its schedule runs in."""

    ms: float | None
    """The planner's prediction; ``None`` for ``auto`` until the run says what it chose."""
    mode: str
    """``overlap`` or ``fence`` (PyTorch DDP), ``sharded`` (ZeRO-1), ``compute`` (no-comm),
    ``auto``, ``none`` (FSDP2: no prediction)."""
    blocks: int | None
    refined_ms: float | None = None
    """Set by :func:`refine` once training has run."""
    state_bytes: int | None = None
    """Predicted optimizer-state bytes per rank, where the planner predicts them (its
    sharded strategies)."""

    def to_dict(self) -> dict[str, Any]:
        return {"ms": self.ms, "mode": self.mode, "blocks": self.blocks, "refined_ms": self.refined_ms,
                "state_bytes": self.state_bytes}


@dataclass(slots=True)
class Planned:
    """What rank 0 planned (:func:`plan`) and every rank receives."""

    schedules: dict[str, Any]
    """Each planned strategy's :class:`~usbyte_opt.formats.Schedule`."""
    predicted: dict[str, Prediction]
    """Each requested strategy's prediction."""
    lower_bound_ms: float
    compute_ms: float
    update_ms: float
    all: dict[str, dict[str, Any]]
    """Every registered strategy's result (iteration, mode, overlap/fence ms, blocks)."""
    sharded_lower_bound_ms: float | None = None
    """Sharded mode's lower bound, when sharded strategies were planned: what their measured
    times are held against (:func:`usbyte_opt.planning.sharded.sharded_lower_bound`)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``planned`` object of ``raw.json`` (without the schedules, which are files)."""
        return {"lower_bound_ms": self.lower_bound_ms,
                "sharded_lower_bound_ms": self.sharded_lower_bound_ms,
                "compute_ms": self.compute_ms,
                "update_ms": self.update_ms, "all": self.all,
                "predicted": {s: p.to_dict() for s, p in self.predicted.items()}}


@dataclass(frozen=True, slots=True)
class LoadedComm:
    """All-reduce cost measured while the training thread computes, for the refined prediction:
    from the profile's probe (``meta.cpu_probe``) or the bench's own; with sharded strategies,
    the bench's reduce-scatter and all-gather the same way."""

    comm: Any
    """The profile's :class:`~usbyte_opt.formats.CommSpec` with the bandwidths fitted to the
    samples (:func:`.refine.loaded_comm`): all-reduce, and reduce-scatter and all-gather where
    probed (else the profile's lines)."""
    cpu_ms_per_mb: float
    cpu_ms_per_block: float
    step_alone_ms: float | None
    samples: tuple[tuple[int, float], ...]
    from_profile: bool

    def to_dict(self) -> dict[str, Any]:
        """The ``loaded_comm`` object of ``raw.json``."""
        shard = {key: {"alpha_ms": c.alpha_ms, "algbw_gbs": c.algbw_gbs,
                       "samples": [list(x) for x in c.samples]}
                 for key, c in (("reduce_scatter", self.comm.reduce_scatter),
                                ("all_gather", self.comm.all_gather)) if c is not None}
        return {**shard, "alpha_ms": self.comm.alpha_ms, "algbw_gbs": self.comm.algbw_gbs,
                "cpu_ms_per_mb": self.cpu_ms_per_mb, "cpu_ms_per_block": self.cpu_ms_per_block,
                "step_alone_ms": self.step_alone_ms,
                "source": "profile (meta.cpu_probe)" if self.from_profile else "bench probe",
                "samples": [list(x) for x in self.samples],
                "method": "chains of blocks on the runtime's channel, issued after a barrier "
                          "while training iterations run; issue to completion of the last, "
                          "minimum over ranks, median of repeats, per block"}


def plan(profile: Any, strategies: list[str], time_budget_s: float) -> Planned:
    """Plan every registered strategy on ``profile`` (and, when ``strategies`` has sharded
    names, every sharded one: :func:`usbyte_opt.bench.plan_reports`); return the schedules
    and predictions of ``strategies`` (``no-comm``: forward + backward + optimizer step;
    ``fsdp2``: none). Each prediction has the planner's ``ms`` in the ``mode`` its schedule
    runs in (PyTorch DDP: fence); :func:`refine` adds ``refined_ms`` once training has run."""
    from ..env import AUTO
    from ..errors import UsbyteError
    from . import flat_best, plan_reports, zero2_base

    report, sharded = plan_reports(profile, strategies, {BEST: {"time_budget_s": time_budget_s}})
    out = Planned({}, {}, report.lower_bound_ms, report.compute_ms,
                  sum(t.update_ms for t in profile.tensors),
                  {n: {"iteration_ms": r.iteration_ms, "mode": r.mode, "overlap_ms": r.overlap_ms,
                       "fence_ms": r.fence_ms, "blocks": r.blocks}
                   for n, r in report.results.items()})
    if sharded is not None:
        out.sharded_lower_bound_ms = sharded.lower_bound_ms
        out.all.update({n: {"iteration_ms": r.iteration_ms, "mode": r.mode, "blocks": r.blocks,
                            "state_bytes": getattr(r, "state_bytes", None)}
                        for n, r in sharded.results.items()})
    for s in strategies:
        base = zero2_base(s) or s   # a ZeRO-2 name: its sharded strategy's schedule
        rep_s = sharded if sharded is not None and base in sharded.results else report
        if s == REFERENCE:
            out.predicted[s] = Prediction(out.compute_ms + out.update_ms, "compute", 0)
        elif s == AUTO:  # planned inside the run; its own prediction is read after training
            out.predicted[s] = Prediction(None, "auto", None)
        elif s == TORCH_FSDP2:  # torch's own sharding: nothing to plan
            out.predicted[s] = Prediction(None, "none", None)
        elif base not in rep_s.results:
            skipped = {**report.skipped, **(sharded.skipped if sharded is not None else {})}
            why = skipped.get(base, "not planned")
            if base in flat_best():
                why = ("planned beside best on several nodes of several ranks only (a profile "
                       "with comm.nodes > 1 and its intra/inter lines)")
            raise UsbyteError(f"--strategies: {s}: {why}")
        else:
            r = rep_s.results[base]
            out.schedules[s] = rep_s.schedule(base)
            out.predicted[s] = Prediction(r.iteration_ms, r.mode, r.blocks,
                                          state_bytes=getattr(r, "state_bytes", None))
    return out


def refine(profile: Any, planned: Planned, loaded: LoadedComm | None = None,
           compute_scale: float = 1.0) -> None:
    """Set ``refined_ms`` of every prediction in ``planned`` (from :func:`plan`), in the mode
    its schedule runs in: the planner's model (with its compute-cost rule) on the all-reduce
    cost measured under compute and the measured training-thread costs (``loaded``, when
    probed), compute scaled by ``compute_scale`` (measured ``no-comm`` over predicted:
    :func:`~.refine.scaled`), and in overlap mode the runtime's update rule
    (:func:`~.refine.refined_overlap`); on one rank, compute plus host cost
    (:func:`usbyte_opt.bench.bench_profile`)."""
    import dataclasses

    from ..planning.compiled import as_compiled
    from ..planning.problem import Problem, runner_of
    from ..planning.simulate import simulate_blocks
    from . import bench_profile
    from .refine import refined_overlap, scaled

    base = scaled(bench_profile(profile), compute_scale)   # one rank: compute + host cost
    if loaded is not None:
        comm = dataclasses.replace(loaded.comm, cpu_ms_per_mb=loaded.cpu_ms_per_mb,
                                   cpu_ms_per_block=loaded.cpu_ms_per_block)
    else:
        comm = base.comm
    rp = Problem.from_profile(base.with_comm(comm))
    from ..planning.cost import HierCost

    # On several nodes a schedule without hierarchical blocks runs flat rings only (as
    # planning.simulate.simulate costs it); one with them, block by block at the cheaper form.
    flat = rp.with_cost(rp.cost.flat_only()) if isinstance(rp.cost, HierCost) else rp
    for s, pred in planned.predicted.items():
        if s == REFERENCE:
            pred.refined_ms = (planned.compute_ms + planned.update_ms) * compute_scale
        elif s not in planned.schedules:  # auto: no schedule known ahead; fsdp2: none
            pred.refined_ms = None
        elif planned.schedules[s].mode == Mode.SHARDED:  # its own model, on the loaded comm
            from ..planning.simulate import simulate

            pred.refined_ms = simulate(rp, planned.schedules[s], check=False).iteration_ms
        elif pred.mode == Mode.FENCE:  # the whole step already runs on the training thread
            sched = planned.schedules[s]
            on = rp if sched.hierarchical else flat
            lay = on.layout(sched.buffers)
            pred.refined_ms = simulate_blocks(as_compiled(on, lay, sched.blocks, sched.cut_pieces),
                                              lay, sched.blocks, Mode.FENCE, runner_of(s)).iteration_ms
        else:
            sched = planned.schedules[s]
            on = rp if sched.hierarchical else flat
            lay = on.layout(sched.buffers)
            pred.refined_ms = refined_overlap(as_compiled(on, lay, sched.blocks, sched.cut_pieces),
                                              lay, sched.blocks)


def pin_cores(local_rank: int, local_world: int) -> list[int] | None:
    """Give CPU rank ``local_rank`` of ``local_world`` its own share of this process's cores
    (threads started later, gloo's included, inherit it), as each rank owns its own GPU on a
    GPU server. Without it the scheduler sometimes runs two ranks' training threads on one
    core while another idles, and every collective waits for the slower rank. Returns the
    cores, or ``None`` where there are fewer cores than ranks (nothing changed).

    Example::

        >>> import os
        >>> before = os.sched_getaffinity(0)
        >>> pin_cores(0, 1) == sorted(before)
        True
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    per = len(cores) // max(1, local_world)
    if per < 1 or not 0 <= local_rank < local_world:
        return None
    mine = cores[local_rank * per:(local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    return mine


def run_rank(job: Job) -> dict[str, Any] | None:
    """Run one rank of the benchmark ``job`` (made by :meth:`usbyte_opt.bench.BenchConfig.job`);
    rank 0 returns the raw result (and writes it), the others ``None``.

    Phases: :func:`_profile`, :func:`_loaded_comm`, :func:`_plan_everywhere`,
    :func:`_train`, then :func:`_gather` and, on rank 0, :func:`_raw`."""
    import torch
    import torch.distributed as dist

    from ..device import resolve_device
    from ..errors import UsbyteError
    from ..group import init_from_env
    from .train import DETERMINISTIC_ENV, deterministic_kernels

    if os.environ.get(DETERMINISTIC_ENV, "") not in ("", "0"):
        # The whole rank, the profile included: deterministic kernels can be several times
        # slower (cuDNN's convolutions), and a profile of faster ones predicts the wrong compute.
        deterministic_kernels()

    dev = resolve_device(job.device)
    if dev.type == "cpu":
        pin_cores(int(os.environ.get("LOCAL_RANK", "0")),
                  int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))
    owns = init_from_env(dev, job.pg_timeout_s)
    if not dist.is_initialized():
        raise UsbyteError("bench worker: no process group (RANK/WORLD_SIZE not set)")
    try:
        if job.threads:
            torch.set_num_threads(job.threads)
        return _run(job, dev)
    finally:
        if owns and dist.is_initialized():
            gc.collect()   # torch DDP's reducers before the group (launcher.run_local)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group after a failure
                pass


@dataclass(slots=True)
class _Clock:
    """Seconds each phase took, in order."""

    start: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)

    def lap(self, phase: str) -> None:
        self.phases[phase] = time.perf_counter() - self.start - sum(self.phases.values())


def _run(job: Job, dev: Any) -> dict[str, Any] | None:
    import torch.distributed as dist

    from ..formats import write_json
    from ..runtime import trace as trace_mod

    rank, world = dist.get_rank(), dist.get_world_size()
    say = _say(rank)
    clock = _Clock()
    prof, profile_path = _profile(job, dev, rank, world, say)
    spec = None
    if job.emulate is not None:
        prof, profile_path, spec = _emulated(job, prof, profile_path, rank, say)
    clock.lap("profile")
    batch = prof.meta.get("batch_size") if job.batch_size is None else job.batch_size
    loaded = _loaded_comm(job, prof, dev, batch, rank, world, say)
    clock.lap("probe")
    planned = _plan_everywhere(job, prof, rank, say)
    clock.lap("plan")
    link = None
    if spec is not None:
        from ..collectives.emulate import EmulatedLink

        link = EmulatedLink(dev)   # one serial channel for every trainee of this rank
    try:
        trainees, traces = _train(job, planned, dev, batch, rank, say,
                                  None if link is None else (spec, link))
    finally:
        if link is not None:
            link.close()
    clock.lap("train")
    if job.trace:
        trace_mod.flush_all()
        _gather_traces(traces, rank, world)
    ref, every = _gather(trainees, world)
    if rank != 0:
        return None
    runs = _runs(list(job.strategies), every, world, planned)
    compute_scale = _compute_scale(runs, planned)
    refine(prof, planned, loaded, compute_scale)
    raw = _raw(job, prof, profile_path, batch, world, dev, planned, loaded, runs, traces,
               compute_scale, clock, ref)
    if link is not None:   # what the emulated link carried, every trainee's turns together
        raw["emulated_link"] = {"spec": str(spec), "collectives": link.count,
                                "busy_s": link.submitted_s}
    if job.profiling.compile:
        raw["compile"] = compile_info(job.profiling.compile, trainees)
    write_json(Path(job.out_dir) / "raw.json", raw)
    return raw


def compile_info(backend: str, trainees: list[Any]) -> dict[str, Any]:
    """``--compile``: the backend, and how rank 0's runtime strategies' compiled graphs were
    split (:mod:`usbyte_opt.runtime.compiled`): graphs split, their pieces, whether the
    updates ran before the forward (a graph break) or a graph ran unsplit."""
    from ..runtime.compiled import _STATES

    split = {}
    for t in trainees:
        st = _STATES.get(t.plain) if t.kind == "runtime" else None
        if st is not None:
            split[t.name] = {"graphs": st.gated, "pieces": st.pieces, "gated": not (
                st.foreign or st.multi), "graph_break": st.multi, "unsplit": st.foreign}
    return {"backend": backend, "split": split}


def _profile(job: Job, dev: Any, rank: int, world: int, say: Callable[[str], None]) -> tuple[Any, str]:
    """Profile on this process group (rank 0 writes ``profile.json``), or load ``job.profile``."""
    from ..formats import load_profile, save_profile
    from ..profiler.run import profile_model

    if job.profile:
        return load_profile(job.profile), job.profile
    say(f"profiling {job.name} on {plural(world, 'rank')}")
    last: dict[str, int] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if done == total or phase not in last:
            say(f"profile: {phase} {done}/{total}")
        last[phase] = done

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Reduce-scatter and all-gather are swept only for sharded strategies (they would only
        # lengthen the run of all-reduce ones).
        from . import split_strategies

        opts = dataclasses.replace(job.profiling,
                                   shard_sweep=bool(split_strategies(job.strategies)[1]))
        link = None
        if job.emulate:
            from ..collectives.emulate import parse_emulate

            link = parse_emulate(job.emulate)
        # Under --emulate the host probe's collectives take the link too (its submission is
        # part of what each block costs this run).
        prof = profile_model(job.model, job.batch_size, opts, name=job.name, device=dev,
                             progress=progress, host_link=link)
    path = str(Path(job.out_dir) / "profile.json")
    if rank == 0:
        save_profile(prof, path)
    return prof, path


def _emulated(job: Job, prof: Any, profile_path: str, rank: int,
              say: Callable[[str], None]) -> tuple[Any, str, Any]:
    """The profile on ``job.emulate``'s link (:func:`usbyte_opt.bench.emulated_profile`: the
    compute and host cost profiled here, the communication the link's line), written by rank 0
    to ``profile.json`` in the output folder; the path; the link's spec."""
    from ..collectives.emulate import parse_emulate
    from ..formats import save_profile
    from . import describe_link, emulated_profile

    assert job.emulate is not None
    spec = parse_emulate(job.emulate)
    prof = emulated_profile(prof, spec)
    say(f"planning for {describe_link(spec)}")
    path = str(Path(job.out_dir) / "profile.json")
    if rank == 0:
        save_profile(prof, path)
    return prof, path, spec


def _loaded_comm(job: Job, prof: Any, dev: Any, batch: Any, rank: int, world: int,
                 say: Callable[[str], None]) -> LoadedComm | None:
    """All-reduce cost while the training thread computes (for the refined prediction): the
    profile's probe when it has one, else this bench's own (unless the probe is off); with
    sharded strategies, also reduce-scatter and all-gather, probed the same way on the same
    channel by the bench (a profile's probe has all-reduce only)."""
    from ..formats.probe_record import CpuProbeRecord
    from . import split_strategies
    from .refine import loaded_comm

    if world < 2:
        return None
    record = CpuProbeRecord.of(prof.meta, job.profile or "profile.json")
    if record is None and not job.profiling.cpu_probe:
        return None
    import torch

    from ..collectives.issuers import block_issuers
    from ..profiler.probe import comm_under_compute, probe_sizes
    from .train import Trainee

    sharded = bool(split_strategies(job.strategies)[1])
    kinds = (() if record is not None else ("all-reduce",)) + \
        (("reduce-scatter", "all-gather") if sharded and job.profiling.cpu_probe else ())
    if not kinds:  # the profiler measured it (usbyte_opt.profiler.probe): reused
        assert record is not None
        return LoadedComm(loaded_comm(prof.comm, record.samples), record.cpu_ms_per_mb,
                          record.cpu_ms_per_block, record.step_alone_ms, record.samples, True)
    say("measuring " + ", ".join(kinds) + " under compute")
    # A chain of 32 blocks of 4 KiB (what a collective costs the training thread), and chains
    # of 4 blocks up to the whole gradient (what bytes cost).
    sizes, parts = probe_sizes(sum(t.nbytes for t in prof.tensors), job.profiling.probe_points)
    probe = Trainee("probe", "local", job.model, batch, dev, job.profiling.optimizer, rank=rank)
    # On the runtime's channel, each size as a chain of blocks, as training sends it.
    issuers, _ = block_issuers(None, dev, ("all-reduce", *kinds))
    got: dict[str, Any] = {}
    tiny = torch.zeros(1, device=dev)
    sync = issuers["all-reduce"]

    def end_everywhere() -> Any:
        return sync(tiny)

    for kind in kinds:
        # A reduce-scatter or all-gather chain ends once every rank has its part (a 4-byte
        # all-reduce after it).
        issue = issuers[kind] if kind == "all-reduce" else as_block(kind, issuers[kind], world)
        tail = None if kind == "all-reduce" else end_everywhere
        got[kind] = comm_under_compute(probe.iteration, sizes, job.profiling.probe_repeats,
                                       device=dev, issue=issue, parts=parts, tail=tail)
    del issuers, probe
    shard = {k: tuple(got[k].samples) for k in ("reduce-scatter", "all-gather") if k in got}
    if record is not None:
        ar: Any = record
        samples = record.samples
    else:
        ar = got["all-reduce"]
        samples = tuple(ar.samples)
    comm = loaded_comm(prof.comm, samples, shard.get("reduce-scatter", ()),
                       shard.get("all-gather", ()))
    return LoadedComm(comm, ar.cpu_ms_per_mb, ar.cpu_ms_per_block, ar.step_alone_ms, samples,
                      record is not None)


def as_block(kind: str, issue: Callable[..., Any], world: int) -> Callable[[Any], Any]:
    """A reduce-scatter or all-gather issuer (``issue(output, input)``) as a one-argument
    issuer of a whole block ``x`` (what :func:`~usbyte_opt.profiler.probe.comm_under_compute`
    chains): the reduce-scatter of ``x`` into a fresh shard, or the all-gather of a shard of
    ``x`` into a fresh block (its first ``world`` multiple of elements either way); the work
    holds its buffers."""
    import torch

    def issue_block(x: Any) -> Any:
        n = x.numel() // world * world
        if kind == "reduce-scatter":
            return issue(torch.empty(n // world, dtype=x.dtype, device=x.device), x[:n])
        return issue(torch.empty(n, dtype=x.dtype, device=x.device), x[:n // world])
    return issue_block


def _plan_everywhere(job: Job, prof: Any, rank: int, say: Callable[[str], None]) -> Planned:
    """Plan on rank 0 (writing the schedules); every rank gets the same plan, or the same
    error."""
    import torch.distributed as dist

    from ..errors import UsbyteError
    from ..formats import save_schedule

    payload: list[Any] = [None]
    if rank == 0:
        say("planning " + ", ".join(s for s in job.strategies if s != REFERENCE))
        try:
            payload[0] = plan(prof, list(job.strategies), job.time_budget_s)
            for s, sched in payload[0].schedules.items():
                save_schedule(sched, Path(job.out_dir) / "schedules" / f"{s}.json")
        except Exception as e:  # noqa: BLE001 - shared, then raised on every rank
            payload[0] = str(e) if isinstance(e, UsbyteError) else f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise UsbyteError(payload[0] if rank == 0 else f"rank 0: {payload[0]}")
    return payload[0]


def _train(job: Job, planned: Planned, dev: Any, batch: Any, rank: int,
           say: Callable[[str], None], emulate: tuple[Any, Any] | None = None,
           ) -> tuple[list[Any], dict[str, str]]:
    """Every requested strategy's trainee, trained side by side; and their trace files.
    ``emulate``: ``(spec, link)``, the emulated link every trainee's collectives occupy."""
    from . import zero2_base
    from .train import TRACED, Trainee, interleave

    out = Path(job.out_dir)
    # Rank 0 records into the output folder; the others into a folder of their own machine,
    # made when first needed and sent to rank 0 afterwards (_gather_traces): no filesystem is
    # assumed shared.
    tdir: Path | None = out / "traces" if rank == 0 else None
    opt = job.profiling.optimizer
    trainees = []
    traces: dict[str, str] = {}
    cc = job.profiling.compile   # --compile: every strategy compiled, as profiled
    for s in job.strategies:
        if s == REFERENCE:
            trainees.append(Trainee(s, "local", job.model, batch, dev, opt, rank=rank, compile=cc))
        elif s == TORCH_DDP:
            trainees.append(Trainee(s, "ddp", job.model, batch, dev, opt, rank=rank,
                                    emulate=emulate, compile=cc))
        elif s == TORCH_FSDP2:
            trainees.append(Trainee(s, "fsdp2", job.model, batch, dev, opt, rank=rank,
                                    emulate=emulate, compile=cc))
        elif s == DDP_TUNED:
            trainees.append(Trainee(s, "ddp-tuned", job.model, batch, dev, opt,
                                    planned.schedules[s], rank=rank, emulate=emulate, compile=cc))
        else:  # the runtime, in its schedule's mode (all-reduce or sharded)
            if job.trace:
                tdir = tdir or Path(tempfile.mkdtemp(prefix="usbyte-traces-"))
                traces[s] = str(tdir / f"{s}.measured.json")
            trainees.append(Trainee(s, "runtime", job.model, batch, dev, opt,
                                    planned.schedules.get(s, s), rank=rank, verify=job.verify,
                                    trace=traces.get(s), zero_stage=2 if zero2_base(s) else 1,
                                    emulate=emulate, compile=cc))
    say(f"training {len(trainees)} ways, {job.iterations} timed iterations each")
    from ..verdict import Budget

    least = max(1, min(job.rounds, job.iterations))   # the rounds interleave() takes
    budget = (Budget(min_pairs=least, max_pairs=job.max_rounds, max_s=job.max_train_s)
              if job.max_rounds > least else None)
    interleave(trainees, job.iterations, job.rounds, job.warmup, dev,
               first_warmup=job.first_warmup, progress=say,
               traced=min(TRACED, job.iterations) if job.trace else 0,
               against=TORCH_DDP, budget=budget, link=_link_counter(job))
    return trainees, traces


def _link_counter(job: Job) -> Callable[[], int] | None:
    """The byte counter of this node's lab link (``job.link``), read by the first rank of
    each node only (the node's ranks share the link); ``None`` elsewhere."""
    from .netlab import tx_bytes

    if job.link is None or int(os.environ.get("LOCAL_RANK", "0")) != 0 \
            or tx_bytes(job.link) is None:
        return None
    name = job.link
    return lambda: tx_bytes(name) or 0


def _gather_traces(traces: dict[str, str], rank: int, world: int) -> None:
    """Every rank's measured trace files, sent to rank 0 over the process group and written
    there beside its own (``<strategy>.measured.rank<r>.json``); the other ranks' local
    copies are removed."""
    import shutil

    import torch.distributed as dist

    from ..runtime.trace import path_for_rank

    mine: dict[str, str] = {}
    for s, path in traces.items():
        p = Path(path_for_rank(path, rank))
        try:
            mine[s] = p.read_text()
        except OSError:
            continue   # nothing recorded (a trainee that settled on DDP's buckets, say)
    every: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, every if rank == 0 else None, dst=0)
    if rank != 0:
        if traces:
            from ..runtime import trace as trace_mod

            folder = Path(next(iter(traces.values()))).parent
            for rec in list(trace_mod._recorders):   # sent: not to be written again at exit
                if Path(rec.path).parent == folder:
                    rec.records.clear()
            shutil.rmtree(folder, ignore_errors=True)
        return
    for r, docs in enumerate(every):
        if r == 0 or not docs:
            continue
        for s, text in docs.items():
            if s in traces:
                target = Path(path_for_rank(traces[s], r))
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(target)


def _gather(trainees: list[Any], world: int) -> tuple[Any, list[Any]]:
    """Correctness against the reference (DDP, else the first runtime strategy, else FSDP2),
    then every rank's timings and optimizer-state bytes to every rank: the reference and the
    ranks' outcomes."""
    import torch.distributed as dist

    ref = next((t for t in trainees if t.kind == "ddp"), None)
    ref = ref or next((t for t in trainees if t.kind == "runtime"), None)
    ref = ref or next((t for t in trainees if t.kind == "fsdp2"), None)
    ref_params = ref.parameters() if ref is not None else None
    mine = {}
    counted = [t.link_iterations > 0 for t in trainees]
    for t in trainees:
        diff = None
        if ref_params is not None and t.kind != "local" and t is not ref:
            # absolute below magnitude 1, relative above (as allclose with atol = rtol)
            diff = float(((t.parameters() - ref_params).abs()
                          / ref_params.abs().clamp(min=1.0)).max())
        elif t is ref:
            diff = 0.0
        mine[t.name] = {"durations_ms": t.durations_ms, "windows_ms": t.windows_ms,
                        "losses": t.losses, "steps": t.steps,
                        "max_param_diff": diff, "runtime": t.report(),
                        "state_bytes": t.state_bytes(),
                        # this node's link, counted by its first rank (None: not counted here)
                        "link_bytes": t.link_bytes if any(counted) else None,
                        "link_iterations": t.link_iterations}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return ref, every


def _runs(strategies: list[str], every: list[Any], world: int, planned: Planned) -> dict[str, Any]:
    """Each strategy's run over all ranks; ``auto``'s prediction is the one the runtime made
    for the plan it settled on."""
    from ..collectives.sweep import median

    runs = {}
    for s in strategies:
        per_rank = [e[s] for e in every]
        diffs = [p["max_param_diff"] for p in per_rank if p["max_param_diff"] is not None]
        timed = per_rank
        if s == REFERENCE and world > 1:
            # Without communication the ranks are not coupled: the slowest rank's iterations,
            # the compute the profile states (its slowest rank's median: every collective
            # waits for that rank), where the mean over ranks would read the faster one's too.
            timed = [max(per_rank, key=lambda p: median(p["durations_ms"]) if p["durations_ms"] else 0.0)]
        k = len(timed)
        n = min(len(p["durations_ms"]) for p in timed)
        # One number per iteration: the mean over ranks (they are coupled by the collectives).
        durations = [sum(p["durations_ms"][i] for p in timed) / k for i in range(n)]
        # One number per window (turn): its median on each rank, mean over ranks, as the
        # comparisons in training took it (the pairs of usbyte_opt.verdict).
        w = min(len(p["windows_ms"]) for p in timed)
        windows = [sum(median(p["windows_ms"][i]) for p in timed) / k for i in range(w)]
        runs[s] = {"durations_ms": durations,
                   "windows_ms": windows,
                   "durations_by_rank_ms": [p["durations_ms"] for p in per_rank],
                   "final_loss": per_rank[0]["losses"][-1] if per_rank[0]["losses"] else math.nan,
                   "losses_rank0": per_rank[0]["losses"],
                   "steps": per_rank[0]["steps"],
                   "max_param_diff": max(diffs) if diffs else None,
                   "state_bytes_by_rank": [p["state_bytes"] for p in per_rank],
                   "link_bytes_per_iteration": _link_per_iteration(per_rank),
                   "runtime": per_rank[0]["runtime"]}
        rt = per_rank[0]["runtime"] or {}
        pred = planned.predicted.get(s)
        if pred is not None and pred.ms is None and rt.get("predicted_ms") is not None:
            pred.ms = rt["predicted_ms"]
            pred.mode = (rt.get("plan") or {}).get("mode", "auto")
            pred.blocks = (rt.get("plan") or {}).get("blocks")
    return runs


def _link_per_iteration(per_rank: list[Any]) -> float | None:
    """Bytes sent on the lab's links per iteration, all nodes together (each node's first
    rank counted its own link); ``None`` when nothing was counted (not in the lab)."""
    counted = [p for p in per_rank if p.get("link_bytes") is not None and p.get("link_iterations")]
    if not counted:
        return None
    return sum(p["link_bytes"] / p["link_iterations"] for p in counted)


def _compute_scale(runs: dict[str, Any], planned: Planned) -> float:
    """Measured ``no-comm`` over predicted compute (1 without a reference run): the refined
    prediction's compute, recalibrated to the side-by-side run."""
    from ..collectives.sweep import median

    expect = planned.compute_ms + planned.update_ms
    if REFERENCE in runs and runs[REFERENCE]["durations_ms"] and expect > 0:
        return median(runs[REFERENCE]["durations_ms"]) / expect
    return 1.0


def _raw(job: Job, prof: Any, profile_path: str, batch: Any, world: int, dev: Any,
         planned: Planned, loaded: LoadedComm | None, runs: dict[str, Any],
         traces: dict[str, str], compute_scale: float, clock: _Clock, ref: Any) -> dict[str, Any]:
    """The ``raw.json`` document rank 0 writes."""
    import torch
    import torch.distributed as dist

    from . import EMULATED

    out = Path(job.out_dir)
    job_doc = job.to_dict()
    job_doc["profiling"].pop("comm_sizes", None)
    return {
        "job": job_doc,
        "compute_scale": compute_scale,
        "profile": profile_path,
        "profile_name": prof.name,
        "world_size": world,
        # the emulated link the one rank's collectives occupied (None: the real network)
        "emulated": prof.meta.get(EMULATED),
        "backend": str(dist.get_backend()),
        "device": dev.type,
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch": torch.__version__,
        "batch_size": batch,
        "forward_ms": prof.forward_ms,
        "backward_ms": prof.backward_ms,
        "comm": {"backend": prof.comm.backend, "alpha_ms": prof.comm.alpha_ms,
                 "algbw_gbs": prof.comm.algbw_gbs, "cpu_ms_per_block": prof.comm.cpu_ms_per_block,
                 "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
                 "samples": [list(s) for s in prof.comm.samples],
                 # the topology the profile measured: nodes, and the all-reduce lines inside a
                 # node and across nodes (several nodes of several ranks only)
                 "nodes": prof.comm.nodes,
                 **{k: {"alpha_ms": c.alpha_ms, "algbw_gbs": c.algbw_gbs}
                    for k, c in (("intra", prof.comm.intra), ("inter", prof.comm.inter))
                    if c is not None}},
        "loaded_comm": None if loaded is None else loaded.to_dict(),
        "gradient_bytes": sum(t.nbytes for t in prof.tensors),
        "tensors": len(prof.tensors),
        "planned": planned.to_dict(),
        "schedules": {s: str(out / "schedules" / f"{s}.json") for s in planned.schedules},
        "traces": traces,
        "runs": runs,
        "phases_s": dict(clock.phases),
        "reference": ref.name if ref is not None else None,
    }


def _work(job_file: str) -> None:
    run_rank(Job.load(job_file))


def main(argv: list[str] | None = None) -> int:
    """Entry point of a rank process: ``python -m usbyte_opt.bench.worker JOB.json``. A failure
    is recorded in the rank's error file for the launcher (:func:`usbyte_opt.launcher.record_rank`)
    and written to stderr (the rank's log) as one ``error:`` line."""
    from ..errors import UsbyteError, first_line
    from ..launcher import record_rank

    argv = sys.argv[1:] if argv is None else argv
    try:
        record_rank(_work)(argv[0])
    except UsbyteError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the log; traceback above it
        import traceback

        traceback.print_exc()
        sys.stderr.write(f"error: {type(e).__name__}: {first_line(e, '')}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.stderr.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the process group's thread-pool teardown
