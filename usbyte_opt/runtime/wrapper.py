"""``usbyte_opt.DistributedDataParallel``: the runtime behind DDP's own surface.

A DDP training script changes one line, its ``DDP(...)`` line::

    model = DDP(model, device_ids=[local_rank])                          # before
    model = usbyte_opt.DistributedDataParallel(model, device_ids=[local_rank])   # after

and keeps everything else: ``model.module``, ``model.no_sync()``,
``model.require_backward_grad_sync = ...``, ``optimizer.step()``, ``scaler.step(optimizer)``,
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, LR schedules through
``optimizer.param_groups``, checkpoints of ``model.module.state_dict()`` on rank 0 only.

The schedule comes from ``schedule=`` or ``$USBYTE_SCHEDULE`` (what ``usbyte-opt launch
--schedule`` sets). **Without one, torch's own DDP runs**, with the arguments given: there is
nothing planned to win, so the run costs exactly what DDP costs. With one, the optimizer is
*taken over* at its first ``step()``: torch's DDP over the module (built with the arguments
given) trains until then, and the first optimizer over the model's parameters to step (created
before or after wrapping, as DDP scripts do both) is wrapped in a
:class:`~usbyte_opt.runtime.DistributedOptimizer` right after that step; the runtime trains
from the next iteration on. The user's object keeps its class and keeps working, its
``step()``, ``zero_grad()``, ``state_dict()`` and ``load_state_dict()`` now the runtime's
(:func:`take_over`: torch's public hooks and methods set on the object, as torch's LR
scheduler sets ``step``; docs/design.md §5.4). Pass ``optimizer=`` to name it instead: the
runtime then trains from the first iteration (a sharded schedule shards the optimizer state
from the start). A second optimizer over the model's parameters stepping in the first
optimizer's iteration is refused.

**The fallback is DDP itself.** With verification on (the default for a schedule given, and
for ``"auto"``), the plan is timed in alternating windows against that torch DDP (DDP's own
buckets) and kept only when measurably faster; otherwise the runtime's hooks come off and DDP
runs from then on (:meth:`~usbyte_opt.runtime.DistributedOptimizer.use_ddp_fallback`). The
user's optimizer then steps as under DDP. DDP's gradient buckets cost one more gradient's
worth of memory while both exist.

DDP's contract holds (:mod:`.guard`): code that reads or changes a gradient between
``backward()`` and ``step()`` first waits for the averaged gradients, and code that touches a
parameter between ``step()`` and the next forward first sees its update.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from .. import voice
from ..errors import UsbyteError, plural
from ..formats import Runner, Schedule
from . import compiled
from .checks import broadcast_from_rank0, check_model, check_world_size, require_initialized, resolve_schedule
from .ddp_runner import DEFAULT_BUCKETS, DDPRunner
from .default_plan import model_tensors
from .optimizer import DistributedOptimizer
from .semantics import UNSUPPORTED_OPTIONS, BufferSync, check_ddp_arguments, module_buffers
from .start import ScheduleArg, requested

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` that trains on a planned
    schedule (usbyte-opt's runtime), with DDP's results.

    Args:
        module: the model (on this rank's device; a ``torch.compile``'d model works).
        device_ids, output_device, dim: as DDP's (inputs are moved to ``device_ids[0]``).
        broadcast_buffers, forward_sync_buffers, init_sync, bucket_cap_mb_list: as DDP's (module
            buffers follow DDP's rule exactly, :mod:`.semantics`).
        process_group: the data-parallel group (default: the world).
        bucket_cap_mb, gradient_as_bucket_view, check_reduction: accepted for DDP's signature;
            the schedule decides the blocks.
        find_unused_parameters: as DDP's. ``False`` (DDP's default) raises, as DDP does, when
            a trainable parameter gets no gradient in a step; ``True`` exchanges the usage map.
        static_graph: accepted (the runtime needs no hint).
        schedule: a :class:`~usbyte_opt.formats.Schedule`, a schedule file, ``"auto"``; default
            ``$USBYTE_SCHEDULE``, else none: torch's DDP runs.
        optimizer: the optimizer to take over now; default: the first over the model's
            parameters to step (torch's DDP trains until its first ``step()``).
        **runtime: any other keyword of :class:`~usbyte_opt.runtime.DistributedOptimizer`
            (``verify``, ``zero_stage``, ``trace``, ``timeout``, ...).

    Example::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> import usbyte_opt
        >>> from usbyte_opt.runtime import default_schedule
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> model = usbyte_opt.DistributedDataParallel(net, schedule=default_schedule(net))  # was: DDP(net)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        >>> for _ in range(3):
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        ...     norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # averaged grads
        ...     opt.step(); opt.zero_grad()
        >>> model.module is net, type(model.optimizer).__name__, type(opt).__name__
        (True, 'DistributedOptimizer', 'AdamW')
        >>> dist.destroy_process_group()
    """

    def __init__(self, module: torch.nn.Module, device_ids: list[Any] | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool | None = None,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, *,
                 schedule: ScheduleArg = None, optimizer: torch.optim.Optimizer | None = None,
                 forward_sync_buffers: bool | None = None, init_sync: bool = True,
                 bucket_cap_mb_list: list[int] | None = None, **runtime: Any):
        super().__init__()
        require_initialized()
        if device_ids is not None and len(device_ids) != 1:
            raise UsbyteError(f"device_ids: expected one device per process, got {device_ids!r}")
        # DDP's newer options: passed on to torch's DDP where this torch has them; those the
        # runtime does not reproduce are refused when a schedule runs (below).
        ddp_extra = {k: runtime.pop(k) for k in list(runtime) if k in UNSUPPORTED_OPTIONS
                     or k == "batched_grad_copy"}
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        # DDP's resolution of the two names of the forward buffer sync.
        sync_buffers = (forward_sync_buffers if forward_sync_buffers is not None
                        else broadcast_buffers if broadcast_buffers is not None else True)
        self.broadcast_buffers = sync_buffers
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self._sync = True
        self._schedule = schedule
        self._runtime_kwargs = runtime
        self._opt: DistributedOptimizer | None = None
        #: Waiting for the optimizer's first step (and refusing a second optimizer in its
        #: iteration): until the forward after the takeover.
        self._watching = False
        self._ddp_kwargs: dict[str, Any] = {
            "device_ids": device_ids, "output_device": output_device, "dim": dim,
            "broadcast_buffers": broadcast_buffers, "process_group": process_group,
            "bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction, "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph, "forward_sync_buffers": forward_sync_buffers,
            "init_sync": init_sync, "bucket_cap_mb_list": bucket_cap_mb_list, **ddp_extra}
        # torch DDP over the module, outside the module tree (state_dict keys stay DDP's):
        # what runs when nothing is planned, until the optimizer's first step, and the
        # fallback of verification.
        self.__dict__["_ddp"] = None
        req = requested(schedule)
        self._planned = req.given
        #: DDP's buffer rule, in force across torch's DDP and the runtime (:mod:`.semantics`).
        self._buffer_sync = BufferSync(module, process_group, sync_buffers)
        #: A schedule whose runner is torch DDP: the planned DDP (and its verification).
        self._runner: DDPRunner | None = None
        rank = dist.get_rank(process_group)
        if self._planned:
            check_ddp_arguments(self._ddp_kwargs)
            # A compiled model whose plan's pieces could round apart is compiled at these
            # buckets, as compiled torch DDP (:mod:`.compiled`).
            compiled.ddp_buckets(module, bucket_cap_mb)
        plan = None if req.auto or not req.given else _read_plan(req.schedule, module, process_group)
        if plan is not None and plan[0].runner is Runner.DDP:
            self._start_runner(plan[0], plan[1], runtime)
            return
        voice.start(_start_line(plan, req.auto), rank)
        voice.closing(lambda: _before_takeover(self._planned), rank)
        if not self._planned or optimizer is None:
            # Nothing planned: DDP itself. Else DDP until the optimizer's first step (its
            # construction broadcasts rank 0's parameters and buffers, DDP's starting point).
            self.__dict__["_ddp"] = self._torch_ddp()
            if self._planned:
                self._watching = True
                _watch(self)
                # A compiled model: torch DDP's split of its graphs is noted, for the runtime
                # to compile the plan's at the takeover.
                compiled.watch()
            return
        # DDP's starting point, at construction as DDP: rank 0's parameters and buffers
        # (buffers unless broadcast_buffers=False; forward_sync_buffers=False keeps it).
        broadcast_from_rank0([p.detach() for p in module.parameters()], process_group, None)
        if sync_buffers or forward_sync_buffers is not None:
            broadcast_from_rank0(module_buffers(module), process_group, None, "buffers")
        self._attach(optimizer)

    def _start_runner(self, schedule: Schedule, source: str, runtime: dict[str, Any]) -> None:
        """A schedule whose runner is torch DDP: torch DDP with its planned buckets, no
        runtime, verified against DDP's default buckets (:mod:`.ddp_runner`)."""
        verify = runtime.pop("verify", True)
        if runtime:
            raise UsbyteError(f"{source}: runs on torch DDP (runner \"ddp\"): the runtime "
                              f"option {sorted(runtime)[0]!r} does not apply; drop it")
        runner = self._runner = DDPRunner(
            self.module, schedule, source, self._torch_ddp, self.find_unused_parameters,
            self.static_graph, self.process_group, verify=bool(verify),
            bucket_cap_mb=self.bucket_cap_mb)
        self.__dict__["_ddp"] = runner.active
        if runner.verifying:
            self._watching = True
            _watch(self)
        rank = dist.get_rank(self.process_group)
        line = (f"{source} ({schedule.strategy}: torch DDP, "
                f"{plural(len(schedule.blocks), 'planned bucket')})")
        if runner.tuner is not None:
            line += (f"; timed against {DEFAULT_BUCKETS} in turns for at least "
                     f"{runner.tuner.needed()} iterations (verify=False skips it)")
        voice.start(line, rank)
        voice.closing(lambda: runner.tuner.final_summary() if runner.tuner is not None else
                      f"ran {source} ({schedule.strategy}) on torch DDP with its "
                      f"{plural(len(schedule.blocks), 'planned bucket')}", rank)

    def report(self) -> dict[str, Any]:
        """What runs: the runtime's :meth:`~usbyte_opt.runtime.DistributedOptimizer.report`,
        torch DDP's planned buckets and their verification (a schedule whose runner is DDP), or
        torch DDP as given (nothing planned, or before the optimizer's first step)."""
        if self._runner is not None:
            return self._runner.report()
        if self._opt is not None:
            return self._opt.report()
        return {"runner": "ddp", "schedule": None if not self._planned else "not started yet"}

    def _torch_ddp(self, extra: dict[str, Any] | None = None) -> torch.nn.Module:
        """torch's ``DistributedDataParallel`` over the module, with the arguments given
        (those this torch's DDP has; the defaults of the others need nothing), and ``extra``
        on top (the planned buckets)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        accepted = inspect.signature(DDP.__init__).parameters
        kw: dict[str, Any] = {}
        for k, v in {**self._ddp_kwargs, **(extra or {})}.items():
            if k in accepted:
                if accepted[k].default is not inspect.Parameter.empty and v is accepted[k].default:
                    continue   # (newer torch warns when some defaults are passed)
                kw[k] = v
            elif v is not None and v is not False and not (k == "init_sync" and v is True):
                raise UsbyteError(f"DistributedDataParallel({k}={v!r}): this torch's DDP has "
                                  f"no such option")
        if kw.get("broadcast_buffers") is True and "forward_sync_buffers" in accepted:
            del kw["broadcast_buffers"]   # the default, under its deprecated name
        return DDP(self.module, **kw)

    @property
    def runs_torch_ddp(self) -> bool:
        """Whether torch's DDP runs now: nothing was planned, the optimizer has not stepped
        yet, or the plan was not measurably faster than DDP (or is being timed against it)."""
        if self._runner is not None:
            return True
        ddp = self.__dict__["_ddp"]
        return ddp is not None and (self._opt is None or self._opt.on_ddp)

    # -- DDP's surface -------------------------------------------------------------------------

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch: ``False`` makes the next backward only accumulate (as ``no_sync()``)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally, as DDP's ``no_sync()``."""
        before = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = before

    @property
    def optimizer(self) -> DistributedOptimizer | None:
        """The runtime driving the taken-over optimizer (``None`` before the optimizer's first
        step, and when nothing is planned: then torch's DDP runs)."""
        return self._opt

    def _set_static_graph(self) -> None:
        """DDP's private switch (some trainers call it): nothing to do here."""

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        if not self._planned:
            return self.__dict__["_ddp"].register_comm_hook(state, hook)   # DDP's own
        raise UsbyteError("register_comm_hook: usbyte-opt's schedule decides the communication; "
                          "use torch's DistributedDataParallel for a communication hook")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        if not self._planned:
            return self.__dict__["_ddp"].join(*args, **kwargs)
        raise UsbyteError("join() (uneven inputs) is not supported by usbyte-opt's runtime: give "
                          "every rank the same number of steps")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._watching and (self._opt is not None or (
                self._runner is not None and not self._runner.verifying)):
            self._stop_watching()   # the taken-over optimizer's first iteration is over
        sync = self._buffer_sync
        if self.runs_torch_ddp:
            ddp = self._runner.active if self._runner is not None else self.__dict__["_ddp"]
            ddp.require_backward_grad_sync = self._sync
            if ddp.training != self.training:
                ddp.training = self.training
            return sync.run_ddp(ddp, lambda: ddp(*inputs, **kwargs))
        opt = self._opt
        assert opt is not None
        opt._state.comm.no_sync = not self._sync
        sync.pre_forward()   # DDP's _pre_forward: rank 0's buffers, when its rule says so
        if self.device_ids:
            dev = torch.device(self.device_ids[0]) if not isinstance(self.device_ids[0], int) \
                else torch.device("cuda", self.device_ids[0])
            inputs, kwargs = _to(inputs, dev), _to(kwargs, dev)
        out = self.module(*inputs, **kwargs)
        sync.post_forward(self._sync)   # DDP's _post_forward
        return out

    # -- the optimizer -------------------------------------------------------------------------

    def _attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Run ``optimizer`` on the runtime: build it, take the object over, and give the
        runtime torch's DDP as its fallback while it verifies or plans."""
        kw = dict(self._runtime_kwargs)
        # The buffer rule is the wrapper's (its forward is the forward through DDP), and the
        # starting point was broadcast at construction (by torch's DDP or above): the runtime
        # broadcasts no buffer of its own.
        kw["broadcast_buffers"] = False
        kw.setdefault("find_unused_parameters", self.find_unused_parameters)
        ddp = self.__dict__["_ddp"]
        check_routable(optimizer)
        rt = DistributedOptimizer(optimizer, self.module, self._schedule, self.process_group, **kw)
        take_over(optimizer, rt)
        self._opt = rt
        if rt._tuner is not None and rt._tuner.phase != "settled":   # verifying or planning
            rt.use_ddp_fallback(ddp if ddp is not None else self._torch_ddp())
            self.__dict__["_ddp"] = rt._fallback_ddp
        else:
            self.__dict__["_ddp"] = None   # the first iteration's DDP, not needed any more

    def _over_model(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps some of the model's trainable parameters."""
        ids = {id(p) for p in self.module.parameters() if p.requires_grad}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer is about to step: once one over the model was taken over, another
        over the model's parameters in the same iteration is refused (before it steps)."""
        rt = self._opt
        if (self._runner is not None or rt is None or optimizer is rt.optimizer
                or not self._over_model(optimizer)):
            return
        raise UsbyteError("usbyte_opt.DistributedDataParallel: 2 optimizers over the model's "
                          f"parameters step ({type(rt.optimizer).__name__} was taken over at its "
                          f"first step, then {type(optimizer).__name__} stepped); use one "
                          "optimizer, or pass the one to run: DistributedDataParallel(model, "
                          "..., optimizer=opt)")

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer over the model's parameters has stepped (as under DDP, which
        averaged its gradients): take it over (with a DDP-runner schedule: time the step)."""
        if self._runner is not None:
            if self._runner.verifying and self._over_model(optimizer):
                self._runner.after_step(optimizer)
            return
        if self._opt is None and self._over_model(optimizer):
            self._attach(optimizer)

    def _stop_watching(self) -> None:
        self._watching = False
        _unwatch(self)


def _read_plan(schedule: Any, module: torch.nn.Module, group: dist.ProcessGroup | None
               ) -> tuple[Schedule, str] | None:
    """The schedule asked for, read and checked against the model (every rank reads the same
    file and raises alike), or None when it is not at hand in this form."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    sched, source = resolve_schedule(schedule, module, ws, warn=False)
    if sched.runner is Runner.DDP:   # (the runtime's own start-up checks the others)
        check_model(sched, model_tensors(module), source)
        check_world_size(sched, ws, rank)
    return sched, str(source)


