"""What every bench mode reports: per-row statistics over the ranks, JSON records and the
markdown page."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = [
    "call_ms",
    "cell",
    "cells",
    "check_cell",
    "exit_status",
    "failed_line",
    "group_by",
    "json_line",
    "link_text",
    "note",
    "rate_text",
    "write_markdown",
    "write_records",
]

T = TypeVar("T")


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


def call_ms(call_s: Sequence[list[float]]) -> dict[str, float]:
    """``ms_median``, ``ms_p10`` and ``ms_p90`` of one row: the max over ranks of each rank's
    statistic of its call seconds."""
    return {
        "ms_median": 1e3 * max(statistics.median(c) for c in call_s),
        "ms_p10": 1e3 * max(_percentile(c, 10) for c in call_s),
        "ms_p90": 1e3 * max(_percentile(c, 90) for c in call_s),
    }


def cell(value: Any, fmt: str = "{}") -> str:
    """A table cell: "-" for None, yes / no for a bool, else ``fmt.format(value)``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt.format(value)


def cells(row: dict[str, Any], columns: Iterable[tuple[str, str, str]]) -> list[str]:
    """The cells of ``row`` under ``columns``: (row key, header, format) each."""
    return [cell(row.get(key), fmt) for key, _, fmt in columns]


def group_by(items: Iterable[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """The items with equal ``key``, in the order each key first occurs."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def link_text(lab: dict[str, Any] | None) -> str:
    """The emulated link of a run's title (``args._lab``)."""
    if not lab:
        return "no link emulation"
    return f"{lab['topology']} {lab['rate_bits_per_s'] / 1e6:g} Mbit/s"


def rate_text(bits_per_s: float) -> str:
    """A ``--link`` rate as the error messages name it, e.g. ``100 Mbit/s``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


def _json_value(value: Any) -> Any:
    """``value`` with every float that is not finite as None: JSON has no Infinity or NaN
    (one rank probes no link: its bandwidth is inf), and json.dumps would write them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


def json_line(record: dict[str, Any], **options: Any) -> str:
    """One record as strict JSON (non-finite floats as null)."""
    return json.dumps(_json_value(record), allow_nan=False, **options)


def write_records(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Append the records to ``--out`` (JSONL) and, with ``--json``, print one per line."""
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json_line(rec) + "\n")
    if args.json:
        for rec in records:
            print(json_line(rec))


def note(text: str, args: argparse.Namespace) -> None:
    """Print a line that is not a row: on stderr under ``--json``, whose stdout is rows only
    (one JSON object a line), else on stdout under the table."""
    print(text, file=sys.stderr if args.json else sys.stdout)


def failed_line(ok: list[bool], why: str) -> list[str]:
    """The line counting the rows that are not ``ok`` (none when every row is): what the
    terminal and the markdown page say under the table."""
    return [] if all(ok) else [f"VERIFICATION FAILED for {ok.count(False)} row(s): {why}"]


def check_cell(ok: bool) -> str:
    """A row's ``check`` cell in the markdown page (the terminal's is red)."""
    return "ok" if ok else "WRONG"


def exit_status(ok: list[bool], why: str, args: argparse.Namespace) -> int:
    """0 when every row is ``ok``; else 1, with a note counting the rows that are not."""
    for line in failed_line(ok, why):
        note(line, args)
    return 0 if all(ok) else 1


def write_markdown(
    path: str, title: str, argv: list[str] | None, note: str, table: list[list[str]], end: list[str]
) -> None:
    """``--markdown``: the title, the command that reproduces the run, ``note``, the table of
    cells (``table[0]``: the header) and the ``end`` lines."""
    header, *rows = table
    lines = [f"# {title}", ""]
    if argv:
        lines += ["Reproduce with:", "", "```", "tokenring " + " ".join(argv), "```", ""]
    lines += [note, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows] + ["", *end]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def timing_note(settings: dict[str, Any], extra: str = "") -> str:
    """The markdown page's line on how the times were taken."""
    return (
        f"torch {settings['torch']}, git {settings['git_sha']}, {settings['warmup']} warm-up + "
        f"{settings['iters']} timed calls per row; times are the max over ranks of each rank's "
        f"median.{extra}"
    )
