"""The command line as a demanding user drives it (second audit): a wrong attention in a rank
fails bench's verification and its markdown page says so; bad sizes are refused before any
work; the simulator's table says what bounds every pass."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tokenring.cli
import tokenring.cli.bench
import tokenring.cli.bench_inference
from tokenring.cli import main
from tokenring.cli.models import KNOWN_MODELS
from tokenring.model.costmodel import PRESETS
from tokenring.model.simulate import simulate

TINY = ["--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]
TIMING = ["--warmup", "0", "--iters", "1"]
# the ranks' functions as imported (a rank imports this module afresh, unpatched)
_RUN_RANK = tokenring.cli.bench.run_rank
_RUN_CACHED_RANK = tokenring.cli.bench_inference.run_rank


# -- a wrong attention in the ranks: the verification must catch it ------------------------------
def _scaled(attend: Any, only: str | None = None) -> Any:
    """``attend`` with its output 1% too large (for ``strategy=only``, or every call)."""

    def wrong(*args: Any, **kwargs: Any) -> Any:
        result = attend(*args, **kwargs)
        if only is not None and kwargs.get("strategy") != only:
            return result
        if isinstance(result, tuple):  # attend_cached: (out, lse)
            return (result[0] * 1.01, *result[1:])
        return result * 1.01

    return wrong


def _ring_one_percent_off(config: Any, progress_path: str | None = None) -> Any:
    """bench's rank with Ring's output (and so its gradients) 1% off."""
    bench = tokenring.cli.bench
    bench.sequence_parallel_attn = _scaled(bench.sequence_parallel_attn, only=bench.Strategy.RING)
    return _RUN_RANK(config, progress_path)


def _cached_one_percent_off(config: Any, progress_path: str | None = None) -> Any:
    """bench --mode decode's rank with every cached attention 1% off."""
    module = tokenring.cli.bench_inference
    module.attend_cached = _scaled(module.attend_cached)
    return _RUN_CACHED_RANK(config, progress_path)


def test_bench_fails_a_strategy_whose_rank_answers_one_percent_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Ring's ranks return out * 1.01: its rows (forward, and the gradients it scales) are
    WRONG in the table, the JSON and the markdown page, the others ok, and the status is 1."""
    bench = tokenring.cli.bench
    monkeypatch.setattr(bench, "run_rank", _ring_one_percent_off)
    md, out = tmp_path / "t.md", tmp_path / "rows.jsonl"
    argv = ["bench", *TINY, *TIMING, "--seq", "12", "--causal", "yes"]
    argv += ["--strategies", "token_ring,ring", "--markdown", str(md), "--out", str(out)]
    assert main(argv) == 1
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["strategy"], r["pass"]): r["verified"] for r in rows} == {
        ("token_ring", "fwd"): True,
        ("token_ring", "fwd+bwd"): True,
        ("ring", "fwd"): False,
        ("ring", "fwd+bwd"): False,
    }
    assert all(r["max_error"] > 1e-3 for r in rows if r["strategy"] == "ring")
    table = [line for line in printed.splitlines() if line.startswith("│")]
    assert [("WRONG" in line, "ring" in line.split("│")[3].split()) for line in table] == [
        (False, False),
        (False, False),
        (True, True),
        (True, True),
    ]
    assert "VERIFICATION FAILED for 2 row(s)" in printed
    page = md.read_text()  # the page published from the run says which rows are wrong
    page_rows = [line for line in page.splitlines() if line.startswith("| 2:1x8 ")]
    assert [line.split(" | ")[-1] for line in page_rows] == ["ok |", "ok |", "WRONG |", "WRONG |"]
    assert "VERIFICATION FAILED for 2 row(s)" in page


def test_decode_bench_fails_a_cached_attention_one_percent_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    module = tokenring.cli.bench_inference
    monkeypatch.setattr(module, "run_rank", _cached_one_percent_off)
    md = tmp_path / "d.md"
    argv = ["bench", "--mode", "decode", *TINY, *TIMING, "--cached", "9", "--new", "1"]
    argv += ["--block-size", "4", "--cached-strategies", "pass_q,pass_kv", "--markdown", str(md)]
    assert main(argv) == 1
    printed = capsys.readouterr().out
    assert printed.count("WRONG") == 2 and "VERIFICATION FAILED for 2 row(s)" in printed
    page = md.read_text()
    assert page.count("| WRONG |") == 2 and "VERIFICATION FAILED for 2 row(s)" in page


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


class _Launched(Exception):
    pass


def test_bench_builds_each_schedule_once_before_its_ranks_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default strategies' check, the schedule check and the memory guard each built every
    (strategy, pass, causal, model) schedule of the run: three P^2 builds, ~35 s at --world-size 60
    before a rank started. Now each is built once."""
    built: Counter[tuple[Any, ...]] = Counter()
    real = tokenring.cli.bench.strategy_schedule

    def counted(strategy: Any, pass_: Any, **kwargs: Any) -> Any:
        built[strategy, pass_, kwargs["causal"], kwargs["heads_q"], kwargs["heads_kv"]] += 1
        return real(strategy, pass_, **kwargs)

    def launched(*args: Any, **kwargs: Any) -> Any:
        raise _Launched

    monkeypatch.setattr("tokenring.cli.bench.strategy_schedule", counted)
    monkeypatch.setattr("tokenring.cli.ranks.launch", launched)
    tokenring.cli.bench._schedule.cache_clear()
    with pytest.raises(_Launched):
        main(["bench", "--world-size", "3", "--seq", "24"])
    assert len(built) >= 8 and set(built.values()) == {1}, built


