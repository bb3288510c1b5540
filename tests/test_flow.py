"""The README's three steps, as a user runs them: profile -> optimize -> launch, on two CPU ranks.

The commands are read from the README itself, so the test fails when the README stops
matching what works. Options that only make the run short (fewer timing repeats, a short
all-reduce sweep, a small batch, three training steps) are appended; nothing else changes.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from usbyte_opt.formats import load_profile, load_schedule

ROOT = Path(__file__).resolve().parent.parent

#: Appended to each README command: speed only.
FAST = {
    "profile": ["--batch-size", "2", "--warmup", "1", "--repeats", "2", "--comm-points", "3",
                "--comm-repeats", "1", "--comm-max-mb", "1", "--no-cpu-probe", "--stable-s", "0"],
    "optimize": [],
    "launch": ["--steps", "3", "--warmup", "1", "--batch-size", "2"],
}


def readme_steps() -> list[list[str]]:
    """The ``usbyte-opt`` commands of the README's "The three steps" code block."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The three steps", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(ln) for ln in block.splitlines() if ln.startswith("usbyte-opt ")]


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_readme_three_steps_work_as_written(tmp_path: Path):
    steps = readme_steps()
    assert [s[1] for s in steps] == ["profile", "optimize", "launch"], steps
    profile_cmd, optimize_cmd, launch_cmd = steps
    assert {"--nproc-per-node", "2"} <= set(profile_cmd) and "cpu" in profile_cmd
    assert "examples/train.py" in launch_cmd
    shutil.copytree(ROOT / "examples", tmp_path / "examples")

    # 1. profile
    res = run(profile_cmd + FAST["profile"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    prof_path = tmp_path / profile_cmd[profile_cmd.index("-o") + 1]
    prof = load_profile(prof_path)
    assert prof.meta["world_size"] == 2 and prof.comm.backend == "gloo"
    assert str(prof_path.relative_to(tmp_path)) in res.stdout
    assert "Traceback" not in res.stderr and "DeprecationWarning" not in res.stderr, res.stderr
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout  # its table fits

    # 2. optimize (its table and choices are the planner's business; the file is the artifact)
    res = run(optimize_cmd, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    sched_path = tmp_path / optimize_cmd[optimize_cmd.index("-o") + 1]
    sched = load_schedule(sched_path)
    assert sched.fingerprint == prof.fingerprint()

    # 3. launch the example with that schedule: the model it trains is the one profiled
    res = run(launch_cmd + FAST["launch"], tmp_path)
    assert res.returncode == 0, f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}"
    model = launch_cmd[launch_cmd.index("--model") + 1]
    assert f"usbyte {model}: median" in res.stdout and "world size 2" in res.stdout
    # Three steps do not settle the verification: the launcher's last words say so, and how
    # many iterations a verdict needs, wrapped within 100 columns.
    said = [line for line in res.stdout.splitlines() if line.startswith("usbyte-opt: ")][-1]
    tail = res.stdout[res.stdout.rindex(said):]
    assert said.startswith("usbyte-opt: no verdict: the run ended after 3 iterations"), res.stdout
    assert "a verdict needs at least" in " ".join(tail.split()), tail
    assert max(len(line) for line in tail.splitlines()) <= 100, tail
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr, res.stderr


@pytest.mark.parametrize("name", ["cnn", "transformer", "mlp", "resnet50"])
def test_the_example_and_the_profiler_build_the_same_model(name: str, tmp_path: Path, monkeypatch):
    """``examples/train.py --model X`` accepts the schedule planned for ``usbyte-opt profile X``:
    the runtime's start-up check compares every tensor's name, dtype and shape. (The script
    runs in-process, as ``python examples/train.py`` would run it: ``--write-schedule`` exits
    before any process group; the README test above runs it for real.)"""
    from usbyte_opt.formats import fingerprint
    from usbyte_opt.models import build

    model, _, _ = build(name, 1)
    mine = fingerprint((n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                       for n, p in model.named_parameters() if p.requires_grad)
    sched = tmp_path / "default.json"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "--model", name, "--batch-size", "1",
                                      "--write-schedule", str(sched)])
    runpy.run_path(str(ROOT / "examples" / "train.py"), run_name="__main__")
    assert load_schedule(sched).fingerprint == mine
