"""The ``ddp-tuned`` strategy: stock PyTorch DDP with the best bucket boundaries for the profile.

A registration only: the programme is :func:`usbyte_opt.planning.ddp.tuned_plan` (one module
holds every DDP bucket plan; its docstring says how the boundaries are chosen). The names
below stay importable from here.
"""

from __future__ import annotations

from ..ddp import MAX_WORK, PREFER_DEFAULT, min_finish, tuned_plan
from . import register

plan = register("ddp-tuned")(tuned_plan)

__all__ = ["MAX_WORK", "PREFER_DEFAULT", "min_finish", "plan"]
