"""usbyte-opt in the Hugging Face ``transformers.Trainer``: :class:`UsbyteTrainer`.

``UsbyteTrainer`` is a ``Trainer`` with one more argument, ``schedule``; everything else (the
model, ``TrainingArguments``, data, callbacks, ``resume_from_checkpoint``) is the Trainer's.
The schedule decides the path (:func:`usbyte_opt.integrations.resolve`):

* **a schedule stock DDP can express** (``usbyte-opt optimize --strategy ddp-tuned``): the
  Trainer's own ``DistributedDataParallel``, built by Accelerate as always, with the planned
  buckets (:func:`usbyte_opt.ddp.planned_ddp_kwargs` put into the DDP keyword arguments
  Accelerate uses) and their check once DDP has rebuilt them
  (:func:`usbyte_opt.ddp.watch_buckets`). ``ddp_find_unused_parameters`` defaults to
  ``False`` here (the plan assumes every parameter gets a gradient every step, and DDP
  rebuilds its buckets in gradient-ready order only then); set it explicitly and it is
  passed on, or refused in one line where DDP could not keep the planned buckets with it.
* **any other schedule** (a runtime schedule, ``"auto"``, or none: the runtime's DDP-like
  default plan): the usbyte-opt runtime. The model is never wrapped in DDP; the Trainer's
  optimizer (its own, or one given with ``optimizers=``) is wrapped in
  :class:`~usbyte_opt.runtime.DistributedOptimizer` with DDP's gradient contract
  (``wait_in_backward=True``), so that ``max_grad_norm`` clipping and the logged
  ``grad_norm`` see the averaged gradients; the micro-batches of
  ``gradient_accumulation_steps`` that do not sync run in the runtime's ``no_sync()``, where
  the Trainer asks Accelerate for DDP's; the LR scheduler works on it; checkpoints
  (``save_steps``, ``save_model``) and ``resume_from_checkpoint`` keep the wrapped optimizer's
  own state format; evaluation, checkpoints and the end of ``train()`` first apply every
  pending update (:meth:`~usbyte_opt.runtime.DistributedOptimizer.synchronize`). With
  ``fp16`` (a ``GradScaler``), a step the scaler skips on an overflow is reported skipped
  (``accelerator.optimizer_step_was_skipped``), so the LR scheduler does not step after it, as
  under the Trainer's DDP.

The run says which path it takes, once, on rank 0. Start it as the Trainer is started:
``torchrun --nproc-per-node N train.py``, or ``usbyte-opt launch --schedule S
--nproc-per-node N train.py`` (the schedule then comes from ``$USBYTE_SCHEDULE``). In a single
process (no process group) there is nothing to all-reduce, and it trains as the plain
Trainer.

Example (in a script started by torchrun)::

    from usbyte_opt.integrations.transformers import UsbyteTrainer

    trainer = UsbyteTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                            schedule="schedule.json")
    trainer.train()

Requires ``pip install 'usbyte-opt[transformers]'`` (transformers and accelerate).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from ..errors import UsbyteError
from ..runtime.default_plan import uncompiled
from ._common import Route, log_plan, report_skipped_steps, resolve, runtime_kwargs

#: The name the integration gives itself in its log line and errors.
TRAINER = "transformers"

__all__ = ["UsbyteTrainer"]


def _inner(opt: Any) -> Any:
    """The optimizer under Accelerate's ``AcceleratedOptimizer`` wrappers."""
    while type(opt).__name__ == "AcceleratedOptimizer" and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


class _PlannedDDPHandler:
    """Accelerate's DDP keyword-arguments handler with the planned buckets.

    Accelerate builds ``DistributedDataParallel(model, **handler.to_kwargs())`` and then calls
    ``handler.register_comm_hook(ddp_model)``; this handler adds ``bucket_cap_mb_list`` (and
    the ``find_unused_parameters`` the plan allows) to the Trainer's own DDP arguments, and
    watches the buckets DDP rebuilds. It is installed on the accelerator after it is built
    (Accelerate looks its handlers up by exact class, and ``DistributedDataParallelKwargs``
    has no field for a list of bucket caps).
    """

    def __init__(self, base: Any, trainer: UsbyteTrainer):
        self._base = base
        self._trainer = weakref.ref(trainer)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_base" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_base"], name)

    def to_kwargs(self) -> dict[str, Any]:
        trainer = self._trainer()
        assert trainer is not None
        kwargs = dict(self._base.to_kwargs())
        kwargs.pop("bucket_cap_mb", None)
        kwargs.pop("find_unused_parameters", None)
        kwargs.pop("static_graph", None)
        return {**kwargs, **trainer._planned_kwargs(trainer.model)}

    def register_comm_hook(self, model: Any) -> None:
        from ..ddp import watch_buckets

        self._base.register_comm_hook(model)
        trainer = self._trainer()
        assert trainer is not None and trainer.usbyte_plan.schedule is not None
        watch_buckets(model, trainer.usbyte_plan.schedule)


