"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import console
from ..errors import UsageError, UsbyteError
from ..formats import CommSpec, Profile, dump_profile, load_profile, write_json
from ..planning.cost import retarget_warning
from ..planning.planner import retargeted
from ..planning.simulate import Timeline, chrome_trace

#: The command line of this process as :func:`usbyte_opt.cli.main.main` was given it (without
#: its ``--debug``, which the ranks inherit as ``USBYTE_DEBUG``): what ``profile
#: --nproc-per-node`` forwards to the ranks it starts.
ARGV: list[str] = []

#: Options shared by several commands, as ``Annotated`` types (``x: common.Json = False``).
WorldSize = Annotated[Optional[int], typer.Option(
    "--world-size", "-n", min=2, help="Retarget to this many ranks (ring all-reduce model).")]
def _positive(ctx: typer.Context, param: typer.CallbackParam, value: Optional[float]) -> Optional[float]:
    """typer callback of an option that must be > 0 when given (a usage error otherwise)."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"expected a number > 0, got {value}")
    return value


BandwidthGbps = Annotated[Optional[float], typer.Option(
    "--bandwidth-gbps", callback=_positive, help="Retarget to this per-link bandwidth, Gbit/s.")]
LatencyUs = Annotated[Optional[float], typer.Option(
    "--latency-us", min=0.0, help="Retarget to this latency per ring step, µs.")]
Nodes = Annotated[Optional[int], typer.Option(
    "--nodes", min=1, help="Retarget to this many nodes (with --ranks-per-node, or the "
                           "profile's; a one-node profile needs --inter-gbps). Several nodes of "
                           "several ranks plan hierarchical all-reduce where it is cheaper.")]
RanksPerNode = Annotated[Optional[int], typer.Option(
    "--ranks-per-node", min=1, help="Ranks on each node when retargeting by nodes (default: "
                                    "the profile's, or --world-size / --nodes).")]
IntraGbps = Annotated[Optional[float], typer.Option(
    "--intra-gbps", callback=_positive, help="Bus bandwidth inside a node, Gbit/s (nccl-tests' "
                                             "busbw; default: the profile's).")]
InterGbps = Annotated[Optional[float], typer.Option(
    "--inter-gbps", callback=_positive, help="Bus bandwidth of each node's network link, Gbit/s "
                                             "(nccl-tests' busbw; default: the profile's inter "
                                             "line).")]
IntraLatencyUs = Annotated[Optional[float], typer.Option(
    "--intra-latency-us", min=0.0, help="Latency per ring step inside a node, µs.")]
InterLatencyUs = Annotated[Optional[float], typer.Option(
    "--inter-latency-us", min=0.0, help="Latency per ring step between nodes, µs (default: the "
                                        "profile's inter line, else the intra latency).")]


def levels(nodes: Optional[int] = None, ranks_per_node: Optional[int] = None,
           intra_gbps: Optional[float] = None, inter_gbps: Optional[float] = None,
           intra_latency_us: Optional[float] = None,
           inter_latency_us: Optional[float] = None) -> dict[str, Any]:
    """The given ones of the retarget-by-nodes options, as keywords of
    :func:`usbyte_opt.planning.cost.retarget`.

    Example::

        >>> levels(nodes=4, inter_gbps=100.0)
        {'nodes': 4, 'inter_gbps': 100.0}
    """
    given = {"nodes": nodes, "ranks_per_node": ranks_per_node, "intra_gbps": intra_gbps,
             "inter_gbps": inter_gbps, "intra_latency_us": intra_latency_us,
             "inter_latency_us": inter_latency_us}
    return {k: v for k, v in given.items() if v is not None}


def _probe(folder: Path, make_dir: bool) -> None:
    """Create and remove a temporary file (or folder) in ``folder``: the one reliable test
    that it accepts new entries (permissions, read-only mounts, /proc, ...)."""
    if make_dir:
        os.rmdir(tempfile.mkdtemp(prefix=".usbyte-probe-", dir=folder))
    else:
        fd, name = tempfile.mkstemp(prefix=".usbyte-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)


def _nearest(path: Path) -> Path:
    """``path`` itself or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _unwritable(option: str, path: Path, why: str) -> UsbyteError:
    return UsageError(f"{option} {path}: expected a path this process can write, but {why}")


