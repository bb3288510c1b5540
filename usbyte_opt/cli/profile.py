"""``usbyte-opt profile MODEL``: measure per-tensor timing and all-reduce cost, write a profile.

Runs on every rank under torchrun (RANK/WORLD_SIZE set; multi-node works the same way), or
starts ``--nproc-per-node`` ranks on this host itself. Rank 0 shows progress and writes
``profiles/<name>.json`` (atomically); the domain work is :func:`usbyte_opt.profiler.profile_model`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import console
from ..console import plural
from ..env import DEBUG_ENV, LAUNCHED_ENV
from ..errors import PeerFailure, UsageError, first_line
from . import common


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Optim(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


def profile(
    model: Annotated[str, typer.Argument(
        help="Built-in name (mlp, cnn, transformer, resnet50, bert-base, gpt2, ...; "
             "torchvision:NAME) or package.module:factory, called as factory(batch_size) and "
             "returning (model, inputs, loss_fn[, optimizer]) (docs/profiles.md, The model "
             "factory).")],
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", min=1, help="Per-rank batch size (default: the model's own).")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(
        "--nproc-per-node", min=1, help="Start this many ranks on this host (ignored under torchrun)."
    )] = None,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed iterations before timing.")] = 3,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Timed iterations; medians are kept.")] = 10,
    device: Annotated[Optional[Device], typer.Option(
        "--device", help="cpu or cuda (default: cuda if available).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Profile file (default: NAME.json in profiles/, NAME the profile's "
                               "name). A profile the repository ships is not replaced without "
                               "--force.")] = None,
    name: Annotated[Optional[str], typer.Option(
        "--name", help="Profile name (default: from MODEL).")] = None,
    optimizer: Annotated[Optional[Optim], typer.Option(
        "--optimizer", help="Optimizer whose step gives update_ms (sgd = SGD with momentum). "
                            "Default: the model factory's own (a 4th element or an optimizer "
                            "attribute), else sgd.")] = None,
    comm_min_kb: Annotated[float, typer.Option(
        "--comm-min-kb", min=0.001, help="Smallest all-reduce of the sweep (KiB).")] = 4.0,
    comm_max_mb: Annotated[float, typer.Option(
        "--comm-max-mb", min=0.001, help="Largest all-reduce of the sweep (MiB).")] = 64.0,
    comm_points: Annotated[int, typer.Option(
        "--comm-points", min=2, help="Sizes in the sweep (log-spaced).")] = 12,
    comm_repeats: Annotated[int, typer.Option(
        "--comm-repeats", min=1, help="Timed all-reduces per size.")] = 5,
    alpha_ms: Annotated[Optional[float], typer.Option(
        "--alpha-ms", min=0.0, help="World size 1 only: analytic latency (default 1.3).")] = None,
    algbw_gbs: Annotated[Optional[float], typer.Option(
        "--algbw-gbs", min=1e-6, help="World size 1 only: analytic bandwidth in GB/s (default 1.79: 8 "
                            "workers, 25 Gbit/s).")] = None,
    shard_sweep: Annotated[bool, typer.Option(
        "--shard-sweep/--no-shard-sweep", help="With 2+ ranks, also sweep reduce-scatter and "
                                               "all-gather (sharded data parallel's collectives) "
                                               "beside all-reduce.")] = True,
    cpu_probe: Annotated[bool, typer.Option(
        "--cpu-probe/--no-cpu-probe", help="With 2+ ranks, also measure what all-reduce costs the "
                                           "training thread (per block and per MB, while training "
                                           "runs) so that the planner charges it.")] = True,
    host_probe: Annotated[bool, typer.Option(
        "--host-probe/--no-host-probe", help="Also measure what the usbyte-opt runtime and torch "
                                             "DDP cost the host per tensor and per block (a model "
                                             "of many tiny tensors, about a second) and, on "
                                             "CUDA, whether the iteration is launch-bound, so "
                                             "that the planner charges it (off: its "
                                             "defaults).")] = True,
    compile_backend: Annotated[Optional[str], typer.Option(
        "--compile", metavar="BACKEND",
        help="Time the model as torch.compile with this backend trains it (inductor, "
             "aot_eager, ...): its graphs split where each tensor is first used, as the "
             "runtime splits them at the plan's blocks, so that the gradients' ready times "
             "are the compiled backward's and the need times its forward's gates.")] = None,
    cut_probes: Annotated[int, typer.Option(
        "--cut-probes", min=0,
        help="With --compile: how many places to cut the graph at are timed one by one (a "
             "copy compiled with that one cut beside one compiled whole), so that the planner "
             "cuts only where the overlap pays for the cut (0: cuts taken as free).")] = 12,
    cut_probe_s: Annotated[float, typer.Option(
        "--cut-probe-s", min=0.0,
        help="With --compile: time cap (seconds) of those probes; the places not timed within "
             "it cost the median of the others.")] = 120.0,
    timeout_s: Annotated[float, typer.Option(
        "--timeout-s", min=0.001, help="Process-group timeout (seconds).")] = 600.0,
    stable_s: Annotated[float, typer.Option(
        "--stable-s", min=0.0, help="Time cap (seconds) of the extra rounds the all-reduce sweep "
                                    "and the probe each run until their numbers are stable (0: "
                                    "none).")] = 20.0,
    force: common.Force = False,
) -> None:
    """Profile MODEL: per-tensor ready/need/update times and the all-reduce cost curve.

    On several nodes, run it under torchrun on each node, K the node's index (0 on HOST); on
    gloo set GLOO_SOCKET_IFNAME to the interface that reaches the other nodes:

    `torchrun --nnodes 2 --nproc-per-node 8 --node-rank K --master-addr HOST
    --master-port 29500 -m usbyte_opt profile MODEL`
    """
    from ..models import model_name

    path = output or Path("profiles") / f"{name or model_name(model)}.json"
    if os.environ.get("RANK", "0") == "0":  # before any work: rank 0 writes it
        common.refuse_shipped(path, "--output" if output else "default output", "profile", force)
        common.check_output_file(path, "--output")
    if nproc_per_node is not None and "RANK" not in os.environ:
        _relaunch(model, nproc_per_node)
        return
    if comm_min_kb <= 0 or comm_max_mb * 1024 < comm_min_kb:
        raise UsageError(f"--comm-min-kb/--comm-max-mb: expected 0 < min <= max, got {comm_min_kb} KiB "
                          f"and {comm_max_mb} MiB")
    if "RANK" in os.environ:  # a rank of torchrun's: before the rendezvous, on every node
        _preflight(device.value if device else None)
    from ..collectives.sweep import default_sizes
    from ..profiler.options import ProfileOptions

    opts = ProfileOptions(
        warmup=warmup, repeats=repeats, optimizer=(optimizer or Optim.sgd).value,
        factory_optimizer=optimizer is None,
        comm_sizes=tuple(default_sizes(int(comm_min_kb * 1024), int(comm_max_mb * (1 << 20)),
                                       comm_points)),
        comm_points=comm_points, comm_repeats=comm_repeats, alpha_ms=alpha_ms, algbw_gbs=algbw_gbs,
        shard_sweep=shard_sweep, cpu_probe=cpu_probe, stable_s=stable_s, host_probe=host_probe,
        compile=compile_backend, cut_probes=cut_probes, cut_probe_s=cut_probe_s)
    _profile_here(model, batch_size, opts, name, device.value if device else None, path, timeout_s)


def _preflight(device: str | None) -> None:
    """On gloo (the CPU path), a world spanning nodes whose ranks here the others could not
    reach fails now, in one line (:func:`usbyte_opt.preflight.check_gloo`), not in
    ``init_process_group`` after its timeout."""
    from ..device import resolve_device
    from ..preflight import check_gloo

    if resolve_device(device).type != "cuda":
        check_gloo("profile")


def _relaunch(model: str, nproc: int) -> None:
    """Run this very command line as ``nproc`` ranks on this host (each rank sees ``RANK`` and
    ignores ``--nproc-per-node``); the first failing rank's line is the one error."""
    from ..launcher import run_command
    from ..models import resolve

    resolve(model)  # a bad spec fails here, once, before any rank starts
    code, message = run_command(nproc, common.ARGV)
    if code:
        if message:
            console.error(message)
        raise typer.Exit(code)


