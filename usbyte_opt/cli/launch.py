"""``usbyte-opt launch --schedule S [torchrun options] SCRIPT [ARGS]``: train with a schedule.

Validates the schedule file, then runs ``torch.distributed.run`` (torchrun) with
``USBYTE_SCHEDULE`` set to it, so that ``DistributedOptimizer(optimizer, model)`` in the script
picks it up. Every torchrun option is accepted (``--nproc-per-node``, ``--nnodes``,
``--rdzv-endpoint``, ...); everything after SCRIPT goes to the script.

Failures read as one line: each rank runs the script through :mod:`usbyte_opt.cli.rank`,
which leaves a usbyte-opt error in the rank's torch elastic error file, so a usbyte-opt error
on a rank (a schedule that does not fit the model names the first
tensor that differs, expected and got) is printed once as ``error: rank N: <message>`` with
its exit code; Ctrl-C stops every rank and prints ``error: interrupted`` (exit code 130);
``--debug`` keeps every traceback. A script that fails in its own code keeps its traceback.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from .. import console
from ..env import AUTO, AUTO_DIR_ENV, DEBUG_ENV, SCHEDULE_ENV
from ..errors import ExitError, UsageError
from ..voice import wrap

USAGE = """\
Usage: usbyte-opt launch --schedule SCHEDULE|auto [--auto-dir DIR]
                         [torchrun options] SCRIPT [SCRIPT ARGS]

Validate SCHEDULE, then start SCRIPT under torchrun with USBYTE_SCHEDULE
set, so that DistributedOptimizer(optimizer, model) in the script applies
it. With --schedule auto the runtime measures and plans inside the run (no
profile needed), verifies the plan against DDP's buckets, and writes the
profile and schedule it built to --auto-dir.

Options:
  --schedule SCHEDULE  schedule file (from `usbyte-opt optimize`), or auto
                       to plan inside the run; exported to the script as
                       USBYTE_SCHEDULE (required)
  --auto-dir DIR       with --schedule auto: where the runtime writes the
                       profile and schedule it built (USBYTE_AUTO_DIR)
  --debug              keep every rank's traceback, not one error line
  -h, --help           show this message
  --help-torchrun      list torchrun's options, all accepted here:
                       --nproc-per-node N, --nnodes N, --rdzv-endpoint ...

Everything after SCRIPT goes to the script.

Examples:
  usbyte-opt launch --schedule schedules/mine.json --nproc-per-node 2 \\
      examples/train.py --model cnn
  usbyte-opt launch --schedule auto --auto-dir runs/auto \\
      --nproc-per-node 8 train.py
  # on each of 2 nodes, K its index (0 on HOST), GLOO_SOCKET_IFNAME on gloo:
  usbyte-opt launch --schedule schedules/mine.json --nnodes 2 \\
      --nproc-per-node 8 --node-rank K --master-addr HOST \\
      --master-port 29500 train.py
