"""The profiler: per-tensor timing and all-reduce cost of a model on its real process group.

``usbyte-opt profile MODEL`` is the command line; :func:`profile_model` is the function
behind it, for use inside an already-initialised process group (every rank calls it; it
returns the same :class:`usbyte_opt.formats.Profile` on every rank, and writes nothing).

- :mod:`.timing`: hooks, clocks and medians of one rank's iterations.
- :mod:`.comm`: the all-reduce sweep, the fitted line and the analytic fallback.
- :mod:`.run`: orchestration, cross-rank aggregation, process-group set-up and the
  ``--nproc-per-node`` launcher.
"""

from .comm import analytic_comm, default_sizes, fit_comm, sweep_allreduce
from .run import OPTIMIZERS, ProfileWarning, init_from_env, launch, make_optimizer, profile_model
from .timing import IterationTimer, Timings, summarize

__all__ = ["IterationTimer", "OPTIMIZERS", "ProfileWarning", "Timings", "analytic_comm",
           "default_sizes", "fit_comm", "init_from_env", "launch", "make_optimizer",
           "profile_model", "summarize", "sweep_allreduce"]