def _start_line(plan: tuple[Schedule, str] | None, auto: bool) -> str:
    """The wrapper's start line (:mod:`usbyte_opt.voice`) for a run that is not DDP-runner's."""
    if auto:
        return ("schedule auto: torch DDP until the optimizer's first step, then DDP's buckets "
                "on the usbyte-opt runtime while the run is measured, then the plan made from it")
    if plan is None:
        return "no schedule given (schedule= or $USBYTE_SCHEDULE): torch DDP runs as given"
    sched, source = plan
    return (f"{source} ({sched.strategy}: usbyte-opt runtime, {sched.mode} mode, "
            f"{plural(len(sched.blocks), 'block')}), from the optimizer's first step on")


def _before_takeover(planned: bool) -> str:
    """The summary of a run the runtime never took over (:mod:`usbyte_opt.voice`)."""
    if not planned:
        return "torch DDP ran as given (no schedule)"
    return "torch DDP ran throughout: the optimizer over the model never stepped"


# -- finding the optimizer at its first step ----------------------------------------------------

#: The wrappers waiting for their optimizer's first step (or watching its iteration).
_WATCHING: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
#: torch's global optimizer step hooks, registered while a wrapper watches.
_HOOKS: list[RemovableHandle] = []


def _watch(wrapper: DistributedDataParallel) -> None:
    _WATCHING.add(wrapper)
    if not _HOOKS:
        _HOOKS.extend((register_optimizer_step_pre_hook(_before_any_step),
                       register_optimizer_step_post_hook(_after_any_step)))


