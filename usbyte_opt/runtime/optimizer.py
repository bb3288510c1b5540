"""``DistributedOptimizer``: a planned all-reduce schedule applied to data-parallel training.

The protocol (docs/design.md §5, docs/runtime.md), seen from one rank:

1. **Backward.** Each gradient goes into its view of a flat buffer (:mod:`.buffers`), scaled
   by ``1 / world_size`` as it is put there; the post-accumulate-grad hook of each tensor marks
   it ready, and every block whose tensors are all ready is all-reduced (async) as soon as it
   is also its turn in the schedule's issue order, so every rank issues the same collectives
   in the same order.
2. **End of backward.** An autograd final callback (queued by the first gradient of the
   pass, as DDP's reducer does) issues the blocks not issued yet (a tensor that got no
   gradient here contributes zeros) and then the per-step usage map. So when ``backward()``
   returns, every rank has issued everything of the step, whatever parameters it used, and
   a collective of the user's own (``dist.all_reduce(loss)``) cannot interleave with them.
   With gradient accumulation, this happens at the end of the last pass of the step.
3. **step().** The iteration boundary: the hyperparameters in force are recorded (an LR
   scheduler stepping right after ``step()`` must not change this update), and every tensor
   the optimizer steps gets a *pending* update. ``p.grad`` becomes ``None``: the averaged
   gradient in the view belongs to the update now.
4. **Next forward** (overlap mode). Each tensor's update runs right before its first use:
   a forward pre-hook of each module that owns trainable tensors waits for their blocks
   (on CPU on the host; on CUDA the updates were enqueued at ``step()`` on an update stream
   and the hook makes the compute stream wait for an event), so communication of the
   input-side tensors overlaps the next forward. Pending updates the forward never reached
   run when the next backward starts, or in :meth:`DistributedOptimizer.synchronize`.
   In fence mode (``schedule.mode == Mode.FENCE``) ``step()`` waits for every block and applies
   every update at once, as DDP does. In sharded mode (``Mode.SHARDED``, ZeRO-1,
   :mod:`.sharded`) the blocks are reduce-scattered, ``step()`` steps this rank's shard of
   each block and issues the all-gathers of the parameters, and each tensor's gathered values
   are copied into it right before its first use in the next forward.

Module layout: this file holds the user-facing class and what lasts across schedules (the
wrapped optimizer, the channel, the step count); :mod:`.installed` the per-schedule state, one
object that a plan switch replaces whole; :mod:`.backward` the step's communication and its
phase; :mod:`.updates` the pending updates and the subset step; :mod:`.amp` GradScaler
support; :mod:`.exit_hook` the release of optimizers left open at exit; :mod:`.comm` the
collectives.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import voice
from ..env import COMPILED_ROUNDING_ENV, TRACE_ENV
from ..errors import UsbyteError, plural
from ..formats import Mode, Schedule
from . import amp
from .backward import Phase
from .checks import (
    wrapped_now,
)
from .comm import Channel
from .compiled import rearm
from .default_plan import fallback_schedule, uncompiled
from .exit_hook import OPEN, release_at_exit
from .installed import Installed, Options, install
from .semantics import BufferSync
from .start import ScheduleArg, requested, start_up
from .updates import GROUPS_CHANGED, STREAM_UPDATE_GROUPS, inner_step

if TYPE_CHECKING:
    from .autotune import IterationStamps, Tuner

__all__ = ["DistributedOptimizer", "release_at_exit"]


def _check_arguments(backward_passes_per_step: int, update_groups: int, zero_stage: int) -> None:
    """The integer arguments of :class:`DistributedOptimizer`, each in its range, or one
    :class:`UsbyteError` naming it."""
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise UsbyteError(f"backward_passes_per_step: expected an integer >= 1, got "
                          f"{backward_passes_per_step!r}")
    if not isinstance(update_groups, int) or update_groups < 1:
        raise UsbyteError(f"update_groups: expected an integer >= 1, got {update_groups!r}")
    if zero_stage not in (1, 2) or isinstance(zero_stage, bool):
        raise UsbyteError(f"zero_stage: expected 1 or 2, got {zero_stage!r}")


def _accept_rounding(given: bool | None) -> bool:
    """``accept_compiled_rounding`` as given, else ``$USBYTE_ACCEPT_COMPILED_ROUNDING``."""
    if given is not None:
        return bool(given)
    v = os.environ.get(COMPILED_ROUNDING_ENV, "").strip().lower()
    if v in ("", "0", "false", "no"):
        return False
    if v in ("1", "true", "yes"):
        return True
    raise UsbyteError(f"${COMPILED_ROUNDING_ENV}: expected 1 or 0, got {v!r}")


def _frozen_parameters(model: torch.nn.Module, params: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's parameters (named, each once) that are not among ``params`` (the
    ``(name, parameter)`` pairs the runtime reduces): frozen at wrapping."""
    ids = {id(p) for _, p in params}
    seen: set[int] = set()
    out: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in ids and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that gradients are averaged over ranks in a planned order.

    Use it like Horovod's: wrap, then train as usual. The model is the plain module (no DDP
    wrapper); its parameters are broadcast from rank 0 here. Communication stays in flight
    past ``backward()`` and updates past ``step()`` (in the next forward, tensor by tensor);
    **DDP's contract holds** all the same: the first read or write of a ``p.grad`` after
    backward waits for the averaged gradients, the first touch of a parameter after
    ``step()`` runs its update first, and ``p.grad`` after ``step()`` is the averaged gradient
    until ``zero_grad()``, as under DDP. What cannot be made equal is refused on every rank in
    one line. Sharded mode (``"mode": "sharded"``, ZeRO-1; ``zero_stage=2``) keeps no
    averaged ``p.grad``: its reads are refused, :meth:`clip_grad_norm_` clips the shards.
    Gradient accumulation runs as under DDP (:meth:`no_sync`, ``backward_passes_per_step``).
    A given or planned schedule is verified against DDP's buckets and kept only when
    measurably faster (``verify``); :class:`usbyte_opt.DistributedDataParallel` verifies
    against torch's DDP itself and falls back to it. The full contract, each mode and the
    options in depth: ``docs/runtime.md``.

    Args:
        optimizer: the optimizer to wrap (it keeps the parameter state).
        model: the module being trained; its trainable parameters must match the schedule.
        schedule: a :class:`~usbyte_opt.formats.Schedule`, the path of a schedule file, or
            ``"auto"`` (measure and plan inside this run: no profile needed); default: what
            ``$USBYTE_SCHEDULE`` names (a file or ``auto``), else a DDP-like default plan
            (with a warning).
        process_group: the data-parallel group (default: the whole world).
        backward_passes_per_step: backward passes per ``step()`` (gradient accumulation);
            communication starts in the last one. Passes inside :meth:`no_sync` are not
            counted as the last.
        broadcast_buffers: DDP's ``broadcast_buffers``: rank 0's module buffers at the start,
            and at the start of each forward of the model that follows one with grad enabled
            and gradient sync on (:class:`.semantics.BufferSync`).
        find_unused_parameters: exchange per-tensor usage each step so that tensors no rank
            gave a gradient are not updated. ``False`` saves that one small all-reduce per step;
            use it only when every rank produces every gradient every step.
        timeout: host-side limit of each wait on gloo (seconds or ``timedelta``); default: the
            process group's timeout. NCCL relies on its watchdog.
        one_in_flight: run the blocks' all-reduces one at a time, in schedule order, as the
            plan assumes. Default (``None``): on gloo, whose process group otherwise runs two
            collectives at once (blocks then go through a one-thread gloo group over the same
            ranks, see :mod:`usbyte_opt.runtime.comm`); NCCL serialises on its stream anyway.
            ``False`` issues blocks on ``process_group`` itself.
        update_groups: on CUDA in overlap mode, the number of optimizer calls the updates of
            one step are grouped into.
        verify: time the plan against DDP's buckets (in fence mode, as DDP) in interleaved
            windows during the first iterations and keep it only if its 95% interval says it is
            faster (:mod:`usbyte_opt.runtime.autotune`, :mod:`usbyte_opt.verdict`; every rank
            decides alike); else run DDP's buckets. Applies to a
            schedule given (argument or ``$USBYTE_SCHEDULE``) or planned (``"auto"``).
        auto_dir: with ``schedule="auto"``, where the measured profile and the planned
            schedule are written (default ``$USBYTE_AUTO_DIR``; unset: not written).
        check_every: after verification, compare the measured iteration time with the
            prediction every this many iterations (0: never); warns once when they are more
            than 15% apart.
        replan_on_drift: on that warning, plan (or verify) again.
        wait_in_backward: wait for the step's all-reduce at the end of backward, as DDP does
            (nothing in flight when ``backward()`` returns; see *DDP's contract* above).
        trace: record the measured timeline as a Chrome trace in this file (each rank but 0
            adds ``.rankN`` before the suffix, :mod:`usbyte_opt.runtime.trace`); default:
            ``$USBYTE_TRACE`` (what ``usbyte-opt launch --trace`` sets), else no trace.
        align_bytes: start every tensor of the flat buffers on a multiple of this many bytes
            (padding between tensors, all-reduced as zeros), so that each block starts there
            when the schedule cuts tensors on such multiples (the planner does for an NCCL
            profile); default 16 on CUDA, where NCCL's vectorised kernels want it, else none.
        zero_stage: with a sharded schedule, ``1`` (ZeRO-1: a flat gradient buffer kept for
            the run) or ``2`` (ZeRO-2: each block's gradient memory goes once it is
            reduce-scattered, see *Gradient access in sharded mode*); ``2`` with any other
            schedule is refused. ``opt.report()["memory"]`` gives the bytes held.
        accept_compiled_rounding: a ``torch.compile``'d model under a backend that fuses
            kernels (inductor): ``True`` compiles its graphs split at the plan's pieces, so
            blocks leave where the plan says, though a fused kernel may then round apart from
            compiled torch DDP's in the last bits (as another ``bucket_cap_mb`` would);
            ``False`` compiles them exactly as compiled torch DDP does, at DDP's buckets, and
            says so once (training stays bitwise with DDP; blocks leave as DDP's pieces end).
            Default ``$USBYTE_ACCEPT_COMPILED_ROUNDING`` (``1``), else ``False``. Under
            ``aot_eager`` the plan's pieces are bitwise with DDP's either way.

    Raises:
        MismatchError: the model does not match the schedule (names the first tensor).
        DistributedError: ranks disagree (different schedules), or a peer failed its checks.
        FormatError: the schedule file is missing or malformed.

    Example::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> from usbyte_opt.runtime import default_schedule
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model,
        ...                            schedule=default_schedule(model))
        >>> for _ in range(3):
        ...     loss = model(torch.randn(16, 4)).pow(2).mean()
        ...     loss.backward()
        ...     norm = opt.clip_grad_norm_(1.0)     # waits for the averaged gradients
        ...     opt.step(); opt.zero_grad()
        >>> opt.synchronize()          # before eval, checkpoints and at the end
        >>> opt.state_dict()["state"][0]["step"]
        tensor(3.)
        >>> dist.destroy_process_group()
    """

    # GradScaler: sets grad_scale / found_inf on us and calls step() (see usbyte_opt.runtime.amp).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 schedule: ScheduleArg = None, process_group: dist.ProcessGroup | None = None,
                 backward_passes_per_step: int = 1, *, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = True, timeout: float | timedelta | None = None,
                 one_in_flight: bool | None = None, update_groups: int = STREAM_UPDATE_GROUPS,
                 verify: bool = True, auto_dir: str | os.PathLike | None = None,
                 check_every: int = 200, replan_on_drift: bool = False,
                 wait_in_backward: bool = False, trace: str | os.PathLike | None = None,
                 align_bytes: int | None = None, zero_stage: int = 1,
                 accept_compiled_rounding: bool | None = None):
        # No super().__init__(): param_groups, state and defaults stay the wrapped optimizer's.
        model = uncompiled(model)  # torch.compile(model): the hooks go on the module it runs
        self._opt = optimizer
        self._model = model
        self._trace_path = str(trace) if trace is not None else os.environ.get(TRACE_ENV) or None
        _check_arguments(backward_passes_per_step, update_groups, zero_stage)
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        self._group = process_group
        # The front door (:mod:`.start`): what was asked for ($USBYTE_SCHEDULE read there,
        # once), every start-up check on every rank alike, rank 0's parameters everywhere.
        # A plan asked for is verified against the fallback; "auto" starts on the fallback,
        # plans in the run, then verifies.
        req = requested(schedule)
        if isinstance(optimizer, DistributedOptimizer):
            raise UsbyteError("the optimizer is already a DistributedOptimizer: wrap the plain one")
        st = start_up(optimizer, model, req, process_group, verify=verify,
                      wait_in_backward=wait_in_backward, zero_stage=zero_stage, timeout=timeout,
                      broadcast_buffers=broadcast_buffers)
        sched, source, auto, verify = st.schedule, st.source, st.auto, st.verify
        params, device, ws = st.params, st.device, st.world_size

        self._chan = Channel(process_group, device, timeout, one_in_flight)
        self._params = dict(params)
        self._device = device
        self._options = Options(backward_passes_per_step, find_unused_parameters, update_groups,
                                bool(wait_in_backward),
                                BufferSync(model, process_group, True) if broadcast_buffers
                                else None,
                                self._trace_path,
                                (16 if device.type == "cuda" else 0) if align_bytes is None
                                else int(align_bytes), zero_stage,
                                _accept_rounding(accept_compiled_rounding))
        self._last_include: Callable[[int], bool] = lambda t: False
        self._steps = 0
        #: Parameters frozen at wrapping (a gradient later means one was unfrozen).
        self._frozen = _frozen_parameters(model, params)
        self._shape: tuple[int, ...] | None = None
        self._state = self._install(sched, source)
        self._shape = self._group_shape()
        self._closed = False
        OPEN.add(self)
        #: torch DDP over the same module, run instead of the runtime on DDP's buckets
        #: whenever the fallback runs (:meth:`use_ddp_fallback`), and whether it runs now.
        self._fallback_ddp: torch.nn.Module | None = None
        self._on_ddp = False
        self._fallback_sched: Schedule | None = None
        self._tuner: Tuner | None = None
        # (Sharded mode is not verified: a switch to the fallback would have to move the
        # sharded state.)
        if auto or verify:
            self._start_tuner(sched if auto else fallback_schedule(model, ws), auto, verify,
                              auto_dir, check_every, replan_on_drift)
        voice.start(self._start_line(auto), self._chan.rank)
        voice.closing(self._final_summary, self._chan.rank)

    def _start_line(self, auto: bool) -> str:
        """The run's start line (:mod:`usbyte_opt.voice`): the schedule, runner, mode and blocks, and
        whether it is planned or verified in the run."""
        sched = self.schedule
        if auto:
            return ("schedule auto: DDP's buckets on the usbyte-opt runtime while the run is "
                    "measured, then the plan made from it")
        what = (f"{self.schedule_source} ({sched.strategy}: usbyte-opt runtime, {self.mode} mode, "
                f"{plural(len(sched.blocks), 'block')})")
        if str(sched.runner) == "ddp":
            what += ("; planned for torch DDP, run here on the usbyte-opt runtime at its own host "
                     "cost (usbyte_opt.DistributedDataParallel runs it on torch DDP)")
        tuner = self._tuner
        if tuner is not None and tuner.phase == "verify":
            what += (f"; timed against DDP's buckets in turns for at least "
                     f"{tuner.needed()} iterations (verify=False skips it)")
        return what

    def _final_summary(self) -> str:
        """The run's summary when it ends (:mod:`usbyte_opt.voice`)."""
        if self._tuner is not None:
            return self._tuner.final_summary()
        sched = self.schedule
        return (f"ran {self.schedule_source} ({sched.strategy}: usbyte-opt runtime, {self.mode} "
                f"mode, {plural(len(sched.blocks), 'block')}) for {plural(self._steps, 'step')}")

    def _start_tuner(self, fallback: Schedule, auto: bool, verify: bool,
                     auto_dir: str | os.PathLike | None, check_every: int,
                     replan_on_drift: bool) -> None:
        """The tuner that plans in the run (``auto``) and verifies a plan against
        ``fallback``; the fallback is built once (auto runs start on it): the tuner compares
        schedules by identity."""
        from .autotune import Tuner

        self._fallback_sched = fallback
        self._tuner = Tuner(_Tuned(self), fallback, auto=auto, verify=verify,
                            auto_dir=auto_dir, check_every=check_every,
                            replan_on_drift=replan_on_drift)

    def _install(self, sched: Schedule, source: str, previous: Installed | None = None) -> Installed:
        """The per-schedule state of ``sched``, its hooks installed (:mod:`.installed`)."""
        return install(sched, source, self._model, self._options, optimizer=self._opt,
                       params=self._params, chan=self._chan, wrapper_check=self._wrapper_check,
                       settle=self._settle_hook, previous=previous)

    def _switch(self, sched: Schedule, source: str, measure: bool = False) -> None:
        """Run ``sched`` from the next iteration on: finish everything of the current one,
        then replace the per-schedule state whole. Every rank calls it at the same step (it
        waits, and issues nothing). With torch DDP as the fallback (:meth:`use_ddp_fallback`)
        the fallback is DDP itself: the runtime's hooks come off and DDP runs, unless the
        tuner measures the run (``measure``: planning inside the run needs the runtime)."""
        self.synchronize()
        old = self._state
        if (self._fallback_ddp is not None and sched is self._fallback_sched and not measure):
            if not self._on_ddp:
                old.remove()
                self._on_ddp = True
            return
        if self._on_ddp:
            self._on_ddp = False   # its hooks came off when DDP took over
        else:
            old.remove()
        self._state = self._install(sched, source, old)

    def use_ddp_fallback(self, ddp_model: torch.nn.Module) -> None:
        """Make torch's own ``DistributedDataParallel`` over this optimizer's model the
        fallback: verification times the plan against it, and where the plan is not
        measurably faster DDP runs for good (what :class:`usbyte_opt.DistributedDataParallel`
        does; the forward must then go through ``ddp_model`` while :attr:`on_ddp`). Call on
        every rank right after construction, before the first step."""
        self._fallback_ddp = ddp_model
        if self._tuner is not None:
            self._tuner.against = "torch DDP"

    @property
    def on_ddp(self) -> bool:
        """Whether torch DDP runs now (the fallback of :meth:`use_ddp_fallback`); the
        runtime's hooks are off meanwhile."""
        return self._on_ddp

    @property
    def schedule(self) -> Schedule:
        """The schedule running (torch DDP running as the fallback: the fallback's)."""
        if self._on_ddp and self._fallback_sched is not None:
            return self._fallback_sched
        return self._state.schedule

    @property
    def schedule_source(self) -> str:
        """Where the running schedule came from (a file, ``<auto schedule>``, ...)."""
        return "<torch DDP>" if self._on_ddp else self._state.source

    @property
    def mode(self) -> Mode:
        """The running schedule's :class:`~usbyte_opt.formats.Mode`."""
        return self._state.schedule.mode

    # ------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------

    def _group_shape(self) -> tuple[int, ...]:
        return tuple(len(g["params"]) for g in self._opt.param_groups)

    def _check_unchanged(self) -> None:
        """At ``step()``: refuse what would silently train differently from DDP, on every
        rank alike (every rank runs the same code): a parameter unfrozen after wrapping (its
        gradient is never averaged); :meth:`_check_groups`: a param group added to the wrapped
        optimizer."""
        for name, p in self._frozen:
            if p.requires_grad and p.grad is not None:
                raise UsbyteError(f"parameter {name!r} was frozen when the DistributedOptimizer "
                                  "was built and has a gradient now: its gradient would never "
                                  "be averaged; unfreeze before wrapping (or wrap again)")

    def _check_groups(self) -> None:
        if self._shape is not None and self._group_shape() != self._shape:
            raise UsbyteError(GROUPS_CHANGED)

    def _honour_assigned(self) -> None:
        """``p.grad`` replaced after the step's gradients were waited for (gradient surgery,
        a callback): the step uses the new tensor, as DDP's optimizer would. It is copied into
        the tensor's view, which the update reads."""
        st = self._state
        comm, views, params = st.comm, st.grads.views, st.grads.params
        with torch.no_grad():
            for t in range(st.n):
                g = params[t].grad
                if g is None or g is views[t] or not (comm.placed[t] or comm.exposed[t]):
                    continue
                views[t].copy_(g)
                params[t].grad = views[t]

    # ------------------------------------------------------------------------------------
    # Optimizer interface
    # ------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's groups. Read between the step's last backward and
        ``step()`` (GradScaler, gradient inspection), it first completes this step's all-reduce,
        so the gradients seen are the averaged ones; read between the passes of an
        accumulation (inside :meth:`no_sync`, or before the last of
        ``backward_passes_per_step``), it leaves the accumulation alone (a learning-rate
        read, Lightning's ``toggle_model``). In sharded mode the groups hold the shard
        parameters; a ``GradScaler`` reading them after backward sees the gradient shards
        (see *Gradient access in sharded mode*)."""
        st = self._state
        if st.sharded is None:
            st.comm.complete_if_due("param_groups")
        elif _read_by_grad_scaler():  # sharded: GradScaler sees the shards (Sharded.expose)
            comm = st.comm
            # (A rank that ran no backward this step takes part too: its blocks go out as
            # zeros, and the non-finite flag's all-reduce finds every rank.)
            if not comm.accumulating and st.sharded.exposed is None:
                comm.complete("GradScaler")
                with torch._C.DisableTorchFunctionSubclass():
                    st.sharded.expose([st.in_opt[t] and p.grad is not None
                                       for t, p in enumerate(st.grads.params)])
        return self._opt.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._opt.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._opt.defaults

    @property
    def buffer_sync(self) -> BufferSync | None:
        """DDP's buffer rule run by this optimizer's model forwards (None with
        ``broadcast_buffers=False``); a trainer whose evaluation steps went through DDP's
        forward without calling the model runs them through it too
        (:mod:`usbyte_opt.integrations.lightning`)."""
        return self._options.buffer_sync

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    @property
    def optimizer_calls(self) -> int:
        """How many times the wrapped optimizer's ``step()`` has run (subset steps included),
        over every plan this optimizer has run."""
        return self._state.stepper.calls

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._opt).__name__}, schedule={self.schedule_source}"
                f" [{self.schedule.strategy}, {plural(self._state.m, 'block')}, {self.mode}], world_size="
                f"{self._chan.world_size})")

    def __getattr__(self, name: str) -> Any:
        # Anything else (register_step_pre_hook, ...) is the wrapped optimizer's.
        if name.startswith("__") or "_opt" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_opt"], name)

    def __getstate__(self) -> dict[str, Any]:
        raise UsbyteError("DistributedOptimizer cannot be pickled: save state_dict() instead")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End the iteration: make sure everything is issued and schedule the updates.

        In overlap mode the updates run lazily, tensor by tensor, in the next forward (or in
        :meth:`synchronize`); in fence mode they run here, after every block. In sharded mode
        this rank's shards are stepped here and the parameters' all-gathers issued; each
        tensor's gathered values are copied in right before its first use in the next
        forward (a step GradScaler skips steps and gathers nothing). With a ``closure``, it
        is called first (with grad enabled) and its value returned.

        Returns:
            The closure's value, or ``None``.
        """
        if self._closed:
            raise UsbyteError("step() on a closed DistributedOptimizer: create a new one to "
                              "train on")
        if self._on_ddp:
            return self._ddp_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self._state
        if st.trace is not None:
            st.trace.step()
        # A torch DDP forward since the last step (another model of the run) left dynamo's
        # DDP hook unset: the runtime's again, for the next compile (.compiled).
        rearm()
        comm, stepper, mode = st.comm, st.stepper, st.mode
        with torch._C.DisableTorchFunctionSubclass():
            self._check_unchanged()
        waited = comm.phase is Phase.WAITED
        if st.guard is not None:
            st.guard.disarm_grads()
        if waited and st.sharded is None and st.grads.stored:
            self._honour_assigned()   # p.grad = new_tensor after the wait: stepped as DDP
        comm.finish()  # every rank issues the whole step here at the latest
        skip = self._amp_verdict(st)
        self._check_groups()   # (GradScaler's sentinel group member is gone by now)
        stepper.snapshot()
        include = self._last_include = comm.include_rule(st.in_opt)
        self._update(st, include, skip)
        stepper.attrs = {}
        comm.reset(clear_zero_intent=st.sharded is not None)
        if mode != Mode.FENCE and st.guard is not None and st.updates.n_pending:
            pend = st.updates.pending
            st.guard.arm_params(None if pend is None or st.updates.n_pending == st.n else
                                [t for t in range(st.n) if pend[t]])
        return self._step_done(loss)

    def _amp_verdict(self, st: Installed) -> bool:
        """Whether this step is skipped: GradScaler.step(self) found infs (it set
        ``found_inf``; the verdict is handed to the wrapped optimizer's own way of taking it)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # called by GradScaler.step(self)
            if st.sharded is not None:
                return self._sharded_amp_step(found_inf, getattr(self, "grad_scale", None))
            return self._amp_step(found_inf, getattr(self, "grad_scale", None))
        if st.sharded is not None and st.sharded.exposed is not None:
            st.sharded.unexpose()  # a scaler read param_groups, then plain step() was called
        return False

    def _update(self, st: Installed, include: Callable[[int], bool], skip: bool) -> None:
        """The optimizer's part of :meth:`step`: none where ``skip``; sharded mode steps the
        shards and issues the all-gathers; fence mode steps here, after every block; overlap
        mode schedules each tensor's update for its first use in the next forward."""
        comm, stepper = st.comm, st.stepper
        if skip:  # no step (sharded mode: no all-gather); the parameters stay as they are
            comm.wait_blocks()
            if st.sharded is not None:
                st.grads.release()
        elif st.sharded is not None:
            comm.wait_blocks()
            gathers = st.sharded.step(include, comm.discard is False)
            stepper.calls += 1
            st.updates.start(gathers, lambda t: True, range(st.n))
            st.grads.release()
        elif st.mode == Mode.FENCE:
            comm.wait_blocks()
            probe = comm.probe
            if probe is not None:
                probe.update_begin()
            stepper.step([t for t in st.candidates if include(t)])
            if probe is not None:
                probe.update_end()
            comm.expose_used()
        else:
            # p.grad keeps the averaged gradient until zero_grad(), as under DDP; the pending
            # update reads it, and a read of p.grad by user code runs the update first.
            st.updates.start(comm.works, include, st.candidates)

    def _ddp_step(self, closure: Callable[[], Any] | None) -> Any:
        """``step()`` while torch DDP runs (the fallback): the wrapped optimizer's own step,
        as under DDP (GradScaler's verdict honoured as ``GradScaler.step`` would), and the
        tuner's count."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        skip = False
        if found_inf is not None:   # called by GradScaler.step(self)
            grads = [p.grad for p in self._state.grads.params if p.grad is not None]
            amp.unscale(grads, getattr(self, "grad_scale", None), self._device)
            skip = amp.skip_on_host(found_inf)
        if not skip:
            inner_step(self._opt)
            self._state.stepper.calls += 1
        return self._step_done(loss)

    def _step_done(self, loss: Any) -> Any:
        """The end of every ``step()``: the tuner's count, and the LR scheduler's check."""
        if self._tuner is not None:
            self._tuner.after_step()
        self._steps += 1
        self._opt._opt_called = True  # type: ignore[attr-defined]  # LR scheduler's check
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, as ``torch.optim.Optimizer.zero_grad`` does.

        After ``step()`` ``p.grad`` holds the averaged gradient, as under DDP, and the pending
        updates (overlap mode) read it: ``set_to_none=True`` drops ``p.grad`` without touching
        what they read; ``set_to_none=False`` first applies them, then zeroes ``p.grad`` in
        place (the next backward accumulates into it, as under DDP). Between backward and
        ``step()`` it first waits for this step's all-reduce (in sharded mode,
        reduce-scatters), then discards the gradients. In sharded mode ``p.grad`` is ``None``
        after ``step()``; ``set_to_none=False`` is recorded so that a tensor no rank uses in
        the next step is stepped with a zero gradient, as under DDP.
        """
        with torch._C.DisableTorchFunctionSubclass():
            self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        st = self._state
        g, comm = st.grads, st.comm
        if comm.phase is Phase.ISSUED:
            comm.complete("zero_grad()")  # never zero a buffer being all-reduced
        if comm.phase is Phase.WAITED:
            comm.discard = set_to_none
        if set_to_none:
            st.updates.drop_grads()   # (on the host: each pending p.grad once its update read it)
            if st.sharded is not None:
                comm.zero_intent[:] = [False] * st.n
            return
        if st.sharded is None and st.updates.n_pending:
            st.updates.flush()   # the views they read are about to be zeroed
        with torch.no_grad():
            for p in g.params:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        if st.sharded is not None and (st.updates.n_pending or comm.phase is Phase.IDLE):
            include = self._last_include
            zi = comm.zero_intent
            for t in range(st.n):
                if not zi[t] and (include(t) or g.params[t].grad is not None):
                    zi[t] = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A context in which backward passes only accumulate gradients locally, as DDP's
        ``no_sync()``: the first backward outside it communicates the accumulated sum.

        Example (accumulation over 4 micro-batches)::

            for i, (x, y) in enumerate(data):
                with opt.no_sync() if (i + 1) % 4 else contextlib.nullcontext():
                    loss_fn(model(x), y).div(4).backward()
                if (i + 1) % 4 == 0:
                    opt.step(); opt.zero_grad()
        """
        before = self._state.comm.no_sync
        self._state.comm.no_sync = True
        try:
            yield
        finally:
            self._state.comm.no_sync = before

    def _wrapper_check(self, *args: Any) -> None:
        """Forward pre-hook of the model: refuse a forward through DDP or FSDP (a trainer
        that wrapped the model after this optimizer was built). Every rank runs the same
        forward, so every rank raises."""
        what = wrapped_now(self._model, self._params if self._steps == 0 else None)
        if what:
            raise UsbyteError(what)

    def report(self) -> dict[str, Any]:
        """What the runtime decided and measured: the schedule running, and with auto
        planning or verification the plan, the chosen side (``"plan"``, or ``"fallback"``:
        DDP's buckets), the measured ms per iteration of both, the prediction, any drift
        warning, and ``"summary"``, one line saying what runs and what it won. In
        sharded mode, ``"memory"``: this rank's bytes of optimizer state and gradients
        (:meth:`.sharded.Sharded.memory`)."""
        base: dict[str, Any] = {
            "schedule": {"source": self.schedule_source, "strategy": self.schedule.strategy,
                         "mode": self.mode, "blocks": self._state.m},
            "steps": self._steps, "world_size": self._chan.world_size}
        if self._state.sharded is not None:
            base["memory"] = self._state.sharded.memory()
        if self._tuner is not None:
            base.update(self._tuner.report())
        return base

    def replan(self) -> None:
        """Plan again inside the run (``schedule="auto"``), or verify the plan again, from the
        next ``step()`` on. Call it on every rank at the same iteration."""
        if self._tuner is None:
            raise UsbyteError("replan(): this optimizer neither plans nor verifies (pass "
                              "schedule=\"auto\" or a schedule with verify=True)")
        self._tuner.replan()

    def record_trace(self, on: bool) -> None:
        """Start (``True``) or stop recording the measured timeline, when a trace file was
        given (``trace=`` or ``$USBYTE_TRACE``; else nothing to do). Recording is on from the
        start; ``usbyte-opt bench`` times iterations with it off, as DDP's are timed, and
        records a separate pass."""
        if self._state.trace is not None:
            self._state.trace.paused = not on

    def synchronize(self) -> None:
        """Finish all communication and updates: call before eval, checkpoints, the end.

        Called after ``backward()`` but before ``step()``, it waits for this step's all-reduce
        instead, so that the averaged gradients can be read or changed (for example clipped)
        before ``step()``. It issues no collective of its own: every rank issued everything of
        the step when its backward ended. Between the passes of an accumulation (inside
        :meth:`no_sync`, or before the last of ``backward_passes_per_step``) there is nothing
        to wait for yet: it applies pending updates only, and the accumulation goes on.
        """
        if self._state.sharded is not None:
            ph = self._state.comm.phase
            if ph is not Phase.IDLE and not self._state.comm.accumulating:
                self._state.sharded.require("synchronize() between backward() and step()")
        else:
            self._state.comm.complete_if_due("synchronize()")
        self._settle()
        comm = self._state.comm
        if comm.usage_work is not None:
            comm.usage_map()  # nothing of this step left in flight

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """Wait for this step's averaged gradients, then clip them as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does under DDP; returns
        the total norm. Call it between ``backward()`` and ``step()``.

        In sharded mode the averaged gradients exist only as shards: the norm comes from one
        all-reduce of the shards' per-tensor parts (a collective: every rank calls it), and
        the shards are scaled; ``p.grad`` is left alone (see *Gradient access*)."""
        st = self._state
        if st.sharded is not None and st.comm.phase is Phase.IDLE:
            # No backward on this rank since step(): the norm is a collective, so take part
            # (this rank's blocks go out as zeros, as step() would send them) rather than
            # leave the others waiting.
            st.comm.complete("clip_grad_norm_()")
        st.comm.complete_if_due("clip_grad_norm_()", between_passes=True)
        if st.sharded is not None:
            sh = st.sharded
            if sh.param_order is None:  # the model's parameter order, once per schedule
                sh.param_order = self._model_order()
            with torch._C.DisableTorchFunctionSubclass():
                flags = [p.grad is not None for p in st.grads.params]
            return sh.clip(max_norm, norm_type, flags, sh.param_order, error_if_nonfinite, foreach)
        # In the model's parameter order, as torch.nn.utils.clip_grad_norm_(model.parameters())
        # sums the per-tensor norms: the same total, bitwise.
        gp = st.grads.params
        params = [gp[t] for t in self._model_order() if gp[t].grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)

    def _model_order(self) -> list[int]:
        """The runtime indices of the trainable tensors in ``model.parameters()`` order."""
        st = self._state
        if st.model_order is None:
            index = {id(p): t for t, p in enumerate(st.grads.params)}
            st.model_order = [index[id(p)] for p in self._model.parameters() if id(p) in index]
        return st.model_order

    def _settle_hook(self, *args: Any, **kwargs: Any) -> None:
        self._settle()

    def _settle(self) -> None:
        """Apply pending updates: waits only, no new collective. (Module buffers are DDP's
        business alone, :mod:`.semantics`: nothing to install here.)"""
        st = self._state
        if st.updates.n_pending:
            st.updates.flush()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, in its own format (pending updates applied
        first; local, so rank 0 alone may call it). In sharded mode, the full state gathered
        from every rank's shards onto the host (CPU tensors; the device holds one block's
        all-gather at a time beside the shards), keyed as the unsharded optimizer over the
        model's parameters keys it: a collective, so call it on every rank and save on rank 0.
        Called on some ranks only (``if rank == 0: save(opt.state_dict())``) it raises
        :class:`~usbyte_opt.errors.DistributedError` there within 300 s (or ``timeout`` if
        shorter), and the other ranks, blocked in their next step's wait, raise right after, in
        one line naming the rank that called alone (the run cannot go on: every later blocked
        wait of these optimizers raises the same). For checkpoints of large models use
        :meth:`sharded_state_dict`."""
        self._settle()
        if self._state.sharded is not None:
            return self._state.sharded.full_state()
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the wrapped optimizer (pending updates are applied first). In
        sharded mode, a full one (as :meth:`state_dict` returns it, or an unsharded
        optimizer's over the model's parameters), best on the host: torch's checks run against
        host stand-ins of the parameters and each rank copies only its pieces to the device."""
        self._settle()
        if self._state.sharded is not None:
            self._state.sharded.load_full(state_dict)
            return
        self._opt.load_state_dict(state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Sharded mode: this rank's pieces of the optimizer state, for
        ``torch.distributed.checkpoint`` (DCP). Local, no collective, no copy: the state
        tensors themselves under keys distinct across ranks, so ``dcp.save`` writes each
        rank's own pieces and no rank ever holds more than its shard; a piece without state
        yet gets zeros (flagged as absent), so a fresh optimizer's dict is the template
        ``dcp.load`` fills in place. Load with :meth:`load_sharded_state_dict`, on the same
        world size and schedule (another is refused, by ``dcp.load`` for the missing keys or
        in one line here)::

            dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()},
                     checkpoint_id=path)
            sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
            dcp.load(sd, checkpoint_id=path)
            model.load_state_dict(sd["model"]); opt.load_sharded_state_dict(sd["optim"])
        """
        self._settle()
        if self._state.sharded is None:
            raise UsbyteError("sharded_state_dict() needs a sharded schedule (\"mode\": "
                              "\"sharded\"): every rank holds the whole state here, save "
                              "state_dict() on rank 0")
        return self._state.sharded.sharded_state()

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Install a dict of :meth:`sharded_state_dict` that ``dcp.load`` filled in place:
        the hyperparameters and this rank's pieces of the state (its tensors taken as they
        are). Local."""
        self._settle()
        if self._state.sharded is None:
            raise UsbyteError("load_sharded_state_dict() needs a sharded schedule (\"mode\": "
                              "\"sharded\"); load a full state with load_state_dict()")
        self._state.sharded.load_sharded(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsbyteError("add_param_group after wrapping is not supported: add the group to the "
                          "optimizer, then create the DistributedOptimizer")

    def close(self) -> None:
        """Synchronize, remove the hooks, give parameters their own gradients back and release
        the communication channel (its gloo groups and their worker threads). The optimizer
        cannot train after this; at interpreter exit, an optimizer not closed is released the
        same way (its collectives given a few seconds to finish). In sharded mode a collective
        (every rank calls it): the full state is gathered onto the host, the shards' state let
        go, then the wrapped optimizer, back over its own parameters, loads the full state (on
        the device, as any unsharded optimizer holds it)."""
        if self._closed:
            return
        self.synchronize()
        sharded = self._state.sharded
        full = sharded.full_state("opt.close()") if sharded is not None else None
        self._state.remove()
        self._release()
        self._opt.__dict__.pop("_usbyte_rt", None)   # a taken-over optimizer is plain again
        if sharded is not None and full is not None:
            sharded.restore()
            self._opt.load_state_dict(full)

    def _release(self, grace_s: float | None = None) -> None:
        """Wait for every collective of this optimizer, drop the works and close the channel.
        With ``grace_s``, give up (and change nothing) if they have not all finished by then."""
        st = self._state
        works = st.comm.in_flight()
        if grace_s is not None:
            deadline = time.monotonic() + grace_s
            while not all(w.is_completed() for w in works):
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.002)
        for w in works:  # NCCL: completed on the host is not yet done on the stream
            self._chan.wait(w, "a collective in flight at close()")
        st.comm.works = [None] * st.m
        st.comm.usage_work = None
        self._chan.close()
        self._closed = True
        OPEN.discard(self)

    # ------------------------------------------------------------------------------------
    # GradScaler
    # ------------------------------------------------------------------------------------

    def _sharded_amp_step(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> bool:
        """GradScaler in sharded mode: its ``found_inf`` is every rank's verdict (it read
        ``param_groups`` after backward, :meth:`.sharded.Sharded.expose`); unscale the shard
        gradients (if the scaler has not) and say whether to skip the step."""
        sh = self._state.sharded
        assert sh is not None
        if sh.exposed is None:
            raise UsbyteError("GradScaler in sharded mode: the scaler did not read this "
                              "optimizer's param_groups after the step's last backward(), so "
                              "its found_inf is not every rank's verdict: call "
                              "scaler.step(opt) (or scaler.unscale_(opt)) after backward()")
        shown = sh.unexpose()
        if grad_scale is not None:
            sh.unscale(shown, grad_scale)
        if not torch.is_tensor(found_inf):
            return bool(found_inf)
        return amp.skip_on_host(found_inf)

    def _amp_step(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> bool:
        """GradScaler: unscale (if the scaler has not) and decide whether to skip the step.
        No collective: the verdict is the same on every rank (:mod:`.amp`)."""
        st = self._state
        st.comm.complete("GradScaler.step()")
        amp.unscale(st.grads.flats, grad_scale, self._chan.device)
        # A fused optimizer skips on the device, in either mode: no host read of found_inf.
        if self._chan.cuda and amp.supports_found_inf(self._opt):
            st.stepper.attrs = {"found_inf": found_inf, "grad_scale": None}
            return False
        return amp.skip_on_host(found_inf)


def _read_by_grad_scaler() -> bool:
    """Whether ``param_groups`` is being read by a ``torch.amp.GradScaler`` method (its
    check of non-finite gradients, ``_unscale_grads_``): the getter's caller's ``self``."""
    import sys
    from types import FrameType

    f: FrameType | None = sys._getframe(2)   # 0: this function, 1: the getter, 2: its caller
    for _ in range(2):
        if f is None:
            return False
        if isinstance(f.f_locals.get("self"), torch.amp.GradScaler):
            return True
        f = f.f_back
    return False


class _Tuned:
    """The optimizer as its tuner sees it (:class:`~usbyte_opt.runtime.autotune.Tunable`):
    the channel's control group, and the running schedule, its tensors and the hooks' probe
    read through the per-schedule state in force."""

    def __init__(self, opt: DistributedOptimizer):
        self._opt = opt
        chan = opt._chan
        self.rank, self.world_size = chan.rank, chan.world_size
        self.device, self.group = opt._device, opt._group
        self.control_all_reduce = chan.control_all_reduce
        self.control_broadcast = chan.control_broadcast
        self.wait_host = chan.wait_host
        self.all_reduce = chan.all_reduce_block
        self.synchronize = opt.synchronize
        self.switch = opt._switch

    @property
    def schedule(self) -> Schedule:
        return self._opt.schedule

    @property
    def schedule_source(self) -> str:
        return self._opt.schedule_source

    @property
    def tensor_count(self) -> int:
        return self._opt._state.n

    @property
    def grad_itemsize(self) -> int:
        return self._opt._state.grads.flats[0].element_size()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        g = self._opt._state.grads
        return list(zip(g.names, g.params))

    @property
    def compiled(self) -> bool:
        st = self._opt._state.gates.split.state
        return st.gated > 0 or st.at_ddp_buckets > 0

    def settled(self) -> None:
        self._opt._state.gates.split.settle(torch_ddp=self._opt._on_ddp)

    def set_probe(self, probe: IterationStamps | None) -> None:
        st = self._opt._state
        st.comm.probe = st.gates.probe = probe

    def hold_communication(self, hold: bool) -> None:
        self._opt._state.comm.defer = hold
