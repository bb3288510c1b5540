"""The one rule of the trainer integrations: which path a schedule runs on, and the log line."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from ..env import AUTO
from ..errors import UsbyteError
from ..formats import Mode, Schedule, load_schedule

#: The integrations' logger.
log = logging.getLogger("usbyte_opt.integrations")


@dataclass(frozen=True)
class Route:
    """Where a trainer runs a schedule.

    Attributes:
        path: ``"ddp"`` (the trainer's own DDP with the planned buckets) or ``"runtime"``
            (the usbyte-opt runtime on the plain model).
        schedule: the schedule, or ``None`` with ``schedule="auto"`` (planned in the run) or
            none at all (the runtime's DDP-like default plan).
        source: where the schedule came from (a path, ``auto`` or ``<default schedule>``).
        why_runtime: why stock DDP cannot express the schedule ('' on the DDP path).
    """

    path: Literal["ddp", "runtime"]
    schedule: Schedule | None
    source: str
    why_runtime: str = ""

    @property
    def runtime_schedule(self) -> Schedule | str | None:
        """What to give :class:`~usbyte_opt.runtime.DistributedOptimizer` as ``schedule``."""
        if self.schedule is not None:
            return self.schedule
        return AUTO if self.source == AUTO else None

    def describe(self, trainer: str) -> str:
        """The run's one line: which path, with what."""
        if self.path == "ddp":
            assert self.schedule is not None
            n = len(self.schedule.blocks)
            return (f"usbyte-opt ({trainer}): stock DistributedDataParallel with the schedule's "
                    f"{n} planned bucket{'s' if n != 1 else ''} ({self.source}, "
                    f"{self.schedule.strategy})")
        if self.schedule is None:
            what = ("planning in the run (schedule auto)" if self.source == AUTO
                    else "its DDP-like default plan (no schedule given)")
            return f"usbyte-opt ({trainer}): the usbyte-opt runtime, {what}"
        n = len(self.schedule.blocks)
        why = self.why_runtime.split("; plan with")[0]
        line = (f"usbyte-opt ({trainer}): the usbyte-opt runtime, {n} block{'s' if n != 1 else ''}"
                f" in {self.schedule.mode} mode ({self.source}, {self.schedule.strategy}); stock "
                f"DDP cannot run it: {why}")
        if self.schedule.mode == Mode.OVERLAP:
            line += ("; the trainer waits for the averaged gradients after backward, so no "
                     "block overlaps the next forward here: `usbyte-opt optimize --mode fence` "
                     "plans for that")
        return line


def resolve(schedule: Schedule | str | os.PathLike | None) -> Route:
    """Decide the path of ``schedule``: a :class:`~usbyte_opt.formats.Schedule`, a path,
    ``"auto"``, or ``None`` (then ``$USBYTE_SCHEDULE``, as ``usbyte-opt launch`` sets it; unset:
    the runtime's default plan).

    Raises:
        FormatError: the schedule file is missing or malformed.
        UsbyteError: a sharded schedule (trainers read and clip ``p.grad`` after backward,
            which sharded mode does not keep, and checkpoint its optimizer on rank 0 only).

    Example::

        >>> import dataclasses, torch
        >>> from usbyte_opt.runtime import default_schedule
        >>> s = default_schedule(torch.nn.Linear(4, 4))          # overlap mode
        >>> resolve(s).path, resolve(dataclasses.replace(s, mode="fence")).path
        ('runtime', 'ddp')
    """
    from ..ddp import expressible
    from ..runtime.start import requested

    schedule = requested(schedule).schedule
    if schedule is None:
        return Route("runtime", None, "<default schedule>", "no schedule given")
    if isinstance(schedule, str) and schedule == AUTO:
        return Route("runtime", None, AUTO, "schedule auto is planned in the run")
    if isinstance(schedule, Schedule):
        from ..runtime.checks import schedule_source

        sched, source = schedule, schedule_source(schedule)
    else:
        sched, source = load_schedule(schedule), str(schedule)
    if sched.mode is Mode.SHARDED:
        raise UsbyteError(f"{source}: mode: expected overlap or fence in a trainer, got sharded "
                          "(sharded mode keeps no averaged p.grad and gathers its optimizer state "
                          "on every rank; run it with DistributedOptimizer in your own loop)")
    why = expressible(sched)
    return Route("runtime" if why else "ddp", sched, source, why)


def runtime_kwargs(options: dict[str, Any], trainer: str) -> dict[str, Any]:
    """The runtime's options for a trainer: the user's ``options`` (any keyword argument of
    :class:`~usbyte_opt.runtime.DistributedOptimizer` but ``schedule`` and
    ``process_group``) with ``wait_in_backward=True``, since trainers read and clip ``p.grad``
    right after ``backward()``; ``wait_in_backward=False`` is refused for that reason.

    Example::

        >>> runtime_kwargs({"check_every": 0}, "Lightning")
        {'check_every': 0, 'wait_in_backward': True}
    """
    import inspect

    from ..runtime import DistributedOptimizer

    allowed = set(inspect.signature(DistributedOptimizer.__init__).parameters) - {
        "self", "optimizer", "model", "schedule", "process_group"}
    for key in options:
        if key not in allowed:
            raise UsbyteError(f"{trainer}: runtime option {key!r}: expected one of "
                              f"{', '.join(sorted(allowed))}")
    if options.get("wait_in_backward") is False:
        raise UsbyteError(f"{trainer}: wait_in_backward=False: the trainer reads and clips "
                          "p.grad right after backward(), which must then hold the averaged "
                          "gradients")
    return {**options, "wait_in_backward": True}


def report_skipped_steps(accelerated: Any) -> None:
    """Make Accelerate's ``AcceleratedOptimizer`` around a
    :class:`~usbyte_opt.runtime.DistributedOptimizer` report the steps ``GradScaler`` skips
    (``step_was_skipped``, ``Accelerator.optimizer_step_was_skipped``) as it reports them for
    the plain optimizer under DDP.

    With a scaler, ``AcceleratedOptimizer.step()`` calls ``scaler.step(optimizer)`` with the
    optimizer's ``step`` patched to note that it ran: the scaler never calls a plain
    optimizer's ``step()`` on an fp16 overflow, so the note is missing and
    ``step_was_skipped`` is true; the Hugging Face Trainer then leaves its LR scheduler alone,
    and a prepared ``AcceleratedScheduler`` does not step. The runtime's ``step()`` is called
    on every step (it sets ``_step_supports_amp_scaling``, so the scaler hands it ``found_inf``
    and it skips the update itself): here the note is made only when ``found_inf`` is zero.
    A wrapped optimizer that takes ``found_inf`` itself (a fused one) is called by the scaler
    on every step under DDP too, and its steps are never reported skipped, as there.
    Nothing without a scaler (fp32, bf16)."""
    if getattr(accelerated, "scaler", None) is None:
        return
    runtime = accelerated.optimizer
    step = getattr(accelerated, "_optimizer_original_step_method", runtime.step)
    fused = bool(getattr(runtime.optimizer, "_step_supports_amp_scaling", False))

    def noting_step(*args: Any, **kwargs: Any) -> Any:
        found_inf = vars(runtime).get("found_inf")   # set by GradScaler.step() for this call
        skipped = found_inf is not None and not fused and float(found_inf) > 0
        out = step(*args, **kwargs)
        if not skipped:
            accelerated._accelerate_step_called = True
        return out

    accelerated._optimizer_patched_step_method = noting_step


def log_plan(plan: Route, trainer: str, rank: int) -> None:
    """Say which path the run uses: the run's start line on rank 0's stderr
    (:mod:`usbyte_opt.voice`; and to the ``usbyte_opt.integrations`` logger at
    INFO)."""
    if rank != 0:
        return
    from .. import voice

    line = plan.describe(trainer)
    log.info(line)
    voice.start(line, rank, under_launch=True, each=True)
    if plan.path == "ddp":   # (on the runtime path the optimizer says what it did)
        assert plan.schedule is not None
        n = len(plan.schedule.blocks)
        voice.closing(lambda: f"usbyte-opt ({trainer}): stock DistributedDataParallel ran with "
                              f"the schedule's {n} planned bucket{'s' if n != 1 else ''}", rank)
