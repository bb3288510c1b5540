"""Terminal output fits: tables within 80 columns, piped or not (``--wide`` shows every column),
and ``--help`` never cuts a default or a word at 80 or 100 columns."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from helpers import run_cli
from rich.console import Console

from usbyte_opt import console
from usbyte_opt.bench.report import COLUMNS, EXPLAIN_COLUMNS, explain, summarize
from usbyte_opt.cli.bench import DEFAULT_COLUMNS, render


def raw_record() -> dict:
    """A bench record with every strategy and wide numbers (seconds-long iterations)."""
    names = ["ddp", "wfbp", "mgwfbp", "bytescheduler", "usbyte", "best", "no-comm"]
    predicted = {s: {"ms": 1234.567 + i, "refined_ms": 1240.5, "mode": "overlap", "blocks": 1234}
                 for i, s in enumerate(names)}
    return {
        "job": {"model": "usbyte_opt.models.lab:lab_transformer", "iterations": 20, "rounds": 2},
        "profile": "/a/long/path/to/the/profile.json", "profile_name": "lab-transformer",
        "world_size": 2, "backend": "gloo", "device": "cpu", "threads": 1, "torch": "2.13.0",
        "batch_size": 12, "forward_ms": 1000.0, "backward_ms": 2000.0,
        "comm": {"backend": "gloo", "alpha_ms": 1.234, "algbw_gbs": 0.0234, "cpu_ms_per_block": 0.5,
                 "cpu_ms_per_mb": 1.5},
        "gradient_bytes": 10_000_000,
        "planned": {"lower_bound_ms": 1200.0, "compute_ms": 3000.0, "update_ms": 20.0, "all": {},
                    "predicted": predicted},
        "schedules": {}, "traces": {},
        "runs": {s: {"durations_ms": [1300.25 + i, 1400.75, 1350.5], "final_loss": 1.0,
                     "max_param_diff": 0.0,   # windows: an interval in "vs DDP"; one below the bound
                     "windows_ms": [1300.25 + 3 * i, 1400.75, 1350.5 - i, 1100.0 + 40 * i]}
                 for i, s in enumerate(names)},
        "phases_s": {"profile": 1.0, "plan": 0.1, "train": 2.0},
        "reference": "ddp",
    }


@pytest.fixture
def screen(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=buf, width=200, highlight=False, soft_wrap=True))
    return buf


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_bench_table_fits_80_columns_and_wide_has_them_all(screen, tmp_path: Path):
    result = summarize(raw_record(), {"description": "lab at 200 Mbit/s (veth pair, MTU 9000, tbf)"},
                       tmp_path)
    render(result, "bench")
    text = screen.getvalue()
    assert widest(text) <= 80, text
    header = text[:text.index("┡")]          # the headers, wrapped at spaces to fit
    assert all(w in header for c in DEFAULT_COLUMNS for w in c.split()) and "refined" not in header
    assert "--wide for every column" in text
    screen.truncate(0)
    screen.seek(0)
    render(result, "bench", wide=True)
    text = screen.getvalue()
    for c in COLUMNS:
        assert c.split()[0] in text, c
    assert widest(text) <= 80, text      # every column: split in two tables, not wider


def test_demo_explanation_table_fits_80_columns(screen, tmp_path: Path):
    result = summarize(raw_record(), {"description": "this machine's loopback"}, tmp_path)
    rows, _ = explain(result)
    console.table("how far the prediction was off (measured − predicted, per iteration)",
                  EXPLAIN_COLUMNS, rows, caption="x" * 150)
    assert widest(screen.getvalue()) <= 80


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", ["", "profile", "launch", "bench", "demo", "schema"])
def test_help_cuts_nothing(command: str, columns: int, monkeypatch, capsys):
    """In-process (the help is laid out from ``COLUMNS`` at each call, as in a fresh
    ``usbyte-opt`` process; ``test_cli`` runs the real ``usbyte-opt --help``)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("TERM", "xterm")
    code, out, err = run_cli(capsys, *([command] if command else []), "--help")
    assert code == 0, err
    assert "…" not in out, out
    if command in ("bench", "profile"):
        assert "bytescheduler," in out or "NAME.json" in out  # defaults shown whole
