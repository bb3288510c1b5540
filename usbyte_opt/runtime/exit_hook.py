"""Releasing the optimizers a script left open, at interpreter exit.

``dist.destroy_process_group()`` does not know the runtime's own gloo groups (the one-thread
block group and the control group). Left to interpreter finalization, a gloo worker thread
that drops the last reference to a collective's tensor needs the GIL, is stopped instead, and
the process aborts ("terminate called without an active exception") at the end of an
otherwise successful run. So an ``atexit`` hook, which runs while the interpreter is still
whole, finishes and closes every optimizer still open: it gives collectives in flight a grace
period (the other ranks are ending their scripts too), then releases the groups, whose
destructors join their workers. An optimizer whose collectives fail or do not finish in time
is left as it is, so a rank whose peers are gone does not wait on the way out.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

#: How long the exit hook waits for collectives still in flight (seconds).
EXIT_GRACE_S = 10.0

#: Optimizers whose channel is still open.
OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def release_at_exit(grace_s: float = EXIT_GRACE_S) -> None:
    """Release every optimizer in :data:`OPEN` (``opt._release(grace_s)``), ignoring failures:
    the process is exiting, and a failure was or will be reported by the training itself."""
    for opt in list(OPEN):
        try:
            opt._release(grace_s)
        except Exception:  # noqa: BLE001 - exiting; the failure was or will be reported
            pass
