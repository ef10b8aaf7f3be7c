"""Bad input at the command line: one line on stderr naming the argument, exit status 2, and
nothing started (Note [Bad input at the command line] in tokenring.cli); and the size guards
that refuse a run before it can run out of memory or time."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Every command's module imported before the fixture below patches launch() and simulate():
# one imported under the patch would keep the refusing stand-in for every later test.
import tokenring.cli.bench
import tokenring.cli.bench_inference
import tokenring.cli.bench_memory
import tokenring.cli.ranks
import tokenring.cli.simulate
import tokenring.launch  # noqa: F401  (sys.modules["tokenring.launch"] below)
from oracle import make_inputs, oracle_with_grads, sharded_positions
from tokenring import Strategy
from tokenring.cli import main

MISSING = "/nonexistent-tokenring-dir/out"


class Started(Exception):
    """Raised by the patched launchers: the command got past its checks."""


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any rank, lab or simulation started fails the test with ``Started``."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Started

    launch_module = sys.modules["tokenring.launch"]  # the package exports launch() by that name
    monkeypatch.setattr(launch_module, "launch", refuse)
    monkeypatch.setattr(launch_module, "_start", refuse)
    # where the commands call it from (imported at the top of their modules)
    monkeypatch.setattr("tokenring.cli.ranks.launch", refuse)
    monkeypatch.setattr("tokenring.model.netlab.Lab.__enter__", refuse)
    # the command's module first: importing it binds the simulator's real function
    monkeypatch.setattr("tokenring.cli.simulate.simulate", refuse)
    monkeypatch.setattr("tokenring.model.simulate.simulate", refuse)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a command that must end with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2, argv
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tokenring {argv[0]}: error: "), lines[0]
    return lines[0]


BAD = [
    # (argv, words the error must contain: the argument and the value)
    (["bench", "--world-size", "0"], ["--world-size", "'0'", ">= 1"]),
    (["bench", "--world-size", "-3"], ["--world-size", "'-3'"]),
    (["bench", "--seq", "0"], ["--seq", "'0'"]),
    (["bench", "--seq", "-8"], ["--seq", "'-8'"]),
    (["bench", "--seq", "1e3"], ["--seq", "'1e3'"]),
    (["bench", "--batch", "0"], ["--batch"]),
    (["bench", "--head-dim", "0"], ["--head-dim"]),
    (["bench", "--iters", "0"], ["--iters"]),
    (["bench", "--warmup", "-1"], ["--warmup"]),
    (["bench", "--hybrid-inner", "0"], ["--hybrid-inner"]),
    (["bench", "--timeout", "nan"], ["--timeout", "'nan'", "finite"]),
    (["bench", "--timeout", "inf"], ["--timeout", "'inf'"]),
    (["bench", "--timeout", "0"], ["--timeout", "'0'", "> 0"]),
    (["bench", "--timeout", "-5"], ["--timeout"]),
    (["bench", "--tolerance", "nan"], ["--tolerance", "'nan'"]),
    (["bench", "--tolerance", "-0.1"], ["--tolerance", "'-0.1'"]),
    (["bench", "--link", "fast"], ["--link", "'fast'"]),
    (["bench", "--link", "nan"], ["--link", "'nan'"]),
    (["bench", "--link", "inf"], ["--link", "'inf'"]),
    (["bench", "--link", "0.5bit"], ["--link", "'0.5bit'"]),
    (["bench", "--out", f"{MISSING}/rows.jsonl"], ["--out", "does not exist"]),
    (["bench", "--plot", f"{MISSING}/t.png"], ["--plot", "does not exist"]),
    (["bench", "--markdown", f"{MISSING}/t.md"], ["--markdown", "does not exist"]),
    (["bench", "--out", "/"], ["--out", "directory"]),
    (["bench", "--strategies", "ring,nope"], ["--strategies", "'nope'", "token_ring"]),
    (["bench", "--strategies", ","], ["--strategies"]),
    (["bench", "--strategies", "ring,token_ring,ring"], ["--strategies", "'ring'", "more than"]),
    (["bench", "--passes", "fwd,fwd"], ["--passes", "'fwd'", "more than once"]),
    (["bench", "--mode", "decode", "--cached", "64,64"], ["--cached", "64", "more than once"]),
    (["bench", "--mode", "memory", "--seq-local", "8,8"], ["--seq-local", "8", "more than"]),
    # the flags, not the config's fields (seq_locals, strategy 'hybrid')
    (["bench", "--mode", "memory", "--seq-local", "8,5"], ["--seq-local", "'8,5'", "even"]),
    (["bench", "--mode", "memory", "--strategies", "ring,hybrid"], ["--strategies", "hybrid"]),
    (["simulate", "--world-size", "4", "8", "4"], ["--world-size", "4", "more than once"]),
    (["simulate", "--seq", "64", "64"], ["--seq", "64", "more than once"]),
    (["simulate", "--strategies", "ring", "ring"], ["--strategies", "'ring'", "more than"]),
    (["bench", "--passes", "fwd,back"], ["--passes", "'back'"]),
    (["bench", "--heads", "4"], ["--heads", "--kv-heads"]),
    (["bench", "--heads", "4", "--kv-heads", "3"], ["--kv-heads must divide --heads", "3"]),
    (["bench", "--strategies", "hybrid", "--world-size", "3"], ["--strategies hybrid", "3"]),
    (["bench", "--strategies", "hybrid", "--hybrid-inner", "3"], ["--strategies hybrid", "3"]),
    (["bench", "--strategies", "ring", "--last-pair", "lend"], ["--last-pair", "token_ring"]),
    (["bench", "--strategies", "ring", "--hybrid-inner", "4"], ["--hybrid-inner", "hybrid"]),
    (["bench", "--mode", "decode", "--new", "0"], ["--new", "'0'"]),
    (["bench", "--mode", "decode", "--cached", "-1"], ["--cached", "'-1'"]),
    (["bench", "--mode", "decode", "--cached", "x"], ["--cached", "'x'"]),
    (["bench", "--mode", "decode", "--cached-strategies", "x"], ["--cached-strategies", "'x'"]),
    (["bench", "--mode", "decode", "--block-size", "0"], ["--block-size"]),
    (["bench", "--mode", "nope"], ["--mode", "'nope'"]),
    # memory mode writes no markdown page: refused rather than dropped
    (["bench", "--mode", "memory", "--markdown", "t.md"], ["--markdown", "--mode memory"]),
    # bidir_token_ring needs 2 query heads: refused before the ranks start
    (["bench", "--mode", "memory", "--heads", "1", "--kv-heads", "1"], ["bidir_token_ring", "1"]),
    # a hybrid factorisation given but not fitting: named, not "changes only --strategies hybrid"
    (["bench", "--hybrid-inner", "3"], ["--hybrid-inner 3", "world_size=4"]),
    # an option the run does not read is refused at any value, its default too (it was
    # accepted and dropped when it equalled the default: --seq 1024 passed, --seq 8192 not)
    (["bench", "--mode", "memory", "--seq", "1024"], ["--seq is for --mode attention"]),
    (["bench", "--mode", "decode", "--passes", "fwd,fwd+bwd"], ["--passes", "attention"]),
    (["bench", "--mode", "decode", "--layout", "auto"], ["--layout", "attention"]),
    (["bench", "--mode", "decode", "--causal", "both"], ["--causal", "attention or memory"]),
    (["bench", "--mode", "decode", "--last-pair", "return"], ["--last-pair", "attention"]),
    (["bench", "--mode", "decode", "--hybrid-inner", "2"], ["--hybrid-inner", "attention"]),
    (["bench", "--mode", "memory", "--hybrid-outer", "token_ring"], ["--hybrid-outer"]),
    (["bench", "--mode", "memory", "--iters", "5"], ["--iters", "decode", "--mode memory"]),
    (["bench", "--mode", "memory", "--warmup", "1"], ["--warmup", "--mode memory"]),
    (["bench", "--mode", "memory", "--topology", "mesh"], ["--topology", "--mode memory"]),
    (["bench", "--cached", "4096"], ["--cached is for --mode decode"]),
    (["bench", "--block-size", "64"], ["--block-size is for --mode decode"]),
    (["bench", "--seq-local", "4096,16384,65536"], ["--seq-local is for --mode memory"]),
    (["bench", "--topology", "mesh"], ["--topology", "without --link"]),
    (["bench", "--strategies", "ring", "--last-pair", "return"], ["--last-pair", "token_ring"]),
    (["bench", "--strategies", "ring", "--hybrid-inner", "2"], ["--hybrid-inner", "hybrid"]),
    (["bench", "--strategies", "ring", "--hybrid-outer", "token_ring"], ["--hybrid-outer"]),
    (["bench", "--world-size", "3", "--hybrid-inner", "2"], ["--hybrid-inner 2", "world_size=3"]),
    (["simulate", "--strategies", "ring", "--splits", "2"], ["--splits", "token_ring"]),
    # memory runs one mask (causal unless --causal no): both was accepted and ran only causal
    (["bench", "--mode", "memory", "--causal", "both"], ["--causal both", "yes or no"]),
    # --json prints rows instead of the table --wide widens: it was dropped
    (["bench", "--wide", "--json"], ["--wide", "--json"]),
    (["simulate", "--hybrid-outer", "token_ring"], ["--hybrid-outer", "--strategies hybrid"]),
    (["demo", "--world-size", "0"], ["--world-size", "'0'"]),
    (["demo", "--seq", "-1"], ["--seq", "'-1'"]),
    (["demo", "--iters", "0"], ["--iters"]),
    (["demo", "--heads", "8", "--kv-heads", "3"], ["--kv-heads must divide --heads"]),
    (["demo", "--timeout", "nan"], ["--timeout", "'nan'"]),
    (["demo", "--heads", "1", "--kv-heads", "1"], ["--heads 1", "bidir_token_ring"]),
    (["simulate", "--world-size", "0"], ["--world-size", "'0'"]),
    (["simulate", "--world-size", "8", "0"], ["--world-size", "'0'"]),
    (["simulate", "--seq", "0"], ["--seq", "'0'"]),
    (["simulate", "--seq", "10", "--world-size", "8"], ["--seq", "16", "10"]),
    (["simulate", "--batch", "0"], ["--batch"]),
    (["simulate", "--splits", "0"], ["--splits"]),
    (["simulate", "--hybrid-inner", "0"], ["--hybrid-inner"]),
    (["simulate", "--strategies", "nope"], ["--strategies", "'nope'"]),
    (["simulate", "--strategies", "hybrid"], ["--hybrid-inner must be given"]),
    (["simulate", "--plot", f"{MISSING}/c.png"], ["--plot", "does not exist"]),
    (["simulate", "--timeline", f"{MISSING}/t.png"], ["--timeline", "does not exist"]),
    (["simulate", "--timeline", "t.png", "--world-size", "128"], ["--timeline", "128"]),
    (["simulate", "--timeline", "t.png", "--mode", "vectorised"], ["--timeline", "vectorised"]),
    (["simulate", "--hybrid-inner", "4"], ["--hybrid-inner", "--strategies hybrid"]),
    (["simulate", "--hybrid-outer", "ring"], ["--hybrid-outer", "--strategies hybrid"]),
    (["simulate", "--strategies", "ring", "--splits", "3"], ["--splits", "token_ring", "ring"]),
    (
        [
            *("simulate", "--strategies", "hybrid", "--hybrid-inner", "2"),
            *("--hybrid-outer", "ring", "--splits", "3"),
        ],
        ["--splits", "bidir_token_ring"],
    ),
    (["simulate", "--strategies", "ring", "--lend-last-pair"], ["--lend-last-pair", "token_ring"]),
    # llama2-7b has 32 K/V heads: TokenRing's last block has at most 32 slices, one per K/V
    # head (Note [Last block by heads]); a larger --splits gave the same prediction silently
    (["simulate", "--strategies", "token_ring", "--splits", "100"], ["--splits 100", "32"]),
    # nothing the simulator could predict: refused before simulating, not a late traceback
    (
        ["simulate", "--strategies", "hybrid", "--hybrid-inner", "2", "--world-size", "3"],
        ["--strategies hybrid", "P=3", "inner=2"],
    ),
    (["simulate", "--strategies", "ulysses", "--mode", "vectorised"], ["ulysses", "vectorised"]),
    (["simulate", "--strategies", "allgather_kv", "--world-size", "128"], ["allgather_kv", "128"]),
    (
        ["simulate", "--mode", "event", "--world-size", "20000", "--seq", "1048576"],
        ["--mode event"],
    ),
]


@pytest.mark.parametrize(("argv", "words"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_with_status_2_and_nothing_starts(
    argv: list[str],
    words: list[str],
    capsys: pytest.CaptureFixture[str],
    nothing_starts: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # relative output paths land in a writable directory
    line = _usage_error(argv, capsys)
    for word in words:
        assert word in line, (word, line)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nothing_starts: None
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = _usage_error(["bench", "--out", str(locked / "rows.jsonl")], capsys)
    assert "--out" in line and "not writable" in line


def test_a_plot_without_matplotlib_is_refused_before_the_ranks_start(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    nothing_starts: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench draws --plot after every row has run: without matplotlib it must say so first."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    line = _usage_error(["bench", "--plot", str(tmp_path / "t.png")], capsys)
    assert "--plot" in line and "matplotlib" in line


def test_a_simulate_picture_without_matplotlib_is_refused_before_simulating(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    nothing_starts: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """simulate --plot or --timeline without matplotlib: one line naming the flag, status 2
    (it was an ImportError traceback from run, status 1)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    for flag in ("--plot", "--timeline"):
        line = _usage_error(["simulate", flag, str(tmp_path / "c.png")], capsys)
        assert flag in line and "matplotlib" in line, line


