"""What ``usbyte-opt launch`` runs on every rank: ``python -m usbyte_opt.cli.rank SCRIPT ARGS``
(or ``... -m MODULE ARGS`` for ``launch -m``).

It runs SCRIPT as ``python SCRIPT ARGS`` would (``sys.argv``, ``sys.path[0]`` and
``__name__ == "__main__"`` as usual; a module as ``python -m MODULE``), with two differences,
so that a failure reads as one line instead of a traceback per rank:

- a :class:`usbyte_opt.errors.UsbyteError` (a schedule that does not fit the model, a
  malformed file, ranks that disagree) is recorded as ``rank N: <message>`` in the rank's
  torch elastic error file (``TORCHELASTIC_ERROR_FILE``, which torchrun sets per rank:
  :func:`usbyte_opt.launcher.record_rank`), where ``usbyte-opt launch`` reads it and prints the
  first rank's line once; without that variable the line goes to stderr. The exit code is
  the error's own.
- Ctrl-C (``KeyboardInterrupt``, or any error while the interrupt unwinds a collective)
  ends the rank quietly with exit code 130: the launcher says "interrupted", once.

Any other exception is the script's own: its traceback is printed as Python would.
``USBYTE_DEBUG=1`` (``usbyte-opt --debug launch ...``) keeps every traceback.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from ..env import DEBUG_ENV, ERROR_FILE_ENV


def _run(target: str, module: bool, rank: str) -> None:
    """Run the script (or module); a usbyte-opt error comes out as :class:`ExitError`
    ``rank N: <message>`` with the error's exit code, which :func:`main`'s error handler
    records."""
    from ..errors import ExitError, UsbyteError, with_rank

    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except UsbyteError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        raise ExitError(with_rank(rank, str(e)), e.exit_code) from e


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]`` as a script (``-m MODULE``: that module) with the rest as its
    arguments; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m usbyte_opt.cli.rank [-m MODULE | SCRIPT] [ARGS]\n")
        return 2
    debug = bool(os.environ.get(DEBUG_ENV))
    rank = os.environ.get("RANK", "0")
    interrupted = False

    def on_sigint(signum, frame):  # noqa: ANN001 - signal handler signature
        nonlocal interrupted
        if interrupted:
            return  # a second SIGINT (torchrun forwards the terminal's): already stopping
        interrupted = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    target = argv[0]
    sys.argv = argv
    sys.path[0] = os.getcwd() if module else str(Path(target).resolve().parent)
    from ..errors import ExitError
    from ..launcher import record_rank

    try:
        record_rank(_run)(target, module, rank)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        return 130
    except ExitError as e:
        if interrupted:
            return 130
        if not os.environ.get(ERROR_FILE_ENV):  # else in the error file, for the launcher
            sys.stderr.write(f"error: {e}\n")
            sys.stderr.flush()
        return e.exit_code
    except BaseException:
        if interrupted and not debug:
            return 130  # a collective broken by Ctrl-C on another rank: not the script's error
        raise
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        # A failed rank ends here, without interpreter finalization: a process group the
        # script left behind (its gloo threads still running) can abort the process there
        # ("terminate called without an active exception"), a second error line.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
