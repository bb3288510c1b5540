"""The one output helper of the CLI: rich on a terminal, plain text when piped.

Domain code never prints; commands render through these functions. Errors go to stderr on
one line; ``--json`` output goes to stdout alone (:func:`emit_json`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _width(stream: Any) -> int | None:
    """The width output is laid out for: ``COLUMNS`` when set (on a terminal or piped), else
    the terminal's, else 160 when piped (so that piped tables keep their natural width up to
    :data:`TABLE_WIDTH` instead of rich's 80)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if stream.isatty() else 160


out = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


def error(message: str) -> None:
    """One line on stderr: ``error: <message>``."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False)


def info(message: str) -> None:
    err.print(message, markup=False)


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1.

    Example::

        >>> plural(1, "block"), plural(3, "block"), plural(2, "all-reduce"), plural(0, "rank")
        ('1 block', '3 blocks', '2 all-reduces', '0 ranks')
    """
    return f"{n} {noun if n == 1 else (many or noun + 's')}"


def emit_json(data: Any) -> None:
    """Write ``data`` as JSON to stdout and nothing else."""
    sys.stdout.write(json.dumps(data, indent=1, sort_keys=False) + "\n")
    sys.stdout.flush()


#: Width that titles, captions, paragraphs and the default columns of every table keep within.
TABLE_WIDTH = 100


def paragraph(text: str) -> None:
    """Print ``text`` on stdout, wrapped to :data:`TABLE_WIDTH` (or a narrower terminal)."""
    out.print(text, markup=False, width=min(out.width, TABLE_WIDTH), soft_wrap=False)


def column_widths(columns: list[str], rows: list[list[str]], room: int) -> list[int]:
    """Widths for a table's columns whose text takes ``room`` columns at most (borders and
    padding not counted) that cut no word: each column at least as wide as its longest word
    (header or cell), at most its longest text, the room left going to the columns that lack
    least first. Where even the longest words do not fit, those widths.

    Example::

        >>> column_widths(["strategy", "predicted ms"], [["bytescheduler", "831.37"]], 73)
        [13, 12]
        >>> column_widths(["strategy", "predicted ms"], [["bytescheduler", "831.37"]], 21)
        [13, 9]
    """
    lo: list[int] = []
    hi: list[int] = []
    for i, head in enumerate(columns):
        texts = [head, *(r[i] for r in rows)]
        lo.append(max((cell_len(w) for t in texts for w in t.split()), default=1))
        hi.append(max((cell_len(t) for t in texts), default=1))
    if sum(hi) <= room:
        return hi
    if sum(lo) >= room:
        return lo
    # The room left goes to the columns that lack least first: as many as can be show their
    # texts on one line.
    widths, spare = list(lo), room - sum(lo)
    for i in sorted(range(len(widths)), key=lambda k: hi[k] - lo[k]):
        give = min(spare, hi[i] - lo[i])
        widths[i] += give
        spare -= give
    return widths


def table(title: str, columns: list[str], rows: list[list[Any]], justify_right_from: int = 1,
          caption: str | None = None) -> None:
    """Print a table on stdout, its title above and its caption below, both wrapped to
    :data:`TABLE_WIDTH` (or the terminal's width, ``COLUMNS``, when narrower). Cells and
    headers wrap at spaces, never inside a word (:func:`column_widths`); a table whose words
    alone are wider than that is printed whole, wider."""
    width = min(out.width, TABLE_WIDTH)
    cells = [[str(x) for x in r] for r in rows]
    # Each column takes its text, a space each side and a border; without the outer borders
    # when that is what makes the words fit.
    edge = 3 * len(columns) + 1
    widths = column_widths(columns, cells, width - edge)
    if sum(widths) > width - edge:
        edge -= 2
        widths = column_widths(columns, cells, width - edge)
    t = Table(show_edge=edge == 3 * len(columns) + 1)
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= justify_right_from else "left", width=widths[i],
                     overflow="fold")
    for r in cells:
        t.add_row(*r)
    out.print(title, style="italic", markup=False, width=width, soft_wrap=False)
    need, before = sum(widths) + edge, out.width
    if need > before:
        out.width = need  # words alone wider than the screen: whole, not cut (print caps at width)
    try:
        out.print(t, soft_wrap=False)
    finally:
        out.width = before
    if caption:
        out.print(caption, style="dim italic", markup=False, width=width, soft_wrap=False)
