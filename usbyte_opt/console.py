"""The one output helper of the CLI: rich on a terminal, plain text when piped.

Domain code never prints; commands render through these functions. Errors and warnings go to
stderr on one line each; ``--json`` output goes to stdout alone (:func:`emit_json`); tables,
titles, captions and paragraphs keep within :data:`TABLE_WIDTH` (80) columns, piped or not
(:func:`table` splits a table whose columns cannot fit).
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

from .errors import plural  # noqa: F401  (the CLI's one home of counted words)

#: Width that titles, captions, paragraphs and every table keep within (the terminal's when
#: narrower): 80 columns, piped or not.
TABLE_WIDTH = 80


def _width(stream: Any) -> int | None:
    """The width output is laid out for: ``COLUMNS`` when set (on a terminal or piped), else
    the terminal's, else :data:`TABLE_WIDTH` (80) when piped."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if stream.isatty() else TABLE_WIDTH


out = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


def error(message: str) -> None:
    """One line on stderr: ``error: <message>``."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)


def warn(message: str) -> None:
    """One line on stderr: ``warning: <message>`` (:func:`warning_text`)."""
    err.print(f"[yellow]warning:[/] {escape(warning_text(message))}", markup=True, highlight=False)


def warn_wrapped(message: str) -> None:
    """:func:`warn`, wrapped within 100 columns: a long note of a run's report (``bench``'s
    and ``demo``'s), not an error line; a note that fits stays one line."""
    import textwrap

    width = 100
    lines = textwrap.wrap("warning: " + warning_text(message), width=width,
                          subsequent_indent="  ", break_on_hyphens=False)
    err.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def warning_text(message: str) -> str:
    """``message`` without a ``Warning:`` of its own at its front (a note also written to a
    report, a Python warning's text), so that :func:`warn` prints one prefix, not two.

    Example::

        >>> warning_text("Warning: the machine's speed changed"), warning_text("no plot")
        ("the machine's speed changed", 'no plot')
    """
    head, sep, rest = message.partition(":")
    return rest.lstrip() if sep and head.strip().lower() == "warning" else message


def info(message: str) -> None:
    """One line on stderr as it is, with no prefix: progress, where the files went."""
    err.print(message, markup=False)


def emit_json(data: Any) -> None:
    """Write ``data`` as JSON to stdout and nothing else."""
    sys.stdout.write(json.dumps(data, indent=1, sort_keys=False) + "\n")
    sys.stdout.flush()


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


def _groups(columns: list[str], cells: list[list[str]], width: int, key: int) -> list[list[int]]:
    """The columns of a table, in order, split into as few groups as fit ``width`` each, every
    group after the first led by the ``key`` first columns again (a row's name), so that no
    group is wider than ``width`` unless one column alone is. One group when all fit.

    Example::

        >>> _groups(["name", "a" * 30, "b" * 30, "c" * 30], [], 80, 1)
        [[0, 1, 2], [0, 3]]
        >>> _groups(["name", "a"], [], 80, 1)
        [[0, 1]]
    """
    def lo(i: int) -> int:
        return max((cell_len(w) for t in [columns[i], *(r[i] for r in cells)] for w in t.split()),
                   default=1)

    def need(group: list[int]) -> int:
        return sum(lo(i) for i in group) + 3 * len(group) - 1   # borders, without the outer two

    lead = list(range(min(key, len(columns))))
    groups: list[list[int]] = []
    group = list(lead)
    for i in range(len(lead), len(columns)):
        if len(group) > len(lead) and need([*group, i]) > width:
            groups.append(group)
            group = list(lead)
        group.append(i)
    groups.append(group)
    return groups


def table(title: str, columns: list[str], rows: list[list[Any]], justify_right_from: int = 1,
          caption: str | None = None, key_columns: int = 1) -> None:
    """Print a table on stdout, its title above and its caption below, both wrapped to
    :data:`TABLE_WIDTH` (or the terminal's width, ``COLUMNS``, when narrower). Cells and
    headers wrap at spaces, never inside a word (:func:`column_widths`); a table whose words
    alone are wider than that is split in two (or more) tables one above the other, each led
    by the first ``key_columns`` columns (:func:`_groups`), so that nothing is cut and no line
    is wider than that unless one column's words alone are."""
    width = min(out.width, TABLE_WIDTH)
    cells = [[str(x) for x in r] for r in rows]
    out.print(title, style="italic", markup=False, width=width, soft_wrap=False)
    for group in _groups(columns, cells, width, key_columns):
        _print_table([columns[i] for i in group], [[r[i] for i in group] for r in cells],
                     [i >= justify_right_from for i in group], width)
    if caption:
        out.print(caption, style="dim italic", markup=False, width=width, soft_wrap=False)


def _print_table(columns: list[str], cells: list[list[str]], right: list[bool], width: int) -> None:
    """One table of :func:`table` (its title and caption apart), within ``width`` when its
    words fit."""
    # Each column takes its text, a space each side and a border; without the outer borders
    # when that is what makes the words fit.
    edge = 3 * len(columns) + 1
    widths = column_widths(columns, cells, width - edge)
    if sum(widths) > width - edge:
        edge -= 2
        widths = column_widths(columns, cells, width - edge)
    t = Table(show_edge=edge == 3 * len(columns) + 1)
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if right[i] else "left", width=widths[i], overflow="fold")
    for r in cells:
        t.add_row(*r)
    need, before = sum(widths) + edge, out.width
    if need > before:
        out.width = need  # words alone wider than the screen: whole, not cut (print caps at width)
    try:
        out.print(t, soft_wrap=False)
    finally:
        out.width = before
