"""The profiler: per-tensor timing and all-reduce cost of a model on its real process group.

``usbyte-opt profile MODEL`` is the command line; :func:`profile_model` is the function
behind it, for use inside an already-initialised process group (every rank calls it; it
returns the same :class:`usbyte_opt.formats.Profile` on every rank, and writes nothing).

- :mod:`.run`: profiling across ranks (build, time, sweep, aggregate).
- :mod:`.timing`: hooks, clocks and medians of one rank's iterations.
- :mod:`.comm`: the all-reduce sweep, the fitted line and the analytic fallback.
- :mod:`.probe`: what all-reduce costs the training thread.
- :mod:`.optimizers`: the optimizer whose step is timed.

The ranks' device is :mod:`usbyte_opt.device`, their process group :mod:`usbyte_opt.group`,
and ``--nproc-per-node`` starts them through :mod:`usbyte_opt.launcher`.
"""

from ..collectives.sweep import analytic_comm, default_sizes, fit_comm, sweep_allreduce
from .optimizers import OPTIMIZERS, make_optimizer
from .run import ProfileWarning, profile_model
from .timing import IterationTimer, Timings, summarize

__all__ = ["IterationTimer", "OPTIMIZERS", "ProfileWarning", "Timings", "analytic_comm",
           "default_sizes", "fit_comm", "make_optimizer", "profile_model", "summarize",
           "sweep_allreduce"]
