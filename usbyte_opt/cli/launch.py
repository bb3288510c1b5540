"""``usbyte-opt launch --schedule S [torchrun options] SCRIPT [ARGS]``: train with a schedule.

Validates the schedule file, then runs ``torch.distributed.run`` (torchrun) with
``USBYTE_SCHEDULE`` set to it, so that ``DistributedOptimizer(optimizer, model)`` in the script
picks it up. Every torchrun option is accepted (``--nproc-per-node``, ``--nnodes``,
``--rdzv-endpoint``, ...); everything after SCRIPT goes to the script.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import typer

from .. import console
from ..errors import UsbyteError

#: ``usbyte_opt.runtime.checks.SCHEDULE_ENV``, spelled out so that validating a schedule does
#: not import torch.
SCHEDULE_ENV = "USBYTE_SCHEDULE"

USAGE = ("usbyte-opt launch --schedule SCHEDULE [torchrun options] SCRIPT [SCRIPT ARGS]\n\n"
         "Validate SCHEDULE, then start SCRIPT under torchrun with USBYTE_SCHEDULE set, so that\n"
         "DistributedOptimizer(optimizer, model) in the script applies it.\n\n"
         "Example:\n  usbyte-opt launch --schedule schedules/resnet50.json --nproc-per-node 8 "
         "train.py --epochs 90\n")


def _parser() -> Any:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "usbyte-opt launch"
    # No square brackets: the one-line error is printed with rich markup.
    parser.usage = "usbyte-opt launch --schedule SCHEDULE <torchrun options> SCRIPT <script args>"
    parser.add_argument("--schedule", required=True, metavar="SCHEDULE",
                        help="Schedule file (from `usbyte-opt optimize`); exported to the "
                             "script as USBYTE_SCHEDULE.")

    def error(message: str) -> None:
        err = UsbyteError(f"launch: {message} (usage: {parser.usage})")
        err.exit_code = 2
        raise err

    parser.error = error  # type: ignore[method-assign]
    return parser


def _schedule_arg(argv: list[str]) -> str | None:
    """The value of the first ``--schedule`` option (torchrun's parser checks the rest)."""
    for i, tok in enumerate(argv):
        if tok.startswith("--schedule="):
            return tok.split("=", 1)[1]
        if tok == "--schedule" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _world_size(nnodes: str, nproc: str) -> int | None:
    """The world size torchrun will start, when the options fix it."""
    lo, _, hi = str(nnodes).partition(":")
    if (hi and hi != lo) or not lo.isdigit() or not str(nproc).isdigit():
        return None
    return int(lo) * int(nproc)


def launch(ctx: typer.Context) -> None:
    """Run SCRIPT under torchrun with USBYTE_SCHEDULE set (after validating the schedule)."""
    argv = list(ctx.args)
    if not argv or argv[0] in ("-h", "--help"):
        console.out.print(USAGE, markup=False, highlight=False)
        if argv:
            console.out.print(_parser().format_help(), markup=False, highlight=False)
        raise typer.Exit(0 if argv else 2)
    from ..formats import load_schedule

    early = _schedule_arg(argv)
    if early is not None:  # a bad file fails here, before torch is imported
        load_schedule(early)
    args = _parser().parse_args(argv)
    sched = load_schedule(args.schedule)
    ws = _world_size(args.nnodes, args.nproc_per_node)
    if ws is not None and ws != sched.world_size:
        console.warn(f"{args.schedule}: planned for world size {sched.world_size}, launching "
                     f"{ws}: the block order stays valid, its timing was predicted for the other "
                     "size")
    os.environ[SCHEDULE_ENV] = str(Path(args.schedule).resolve())
    console.info(f"usbyte-opt: {args.schedule} ({sched.strategy}, {len(sched.blocks)} blocks, "
                 f"world size {sched.world_size}) -> {args.training_script}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as e:
        # The rank that failed first; the others were stopped by torchrun (SIGTERM) after it.
        rank, failure = min(e.failures.items(), key=lambda kv: (
            kv[1].exitcode == -signal.SIGTERM, kv[1].timestamp, kv[0])) if e.failures else (None, None)
        where = f"rank {rank} exited with code {failure.exitcode}" if failure else "a worker failed"
        err = UsbyteError(f"launch: {args.training_script}: {where}; its output is above")
        err.exit_code = (failure.exitcode if failure and failure.exitcode > 0 else 1)
        raise err from None


def register(app: typer.Typer) -> None:
    app.command("launch", context_settings={"allow_extra_args": True,
                                            "ignore_unknown_options": True,
                                            "help_option_names": []},
                help="Train with a schedule: torchrun with USBYTE_SCHEDULE set. "
                     "`usbyte-opt launch --help` lists the torchrun options.")(launch)
