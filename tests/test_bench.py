"""``tokenring bench`` and ``tokenring demo`` in-process on a tiny shape with 2 ranks."""

from __future__ import annotations

import json

import pytest

from tokenring import Strategy
from tokenring.cli import main
from tokenring.model.netlab import lab_unavailable_reason

TINY = [
    "--world-size",
    "2",
    "--seq",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
    "--warmup",
    "0",
    "--iters",
    "2",
]


def test_bench_json_rows_cover_the_grid(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    plot = tmp_path / "timeline.png"
    md = tmp_path / "table.md"
    trace = tmp_path / "timeline.json"
    argv = ["bench", *TINY, "--json", "--plot", str(plot), "--markdown", str(md)]
    status = main([*argv, "--trace", str(trace)])
    assert status == 0
    rows = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    # every strategy (the hybrid as 1 x 2 on 2 ranks) x 2 causal settings x 2 passes, every
    # row verified against float64 and predicted by the model
    strategies = [s.value for s in Strategy]
    assert len(rows) == 4 * len(strategies)
    assert {(r["strategy"], r["causal"], r["pass"]) for r in rows} == {
        (s, c, p) for s in strategies for c in (True, False) for p in ("fwd", "fwd+bwd")
    }
    for row in rows:
        assert row["verified"] and row["max_error"] <= row["tolerance"]
        assert row["world_size"] == 2 and row["torch"] and row["git_sha"]
        assert row["ms_p10"] <= row["ms_median"] <= row["ms_p90"] <= row["ms_max"]
        assert row["model_ms"] > 0 and row["planner_pick"] in strategies
        if row["strategy"] in (
            "token_ring",
            "ring",
            "bidir_ring",
            "bidir_token_ring",
        ):  # compute-only runs
            assert row["pct_of_bound"] > 0
        assert row["hybrid"] == ("1x2 token_ring" if row["strategy"] == "hybrid" else None)
        assert row["layout"] == ("zigzag" if row["causal"] else "contiguous")
    ring_fwd = next(r for r in rows if r["strategy"] == "ring" and r["pass"] == "fwd")
    assert ring_fwd["return_bytes_per_rank"] == 0 < ring_fwd["travel_bytes_per_rank"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    # the same panels as a trace: one call per strategy and rank, the ranks' steps inside
    events = json.loads(trace.read_text())["traceEvents"]
    calls = [e for e in events if e["ph"] == "X" and e["cat"] == "call"]
    assert sorted((c["name"].split()[0], c["pid"]) for c in calls) == sorted(
        (s, rank) for s in strategies for rank in (0, 1)
    )
    computed = [e for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert {e["pid"] for e in computed} == {0, 1} and all(e["dur"] > 0 for e in computed)
    text = md.read_text()
    assert "Reproduce with" in text and text.count("\n| ") == 1 + len(rows)
    assert "| hybrid 1x2 token_ring |" in text


def test_bench_of_some_strategies_plans_among_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Without the hybrid in --strategies the planner is not handed the hybrid's spec (it
    raises when its strategies leave the hybrid out) and picks among the rows run."""
    argv = ["bench", *TINY, "--strategies", "token_ring,ring", "--causal", "yes", "--json"]
    status = main([*argv, "--passes", "fwd", "--last-pair", "lend"])
    assert status == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["strategy"] for r in rows) == ["ring", "token_ring"]
    assert {r["planner_pick"] for r in rows} <= {"ring", "token_ring"}
    assert [r["last_pair"] for r in rows if r["strategy"] == "token_ring"] == ["lend"]


def test_bench_runs_ulysses_with_fewer_heads_than_ranks(capsys) -> None:
    """A rank Ulysses gives no heads has no kernel calls to time (it once failed to build a
    0-head shape in its compute-only run, after the ranks had launched)."""
    argv = ["bench", *TINY, "--heads", "1", "--kv-heads", "1", "--strategies", "ulysses"]
    assert main([*argv, "--causal", "no", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(rows) == 2 and all(r["verified"] for r in rows)


def test_the_exposed_tail_is_the_last_message_the_call_sent() -> None:
    """A row's exposed bytes (its bound's transfer nothing overlaps) are those of the last
    return message its own call posted, as the call's timeline recorded it: on gloo's
    shared memory TokenRing returns its last block in one slice, and the bound once took the
    schedule of two (half the bytes) for every row."""
    from tokenring.cli.bench import BenchConfig, run_rank
    from tokenring.core.schedule import AttentionShape
    from tokenring.launch import launch

    config = BenchConfig(
        seq=64,
        models={"m": AttentionShape(heads_q=2, heads_kv=2, head_dim=8)},
        strategies=(Strategy.TOKEN_RING, Strategy.BIDIR_TOKEN_RING),
        causal=(True, False),
        passes=("fwd",),
        warmup=0,
        iters=1,
    )
    per_rank = launch(run_rank, config, world_size=2, timeout_s=120)
    for result in per_rank:
        for row in result["rows"]:
            returned = [ev for ev in row.events if ev.kind == "send" and ev.label == "out"]
            last = max(returned, key=lambda ev: ev.start_s)
            assert row.exposed_bytes == {last.peer: last.num_bytes}, (row.strategy, row.causal)


def test_bench_table_and_failed_verification_exit(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", *TINY, "--causal", "yes", "--passes", "fwd", "--tolerance", "0"])
    out = capsys.readouterr().out
    assert status == 1  # float32 can never match float64 exactly: every row is flagged
    assert "WRONG" in out and f"VERIFICATION FAILED for {len(Strategy)} row(s)" in out
    assert "token_ring" in out and "% bound" in out


def test_bench_json_stdout_is_rows_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--json: every stdout line is one JSON row (what `| jq` reads); the failed
    verification goes to stderr (the note of no hybrid rows too: test_cli), status 1."""
    argv = ["bench", *TINY, "--causal", "yes", "--passes", "fwd", "--tolerance", "0"]
    assert main([*argv, "--strategies", "token_ring,ring", "--json"]) == 1
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["strategy"] for r in rows] == ["token_ring", "ring"]
    assert "VERIFICATION FAILED for 2 row(s)" in captured.err


