"""usbyte-opt in Lightning (``lightning.pytorch``): :class:`UsbyteStrategy`.

The LightningModule stays as it is; only the strategy changes::

    import lightning.pytorch as pl
    from usbyte_opt.integrations.lightning import UsbyteStrategy

    trainer = pl.Trainer(strategy=UsbyteStrategy(schedule="schedules/mine.json"),
                         accelerator="gpu", devices=8)
    trainer.fit(module, data)

Importing this module registers the strategy as ``"usbyte"``: ``Trainer(strategy="usbyte")``
then takes the schedule from ``$USBYTE_SCHEDULE``, which ``usbyte-opt launch --schedule S
--nproc-per-node N train.py`` sets (it runs ``torchrun``, which Lightning recognises).

The schedule decides the path (:func:`usbyte_opt.integrations.resolve`), and the run says which
one on rank 0's stderr:

* a schedule stock DDP can express (``usbyte-opt optimize --strategy ddp-tuned``): Lightning's
  own :class:`~lightning.pytorch.strategies.DDPStrategy`, whose
  ``DistributedDataParallel`` gets the planned buckets (``bucket_cap_mb_list``,
  :func:`usbyte_opt.ddp.planned_ddp_kwargs`); DDP's rebuilt buckets are checked against the
  plan once (a :class:`~usbyte_opt.runtime.UsbyteWarning` if they differ);
* any other: the usbyte-opt runtime on the plain LightningModule, never inside DDP. Each
  optimizer of ``configure_optimizers`` is wrapped in
  :class:`~usbyte_opt.runtime.DistributedOptimizer` with DDP's gradient contract
  (``wait_in_backward=True``: Lightning clips right after backward, on averaged gradients);
  ``accumulate_grad_batches`` runs its non-final passes in the optimizer's ``no_sync()``
  (through Lightning's ``block_backward_sync()``); pending updates are applied before
  validation, testing, prediction, checkpoints (``LightningModule.state_dict()``) and at the end
  of training. Checkpoints hold the wrapped optimizer's own state dict, so a checkpoint of
  either path (or of Lightning's DDP) resumes on either.

**Where the runtime's hooks go.** The runtime's root hooks (updates of the tensors used
before or outside their modules, DDP's rule for rank 0's module buffers at the start of a
forward through DDP) must run exactly once around the whole ``training_step``, as
Lightning's DDP runs the step through DDP's forward once. Lightning calls
``training_step``, not the LightningModule's ``forward``; and a ``training_step`` that calls
``self(x)`` would run the forward hooks of the LightningModule once per call, nested inside
the step. So the runtime is given a private root module that holds the LightningModule's own
parameters, buffers and submodules (same names, so a schedule profiled on the
LightningModule fits) and whose ``forward`` is the ``training_step``; the strategy calls the
step through it. Validation, test and predict steps, which Lightning's DDP also runs through
DDP's forward, run under the same buffer rule (:meth:`UsbyteStrategy._through_ddp`).

With manual optimization, the backward passes that only accumulate must run inside
``with self.trainer.strategy.block_backward_sync():`` (the optimizer's ``no_sync()``; under DDP
it saves their all-reduce): a second backward outside it before ``step()`` is refused with an
error that says so. Reading the optimizer's ``param_groups`` between such passes (which
``LightningOptimizer.toggle_model()`` does) issues the step's all-reduce early, and the next
backward is refused: on the runtime path, accumulate with ``block_backward_sync()``, not
``toggle_model(sync_grad=False)``. One optimizer per LightningModule on the runtime path
(Lightning allows several only with manual optimization); several run on the DDP path.

Mixed precision (``precision="16-mixed"``/``"bf16-mixed"``) with ``gradient_clip_val`` (or
``self.clip_gradients`` in manual optimization) trains as under Lightning's DDP: Lightning's
``MixedPrecision`` plugin would take the runtime (which sets ``_step_supports_amp_scaling``, so
that ``GradScaler`` hands its ``step()`` the overflow verdict) for a fused optimizer, neither
unscaling before clipping nor clipping; on the runtime path it judges the optimizer the runtime
wraps instead, for the duration of ``fit``.

In overlap mode, between ``optimizer.step()`` and the next training forward the parameters
still hold their values before that step's update (it is applied right before each module's
next use). Lightning's checkpoints, validation and the end of ``fit`` see the updated values;
a callback that reads parameters directly in ``on_train_batch_end`` should call
``trainer.strategy.synchronize()`` first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("usbyte_opt.integrations.lightning needs the lightning package: "
                      "pip install 'usbyte-opt[lightning]'") from e

from ..errors import UsbyteError
from ..formats import Schedule
from ._common import Route, log_plan, resolve, runtime_kwargs

TRAINER = "Lightning"

__all__ = ["UsbyteStrategy"]


class _Root(nn.Module):
    """The module the runtime trains: the LightningModule's parameters, buffers and submodules
    under their own names (shared, not copied), with ``training_step`` as its ``forward``.
    Its ``training`` flag is the LightningModule's."""

    def __init__(self, module: pl.LightningModule):
        super().__init__()
        object.__setattr__(self, "_lightning_module", module)  # not a submodule: no prefix
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(module, name))

    @property  # type: ignore[override]
    def training(self) -> bool:
        module = self.__dict__.get("_lightning_module")
        return True if module is None else module.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # Lightning sets train/eval on the LightningModule, whose flag this one reads

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._lightning_module.training_step(*args, **kwargs)

    @property
    def _usbyte_compiled_inside(self) -> bool:
        """``runtime.forward.COMPILED_INSIDE_ATTR``: the forward runs a compiled
        ``training_step`` when Lightning compiled the LightningModule (it compiles its
        ``forward`` and ``*_step`` methods one by one, ``from_compiled``); every update of a
        step then runs before it."""
        return getattr(self._lightning_module, "_compiler_ctx", None) is not None


