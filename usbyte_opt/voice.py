"""What a run says: one line when it starts and one summary when it ends, on rank 0 only.

Every way in (the wrapper, :class:`~usbyte_opt.runtime.DistributedOptimizer`, the trainer
integrations) says, at its start, what will run (the schedule file, ``auto`` or none; the
runner; the mode; the blocks) through :func:`start`, and registers what it will have done
through :func:`closing`; the process says each once, however many optimizers or plan switches
it goes through (the first start line and the last summary win). Lines go to rank 0's stderr,
wrapped to 100 columns. Under ``usbyte-opt launch`` (which sets
:data:`~usbyte_opt.env.SUMMARY_FILE_ENV`) the launcher speaks instead: it prints the start
line itself, and the summary is written to that file for it to print when the run ends.
``USBYTE_QUIET=1`` silences both (warnings and errors still show).

Example::

    >>> wrap("usbyte-opt: " + "word " * 30, width=40).splitlines()[:2]
    ['usbyte-opt: word word word word word', '  word word word word word word word']
"""

from __future__ import annotations

import atexit
import os
import sys
import textwrap
from collections.abc import Callable

from .env import SUMMARY_FILE_ENV

#: Set (to anything but ``0``) to silence the start line and the summary.
QUIET_ENV = "USBYTE_QUIET"
#: The widest line printed.
WIDTH = 100
#: What every line starts with.
PREFIX = "usbyte-opt: "

_state: dict[str, object] = {"started": False, "closing": None, "registered": False}


def quiet() -> bool:
    """Whether ``$USBYTE_QUIET`` silences the run's lines."""
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def launched() -> bool:
    """Whether ``usbyte-opt launch`` speaks for the run (it set the summary file)."""
    return bool(os.environ.get(SUMMARY_FILE_ENV))


def wrap(line: str, width: int = WIDTH) -> str:
    """``line`` in lines of at most ``width`` columns, the continuations indented."""
    return textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def say(line: str) -> None:
    """Print ``line`` (wrapped, with :data:`PREFIX` unless it names usbyte-opt already) on
    this process's stderr, unless quiet."""
    if not quiet():
        print(wrap(line if line.startswith("usbyte-opt") else PREFIX + line), file=sys.stderr,
              flush=True)


def start(line: str, rank: int, under_launch: bool = False, each: bool = False) -> None:
    """The run's start line, once per process, on rank 0; under ``usbyte-opt launch``, which
    prints its own, only with ``under_launch`` (a line launch cannot know: which path a
    trainer takes). ``each``: said for every set-up that calls it (a trainer integration's
    path, one per trainer built), and the runtime's own start line is then not said."""
    if rank != 0 or (_state["started"] and not each):
        return
    _state["started"] = True
    if under_launch or not launched():
        say(line)


def closing(summary: Callable[[], str | None], rank: int) -> None:
    """What the run will have done, asked at exit (the latest registered wins): rank 0
    prints it, or under ``usbyte-opt launch`` writes it to the summary file."""
    if rank != 0:
        return
    _state["closing"] = summary
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    fn = _state["closing"]
    if not callable(fn):
        return
    try:
        text = fn()
    except Exception:  # noqa: BLE001 - a summary must never fail the run's exit
        return
    if not text:
        return
    path = os.environ.get(SUMMARY_FILE_ENV)
    if path:
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except OSError:
            say(text)
        return
    say(text)


def reset() -> None:
    """Forget what this process said (tests that build several runs in one process)."""
    _state["started"] = False
    _state["closing"] = None
