"""Starting ranks, in one place: processes on this host, the lab's namespaces, torchrun.

Every rank usbyte-opt starts is told its place as torchrun tells it (:func:`rank_env`:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), and on CUDA uses the GPU of its ``LOCAL_RANK``. Three ways to start them:

- :func:`run_ranks`: a command as ``nproc`` processes on this host, on loopback or inside the
  lab (:class:`usbyte_opt.bench.netlab.Lab`: ``lab.command`` wraps each rank's command,
  ``lab.env`` gives its address); :func:`run_command` runs ``usbyte-opt ARGS`` that way
  (``usbyte-opt profile --nproc-per-node``), the bench its workers.
- :func:`run_local`: a Python function on ``world_size`` spawned processes, each with its
  process group, and a hard deadline: for tests, examples and benchmarks.
- :func:`run_torchrun`: ``torch.distributed.run`` for ``usbyte-opt launch``, its own log
  lines silenced, Ctrl-C and other signals turned into one outcome; :func:`run_summary`
  reads back the one line the runtime's rank 0 leaves on what it kept.

Nothing hangs: when a rank fails the others are stopped (:func:`stop`, the one way ranks are
stopped here), and past a deadline every rank is.

Example::

    >>> env = rank_env(1, 2, master_port=29500)
    >>> env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]
    ('1', '1', '2', '127.0.0.1')
    >>> from usbyte_opt.launcher import run_local
    >>> import torch.distributed as dist
    >>> def world(rank, ws):          # must be importable by the child processes
    ...     return dist.get_world_size()
    >>> [r.value for r in run_local(world, 2)]      # doctest: +SKIP
    [2, 2]
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from .env import ERROR_FILE_ENV, LAUNCHED_ENV, SUMMARY_FILE_ENV
from .errors import DistributedError, ExitError, PeerFailure, UsageError, UsbyteError, first_line, with_rank

#: The address ranks on this host meet at.
LOOPBACK = "127.0.0.1"
#: The rendezvous port inside the lab, whose namespaces are its own: any port is free there.
LAB_PORT = 29500
#: Prefix of the progress lines a rank writes on stderr for :func:`run_ranks` to pass on.
PROGRESS_PREFIX = "@@ "


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range where it
    can: a port from that range, free when checked, could be taken by any outgoing connection
    (another run's gloo pairs) before the rank that rendezvouses on it has started (seen once
    in the test suite: ``EADDRINUSE``)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(64 if low > 20_000 else 0):
        port = rng.randrange(20_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def threads_per_rank(nproc: int) -> int:
    """This host's cores split between ``nproc`` ranks (at least one each): what
    ``OMP_NUM_THREADS`` defaults to for the ranks started here."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def rank_env(rank: int, nproc: int, master_addr: str = LOOPBACK,
             master_port: int | str = 0) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of ``nproc`` ranks, all on one host."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port)}


def _running(p: Any) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _wait(p: Any, timeout: float | None) -> bool:
    """Wait for ``p`` (a :class:`subprocess.Popen` or a :mod:`multiprocessing` process) up to
    ``timeout`` seconds; whether it has ended."""
    if isinstance(p, subprocess.Popen):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    if p.pid is not None:
        p.join(timeout)
    return not p.is_alive()


