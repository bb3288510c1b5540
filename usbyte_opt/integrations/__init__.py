"""usbyte-opt inside the trainers people use: Lightning, Hugging Face Transformers, Accelerate.

One rule in all three (:func:`resolve`): **the schedule decides.** A schedule stock DDP can
express (the ``ddp-tuned`` strategy's: fence mode, whole tensors in gradient-ready order, one
dtype) runs the trainer's own ``DistributedDataParallel`` with the planned buckets
(:func:`usbyte_opt.ddp.planned_ddp_kwargs`); any other runs the usbyte-opt runtime
(:class:`~usbyte_opt.runtime.DistributedOptimizer`) on the plain model, never inside DDP, with
DDP's gradient contract (``wait_in_backward=True``: the trainers clip and log the gradient
norm right after ``backward()``) and DDP's accumulation protocol (``no_sync()``). The run logs
which of the two it uses, once, on rank 0.

* :mod:`usbyte_opt.integrations.lightning`: ``UsbyteStrategy``, a strategy for ``lightning``
  (``Trainer(strategy="usbyte")`` once imported);
* :mod:`usbyte_opt.integrations.transformers`: ``UsbyteTrainer``, a ``transformers.Trainer``;
* :mod:`usbyte_opt.integrations.accelerate`: ``prepare(accelerator, model, optimizer)``.

Each imports its trainer only when imported itself (``pip install 'usbyte-opt[lightning]'``
or ``'usbyte-opt[transformers]'``, which leave torch as it is).
"""

from ._common import Route, log_plan, resolve, runtime_kwargs

__all__ = ["Route", "log_plan", "resolve", "runtime_kwargs"]
