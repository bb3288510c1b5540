"""The one output helper of the CLI: rich on a terminal, plain text when piped.

Domain code never prints; commands render through these functions. Errors go to stderr on
one line; ``--json`` output goes to stdout alone (:func:`emit_json`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Piped output keeps whole tables (rich would fold them to 80 columns).
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True,
              width=None if sys.stderr.isatty() else 160)


def error(message: str) -> None:
    """One line on stderr: ``error: <message>``."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False)


def info(message: str) -> None:
    err.print(message, markup=False)


def emit_json(data: Any) -> None:
    """Write ``data`` as JSON to stdout and nothing else."""
    sys.stdout.write(json.dumps(data, indent=1, sort_keys=False) + "\n")
    sys.stdout.flush()


#: Width that titles, captions, paragraphs and the default columns of every table keep within.
TABLE_WIDTH = 100


def paragraph(text: str) -> None:
    """Print ``text`` on stdout, wrapped to :data:`TABLE_WIDTH` (or a narrower terminal)."""
    out.print(text, markup=False, width=min(out.width, TABLE_WIDTH), soft_wrap=False)


def table(title: str, columns: list[str], rows: list[list[Any]], justify_right_from: int = 1,
          caption: str | None = None) -> None:
    """Print a table on stdout, its title above and its caption below, both wrapped to
    :data:`TABLE_WIDTH` (or the terminal's width when narrower). Commands keep their default
    columns within that width too; a terminal narrower than a table folds its cells."""
    width = min(out.width, TABLE_WIDTH)
    t = Table()
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= justify_right_from else "left")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    out.print(title, style="italic", markup=False, width=width, soft_wrap=False)
    out.print(t, soft_wrap=False)
    if caption:
        out.print(caption, style="dim italic", markup=False, width=width, soft_wrap=False)
