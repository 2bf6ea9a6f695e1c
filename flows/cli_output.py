"""How the CLI prints rows: a Rich table at the terminal's width, or CSV / JSON / Markdown for other programs."""

from __future__ import annotations

import shutil
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from quantgate.flows.verdicts import cell

console = Console(soft_wrap=True)
FORMATS = ("table", "csv", "json", "markdown")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise typer.BadParameter(f"unknown format {fmt!r}: use {', '.join(FORMATS)}", param_hint="--format")


def print_frame(rows: list[dict], fmt: str) -> None:
    import pandas as pd

    write_frame(pd.DataFrame(rows), fmt)


def write_frame(df: Any, fmt: str) -> None:
    if fmt == "csv":
        sys.stdout.write(df.to_csv(index=False))
    elif fmt == "json":
        sys.stdout.write(df.to_json(orient="records", date_format="iso", indent=1) + "\n")
    else:
        sys.stdout.write(df.to_markdown(index=False) + "\n")


def terminal_width() -> int:
    return max(shutil.get_terminal_size((200, 50)).columns, 120)


def print_rows(rows: list[dict], columns: list[str], width: int | None = None) -> None:
    table = Table(show_lines=False)
    # `width` caps the table at the terminal's width or at `width`, whichever is narrower.
    console.width = min(shutil.get_terminal_size((width, 50)).columns, width) if width else terminal_width()
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[cell(r.get(c)) for c in columns])
    console.print(table)
    console.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}")
