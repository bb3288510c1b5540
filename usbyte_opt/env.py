"""The environment variables usbyte-opt reads and sets, named once (this module imports no torch).

Every module that reads or sets one of them imports its name from here.

- :data:`SCHEDULE_ENV`: the schedule file ``DistributedOptimizer`` applies when it is given
  none (``usbyte-opt launch --schedule`` sets it); :data:`AUTO` there plans inside the run.
- :data:`AUTO_DIR_ENV`: where a run with :data:`AUTO` writes the profile and schedule it built.
- :data:`TRACE_ENV`: the file the runtime records its measured timeline in (one per rank).
- :data:`DEBUG_ENV`: set (``usbyte-opt --debug``), every rank keeps its tracebacks.
- :data:`ERROR_FILE_ENV`: torch elastic's own name for the file where a rank leaves its error
  (torchrun sets it per rank, and so does :func:`usbyte_opt.launcher.run_ranks`); usbyte-opt's
  ranks leave their one-line error there (:func:`usbyte_opt.launcher.record_rank`).
- :data:`LAUNCHED_ENV`: set on ranks that ``--nproc-per-node`` started on this host; a rank
  whose collective failed because another rank stopped then prints nothing and leaves the
  one line (the other rank's cause) to the launcher.
- :data:`SUMMARY_FILE_ENV`: where rank 0 of a run that plans or verifies writes its one-line
  summary (what it kept, against DDP's buckets); ``usbyte-opt launch`` sets it and prints
  the line when the run ends.
- :data:`COMPILED_ROUNDING_ENV`: ``1``: a compiled model trains on the plan's pieces under a
  backend that may round them apart from compiled DDP's (inductor), instead of the refusal
  (the runtime's ``accept_compiled_rounding``).

The ranks' place in the world uses torchrun's own names (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
:mod:`usbyte_opt.launcher` sets them, and a profile's nodes come from ``GROUP_RANK`` and
``LOCAL_WORLD_SIZE`` (:mod:`usbyte_opt.profiler.topology`). gloo's own
``GLOO_SOCKET_IFNAME`` is read by the pre-flight of a world spanning nodes
(:mod:`usbyte_opt.preflight`).
"""

from __future__ import annotations

SCHEDULE_ENV = "USBYTE_SCHEDULE"
#: The value of :data:`SCHEDULE_ENV` (and the ``schedule`` argument) that plans inside the run.
AUTO = "auto"
AUTO_DIR_ENV = "USBYTE_AUTO_DIR"
TRACE_ENV = "USBYTE_TRACE"
DEBUG_ENV = "USBYTE_DEBUG"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
LAUNCHED_ENV = "USBYTE_LAUNCHED"
SUMMARY_FILE_ENV = "USBYTE_SUMMARY_FILE"
COMPILED_ROUNDING_ENV = "USBYTE_ACCEPT_COMPILED_ROUNDING"

__all__ = ["AUTO", "AUTO_DIR_ENV", "COMPILED_ROUNDING_ENV", "DEBUG_ENV", "ERROR_FILE_ENV",
           "LAUNCHED_ENV", "SCHEDULE_ENV", "SUMMARY_FILE_ENV", "TRACE_ENV"]
