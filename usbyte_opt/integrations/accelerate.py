"""usbyte-opt in a Hugging Face Accelerate loop: :func:`prepare`.

``prepare(accelerator, *objects, schedule=S)`` takes the place of
``accelerator.prepare(*objects)``: like it, it takes the model, the optimizer and any other
objects of the run (data loaders, LR schedulers, ...) in any order and returns them prepared,
in the order given; exactly one of them is a module and one an optimizer, which get the
schedule's all-reduce. The rest of the loop is Accelerate's own, as its docs show it
(``pip install 'usbyte-opt[transformers]'`` brings accelerate)::

    from accelerate import Accelerator
    from usbyte_opt.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                  schedule="schedule.json")
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")          # and accelerator.load_state("ckpt") to resume

``prepare(accelerator, model, optimizer)`` alone returns ``(model, optimizer)``; the loader and
scheduler may then go to ``accelerator.prepare`` separately. Started with ``usbyte-opt launch
--schedule S --nproc-per-node N train.py`` (which runs ``torchrun`` with
``$USBYTE_SCHEDULE=S``), ``schedule`` may be left out.

**The schedule decides** (:func:`usbyte_opt.integrations.resolve`):

* a schedule stock DDP can express (the ``ddp-tuned`` strategy's) runs **Accelerate's own
  DistributedDataParallel with the planned buckets**: ``accelerator.prepare(*objects)`` builds
  the DDP, with the keyword arguments of the user's ``DistributedDataParallelKwargs`` handler
  (if any) and :func:`usbyte_opt.ddp.planned_ddp_kwargs` (``find_unused_parameters`` and
  ``static_graph`` taken from that handler); DDP's buckets are checked once after its rebuild
  (:func:`usbyte_opt.ddp.watch_buckets`);
* any other schedule runs **the usbyte-opt runtime** on the plain model, never inside DDP:
  the model gets Accelerate's device placement, mixed precision and ``torch.compile`` (its
  ``prepare_model(..., evaluation_mode=True)``, which wraps nothing), the optimizer becomes a
  :class:`~usbyte_opt.runtime.DistributedOptimizer` with DDP's gradient contract
  (``wait_in_backward=True``: ``accelerator.clip_grad_norm_`` right after
  ``accelerator.backward`` sees the averaged gradients) inside Accelerate's own
  ``AcceleratedOptimizer`` (so ``step()`` and ``zero_grad()`` are skipped on the micro-batches
  that do not sync, and ``GradScaler`` runs as Accelerate runs it; on an fp16 overflow the
  runtime skips the update itself, and ``optimizer.step_was_skipped`` is ``True`` then, as
  under DDP, so a prepared LR scheduler does not step), and
  ``accelerator.accumulate(model)`` / ``accelerator.no_sync(model)`` enter the runtime's
  :meth:`~usbyte_opt.runtime.DistributedOptimizer.no_sync` (Accelerate calls the ``no_sync``
  of the model it is given; the model returned carries the runtime's). The other objects go
  to ``accelerator.prepare`` as they would without usbyte-opt (those before the model and the
  optimizer first, LR schedulers last), and an LR scheduler of the optimizer steps with the
  ``AcceleratedOptimizer`` returned, as ``accelerator.prepare`` binds it under DDP.

``save_state`` / ``load_state`` round-trip the model and the optimizer state on both paths:
on the runtime path, ``model.state_dict()`` and ``optimizer.state_dict()`` apply the pending
updates first, and a save-state pre-hook finishes anything in flight. Before reading the
parameters directly (a checksum, an export without ``state_dict``) call :func:`synchronize`.
The run logs which path it uses, once, on rank 0. With one process there is nothing to
all-reduce: :func:`prepare` is then ``accelerator.prepare(*objects)``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

from ..errors import UsbyteError
from ..formats import Schedule
from ._common import Route, log_plan, report_skipped_steps, resolve, runtime_kwargs

__all__ = ["prepare", "runtime_optimizer", "synchronize"]

TRAINER = "Accelerate"

#: Accelerate's distributed types the two paths run on (data parallel, one model replica per
#: process); DeepSpeed, FSDP, Megatron-LM and XLA shard or reduce gradients their own way.
_DATA_PARALLEL = ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                  "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")


def prepare(accelerator: Any, *objects: Any, schedule: Schedule | str | Any = None,
            **runtime_options: Any) -> tuple[Any, ...]:
    """``accelerator.prepare(*objects)`` with the schedule's all-reduce.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the run.
        *objects: what ``accelerator.prepare`` takes, in any order: exactly one module (the
            plain model, not prepared, not in DDP) and one optimizer (the plain optimizer over
            its parameters, not prepared), and any data loaders, LR schedulers or other
            objects of the run.
        schedule: a :class:`~usbyte_opt.formats.Schedule`, its path, ``"auto"``, or ``None``
            (then ``$USBYTE_SCHEDULE``, as ``usbyte-opt launch`` sets it; unset: the runtime's
            DDP-like default plan).
        **runtime_options: options of :class:`~usbyte_opt.runtime.DistributedOptimizer`
            (``verify``, ``check_every``, ...) for the runtime path; ``wait_in_backward`` is
            always on, and accumulation is Accelerate's (``backward_passes_per_step`` is
            refused).

    Returns:
        The objects prepared, in the order given (``(model, optimizer)`` for those two): on
        the DDP path all as ``accelerator.prepare`` returns them (Accelerate's DDP model and
        ``AcceleratedOptimizer``); on the runtime path the plain model (on its device) and an
        ``AcceleratedOptimizer`` around the ``DistributedOptimizer``, the others as
        ``accelerator.prepare`` returns them, an LR scheduler of the optimizer bound to the
        optimizer returned.

    Raises:
        UsbyteError: not exactly one module and one optimizer among ``objects``; an
            Accelerate setup the runtime cannot run in (DeepSpeed, FSDP, Megatron-LM, XLA,
            tensor or context parallelism, ``sync_each_batch=True``), a model or optimizer
            already prepared, a runtime option it does not take, or a
            ``DistributedDataParallelKwargs(bucket_cap_mb=...)`` on the DDP path.
        MismatchError: the model does not match the schedule.
        FormatError: the schedule file is missing or malformed.
    """
    from accelerate.optimizer import AcceleratedOptimizer

    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) != 1:
        raise UsbyteError(f"Accelerate: prepare() takes exactly one model and one optimizer "
                          f"among its objects, got {len(models)} module(s) and "
                          f"{len(optimizers)} optimizer(s): prepare the others with "
                          "accelerator.prepare")
    model, optimizer = models[0], optimizers[0]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UsbyteError("Accelerate: the model is already wrapped in DistributedDataParallel "
                          "(prepared?): pass the plain model to usbyte_opt's prepare()")
    if isinstance(optimizer, AcceleratedOptimizer):
        raise UsbyteError("Accelerate: the optimizer is already prepared (AcceleratedOptimizer): "
                          "pass the plain optimizer to usbyte_opt's prepare()")
    _check_setup(accelerator)
    if "backward_passes_per_step" in runtime_options:
        raise UsbyteError("Accelerate: runtime option backward_passes_per_step: accumulation is "
                          "Accelerate's (gradient_accumulation_steps and accelerator.accumulate)")
    kwargs = runtime_kwargs(runtime_options, TRAINER)
    plan = resolve(schedule)
    if not accelerator.use_distributed:
        if accelerator.is_main_process:
            print(f"usbyte-opt ({TRAINER}): one process, nothing to all-reduce: Accelerate's own "
                  "prepare()", file=sys.stderr, flush=True)
        return _as_tuple(accelerator.prepare(*objects), len(objects))
    if plan.path == "ddp":
        return _prepare_ddp(accelerator, objects, model, plan)
    return _prepare_runtime(accelerator, objects, model, optimizer, plan, kwargs)


def runtime_optimizer(optimizer: Any) -> Any:
    """The :class:`~usbyte_opt.runtime.DistributedOptimizer` inside what :func:`prepare`
    returned (``None`` on the DDP path)."""
    from ..runtime import DistributedOptimizer

    while optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def synchronize(optimizer: Any) -> None:
    """Finish every all-reduce and pending update of the optimizer :func:`prepare` returned
    (nothing to do on the DDP path): before reading the parameters directly, and at the end
    of training. ``model.state_dict()``, ``save_state`` and a forward need no call."""
    opt = runtime_optimizer(optimizer)
    if opt is not None:
        opt.synchronize()


def _check_setup(accelerator: Any) -> None:
    """Refuse, in one line, an Accelerate setup where neither path applies."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    pc = getattr(accelerator, "parallelism_config", None)
    if getattr(accelerator, "is_fsdp2", False) or (kind != "NO" and kind not in _DATA_PARALLEL):
        raise UsbyteError(f"Accelerate: distributed type {kind}: usbyte-opt plans the all-reduce "
                          "of data-parallel training (DDP); run without DeepSpeed, FSDP, "
                          "Megatron-LM or XLA")
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise UsbyteError("Accelerate: tensor or context parallelism: usbyte-opt plans the "
                          "all-reduce of plain data-parallel training")
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise UsbyteError("Accelerate: sync_each_batch=True: usbyte-opt communicates once per "
                          "optimizer step (accumulating under no_sync, as DDP by default); use "
                          "GradientAccumulationPlugin(sync_each_batch=False)")


