"""README, *In your own script*: the DDP loop shown there is ``examples/own_script.py`` (the
README block is the file, its docstring aside), and it runs as written on 2 gloo ranks under
torchrun: with its one line changed to ``usbyte_opt.DistributedDataParallel`` and a schedule
in ``$USBYTE_SCHEDULE`` (split blocks, overlap mode, verified against torch DDP as by
default), the model and optimizer it saves are those of the same loop on torch DDP, bitwise."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from usbyte_opt.env import SCHEDULE_ENV
from usbyte_opt.formats import save_schedule

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "own_script.py"


def _body(text: str) -> str:
    """The script without its module docstring."""
    tree = ast.parse(text)
    doc = tree.body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    return "\n".join(text.splitlines()[doc.end_lineno:]).strip()


def test_readme_block_is_the_script():
    readme = (ROOT / "README.md").read_text()
    sec = readme.split("### In your own script", 1)[1]
    block = re.search(r"```python\n(.*?)```", sec, re.S)
    assert block is not None
    assert block.group(1).strip() == _body(SCRIPT.read_text())


def _run(tmp: Path, name: str, *args: str, schedule: Path | None = None) -> dict:
    out = tmp / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if k != SCHEDULE_ENV}
    env.update(OWN_SCRIPT_OUT=str(out), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if schedule is not None:
        env[SCHEDULE_ENV] = str(schedule)
    for _ in range(2):   # one retry: torchrun on a loaded 2-core machine, rarely, fails to start
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", str(SCRIPT), *args], env=env,
                             cwd=tmp, capture_output=True, text=True, timeout=300)
        if res.returncode == 0:
            break
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_own_script_trains_like_ddp(tmp_path: Path):
    from usbyte_opt.planning.problem import Problem
    from usbyte_opt.runtime import profile_from_model
    from usbyte_opt.runtime.default_plan import split_blocks

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    pb = Problem.from_profile(profile_from_model(m, 2))
    lay = pb.layout()
    sched = tmp_path / "split.json"
    save_schedule(pb.schedule("split", lay, split_blocks(pb, lay, 2, pb.need_order())), sched)
    ddp = _run(tmp_path, "ddp", "--ddp")
    usb = _run(tmp_path, "usbyte", schedule=sched)
    plain = _run(tmp_path, "wrapper-without-schedule")     # torch DDP itself
    for got in (usb, plain):
        for k, v in ddp["model"].items():
            assert torch.equal(v, got["model"][k]), k
        assert got["optimizer"]["state"][0]["step"] == ddp["optimizer"]["state"][0]["step"]
        for i, st in ddp["optimizer"]["state"].items():
            assert torch.equal(st["exp_avg"], got["optimizer"]["state"][i]["exp_avg"]), i