def stop(procs: Sequence[Any], grace_s: float = 0.0, term_s: float = 5.0) -> None:
    """Stop the processes of ``procs`` that still run, and wait until every one has ended.

    They get ``grace_s`` to end on their own (a failure every rank shares ends them all a
    moment later, each with its own message), then SIGTERM, then SIGKILL after ``term_s``.
    Takes :class:`subprocess.Popen` and :mod:`multiprocessing` processes alike.
    """
    started = [p for p in procs if isinstance(p, subprocess.Popen) or p.pid is not None]
    deadline = time.monotonic() + grace_s
    while grace_s and any(_running(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in started:
        if _running(p):
            try:
                p.terminate()
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + term_s
    for p in started:
        if not _wait(p, max(0.0, deadline - time.monotonic())):
            p.kill()
            _wait(p, None if isinstance(p, subprocess.Popen) else 5.0)


# --------------------------------------------------------------------------------------------
# Rank errors: torch elastic's error file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankError:
    """What a failed rank left in its error file (torch elastic's format, the one torchrun
    reads: ``{"message": {"message": ..., "extraInfo": {"timestamp": ..., ...}}}``)."""

    message: str
    """The one line that says why (a usbyte-opt error's message; else ``Type: first line``)."""
    exit_code: int = 1
    """The exit code the error stands for."""
    peer: bool = False
    """The rank failed because another rank stopped (:class:`~usbyte_opt.errors.PeerFailure`):
    not a cause."""
    usbyte: bool = False
    """A usbyte-opt error, whose message is the whole story; else an exception of the rank's
    own code, whose traceback is on the rank's stderr."""
    timestamp: float = 0
    """When it failed (seconds since the epoch): the file's ``extraInfo.time`` where this module
    wrote it (sub-second), else torch elastic's whole-second ``timestamp``."""

    @classmethod
    def of(cls, data: Any) -> RankError | None:
        """The error of an error file's parsed JSON; ``None`` when it holds none."""
        msg = data.get("message") if isinstance(data, Mapping) else None
        if isinstance(msg, str):
            return cls(msg, timestamp=int(data.get("timestamp", 0) or 0))
        if not isinstance(msg, Mapping) or not isinstance(msg.get("message"), str):
            return None
        info = msg.get("extraInfo")
        extra: Mapping[str, Any] = info if isinstance(info, Mapping) else {}
        code = extra.get("exit_code", 1)
        when = extra.get("time")
        if not isinstance(when, (int, float)) or isinstance(when, bool):
            try:
                when = int(extra.get("timestamp", 0) or 0)
            except (TypeError, ValueError):
                when = 0
        return cls(msg["message"], code if isinstance(code, int) and code > 0 else 1,
                   extra.get("peer") is True, extra.get("usbyte") is True, when)

    @classmethod
    def read(cls, path: str | os.PathLike) -> RankError | None:
        """The error in the file at ``path``; ``None`` when there is none (the rank succeeded,
        or died without a word: a signal, ``os._exit``)."""
        import json

        try:
            return cls.of(json.loads(Path(path).read_text()))
        except (OSError, ValueError):
            return None


def describe(exc: BaseException) -> RankError:
    """The :class:`RankError` a rank records for ``exc``: a usbyte-opt error's own message and
    exit code, else ``Type: first line`` and 1.

    Example::

        >>> describe(ExitError("rank 1: bad", 3))
        RankError(message='rank 1: bad', exit_code=3, peer=False, usbyte=True, timestamp=0)
        >>> describe(KeyError("k")).message
        "KeyError: 'k'"
    """
    if isinstance(exc, UsbyteError):
        return RankError(first_line(exc), int(exc.exit_code), isinstance(exc, PeerFailure), True)
    return RankError(f"{type(exc).__name__}: {first_line(exc, '')}", 1)


def write_rank_error(exc: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Leave ``exc`` (as :func:`describe` says it) in this rank's error file: ``path``, default
    :data:`~usbyte_opt.env.ERROR_FILE_ENV`. Returns whether a file was written (no file is
    asked for outside torchrun and :func:`run_ranks`)."""
    import json

    target = path or os.environ.get(ERROR_FILE_ENV)
    if not target:
        return False
    e = describe(exc)
    data = {"message": {"message": e.message, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(time.time())),
        "time": time.time(),
        "exit_code": e.exit_code, "peer": e.peer, "usbyte": e.usbyte}}}
    try:
        Path(target).write_text(json.dumps(data))
    except OSError:
        return False  # the launcher's folder is gone: the rank's own stderr still says it
    return True


def record_rank(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a rank's entry point: torch elastic's
    :func:`~torch.distributed.elastic.multiprocessing.errors.record`, whose error handler
    leaves an exception's one line (:func:`write_rank_error`) in the error file that torchrun,
    ``usbyte-opt launch`` and :func:`run_ranks` read; then the exception propagates as before.
    torch is imported when ``fn`` is first called."""
    import functools

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(fn, error_handler=_error_handler())(*args, **kwargs)

    return entry


@functools.cache
def _error_handler() -> Any:
    """torch elastic's error handler, recording the one line of :func:`describe`."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class OneLine(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            if not _exits_quietly(e):
                write_rank_error(e, self._get_error_file_path())

    return OneLine()


def _exits_quietly(e: BaseException) -> bool:
    """A command-line exit (typer's ``Exit``, a usage error), not an error of the rank."""
    return type(e).__name__ in ("Exit", "Abort") and type(e).__module__.split(".")[0] in ("click",
                                                                                          "typer")


def _collective_text(message: str) -> bool:
    """Whether a failed rank's one line is a collective that failed because another rank
    stopped (the text of :func:`usbyte_opt.group.collective_failure`, read from an error
    file)."""
    return ("gloo" in message or "NCCL" in message) and any(
        s in message for s in ("Connection", "connection", "Timed out", "timed out", "closed", "abort"))


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed rank as the process that started it saw it: its global rank, exit code
    (negative: the signal that ended it), when it failed, the error it left (if any) and its
    node (``GROUP_RANK``; ``None`` when unknown)."""

    rank: int
    exitcode: int
    timestamp: float
    error: RankError | None = None
    node: int | None = None

    @property
    def peer(self) -> bool:
        """It failed because another rank stopped (its collective failed): not a cause."""
        return self.error is not None and (self.error.peer or _collective_text(self.error.message))

    @property
    def stopped(self) -> bool:
        """It was stopped (SIGTERM) by its launcher after another rank failed: not a cause."""
        return self.exitcode == -signal.SIGTERM

    @property
    def label(self) -> str:
        """``rank R``, with ``(node K)`` when the node is known."""
        return f"rank {self.rank}" + (f" (node {self.node})" if self.node is not None else "")


def first_failure(failures: Sequence[Failure]) -> Failure | None:
    """The failure that caused the others: the earliest (then the lowest rank) of those that
    failed on their own, neither because a peer stopped (:attr:`Failure.peer`) nor stopped
    by the launcher (:attr:`Failure.stopped`); ``None`` when every failure here is such a
    consequence (on several nodes: the cause is on another node).

    Example::

        >>> peer = RankError("rank 1: a collective failed", peer=True, usbyte=True)
        >>> killed, hurt = Failure(3, -9, 100.2, None, 1), Failure(1, 4, 100.1, peer, 0)
        >>> first_failure([hurt, killed]).label
        'rank 3 (node 1)'
        >>> first_failure([hurt]) is None
        True
    """
    causes = [f for f in failures if not f.peer and not f.stopped]
    return min(causes, key=lambda f: (f.timestamp, f.rank)) if causes else None


#: Key prefix of the failures the nodes' launchers exchange (:class:`FailureBoard`).
FAILURE_KEY = "usbyte-failure"


def _failure_record(f: Failure) -> dict[str, Any]:
    e = f.error
    return {"rank": f.rank, "exitcode": f.exitcode, "time": f.timestamp, "node": f.node,
            "error": None if e is None else {"message": e.message, "exit_code": e.exit_code,
                                             "peer": e.peer, "usbyte": e.usbyte,
                                             "timestamp": e.timestamp}}


def _failure_of(d: Mapping[str, Any]) -> Failure:
    e = d.get("error")
    return Failure(int(d["rank"]), int(d["exitcode"]), float(d["time"]),
                   None if not e else RankError(str(e["message"]), int(e["exit_code"]),
                                                bool(e["peer"]), bool(e["usbyte"]),
                                                float(e["timestamp"])),
                   None if d.get("node") is None else int(d["node"]))


class FailureBoard:
    """Where the launchers of a run's nodes leave their failures for one another, so that each
    names the same first one (:func:`first_failure`): a small TCP store at ``port`` (the
    rendezvous port + 1 in ``usbyte-opt launch``) that node 0's launcher hosts from before
    torchrun starts until the others have read it (or :meth:`close`). Best effort: where the
    store cannot be hosted or reached in ``wait_s`` seconds, a node keeps its own view.
    Failure times are each node's wall clock.

    Example (two nodes' launchers, here in one process)::

        >>> port = free_port()
        >>> host, other = FailureBoard(0, 2, LOOPBACK, port), FailureBoard(1, 2, LOOPBACK, port)
        >>> import threading
        >>> killed = Failure(3, -9, 100.0, None, 1)
        >>> t = threading.Thread(target=other.share, args=([killed],)); t.start()
        >>> [f.label for f in host.share([Failure(0, 1, 100.5, RankError("rank 0: x", peer=True), 0)])]
        ['rank 0 (node 0)', 'rank 3 (node 1)']
        >>> t.join(); host.close()
    """

    def __init__(self, node: int, nodes: int, host: str, port: int, wait_s: float = 5.0):
        self.node, self.nodes, self.host, self.port, self.wait_s = node, nodes, host, port, wait_s
        self.store: Any = None
        if node == 0:
            self.store = self._open(True)

    def _open(self, master: bool) -> Any:
        from datetime import timedelta

        import torch.distributed as dist

        try:
            return dist.TCPStore(self.host, self.port, None, master, timedelta(seconds=self.wait_s),
                                 wait_for_workers=False)
        except Exception:  # noqa: BLE001 - port taken, host unreachable: no exchange
            return None

    def share(self, failures: Sequence[Failure]) -> list[Failure]:
        """This node's ``failures`` and those the other nodes left (waiting up to ``wait_s``
        for every node's); node 0 then waits (``wait_s`` more at most) until every node that
        wrote has read."""
        import json

        store = self.store if self.node == 0 else self._open(False)
        if store is None:
            return list(failures)
        key = FAILURE_KEY
        keys = [f"{key}/{k}" for k in range(self.nodes)]
        out: list[Failure] = []
        try:
            store.set(f"{key}/{self.node}", json.dumps([_failure_record(f) for f in failures]))
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.05)
            for k in keys:
                if store.check([k]):
                    out += [_failure_of(d) for d in json.loads(store.get(k))]
            store.set(f"{key}/read/{self.node}", "1")
            if self.node == 0:
                wrote = [f"{key}/read/{k}" for k in range(self.nodes) if store.check([f"{key}/{k}"])]
                until = time.monotonic() + self.wait_s
                while time.monotonic() < until and not store.check(wrote):
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the host went away: what was read
            pass
        return out or list(failures)

    def close(self) -> None:
        """Stop hosting (node 0) or drop the connection."""
        self.store = None


@dataclass(frozen=True, slots=True)
class Exit:
    """How the ranks of :func:`run_ranks` ended."""

    codes: tuple[int, ...]
    """Every rank's exit code (negative: the signal that ended it)."""
    failed: tuple[int, ...] = ()
    """The ranks that had failed on their own when the first failure was seen, in rank order
    (the others were then stopped); empty when every rank succeeded or the deadline passed."""
    errors: Mapping[int, RankError] = field(default_factory=dict)
    """The error each failed rank left in its error file (:class:`RankError`)."""
    timed_out: bool = False
    """The deadline passed and every rank was stopped."""

    @property
    def ok(self) -> bool:
        return not self.failed and not self.timed_out


def run_ranks(argv: Sequence[str], nproc: int, *, logs: Path | None = None, terminal: bool = False,
              lab: Any = None, env: Mapping[str, str] | None = None, timeout_s: float | None = None,
              grace_s: float = 0.0, progress: Callable[[str], None] | None = None,
              poll_s: float = 0.05) -> Exit:
    """Run ``argv`` as ``nproc`` ranks on this host and wait for all of them.

    Each rank's environment is ``env`` (default: this process's) with :func:`rank_env` and
    ``OMP_NUM_THREADS`` (unless set) from :func:`threads_per_rank`, and its own error file
    (:data:`~usbyte_opt.env.ERROR_FILE_ENV`, in a temporary folder), read back once it has
    ended: a rank's entry point under :func:`record_rank` leaves its one line there. On
    loopback the ranks meet
    at a free port; with ``lab`` (an open :class:`usbyte_opt.bench.netlab.Lab`) each rank runs as
    ``lab.command(rank, argv)`` with ``lab.env(rank)``, so that its bytes cross the lab's links.

    Args:
        argv: the command of every rank.
        nproc: number of ranks.
        logs: folder for ``rank<r>.log``, each rank's stderr (kept); ``None``: temporary files.
        terminal: rank 0 keeps this process's terminal (its progress bars and messages show).
        lab: an open lab, or ``None`` for loopback.
        env: the environment the ranks' own is built on.
        timeout_s: deadline of the whole run; past it every rank is stopped.
        grace_s: after the first failure, how long the other ranks get to end on their own
            (with their own messages) before they are stopped.
        progress: receives rank 0's progress lines (``@@ text`` on its stderr; needs a log,
            so not with ``terminal``).
        poll_s: how often the ranks are looked at.

    Returns:
        :class:`Exit`: every rank's code, the ranks that failed on their own and their errors,
        whether the deadline passed.
    """
    if terminal and progress is not None:
        raise ValueError("progress lines are read from rank 0's log, which terminal=True does not keep")
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    addr, port = (LOOPBACK, free_port()) if lab is None else (lab.master_addr, LAB_PORT)
    procs: list[subprocess.Popen] = []
    files: list[IO[str]] = []
    temp = Path(tempfile.mkdtemp(prefix="usbyte-ranks-"))  # error files, and logs unless kept
    folder = logs if logs is not None else temp
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for r in range(nproc):
            rank_argv = list(argv)
            env_r = dict(base, **rank_env(r, nproc, addr, port),
                         **{ERROR_FILE_ENV: str(temp / f"rank{r}.error.json")})
            if lab is not None:
                env_r.update(lab.env(r))
                rank_argv = lab.command(r, rank_argv)
            if terminal and r == 0:
                procs.append(subprocess.Popen(rank_argv, env=env_r))
                continue
            f = open(folder / f"rank{r}.log", "w")
            files.append(f)
            procs.append(subprocess.Popen(rank_argv, env=env_r, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=f))
        reader: IO[str] | None = None
        if progress is not None:
            reader = open(folder / "rank0.log", errors="replace")
            files.append(reader)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed, timed_out = _watch(procs, reader, progress, deadline, grace_s, poll_s)
        final = tuple(int(p.wait()) for p in procs)
        # Ranks that failed during the grace period too, after the first one seen.
        failed = failed + [r for r, c in enumerate(final) if c != 0 and r not in failed]
        errors = {r: e for r in range(nproc)
                  if (e := RankError.read(temp / f"rank{r}.error.json")) is not None}
        return Exit(final, tuple(failed), errors, timed_out)
    finally:
        if any(p.poll() is None for p in procs):
            stop(procs)
        for fh in files:
            fh.close()
        shutil.rmtree(temp, ignore_errors=True)


def _watch(procs: Sequence[subprocess.Popen], reader: IO[str] | None,
           progress: Callable[[str], None] | None, deadline: float | None, grace_s: float,
           poll_s: float) -> tuple[list[int], bool]:
    """Wait for ``procs``, passing rank 0's progress lines on, until every rank succeeded, one
    failed (the others are then stopped after ``grace_s``) or the deadline passed (every rank
    is stopped). Returns the ranks that had failed when it was seen, and whether the deadline
    passed."""
    codes: list[int | None] = [None] * len(procs)
    pending = ""
    while True:
        if reader is not None and progress is not None:
            chunk = reader.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for ln in lines:
                    if ln.startswith(PROGRESS_PREFIX):
                        progress(ln[len(PROGRESS_PREFIX):])
        for r, p in enumerate(procs):
            if codes[r] is None:
                codes[r] = p.poll()
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            stop(procs, grace_s=grace_s)
            return failed, False
        if all(c == 0 for c in codes):
            return [], False
        if deadline is not None and time.monotonic() > deadline:
            stop(procs)
            return [], True
        time.sleep(poll_s)


def run_command(nproc: int, argv: Sequence[str]) -> tuple[int, str]:
    """Run ``usbyte-opt ARGV`` (``python -m usbyte_opt``) as ``nproc`` ranks on this host, as
    torchrun would, and wait for them.

    Rank 0 keeps the terminal (its progress bars and messages show); the others' output is
    kept aside. When a rank fails the others get a moment to fail on their own (a model that
    fails to build fails on every rank), then are stopped, so nothing waits on a collective
    that will never come. The ranks get :data:`~usbyte_opt.env.LAUNCHED_ENV`: a rank whose
    collective failed only because a peer stopped prints nothing, and its error file says so
    (:class:`~usbyte_opt.errors.PeerFailure`). Returns ``(exit code, message)``: the message
    is the error of the first rank that failed on its own, unless that is rank 0 (which has
    printed its own), or says that a collective failed when none did.
    """
    if nproc < 1:
        raise UsageError(f"--nproc-per-node: expected an integer >= 1, got {nproc}")
    res = run_ranks([sys.executable, "-m", "usbyte_opt", *argv], nproc, terminal=True, grace_s=3.0,
                    env=dict(os.environ, **{LAUNCHED_ENV: "1"}))
    if not res.failed:
        return 0, ""
    # The cause: the first rank that failed on its own, not because a peer stopped.
    # (a rank stopped by the launcher, with a negative code, is a cause only if seen first)
    causes = [r for r in res.failed if not (r in res.errors and res.errors[r].peer)
              and (res.codes[r] > 0 or r == res.failed[0])]
    if not causes:
        return 1, (f"rank {res.failed[0]}: a collective failed; another rank stopped or timed out "
                   "without an error of its own (--debug shows the tracebacks)")
    # Rank 0 keeps the terminal and has printed its own line, which names a peer's start-up
    # error when that is why it stopped: nothing more to say, whichever rank exited first.
    first = 0 if 0 in causes and res.codes[0] > 0 else causes[0]
    code = res.codes[first] if res.codes[first] > 0 else 1
    if first == 0:
        return code, ""  # rank 0 failed on its own and has printed its error
    error = res.errors.get(first)
    shown = error.message if error is not None else f"exited with code {res.codes[first]}"
    return code, with_rank(first, shown)


# --------------------------------------------------------------------------------------------
# A function on spawned ranks
# --------------------------------------------------------------------------------------------


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


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
           args: Sequence[Any], out: str, threads: int, pg_timeout_s: float) -> None:
    t0 = time.perf_counter()
    res = RankResult(rank)
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        os.environ.update(rank_env(rank, world_size, LOOPBACK, port))
        kwargs: dict[str, Any] = {}
        if "nccl" in backend:  # one GPU per rank, by local rank, as torchrun users do
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
                                **kwargs)
        try:
            res.value = fn(rank, world_size, *args)
        finally:
            # (torch DDP's reducers left in cycles go first: one freed after the group is
            # destroyed drops its last reference with the GIL held, which can deadlock with
            # the group's worker threads, :func:`usbyte_opt.profiler.host.host_cost`.)
            gc.collect()
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

    Each rank is a process started with ``spawn``, with its process group initialised (TCP
    rendezvous on a free loopback port) before ``fn`` runs and destroyed after it.

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
        stop(procs, term_s=0.0)  # past the deadline: killed at once
        shutil.rmtree(out, ignore_errors=True)


def values(results: Sequence[RankResult]) -> list[Any]:
    """The values of ``results``; the first failed rank's error re-raised as
    :class:`~usbyte_opt.errors.DistributedError` (with its traceback in the message's tail)."""
    for r in results:
        if not r.ok:
            raise DistributedError(f"rank {r.rank} raised {r.error_type}: {r.error}\n{r.trace}")
    return [r.value for r in results]


# --------------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------------


def _quiet_torchrun() -> None:
    """Silence torchrun's own log lines (its OMP notice, "failed (exitcode ...)", the
    death-signal notices): the caller reports the outcome itself, in one line."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def run_torchrun(args: Any, quiet: bool = True) -> dict[int, Any] | None:
    """Run ``torch.distributed.run`` on ``args`` (parsed by its own parser) and wait.

    ``OMP_NUM_THREADS`` defaults to :func:`threads_per_rank` (torchrun would set 1, with a
    warning). Returns ``None`` when every rank succeeded, else torchrun's failures by global
    rank (each with ``exitcode`` and ``timestamp``; empty when torchrun named none). Ctrl-C
    becomes :class:`KeyboardInterrupt` and any other signal a :class:`UsbyteError` with exit
    code 128 + signal; after either, or after a failure, a second Ctrl-C is ignored so that
    the caller's exit stays one line.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    nproc = str(args.nproc_per_node)
    if "OMP_NUM_THREADS" not in os.environ and nproc.isdigit() and int(nproc) > 1:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(int(nproc)))
    if quiet:
        _quiet_torchrun()
    try:
        run(args)
    except SignalException as e:
        # torchrun's handlers stay installed: a second Ctrl-C must not interrupt the exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise ExitError(f"launch: stopped by {signal.Signals(e.sigval).name}",
                        128 + int(e.sigval)) from None
    except ChildFailedError as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return dict(e.failures) if e.failures else {}
    return None


@contextlib.contextmanager
def run_summary() -> Iterator[list[str]]:
    """Inside: :data:`~usbyte_opt.env.SUMMARY_FILE_ENV` names a file in a fresh temporary
    folder, for the ranks started there (the runtime's rank 0 writes its one-line summary to
    it: what it kept, against DDP's buckets). After: the list given holds that line, or
    nothing when no rank wrote one; the folder is gone and the variable as it was.

    Example::

        >>> with run_summary() as said:
        ...     with open(os.environ["USBYTE_SUMMARY_FILE"], "w") as f:
        ...         _ = f.write("kept the plan best\\n")
        >>> said, "USBYTE_SUMMARY_FILE" in os.environ
        (['kept the plan best'], False)
    """
    folder = tempfile.mkdtemp(prefix="usbyte-summary-")
    path = os.path.join(folder, "summary.txt")
    before = os.environ.get(SUMMARY_FILE_ENV)
    os.environ[SUMMARY_FILE_ENV] = path
    said: list[str] = []
    try:
        yield said
    finally:
        if before is None:
            os.environ.pop(SUMMARY_FILE_ENV, None)
        else:
            os.environ[SUMMARY_FILE_ENV] = before
        try:
            with open(path) as f:
                line = f.read().strip().splitlines()
            said.extend(line[:1])
        except OSError:
            pass
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["Exit", "Failure", "LAB_PORT", "LOOPBACK", "RankError", "RankResult", "describe", "first_failure",
           "FailureBoard", "free_port",
           "rank_env", "record_rank", "run_command", "run_local", "run_ranks", "run_summary", "run_torchrun",
           "stop",
           "threads_per_rank", "values", "write_rank_error"]
