"""Audit of the user-facing tools: the ``tokenring`` command line and the planner's inputs.

Every case is in-process (``main(argv)``) or a pure function; expected values come from the
library's own simulator called directly, from the functions' documented contracts, or from the
errors the contracts promise (naming the argument, the value and what was expected).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokenring
import tokenring.cli as cli
from test_cli import _usage_error
from tokenring import get_communicator, launch
from tokenring.cli import bench_inference, main
from tokenring.cli.models import KNOWN_MODELS
from tokenring.core.schedule import AttentionShape
from tokenring.model.costmodel import PRESETS, load_kernel_rates, measured
from tokenring.model.planner import explain_cached
from tokenring.model.simulate import simulate
from tokenring.runtime import comm
from tokenring.strategies.cached import CachedStrategy
from tokenring.strategies.hybrid import HybridSpec
from tokenring.strategies.ring import LEND_MAX_WORLD_SIZE


def _simulate_rows(argv: list[str]) -> list[dict[str, Any]]:
    """``tokenring simulate ... --json``'s rows (status 0 asserted)."""
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["simulate", *argv, "--json"])
    assert status == 0, argv
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


# -- simulate: the hybrid's rows -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "inner", "outer"),
    [(2, 2, "token_ring"), (4, 1, "token_ring"), (4, 1, "ring"), (8, 2, "bidir_ring")],
)
def test_simulate_reports_the_hybrid_whose_steps_outnumber_its_ranks(
    world_size: int, inner: int, outer: str
) -> None:
    """A hybrid pass has its inner all-to-alls' steps beside the outer ring's, more steps than
    ranks: ``transfer_ms`` sized its per-step list by the world size and the command ended in
    an IndexError traceback (``--world-size 2 --strategies hybrid --hybrid-inner 2``)."""
    argv = ["--world-size", str(world_size), "--seq", "64", "--strategies", "hybrid"]
    rows = _simulate_rows([*argv, "--hybrid-inner", str(inner), "--hybrid-outer", outer])
    model = KNOWN_MODELS["llama2-7b"]
    want = simulate(
        "hybrid",
        passes="forward",
        layout="zigzag",
        causal=True,
        world_size=world_size,
        seq_local=64 // world_size,
        shape=model.shape,
        hardware=PRESETS["h100-nvswitch"],
        hybrid=HybridSpec(inner=inner, outer_strategy=outer),
    )
    (row,) = rows
    first = want.passes[0]
    assert row["call_ms"] == pytest.approx(1e3 * want.call_s, rel=1e-12)
    assert len(row["step_ms"]) == len(first.step_s)
    for label, per_step in row["transfer_ms"].items():
        assert len(per_step) == len(first.step_s), label
        sends = [
            ev
            for events in first.timeline or ()
            for ev in events
            if ev.kind == "send" and ev.label == label
        ]
        longest = max(1e3 * (ev.end_s - ev.start_s) for ev in sends)
        assert max(per_step) == pytest.approx(longest, rel=1e-12)


# -- hardware descriptions: every bad field named --------------------------------------------------
RATES: dict[str, Any] = dict(
    forward_flops_per_s=1e12,
    backward_flops_per_s=1e12,
    link_bandwidth_bytes_per_s=1e9,
    memory_bandwidth_bytes_per_s=1e11,
    dtype="bfloat16",
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("forward_flops_per_s", "1e12"),  # a str from a config file: TypeError '>' ... 'str'
        ("forward_flops_per_s", None),
        ("forward_flops_per_s", True),  # accepted: 1 FLOP/s
        ("backward_flops_per_s", 1j),
        ("memory_bandwidth_bytes_per_s", [1e11]),
        ("link_bandwidth_bytes_per_s", "fast"),
        ("link_bandwidth_bytes_per_s", False),
        ("port_bandwidth_bytes_per_s", "22e9"),
        ("latency_s", "1e-5"),
        ("latency_s", True),  # accepted: one second per message
        ("kernel_call_s", "0"),
    ],
)
def test_measured_names_a_rate_that_is_not_a_number(field: str, value: object) -> None:
    said = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"^{field} must be a .*number.*; got {said}$"):
        measured(**{**RATES, field: value})


def test_measured_keeps_numpy_and_int_rates_as_floats() -> None:
    """A NumPy or int rate is a number: kept, as a float (so the description prints and
    compares as one)."""
    hw = measured(**{**RATES, "forward_flops_per_s": np.float64(2e12), "latency_s": np.int64(0)})
    assert type(hw.forward_flops_per_s) is float and hw.forward_flops_per_s == 2e12
    assert type(hw.interconnect.latency_s) is float
    assert hw == measured(**{**RATES, "forward_flops_per_s": 2e12})


