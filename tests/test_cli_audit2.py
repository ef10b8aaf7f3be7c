"""The command line as a demanding user drives it (second audit): a wrong attention in a rank
fails bench's verification and its markdown page says so; bad sizes are refused before any
work; the simulator's table says what bounds every pass."""

from __future__ import annotations

from typing import Any

import pytest

from tokenring.cli import main


# -- sizes refused before any work ----------------------------------------------------------------
def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a command that must end with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2, argv
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tokenring {argv[0]}: error: "), lines
    return lines[0]


def _nothing_built(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a schedule was built before the world size was checked")


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--world-size", "99999"],
        ["bench", "--world-size", "99999"],
        ["bench", "--world-size", "99999", "--strategies", "ring", "--seq", "8"],
        ["bench", "--mode", "memory", "--world-size", "99999", "--seq-local", "2"],
        ["bench", "--mode", "decode", "--world-size", "99999"],
    ],
    ids=" ".join,
)
def test_more_ranks_than_the_machine_holds_are_refused_before_any_schedule(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank holds a process (PROCESS_BYTES) before its first tensor: 99999 of them
    cannot start on any machine. The check built the P^2 schedules of every strategy first,
    and the command was killed for memory (20 GB in a minute) instead of refusing."""
    monkeypatch.setattr("tokenring.cli.ranks.mem_available_bytes", lambda: 64 << 30)
    for module in ("bench", "bench_memory"):
        monkeypatch.setattr(f"tokenring.cli.{module}.strategy_schedule", _nothing_built)
    line = _usage_error(argv, capsys)
    assert "--world-size 99999" in line and "MemAvailable is 64 GiB" in line, line
    assert "0.312 GiB each" in line, line
