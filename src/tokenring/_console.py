"""Terminal output for the CLI commands: rich tables and progress (the ``cli`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["make_table", "print_table", "progress"]


def _rich() -> Any:
    try:
        import rich
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the tokenring command line needs rich: pip install 'tokenring-attention[cli]'"
        ) from exc
    return rich


def make_table(title: str, columns: Sequence[str]) -> Any:
    """A rich Table with these column headers (put units in the names)."""
    _rich()
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def print_table(table: Any) -> None:
    _rich()
    from rich.console import Console

    Console(width=max(Console().width, 200)).print(table)


def progress(total: int, description: str) -> Any:
    """A rich Progress bar context manager; ``bar.advance(task)`` per unit of work."""
    _rich()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=True,
    )
    bar.add_task(description, total=total)
    return bar