# -- tokenring simulate against the library it wraps ----------------------------------------------
def test_simulate_rows_are_the_librarys_and_say_what_bounds_each_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--pass both``: every number of a row is ``tokenring.model.simulate``'s for the same
    inputs, and ``bound_by`` names what bounds each pass (TokenRing's forward is comm-bound,
    its backward compute-bound on llama3-8b, P = 4, S = 4096: the row said "comm" alone,
    from the forward, beside a bound that sums both passes)."""
    argv = ["simulate", "--model", "llama3-8b", "--seq", "4096", "--world-size", "4"]
    assert main([*argv, "--pass", "both", "--json"]) == 0
    rows = {r["strategy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    model = KNOWN_MODELS["llama3-8b"]
    shape = dataclasses.replace(model.shape, batch=1, dtype="bfloat16")
    for name in ("token_ring", "ring"):
        want = simulate(
            name,
            passes="both",
            layout="zigzag",
            causal=True,
            world_size=4,
            seq_local=1024,
            shape=shape,
            hardware=PRESETS["h100-nvswitch"],
        )
        row = rows[name]
        assert row["call_ms"] == pytest.approx(1e3 * want.call_s, rel=1e-12)
        assert row["bound_ms"] == pytest.approx(1e3 * want.bound_s, rel=1e-12)
        compute = sum(p.compute_s for p in want.passes)
        assert row["compute_only_ms"] == pytest.approx(1e3 * compute, rel=1e-12)
        said = [
            "compute" if p.compute_s >= p.busiest_s else f"comm ({p.busiest_resource})"
            for p in want.passes
        ]
        assert len(set(said)) == (2 if name == "token_ring" else 1), said
        expected = said[0] if len(set(said)) == 1 else f"forward {said[0]}, backward {said[1]}"
        assert row["bound_by"] == expected
        # each pass's own: these were the forward's alone for the whole call
        for p in want.passes:
            key = p.pass_.value
            assert row["steady_step_ms"][key] == pytest.approx(1e3 * p.steady_step_s, rel=1e-12)
            assert row["busiest_resource"][key] == p.busiest_resource
            assert row["step_ms"][key] == pytest.approx([1e3 * x for x in p.step_s], rel=1e-12)
            assert set(row["transfer_ms"][key]) == {tr.label for tr in _sends(p)}
    fwd, bwd = (rows["token_ring"]["steady_step_ms"][k] for k in ("forward", "backward"))
    assert main([*argv, "--pass", "both"]) == 0
    assert f"{fwd:.4g} / {bwd:.4g}" in capsys.readouterr().out


def _sends(p: Any) -> list[Any]:
    return [ev for events in p.timeline for ev in events if ev.kind == "send"]


# -- output files ---------------------------------------------------------------------------------
def _refuse_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the command started")

    monkeypatch.setattr("tokenring.cli.ranks.launch", started)
    monkeypatch.setattr("tokenring.cli.simulate.simulate", started)


def test_two_outputs_naming_one_file_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each output option writes its own file; naming one file twice left only the later
    (``--out t --markdown t``: the markdown page where the JSON rows were appended)."""
    _refuse_to_start(monkeypatch)
    same, other = str(tmp_path / "t"), str(tmp_path / ".." / tmp_path.name / "t")
    for argv in (
        ["bench", "--out", same, "--markdown", same],
        ["bench", "--plot", same, "--trace", other],
        ["simulate", "--plot", same, "--timeline", same],
        ["simulate", "--timeline", same, "--trace", other],
    ):
        line = _usage_error(argv, capsys)
        assert f"{argv[1]} {argv[2]!r} and {argv[3]} {argv[4]!r} name the same file" in line


