"""The profiler: per-tensor timing and all-reduce cost of a model on its real process group.

``usbyte-opt profile MODEL`` is the command line; :func:`profile_model` is the function
behind it, for use inside an already-initialised process group (every rank calls it; it
returns the same :class:`usbyte_opt.formats.Profile` on every rank, and writes nothing).

- :mod:`.options`: :class:`ProfileOptions`, every knob of a profile (no torch).
- :mod:`.run`: profiling across ranks (build, time, sweep, aggregate).
- :mod:`.timing`: hooks, clocks and medians of one rank's iterations.
- :mod:`.probe`: what all-reduce costs the training thread.
- :mod:`.optimizers`: the optimizer whose step is timed.

The all-reduce sweep, its fitted line and the analytic fallback are
:mod:`usbyte_opt.collectives.sweep` (shared with the runtime). The ranks' device is
:mod:`usbyte_opt.device`, their process group :mod:`usbyte_opt.group`,
and ``--nproc-per-node`` starts them through :mod:`usbyte_opt.launcher`.
"""

from typing import Any

from .options import STABLE_S, ProfileOptions

#: Where each name that needs torch lives: imported when first used, so that
#: :class:`ProfileOptions` (which the bench job and the CLI build) imports no torch.
_LAZY = {"IterationTimer": ".timing", "Timings": ".timing", "summarize": ".timing",
         "OPTIMIZERS": ".optimizers", "make_optimizer": ".optimizers",
         "ProfileWarning": ".run", "profile_model": ".run",
         "analytic_comm": "..collectives.sweep", "default_sizes": "..collectives.sweep",
         "fit_comm": "..collectives.sweep", "sweep_allreduce": "..collectives.sweep"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = ["IterationTimer", "OPTIMIZERS", "ProfileOptions", "ProfileWarning", "STABLE_S", "Timings",
           "analytic_comm", "default_sizes", "fit_comm", "make_optimizer", "profile_model",
           "summarize", "sweep_allreduce"]