"""


def _parser() -> Any:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "usbyte-opt launch"
    # No square brackets: the one-line error is printed with rich markup.
    parser.usage = "usbyte-opt launch --schedule SCHEDULE <torchrun options> SCRIPT <script args>"
    parser.add_argument("--schedule", required=True, metavar="SCHEDULE",
                        help="Schedule file (from `usbyte-opt optimize`), or `auto` to plan "
                             "inside the run; exported to the script as USBYTE_SCHEDULE.")
    parser.add_argument("--auto-dir", default=None, metavar="DIR",
                        help="With --schedule auto: where the runtime writes the profile and "
                             "schedule it built (exported as USBYTE_AUTO_DIR).")

    def error(message: str) -> None:
        raise UsageError(f"launch: {message} (usage: {parser.usage})")

    parser.error = error  # type: ignore[method-assign, assignment]
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


def _profile_of(schedule: Any, path: Path) -> tuple[Any, Path] | None:
    """The profile ``schedule`` (read from ``path``) was planned from, checked by its digest:
    where ``optimize`` recorded it (``profile_path``), else found by its name,
    ``profiles/NAME.json`` here or beside the schedule's folder, or a bench folder's
    ``profile.json``; ``None`` when none is at hand."""
    from ..formats import load_profile

    name = schedule.profile_name
    here = path.resolve().parent
    recorded = (schedule.extra or {}).get("profile_path")   # where optimize read it
    for candidate in ((*([here / str(recorded)] if isinstance(recorded, str) else []),
                       Path("profiles") / f"{name}.json", here.parent / "profiles" / f"{name}.json",
                       here / f"{name}.json", here.parent / "profile.json", here / "profile.json")):
        try:
            if candidate.resolve() == path.resolve() or not candidate.is_file():
                continue
            profile = load_profile(candidate)
        except Exception:  # noqa: BLE001 - not a profile, or unreadable: look further
            continue
        if profile.digest() == schedule.profile_digest:
            return profile, candidate
    return None


def world_size_line(schedule: Any, path: Path, world_size: int,
                    has_gpu: bool | None = None) -> str:
    """The warning of a launch at another world size than ``schedule`` was planned for: the
    iteration time it predicts there, re-predicted for ``world_size`` when its profile is at
    hand (:func:`_profile_of`; the planner's ring model of the profile's links, torch-free,
    well under a second), else the planned size's prediction, said not to be re-predicted.
    A profile measured on a GPU launched on a machine without one (``has_gpu``, default:
    whether torch sees one) is said to take far longer here."""
    planned = (schedule.predicted or {}).get("iteration_ms")
    at_plan = f" (predicted {planned:.1f} ms per iteration there)" if planned else ""
    head = (f"{path}: planned for world size {schedule.world_size}{at_plan}, launching "
            f"{world_size}: ")
    found = _profile_of(schedule, path)
    if found is not None:
        from ..planning.planner import retargeted, single_rank
        from ..planning.simulate import simulate

        profile, where = found
        try:
            moved = single_rank(profile) if world_size == 1 else retargeted(profile, world_size)
            now = simulate(moved, schedule, check=False).iteration_ms
        except Exception as e:  # noqa: BLE001 - a schedule this size cannot run (hierarchy, ...)
            head += f"not re-predicted ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
        else:
            how = "nothing to communicate" if world_size == 1 else "its links' ring model"
            head += (f"predicted {now:.1f} ms per iteration at {world_size} (re-predicted on "
                     f"{where}, {how}); ")
        device = str(profile.meta.get("device", ""))
        if has_gpu is None:
            import torch

            has_gpu = torch.cuda.is_available()
        if device.startswith("cuda") and not has_gpu:
            head += (f"its compute was measured on {device} and this machine has no GPU, so "
                     "expect iterations far longer; ")
    elif not at_plan:
        head += "no prediction at hand; "
    else:
        head += (f"not re-predicted (its profile {schedule.profile_name!r} is not in profiles/; "
                 f"`usbyte-opt simulate PROFILE {path} --world-size {world_size}` re-predicts "
                 "it); ")
    fix = (f"; `usbyte-opt optimize {found[1] if found else 'PROFILE'} --world-size {world_size}` "
           "plans for it" if world_size > 1 else "")
    return head + "the block order stays valid" + fix


def _rendezvous_host(args: Any) -> str | None:
    """The host every node meets at: ``--rdzv-endpoint``'s, else ``--master-addr``."""
    endpoint = str(getattr(args, "rdzv_endpoint", "") or "")
    if endpoint:
        host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 or "]" in endpoint else endpoint
        return host.strip("[]") or None
    return getattr(args, "master_addr", None)


def _preflight(args: Any) -> int:
    """A world spanning nodes whose ranks here the other nodes could not reach over gloo
    fails now, before torchrun's rendezvous, on every node
    (:func:`usbyte_opt.preflight.check_gloo`): on a host without CUDA (the script's ranks use
    gloo), in one line; on a CUDA host (NCCL, gloo only where the script asks for it) the
    same line is a warning. Returns the most nodes ``--nnodes`` allows."""
    import torch

    from ..errors import UsbyteError
    from ..preflight import check_gloo

    nnodes = max((int(n) for n in str(args.nnodes).split(":") if n.isdigit()), default=1)
    try:
        check_gloo("launch", nnodes=nnodes, master=_rendezvous_host(args))
    except UsbyteError as e:
        if not torch.cuda.is_available():
            raise
        console.warn(f"{e} (on NCCL this matters to the script's gloo groups only)")
    return nnodes