def test_a_world_size_that_torchrun_overrides_is_refused(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun the launcher's ranks are the run's: a --world-size other than theirs
    would be dropped without a word (every mode)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    for mode in ("attention", "decode", "memory"):
        line = _usage_error(["bench", "--mode", mode, "--world-size", "3"], capsys)
        assert "--world-size 3" in line and "torchrun" in line and "2 ranks" in line
    # bench's default world size is 4: given, it is as wrong as any other (it passed)
    line = _usage_error(["bench", "--world-size", "4"], capsys)
    assert "--world-size 4" in line and "2 ranks" in line


def test_the_memory_bench_under_torchrun_needs_its_allocator_setting(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU peak memory is honest only with MALLOC_MMAP_THRESHOLD_=65536 set before the
    process starts (Note [Measuring peak memory]): bench sets it for the ranks it spawns,
    torchrun's ranks have what their launcher gave them, so it is checked before the process
    group forms, not in every rank's first measurement."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Started

    monkeypatch.setattr("tokenring.cli.ranks.collect_per_rank", refuse)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    argv = ["bench", "--mode", "memory", "--device", "cpu", "--seq-local", "8"]
    line = _usage_error(argv, capsys)
    assert "MALLOC_MMAP_THRESHOLD_=65536" in line and "torchrun" in line and "None" in line
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with pytest.raises(Started):
        main(argv)


def test_the_checks_pass_good_input_to_the_launcher(tmp_path: Path, nothing_starts: None) -> None:
    """The same flags with good values reach the launcher (the checks refuse only bad
    input): every command starts its ranks or simulation."""
    out = str(tmp_path / "rows.jsonl")
    for argv in (
        ["bench", "--seq", "100", "--world-size", "3", "--out", out, "--timeout", "60"],
        ["bench", "--mode", "decode", "--cached", "0,64", "--new", "1"],
        ["demo", "--seq", "33", "--world-size", "2"],
        ["simulate", "--world-size", "8", "4096", "--json", "--plot", str(tmp_path / "c.png")],
    ):
        with pytest.raises(Started):
            main(argv)


def test_an_option_given_at_its_default_reaches_the_run_that_reads_it(
    nothing_starts: None,
) -> None:
    """Refusing an option the run does not read must not refuse one it does: each of these
    names its default value and the run that reads it starts."""
    for argv in (
        ["bench", "--seq", "64", "--world-size", "2", "--passes", "fwd,fwd+bwd"],
        ["bench", "--seq", "64", "--world-size", "2", "--last-pair", "return"],
        ["bench", "--seq", "64", "--hybrid-inner", "2", "--hybrid-outer", "token_ring"],
        ["bench", "--mode", "memory", "--world-size", "2", "--causal", "yes", "--seq-local", "8"],
        ["bench", "--mode", "decode", "--cached", "64", "--new", "1", "--block-size", "64"],
        ["simulate", "--strategies", "token_ring", "--splits", "2", "--world-size", "4"],
    ):
        with pytest.raises(Started):
            main(argv)


def test_a_default_strategy_that_cannot_run_the_shape_is_dropped_with_a_note(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query head: bidir_token_ring (two lanes of half the query heads each) cannot run.
    Left to the default list it is dropped with a note, as the hybrid is (the run was refused
    with "--strategies bidir_token_ring cannot run", a flag the user never gave); named in
    --strategies it is refused."""
    launched: list[Any] = []

    def record(fn: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        launched.append(config)
        raise Started

    monkeypatch.setattr("tokenring.cli.ranks.launch", record)
    argv = ["bench", "--seq", "64", "--heads", "1", "--kv-heads", "1", "--json"]
    with pytest.raises(Started):
        main(argv)
    err = capsys.readouterr().err
    assert "bench: no bidir_token_ring rows" in err and "heads_q=1" in err, err
    assert "bench: no hybrid rows" in err, err
    want = {s for s in Strategy if s not in (Strategy.BIDIR_TOKEN_RING, Strategy.HYBRID)}
    assert set(launched[0].strategies) == want
    line = _usage_error([*argv, "--strategies", "ring,bidir_token_ring"], capsys)
    assert "--strategies bidir_token_ring cannot run" in line, line
    # memory mode refuses its default list's too (its BAD case), without naming a flag not given
    line = _usage_error(["bench", "--mode", "memory", "--heads", "1", "--kv-heads", "1"], capsys)
    assert "the default strategy bidir_token_ring cannot run" in line, line


def test_splits_beyond_what_a_strategy_slices_are_said(capsys: pytest.CaptureFixture[str]) -> None:
    """llama3-8b, 8 K/V heads: TokenRing slices its last block by K/V head, at most 8;
    bidir_token_ring each lane's half, at most 4 (Note [Last block by heads]). --splits 8 takes
    effect for the first and is cut to 4 for the second: said on stderr (it was silent), and
    the rows are those of --splits 4 for bidir_token_ring."""

    def rows(splits: int) -> dict[str, Any]:
        argv = ["simulate", "--model", "llama3-8b", "--seq", "8192", "--world-size", "4"]
        argv += ["--strategies", "token_ring", "bidir_token_ring", "--json"]
        assert main([*argv, "--splits", str(splits)]) == 0
        out = capsys.readouterr()
        got = {r["strategy"]: r for r in map(json.loads, out.out.splitlines())}
        return {"rows": got, "err": out.err}

    eight, four = rows(8), rows(4)
    assert "bidir_token_ring" in eight["err"] and "at most 4" in eight["err"], eight["err"]
    assert "token_ring slices" not in eight["err"].replace("bidir_token_ring", ""), eight["err"]
    assert "--splits" not in four["err"], four["err"]
    assert eight["rows"]["bidir_token_ring"] == four["rows"]["bidir_token_ring"]
    assert eight["rows"]["token_ring"] != four["rows"]["token_ring"]


def _strict_json(text: str) -> Any:
    """json.loads that refuses what RFC 8259 has no word for (Infinity, -Infinity, NaN)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_records_are_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json and --out rows parse as JSON: a value that is not finite (one rank probes no
    link, its bandwidth inf) is null, not Python's Infinity, which JSON parsers refuse."""
    import argparse

    from tokenring.cli.report import write_records

    out = tmp_path / "rows.jsonl"
    record = {"rate": float("inf"), "steps": [1.0, float("nan")], "cal": {"x": -float("inf")}}
    write_records([record], argparse.Namespace(out=str(out), json=True))
    want = {"rate": None, "steps": [1.0, None], "cal": {"x": None}}
    assert _strict_json(capsys.readouterr().out) == want
    assert _strict_json(out.read_text()) == want


# -- size guards -------------------------------------------------------------------------------
def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_estimate(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2^20 tokens, 4 ranks: every rank draws the global q, k, v, dout (B S (2 Hq + 2 Hkv) D
    float32 = 10 GiB for the default 8/8 x 64 model) before anything else."""
    monkeypatch.setattr("tokenring.cli.bench.mem_available_bytes", lambda: 16 << 30)
    line = _usage_error(["bench", "--seq", "1048576"], capsys)
    assert "--seq 1048576" in line and "MemAvailable is 16 GiB" in line
    per_rank = float(line.split("needs about ")[1].split(" GiB")[0])
    inputs = 2**20 * (2 * 8 + 2 * 8) * 64 * 4
    assert per_rank * 2**30 >= inputs
    # what a rank holds, compared with the machine: 4 ranks here
    total = float(line.split("GiB), ")[1].split(" GiB")[0])
    assert total == pytest.approx(4 * per_rank, rel=1e-2)


def test_the_memory_estimate_follows_the_ranks_on_this_machine(
    nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run fits when the machine has room for its ranks and is refused otherwise."""
    from tokenring.cli.bench import BenchConfig, estimate_rank_bytes
    from tokenring.core.schedule import AttentionShape

    config = BenchConfig(seq=4096, models={"m": AttentionShape(heads_q=4, heads_kv=2, head_dim=16)})
    per_rank = sum(estimate_rank_bytes(config, 2).values())
    argv = ["bench", "--seq", "4096", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    argv += ["--world-size", "2", "--strategies", "token_ring,ring,bidir_ring,ulysses,allgather_kv"]
    monkeypatch.setattr("tokenring.cli.bench.mem_available_bytes", lambda: 2 * per_rank)
    with pytest.raises(Started):
        main(argv)
    monkeypatch.setattr("tokenring.cli.bench.mem_available_bytes", lambda: 2 * per_rank - 1)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_a_memory_bench_that_cannot_fit_is_refused_with_the_estimate(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--mode memory measures peaks at least as large as the inputs + outputs + gradients
    (9 tensors of s rows, README "Memory"): s = 2^20 tokens per rank of 8 + 8 heads of 64 in
    float32 hold 4 GiB a rank at the very least, so 4 ranks do not fit in 8 GiB: refused
    naming --seq-local (it started the ranks, which ran out of memory)."""
    monkeypatch.setattr("tokenring.cli.bench_memory.mem_available_bytes", lambda: 8 << 30)
    argv = ["bench", "--mode", "memory", "--device", "cpu", "--seq-local", "4096,1048576"]
    line = _usage_error(argv, capsys)
    assert "--seq-local 1048576" in line and "4 ranks" in line, line
    assert "MemAvailable is 8 GiB" in line, line
    per_rank = float(line.split("needs about ")[1].split(" GiB")[0]) * 2**30
    s = 1 << 20
    assert per_rank >= s * (4 * 8 + 4 * 8) * 64 * 4 + s * 8 * 4, line
    with pytest.raises(Started):  # the same run on a machine with room for it
        monkeypatch.setattr("tokenring.cli.bench_memory.mem_available_bytes", lambda: 1 << 40)
        main(argv)


def test_a_link_too_slow_for_the_timeout_is_refused_with_the_bytes(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ring forward, non-causal, 2 ranks: each call sends the other rank's K/V once (s rows of
    2 Hkv D float32), and the bandwidth probe sends 6 rounds of 4 MiB each way: 3 calls x
    1024 x 2 x 8 x 32 x 4 + 6 x 4 MiB = 31457280 bytes, 251.7 s at 1 Mbit/s."""
    monkeypatch.setattr("tokenring.cli.ranks.lab_unavailable_reason", lambda: None)
    num_bytes = 3 * 1024 * 2 * 8 * 32 * 4 + 6 * (4 << 20)
    seconds = num_bytes * 8 / 1e6
    argv = ["bench", "--world-size", "2", "--seq", "2048", "--heads", "8", "--kv-heads", "8"]
    argv += ["--head-dim", "32", "--strategies", "ring", "--passes", "fwd", "--causal", "no"]
    argv += ["--warmup", "1", "--iters", "2", "--link", "1mbit"]
    line = _usage_error([*argv, "--timeout", f"{seconds - 1:.0f}"], capsys)
    assert f"{num_bytes / 1e6:.4g} MB" in line and "--link 1 Mbit/s" in line
    assert f"{seconds:.4g} s" in line and "--timeout" in line
    with pytest.raises(Started):  # one second more and the run may go ahead
        main([*argv, "--timeout", f"{seconds + 1:.0f}"])


def test_a_decode_link_too_slow_for_its_calibration_is_refused(
    capsys: pytest.CaptureFixture[str], nothing_starts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode bench calibrates first: 3 timed probes and a warm-up of 8 MiB one way, then
    both ways, round the ring: 2 x 4 x 8 MiB = 67108864 bytes over each link r -> r-1, 536.9 s
    at 1 Mbit/s, whatever the rows (they once ran until --timeout killed the ranks)."""
    monkeypatch.setattr("tokenring.cli.ranks.lab_unavailable_reason", lambda: None)
    num_bytes = 2 * 4 * (8 << 20)
    seconds = num_bytes * 8 / 1e6
    argv = ["bench", "--mode", "decode", "--world-size", "2", "--cached", "8", "--new", "1"]
    argv += ["--link", "1mbit"]
    line = _usage_error([*argv, "--timeout", f"{seconds - 1:.0f}"], capsys)
    assert f"{num_bytes / 1e6:.4g} MB" in line and "--link 1 Mbit/s" in line
    assert f"{seconds:.4g} s" in line and "--timeout" in line
    with pytest.raises(Started):  # one second more and the run may go ahead
        main([*argv, "--timeout", f"{seconds + 1:.0f}"])


# -- any sequence length (uneven shards) -------------------------------------------------------
def test_the_per_rank_reference_equals_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench's reference (the rank's rows only, in score tiles) against the test oracle (full
    attention in float64), for uneven shards, GQA, both layouts, one tile or 3 rows a tile."""
    from tokenring.cli import bench, reference

    whole_tiles = reference._tile_rows
    for seq, world, layout, causal in (
        (37, 3, "zigzag", True),
        (37, 4, "contiguous", False),
        (5, 4, "zigzag", True),  # some ranks hold one token, some none
        (50, 2, "contiguous", True),
    ):
        q, k, v, dout = make_inputs(
            seed=seq, batch=2, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8
        )
        want = oracle_with_grads(q, k, v, dout, causal=causal, scale=0.3)
        inputs = [x.clone() for x in (q, k, v, dout)]
        for rank in range(world):
            rows = torch.tensor(sharded_positions(layout, rank, world, seq), dtype=torch.long)
            for tiles in (whole_tiles, lambda *_: 3):
                monkeypatch.setattr(reference, "_tile_rows", tiles)
                got = bench.per_rank_reference(
                    q, k, v, dout, rows, causal=causal, scale=0.3, grads=True
                )
                (out,) = bench.per_rank_reference(
                    q, k, v, dout, rows, causal=causal, scale=0.3, grads=False
                )
                torch.testing.assert_close(out, want["out"][:, rows], rtol=0, atol=1e-12)
                for name, tensor in zip(("out", "dq", "dk", "dv"), got, strict=True):
                    torch.testing.assert_close(tensor, want[name][:, rows], rtol=0, atol=1e-12)
        for x, y in zip((q, k, v, dout), inputs, strict=True):  # read, never written
            assert torch.equal(x, y)


def test_bench_runs_any_sequence_length(capsys: pytest.CaptureFixture[str]) -> None:
    """S = 37 on 3 ranks (uneven shards in both layouts): every strategy, causal or not,
    out and gradients verified against float64 (the reference above); the hybrid on 2."""
    argv = ["bench", "--world-size", "3", "--seq", "37", "--heads", "6", "--kv-heads", "3"]
    argv += ["--head-dim", "8", "--warmup", "0", "--iters", "1", "--json", "--dtype", "float64"]
    argv += ["--passes", "fwd+bwd"]  # out and every gradient (forward-only: the test above)
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    # 2 does not divide 3: said, not silently dropped (on stderr: --json's stdout is rows)
    assert "no hybrid rows" in captured.err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    strategies = [s.value for s in Strategy if s is not Strategy.HYBRID]
    assert sorted({r["strategy"] for r in rows}) == sorted(strategies)
    assert len(rows) == 2 * len(strategies)
    for row in rows:
        assert row["seq"] == 37 and row["verified"], row
        assert row["max_error"] <= 1e-9
    # the hybrid too: 1 x 2 on 2 ranks, uneven shards of S = 37 (hybrid_shard, seq_len=)
    for flag, value in (("--world-size", "2"), ("--heads", "4"), ("--kv-heads", "2")):
        argv[argv.index(flag) + 1] = value
    assert main([*argv, "--strategies", "hybrid", "--hybrid-inner", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert len(rows) == 2 and {r["hybrid"] for r in rows} == {"1x2 token_ring"}
    assert all(r["verified"] and r["max_error"] <= 1e-9 for r in rows), rows


# -- a run that fails after its ranks started ----------------------------------------------------
def rank_one_raises(config: Any, progress_path: str | None = None) -> Any:
    """A bench's rank function: rank 1 raises, rank 0 waits for it in a barrier."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


def _run_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of a command that started and failed: status 1, no traceback."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"tokenring {argv[0]}: error: "), err
    assert not any("error:" in line for line in lines[:-1]), err
    return lines[-1]


SMALL_BENCH = ["bench", "--world-size", "2", "--seq", "16", "--heads", "2", "--kv-heads", "2"]
SMALL_BENCH += ["--head-dim", "8", "--strategies", "ring", "--causal", "yes", "--passes", "fwd"]


def test_a_failing_rank_is_one_line_naming_it_and_its_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that raises ends the command with status 1 and one line naming the rank that
    failed first and its error (the launcher's traceback, with the rank's inside its message,
    reached the user)."""
    monkeypatch.setattr("tokenring.cli.bench.run_rank", rank_one_raises)
    line = _run_error([*SMALL_BENCH, "--timeout", "120"], capsys)
    assert "rank 1 failed first" in line and "ValueError: rank one refuses" in line, line
    assert "rank_one_raises" in line, line  # where it was raised


def test_a_run_past_its_timeout_is_one_line_with_the_timeout_as_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--timeout 1.5 that passes: status 1 and one line that names --timeout 1.5 (the
    launcher said "deadline of 2 s" for 2.5)."""
    line = _run_error([*SMALL_BENCH, "--iters", "1000000", "--timeout", "1.5"], capsys)
    assert "deadline of 1.5 s passed" in line and "--timeout 1.5" in line, line
    assert "ranks [0, 1] had not finished" in line, line
