"""The command line's first screen (issue 15, item 6) and its start-up (issue 13): --help
without the commands' modules, help with defaults in groups, a bench table that fits 120
columns, honest planner verdicts."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import tokenring.cli.bench
import tokenring.cli.console
import tokenring.launch  # so sys.modules has it below (the package exports launch())
from tokenring.cli import main
from tokenring.cli.bench import (
    SCREEN_COLUMNS,
    BenchConfig,
    _planner_lines,
    _print_table,
    planner_verdict,
    results_table,
    run_rank,
)

HEAVY = [
    "tokenring.cli.bench",
    "tokenring.cli.bench_memory",
    "tokenring.cli.bench_inference",
    "tokenring.cli.demo",
]


def _modules_after(*argvs: list[str]) -> list[tuple[str, set[str]]]:
    """Run ``main(argv)`` for each argv, each in a fresh interpreter (all at once: they wait
    on nothing but their imports); each one's stdout and which HEAVY modules it imported."""
    codes = [
        "import json, sys\n"
        "from tokenring.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        for argv in argvs
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for code in codes
    ]
    found = []
    try:
        for argv, proc in zip(argvs, procs, strict=True):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{argv}: exit code {proc.returncode}\n{err}"
            *text, loaded = out.splitlines()
            found.append(("\n".join(text), set(json.loads(loaded))))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return found


def test_help_imports_no_command_module() -> None:
    """``tokenring --help`` lists the commands without importing their modules; a command's
    help imports that command only (and the library, which loads on first use: Note [Lazy
    package] in tokenring)."""
    top, simulate, bench = _modules_after(["--help"], ["simulate", "--help"], ["bench", "--help"])
    text, loaded = top
    assert "bench" in text and "simulate" in text and "demo" in text
    assert loaded == set(), loaded
    text, loaded = simulate
    assert "--world-size" in text
    assert loaded == set(), loaded  # simulate's module is the library's (the planner's)
    text, loaded = bench
    assert "--mode" in text
    assert "tokenring.cli.bench" in loaded and "tokenring.cli.demo" not in loaded


def _entry_point() -> tuple[str, str]:
    """The console script's module and function, as pyproject.toml declares them."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    match = re.search(r'^\[project\.scripts\]\ntokenring = "([\w.]+):(\w+)"', text, re.M)
    assert match is not None, "pyproject.toml declares no tokenring console script"
    return match[1], match[2]


def _imported_modules(importtime_log: str) -> set[str]:
    """The module names of ``python -X importtime``'s log (one line per module imported)."""
    lines = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", importtime_log, re.M)
    return set(lines)


