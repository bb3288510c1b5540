"""usbyte-opt: ahead-of-time scheduling of gradient all-reduce for data-parallel training.

Three steps: ``usbyte-opt profile`` measures a model on its GPUs, ``usbyte-opt optimize``
plans the order and sizes of the all-reduce blocks, and the runtime applies the plan in
training: ``usbyte_opt.DistributedDataParallel(model)`` in place of DDP (one line of a DDP
script changes), or :class:`usbyte_opt.runtime.DistributedOptimizer` Horovod-style.

The planner (formats, cost model, simulator, strategies) imports no torch.
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # the runtime (and torch) only when asked for
    if name in ("DistributedDataParallel", "DDP"):
        from .runtime.wrapper import DistributedDataParallel

        return DistributedDataParallel
    if name == "per_parameter":   # declare an optimizer class per-parameter (runtime/semantics.py)
        from .runtime.semantics import per_parameter

        return per_parameter
    raise AttributeError(f"module 'usbyte_opt' has no attribute {name!r}")
