"""Start the benchmark's ranks on this machine — on loopback or inside the lab — and wait.

Each rank is ``python -m usbyte_opt.bench.worker JOB.json`` with torchrun's variables set
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and ``OMP_NUM_THREADS`` splitting
the cores. In the lab it runs as ``ip netns exec <rank's namespace> python ...`` (``ip``
execs, so the pid is the rank's own) with MASTER_ADDR = rank 0's veth address and
GLOO_SOCKET_IFNAME = the veth, so every byte between ranks crosses the shaped link.

Every rank's stderr goes to ``logs/rank<r>.log`` in the output folder; rank 0's ``@@ text``
progress lines are passed to ``progress``. Nothing can hang: a rank that fails stops the
others at once, and past ``timeout_s`` all of them are killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DistributedError, UsbyteError
from ..runtime.local import free_port


def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _error_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if ln.startswith("error:")]
    if errs:
        return errs[-1].removeprefix("error:").strip()
    lines = [ln for ln in lines if not ln.startswith("@@ ")]
    return lines[-1].strip() if lines else ""


def launch_ranks(job_path: Path, nproc: int, logs: Path, lab: Any = None, timeout_s: float = 1800.0,
                 progress: Callable[[str], None] | None = None, poll_s: float = 0.1) -> None:
    """Run ``nproc`` worker ranks on ``job_path`` and wait for all of them.

    Args:
        job_path: the job file every rank reads.
        nproc: number of ranks.
        logs: folder for ``rank<r>.log`` (stderr of each rank).
        lab: a :class:`usbyte_opt.lab.Lab` that is open, or ``None`` for loopback.
        timeout_s: hard limit of the whole run.
        progress: receives rank 0's progress lines.

    Raises:
        UsbyteError: a rank failed (the message is its one-line error, naming the rank).
        DistributedError: the ranks were still running after ``timeout_s`` (killed).
    """
    logs.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                PYTHONUNBUFFERED="1")
    base.pop("USBYTE_TRACE", None)  # the worker sets its own per strategy
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if lab is None:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    else:
        base.update(MASTER_PORT="29500")  # the namespaces are the lab's own: any port is free
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for r in range(nproc):
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            argv = [sys.executable, "-m", "usbyte_opt.bench.worker", str(job_path)]
            if lab is not None:
                env.update(lab.env(r))
                argv = lab.command(r, argv)
            f = open(logs / f"rank{r}.log", "w")
            files.append(f)
            procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=f))
        deadline = time.monotonic() + timeout_s
        reader = open(logs / "rank0.log", errors="replace")
        files.append(reader)
        codes: list[int | None] = [None] * nproc
        pending = ""
        while True:
            chunk = reader.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for ln in lines:
                    if ln.startswith("@@ ") and progress:
                        progress(ln[3:])
            for r, p in enumerate(procs):
                if codes[r] is None:
                    codes[r] = p.poll()
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _stop(procs)
                r = failed[0]
                msg = _error_line(logs / f"rank{r}.log") or f"exited with code {codes[r]}"
                raise UsbyteError(f"bench: rank {r}: {msg} (log: {logs / f'rank{r}.log'})")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                _stop(procs)
                raise DistributedError(f"bench: ranks still running after {timeout_s:g} s; killed "
                                       f"(logs in {logs})")
            time.sleep(poll_s)
    finally:
        if any(p.poll() is None for p in procs):
            _stop(procs)
        for f in files:
            f.close()