def launch(ctx: typer.Context) -> None:
    """Run SCRIPT under torchrun with USBYTE_SCHEDULE set (after validating the schedule)."""
    argv = list(ctx.args)
    if not argv or argv[0] in ("-h", "--help"):
        console.out.print(USAGE, markup=False, highlight=False, end="")
        raise typer.Exit(0 if argv else 2)
    if argv[0] == "--help-torchrun":
        console.out.print(_parser().format_help(), markup=False, highlight=False, end="")
        raise typer.Exit(0)
    from ..formats import load_schedule

    early = _schedule_arg(argv)
    if early is not None and early != AUTO:  # a bad file fails here, before torch is imported
        load_schedule(early)
    args = _parser().parse_args(argv)
    auto = args.schedule == AUTO
    sched = None if auto else load_schedule(args.schedule)
    if str(args.nproc_per_node).lstrip("-").isdigit() and int(args.nproc_per_node) < 1:
        raise UsageError(f"launch: --nproc-per-node: expected an integer >= 1 (or auto, gpu, cpu), "
                         f"got {args.nproc_per_node}")
    ws = _world_size(args.nnodes, args.nproc_per_node)
    if sched is not None and ws is not None and ws != sched.world_size:
        console.warn(world_size_line(sched, Path(args.schedule), ws))
    nnodes = _preflight(args)
    wrapped = not (args.no_python or args.run_path)
    if wrapped and not args.module and not Path(args.training_script).is_file():
        raise UsageError(f"launch: {args.training_script}: expected an existing script file")
    os.environ[SCHEDULE_ENV] = AUTO if auto else str(Path(args.schedule).resolve())
    if args.auto_dir:
        os.environ[AUTO_DIR_ENV] = str(Path(args.auto_dir).resolve())
    debug = bool(os.environ.get(DEBUG_ENV))
    script = args.training_script
    if wrapped:
        # Each rank runs the script through usbyte_opt.cli.rank, which turns a usbyte-opt
        # error into one line for this process to print (see _failure) and Ctrl-C into a
        # quiet exit.
        args.training_script_args = (["-m"] if args.module else []) + [script, *args.training_script_args]
        args.training_script, args.module = "usbyte_opt.cli.rank", True
    # On stdout, with the ranks' own output: stderr is kept for warnings and the one error line.
    what = ("auto (planned in the run)" if sched is None else
            f"{args.schedule} ({sched.strategy}: " + (
                f"torch DDP, {console.plural(len(sched.blocks), 'planned bucket')}"
                if str(sched.runner) == "ddp" else
                f"usbyte-opt runtime, {sched.mode} mode, {console.plural(len(sched.blocks), 'block')}")
            + f", world size {sched.world_size})")
    console.out.print(wrap(f"usbyte-opt: {what} -> {script}"), markup=False, highlight=False)
    from ..launcher import run_summary, run_torchrun

    board = _board(args, nnodes)   # before torchrun: node 0 hosts it for the whole run
    try:
        with run_summary() as said:   # the runtime's last word: what it kept, against DDP's buckets
            failures = run_torchrun(args, quiet=not debug)
        if said:   # the run's summary (rank 0 wrote it at exit, usbyte_opt.voice)
            line = said[0] if said[0].startswith("usbyte-opt") else f"usbyte-opt: {said[0]}"
            console.out.print(wrap(line), markup=False, highlight=False, soft_wrap=True)
        if failures is not None:
            nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else None
            raise _failure(failures, script, nnodes, nproc,
                           board.share if board is not None else None) from None
    finally:
        if board is not None:
            board.close()


