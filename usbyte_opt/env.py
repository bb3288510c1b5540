"""The environment variables usbyte-opt reads and sets, named once (this module imports no torch).

Every module that reads or sets one of them imports its name from here.

- :data:`SCHEDULE_ENV`: the schedule file ``DistributedOptimizer`` applies when it is given
  none (``usbyte-opt launch --schedule`` sets it); :data:`AUTO` there plans inside the run.
- :data:`AUTO_DIR_ENV`: where a run with :data:`AUTO` writes the profile and schedule it built.
- :data:`TRACE_ENV`: the file the runtime records its measured timeline in (one per rank).
- :data:`DEBUG_ENV`: set (``usbyte-opt --debug``), every rank keeps its tracebacks.
- :data:`RANK_ERRORS_ENV`: the folder where each rank under ``usbyte-opt launch`` leaves its
  one-line error for the launcher to print.
- :data:`LAUNCHED_ENV`: set on ranks that ``--nproc-per-node`` started on this host; a rank
  whose collective failed because another rank stopped then exits with :data:`PEER_EXIT`
  and leaves the one line (the other rank's cause) to the launcher.

The ranks' place in the world uses torchrun's own names (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); :mod:`usbyte_opt.launcher`
sets them.
"""

from __future__ import annotations

SCHEDULE_ENV = "USBYTE_SCHEDULE"
#: The value of :data:`SCHEDULE_ENV` (and the ``schedule`` argument) that plans inside the run.
AUTO = "auto"
AUTO_DIR_ENV = "USBYTE_AUTO_DIR"
TRACE_ENV = "USBYTE_TRACE"
DEBUG_ENV = "USBYTE_DEBUG"
RANK_ERRORS_ENV = "USBYTE_RANK_ERRORS"
LAUNCHED_ENV = "USBYTE_LAUNCHED"
#: Exit code of a rank started by the launcher whose collective failed because of a peer.
PEER_EXIT = 75

__all__ = ["AUTO", "AUTO_DIR_ENV", "DEBUG_ENV", "LAUNCHED_ENV", "PEER_EXIT", "RANK_ERRORS_ENV",
           "SCHEDULE_ENV", "TRACE_ENV"]
