"""Process helpers the lifecycle, lab and shared-memory tests share."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` runs: neither gone nor a zombie (ended, waiting for its parent to reap
    it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
