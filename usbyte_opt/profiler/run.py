"""Profiling a model across ranks: build it, time it on every rank, sweep all-reduce,
aggregate across ranks, return a :class:`usbyte_opt.formats.Profile`.

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

import dataclasses
import datetime as _dt
import math
import platform
import socket
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import __version__
from ..collectives.agree import agree
from ..collectives.issuers import backend_for, block_issuer
from ..collectives.sweep import analytic_comm, default_sizes, fit_comm, sweep_allreduce
from ..device import resolve_device
from ..errors import UsbyteError
from ..formats import COMM_BACKENDS, DTYPE_SIZES, Profile, TensorSpec
from ..group import barrier
from ..models import Factory, build, model_name, resolve
from ..planning.cost import fit_samples
from .optimizers import OPTIMIZERS, make_optimizer
from .timing import IterationTimer, Progress, summarize


class ProfileWarning(UserWarning):
    """Something the user should know about a profile (e.g. analytic comm at world size 1)."""


def _r(x: float) -> float:
    return round(float(x), 6)  # ns resolution: keeps distinct ready times distinct


def profile_model(model: str | Factory, batch_size: int | None = None, *, name: str | None = None,
                  device: str | torch.device | None = None, warmup: int = 3, repeats: int = 10,
                  optimizer: str = "sgd", comm_sizes: Sequence[int] | None = None,
                  comm_repeats: int = 5, alpha_ms: float | None = None, algbw_gbs: float | None = None,
                  cpu_probe: bool = True, group: Any = None,
                  progress: Progress | None = None, stable_s: float | None = None) -> Profile:
    """Profile ``model`` on this rank and, when a process group is initialised, on all ranks.

    Every rank of ``group`` must call this with the same arguments (it runs collectives).
    Without a process group (or at world size 1) the communication settings are analytic
    (:func:`usbyte_opt.collectives.sweep.analytic_comm`, overridable with ``alpha_ms`` /
    ``algbw_gbs``) and a :class:`ProfileWarning` is issued. Nothing is printed or written.

    Args:
        model: a built-in name, ``package.module:factory`` or a factory callable
            (see :mod:`usbyte_opt.models` for the protocol).
        batch_size: per-rank batch size; ``None`` takes the model's default.
        name: the profile's name; default from the model spec.
        device: ``"cpu"`` or ``"cuda"``; default CUDA when available.
        warmup: untimed iterations after the discovery pass.
        repeats: timed iterations (medians are taken over them).
        optimizer: ``sgd`` (momentum), ``adam`` or ``adamw``: whose step gives ``update_ms``.
        comm_sizes: all-reduce sizes in bytes; default 12 log-spaced from 4 KiB to 64 MiB.
        comm_repeats: timed all-reduces per size.
        alpha_ms, algbw_gbs: analytic settings at world size 1 (ignored when measured).
        cpu_probe: with more than one rank, also measure what all-reduce costs the training
            thread (:mod:`usbyte_opt.profiler.probe`: chains of blocks on the runtime's
            channel beside training iterations) into ``comm.cpu_ms_per_block`` and
            ``comm.cpu_ms_per_mb``, the planner's compute-cost option; samples in
            ``meta.cpu_probe``.
        group: process group; default the world.
        progress: ``progress(phase, done, total)`` after each step, for a progress bar.
        stable_s: time cap (seconds) of the extra rounds that the all-reduce sweep and the
            probe each add until their numbers are stable; default :data:`STABLE_S`.

    Returns:
        The profile, identical on every rank.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     p = profile_model("mlp", batch_size=4, warmup=1, repeats=2)
        >>> len(p.tensors), p.comm.backend, p.meta["world_size"]
        (8, 'analytic', 1)
        >>> all(0 <= t.ready_ms <= p.backward_ms and 0 <= t.need_ms <= p.forward_ms for t in p.tensors)
        True

    Under ``torchrun`` (or inside any initialised process group) call it on every rank::

        >>> dist.init_process_group("gloo")                # doctest: +SKIP
        >>> p = profile_model("cnn", batch_size=16)        # doctest: +SKIP
        >>> if dist.get_rank() == 0: save_profile(p, "profiles/cnn.json")  # doctest: +SKIP
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    dev = resolve_device(device)
    label = model if isinstance(model, str) else model_name(model)
    if optimizer not in OPTIMIZERS:
        raise UsbyteError(f"--optimizer: expected one of {'|'.join(OPTIMIZERS)}, got {optimizer!r}")

    # 1. Build (every rank agrees that it worked before the first timed collective).
    error: UsbyteError | None = None
    try:
        net, inputs, loss_fn = build(model, batch_size, dev)
    except UsbyteError as e:
        error = e
    if world > 1:
        agree(group, None, error, dev, None)
    elif error is not None:
        raise error
    batch = batch_size if batch_size is not None else resolve(model)[1]
    backend = backend_for(group, dev) if world > 1 else "none"

    # 2. Time forward/backward/step with hooks.
    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        barrier(group, dev, backend)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
    timer = IterationTimer(net, inputs, loss_fn, opt, dev, sync=sync if world > 1 else None, label=label)
    timings = timer.run(warmup, repeats, progress)
    s = summarize(timings)

    # 3. Every rank's medians to every rank; the slowest rank sets each number.
    mine = {"F": s.forward_ms, "B": s.backward_ms, "step": s.step_ms, "ready": s.ready_ms,
            "need": s.need_ms, "update": s.update_ms, "spread": s.spread, "host": socket.gethostname(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if world > 1:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine, group=group)
    else:
        every = [mine]
    F = max(r["F"] for r in every)
    B = max(r["B"] for r in every)
    ready = [max(v) for v in zip(*(r["ready"] for r in every))]
    need = [max(v) for v in zip(*(r["need"] for r in every))]
    update = [max(v) for v in zip(*(r["update"] for r in every))]

    # 4. Communication.
    notes: list[str] = []
    probe_record: dict[str, Any] | None = None
    if world > 1:
        sizes = list(comm_sizes) if comm_sizes else default_sizes()
        # The channel the runtime's blocks take (on gloo its one-thread group), so that alpha
        # is what one more block costs there.
        issue, channel = block_issuer(group, dev)
        sweep = sweep_allreduce(sizes, comm_repeats, 1, dev, group, progress,
                                barrier=lambda: barrier(group, dev, backend), issue=issue,
                                max_seconds=STABLE_S if stable_s is None else stable_s)
        sweep.channel = channel
        # The profile format knows nccl/gloo/mpi/ucc; another backend is filed under the one
        # it stands in for on this device, and meta.backend keeps its real name.
        label_backend = backend if backend in COMM_BACKENDS else ("nccl" if dev.type == "cuda" else "gloo")
        comm, comm_record = fit_comm(sweep, label_backend, world)
        if cpu_probe:
            probe_record = _probe(net, inputs, loss_fn, opt, dev, group, issue, timings, progress,
                                  STABLE_S if stable_s is None else stable_s)
            # A block's latency while training runs (the probe's chains beside training
            # iterations), recorded, not planned with: as the planning alpha it made the
            # per-tensor strategies' predictions exact but `best` slower on lab-cnn
            # (docs/bench.md, "alpha under training").
            loaded = [(int(x["bytes"]), float(x["ms"])) for x in probe_record["samples"]]
            probe_record["alpha_ms"] = _r(fit_samples(loaded)[0]) if len(loaded) >= 2 else None
            comm = dataclasses.replace(comm, cpu_ms_per_block=probe_record["cpu_ms_per_block"],
                                       cpu_ms_per_mb=probe_record["cpu_ms_per_mb"])
        del issue
        worst = comm_record["fit"]["max_rel_error"]
        changed = _fit_changes_verdict(timings, F, B, ready, need, update, comm,
                                       comm_record["spread"]) if worst > 0.5 else ""
        if changed:
            msg = (f"all-reduce medians lie up to {100 * worst:.0f}% off the fitted line, and "
                   f"within the fit's spread the plan changes ({changed}): a shared machine or "
                   "a noisy network; rerun with more --comm-repeats, or see meta.comm_sweep")
            notes.append(msg)
            warnings.warn(msg, ProfileWarning, stacklevel=2)
    else:
        comm = analytic_comm(alpha_ms, algbw_gbs)
        comm_record = {"method": "analytic: world size 1 has no all-reduce to measure; ring of "
                                 f"{comm.world_size} workers, 25 Gbit/s, alpha {comm.alpha_ms:g} ms "
                                 "unless --alpha-ms/--algbw-gbs were given"}
        msg = (f"world size 1: no all-reduce to measure; using analytic settings for "
               f"{comm.world_size} workers (alpha {comm.alpha_ms:.3g} ms, algbw "
               f"{comm.algbw_gbs:.3g} GB/s); run under torchrun or with --nproc-per-node to measure")
        notes.append(msg)
        warnings.warn(msg, ProfileWarning, stacklevel=2)
    if timings.fallback_passes:
        msg = (f"{timings.fallback_passes} of {repeats} timed passes called modules in a different "
               "order than the first; need_ms of those passes fell back to owner pre-hooks")
        notes.append(msg)
        warnings.warn(msg, ProfileWarning, stacklevel=2)

    # 5. The profile.
    tensors = []
    for i, n in enumerate(timings.names):
        dt = timings.dtypes[i]
        if dt not in DTYPE_SIZES:
            raise UsbyteError(f"model {label!r}: trainable tensor {n!r} has dtype {dt}; expected one of "
                              + "|".join(DTYPE_SIZES))
        tensors.append(TensorSpec(n, timings.shapes[i], dt, _r(min(ready[i], B)), _r(min(need[i], F)),
                                  _r(update[i])))
    dtypes = sorted(set(timings.dtypes))
    meta = {
        "source": "usbyte-opt profile",
        "usbyte_opt": __version__,
        "model": label,
        "created": every[0]["created"],
        "device": dev.type,
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else platform.processor() or platform.machine()),
        "backend": backend,
        "torch": torch.__version__,
        "world_size": world,
        "hosts": len({r["host"] for r in every}),
        "batch_size": batch,
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "optimizer": optimizer,
        "warmup": warmup,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "timing": "CUDA events recorded in hooks" if dev.type == "cuda" else "perf_counter in hooks",
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
        "spread": every[0]["spread"] if world == 1 else {"rank0": every[0]["spread"]},
        "per_rank": [{"forward_ms": _r(r["F"]), "backward_ms": _r(r["B"]), "step_ms": _r(r["step"])}
                     for r in every],
        "step_ms": _r(max(r["step"] for r in every)),
        "comm_sweep": comm_record,
    }
    if probe_record is not None:
        meta["cpu_probe"] = probe_record
    if notes:
        meta["warnings"] = notes
    return Profile(name or model_name(model), _r(F), _r(B), tuple(tensors), comm, meta)