def test_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "demo",
                "--world-size",
                "2",
                "--seq",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "8",
                "--iters",
                "1",
            ]
        )
        == 0
    )
    assert "token_ring" in capsys.readouterr().out


@pytest.mark.lab
@pytest.mark.skipif(lab_unavailable_reason() is not None, reason=str(lab_unavailable_reason()))
def test_bench_in_the_lab_moves_the_counted_bytes_at_the_link_rate(capsys) -> None:
    """Ring forward, 2 ranks, 100 Mbit/s: the call takes about its bytes / rate (wide
    margin)."""
    status = main(
        [
            "bench",
            *TINY[:2],
            "--seq",
            "2048",
            "--heads",
            "8",
            "--kv-heads",
            "8",
            "--head-dim",
            "64",
            "--causal",
            "no",
            "--passes",
            "fwd",
            "--strategies",
            "ring",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--link",
            "100mbit",
            "--json",
        ]
    )
    assert status == 0
    (row,) = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    assert row["lab"]["topology"] == "mesh"
    wire_s = row["busiest_link_bytes"] * 8 / 100e6
    assert 0.8 * wire_s <= row["ms_median"] / 1e3 <= 2.0 * wire_s + 0.5


@pytest.mark.lab
@pytest.mark.skipif(lab_unavailable_reason() is not None, reason=str(lab_unavailable_reason()))
def test_decode_bench_in_the_lab_prices_the_labs_topology(capsys) -> None:
    """The calibration takes the lab's --topology as attention mode does (its probes can tell
    a switch from a mesh, never a ring: the predictions were of a mesh)."""
    argv = ["bench", "--mode", "decode", "--world-size", "3", "--cached", "37", "--new", "1"]
    argv += ["--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--block-size", "4"]
    argv += ["--iters", "1", "--warmup", "0", "--link", "1gbit", "--topology", "ring", "--json"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert rows and {(r["lab"]["topology"], r["calibration"]["topology"]) for r in rows} == {
        ("ring", "ring")
    }


def test_bench_under_torchrun_uses_the_launchers_ranks() -> None:
    """``torchrun ... -m tokenring bench``: no spawning of its own; rank 0 prints the rows."""
    import subprocess
    import sys

    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tokenring",
        "bench",
        "--seq",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--causal",
        "yes",
        "--passes",
        "fwd",
        "--strategies",
        "token_ring,ring",
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["strategy"] for r in rows] == ["token_ring", "ring"]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" and r["verified"] for r in rows)
