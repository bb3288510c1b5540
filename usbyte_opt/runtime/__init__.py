"""The runtime: apply a schedule in data-parallel training (docs/design.md §5, docs/runtime.md).

:class:`DistributedDataParallel` takes DDP's place (``model = DistributedDataParallel(model)``,
the rest of a DDP script unchanged); :class:`DistributedOptimizer` wraps the user's optimizer,
Horovod-style::

    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()

Modules, by concern: :mod:`.optimizer` (the user-facing class), :mod:`.installed` (the
per-schedule state a plan switch replaces), :mod:`.backward` (one step's communication:
hooks, issue order, end of backward, the update rule, the step's phase), :mod:`.updates`
(pending updates, on the host or on a CUDA update stream), :mod:`.forward` (forward gates,
module buffers, ``torch.compile``), :mod:`.amp` (GradScaler), :mod:`.buffers` (flat gradient
buffers), :mod:`.comm` (collectives, streams, averaging), :mod:`.checks` (start-up checks),
:mod:`.guard` (DDP's contract for code that touches gradients or parameters in flight),
:mod:`.wrapper` (DDP's surface), :mod:`.semantics` (DDP's semantics: the buffer rule,
which optimizers may be stepped on subsets, the DDP options refused), :mod:`.exit_hook` (optimizers left open at exit),
:mod:`.default_plan` (a plan without a profile), :mod:`.autotune` (planning inside the run)
and :mod:`.trace` (the measured timeline). Several ranks on this machine, for tests, examples and benchmarks:
:func:`usbyte_opt.launcher.run_local`.
"""

from ..env import SCHEDULE_ENV
from .checks import UsbyteWarning
from .default_plan import default_schedule, model_tensors, profile_from_model, split_blocks
from .optimizer import DistributedOptimizer
from .semantics import per_parameter, steps_per_parameter
from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "DistributedOptimizer", "SCHEDULE_ENV", "UsbyteWarning", "default_schedule",
           "model_tensors", "per_parameter", "profile_from_model", "split_blocks", "steps_per_parameter"]