class _SynchronizeAtTrainEnd(TrainerCallback):
    """First of the callbacks: every pending update is applied before ``on_train_end`` runs
    (the others may read or save the weights)."""

    def __init__(self, trainer: UsbyteTrainer):
        self._trainer = weakref.ref(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.synchronize()


class UsbyteTrainer(Trainer):
    """A ``transformers.Trainer`` whose gradient all-reduce follows a usbyte-opt schedule.

    Args:
        *args, **kwargs: the ``Trainer``'s, unchanged.
        schedule: a :class:`~usbyte_opt.formats.Schedule`, the path of a schedule file,
            ``"auto"`` (the runtime plans in the run), or ``None``: ``$USBYTE_SCHEDULE`` (set
            by ``usbyte-opt launch``), else the runtime's DDP-like default plan.
        runtime_options: keyword arguments for
            :class:`~usbyte_opt.runtime.DistributedOptimizer` on the runtime path
            (``verify``, ``check_every``, ``find_unused_parameters``, ...; not ``schedule``
            or ``process_group``). ``wait_in_backward`` is always ``True``: the Trainer clips
            and logs the gradient norm right after ``backward()``. Unless given here,
            ``broadcast_buffers`` and ``find_unused_parameters`` follow
            ``TrainingArguments.ddp_broadcast_buffers`` / ``ddp_find_unused_parameters``
            when those are set.

    Attributes:
        usbyte_plan: the :class:`~usbyte_opt.integrations.Route`: ``usbyte_plan.path`` is
            ``"ddp"`` or ``"runtime"``.
        usbyte_optimizer: on the runtime path, the
            :class:`~usbyte_opt.runtime.DistributedOptimizer` once ``train()`` has built it
            (``None`` before, and on the DDP path).

    Raises:
        UsbyteError: a bad runtime option; a schedule stock DDP cannot run with the
            arguments given (``ddp_bucket_cap_mb`` set, ``ddp_find_unused_parameters=True``
            with an order DDP will not keep); the runtime with DeepSpeed, FSDP or
            ``sync_each_batch`` (the runtime averages the gradients itself, once per
            optimizer step). The model's checks (tensors against the schedule) raise
            :class:`~usbyte_opt.errors.MismatchError`, on every rank.
        FormatError: the schedule file is missing or malformed.
    """

    def __init__(self, *args: Any, schedule: Any = None,
                 runtime_options: dict[str, Any] | None = None, **kwargs: Any):
        self.usbyte_plan: Route = resolve(schedule)
        self._runtime_kwargs = runtime_kwargs(dict(runtime_options or {}), TRAINER)
        self.usbyte_optimizer: Any = None
        self._distributed = False
        super().__init__(*args, **kwargs)
        self.callback_handler.callbacks.insert(0, _SynchronizeAtTrainEnd(self))
        if not self._distributed:
            if self.args.process_index == 0:
                print(f"usbyte-opt ({TRAINER}): a single process (no process group): nothing "
                      "to all-reduce, training as the plain Trainer", file=sys.stderr, flush=True)
            return
        self._check_args()
        if self.usbyte_plan.path == "ddp" and self.model is not None:
            self._planned_kwargs(self.model)   # refuse early what DDP cannot run as planned
        log_plan(self.usbyte_plan, TRAINER, self.args.process_index)

    # --------------------------------------------------------------------------------------
    # Set-up: where the Trainer builds its accelerator, DDP and optimizer
    # --------------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with the schedule's path put where it builds DDP: the
        planned buckets in its DDP arguments, or (runtime path) no DDP at all."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        self._distributed = dist.is_available() and dist.is_initialized()
        if not self._distributed:
            return
        if self.usbyte_plan.path == "ddp":
            acc.ddp_handler = _PlannedDDPHandler(acc.ddp_handler, self)
            return
        prepare_model, prepare_optimizer, no_sync = acc.prepare_model, acc.prepare_optimizer, acc.no_sync
        ref = weakref.ref(self)

        def prepare_plain(model: Any, device_placement: bool | None = None,
                          evaluation_mode: bool = False) -> Any:
            # Accelerate's preparation (device, autocast, compile) without the DDP wrapper:
            # the runtime averages the gradients itself.
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        def runtime_no_sync(model: Any) -> Any:
            # The Trainer asks for DDP's no_sync() on the micro-batches that must not sync.
            trainer = ref()
            opt = None if trainer is None else trainer.usbyte_optimizer
            # (torch_compile: Accelerate unwraps to the compiled module; the model is inside)
            if opt is not None and uncompiled(acc.unwrap_model(model)) is uncompiled(trainer.model):
                return opt.no_sync()
            return no_sync(model)

        def prepare_reporting(optimizer: Any, device_placement: bool | None = None) -> Any:
            # Accelerate's AcceleratedOptimizer, made to report the steps GradScaler skips
            # (the Trainer then does not step its LR scheduler, as under DDP).
            from ..runtime import DistributedOptimizer

            prepared = prepare_optimizer(optimizer, device_placement=device_placement)
            if isinstance(_inner(prepared), DistributedOptimizer):
                report_skipped_steps(prepared)
            return prepared

        acc.prepare_model = prepare_plain
        acc.prepare_optimizer = prepare_reporting
        acc.no_sync = runtime_no_sync

    def _check_args(self) -> None:
        a = self.args
        if self.usbyte_plan.path == "ddp":
            if a.ddp_bucket_cap_mb is not None:
                raise UsbyteError(f"ddp_bucket_cap_mb={a.ddp_bucket_cap_mb}: the schedule "
                                  f"({self.usbyte_plan.source}) gives the buckets; leave "
                                  "ddp_bucket_cap_mb unset")
            return
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or a.fsdp:
            what = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            raise UsbyteError(f"{what}: the usbyte-opt runtime averages the gradients of the "
                              "plain model itself; use a ddp-tuned schedule (stock DDP) or no "
                              f"usbyte-opt with {what}")
        plugin = getattr(self.accelerator.gradient_state, "plugin_kwargs", {}) or {}
        if plugin.get("sync_each_batch", False):
            raise UsbyteError("gradient_accumulation_kwargs sync_each_batch=True: the usbyte-opt "
                              "runtime communicates once per optimizer step; leave it unset")

    def _planned_kwargs(self, model: torch.nn.Module) -> dict[str, Any]:
        """DDP's bucket arguments for ``model`` on the DDP path (checked against the schedule)."""
        from ..ddp import planned_ddp_kwargs
        from ..runtime.checks import check_model, model_label
        from ..runtime.default_plan import model_tensors

        plan, a = self.usbyte_plan, self.args
        assert plan.schedule is not None
        check_model(plan.schedule, model_tensors(model), plan.source, model_label(model))
        # The plan assumes every parameter gets its gradient every step: with
        # find_unused_parameters DDP would never rebuild its buckets in gradient-ready order.
        # HF turns it on by default for many models; here only when asked for.
        find_unused = bool(a.ddp_find_unused_parameters)
        return planned_ddp_kwargs(plan.schedule, model, find_unused_parameters=find_unused,
                                  static_graph=bool(a.ddp_static_graph), source=plan.source)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer; on the runtime path wrapped in
        :class:`~usbyte_opt.runtime.DistributedOptimizer` (once) on the plain model."""
        opt = super().create_optimizer(model)
        if not self._distributed or self.usbyte_plan.path != "runtime":
            return opt
        from ..runtime import DistributedOptimizer

        inner = _inner(opt)
        if isinstance(inner, DistributedOptimizer):
            self.usbyte_optimizer = inner
            return opt
        kw = dict(self._runtime_kwargs)
        if self.args.ddp_broadcast_buffers is not None:
            kw.setdefault("broadcast_buffers", bool(self.args.ddp_broadcast_buffers))
        if self.args.ddp_find_unused_parameters is not None:
            kw.setdefault("find_unused_parameters", bool(self.args.ddp_find_unused_parameters))
        self.usbyte_optimizer = DistributedOptimizer(
            inner, self.model, schedule=self.usbyte_plan.runtime_schedule, **kw)
        self.optimizer = self.usbyte_optimizer
        return self.optimizer

    # --------------------------------------------------------------------------------------
    # Every update applied before the weights are read: evaluation, checkpoints, the end
    # --------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish the runtime's communication and apply its pending updates (nothing on the
        DDP path): the weights are then the trained ones. Local: issues no collective."""
        if self.usbyte_optimizer is not None:
            self.usbyte_optimizer.synchronize()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; when it returns every update has been applied."""
        out = super().train(*args, **kwargs)
        self.synchronize()
        return out

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (also what checkpoints save), every update applied first."""
        self.synchronize()
        super().save_model(output_dir, _internal_call=_internal_call)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate``, every update applied first."""
        self.synchronize()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict``, every update applied first."""
        self.synchronize()
        return super().predict(*args, **kwargs)

