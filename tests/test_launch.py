"""``usbyte-opt launch``: validates the schedule, then runs torchrun with USBYTE_SCHEDULE set.

The runs are real ``usbyte-opt`` subprocesses; the refusals before any rank starts (and
``--help``) are driven in-process (``tests/test_errors.py`` sees launch errors as a user does)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from helpers import run_cli

from usbyte_opt.formats import save_schedule
from usbyte_opt.runtime import default_schedule

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from usbyte_opt.runtime import DistributedOptimizer
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(2):   # within verification's first window: on the plan throughout
        g = torch.Generator().manual_seed(dist.get_rank() * 10 + step)
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step(); opt.zero_grad()
    opt.synchronize()
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "source": opt.schedule_source,
           "args": sys.argv[1:], "w": model[0].weight.sum().item()}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *args], capture_output=True,
                          text=True, timeout=timeout, env={**__import__("os").environ,
                                                           "OMP_NUM_THREADS": "1"})


def test_launch_runs_torchrun_with_the_schedule(tmp_path: Path):
    sched = tmp_path / "s.json"
    save_schedule(default_schedule(model(), 2), sched)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    res = cli("launch", "--schedule", str(sched), "--nproc-per-node", "2", "--master-port",
              str(__import__("usbyte_opt.launcher", fromlist=["free_port"]).free_port()),
              str(script), str(out), "--schedule", "for-the-script", timeout=180)
    assert res.returncode == 0, (f"written: {sorted(p.name for p in out.iterdir())}\n"
                                 f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["source"] == str(sched.resolve()) for r in ranks)
    assert ranks[0]["args"] == [str(out), "--schedule", "for-the-script"]  # after SCRIPT: its own
    assert ranks[0]["w"] == ranks[1]["w"]
    assert "(default: usbyte-opt runtime, overlap mode, 1 block, world size 2)" in " ".join(
        res.stdout.split())


def test_launch_rejects_a_bad_schedule(tmp_path: Path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "usbyte-schedule", "version": 1}))
    code, _, err = run_cli(capsys, "launch", "--schedule", str(bad), "train.py")
    assert code == 2
    assert f"{bad}: strategy: expected a value (field is missing)" in err
    assert "Traceback" not in err


def test_launch_missing_file_and_missing_option(tmp_path: Path, capsys):
    code, _, err = run_cli(capsys, "launch", "--schedule", str(tmp_path / "nope.json"), "train.py")
    assert code == 2 and "nope.json: expected an existing file" in err
    code, _, err = run_cli(capsys, "launch", "--nproc-per-node", "2", "train.py")
    assert code == 2
    assert "the following arguments are required: --schedule" in err


def test_launch_failure_of_the_script_is_one_line(tmp_path: Path):
    sched = tmp_path / "s.json"
    save_schedule(default_schedule(model(), 1), sched)
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    res = cli("launch", "--schedule", str(sched), "--nproc-per-node", "1", str(script))
    assert res.returncode == 3, res.stderr[-2000:]
    assert "fail.py: rank 0 exited with code 3" in res.stderr


def test_launch_help_lists_torchrun_options(capsys):
    code, out, _ = run_cli(capsys, "launch", "--help")
    assert code == 0
    assert "--schedule SCHEDULE" in out and "--nproc-per-node" in out


def test_schedule_env_name_is_the_runtimes():
    from usbyte_opt.cli.launch import SCHEDULE_ENV as launch_env
    from usbyte_opt.runtime.checks import SCHEDULE_ENV

    assert launch_env == SCHEDULE_ENV


AUTO_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from usbyte_opt.runtime import DistributedOptimizer
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    for step in range(120):
        g = torch.Generator().manual_seed(dist.get_rank() * 100 + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step(); opt.zero_grad()
    opt.synchronize()
    rep = opt.report()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"chosen": rep["chosen"], "auto": rep["auto"], "phase": rep["phase"]}, f)
    dist.destroy_process_group()
""")


def test_launch_schedule_auto_plans_in_the_run(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(AUTO_SCRIPT)
    out, auto = tmp_path / "out", tmp_path / "auto"
    out.mkdir()
    res = cli("launch", "--schedule", "auto", "--auto-dir", str(auto), "--nproc-per-node", "2",
              str(script), str(out), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["auto"] and r["phase"] == "settled" for r in ranks)
    assert ranks[0]["chosen"] == ranks[1]["chosen"] in ("plan", "fallback")
    assert (auto / "profile.json").is_file() and (auto / "schedule.json").is_file()
    assert "auto (planned in the run)" in res.stdout
    # the run's summary, once: rank 0 hands it to the launcher, which ends with it
    last = [line for line in res.stdout.splitlines() if line.startswith("usbyte-opt: ")][-1]
    assert last.startswith(("usbyte-opt: kept the plan best", "usbyte-opt: running DDP's buckets")), last
    assert "usbyte-opt: kept" not in res.stderr and "usbyte-opt: running" not in res.stderr
