"""No abort at interpreter exit (usbyte_opt.runtime.exit_hook, docs/runtime.md "Exit").

A gloo worker that frees a finished collective's work needs the GIL; if it asked for it while
the script's last lines held it, the interpreter's finalization used to hand it over and
Python stopped the thread inside a ``noexcept`` destructor: "terminate called without an
active exception", SIGABRT. The script below makes that happen every time without the exit
hook (rank 0 drops its work, then keeps the GIL until it exits while rank 1 completes the
collective), on the runtime's one-thread group and on the default group alike.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from usbyte_opt.launcher import free_port

SCRIPT = """
import sys, time, torch, torch.distributed as dist
import usbyte_opt.runtime  # noqa: F401  (as every use of the runtime or usbyte_opt.ddp.wrap)
from usbyte_opt.collectives.issuers import serial_group
dist.init_process_group("gloo")
pg = serial_group(None) if sys.argv[1] == "serial" else dist.distributed_c10d._get_default_group()
t = torch.ones(4)
if dist.get_rank() == 0:
    sys.setswitchinterval(30)    # the main thread keeps the GIL while it runs Python
    pg.allreduce([t])            # the Work dropped at once: gloo's worker frees it
    end = time.monotonic() + 1.0     # rank 1 joins meanwhile; the worker waits for the GIL
    while time.monotonic() < end:
        pass
else:
    time.sleep(0.3)
    pg.allreduce([t]).wait()
    time.sleep(1.5)
"""


@pytest.mark.parametrize("group", ["serial", "default"])
def test_a_gloo_work_freed_at_exit_does_not_abort_the_rank(tmp_path, group):
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script), group], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-2000:]}"
        assert "terminate called" not in out
