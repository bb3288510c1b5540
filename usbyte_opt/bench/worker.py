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
3. rank 0 plans every strategy (:func:`usbyte_opt.planning.planner.compare`, so ``best`` is seeded
   with all of them) and broadcasts the schedules;
4. trains every requested strategy side by side (:func:`usbyte_opt.bench.train.interleave`);
5. compares each trainee's final parameters with the reference (DDP) and sends its timings
   to rank 0, which writes ``raw.json`` in the output folder.

Rank 0 prints progress as ``@@ <text>`` lines on stderr (the launcher shows them); a failure
is one ``error: <message>`` line and exit code 1.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _say(rank: int) -> Callable[[str], None]:
    def say(text: str) -> None:
        if rank == 0:
            sys.stderr.write(f"{PROGRESS_PREFIX}{text}\n")
            sys.stderr.flush()
    return say


def plan(profile: Any, strategies: list[str], time_budget_s: float) -> dict[str, Any]:
    """Plan every registered strategy on ``profile``; return the schedules and predictions
    of ``strategies`` (``no-comm``: forward + backward + optimizer step). Each prediction has
    the planner's ``ms`` in the ``mode`` its schedule runs in (PyTorch DDP: fence);
    :func:`refine` adds ``refined_ms`` once training has run."""
    from ..planning.planner import compare

    report = compare(profile, options={BEST: {"time_budget_s": time_budget_s}})
    out: dict[str, Any] = {"schedules": {}, "predicted": {}, "lower_bound_ms": report.lower_bound_ms,
                           "compute_ms": report.compute_ms,
                           "update_ms": sum(t.update_ms for t in profile.tensors),
                           "all": {n: {"iteration_ms": r.iteration_ms, "mode": r.mode,
                                       "overlap_ms": r.overlap_ms, "fence_ms": r.fence_ms,
                                       "blocks": r.blocks}
                                   for n, r in report.results.items()}}
    from ..env import AUTO

    for s in strategies:
        if s == REFERENCE:
            ms = out["compute_ms"] + out["update_ms"]
            out["predicted"][s] = {"ms": ms, "mode": "compute", "blocks": 0}
            continue
        if s == AUTO:  # planned inside the run; its own prediction is read after training
            out["predicted"][s] = {"ms": None, "mode": "auto", "blocks": None}
            continue
        if s not in report.results:
            from ..errors import UsbyteError

            raise UsbyteError(f"--strategies: {s}: {report.skipped.get(s, 'not planned')}")
        r = report.results[s]
        sched = report.schedule(s)
        out["schedules"][s] = sched
        out["predicted"][s] = {"ms": r.iteration_ms, "mode": r.mode, "blocks": r.blocks}
    return out


