"""Tables that read everywhere: rich tables on a terminal, plain greppable lines elsewhere.

On a terminal a table fits the terminal's width (80 columns included): short columns never wrap
or get cut, long text folds, and a column a row does not need is left out of the table. When
stdout is not a terminal (a log file, a Slurm job log, ``| grep``), every row is one line, one
fact a line: ``TITLE: key=value key=value ...`` with keys from the column names (spaces become
``_``) and values quoted only when they contain a space (``RECORD`` names what a row is, e.g.
``node``). Styles (``Cell.style``) colour a
terminal only.

Thin by design: the commands build the rows, this module only lays them out.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Sequence, Union

__all__ = ["Cell", "console", "key_of", "plain_line", "print_record", "print_table"]


@dataclass(frozen=True)
class Cell:
    """A value with a terminal style (rich markup style name, e.g. ``"bold green"``)."""

    text: str
    style: str = ""


CellLike = Union[str, int, Cell]


def console(raise_broken_pipe: bool = False) -> Any:
    """The console the commands print to (stdout; plain text when it is not a terminal). rich
    ends the process (SystemExit) when stdout is a closed pipe; with ``raise_broken_pipe`` the
    write raises ``BrokenPipeError`` instead, for a caller that must clean up (``up``)."""
    from rich.console import Console

    if not raise_broken_pipe:
        return Console(highlight=False)

    class PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError("stdout closed")

    return PipeAwareConsole(highlight=False)


def key_of(column: str) -> str:
    return column.strip().replace(" ", "_").replace("(", "").replace(")", "").lower()


def _text(cell: CellLike) -> str:
    return cell.text if isinstance(cell, Cell) else str(cell)


def plain_line(title: str, columns: Sequence[str], row: Sequence[CellLike]) -> str:
    """``title: key=value ...`` for one row; empty values are left out."""
    facts = []
    for col, cell in zip(columns, row):
        value = _text(cell)
        if value == "":
            continue
        facts.append(f"{key_of(col)}={shlex.quote(value) if any(c.isspace() for c in value) else value}")
    return f"{title}: " + " ".join(facts)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[CellLike]], *,
                out: Any | None = None, wide: Sequence[str] = (), record: str | None = None) -> None:
    """Print ``rows`` under ``title``. ``wide`` names the columns that may fold on a terminal
    (free text, addresses with paths); every other column keeps its values whole. Off a
    terminal each row is a line ``RECORD: key=value ...`` (``record`` defaults to the title),
    after the title on a line of its own when it says more than one word."""
    out = out if out is not None else console()
    if not out.is_terminal:
        name = record or title
        if name != title and " " in title:  # a title that says something ("quorum 7"), not "nodes"
            out.print(title, markup=False, soft_wrap=True)
        for row in rows:
            out.print(plain_line(name, columns, row), markup=False, highlight=False, soft_wrap=True)
        if not rows:
            out.print(f"{name}: none", markup=False, soft_wrap=True)
        return
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in columns:
        if col in wide:
            table.add_column(col, overflow="fold", ratio=1)
        else:
            width = max([len(col)] + [len(_text(r[columns.index(col)])) for r in rows])
            table.add_column(col, no_wrap=True, min_width=min(width, 24))
    for row in rows:
        table.add_row(*(Text(_text(c), style=c.style if isinstance(c, Cell) else "") for c in row))
    out.print(table)


def print_record(title: str, fields: dict[str, str], *, out: Any | None = None) -> None:
    """One record: a field/value table on a terminal, one ``title: key=value ...`` line elsewhere."""
    out = out if out is not None else console()
    if not out.is_terminal:
        out.print(plain_line(title, list(fields), list(fields.values())), markup=False, soft_wrap=True)
        return
    print_table(title, ("field", "value"), [(k, v) for k, v in fields.items()], out=out, wide=("value",))