def _takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales and skips on ``found_inf`` in its own ``step()`` (fused
    optimizers): Lightning's test (``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


_PRECISION_CLASSES: dict[type, type] = {}


def _runtime_precision(base: type) -> type:
    """``base`` (Lightning's ``MixedPrecision``, or a subclass that keeps its ``optimizer_step``
    and ``clip_gradients``) acting on a :class:`~usbyte_opt.runtime.DistributedOptimizer` as
    on the optimizer it wraps.

    ``MixedPrecision`` unscales the gradients (``scaler.unscale_``) right after the closure,
    before the ``on_before_optimizer_step`` hooks and ``gradient_clip_val``, unless the
    optimizer sets ``_step_supports_amp_scaling`` (fused optimizers, which unscale in
    ``step()``), and refuses to clip those. The runtime sets it so that ``GradScaler`` calls its
    ``step()`` on every step with ``found_inf`` (it skips the update itself, on every rank
    alike). Here that attribute is the wrapped optimizer's: for a plain one the gradients are
    unscaled after the closure and clipped as under DDP, then ``scaler.step`` still goes to
    the runtime; a fused one is refused clipping with Lightning's own message, as under DDP.
    """
    if base in _PRECISION_CLASSES:
        return _PRECISION_CLASSES[base]

    class RuntimeMixedPrecision(base):  # type: ignore[valid-type,misc]
        def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
            from ..runtime import DistributedOptimizer

            if (self.scaler is None or not isinstance(optimizer, DistributedOptimizer)
                    or not _takes_found_inf(optimizer) or _takes_found_inf(optimizer.optimizer)):
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            scaler = self.scaler

            def closure_then_unscale() -> Any:
                result = closure()
                # MixedPrecision's own condition: no unscaling where automatic optimization
                # skipped the backward (the closure returned None).
                if result is not None or not model.automatic_optimization:
                    scaler.unscale_(optimizer)
                return result

            return super().optimizer_step(optimizer, model=model, closure=closure_then_unscale,
                                          **kwargs)

        def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                           gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM
                           ) -> None:
            from ..runtime import DistributedOptimizer

            if isinstance(optimizer, LightningOptimizer):   # manual optimization's clip_gradients
                optimizer = optimizer.optimizer
            if isinstance(optimizer, DistributedOptimizer) and _takes_found_inf(optimizer):
                if _takes_found_inf(optimizer.optimizer):
                    optimizer = optimizer.optimizer    # Lightning's refusal, naming it as under DDP
                else:                                  # MixedPrecision's check is about that one
                    return super(MixedPrecision, self).clip_gradients(  # type: ignore[misc]
                        optimizer, clip_val, gradient_clip_algorithm)
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    RuntimeMixedPrecision.__name__ = RuntimeMixedPrecision.__qualname__ = base.__name__
    return _PRECISION_CLASSES.setdefault(base, RuntimeMixedPrecision)


