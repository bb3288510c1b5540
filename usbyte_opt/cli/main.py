"""Entry point of ``usbyte-opt``: builds the typer app and turns domain errors into one line.

Each subcommand lives in its own module with a ``register(app)`` function; add new ones to
:data:`COMMANDS`. A :class:`usbyte_opt.errors.UsbyteError` becomes ``error: <message>`` on
stderr and its exit code; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from .. import __version__, console
from ..errors import UsbyteError

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
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """usbyte-opt: profile → optimize → launch."""


for _name in COMMANDS:
    importlib.import_module(f"{__package__}.{_name}").register(app)


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
    debug = "--debug" in argv[:ours] or bool(os.environ.get("USBYTE_DEBUG"))
    if "--debug" in argv[:ours]:
        argv.pop(argv.index("--debug"))
        argv.insert(0, "--debug")
    try:
        app(args=argv, prog_name="usbyte-opt")
    except UsbyteError as e:
        if debug:
            raise
        console.error(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        console.error("interrupted")
        sys.exit(130)