def _planned_handler(accelerator: Any, model: torch.nn.Module, plan: Route) -> Any:
    """The user's ``DistributedDataParallelKwargs`` (or the default one) with the planned
    buckets: an instance of a subclass whose ``to_kwargs()`` adds
    :func:`~usbyte_opt.ddp.planned_ddp_kwargs` (so ``accelerator.prepare`` builds DDP with
    them) and keeps the user's comm hook."""
    from accelerate.utils import DistributedDataParallelKwargs

    from ..ddp import planned_ddp_kwargs

    user = accelerator.ddp_handler or DistributedDataParallelKwargs()
    if user.bucket_cap_mb != DistributedDataParallelKwargs.bucket_cap_mb:
        raise UsbyteError(f"Accelerate: DistributedDataParallelKwargs(bucket_cap_mb="
                          f"{user.bucket_cap_mb}): the schedule gives the buckets; leave "
                          "bucket_cap_mb out")
    planned = planned_ddp_kwargs(plan.schedule, model,  # type: ignore[arg-type]
                                 find_unused_parameters=user.find_unused_parameters,
                                 static_graph=user.static_graph, source=plan.source)
    fields = {f.name: getattr(user, f.name) for f in dataclasses.fields(user) if f.init}
    return _planned_class()(**fields, planned=planned)


