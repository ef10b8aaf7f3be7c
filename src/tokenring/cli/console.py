"""Terminal output for the CLI commands: rich tables and progress (the ``cli`` extra)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["make_table", "print_table", "progress", "rich_modules"]


def rich_modules() -> Any:
    """The ``rich`` package with its console, progress and table modules loaded; ImportError
    naming the extra."""
    try:
        import rich.console
        import rich.progress
        import rich.table
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the tokenring command line needs rich: pip install 'tokenring-attention[cli]'"
        ) from exc
    return rich


def make_table(title: str, columns: Sequence[str], *, right: Collection[str] = ()) -> Any:
    """A rich Table with these column headers (put units in the names), those in ``right``
    right-justified."""
    table = rich_modules().table.Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column in right else "left")
    return table


def print_table(table: Any) -> None:
    """Print at the terminal's width; into a pipe or file (no terminal to fit) at the table's
    own width, so no cell is folded in a log."""
    rich = rich_modules()
    console = rich.console.Console()
    if not console.is_terminal:
        natural = rich.console.Console(width=10_000).measure(table).maximum
        console = rich.console.Console(width=max(console.width, natural))
    console.print(table)


def progress(total: int, description: str) -> Any:
    """A rich Progress bar context manager; ``bar.advance(task)`` per unit of work. On stderr:
    stdout is the results' (``--json``: one row a line; off a terminal rich ends a bar with
    an empty line)."""
    rich = rich_modules()
    bar = rich.progress.Progress(
        rich.progress.TextColumn("{task.description}"),
        rich.progress.BarColumn(),
        rich.progress.TextColumn("{task.completed}/{task.total}"),
        rich.progress.TimeElapsedColumn(),
        transient=True,
        console=rich.console.Console(stderr=True),
    )
    bar.add_task(description, total=total)
    return bar