def _unwatch(wrapper: DistributedDataParallel) -> None:
    """Stop watching (from the wrapper's forward, never from inside a step hook: torch is
    iterating its hooks there)."""
    _WATCHING.discard(wrapper)
    if not _WATCHING:
        for h in _HOOKS:
            h.remove()
        _HOOKS.clear()


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for w in list(_WATCHING):
        w._before_step(optimizer)


def _after_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for w in list(_WATCHING):
        w._after_step(optimizer)


# -- the taken-over optimizer -------------------------------------------------------------------

def take_over(optimizer: torch.optim.Optimizer, rt: DistributedOptimizer) -> None:
    """Route the user's ``optimizer`` object through ``rt``, its class unchanged:
    ``step()``, ``zero_grad()``, ``load_state_dict()`` and ``add_param_group()`` become the
    runtime's (methods set on the object, as torch's LR scheduler sets ``step``: each replaces
    the optimizer's own call, which no hook can skip), ``state_dict()`` returns the runtime's
    (a state-dict post-hook), ``GradScaler.step(optimizer)`` hands its verdict to the runtime
    (``_step_supports_amp_scaling`` on the object), and in sharded mode a ``GradScaler``
    reading ``param_groups`` after backward is shown the gradient shards (:class:`_Groups`).
    The runtime's own calls of the optimizer (:func:`inner`) reach the optimizer's own
    methods; after ``rt.close()`` every call is the optimizer's own again. The caller has
    checked it can be routed (:func:`check_routable`, before the runtime was built)."""
    d = optimizer.__dict__
    if "_usbyte_own_amp" not in d:   # (not taken over before)
        d["_usbyte_own_amp"] = d.get("_step_supports_amp_scaling", _ABSENT)
        d["_usbyte_state_hook"] = optimizer.register_state_dict_post_hook(_state_dict_hook)
    for name, fn in (("step", _step), ("zero_grad", _zero_grad),
                     ("load_state_dict", _load_state_dict), ("add_param_group", _add_param_group)):
        d[name] = types.MethodType(fn, optimizer)
    d["_step_supports_amp_scaling"] = True
    if rt._state.sharded is not None and not isinstance(d["param_groups"], _Groups):
        d["param_groups"] = _Groups(d["param_groups"], weakref.ref(optimizer))
    d["_usbyte_rt"] = rt


