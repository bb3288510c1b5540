"""The ``ddp`` strategy: PyTorch DDP's own buckets, run by torch DDP in fence mode.

A registration only: the buckets are :func:`usbyte_opt.planning.ddp.buckets`, the plan
:func:`usbyte_opt.planning.ddp.stock_plan` (one module holds every DDP bucket plan). The names
below stay importable from here.
"""

from __future__ import annotations

from ..ddp import BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES, MIB, buckets, stock_plan
from . import register

plan = register("ddp")(stock_plan)

__all__ = ["BUCKET_CAP_BYTES", "FIRST_BUCKET_BYTES", "MIB", "buckets", "plan"]