def test_an_output_path_under_a_file_or_unwritable_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path under a file was said to be under a directory that 'does not exist'; '' and
    unwritable files and directories (os.access, as for a user who is not root) are named."""
    _refuse_to_start(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("")
    line = _usage_error(["bench", "--out", str(afile / "rows.jsonl")], capsys)
    assert "argument --out" in line and f"{str(afile)!r} is a file, not a directory" in line
    line = _usage_error(["simulate", "--trace", ""], capsys)
    assert "argument --trace: must be a file path; got ''" in line
    monkeypatch.setattr("tokenring.cli.os.access", lambda *args: False)
    line = _usage_error(["bench", "--markdown", str(afile)], capsys)
    assert f"argument --markdown: file {str(afile)!r} is not writable" in line
    line = _usage_error(["simulate", "--plot", str(tmp_path / "new.png")], capsys)
    assert f"argument --plot: directory {str(tmp_path)!r} is not writable" in line


def test_mem_available_is_none_where_proc_meminfo_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("/proc/meminfo")

    monkeypatch.setattr(tokenring.cli, "open", unreadable, raising=False)
    assert tokenring.cli.mem_available_bytes() is None
    for text in ("MemTotal: 1 kB\n", "MemAvailable: lots kB\n"):
        monkeypatch.setattr(tokenring.cli, "open", lambda *a, t=text, **k: io.StringIO(t))
        assert tokenring.cli.mem_available_bytes() is None
    monkeypatch.setattr(tokenring.cli, "open", lambda *a, **k: io.StringIO("MemAvailable: 3 kB"))
    assert tokenring.cli.mem_available_bytes() == 3 * 1024


def test_simulate_table_says_what_it_rounded_and_which_engine_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under the table: a sequence rounded down to what the layout splits (the row shows the
    rounded S), and the vectorised engine beyond the event engine's world sizes; --json
    keeps both S."""
    argv = ["simulate", "--seq", "7", "--world-size", "4", "--layout", "contiguous"]
    assert main([*argv, "--strategies", "ring"]) == 0
    out = capsys.readouterr().out
    assert "S=7 rounded down to 4, a multiple the layout 'contiguous' splits over 4 ranks" in out
    assert main([*argv, "--strategies", "ring", "--json"]) == 0
    (row,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert (row["seq"], row["seq_requested"], row["mode"]) == (4, 7, "event")
    argv = ["simulate", "--seq", "1000", "--world-size", "100", "--strategies", "token_ring"]
    assert main([*argv, "--splits", "2"]) == 0
    out = capsys.readouterr().out
    assert "engine 'vectorised'" in out and "P > 64" in out


# -- --link: refused where the lab cannot run it (the lab itself needs root and netns) -----------
def test_link_is_refused_under_torchrun_and_without_the_lab(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse_to_start(monkeypatch)
    monkeypatch.setattr("tokenring.cli.ranks.lab_unavailable_reason", lambda: "needs root")
    for mode in ("attention", "decode"):
        line = _usage_error(["bench", "--mode", mode, *TINY, "--link", "100mbit"], capsys)
        assert "--link needs the emulated-interconnect lab: needs root" in line, line
    line = _usage_error(["bench", *TINY[2:], "--world-size", "1", "--link", "1gbit"], capsys)
    assert "--link with --world-size 1" in line and "[2, 250]" in line, line
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    line = _usage_error(["bench", *TINY[2:], "--link", "100mbit"], capsys)
    assert "--link emulates links between ranks bench spawns; not under torchrun" in line
