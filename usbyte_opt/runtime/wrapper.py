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
*taken over*: at the first forward, the one optimizer over the model's parameters (created
before or after wrapping, as DDP scripts do both) is found and wrapped in a
:class:`~usbyte_opt.runtime.DistributedOptimizer` (an evaluation under ``torch.no_grad()``
before that runs the plain module); the user's object keeps working, its
``step()``, ``zero_grad()``, ``state_dict()`` and ``load_state_dict()`` now the runtime's.
Pass ``optimizer=`` to name it instead (several optimizers over one model are refused).

**The fallback is DDP itself.** With verification on (the default for a schedule given, and
for ``"auto"``), the plan is timed in alternating windows against torch's DDP over the same
module (built beside it, with the arguments given: DDP's own buckets) and kept only when
measurably faster; otherwise the runtime's hooks come off and DDP runs from then on
(:meth:`~usbyte_opt.runtime.DistributedOptimizer.use_ddp_fallback`). The user's optimizer
then steps as under DDP. DDP's gradient buckets cost one more gradient's worth of memory
while both exist.

DDP's contract holds (:mod:`.guard`): code that reads or changes a gradient between
``backward()`` and ``step()`` first waits for the averaged gradients, and code that touches a
parameter between ``step()`` and the next forward first sees its update.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from .checks import broadcast_from_rank0, require_initialized
from .optimizer import DistributedOptimizer
from .start import ScheduleArg, requested

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` that trains on a planned
    schedule (usbyte-opt's runtime), with DDP's results.

    Args:
        module: the model (on this rank's device; a ``torch.compile``'d model works).
        device_ids, output_device, dim: as DDP's (inputs are moved to ``device_ids[0]``).
        broadcast_buffers: as DDP's (rank 0's buffers after each training forward).
        process_group: the data-parallel group (default: the world).
        bucket_cap_mb, gradient_as_bucket_view, check_reduction: accepted for DDP's signature;
            the schedule decides the blocks.
        find_unused_parameters: as DDP's. ``False`` (DDP's default) raises, as DDP does, when
            a trainable parameter gets no gradient in a step; ``True`` exchanges the usage map.
        static_graph: accepted (the runtime needs no hint).
        schedule: a :class:`~usbyte_opt.formats.Schedule`, a schedule file, ``"auto"``; default
            ``$USBYTE_SCHEDULE``, else none: torch's DDP runs.
        optimizer: the optimizer to take over; default: the one found at the first forward.
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
        >>> model.module is net, type(model.optimizer).__name__
        (True, 'DistributedOptimizer')
        >>> dist.destroy_process_group()
    """

    def __init__(self, module: torch.nn.Module, device_ids: list[Any] | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool = True,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, *,
                 schedule: ScheduleArg = None, optimizer: torch.optim.Optimizer | None = None,
                 **runtime: Any):
        super().__init__()
        require_initialized()
        if device_ids is not None and len(device_ids) != 1:
            raise UsbyteError(f"device_ids: expected one device per process, got {device_ids!r}")
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self._sync = True
        self._schedule = schedule
        self._runtime_kwargs = runtime
        self._opt: DistributedOptimizer | None = None
        self._ddp_kwargs: dict[str, Any] = {
            "device_ids": device_ids, "output_device": output_device, "dim": dim,
            "broadcast_buffers": broadcast_buffers, "process_group": process_group,
            "bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction, "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph}
        # torch DDP over the module, outside the module tree (state_dict keys stay DDP's):
        # what runs when nothing is planned, and the fallback of verification.
        self.__dict__["_ddp"] = None
        if not requested(schedule).given:
            self.__dict__["_ddp"] = self._torch_ddp()   # nothing planned: DDP itself
            return
        # DDP's starting point, at construction as DDP: rank 0's parameters and buffers (an
        # evaluation before the optimizer is found already sees them).
        broadcast_from_rank0([p.detach() for p in module.parameters()], process_group, None)
        if broadcast_buffers:
            broadcast_from_rank0(list(module.buffers()), process_group, None, "buffers")
        if optimizer is not None:
            self._attach(optimizer)

    def _torch_ddp(self) -> torch.nn.Module:
        """torch's ``DistributedDataParallel`` over the module, with the arguments given."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(self.module, **self._ddp_kwargs)

    @property
    def runs_torch_ddp(self) -> bool:
        """Whether torch's DDP runs now: nothing was planned, or the plan was not measurably
        faster than DDP (or is being timed against it)."""
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
        """The runtime driving the taken-over optimizer (``None`` before the first forward,
        and when nothing is planned: then torch's DDP runs)."""
        return self._opt

    def _set_static_graph(self) -> None:
        """DDP's private switch (some trainers call it): nothing to do here."""

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        ddp = self.__dict__["_ddp"]
        if ddp is not None and self._opt is None:
            return ddp.register_comm_hook(state, hook)   # nothing planned: DDP's own
        raise UsbyteError("register_comm_hook: usbyte-opt's schedule decides the communication; "
                          "use torch's DistributedDataParallel for a communication hook")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self.__dict__["_ddp"]
        if ddp is not None and self._opt is None:
            return ddp.join(*args, **kwargs)
        raise UsbyteError("join() (uneven inputs) is not supported by usbyte-opt's runtime: give "
                          "every rank the same number of steps")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.runs_torch_ddp:
            ddp = self.__dict__["_ddp"]
            ddp.require_backward_grad_sync = self._sync
            if ddp.training != self.training:
                ddp.training = self.training
            return ddp(*inputs, **kwargs)
        opt = self._opt
        if opt is None and torch.is_grad_enabled():   # the first forward that can train
            self._attach(None)
            opt = self._opt
        if opt is not None:
            opt._state.comm.no_sync = not self._sync
        if self.device_ids:
            dev = torch.device(self.device_ids[0]) if not isinstance(self.device_ids[0], int) \
                else torch.device("cuda", self.device_ids[0])
            inputs, kwargs = _to(inputs, dev), _to(kwargs, dev)
        return self.module(*inputs, **kwargs)

    # -- the optimizer -------------------------------------------------------------------------

    def _attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Find (or take) the optimizer over the model's parameters and run it on the runtime."""
        error: str | None = None
        if optimizer is None:
            found = _optimizers_over(self.module)
            if len(found) != 1:
                what = "no optimizer" if not found else f"{len(found)} optimizers"
                error = (f"usbyte_opt.DistributedDataParallel: {what} over the model's parameters "
                         "at its first forward; create the optimizer before the first forward, "
                         "or pass it: DistributedDataParallel(model, ..., optimizer=opt)")
            else:
                optimizer = found[0]
        if error is not None:
            raise UsbyteError(error)
        assert optimizer is not None
        kw = dict(self._runtime_kwargs)
        kw.setdefault("broadcast_buffers", self.broadcast_buffers)
        kw.setdefault("find_unused_parameters", self.find_unused_parameters)
        schedule = self._schedule
        rt = DistributedOptimizer(optimizer, self.module, schedule, self.process_group, **kw)
        take_over(optimizer, rt)
        self._opt = rt
        if rt._tuner is not None and rt._tuner.phase != "settled":   # verifying or planning
            rt.use_ddp_fallback(self._torch_ddp())
            self.__dict__["_ddp"] = rt._fallback_ddp


def _optimizers_over(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers alive now whose parameters are the model's (a scan of live objects,
    once, at the first forward)."""
    ids = {id(p) for p in model.parameters() if p.requires_grad}
    out = []
    for o in gc.get_objects():
        tp = type(o)   # (not isinstance: it would read __class__ of every live object)
        if issubclass(tp, torch.optim.Optimizer) and not issubclass(tp, DistributedOptimizer):
            ps = [p for g in o.param_groups for p in g["params"]]
            if ps and any(id(p) in ids for p in ps):
                out.append(o)
    return out


_TAKEN: dict[type, type] = {}


def take_over(optimizer: torch.optim.Optimizer, rt: DistributedOptimizer) -> None:
    """Route the user's ``optimizer`` object through ``rt``: ``step()``, ``zero_grad()``,
    ``state_dict()``, ``load_state_dict()`` and ``add_param_group()`` become the runtime's,
    and ``GradScaler.step(optimizer)`` hands its verdict to the runtime. The runtime's own
    calls of the wrapped optimizer reach the original methods."""
    base = _base(optimizer) if getattr(type(optimizer), "_usbyte_taken", False) else type(optimizer)
    cls = _TAKEN.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "_usbyte_taken": True, "_step_supports_amp_scaling": True,
            "step": _step, "zero_grad": _zero_grad, "state_dict": _state_dict,
            "load_state_dict": _load_state_dict, "add_param_group": _add_param_group,
            "param_groups": property(_param_groups, _set_param_groups),
            "__module__": base.__module__, "__qualname__": base.__qualname__,
        })
        _TAKEN[base] = cls
    optimizer.__class__ = cls
    # An LR scheduler built before this wrapped step() on the object itself, calling the
    # original class's step: wrap the runtime's instead, as the scheduler would have.
    step = optimizer.__dict__.get("step")
    if step is not None and getattr(step, "_wrapped_by_lr_sched", False):
        optimizer.__dict__["step"] = _lr_sched_step(optimizer)
    optimizer.__dict__["_usbyte_rt"] = rt


def _lr_sched_step(optimizer: torch.optim.Optimizer) -> Any:
    """``step`` marked as an LR scheduler marks it (``_opt_called``, no order warning)."""
    ref = weakref.ref(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        assert opt is not None
        opt._opt_called = True  # type: ignore[attr-defined]
        return _step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def _runtime(opt: torch.optim.Optimizer) -> DistributedOptimizer | None:
    rt = opt.__dict__.get("_usbyte_rt")
    if rt is None or opt.__dict__.get("_usbyte_inner"):
        return None
    return rt


def _base(opt: torch.optim.Optimizer) -> Any:
    return type(opt).__mro__[1]


def _step(self: torch.optim.Optimizer, closure: Any = None, **kw: Any) -> Any:
    rt = _runtime(self)
    if rt is None:
        return _base(self).step(self, closure, **kw)
    # GradScaler's verdict, set on this object: the runtime's for this call (the optimizer's
    # own step, which the runtime calls, must not see it), back here for GradScaler to delete.
    d = self.__dict__
    verdict: dict[str, Any] = {k: d.pop(k) for k in ("grad_scale", "found_inf") if k in d}
    rt.__dict__.update(verdict)
    try:
        return rt.step(closure)
    finally:
        for k in verdict:
            rt.__dict__.pop(k, None)
        d.update(verdict)


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    rt = _runtime(self)
    if rt is None:
        return _base(self).zero_grad(self, set_to_none)
    return rt.zero_grad(set_to_none)


def _state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    rt = _runtime(self)
    if rt is None:
        return _base(self).state_dict(self)
    with inner(self):
        return rt.state_dict()


def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    rt = _runtime(self)
    if rt is None:
        return _base(self).load_state_dict(self, state_dict)
    with inner(self):
        rt.load_state_dict(state_dict)


def _param_groups(self: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's own groups; in sharded mode, read by a GradScaler after backward, the
    runtime's (which show it the gradient shards and every rank's non-finite flag)."""
    d = self.__dict__
    rt = d.get("_usbyte_rt")
    if rt is None or d.get("_usbyte_pg") or rt._state.sharded is None:
        return d["param_groups"]
    d["_usbyte_pg"] = True
    try:
        return rt.param_groups
    finally:
        d["_usbyte_pg"] = False


def _set_param_groups(self: torch.optim.Optimizer, value: list[dict[str, Any]]) -> None:
    self.__dict__["param_groups"] = value


def _add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    if _runtime(self) is None:
        return _base(self).add_param_group(self, param_group)
    raise UsbyteError("add_param_group after the first forward of usbyte_opt."
                      "DistributedDataParallel: those parameters would not be averaged; add "
                      "the group before the first forward")


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