def _failure(failures: dict[int, Any], script: str, nnodes: int = 1,
             nproc: int | None = None,
             share: Callable[[list[Any]], list[Any]] | None = None) -> BaseException:
    """The one error a failed run reports: the rank that failed first on its own
    (:func:`usbyte_opt.launcher.first_failure`: not one whose collective failed because
    another rank stopped, nor one torchrun stopped after it), by its error file's time
    (torchrun read the file: :class:`usbyte_opt.launcher.RankError`) or when torchrun saw it
    end: its usbyte-opt error (``rank N: message``, with its exit code) or what ended it. On
    several nodes the rank is named with its node (``GROUP_RANK``); ``share`` (the nodes'
    exchange, :meth:`usbyte_opt.launcher.FailureBoard.share`) adds the other nodes' failures, so
    that every node names the same first one; a node that learns of none where every failure
    of its own was a consequence says that the cause is on another node.
    ``KeyboardInterrupt`` when every rank ended from Ctrl-C."""
    from ..errors import with_rank
    from ..launcher import Failure, RankError, first_failure

    codes = {f.exitcode for f in failures.values()}
    if failures and codes <= {130, -signal.SIGTERM, -signal.SIGINT} and codes & {130, -signal.SIGINT}:
        return KeyboardInterrupt()
    if not failures:
        return ExitError(f"launch: {script}: a worker failed; its output is above", 1)
    several = nnodes > 1 and nproc is not None
    records = []
    for rank, f in failures.items():
        e = RankError.of(getattr(f, "error_file_data", None))
        when = e.timestamp if e is not None and e.timestamp else float(f.timestamp)
        records.append(Failure(rank, f.exitcode, when, e, rank // nproc if several and nproc else None))
    everywhere = records
    if several and share is not None:
        everywhere = share(records) or records
    first = first_failure(everywhere)
    if first is None:
        seen = min(records, key=lambda r: (r.timestamp, r.rank))
        why = _short(seen.error.message) if seen.error is not None else f"exited with code {seen.exitcode}"
        where = f"node {seen.node}" if seen.node is not None else "this node"
        then = ("the first failure is on another node: see its output" if several else
                "no rank says why (--debug shows the tracebacks)")
        return ExitError(f"launch: {script}: no rank on {where} failed on its own "
                         f"({with_rank(seen.rank, why)}); {then}",
                         seen.exitcode if seen.exitcode > 0 else 1)
    label = first.label
    code = first.exitcode if first.exitcode > 0 else 1
    e = first.error
    output = ("its output is above" if any(r.rank == first.rank for r in records)
              else "its output is on its node")
    if e is not None and e.usbyte:
        message = with_rank(first.rank, e.message)
        if first.node is not None:
            message = f"{label}:{message[len(f'rank {first.rank}:'):]}"
        return ExitError(message, e.exit_code)
    if first.exitcode < 0:
        try:
            what = f"was killed by {signal.Signals(-first.exitcode).name}"
        except ValueError:
            what = f"was killed by signal {-first.exitcode}"
        return ExitError(f"launch: {script}: {label} {what}, the first rank to fail", code)
    return ExitError(f"launch: {script}: {label} exited with code {first.exitcode}, the first rank "
                     f"to fail; {output}", code)


def _board(args: Any, nnodes: int) -> Any:
    """Where this node leaves its failures for the other nodes' launchers and reads theirs
    (:class:`usbyte_opt.launcher.FailureBoard`, node 0 hosting it at the rendezvous port + 1
    from now until the run's end): with torchrun's static rendezvous (``--master-addr``,
    ``--node-rank``) of a fixed number of nodes; ``None`` otherwise."""
    from ..launcher import FailureBoard

    fixed = str(args.nnodes).isdigit() and int(args.nnodes) == nnodes > 1
    if not fixed or str(getattr(args, "rdzv_backend", "static")) != "static" or args.rdzv_endpoint:
        return None
    return FailureBoard(int(args.node_rank), nnodes, str(args.master_addr), int(args.master_port) + 1)


def _short(message: str) -> str:
    """A collective library's error without its source location and advice.

    Example::

        >>> _short("RuntimeError: [/src/gloo/pair.cc:537] Read error: Connection reset. This is typically ...")
        'RuntimeError: Read error: Connection reset'
    """
    return re.sub(r"\[[^\]]*\.(cc|cpp):\d+\]\s*", "", message).split(". This is")[0]


def register(app: typer.Typer) -> None:
    app.command("launch", context_settings={"allow_extra_args": True,
                                            "ignore_unknown_options": True,
                                            "help_option_names": []},
                help="Train with a schedule: torchrun with USBYTE_SCHEDULE set. "
                     "`usbyte-opt launch --help` shows its options, `--help-torchrun` "
                     "torchrun's.")(launch)