def check_output_file(path: str | os.PathLike, option: str = "--output") -> Path:
    """Raise :class:`~usbyte_opt.errors.UsageError` (one line, exit code 2) unless a file can be written at
    ``path``; return it as a :class:`Path`. Called before any work, so that a bad output
    path costs nothing; nothing is left behind (missing folders are not created).

    Example::

        >>> check_output_file("/proc/x.json", "-o")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: -o /proc/x.json: expected a path this process can ...
    """
    p = Path(path)
    if p.is_dir():
        raise _unwritable(option, p, "it is a folder")
    folder = _nearest(p.parent)
    if not folder.is_dir():
        raise _unwritable(option, p, f"{folder} is a file, not a folder")
    try:
        _probe(folder, make_dir=folder != Path(os.path.abspath(p.parent)))
    except OSError as e:
        raise _unwritable(option, p, f"{folder} does not accept new "
                          f"{'files' if folder == Path(os.path.abspath(p.parent)) else 'folders'} "
                          f"({e.strerror or e})") from None
    return p


def check_output_dir(path: str | os.PathLike, option: str = "--output-dir") -> Path:
    """Like :func:`check_output_file` for a folder that will receive files.

    Example::

        >>> check_output_dir("/proc/results", "-o")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: -o /proc/results: expected a path this process can ...
    """
    p = Path(path)
    folder = _nearest(p)
    if not folder.is_dir():
        raise _unwritable(option, p, f"{folder} is a file, not a folder")
    try:
        _probe(folder, make_dir=folder != Path(os.path.abspath(p)))
    except OSError as e:
        what = "files" if folder == Path(os.path.abspath(p)) else "folders"
        raise _unwritable(option, p, f"{folder} does not accept new {what} ({e.strerror or e})") from None
    return p


#: The source checkout this package runs from: its ``profiles/`` and ``schedules/`` hold the
#: shipped files (when it is one; an installed package has none).
REPOSITORY = Path(__file__).resolve().parents[2]