def refine(profile: Any, planned: dict[str, Any], loaded: Any = None, compute_scale: float = 1.0) -> None:
    """Set ``refined_ms`` of every prediction in ``planned`` (from :func:`plan`), in the mode
    its schedule runs in: the planner's model (with its compute-cost rule) on the all-reduce
    cost measured under compute and the measured training-thread costs (``loaded = (comm,
    cpu_ms_per_mb, cpu_ms_per_block)``, when probed), compute scaled by ``compute_scale``
    (measured ``no-comm`` over predicted: :func:`~.refine.scaled`), and in overlap mode the
    runtime's update rule (:func:`~.refine.refined_overlap`)."""
    import dataclasses

    from ..planning.problem import Problem
    from ..planning.simulate import simulate_blocks
    from .refine import refined_overlap, scaled

    base = scaled(profile, compute_scale)
    comm, per_mb, per_block = (loaded if loaded is not None else
                               (None, profile.comm.cpu_ms_per_mb, profile.comm.cpu_ms_per_block))
    comm = dataclasses.replace(comm if comm is not None else base.comm, cpu_ms_per_mb=per_mb,
                               cpu_ms_per_block=per_block)
    rp = Problem.from_profile(base.with_comm(comm))
    for s, pred in planned["predicted"].items():
        if s == REFERENCE:
            pred["refined_ms"] = (planned["compute_ms"] + planned["update_ms"]) * compute_scale
            continue
        if s not in planned["schedules"]:  # auto: no schedule known ahead
            pred["refined_ms"] = None
            continue
        sched = planned["schedules"][s]
        lay = rp.layout(sched.buffers)
        if pred["mode"] == Mode.FENCE:  # the whole step already runs on the training thread
            pred["refined_ms"] = simulate_blocks(rp, lay, sched.blocks, Mode.FENCE).iteration_ms
        else:
            pred["refined_ms"] = refined_overlap(rp, lay, sched.blocks)


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
    rank 0 returns the raw result (and writes it), the others ``None``."""
    import torch
    import torch.distributed as dist

    from ..device import resolve_device
    from ..errors import UsbyteError
    from ..formats import load_profile, save_profile, save_schedule, write_json
    from ..group import init_from_env
    from ..profiler.run import profile_model
    from ..runtime import trace as trace_mod
    from .train import TRACED, Trainee, interleave

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
        rank, world = dist.get_rank(), dist.get_world_size()
        say = _say(rank)
        out = Path(job.out_dir)
        spec = job.model
        t_start = time.perf_counter()

        # 1-2. Profile on this process group (or load one).
        if job.profile:
            prof = load_profile(job.profile)
            profile_path = job.profile
        else:
            say(f"profiling {job.name} on {world} ranks")
            last = {}

            def progress(phase: str, done: int, total: int) -> None:
                if done == total or phase not in last:
                    say(f"profile: {phase} {done}/{total}")
                last[phase] = done

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof = profile_model(spec, job.batch_size, name=job.name, device=dev,
                                     warmup=job.profile_warmup, repeats=job.profile_repeats,
                                     optimizer=job.optimizer, comm_sizes=job.comm_sizes,
                                     comm_repeats=job.comm_repeats, cpu_probe=job.probe,
                                     progress=progress, stable_s=job.stable_s)
            profile_path = str(out / "profile.json")
            if rank == 0:
                save_profile(prof, profile_path)
        t_profile = time.perf_counter() - t_start

        # 2b. All-reduce cost while the training thread computes (for the refined prediction).
        batch = prof.meta.get("batch_size") if job.batch_size is None else job.batch_size
        loaded = None
        probe_samples: list[Any] = []
        step_alone: float | None = None
        record = prof.meta.get("cpu_probe") if isinstance(prof.meta, dict) else None
        if isinstance(record, dict) and world > 1:
            # The profiler measured it (usbyte_opt.profiler.probe): the same probe, reused.
            from .refine import loaded_comm

            probe_samples = [(int(x["bytes"]), float(x["ms"])) for x in record["samples"]]
            loaded = (loaded_comm(prof.comm, probe_samples), float(record["cpu_ms_per_mb"]),
                      float(record["cpu_ms_per_block"]))
            step_alone = record.get("step_alone_ms")
        elif job.probe and world > 1:
            from ..collectives.issuers import block_issuer
            from ..profiler.probe import comm_under_compute, probe_sizes
            from .refine import loaded_comm

            say("measuring all-reduce under compute")
            # A chain of 32 blocks of 4 KiB (what a collective costs the training thread), and
            # chains of 4 blocks up to the whole gradient (what bytes cost).
            sizes, parts = probe_sizes(sum(t.nbytes for t in prof.tensors),
                                       job.probe_points)
            probe = Trainee("probe", "local", spec, batch, dev, job.optimizer, rank=rank)
            # On the runtime's channel, each size as a chain of blocks, as training sends it.
            issue, _ = block_issuer(None, dev)
            probed = comm_under_compute(probe.iteration, sizes, job.probe_repeats,
                                        device=dev, issue=issue, parts=parts)
            del issue
            probe_samples = list(probed.samples)
            step_alone = probed.step_alone_ms
            loaded = (loaded_comm(prof.comm, probe_samples), probed.cpu_ms_per_mb,
                      probed.cpu_ms_per_block)
            del probe
        t_probe = time.perf_counter() - t_start - t_profile

        # 3. Plan on rank 0; every rank gets the same schedules.
        strategies = list(job.strategies)
        payload: list[Any] = [None]
        if rank == 0:
            say("planning " + ", ".join(s for s in strategies if s != REFERENCE))
            try:
                payload[0] = plan(prof, strategies, job.time_budget_s)
                for s, sched in payload[0]["schedules"].items():
                    save_schedule(sched, out / "schedules" / f"{s}.json")
            except Exception as e:  # noqa: BLE001 - shared, then raised on every rank
                payload[0] = {"error": f"{type(e).__name__}: {e}" if not isinstance(e, UsbyteError)
                              else str(e)}
        dist.broadcast_object_list(payload, src=0)
        planned = payload[0]
        if "error" in planned:
            raise UsbyteError(planned["error"] if rank == 0 else f"rank 0: {planned['error']}")
        t_plan = time.perf_counter() - t_start - t_profile - t_probe

        # 4. Train side by side.
        trainees = []
        traces: dict[str, str] = {}
        for s in strategies:
            if s == REFERENCE:
                trainees.append(Trainee(s, "local", spec, batch, dev, job.optimizer, rank=rank))
            elif s == TORCH_DDP:
                trainees.append(Trainee(s, "ddp", spec, batch, dev, job.optimizer, rank=rank))
            elif s == DDP_TUNED:
                trainees.append(Trainee(s, "ddp-tuned", spec, batch, dev, job.optimizer,
                                        planned["schedules"][s], rank=rank))
            else:
                if job.trace:
                    traces[s] = str(out / "traces" / f"{s}.measured.json")
                trainees.append(Trainee(s, "runtime", spec, batch, dev, job.optimizer,
                                        planned["schedules"].get(s, s), rank=rank,
                                        verify=job.verify, trace=traces.get(s)))
        say(f"training {len(trainees)} ways, {job.iterations} timed iterations each")
        interleave(trainees, job.iterations, job.rounds, job.warmup, dev,
                   first_warmup=job.first_warmup, progress=say,
                   traced=min(TRACED, job.iterations) if job.trace else 0)
        t_train = time.perf_counter() - t_start - t_profile - t_probe - t_plan
        if job.trace:
            trace_mod.flush_all()

        # 5. Correctness against the reference, then everything to rank 0.
        ref = next((t for t in trainees if t.kind == "ddp"), None)
        ref = ref or next((t for t in trainees if t.kind == "runtime"), None)
        ref_params = ref.parameters() if ref is not None else None
        mine = {}
        for t in trainees:
            diff = None
            if ref_params is not None and t.kind != "local" and t is not ref:
                # absolute below magnitude 1, relative above (as allclose with atol = rtol)
                diff = float(((t.parameters() - ref_params).abs()
                              / ref_params.abs().clamp(min=1.0)).max())
            elif t is ref:
                diff = 0.0
            mine[t.name] = {"durations_ms": t.durations_ms, "losses": t.losses,
                            "steps": t.steps, "max_param_diff": diff,
                            "runtime": t.report()}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank != 0:
            return None
        runs = {}
        for s in strategies:
            per_rank = [e[s] for e in every]
            n = min(len(p["durations_ms"]) for p in per_rank)
            # One number per iteration: the mean over ranks (they are coupled by the collectives).
            durations = [sum(p["durations_ms"][i] for p in per_rank) / world for i in range(n)]
            diffs = [p["max_param_diff"] for p in per_rank if p["max_param_diff"] is not None]
            runs[s] = {"durations_ms": durations,
                       "durations_by_rank_ms": [p["durations_ms"] for p in per_rank],
                       "final_loss": per_rank[0]["losses"][-1] if per_rank[0]["losses"] else math.nan,
                       "losses_rank0": per_rank[0]["losses"],
                       "steps": per_rank[0]["steps"],
                       "max_param_diff": max(diffs) if diffs else None,
                       "runtime": per_rank[0]["runtime"]}
            rt = per_rank[0]["runtime"] or {}
            pred = planned["predicted"].get(s)
            if pred is not None and pred["ms"] is None and rt.get("predicted_ms") is not None:
                # auto: the prediction the runtime made for the plan it settled on
                pred.update(ms=rt["predicted_ms"], mode=(rt.get("plan") or {}).get("mode", "auto"),
                            blocks=(rt.get("plan") or {}).get("blocks"))
        # The refined prediction, with compute recalibrated to the side-by-side no-comm run.
        compute_scale = 1.0
        if REFERENCE in runs and runs[REFERENCE]["durations_ms"]:
            from ..collectives.sweep import median

            expect = planned["compute_ms"] + planned["update_ms"]
            if expect > 0:
                compute_scale = median(runs[REFERENCE]["durations_ms"]) / expect
        refine(prof, planned, loaded, compute_scale)
        raw = {
            "job": {k: v for k, v in job.to_dict().items() if k != "comm_sizes"},
            "compute_scale": compute_scale,
            "profile": profile_path,
            "profile_name": prof.name,
            "world_size": world,
            "backend": str(dist.get_backend()),
            "device": dev.type,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "batch_size": batch,
            "forward_ms": prof.forward_ms,
            "backward_ms": prof.backward_ms,
            "comm": {"backend": prof.comm.backend, "alpha_ms": prof.comm.alpha_ms,
                     "algbw_gbs": prof.comm.algbw_gbs, "cpu_ms_per_block": prof.comm.cpu_ms_per_block,
                     "cpu_ms_per_mb": prof.comm.cpu_ms_per_mb,
                     "samples": [list(s) for s in prof.comm.samples]},
            "loaded_comm": None if loaded is None else {
                "alpha_ms": loaded[0].alpha_ms, "algbw_gbs": loaded[0].algbw_gbs,
                "cpu_ms_per_mb": loaded[1], "cpu_ms_per_block": loaded[2],
                "step_alone_ms": step_alone,
                "source": "profile (meta.cpu_probe)" if isinstance(record, dict) else "bench probe",
                "samples": [list(x) for x in probe_samples],
                "method": "chains of blocks on the runtime's channel, issued after a barrier "
                          "while training iterations run; issue to completion of the last, "
                          "minimum over ranks, median of repeats, per block"},
            "gradient_bytes": sum(t.nbytes for t in prof.tensors),
            "tensors": len(prof.tensors),
            "planned": {"lower_bound_ms": planned["lower_bound_ms"], "compute_ms": planned["compute_ms"],
                        "update_ms": planned["update_ms"], "all": planned["all"],
                        "predicted": planned["predicted"]},
            "schedules": {s: str(out / "schedules" / f"{s}.json") for s in planned["schedules"]},
            "traces": traces,
            "runs": runs,
            "phases_s": {"profile": t_profile, "probe": t_probe, "plan": t_plan, "train": t_train},
            "reference": ref.name if ref is not None else None,
        }
        write_json(out / "raw.json", raw)
        return raw
    finally:
        if owns and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group after a failure
                pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of a rank process: ``python -m usbyte_opt.bench.worker JOB.json``."""
    from ..errors import UsbyteError

    argv = sys.argv[1:] if argv is None else argv
    try:
        run_rank(Job.load(argv[0]))
    except UsbyteError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the launcher; traceback above it
        import traceback

        traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        sys.stderr.write(f"error: {type(e).__name__}: {first}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.stderr.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the process group's thread-pool teardown
