"""Clean errors, as a user sees them: each case is a real ``usbyte-opt`` subprocess that must
exit with a non-zero code, print exactly one line on stderr and write nothing.

Output paths are checked before any work starts; a usage error, an OSError on an output,
Ctrl-C in ``launch``, a rank failing with a usbyte-opt error and a schedule that does not fit
the model each read as one line (``launch`` prints its one banner line on stdout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from usbyte_opt.env import DEBUG_ENV
from usbyte_opt.formats import save_schedule
from usbyte_opt.runtime import default_schedule

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "vgg16.json"


def cli(*args: str, cwd: Path, timeout: float = 180, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(DEBUG_ENV, None)
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *args], cwd=cwd, env=env,
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout)


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """Assert the exit code and exactly one ``error:`` line on stderr containing ``words``."""
    lines = res.stderr.splitlines()
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "a_file").write_text("x")
    return tmp_path


# --------------------------------------------------------------------------------------------
# Output paths, checked before any work
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["profile", "mlp", "--nproc-per-node", "2", "--device", "cpu", "-o", "/proc/x.json"],
     ["--output /proc/x.json", "/proc does not accept new files"]),
    (["profile", "mlp", "-o", "a_file/p.json"], ["--output a_file/p.json", "is a file, not a folder"]),
    (["profile", "mlp", "-o", "."], ["--output .", "it is a folder"]),
    (["optimize", str(PROFILE), "-o", "/proc/x.json"], ["--output /proc/x.json"]),
    (["optimize", str(PROFILE), "-o", "a_file/deeper/s.json"], ["a_file is a file, not a folder"]),
    (["optimize", str(PROFILE), "-o", "out.json", "--trace", "/proc/t.json"], ["--trace /proc/t.json"]),
    (["simulate", str(PROFILE), str(PROFILE), "--trace", "a_file/t.json"], ["--trace a_file/t.json"]),
    (["bench", "lab-cnn", "-o", "/proc/results"], ["--output-dir /proc/results",
                                                   "/proc does not accept new folders"]),
    (["bench", "lab-cnn", "-o", "a_file/results"], ["--output-dir a_file/results"]),
    (["demo", "-o", "a_file/x"], ["--output-dir a_file/x", "is a file, not a folder"]),
])
def test_bad_output_paths_fail_before_any_work(work: Path, argv, words):
    before = listing(work)
    t0 = time.monotonic()
    res = cli(*argv, cwd=work)
    one_line(res, 2, *words)
    assert listing(work) == before
    assert time.monotonic() - t0 < 60  # no profiling, planning or training happened first


def test_usage_errors_are_one_line(work: Path):
    one_line(cli("optimize", str(PROFILE), "--bogus", cwd=work), 2, "No such option: --bogus",
             "usbyte-opt optimize --help")
    one_line(cli("profile", "mlp", "--warmup", "x", cwd=work), 2, "--warmup")
    one_line(cli("optimize", str(PROFILE), "-o", ".", cwd=work), 2, "'--output'", "directory")
    one_line(cli("nope", cwd=work), 2, "No such command 'nope'")
    assert listing(work) == ["a_file"]


def test_an_oserror_on_an_output_is_one_line(work: Path):
    """stdout on a full device: the write fails after the command did its work."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        res = cli("schema", "profile", cwd=work, stdout=full)
    lines = res.stderr.splitlines()
    assert res.returncode == 1, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "No space left" in lines[0], res.stderr


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------


def schedule_for(model: torch.nn.Module, path: Path, world: int = 2) -> Path:
    save_schedule(default_schedule(model, world), path)
    return path


def launch(work: Path, sched: Path, script: str, *args: str, nproc: int = 2,
           debug: bool = False, **kw) -> subprocess.CompletedProcess:
    (work / "script.py").write_text(textwrap.dedent(script))
    # No --master-port: on one node torchrun binds a free port itself, which no other process
    # on a shared machine can take between the choice and the use.
    argv = ["--debug"] if debug else []
    argv += ["launch", "--schedule", str(sched), "--nproc-per-node", str(nproc), "script.py", *args]
    return cli(*argv, cwd=work, **kw)