def shipped_files(folder: str) -> frozenset[Path]:
    """The files of ``folder`` (``profiles`` or ``schedules``) that the repository tracks, as
    absolute paths; empty when this is no git checkout (or git is missing)."""
    try:
        out = subprocess.run(["git", "-C", str(REPOSITORY), "ls-files", "-z", "--", folder],
                             capture_output=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset((REPOSITORY / f).resolve() for f in out.decode().split("\0") if f)


def refuse_shipped(path: Path, option: str, what: str, force: bool) -> None:
    """Raise :class:`~usbyte_opt.errors.UsageError` (exit code 2) when ``path`` is one of the
    repository's shipped ``profiles/`` or ``schedules/`` files, unless ``force``: running a
    documented command must not change a tracked file.

    Example::

        >>> refuse_shipped(REPOSITORY / "schedules" / "nope-never-shipped.json", "-o", "schedule", False)
    """
    p = Path(os.path.abspath(path))
    if force or p.parent.name not in ("profiles", "schedules") or p.parent.resolve() != (
            REPOSITORY / p.parent.name).resolve():
        return
    if p.resolve() in shipped_files(p.parent.name):
        raise UsageError(f"{option} {path}: a shipped {what} of the repository; expected another "
                         "path (-o FILE), or --force to replace it")


def output_file(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """typer callback of an output-file option: :func:`check_output_file` when it is given."""
    if value is not None and not ctx.resilient_parsing:
        check_output_file(value, max(param.opts, key=len) if param.opts else "--output")
    return value


Trace = Annotated[Optional[Path], typer.Option(
    "--trace", dir_okay=False, callback=output_file,
    help="Write a Chrome/Perfetto trace of the predicted timeline here.")]
Json = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")]
Force = Annotated[bool, typer.Option(
    "--force", help="Replace the output even when it is one of the repository's shipped files.")]
Wide = Annotated[bool, typer.Option(
    "--wide", help="Show every column of the table (the ones that do not fit 80 columns in a "
                   "second table).")]


def load_retargeted(path: Path, world_size: Optional[int], bandwidth_gbps: Optional[float],
                    latency_us: Optional[float],
                    by_nodes: Optional[dict[str, Any]] = None) -> tuple[Profile, Profile]:
    """``(original, retargeted)`` profile from a file; the retargeted one is checked against
    the format's bounds like a file (``--bandwidth-gbps 1e308`` is a clean error).
    ``by_nodes``: the retarget-by-nodes options given (:func:`levels`). A profile of one node
    moved to more ranks without ``--nodes`` prints one warning line that says what the ring
    assumes (:func:`usbyte_opt.planning.cost.retarget_warning`)."""
    by_nodes = by_nodes or {}
    original = load_profile(path)
    moved = retargeted(original, world_size, bandwidth_gbps, latency_us, **by_nodes)
    warning = retarget_warning(original.comm, world_size, by_nodes.get("nodes"),
                               by_nodes.get("ranks_per_node"))
    if warning is not None:
        console.warn(warning)
    flags = "/".join(f for f, v in (("--world-size", world_size),
                                     ("--bandwidth-gbps", bandwidth_gbps),
                                     ("--latency-us", latency_us),
                                     *(("--" + k.replace("_", "-"), v) for k, v in by_nodes.items()))
                     if v is not None)
    if flags:
        dump_profile(moved, f"{path} retargeted by {flags}")
    return original, moved


def write_trace(path: Path, timeline: Timeline, label: str) -> Path:
    return write_json(os.fspath(path), chrome_trace(timeline, label))


def cpu_cost_note(comm: CommSpec) -> str:
    """``", training thread X ms/block + Y ms/MB"`` when the profile carries the compute-cost
    option (docs/planner.md), else ``""``.

    Example::

        >>> cpu_cost_note(CommSpec("gloo", 2, 3.0, 0.025, cpu_ms_per_block=0.4, cpu_ms_per_mb=6.0))
        ', training thread 0.40 ms/block + 6.00 ms/MB'
    """
    if not (comm.cpu_ms_per_block or comm.cpu_ms_per_mb):
        return ""
    return f", training thread {comm.cpu_ms_per_block:.2f} ms/block + {comm.cpu_ms_per_mb:.2f} ms/MB"


def host_line(host: Any) -> str:
    """The profile's host cost in one cell (the summary's, ``optimize``'s caption).

    Example::

        >>> from usbyte_opt.formats import HostCost
        >>> host_line(HostCost(9.0, 35.0, 6.0, 23.0, True))
        'runtime 9.0 µs/tensor + 35.0 µs/block, DDP 6.0 + 23.0 µs; on the critical path'
        >>> host_line(HostCost.default("cuda"))      # doctest: +ELLIPSIS
        'runtime 10.5 µs/tensor + 34.0 µs/block, DDP 7.4 + 22.1 µs; hidden ... (defaults: no host section)'
    """
    if host is None:
        return "not measured: none charged"
    where = ("on the critical path" if host.launch_bound else
             "hidden behind the GPU where below compute (not launch-bound)")
    return (f"runtime {host.runtime_tensor_us:.1f} µs/tensor + {host.runtime_block_us:.1f} µs/block, "
            f"DDP {host.ddp_tensor_us:.1f} + {host.ddp_bucket_us:.1f} µs; {where}"
            + (" (defaults: no host section)" if host.defaulted else ""))

