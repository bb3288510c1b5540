"""Releasing the optimizers a script left open, and letting gloo's workers finish, at
interpreter exit.

A gloo worker thread that finishes a collective frees the work object when it holds the last
reference to it (the caller dropped its ``Work`` after ``wait()``, as ``dist.all_reduce`` does),
and freeing a tensor that Python also knows needs the GIL. When the worker asks for the GIL
while the main thread runs the script's last lines and the interpreter then starts
finalizing, the first release of the GIL there (a process group's destructor releases it)
hands it to the worker, which Python then stops with ``pthread_exit`` inside a ``noexcept``
destructor: ``std::terminate``, "terminate called without an active exception", SIGABRT, at
the end of an otherwise successful run (a core dump shows ``ProcessGroupGloo::runLoop`` ->
``~AsyncWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). Any gloo
group is exposed: the runtime's own groups, and the default group after a script's last
collective (``dist.all_reduce`` of a metric right before the script ends).

So an ``atexit`` hook, which runs while the interpreter is still whole:

1. finishes and closes every optimizer still open (``dist.destroy_process_group()`` does not
   know the runtime's gloo groups): it gives collectives in flight a grace period (the other
   ranks are ending their scripts too), then releases the groups, whose destructors join
   their workers. An optimizer whose collectives fail or do not finish in time is left as it
   is, so a rank whose peers are gone does not wait on the way out;
2. then hands the GIL to gloo's worker threads (:func:`drain_gloo_workers`) until none of
   them is running or waiting for it, so that every work freed by a worker is freed now.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Any

#: How long the exit hook waits for collectives still in flight (seconds).
EXIT_GRACE_S = 10.0

#: How long the exit hook lets gloo's workers finish freeing their works, at most (seconds).
DRAIN_S = 2.0

#: Optimizers whose channel is still open.
OPEN: weakref.WeakSet[Any] = weakref.WeakSet()

#: The name torch gives gloo's worker threads (``ProcessGroupGloo::runLoop``).
GLOO_WORKER = "pt_gloo_runloop"


def _gloo_workers_busy() -> bool | None:
    """Whether a gloo worker thread of this process is running or runnable (Linux ``/proc``:
    a thread waiting for the GIL becomes runnable once the GIL is released); None where this
    cannot be read."""
    tasks = "/proc/self/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue   # the thread ended meanwhile
        if state in ("R", "D"):
            return True
    return False


def drain_gloo_workers(max_s: float = DRAIN_S, slice_s: float = 0.002) -> None:
    """Release the GIL in slices of ``slice_s`` until no gloo worker thread is running or
    waiting for it (twice in a row, a slice apart), at most ``max_s``: a worker that finished
    a collective and frees its work then does so while the interpreter is whole. Where the
    threads cannot be read (no ``/proc``), a few slices. Does nothing without gloo workers."""
    if "torch.distributed" not in sys.modules:
        return
    deadline = time.monotonic() + max_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(slice_s)   # the GIL is released: a worker waiting for it takes it
        busy = _gloo_workers_busy()
        quiet = quiet + 1 if busy is not True else 0
        if busy is None and quiet >= 2:
            time.sleep(10 * slice_s)
            break


@atexit.register
def release_at_exit(grace_s: float = EXIT_GRACE_S) -> None:
    """Release every optimizer in :data:`OPEN` (``opt._release(grace_s)``), ignoring failures:
    the process is exiting, and a failure was or will be reported by the training itself.
    Then :func:`drain_gloo_workers`."""
    for opt in list(OPEN):
        try:
            opt._release(grace_s)
        except Exception:  # noqa: BLE001 - exiting; the failure was or will be reported
            pass
    drain_gloo_workers()
