"""Helpers the test files share that need neither transformers nor diffusers: whether a
process runs, and a call's outcome as ranks report it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def running(pid: int) -> bool:
    """Whether ``pid`` runs: neither gone nor a zombie (ended, waiting for its parent to reap
    it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """``run()``'s value (``"value"``) or error (``"error"``: type and message), and its time
    (``"elapsed_s"``)."""
    start = time.monotonic()
    out: dict[str, Any] = {}
    try:
        out["value"] = run()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["elapsed_s"] = time.monotonic() - start
    return out
