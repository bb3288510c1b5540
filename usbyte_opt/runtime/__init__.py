"""The runtime: apply a schedule in data-parallel training (DESIGN.md §5).

:class:`DistributedOptimizer` wraps the user's optimizer, Horovod-style::

    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()

Modules, by concern: :mod:`.optimizer` (the protocol: hooks, issue order, lazy updates),
:mod:`.buffers` (flat gradient buffers), :mod:`.comm` (collectives, streams, averaging),
:mod:`.checks` (start-up checks), :mod:`.default_plan` (a plan without a profile) and
:mod:`.local` (several ranks on this machine, for tests, examples and benchmarks).
"""

from .checks import SCHEDULE_ENV, UsbyteWarning
from .default_plan import default_schedule, model_tensors, profile_from_model, split_blocks
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "SCHEDULE_ENV", "UsbyteWarning", "default_schedule",
           "model_tensors", "profile_from_model", "split_blocks"]
