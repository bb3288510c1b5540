"""Entry point of ``usbyte-opt``: builds the typer app and turns domain errors into one line.

Each subcommand lives in its own module with a ``register(app)`` function; add new ones to
:data:`COMMANDS`. A :class:`usbyte_opt.errors.UsbyteError` becomes ``error: <message>`` on
stderr and its exit code; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated, Any

import typer

try:  # typer >= 0.22 carries its own click
    from typer._click.exceptions import ClickException
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException

from .. import __version__, console
from ..env import DEBUG_ENV, ERROR_FILE_ENV
from ..errors import PeerFailure, UsbyteError

#: Subcommand modules under ``usbyte_opt.cli``, in ``--help`` order.
COMMANDS = ("profile", "optimize", "simulate", "launch", "bench", "demo", "schema")

app = typer.Typer(
    name="usbyte-opt",
    help="Plan gradient all-reduce ahead of time for PyTorch data-parallel training: "
    "profile a model, optimize a schedule, train with it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        console.out.print(f"usbyte-opt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """usbyte-opt: profile → optimize → launch."""


for _name in COMMANDS:
    importlib.import_module(f"{__package__}.{_name}").register(app)


def _no_flag_metavar() -> None:
    """``--help`` shows no ``<bool>`` beside a plain on/off flag (``--json``, ``--force``,
    ``--shard-sweep/--no-shard-sweep``, ``--help``): such a flag takes no value. typer's
    rich help names every option's type; this leaves the others as they are."""
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - a typer without it shows no types either
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_usbyte_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> Any:
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return shown(self, ctx)

    display_type_rich._usbyte_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_no_flag_metavar()


def os_error_line(e: OSError) -> str:
    """One line for an :class:`OSError`: the file(s), then what went wrong.

    Example::

        >>> os_error_line(PermissionError(13, "Permission denied", "/x/p.json"))
        '/x/p.json: Permission denied'
        >>> os_error_line(OSError(28, "No space left on device", "/x/.p.tmp", None, "/x/p.json"))
        '/x/.p.tmp -> /x/p.json: No space left on device'
    """
    what = e.strerror or str(e) or type(e).__name__
    if e.filename is None:
        return f"{type(e).__name__}: {what}"
    files = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{files}: {what}"


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; ``argv`` defaults to ``sys.argv[1:]``. Exits with the command's code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is ours anywhere before "--" or, for launch, before the training script (whose
    # own arguments may have a --debug of their own); it is moved to the front for typer.
    ours = len(argv)
    for i, a in enumerate(argv):
        if a == "--" or (argv[:1] == ["launch"] and a.endswith(".py")):
            ours = i
            break
    debug = "--debug" in argv[:ours] or bool(os.environ.get(DEBUG_ENV))
    if "--debug" in argv[:ours]:
        argv.pop(argv.index("--debug"))
        argv.insert(0, "--debug")
    if debug:
        os.environ[DEBUG_ENV] = "1"  # for the ranks `launch` and `profile` start
    from . import common

    common.ARGV[:] = argv[1:] if argv[:1] == ["--debug"] else argv
    try:
        # Not standalone: usage errors come back here to be printed on one line, like the rest.
        code = app(args=argv, prog_name="usbyte-opt", standalone_mode=False)
    except ClickException as e:
        if debug:
            raise
        if e.format_message().strip():  # empty: the help was shown instead (no arguments)
            console.error(usage_error_line(e))
        sys.exit(e.exit_code)
    except typer.Abort:
        if debug:
            raise
        console.error("interrupted")
        sys.exit(130)
    except UsbyteError as e:
        _record(e)
        if debug:
            raise
        if not (isinstance(e, PeerFailure) and e.silent):  # else the launcher names the cause
            console.error(str(e))
        sys.exit(e.exit_code)
    except OSError as e:
        # A file that cannot be read or written (disk full, permissions, a folder vanished):
        # the environment's doing, not a bug, so one line like any other error.
        _record(e)
        if debug:
            raise
        console.error(os_error_line(e))
        sys.exit(1)
    except KeyboardInterrupt:
        if debug:
            raise
        console.error("interrupted")
        sys.exit(130)
    if code == 130:
        console.error("interrupted")  # typer's exit code for Ctrl-C inside a command
    sys.exit(code if isinstance(code, int) else 0)


def _record(e: BaseException) -> None:
    """On a rank (torchrun's, or one that ``--nproc-per-node`` started), leave the error in the
    rank's error file for whoever started it (:func:`usbyte_opt.launcher.write_rank_error`:
    torch elastic's format, written here without importing torch)."""
    if os.environ.get(ERROR_FILE_ENV):
        from ..launcher import write_rank_error

        write_rank_error(e)


def usage_error_line(e: ClickException) -> str:
    """A usage error (unknown option, bad value) on one line, with where to read more.

    Example::

        >>> usage_error_line(ClickException("No such option: --bogus"))
        'No such option: --bogus'
    """
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.command_path:
        message += f" (see `{ctx.command_path} --help`)"
    return message