def _profile_here(model: str, batch_size: int | None, opts: Any, name: str | None,
                  device: str | None, path: Path, timeout_s: float) -> None:
    """Profile on this rank's process group (or alone); rank 0 writes the file and prints."""
    import torch.distributed as dist

    from ..device import resolve_device
    from ..formats import save_profile
    from ..group import init_from_env
    from ..profiler.run import profile_model

    dev = resolve_device(device)
    owns_group = init_from_env(dev, timeout_s)
    try:
        rank = dist.get_rank() if dist.is_initialized() else 0
        bar, progress = _progress_bar(rank)
        with bar, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                prof = profile_model(model, batch_size, opts, name=name, device=dev,
                                     progress=progress)
            except RuntimeError as e:
                failure = _collective_failed(e, rank)
                if failure is None:
                    raise
                raise failure from e
        if rank != 0:
            return
        for w in caught:
            if w.category.__name__ == "ProfileWarning":
                console.warn(str(w.message))
        _summary(prof, save_profile(prof, path))
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


#: Seconds between two progress lines of :class:`PlainProgress` (stderr not a terminal).
PLAIN_PROGRESS_S = 5.0


def _progress_bar(rank: int) -> tuple[Any, Callable[[str, int, int], None]]:
    """Rank 0's progress: bars on a terminal (one per phase), else a plain line on stderr
    every :data:`PLAIN_PROGRESS_S` seconds (:class:`PlainProgress`); nothing on the
    other ranks. Returns the context that shows it and the callback that feeds it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if rank == 0 and not console.err.is_terminal:
        plain = PlainProgress(console.info, PLAIN_PROGRESS_S)
        return plain, plain
    bar = Progress(TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console.err, transient=True,
                   disable=rank != 0 or not console.err.is_terminal)
    tasks: dict[str, Any] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.update(tasks[phase], completed=done)

    return bar, progress


class PlainProgress:
    """Progress for a log or a pipe: ``profile: PHASE DONE/TOTAL (N s)`` through ``say``
    every ``every_s`` seconds, N the seconds since it was made, the last phase reported (or
    ``starting``) repeated while a long step runs; silent in between. Called as a progress
    callback; ``with`` it, a thread says the line when no step reports for ``every_s``.

    Example::

        >>> t = iter([0.0, 1.0, 6.0, 7.0, 13.2, 14.0])
        >>> lines = []
        >>> p = PlainProgress(lines.append, 5.0, clock=lambda: next(t))
        >>> for done in (1, 2, 3, 4): p("compute", done, 14)
        >>> lines
        ['profile: compute 2/14 (6 s)', 'profile: compute 4/14 (13 s)']
        >>> p.tick(); lines[-1]                   # 0.8 s later: nothing new
        'profile: compute 4/14 (13 s)'
    """

    def __init__(self, say: Callable[[str], None], every_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.every_s, self.clock = say, every_s, clock
        self.start = self.last = clock()
        self.state = "starting"
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self.lock:
            self.state = f"{phase} {done}/{total}"
        self.tick()

    def tick(self) -> None:
        """Say the line when ``every_s`` seconds have passed since the last one."""
        with self.lock:
            now = self.clock()
            if now - self.last < self.every_s:
                return
            self.last = now
            line = f"profile: {self.state} ({now - self.start:.0f} s)"
        self.say(line)

    def __enter__(self) -> PlainProgress:
        def run() -> None:
            while not self.stopped.wait(self.every_s / 5):
                self.tick()

        self.thread = threading.Thread(target=run, name="usbyte-progress", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


def _collective_failed(e: RuntimeError, rank: int) -> PeerFailure | None:
    """What a rank reports when a collective failed: a rank died or timed out, and every
    survivor lands here, so it is said once, plainly (by the launcher, which names the cause,
    for ranks that ``--nproc-per-node`` started). ``None`` when ``e`` is no such failure."""
    from ..group import collective_failure

    if not collective_failure(e):
        return None
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first_line(e, "")).split(". This is")[0]
    return PeerFailure(f"rank {rank}: a collective failed ({type(e).__name__}: {first}); another "
                       "rank probably stopped or timed out",
                       silent=bool(os.environ.get(LAUNCHED_ENV)) and not os.environ.get(DEBUG_ENV))


def _summary(prof: Any, path: Path) -> None:
    """The table rank 0 prints once the profile is written."""
    total = sum(t.nbytes for t in prof.tensors)
    c = prof.comm
    console.table(f"profile {prof.name} → {path}", ["", "value"], [
        ["tensors", f"{len(prof.tensors)} ({total / 1e6:.1f} MB)"],
        ["forward / backward", f"{prof.forward_ms:.2f} / {prof.backward_ms:.2f} ms"],
        ["optimizer step", f"{sum(t.update_ms for t in prof.tensors):.2f} ms ({prof.meta['optimizer']}, "
                           f"from {prof.meta.get('optimizer_from', '--optimizer')})"],
        ["world", f"{plural(prof.meta['world_size'], 'rank')}"
                  + (f" on {plural(c.nodes, 'node')} of {c.ranks_per_node}" if c.nodes > 1 else "")
                  + f" ({plural(prof.meta['hosts'], 'host')}), {prof.meta['device']}, "
                    f"batch {prof.meta['batch_size']}"],
        ["all-reduce", f"{c.backend}: alpha {c.alpha_ms:.3f} ms, algbw {c.algbw_gbs:.3f} GB/s"
                       + (f" ({plural(len(c.samples), 'size')})" if c.samples else "")],
        *([name, f"alpha {x.alpha_ms:.3f} ms, algbw {x.algbw_gbs:.3f} GB/s"]
          for name, x in ((f"intra-node ({plural(c.ranks_per_node, 'rank')})", c.intra),
                          (f"inter-node ({plural(c.nodes, 'rank')})", c.inter),
                          ("reduce-scatter", c.reduce_scatter), ("all-gather", c.all_gather))
          if x is not None),
        ["host cost", common.host_line(prof.host)],
    ], justify_right_from=2)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)