A10 = PRESETS["a10-pcie"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        # accepted, then an AttributeError deep in the simulator ('dict' has no 'topology')
        (dict(interconnect={"topology": "mesh"}), ["interconnect must be an Interconnect"]),
        (dict(interconnect=None), ["interconnect must be an Interconnect", "None"]),
        (dict(devices_per_node=2, inter={"x": 1}), ["inter must be an Interconnect or None"]),
        # 2.5 devices per island and True (1) were accepted
        (dict(devices_per_node=2.5, inter=A10.interconnect), ["devices_per_node", "2.5"]),
        (dict(devices_per_node=True, inter=A10.interconnect), ["devices_per_node", "True"]),
        # a lone name was read letter by letter: "dtype must be one of ...; got 'b'"
        (dict(dtypes="bfloat16"), ["dtypes must be a sequence", "'bfloat16'"]),
        (dict(name=None), ["name must be a str", "None"]),
        (dict(name=5), ["name must be a str", "5"]),
    ],
)
def test_hardware_names_a_field_of_the_wrong_kind(fields: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        dataclasses.replace(A10, **fields)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("bad", ["true", "Infinity", "NaN", "0", '"336"'])
def test_kernel_rates_files_name_a_rate_that_is_not_a_finite_number(
    bad: str, tmp_path: Path
) -> None:
    """``true`` read as 1 TFLOP/s and ``Infinity`` passed the file's check (then the preset
    said ``forward_flops_per_s ... got inf`` without the file)."""
    path = tmp_path / "rates.json"
    full = '{"forward_tflops": ' + bad + ', "backward_tflops": 250}'
    path.write_text('{"rates": {"bfloat16": {"full": ' + full + ', "causal": ' + full + "}}}")
    with pytest.raises(ValueError, match=r"rates\['bfloat16'\]\['full'\] must give .*finite"):
        load_kernel_rates(path)


# -- explain_cached: its candidates ----------------------------------------------------------------
CACHED: dict[str, Any] = dict(
    world_size=2, cached=128, new=1, heads_q=8, heads_kv=8, head_dim=64, hardware="a10-pcie"
)


@pytest.mark.parametrize(
    ("candidates", "said"),
    [
        # a lone name was read letter by letter: "strategy must be one of ...; got 'p'"
        ("pass_q", r"candidates must be a sequence of strategies or None; got 'pass_q'"),
        (CachedStrategy.TREE, r"candidates must be a sequence .*; got <CachedStrategy\.TREE"),
        # "strategy must be one of 'pass_q', ..., 'tree' or 'auto'; got 'auto'"
        (["pass_q", "auto"], r"each of candidates must be one of 'pass_q', .*'tree'; got 'auto'$"),
    ],
)
def test_explain_cached_names_candidates_that_are_not_a_list_of_strategies(
    candidates: Any, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        explain_cached(**CACHED, candidates=candidates)
    assert explain_cached(**CACHED, candidates=["tree", "direct"]).pick in (
        CachedStrategy.TREE,
        CachedStrategy.DIRECT,
    )


# -- bench --mode decode: the pick it scores -------------------------------------------------------
def test_decode_bench_picks_among_the_strategies_it_runs(single_rank_group: None) -> None:
    """``--cached-strategies tree`` on one rank (every plan alike: auto's tie goes to pass_q):
    the row said "auto picks pass_q; measured fastest tree; MISS", scoring a strategy it never
    ran. The pick is now among the strategies run, as the attention bench's planner's is."""
    config = bench_inference.InferenceBenchConfig(
        mode="decode",
        cached=(64,),
        new=(1,),
        models={"m": AttentionShape(heads_q=2, heads_kv=2, head_dim=8)},
        strategies=(CachedStrategy.TREE,),
        warmup=0,
        iters=1,
    )
    (row,) = bench_inference.aggregate([bench_inference.run_rank(config)], config)
    assert (row["strategy"], row["auto_pick"], row["fastest"]) == ("tree", "tree", "tree")
    assert row["pick_within_10pct"] and row["verified"]


# -- simulate --lend-last-pair beyond the ranks that lend -----------------------------------------
def test_simulate_says_where_lend_last_pair_cannot_lend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TokenRing lends its last pair up to LEND_MAX_WORLD_SIZE ranks (the runtime and the
    simulator alike); at 128 ranks --lend-last-pair predicted the plain tail without a word,
    the same numbers as without the flag. Refused where no world size lends; said in a note,
    and in each row's ``lend_last_pair``, where some do."""
    big = str(LEND_MAX_WORLD_SIZE + 1)  # 65: 520 tokens split into 130 zigzag chunks
    argv = ["simulate", "--strategies", "token_ring", "--lend-last-pair", "--seq", "520"]
    line = _usage_error([*argv, "--world-size", big], capsys)
    assert "--lend-last-pair" in line and big in line and str(LEND_MAX_WORLD_SIZE) in line, line
    rows = _simulate_rows([*argv[1:], "--world-size", "4", big])
    assert [(r["world_size"], r["lend_last_pair"]) for r in rows] == [(4, True), (int(big), False)]
    note = capsys.readouterr().err
    assert f"--lend-last-pair: at --world-size {big}" in note, note
    plain = _simulate_rows(["--strategies", "token_ring", "--seq", "520", "--world-size", "4"])
    assert plain[0]["lend_last_pair"] is False and plain[0]["call_ms"] != rows[0]["call_ms"]


# -- sizes and timeouts beyond what the run can take ----------------------------------------------
HUGE = str(10**400)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        # each ended in "OverflowError: int too large to convert to float", a traceback
        (["simulate", "--world-size", "2", "--seq", HUGE], "--seq"),
        (["simulate", "--world-size", "2", "--seq", "64", "--batch", HUGE], "--batch"),
        (["bench", "--world-size", "2", "--seq", HUGE], "--seq"),
        (["bench", "--world-size", "2", "--batch", HUGE], "--batch"),
        (["bench", "--mode", "decode", "--cached", f"64,{HUGE}"], "--cached"),
        # the ranks started, then each failed: "OverflowError: Python int too large to convert
        # to C int" (1e300), "timeout_s must be a finite number of seconds > 0; got 2500000000.0"
        (["demo", "--world-size", "2", "--timeout", "1e300"], "--timeout"),
        (["bench", "--world-size", "2", "--timeout", "1e10"], "--timeout"),
    ],
)
def test_sizes_and_timeouts_too_large_to_run_are_refused_before_anything_starts(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(argv, capsys)
    assert flag in line and ("2**63" in line or "1e+07" in line), line


def test_the_cli_timeout_limit_is_the_communicators(single_rank_group: None) -> None:
    """The CLI's limit is the communicator's (the CLI imports no torch for --help); launch and
    get_communicator refuse a timeout beyond it before any rank or group uses it."""
    assert cli.MAX_TIMEOUT_S == comm.MAX_TIMEOUT_S
    with pytest.raises(
        ValueError, match=r"pg_timeout_s must be a finite number > 0; got 2500000000\.0 .*1e7"
    ):
        launch(_never_run, world_size=2, timeout_s=60, pg_timeout_s=2.5e9)
    too_long = r"timeout_s must be a finite number > 0; got 10000000000\.0 .*1e7"
    with pytest.raises(ValueError, match=too_long):
        get_communicator(timeout_s=1e10)


def _never_run() -> None:
    raise AssertionError("launch started a rank")


# -- explain: its plain data says what it priced ---------------------------------------------------
def test_explain_as_dict_says_whether_token_ring_was_priced_lending() -> None:
    """last_pair="lend" (or "auto" choosing to lend) prices TokenRing with its last pair lent,
    a different time; ``as_dict`` (the JSON form) dropped which, so two plans of different
    TokenRing times read alike apart from the number."""
    kw: dict[str, Any] = dict(
        world_size=4, seq_local=256, heads_q=8, heads_kv=8, head_dim=64, dtype="bfloat16"
    )
    kw |= dict(causal=True, layout="zigzag", hardware="a10-pcie", strategies=["token_ring"])
    for last_pair, lends in (("lend", True), ("return", False)):
        plan = tokenring.explain(**kw, last_pair=last_pair)
        (data,) = json.loads(json.dumps(plan.as_dict()))["predictions"]
        assert plan.predictions[0].lends_last_pair is lends
        assert data["lends_last_pair"] is lends and data["total_s"] == plan.predictions[0].total_s


@pytest.mark.parametrize("world_size", ["100000", "99999999999999"])
def test_simulate_refuses_a_vectorised_replay_of_hours(
    world_size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The vectorised engine replays P^2 (rank, step) cells: --world-size 100000 ran for hours
    (99999999999999: for ever) with nothing on the screen; refused before simulating, with the
    estimate."""
    argv = ["simulate", "--world-size", world_size, "--seq", str(2 * int(world_size))]
    line = _usage_error(argv, capsys)
    assert f"--world-size {world_size}" in line and "cells" in line and "at most" in line, line