@functools.cache
def _planned_class() -> type:
    """``PlannedDDPKwargs``: a ``DistributedDataParallelKwargs`` that adds the planned
    buckets (defined on first use, so that importing this module does not import
    accelerate)."""
    from accelerate.utils import DistributedDataParallelKwargs

    @dataclasses.dataclass
    class PlannedDDPKwargs(DistributedDataParallelKwargs):
        """Accelerate's DDP keyword arguments plus the schedule's ``bucket_cap_mb_list``."""

        planned: dict = dataclasses.field(default_factory=dict)

        def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option",
                                       "planned")):
            return super().to_dict(ignore_keys)

        def to_kwargs(self):
            kw = super().to_kwargs()
            kw.pop("bucket_cap_mb", None)
            return {**kw, **self.planned}

    return PlannedDDPKwargs


def _as_tuple(prepared: Any, n: int) -> tuple[Any, ...]:
    """What ``accelerator.prepare`` returned for ``n`` objects, as a tuple (it returns one
    object alone)."""
    return tuple(prepared) if n > 1 else (prepared,)


def _prepare_others(accelerator: Any, objects: list[Any]) -> list[Any]:
    """``accelerator.prepare`` of objects other than the model and the optimizer."""
    return list(_as_tuple(accelerator.prepare(*objects), len(objects))) if objects else []


