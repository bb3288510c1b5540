"""Several ranks on this machine, with a hard deadline: for tests, examples and benchmarks.

:func:`run_local` starts ``world_size`` processes (``spawn``), gives each an initialized
process group (TCP rendezvous on a free loopback port), runs ``fn(rank, world_size, *args)``
and returns what every rank returned or raised. Nothing can hang: past ``timeout_s`` the
processes are killed and :class:`~usbyte_opt.errors.DistributedError` is raised.

Example::

    >>> from usbyte_opt.runtime.local import run_local
    >>> import torch.distributed as dist
    >>> def world(rank, ws):          # must be importable by the child processes
    ...     return dist.get_world_size()
    >>> [r.value for r in run_local(world, 2)]      # doctest: +SKIP
    [2, 2]
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

from ..errors import DistributedError


@dataclass(slots=True)
class RankResult:
    """What one rank returned (``value``) or raised (``error_type``, ``error``, ``trace``)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    """Qualified name of the exception class, e.g. ``usbyte_opt.errors.DistributedError``."""
    error: str | None = None
    trace: str | None = None
    elapsed_s: float = 0.0
    """Seconds from process start to the end of ``fn`` (process group set-up included)."""

    @property
    def ok(self) -> bool:
        return self.error_type is None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
           args: Sequence[Any], out: str, threads: int, pg_timeout_s: float) -> None:
    t0 = time.perf_counter()
    res = RankResult(rank)
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        kwargs: dict[str, Any] = {}
        if "nccl" in backend:  # one GPU per rank, by local rank, as torchrun users do
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
                                **kwargs)
        try:
            res.value = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may be broken after a failure
                pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        res.error_type = f"{type(e).__module__}.{type(e).__qualname__}"
        res.error = str(e)
        res.trace = traceback.format_exc()
    res.elapsed_s = time.perf_counter() - t0
    with open(os.path.join(out, f"{rank}.tmp"), "wb") as f:
        try:
            pickle.dump(res, f)
        except Exception as e:  # noqa: BLE001 - an unpicklable value
            pickle.dump(RankResult(rank, None, type(e).__name__, f"result not picklable: {e}"), f)
    os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.pkl"))
    # Skip interpreter teardown (thread pools of the process group): the result is written.
    os._exit(0 if res.ok else 1)


def run_local(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
              timeout_s: float = 120.0, backend: str = "gloo", threads: int = 1,
              pg_timeout_s: float = 60.0) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; one result per rank.

    Args:
        fn: a module-level (importable) function.
        world_size: number of processes.
        args: extra arguments, pickled to every rank.
        timeout_s: hard deadline for the whole run; past it every process is killed.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        threads: ``torch.set_num_threads`` in each rank (0: leave torch's default).
        pg_timeout_s: the process group's own timeout (collectives fail after it).

    Returns:
        A :class:`RankResult` per rank, in rank order.

    Raises:
        DistributedError: the deadline passed (the processes were killed). A rank that died
            without reporting gets a result with ``error_type == "exit"``.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = tempfile.mkdtemp(prefix="usbyte-local-")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, tuple(args), out,
                                             threads, pg_timeout_s), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if alive:
            raise DistributedError(f"local run of {getattr(fn, '__name__', fn)}: ranks {alive} "
                                   f"still running after {timeout_s:g} s; killed")
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(out, f"{r}.pkl")
            if not os.path.exists(path):
                results.append(RankResult(r, None, "exit", f"rank {r} exited with code "
                                          f"{p.exitcode} without a result"))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(5)
        shutil.rmtree(out, ignore_errors=True)


def values(results: Sequence[RankResult]) -> list[Any]:
    """The values of ``results``; the first failed rank's error re-raised as
    :class:`~usbyte_opt.errors.DistributedError` (with its traceback in the message's tail)."""
    for r in results:
        if not r.ok:
            raise DistributedError(f"rank {r.rank} raised {r.error_type}: {r.error}\n{r.trace}")
    return [r.value for r in results]
