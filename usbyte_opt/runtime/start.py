"""The runtime's front door: what was asked for, and the start-up that checks it, in one place.

:func:`requested` is the one reader of ``$USBYTE_SCHEDULE`` (what ``usbyte-opt launch``
sets): :class:`~usbyte_opt.runtime.DistributedOptimizer`, the
:class:`~usbyte_opt.DistributedDataParallel` wrapper and the trainer integrations all ask it
what schedule was requested, and whether one was at all. :func:`start_up` then runs every
start-up check once, on every rank alike (docs/design.md §5.1): the local checks (a model
with trainable parameters on one device, the schedule read and matched against the model,
hierarchical blocks against the world, the optimizer's parameters, sharded mode and
``zero_stage``), their outcome shared by one all-gather so that no rank hangs, the world size,
then rank 0's parameters and buffers broadcast. It returns what the runtime needs
(:class:`Start`).

Example (one rank)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> from usbyte_opt.runtime import default_schedule
    >>> model = torch.nn.Linear(4, 2)
    >>> req = requested(default_schedule(model))
    >>> req.given, req.auto
    (True, False)
    >>> st = start_up(torch.optim.SGD(model.parameters(), lr=0.1), model, req, None)
    >>> st.source, st.schedule.strategy, st.zero_stage, [n for n, _ in st.params]
    ('<default schedule>', 'default', 1, ['weight', 'bias'])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.agree import agree
from ..env import AUTO, SCHEDULE_ENV
from ..errors import UsbyteError
from ..formats import Mode, Schedule
from .checks import (
    broadcast_from_rank0,
    check_hierarchy,
    check_model,
    check_not_wrapped,
    check_world_size,
    require_initialized,
    resolve_schedule,
    whole_world,
)
from .default_plan import fallback_schedule, model_tensors, trainable_parameters
from .semantics import check_module, module_buffers
from .sharded import check_sharded

ScheduleArg = Schedule | str | os.PathLike | None


@dataclass(frozen=True)
class Request:
    """The schedule asked for, the environment read.

    Attributes:
        schedule: a :class:`~usbyte_opt.formats.Schedule`, a file, :data:`~usbyte_opt.env.AUTO`,
            or ``None`` (none asked for).
        given: a schedule was asked for (argument or ``$USBYTE_SCHEDULE``).
        auto: planned inside the run (``"auto"``).
    """

    schedule: ScheduleArg
    given: bool
    auto: bool


def requested(schedule: ScheduleArg = None) -> Request:
    """The schedule asked for: ``schedule`` when given, else ``$USBYTE_SCHEDULE`` (the one
    place the runtime reads it).

    Example::

        >>> os.environ.pop("USBYTE_SCHEDULE", None) and None
        >>> requested(None), requested("auto").auto
        (Request(schedule=None, given=False, auto=False), True)
    """
    if schedule is None:
        schedule = os.environ.get(SCHEDULE_ENV) or None
    auto = isinstance(schedule, str) and schedule == AUTO
    return Request(schedule, schedule is not None, auto)


@dataclass(frozen=True)
class Start:
    """What :func:`start_up` found, checked on every rank: what the runtime needs.

    Attributes:
        schedule: the schedule to run first (with ``auto``: DDP's buckets, the fallback).
        source: where it came from (a file, ``<auto schedule>``, ``<default schedule>``...).
        auto: planned inside the run.
        verify: time the plan against the fallback (a schedule asked for, not sharded).
        params: the trainable parameters, by name, in the model's order.
        device: their device.
        zero_stage: 1 or 2 (ZeRO-2 only with a sharded schedule).
        rank, world_size: this rank and the group's size.
    """

    schedule: Schedule
    source: str
    auto: bool
    verify: bool
    params: list[tuple[str, torch.nn.Parameter]]
    device: torch.device
    zero_stage: int
    rank: int
    world_size: int


def start_up(optimizer: torch.optim.Optimizer, model: torch.nn.Module, request: Request,
             process_group: dist.ProcessGroup | None, *, verify: bool = True,
             wait_in_backward: bool = False, zero_stage: int = 1,
             timeout: timedelta | None = None, broadcast_buffers: bool = True) -> Start:
    """Every start-up check of the runtime, once, on every rank alike; then rank 0's
    parameters (and buffers) on every rank.

    Raises:
        UsbyteError, MismatchError, FormatError: a local check failed (on the rank that
            failed it, after sharing it, so that every rank raises).
        DistributedError: another rank failed its checks, or runs another schedule.
    """
    require_initialized()
    rank, ws = dist.get_rank(process_group), dist.get_world_size(process_group)
    schedule = fallback_schedule(model, ws) if request.auto else request.schedule
    params = trainable_parameters(model)
    device = params[0][1].device if params else torch.device("cpu")
    error: BaseException | None = None
    sched: Schedule | None = None
    source = "<schedule>"
    try:   # an error is held back and shared below, so that no rank hangs
        sched, source = _local_checks(optimizer, model, schedule, params, ws, rank,
                                      process_group, wait_in_backward, zero_stage, request.auto)
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = e
    agree(process_group, None if sched is None else sched.digest(), error, device, timeout)
    assert sched is not None
    check_world_size(sched, ws, rank)
    broadcast_from_rank0([p.detach() for p in model.parameters()], process_group, timeout)
    if broadcast_buffers:
        broadcast_from_rank0(module_buffers(model), process_group, timeout, "buffers")
    verify = verify and request.given and sched.mode != Mode.SHARDED
    return Start(sched, source, request.auto, verify, params, device, zero_stage, rank, ws)


def _local_checks(optimizer: torch.optim.Optimizer, model: torch.nn.Module, schedule: Any,
                  params: list[tuple[str, torch.nn.Parameter]], ws: int, rank: int,
                  process_group: dist.ProcessGroup | None, wait_in_backward: bool,
                  zero_stage: int, auto: bool) -> tuple[Schedule, str]:
    """This rank's checks: the schedule read and matched against the model and the world."""
    if not params:
        raise UsbyteError(f"model {type(model).__name__}: no parameter requires grad")
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise UsbyteError(f"trainable parameters live on {len(devices)} devices "
                          f"({', '.join(sorted(map(str, devices)))}); expected one "
                          "device per rank")
    sched, source = resolve_schedule(schedule, model, ws, warn=rank == 0)
    check_not_wrapped(model)
    check_module(model)
    check_model(sched, model_tensors(model), source)
    check_hierarchy(sched, ws, source, whole_world=whole_world(process_group))
    check_optimizer(optimizer, model)
    if sched.mode == Mode.SHARDED:
        check_sharded(optimizer, sched, wait_in_backward=wait_in_backward)
    elif zero_stage == 2:
        what = 'schedule="auto" plans' if auto else f"{source} is"
        raise UsbyteError(f'zero_stage=2 needs a sharded schedule ("mode": "sharded"); '
                          f"{what} in {sched.mode} mode (plan one with `usbyte-opt "
                          "optimize PROFILE --shard`)")
    return sched, source


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Every parameter the optimizer holds is one of the model's (the runtime averages and
    updates only those)."""
    model_ids = {id(p) for p in model.parameters()}
    for gi, grp in enumerate(optimizer.param_groups):
        for j, p in enumerate(grp["params"]):
            if id(p) not in model_ids:
                raise UsbyteError(f"optimizer param_groups[{gi}]['params'][{j}] (shape "
                                  f"{list(p.shape)}) is not a parameter of the model: the "
                                  "runtime only averages and updates the model's parameters")
