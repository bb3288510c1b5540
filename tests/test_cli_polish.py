"""The CLI's small promises: 80 columns when piped, a progress line when piped, one prefix per
warning, counts in the singular where they are 1, no ``<bool>`` on plain flags, the plot's
extra named in one line, the model factory's contract checked in one line, and a launch at
another world size than planned said with its predicted iteration time."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from helpers import run_cli
from rich.console import Console

from usbyte_opt import console
from usbyte_opt.cli import bench as bench_cli
from usbyte_opt.cli import profile as profile_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def screen(monkeypatch):
    """stdout and stderr of the console as a pipe sees them (80 columns, no terminal)."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=out, width=console.TABLE_WIDTH, highlight=False,
                                                soft_wrap=True))
    monkeypatch.setattr(console, "err", Console(file=err, width=console.TABLE_WIDTH, highlight=False,
                                                soft_wrap=True))
    return out, err


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


# -- 80 columns ---------------------------------------------------------------------------


def test_piped_width_is_80(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console.TABLE_WIDTH == 80
    assert console._width(io.StringIO()) == 80


def test_a_table_too_wide_for_80_columns_splits_in_two_led_by_its_key(screen):
    out, _ = screen
    columns = ["strategy", *(f"column{i} ms" for i in range(12))]
    rows = [["bytescheduler", *(f"{1234.5 + i:.1f}" for i in range(12))],
            ["best *", *(f"{99.5 + i:.1f}" for i in range(12))]]
    console.table("a title", columns, rows, caption="a caption")
    text = out.getvalue()
    assert widest(text) <= 80, text
    assert text.count("bytescheduler") >= 2 and text.count("best *") >= 2   # each part keyed
    for c in columns[1:]:
        assert c.split()[0] in text, c                       # nothing left out
    assert "1245.5" in text and "110.5" in text
    assert text.index("a title") < text.index("strategy") and text.rstrip().endswith("a caption")


def test_optimize_wide_fits_80_columns_piped(screen, capsys, tmp_path):
    out, _ = screen
    code, _, err = run_cli(capsys, "optimize", str(ROOT / "profiles" / "resnet50.json"),
                           "-o", str(tmp_path / "s.json"), "--wide")
    assert code == 0, err
    text = out.getvalue()
    assert widest(text) <= 80, text
    for word in ("exposed", "solve", "overlap", "fence", "wfbp"):
        assert word in text, word


def test_simulate_fits_80_columns_piped(screen, capsys):
    out, _ = screen
    code, _, err = run_cli(capsys, "simulate", str(ROOT / "profiles" / "resnet50.json"),
                           str(ROOT / "schedules" / "resnet50.json"), "--wide")
    assert code == 0, err
    assert widest(out.getvalue()) <= 80, out.getvalue()


# -- progress when piped ------------------------------------------------------------------


def test_profile_progress_is_a_plain_line_every_few_seconds_when_piped(screen, monkeypatch):
    _, err = screen
    bar, progress = profile_cli._progress_bar(0)
    assert isinstance(bar, profile_cli.PlainProgress)         # not a terminal: plain lines
    assert profile_cli.PLAIN_PROGRESS_S <= 5.0
    monkeypatch.setattr(bar, "every_s", 0.05)
    import time
    with bar:
        progress("compute", 5, 14)
        time.sleep(0.3)           # a long step: the thread repeats the phase
    lines = err.getvalue().splitlines()
    assert len(lines) >= 2, lines
    assert all(ln.startswith("profile: compute 5/14 (") and ln.endswith(" s)") for ln in lines), lines
    bar2, _ = profile_cli._progress_bar(1)                     # other ranks say nothing
    assert not isinstance(bar2, profile_cli.PlainProgress)


def test_plain_progress_is_silent_between_lines():
    lines: list[str] = []
    now = [0.0]
    p = profile_cli.PlainProgress(lines.append, 5.0, clock=lambda: now[0])
    for t, done in ((1.0, 1), (2.0, 2), (4.9, 3)):
        now[0] = t
        p("compute", done, 14)
    assert lines == []
    now[0] = 5.5
    p("collectives", 3, 120)
    assert lines == ["profile: collectives 3/120 (6 s)"]


# -- wording ------------------------------------------------------------------------------


def test_one_warning_prefix(screen):
    _, err = screen
    console.warn("Warning: training without communication ran at x1.30 of the profiled compute")
    console.warn("warning: already prefixed")
    console.warn("something else: with a colon")
    text = err.getvalue()
    assert "warning: Warning:" not in text and "warning: warning:" not in text, text
    assert text.splitlines() == [
        "warning: training without communication ran at x1.30 of the profiled compute",
        "warning: already prefixed", "warning: something else: with a colon"]


def test_bench_notes_name_the_plot_extra_once(screen):
    """Without matplotlib the run's note says how to get it, in one line, and the extra it
    names is pyproject's and brings matplotlib."""
    _, err = screen
    extras = (ROOT / "pyproject.toml").read_text()
    note = "No plot: matplotlib is not installed (`pip install 'usbyte-opt[plot]'`)."
    bench_cli.notes({"notes": [note, "Warning: the machine's speed changed"]})
    lines = err.getvalue().splitlines()
    assert lines[0] == f"warning: {note}" and lines[1] == "warning: the machine's speed changed"
    assert re.search(r'^plot = \["matplotlib', extras, re.M), "the extra is pyproject's plot"


def test_plural_everywhere():
    from usbyte_opt.console import plural
    assert [plural(1, "block"), plural(2, "block"), plural(1, "rank"), plural(1, "bucket")] == [
        "1 block", "2 blocks", "1 rank", "1 bucket"]


@pytest.mark.parametrize("command", ["profile", "optimize", "simulate", "bench", "demo", "schema"])
def test_no_bool_metavar_on_flags(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(capsys, command, "--help")
    assert code == 0, err
    assert "<bool>" not in out and "BOOLEAN" not in out, out
    assert "--help" in out


def test_bench_help_is_short(monkeypatch, capsys):
    """Rare options are grouped and their detail is in docs/bench.md, where every option of
    ``bench`` is named."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0
    assert len(out.splitlines()) <= 100, len(out.splitlines())
    assert "docs/bench.md" in out
    doc = (ROOT / "docs" / "bench.md").read_text()
    import typer.main

    cmd = typer.main.get_command(sys.modules["usbyte_opt.cli.main"].app)
    bench = cmd.commands["bench"]  # type: ignore[attr-defined]
    for p in bench.params:
        for opt in p.opts:
            if opt.startswith("--") and opt != "--help":
                assert opt in out, opt                       # every option listed in --help
                assert f"`{opt}" in doc, opt                 # and explained in the docs


# -- the model factory's contract ----------------------------------------------------------

FACTORIES = '''
import torch

def two_args(batch_size, width):
    return torch.nn.Linear(2, 2), (torch.zeros(batch_size, 2),), lambda o: o.sum()

def no_args():
    return None

def wrong_return(batch_size):
    return torch.nn.Linear(2, 2)
'''


@pytest.mark.parametrize("factory, expected, got", [
    ("two_args", "cannot be called as two_args(batch_size)", "missing a required argument: 'width'"),
    ("no_args", "cannot be called as no_args(batch_size)", "too many positional arguments"),
    ("wrong_return", "expected factory(batch_size: int) -> (model: torch.nn.Module", "got a Linear"),
])
@pytest.mark.parametrize("command", [["profile"], ["bench", "-s", "ddp", "--device", "cpu"]])
def test_a_factory_breaking_the_contract_is_one_line(factory, expected, got, command, tmp_path,
                                                     monkeypatch, capsys):
    (tmp_path / "polish_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, command[0], f"polish_factories:{factory}", *command[1:],
                           "-o", str(tmp_path / "out"))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"'polish_factories:{factory}'" in lines[0] and expected in lines[0] and got in lines[0]
    assert "Traceback" not in err


# -- a launch at another world size than planned ---------------------------------------------


def test_launch_at_another_world_size_says_the_predicted_iteration_time(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, _, err = run_cli(capsys, "launch", "--schedule", "schedules/resnet50.json",
                           "--nproc-per-node", "2", "no-such-script.py")
    assert code == 2    # the missing script: after the warning, before any rank starts
    warning = next(ln for ln in err.splitlines() if ln.startswith("warning:"))
    assert "planned for world size 8 (predicted 175.7 ms per iteration there), launching 2" in warning
    assert re.search(r"predicted \d+\.\d ms per iteration at 2 \(re-predicted on "
                     r"profiles/resnet50.json", warning), warning
    assert "usbyte-opt optimize profiles/resnet50.json --world-size 2" in warning


def test_world_size_line_re_predicts_from_the_profile_and_says_so_without_it(tmp_path, monkeypatch):
    from usbyte_opt.cli.launch import world_size_line
    from usbyte_opt.formats import load_profile, load_schedule
    from usbyte_opt.planning.planner import retargeted
    from usbyte_opt.planning.simulate import simulate

    monkeypatch.chdir(ROOT)
    sched = load_schedule("schedules/resnet50.json")
    want = simulate(retargeted(load_profile("profiles/resnet50.json"), 16), sched).iteration_ms
    line = world_size_line(sched, Path("schedules/resnet50.json"), 16, has_gpu=True)
    assert f"predicted {want:.1f} ms per iteration at 16" in line and "no GPU" not in line
    line = world_size_line(sched, Path("schedules/resnet50.json"), 2, has_gpu=False)
    assert "this machine has no GPU, so expect iterations far longer" in line  # a GPU profile
    # Without its profile at hand: the planned size's prediction, said not to be re-predicted.
    alone = tmp_path / "elsewhere" / "s.json"
    alone.parent.mkdir()
    alone.write_text((ROOT / "schedules" / "resnet50.json").read_text())
    monkeypatch.chdir(tmp_path)
    line = world_size_line(sched, alone, 2, has_gpu=True)
    assert "predicted 175.7 ms per iteration there" in line and "not re-predicted" in line
    assert f"usbyte-opt simulate PROFILE {alone} --world-size 2" in line


def test_a_rank_at_another_world_size_says_the_planned_prediction():
    """Without ``launch`` (a plain torchrun), rank 0's warning gives the schedule's own
    prediction and how to re-predict and re-plan for this size."""
    import warnings

    from usbyte_opt.formats import load_schedule
    from usbyte_opt.runtime.checks import check_world_size

    sched = load_schedule(ROOT / "schedules" / "resnet50.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_world_size(sched, 2, 0)
        check_world_size(sched, 2, 1)          # other ranks: silent
        check_world_size(sched, 8, 0)          # the planned size: silent
    assert len(caught) == 1
    text = str(caught[0].message)
    assert text.startswith("schedule was planned for world size 8, running with 2: predicted "
                           "175.7 ms per iteration at 8, not re-predicted for 2"), text
    assert "usbyte-opt optimize PROFILE --world-size 2" in text