MISMATCH = """
    import torch, torch.distributed as dist
    from usbyte_opt.runtime import DistributedOptimizer
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""


def test_launch_schedule_of_another_model_is_one_line_naming_the_tensor(work: Path):
    sched = schedule_for(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), work / "s.json")
    res = launch(work, sched, MISMATCH)
    line = one_line(res, 3, "error: rank ", "tensor '1.weight'", "expected shape [2, 8] (schedule)",
                    "got [3, 8] (model)")
    assert line.count("rank ") == 1
    assert "Traceback" not in res.stdout


@pytest.mark.slow
def test_launch_with_debug_keeps_the_ranks_tracebacks(work: Path):
    """(The default run checks --debug on a command of one process: test_cli.)"""
    sched = schedule_for(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), work / "s.json")
    res = launch(work, sched, MISMATCH, debug=True)
    assert res.returncode != 0 and "Traceback" in res.stderr and "MismatchError" in res.stderr


def test_launch_a_rank_failing_with_a_usbyte_error_is_one_line_naming_it(work: Path):
    sched = schedule_for(torch.nn.Linear(2, 2), work / "s.json")
    res = launch(work, sched, """
        import os, time
        from usbyte_opt.errors import FormatError
        if os.environ["RANK"] == "1":
            raise FormatError("data.json", "rows[2]", "a number", "x")
        time.sleep(60)
    """)
    one_line(res, 2, "error: rank 1: data.json: rows[2]: expected a number, got 'x'")
    assert listing(work) == ["a_file", "s.json", "script.py"]


def test_launch_a_missing_script_is_one_line(work: Path):
    sched = schedule_for(torch.nn.Linear(2, 2), work / "s.json")
    res = cli("launch", "--schedule", str(sched), "--nproc-per-node", "2", "nope.py", cwd=work)
    one_line(res, 2, "nope.py: expected an existing script file")


def test_launch_ctrl_c_is_one_line_and_exit_code_130(work: Path):
    """SIGINT to the launch's process group, as a terminal's Ctrl-C sends it, while both ranks
    are inside collectives."""
    sched = schedule_for(torch.nn.Linear(2, 2), work / "s.json")
    (work / "script.py").write_text(textwrap.dedent("""
        import os, sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        open(f"started{dist.get_rank()}", "w").close()
        x = torch.zeros(1000)
        while True:
            dist.all_reduce(x)
            time.sleep(0.01 * dist.get_rank())
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(DEBUG_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "usbyte_opt", "launch", "--schedule", str(sched),
                             "--nproc-per-node", "2", "script.py"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((work / f"started{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert err.splitlines() == ["error: interrupted"], err[-3000:]
    assert "Traceback" not in out


def test_rank_wrapper_runs_a_script_as_python_would(tmp_path: Path):
    script = tmp_path / "s.py"
    script.write_text(f"import sys; print(__name__, sys.argv[1:], sys.path[0] == {str(tmp_path)!r})\n")
    res = subprocess.run([sys.executable, "-m", "usbyte_opt.cli.rank", str(script), "a", "--b"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.split() == ["__main__", "['a',", "'--b']", "True"], res
    # A usbyte-opt error outside `launch` (no folder to leave it in): one line on stderr.
    script.write_text("from usbyte_opt.errors import MismatchError\nraise MismatchError('m')\n")
    res = subprocess.run([sys.executable, "-m", "usbyte_opt.cli.rank", str(script)],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, RANK="3"))
    assert res.returncode == 3 and res.stderr == "error: rank 3: m\n"


@pytest.mark.parametrize("flag, value, field", [("--bandwidth-gbps", "1e308", "comm.algbw_gbs"),
                                                 ("--latency-us", "1e308", "comm.alpha_ms")])
def test_retargeting_beyond_physical_bounds_is_one_line(tmp_path, flag, value, field):
    res = cli("optimize", str(ROOT / "profiles" / "resnet50.json"), flag, value, "-o",
              str(tmp_path / "s.json"), cwd=tmp_path)
    one_line(res, 2, field)
    assert not (tmp_path / "s.json").exists()


def test_profile_a_rank_dying_mid_run_is_named_with_its_cause(work: Path):
    """Rank 1 exits during the timing; rank 0's collective fails because of it: one line,
    the launcher's, naming rank 1 and how it ended. No traceback, nothing written."""
    (work / "dying.py").write_text(textwrap.dedent("""
        import os
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.calls = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2), 0

            def forward(self, x):
                self.calls += 1
                if os.environ.get("RANK") == "1" and self.calls > 4:
                    os._exit(7)
                return self.b(self.a(x))

        def factory(batch_size):
            return Net(), (torch.randn(batch_size, 8),), lambda out: out.sum()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(work))
    env.pop(DEBUG_ENV, None)
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "profile", "dying:factory",
                          "--nproc-per-node", "2", "--device", "cpu", "-o", "p.json"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 7 and res.stderr == "error: rank 1: exited with code 7\n", res.stderr[-3000:]
    assert not (work / "p.json").exists()