class UsbyteStrategy(DDPStrategy):
    """A Lightning strategy that runs a usbyte-opt schedule: Lightning's DDP with the
    planned buckets for a schedule stock DDP can express, the usbyte-opt runtime otherwise
    (see the module's docstring).

    Args:
        schedule: a :class:`~usbyte_opt.formats.Schedule`, a schedule file, ``"auto"`` (plan
            inside the run), or ``None``: ``$USBYTE_SCHEDULE`` (``usbyte-opt launch`` sets it),
            else the runtime's DDP-like default plan.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
        ddp_kwargs: further ``DistributedDataParallel`` arguments for the DDP path
            (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ...;
            not ``bucket_cap_mb``/``bucket_cap_mb_list``: the schedule gives the buckets).
        **runtime_options: options of :class:`~usbyte_opt.runtime.DistributedOptimizer` for
            the runtime path (``verify``, ``check_every``, ``find_unused_parameters``,
            ``broadcast_buffers``, ...); ``wait_in_backward`` is always on.

    Raises:
        UsbyteError: an unknown runtime option, ``wait_in_backward=False``, bucket sizes in
            ``ddp_kwargs``; at ``fit``: a model that does not match the schedule
            (:class:`~usbyte_opt.errors.MismatchError`), several optimizers on the runtime path.
        FormatError: the schedule file is missing or malformed.

    Attributes:
        plan: the :class:`~usbyte_opt.integrations.Route` (``plan.path``: ``"ddp"`` or
            ``"runtime"``).
        distributed_optimizers: on the runtime path during ``fit``, the
            :class:`~usbyte_opt.runtime.DistributedOptimizer` of each optimizer.

    Example::

        trainer = pl.Trainer(strategy=UsbyteStrategy(schedule="s.json", verify=False),
                             accelerator="cpu", devices=2, accumulate_grad_batches=2,
                             gradient_clip_val=1.0)
    """

    strategy_name = "usbyte"

    def __init__(self, schedule: Schedule | str | os.PathLike | None = None, *,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 ddp_kwargs: Mapping[str, Any] | None = None, **runtime_options: Any):
        ddp_kwargs = dict(ddp_kwargs or {})
        for key in ("bucket_cap_mb", "bucket_cap_mb_list"):
            if key in ddp_kwargs:
                raise UsbyteError(f"{TRAINER}: ddp_kwargs {key}: the schedule gives the buckets; "
                                  f"do not pass {key}")
        self._runtime_options = runtime_kwargs(runtime_options, TRAINER)
        self.plan: Route = resolve(schedule)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method, **ddp_kwargs)  # type: ignore[arg-type]
        self._user_ddp_kwargs = ddp_kwargs
        self._root: _Root | None = None
        self.distributed_optimizers: list[Any] = []
        self._state_hooks: list[Any] = []
        self._failed = False
        self._accumulating = False   # a pass that only accumulates ran since the last step
        self._plugin_class: tuple[Any, type] | None = None   # a precision plugin to put back

    # ----------------------------------------------------------------------------------
    # Set-up: DDP with the planned buckets, or the runtime on the plain module
    # ----------------------------------------------------------------------------------

    def configure_ddp(self) -> None:
        """The DDP path: Lightning's DDP with the planned buckets, checked once after DDP's
        rebuild. The runtime path: no DDP; the runtime's root module."""
        module = self.lightning_module
        assert module is not None
        plan = self.plan
        if plan.path == "ddp":
            from ..ddp import planned_ddp_kwargs, watch_buckets
            from ..runtime.checks import check_model, model_label
            from ..runtime.default_plan import model_tensors

            assert plan.schedule is not None
            check_model(plan.schedule, model_tensors(module), plan.source, model_label(module))
            user = dict(self._user_ddp_kwargs)
            planned = planned_ddp_kwargs(plan.schedule, module, source=plan.source,
                                         find_unused_parameters=bool(user.pop("find_unused_parameters",
                                                                              False)),
                                         static_graph=bool(user.pop("static_graph", False)))
            self._ddp_kwargs = {**user, **planned}
            super().configure_ddp()
            watch_buckets(self.model, plan.schedule)
        else:
            self._root = _Root(module)
        log_plan(plan, TRAINER, self.global_rank)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers; on the runtime path each wrapped in a
        :class:`~usbyte_opt.runtime.DistributedOptimizer` on the plain module."""
        super().setup_optimizers(trainer)
        if self._root is None:
            return
        from ..runtime import DistributedOptimizer

        if len(self.optimizers) != 1:
            raise UsbyteError(f"{TRAINER}: configure_optimizers returned {len(self.optimizers)} "
                              "optimizers: the usbyte-opt runtime path takes one optimizer per "
                              "LightningModule (a ddp-tuned schedule runs several on Lightning's DDP)")
        wrapped = [DistributedOptimizer(opt, self._root, schedule=self.plan.runtime_schedule,
                                        **self._runtime_options) for opt in self.optimizers]
        self.distributed_optimizers = wrapped
        self.optimizers = wrapped
        # Mixed precision: Lightning's plugin treats the runtime as the optimizer it wraps
        # (unscaling before clipping); put back at teardown.
        plugin = self.precision_plugin
        kind = type(plugin)
        if (isinstance(plugin, MixedPrecision) and kind.optimizer_step is MixedPrecision.optimizer_step
                and kind.clip_gradients is MixedPrecision.clip_gradients):
            plugin.__class__ = _runtime_precision(kind)
            self._plugin_class = (plugin, kind)
        module = self.lightning_module
        assert module is not None
        # LightningModule.state_dict() (checkpoints, user code) sees the updated values.
        self._state_hooks = [module.register_state_dict_pre_hook(self._settle_hook),
                             module.register_load_state_dict_pre_hook(self._settle_hook)]

    def _settle_hook(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """Apply every pending update (runtime path; local, no collective). Lightning's
        checkpoints, validation and the end of ``fit`` call it.

        Between the passes of an accumulation (a validation every N batches, N not a multiple
        of ``accumulate_grad_batches``) it does nothing: the step's first backward applied every
        pending update already, and the step's all-reduce must wait for its last pass."""
        if self._accumulating:
            return
        for opt in self.distributed_optimizers:
            opt.synchronize()

    # ----------------------------------------------------------------------------------
    # The training step, accumulation
    # ----------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step; on the runtime path through the runtime's root module,
        so that its hooks run once around the whole step."""
        if self._root is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            out = self._root(*args, **kwargs)
        module = self.lightning_module
        sync = self.distributed_optimizers[0].buffer_sync if self.distributed_optimizers else None
        if sync is not None and module is not None and not module.automatic_optimization:
            # Lightning's DDP turns gradient sync off inside DDP's forward under manual
            # optimization (its backward is the user's), so that forward leaves the next one
            # unsynced: DDP's buffer rule sees the same.
            sync.post_forward(grad_sync=False)
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_ddp(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_ddp(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_ddp(super().predict_step, *args, **kwargs)

    def _through_ddp(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An evaluation step, which Lightning's DDP runs through DDP's forward: on the
        runtime path it runs under DDP's buffer rule (rank 0's buffers at its start when the
        forward before it trained; :mod:`usbyte_opt.runtime.semantics`)."""
        sync = self.distributed_optimizers[0].buffer_sync if self.distributed_optimizers else None
        if sync is None:
            return step(*args, **kwargs)
        sync.pre_forward()
        out = step(*args, **kwargs)
        sync.post_forward(grad_sync=not self._accumulating)
        return out

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes that only accumulate: DDP's ``no_sync()`` on the DDP path, the
        optimizers' ``no_sync()`` on the runtime path."""
        if self._root is None:
            with super().block_backward_sync():
                yield None
            return
        with contextlib.ExitStack() as stack:
            for opt in self.distributed_optimizers:
                stack.enter_context(opt.no_sync())
            self._accumulating = True
            yield None

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._accumulating = False
        return out

    # ----------------------------------------------------------------------------------
    # Every pending update applied: evaluation, checkpoints, the end
    # ----------------------------------------------------------------------------------

    def on_validation_start(self) -> None:
        self.synchronize()
        super().on_validation_start()

    def on_test_start(self) -> None:
        self.synchronize()
        super().on_test_start()

    def on_predict_start(self) -> None:
        self.synchronize()
        super().on_predict_start()

    def on_train_end(self) -> None:
        self.synchronize()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.synchronize()
        super().load_model_state_dict(checkpoint, strict=strict)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Close the runtime (every update applied, hooks removed), then Lightning's teardown."""
        opts, self.distributed_optimizers = self.distributed_optimizers, []
        for opt in opts:
            try:
                opt.close()
            except Exception:
                if not self._failed:
                    raise  # after a failure, the original error is the one to see
        if self._plugin_class is not None:
            plugin, kind = self._plugin_class
            plugin.__class__ = kind
            self._plugin_class = None
        for h in self._state_hooks:
            h.remove()
        self._state_hooks = []
        self._root = None
        self._failed = self._accumulating = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="usbyte-opt: the schedule in $USBYTE_SCHEDULE (Lightning's DDP with the "
                        "planned buckets, or the usbyte-opt runtime)")


UsbyteStrategy.register_strategies(StrategyRegistry)