#: Time cap (seconds) of the extra rounds the sweep and the probe run until their numbers
#: are stable.
STABLE_S = 20.0


def _fit_changes_verdict(timings: Any, F: float, B: float, ready: Sequence[float],
                         need: Sequence[float], update: Sequence[float], comm: Any,
                         spread: dict[str, list[float]]) -> str:
    """Whether the plan ``usbyte-opt optimize`` would choose changes anywhere within the fit's
    spread (the corners of the alpha and bandwidth intervals): the best plan's mode, or
    whether it beats DDP by more than 2%. Returns a description of the change, or ""."""
    from ..planning.planner import compare

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
           timings: Any, progress: Progress | None, stable_s: float = 0.0) -> dict[str, Any]:
    """What all-reduce costs the training thread (:func:`.probe.comm_under_compute`), on the
    runtime's channel ``issue``, as the record kept in ``meta.cpu_probe``."""
    from .probe import comm_under_compute, probe_sizes

    total = sum(math.prod(shape) * DTYPE_SIZES.get(dt, 4)
                for shape, dt in zip(timings.shapes, timings.dtypes))
    sizes, parts = probe_sizes(total)
    repeats = 4

    def step() -> None:  # no host synchronize: on CUDA the probe times with events
        loss_fn(net(*inputs)).backward()
        opt.step()
        opt.zero_grad()

    if progress is not None:
        progress("all-reduce under compute", 0, 1)
    pr = comm_under_compute(step, sizes, repeats, group=group, device=dev, issue=issue, parts=parts,
                            max_seconds=stable_s)
    if progress is not None:
        progress("all-reduce under compute", 1, 1)
    return {
        "method": "chains of blocks on the runtime's channel while training iterations run; "
                  "iterations' lost time fitted to a cost per block and per MB (non-negative "
                  "least squares), max over ranks",
        "cpu_ms_per_block": _r(pr.cpu_ms_per_block),
        "cpu_ms_per_mb": _r(pr.cpu_ms_per_mb),
        "step_alone_ms": _r(pr.step_alone_ms),
        "chains": [{"bytes": b, "blocks": m} for b, m in zip(sizes, parts)],
        "repeats": repeats,
        "passes": pr.passes,
        "spread": {k: [_r(v) for v in lo_hi] for k, lo_hi in (pr.spread or {}).items()},
        "samples": [{"bytes": b, "ms": _r(ms)} for b, ms in pr.samples],
    }


__all__ = ["STABLE_S", "ProfileWarning", "profile_model"]