def _prepare_ddp(accelerator: Any, objects: tuple[Any, ...], model: torch.nn.Module,
                 plan: Route) -> tuple[Any, ...]:
    """Accelerate's own DDP with the planned buckets: the planned handler stands in for the
    user's for this one ``accelerator.prepare`` call, which prepares every object as without
    usbyte-opt (other models prepared later keep the user's handler)."""
    from accelerate.utils import is_compiled_module

    from ..ddp import watch_buckets
    from ..runtime.checks import check_model, model_label
    from ..runtime.default_plan import model_tensors

    assert plan.schedule is not None
    check_model(plan.schedule, model_tensors(model), plan.source, model_label(model))
    handler = _planned_handler(accelerator, model, plan)
    saved = accelerator.ddp_handler
    accelerator.ddp_handler = handler
    try:
        out = _as_tuple(accelerator.prepare(*objects), len(objects))
    finally:
        accelerator.ddp_handler = saved
    prepared = next(p for o, p in zip(objects, out) if o is model)
    ddp = prepared._orig_mod if is_compiled_module(prepared) else prepared
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise UsbyteError(f"Accelerate: accelerator.prepare built {type(ddp).__name__}, not "
                          "DistributedDataParallel: the planned buckets cannot apply")
    watch_buckets(ddp, plan.schedule)
    log_plan(plan, TRAINER, accelerator.process_index)
    return out


def _prepare_runtime(accelerator: Any, objects: tuple[Any, ...], model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, plan: Route,
                     kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The runtime on the plain model, inside Accelerate's optimizer wrapper; the other
    objects prepared by Accelerate in its own order: those before the model and the optimizer
    first, then the rest, its LR schedulers last (they bind to the optimizers prepared)."""
    from torch.optim.lr_scheduler import LRScheduler

    from ..runtime import DistributedOptimizer

    if hasattr(type(model), "no_sync"):
        raise UsbyteError(f"Accelerate: {type(model).__name__} defines no_sync(): Accelerate "
                          "would call it for accumulation instead of the runtime's")
    first = min(i for i, o in enumerate(objects) if o is model or o is optimizer)
    before = [i for i in range(first) if not isinstance(objects[i], LRScheduler)]
    after = [i for i in range(len(objects)) if i not in before
             and objects[i] is not model and objects[i] is not optimizer]
    out: list[Any] = list(objects)
    for i, p in zip(before, _prepare_others(accelerator, [objects[i] for i in before])):
        out[i] = p
    # Device placement, mixed precision (autocast forward) and torch.compile, as Accelerate
    # does them for training, but no DDP; the model is marked prepared (a later
    # accelerator.prepare(model) returns it unchanged) and saved by save_state.
    prepared: Any = accelerator.prepare_model(model, evaluation_mode=True)
    log_plan(plan, TRAINER, accelerator.process_index)   # the run's start line, before the runtime's
    dopt = DistributedOptimizer(optimizer, prepared, schedule=plan.runtime_schedule, **kwargs)
    # accelerator.accumulate(model) / no_sync(model) call getattr(model, "no_sync") when
    # distributed: the runtime's, DDP's accumulation protocol.
    prepared.no_sync = dopt.no_sync
    # save_state takes model.state_dict() and optimizer.state_dict(), which apply the pending
    # updates first (the runtime's hooks); these pre-hooks leave nothing in flight while the
    # files are written or read.
    accelerator.register_save_state_pre_hook(lambda *_: dopt.synchronize())
    accelerator.register_load_state_pre_hook(lambda *_: dopt.synchronize())
    # Accelerate's AcceleratedOptimizer around it, marked prepared as accelerator.prepare
    # marks what it returns (so that passing it to accelerator.prepare again wraps nothing).
    opt = accelerator.prepare(dopt)
    report_skipped_steps(opt)   # step_was_skipped on an fp16 overflow, as under DDP
    for i, o in enumerate(objects):
        if o is model or o is optimizer:
            out[i] = prepared if o is model else opt
    for i, p in zip(after, _prepare_others(accelerator, [objects[i] for i in after])):
        # Accelerate binds a scheduler to the prepared optimizer whose .optimizer is the
        # scheduler's; here that is the DistributedOptimizer, so it would fall back to all the
        # accelerator's optimizers: bound to the one returned, as under DDP.
        if getattr(getattr(p, "scheduler", None), "optimizer", None) is optimizer:
            p.optimizers = [opt]
        out[i] = p
    return tuple(out)