def check_routable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` was replaced on the object by anything but an LR
    scheduler (whose marking the runtime's ``step`` keeps): that call would bypass the
    runtime, and replacing it would drop what it does."""
    step = optimizer.__dict__.get("step")
    if step is not None and not getattr(step, "_wrapped_by_lr_sched", False):
        raise UsbyteError(f"{type(optimizer).__name__}.step is replaced on the object "
                          f"({step!r}): the runtime cannot take it over; pass the optimizer "
                          "before replacing its step")


_ABSENT = object()


def _runtime(opt: torch.optim.Optimizer) -> DistributedOptimizer | None:
    """The runtime ``opt`` is routed through, unless the runtime itself is calling it."""
    d = opt.__dict__
    rt = d.get("_usbyte_rt")
    if rt is None or d.get("_usbyte_inner"):
        return None
    return rt


def _step(opt: torch.optim.Optimizer, closure: Any = None, **kw: Any) -> Any:
    """``step`` through the runtime, each call marked as torch's LR scheduler marks the
    ``step`` it wraps (``_opt_called``: no order warning; marked as wrapped, a scheduler built
    later leaves it as it is). GradScaler's verdict, set on the optimizer, is the runtime's for
    the call (the optimizer's own step, which the runtime calls, must not see it), back on the
    optimizer for GradScaler to delete; meanwhile the optimizer's own
    ``_step_supports_amp_scaling`` is back: the runtime reads it to know whether the optimizer
    skips a step on the device (a fused one) or the runtime skips it."""
    opt._opt_called = True  # type: ignore[attr-defined]
    rt = _runtime(opt)
    if rt is None:
        return type(opt).step(opt, closure, **kw)
    d = opt.__dict__
    verdict: dict[str, Any] = {k: d.pop(k) for k in ("grad_scale", "found_inf") if k in d}
    rt.__dict__.update(verdict)
    own = d["_usbyte_own_amp"]
    if own is _ABSENT:
        del d["_step_supports_amp_scaling"]
    else:
        d["_step_supports_amp_scaling"] = own
    try:
        return rt.step(closure)
    finally:
        d["_step_supports_amp_scaling"] = True
        for k in verdict:
            rt.__dict__.pop(k, None)
        d.update(verdict)


_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    rt = _runtime(opt)
    if rt is None:
        return type(opt).zero_grad(opt, set_to_none)
    return rt.zero_grad(set_to_none)


def _state_dict_hook(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
    """The runtime's state dict (pending updates applied first; in sharded mode the full
    state gathered from the shards) instead of the optimizer's own."""
    rt = _runtime(opt)
    if rt is None:
        return None
    with inner(opt):
        return rt.state_dict()


def _load_state_dict(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    rt = _runtime(opt)
    if rt is None:
        return type(opt).load_state_dict(opt, state_dict)
    with inner(opt):
        rt.load_state_dict(state_dict)


def _add_param_group(opt: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    if _runtime(opt) is None:
        return type(opt).add_param_group(opt, param_group)
    raise UsbyteError("add_param_group on an optimizer taken over by usbyte_opt."
                      "DistributedDataParallel: those parameters would not be averaged; add "
                      "the group before its first step (or before passing it as optimizer=)")


class _Groups(list):  # type: ignore[type-arg]
    """The optimizer's ``param_groups`` list in sharded mode: iterating it (as a
    ``GradScaler`` looking for non-finite gradients does, after backward) first reads the
    runtime's groups, which show a ``GradScaler`` the gradient shards and every rank's
    non-finite flag (:meth:`.sharded.Sharded.expose`). Any other reader sees the groups as
    they are."""

    __slots__ = ("_ref", "_busy")

    def __init__(self, groups: list[dict[str, Any]], ref: weakref.ref[torch.optim.Optimizer]):
        super().__init__(groups)
        self._ref = ref
        self._busy = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        opt = self._ref()
        rt = None if opt is None else _runtime(opt)
        if rt is not None and not self._busy and rt._state.sharded is not None:
            self._busy = True
            try:
                rt.param_groups   # noqa: B018 - read by a GradScaler: the shards shown
            finally:
                self._busy = False
        return super().__iter__()

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))   # copied or pickled: the plain list


@contextlib.contextmanager
def inner(opt: torch.optim.Optimizer) -> Iterator[None]:
    """The runtime calls the wrapped optimizer itself: its own methods, not the runtime's."""
    d = opt.__dict__
    before = d.get("_usbyte_inner", False)
    d["_usbyte_inner"] = True
    try:
        yield
    finally:
        d["_usbyte_inner"] = before


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj
