"""usbyte-opt: ahead-of-time scheduling of gradient all-reduce for data-parallel training.

Three steps: ``usbyte-opt profile`` measures a model on its GPUs, ``usbyte-opt optimize``
plans the order and sizes of the all-reduce blocks, and
:class:`usbyte_opt.runtime.DistributedOptimizer` applies the plan in training.

The planner (formats, cost model, simulator, strategies) imports no torch.
"""

__version__ = "0.1.0"