@pytest.mark.parametrize("how", ["console-script", "python-m"])
def test_top_level_help_does_not_import_torch(how: str) -> None:
    """``tokenring --help`` and ``python -m tokenring --help``, run as a user runs them:
    every module they import, as the interpreter logs it, is torch-free (Note [Lazy
    package] in tokenring). Importing torch is most of a second or more."""
    if how == "console-script":  # what the installed script runs, from this tree
        module, function = _entry_point()
        launcher = ["-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
    else:
        launcher = ["-m", "tokenring"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *launcher, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "{demo,bench,simulate}" in done.stdout, done.stdout
    imported = _imported_modules(done.stderr)
    assert {"tokenring", "tokenring.cli", "argparse"} <= imported  # the log was read
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy"))
    assert not heavy, f"{len(heavy)} modules of torch and numpy, e.g. {heavy[:3]}"


def test_help_shows_defaults_in_groups_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    for group in ("ranks and shape (every mode):", "--mode attention:", "--mode memory:"):
        assert group in text
    assert "--mode decode, prefill-cached: --cached CACHED" in text
    assert "--head-dim HEAD_DIM head dimension D (default: 64)" in text
    assert "--iters ITERS timed calls per row (default: 5)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("(default: llama2-7b)") == 1  # said once, not twice
    assert "the machine and the simulator: --hardware" in text
    assert "output: --json" in text


# -- the bench table -----------------------------------------------------------------------------
def _row(model: str, strategy: str, pass_: str, ms: float, **extra: Any) -> dict[str, Any]:
    """A bench row with every field the table shows, at the widest realistic values."""
    return {
        "model": model,
        "causal": True,
        "strategy": strategy,
        "hybrid": "2x2 token_ring" if strategy == "hybrid" else None,
        "pass": pass_,
        "ms_median": ms,
        "ms_p10": 0.9 * ms,
        "ms_p90": 1.1 * ms,
        "ms_step_fwd": ms / 4,
        "ms_step_bwd": ms / 2,
        "travel_bytes_per_rank": 123.45e6,
        "return_bytes_per_rank": 67.89e6,
        "travel_MBps": 1234.5,
        "return_MBps": 987.6,
        "overlap_efficiency": 0.87,
        "pct_of_bound": 104.0,
        "model_ms": 0.8 * ms,
        "model_error_pct": 25.0,
        "max_error": 1.2e-6,
        "verified": True,
        **extra,
    }


SETTINGS = {
    "world_size": 4,
    "backend": "gloo",
    "device": "cpu",
    "seq": 131072,
    "batch": 1,
    "dtype": "bfloat16",
    "lab": {"topology": "switch", "rate_bits_per_s": 100e6},
    "link_probe_bytes_per_s": 11.9e6,
}
ROWS = [
    _row(model, strategy, pass_, 12345.6)
    for model in ("mha-8/8", "gqa-8/2")
    for strategy in ("token_ring", "ring", "bidir_ring", "ulysses", "allgather_kv", "hybrid")
    for pass_ in ("fwd", "fwd+bwd")
]


def _render(table: Any, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(table)
    return console.export_text().splitlines()


def test_bench_table_fits_120_columns_unless_wide() -> None:
    """At 120 columns the default table is what it is on any wider screen (nothing folded
    or cut) and no line is longer; --wide needs more."""
    narrow = results_table(ROWS, SETTINGS, wide=False)
    lines = _render(narrow, 120)
    assert max(len(line) for line in lines) <= 120
    assert lines == _render(narrow, 400)
    assert len(lines) > len(ROWS)  # every row is in it
    wide = _render(results_table(ROWS, SETTINGS, wide=True), 400)
    assert max(len(line) for line in wide) > 120
    assert "MB/s travel" in "\n".join(wide) and "MB/s travel" not in "\n".join(lines)


# -- planner verdicts (Note [Verdicts within noise]) -----------------------------------------------
def _measured(strategy: str, median: float, p10: float, p90: float, **extra: Any) -> dict:
    return {"strategy": strategy, "ms_median": median, "ms_p10": p10, "ms_p90": p90, **extra}


def test_a_pick_within_the_spread_is_not_a_miss() -> None:
    fastest = _measured("ring", 100.0, 90.0, 130.0)
    assert planner_verdict(fastest, fastest) == ("hit", "")
    assert planner_verdict(_measured("token_ring", 104.9, 100.0, 110.0), fastest)[0] == "hit"
    # 20 ms slower: more than 5%, less than the fastest's 40 ms spread
    verdict, why = planner_verdict(_measured("token_ring", 120.0, 118.0, 122.0), fastest)
    assert verdict == "noise" and "20.0 ms" in why and "40.0 ms" in why
    # the pick's own spread counts as well
    tight = _measured("ring", 100.0, 99.0, 101.0)
    assert planner_verdict(_measured("token_ring", 120.0, 100.0, 150.0), tight)[0] == "noise"
    # 41 ms slower than a 40 ms spread: a miss
    assert planner_verdict(_measured("token_ring", 141.0, 139.0, 143.0), fastest)[0] == "miss"


def test_a_miss_says_why_in_one_line() -> None:
    fastest = _measured("ring", 100.0, 98.0, 102.0, model_ms=90.0, model_error_pct=11.1)
    # the model with each strategy's own kernel rate ranks the fastest first: one rate per
    # pass is what misled the planner
    pick = _measured("ulysses", 150.0, 148.0, 152.0, model_ms=95.0, model_error_pct=57.9)
    verdict, why = planner_verdict(pick, fastest)
    assert verdict == "miss" and "\n" not in why
    assert "ranks ring first (90.0 vs 95.0 ms)" in why and "one rate per pass" in why
    # the model ranks the pick first too: name the row it is further off on
    pick = _measured("ulysses", 150.0, 148.0, 152.0, model_ms=80.0, model_error_pct=87.5)
    verdict, why = planner_verdict(pick, fastest)
    assert verdict == "miss" and "\n" not in why
    assert "prices ulysses at 80.0 ms, measured 150.0 ms (+88%)" in why
    pick = _measured("ulysses", 150.0, 148.0, 152.0, model_ms=140.0, model_error_pct=7.1)
    fastest_off = {**fastest, "model_ms": 200.0, "model_error_pct": -50.0}
    assert (
        "prices ring at 200.0 ms, measured 100.0 ms (-50%)" in planner_verdict(pick, fastest_off)[1]
    )


def test_the_verdict_lines_fit_the_screen_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A miss's reason is long: under the table it folds to 120 columns, every word kept."""
    group = {"model": "mha-8/8", "causal": True, "pass": "fwd+bwd", "planner_pick": "ulysses"}
    fastest = _measured("ring", 100.0, 98.0, 102.0, model_ms=90.0, model_error_pct=11.1)
    pick = _measured("ulysses", 150.0, 148.0, 152.0, model_ms=95.0, model_error_pct=57.9)
    rows = [
        {**_row("mha-8/8", r["strategy"], "fwd+bwd", r["ms_median"]), **group, **r}
        for r in (fastest, pick)
    ]
    whole = _planner_lines(rows)
    assert max(len(line) for line in whole) > SCREEN_COLUMNS  # the case this is about
    _print_table(rows, SETTINGS, wide=False)
    printed = capsys.readouterr().out.splitlines()
    verdicts = printed[printed.index(next(x for x in printed if x.startswith("auto ("))) :]
    assert max(len(line) for line in verdicts) <= SCREEN_COLUMNS
    assert " ".join(" ".join(verdicts).split()) == " ".join(" ".join(whole).split())


# -- progress and refused combinations -----------------------------------------------------------
class _Started(Exception):
    pass


def test_demo_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo launches its ranks behind a progress bar of one unit per strategy, fed by
    the rows the ranks finish (the launch is stubbed: it reports two rows and stops)."""
    bars: list[Any] = []
    real_progress = tokenring.cli.console.progress

    def recording_progress(total: int, description: str) -> Any:
        bars.append(real_progress(total, description))
        return bars[-1]

    def two_rows_then_stop(fn: Any, config: Any, progress_path: str, **kwargs: Any) -> Any:
        assert fn is run_rank
        with open(progress_path, "w") as f:
            f.write("row\nrow\n")
        kwargs["poll"]()
        raise _Started

    monkeypatch.setattr("tokenring.cli.ranks.progress", recording_progress)
    monkeypatch.setattr("tokenring.cli.ranks.launch", two_rows_then_stop)
    with pytest.raises(_Started):
        main(["demo", "--world-size", "2", "--seq", "32"])
    (bar,) = bars
    (task,) = bar.tasks
    assert task.total == len(BenchConfig(seq=32).strategies) and task.completed == 2


@pytest.mark.parametrize("flag", ["--plot", "--trace", "--wide"])
def test_attention_outputs_in_other_modes_are_refused(
    flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    value = [] if flag == "--wide" else [str(tmp_path / "x")]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--mode", "memory", flag, *value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{flag} is for --mode attention; got --mode memory" in error


def test_a_link_is_refused_for_the_memory_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """Peak memory does not depend on the link: --link there would be ignored, so it raises."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--mode", "memory", "--link", "100mbit"])
    assert exit_info.value.code == 2
    assert "--link is for --mode attention, decode or prefill-cached" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-local", "8"], "--seq-local is for --mode memory; got --mode attention"),
        (["--device", "cpu"], "--device is for --mode memory; got --mode attention"),
        (
            ["--cached", "64"],
            "--cached is for --mode decode or prefill-cached; got --mode attention",
        ),
        (["--mode", "decode", "--seq", "64"], "--seq is for --mode attention; got --mode decode"),
        (
            ["--mode", "prefill-cached", "--strategies", "ring"],
            "--strategies is for --mode attention or memory; got --mode prefill-cached",
        ),
        (
            ["--mode", "memory", "--iters", "3"],
            "--iters is for --mode attention, decode or prefill-cached; got --mode memory",
        ),
        (["--mode", "memory", "--layout", "zigzag"], "--layout is for --mode attention"),
        (["--topology", "ring"], "--topology is for the emulated links; got --topology ring"),
    ],
)
def test_an_option_the_mode_does_not_read_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every option reaches the run or raises: one that --mode would drop is an error."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_decode_bench_keeps_a_warmup_of_zero() -> None:
    from tokenring.cli import bench_inference

    parser = argparse.ArgumentParser()
    tokenring.cli.bench.add_arguments(parser)
    args = parser.parse_args(["--mode", "decode", "--warmup", "0", "--cached", "64"])
    assert bench_inference.config_from_args(args).warmup == 0


def test_the_torch_floor_reads_the_installed_version() -> None:
    import tokenring

    assert tokenring._installed_torch() == torch.__version__  # the floor: test_packaging


def test_every_public_name_is_exported() -> None:
    import tokenring

    for name in tokenring.__all__:
        assert getattr(tokenring, name) is not None, name
    assert callable(tokenring.launch)  # the function, not the submodule of the same name
