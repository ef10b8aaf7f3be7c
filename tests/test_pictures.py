"""Profiling and pictures (issue 15, item 5): named ranges in torch.profiler traces, the
timeline as a Chrome/Perfetto trace, the PNG's legend and ticks, and the simulator's bars.
The figures are checked through their matplotlib objects, not their pixels."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from matplotlib.container import BarContainer

import tokenring
from tokenring.cli import main
from tokenring.cli.plot import COLOURS, curves_figure, timeline_figure, write_trace
from tokenring.runtime.comm import Event


# -- named ranges in torch.profiler --------------------------------------------------------------
def _profiled_names(strategies: list[str]) -> dict[str, list[str]]:
    """On each rank: profile one forward and backward call per strategy; the names of the
    profiler's events that start with ``tokenring.``."""
    torch.manual_seed(0)
    names = {}
    for strategy in strategies:
        q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            out = tokenring.sequence_parallel_attn(q, k, v, causal=True, strategy=strategy)
            out.sum().backward()
        names[strategy] = sorted({e.name for e in prof.events() if e.name.startswith("tokenring.")})
    return names


def test_every_step_is_a_named_range_in_the_profiler() -> None:
    """P = 2: each ring strategy's forward and backward steps 0 and 1 (a rank computes P
    blocks, one per step at least) appear as ``tokenring.<strategy>.<pass>.step<t>``; the
    collectives' one step as ``step0``."""
    world_size = 2
    steps = {"token_ring": 2, "ring": 2, "bidir_ring": 2, "ulysses": 1, "allgather_kv": 1}
    per_rank = tokenring.launch(_profiled_names, list(steps), world_size=world_size, timeout_s=240)
    for names in per_rank:
        for strategy, num_steps in steps.items():
            got = names[strategy]
            pattern = rf"tokenring\.{strategy}\.(forward|backward)\.step(\d+)"
            assert all(re.fullmatch(pattern, name) for name in got), got
            for pass_ in ("forward", "backward"):
                for step in range(num_steps):
                    assert f"tokenring.{strategy}.{pass_}.step{step}" in got, (strategy, got)


# -- Chrome / Perfetto trace ---------------------------------------------------------------------
def _lanes(backward: bool) -> list[list[Event]]:
    """Two ranks' hand-made timelines: compute, merges, and transfers both ways."""
    lanes = []
    for rank in range(2):
        peer = 1 - rank
        events = [
            Event("compute", "attn", 0, 0.000, 0.004),
            Event("send", "q", 0, 0.004, 0.004, peer, 1024),
            Event("recv", "q", 1, 0.004, 0.007, peer, 1024),
            Event("compute", "attn", 1, 0.007, 0.011),
            Event("recv", "out", 1, 0.011, 0.013, peer, 2048),
            Event("merge", "merge", 1, 0.013, 0.0135),
        ]
        if backward:
            events += [
                Event("compute", "attn_bwd", 0, 0.014, 0.020),
                Event("recv", "dq", 0, 0.020, 0.023, peer, 512),
            ]
        lanes.append([replace_start(ev, 0.001 * rank) for ev in events])
    return lanes


def replace_start(ev: Event, shift_s: float) -> Event:
    return Event(
        ev.kind, ev.label, ev.step, ev.start_s + shift_s, ev.end_s + shift_s, ev.peer, ev.num_bytes
    )


def test_the_trace_has_one_event_per_recorded_event(tmp_path: Path) -> None:
    panels = [("token_ring fwd", _lanes(False)), ("ring fwd+bwd", _lanes(True))]
    path = tmp_path / "trace.json"
    write_trace(panels, str(path))
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "call"]
    recorded = [(rank, ev) for _, lanes in panels for rank, evs in enumerate(lanes) for ev in evs]
    assert len(spans) == len(recorded)
    lane_names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    offset_us = 0.0
    for index, (span, (rank, ev)) in enumerate(zip(spans, recorded, strict=True)):
        if index == len(_lanes(False)[0]) * 2:  # the second panel starts after the first
            offset_us = 1e6 * (max(e.end_s for evs in panels[0][1] for e in evs) + 1e-3)
        assert span["pid"] == rank and span["name"] == ev.label and span["cat"] == ev.kind
        assert span["ts"] == pytest.approx(offset_us + 1e6 * ev.start_s)
        assert span["dur"] == pytest.approx(1e6 * (ev.end_s - ev.start_s))
        assert span["args"] == {"step": ev.step, "peer": ev.peer, "num_bytes": ev.num_bytes}
        lane = "compute" if ev.kind in ("compute", "merge") else f"{ev.label} {ev.kind}"
        assert lane_names[(span["pid"], span["tid"])] == lane
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "call"]
    assert [(c["name"], c["pid"]) for c in calls] == [
        (title, rank) for title, _ in panels for rank in range(2)
    ]


def test_simulate_writes_the_simulated_timeline_as_a_trace(tmp_path: Path) -> None:
    from tokenring.cli.models import KNOWN_MODELS
    from tokenring.model.costmodel import PRESETS
    from tokenring.model.simulate import simulate

    path = tmp_path / "sim.json"
    argv = ["simulate", "--world-size", "4", "--seq", "8192", "--strategies", "token_ring"]
    assert main([*argv, "--json", "--trace", str(path)]) == 0
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    preset = KNOWN_MODELS["llama2-7b"]

    result = simulate(
        "token_ring",
        passes="forward",
        layout="zigzag",
        causal=preset.causal,
        world_size=4,
        seq_local=8192 // 4,
        shape=dataclasses.replace(preset.shape, batch=1, dtype="bfloat16"),
        hardware=PRESETS["h100-nvswitch"],
    )
    (timeline,) = (p.timeline for p in result.passes)
    assert timeline is not None
    recorded = [(r, ev) for r, events in enumerate(timeline) for ev in events]
    want = sorted((r, ev.label, round(1e6 * (ev.end_s - ev.start_s), 3)) for r, ev in recorded)
    got = sorted((e["pid"], e["name"], round(e["dur"], 3)) for e in spans if e["cat"] != "call")
    assert got == want


# -- the timeline PNG ------------------------------------------------------------------------------
def _legend(fig: Any) -> list[str]:
    (legend,) = fig.legends
    return [text.get_text() for text in legend.get_texts()]


def test_the_legend_shows_only_what_the_run_drew() -> None:
    fig = timeline_figure([("a fwd", _lanes(False)), ("b fwd", _lanes(False))], "title")
    assert _legend(fig) == ["attn", "merge", "q", "out"]  # no backward series
    fig = timeline_figure([("a fwd+bwd", _lanes(True))], "title")
    assert _legend(fig) == ["attn", "attn_bwd", "merge", "q", "out", "dq"]
    assert list(COLOURS)[:3] == ["attn", "attn_bwd", "merge"]  # the legend keeps this order


def test_every_panel_has_its_tick_labels() -> None:
    fig = timeline_figure([("a fwd", _lanes(False)), ("b fwd", _lanes(False))], "title")
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert len(ticks) >= 2, ax.get_title()
        lanes = [t.get_text() for t in ax.get_yticklabels()]
        assert lanes == [
            f"rank {r} {lane}" for r in (0, 1) for lane in ("compute", "out in", "q in")
        ]
        assert min(t.get_fontsize() for t in ax.get_yticklabels()) >= 8
        assert ax.get_xlabel()


# -- simulate --plot -----------------------------------------------------------------------------
def _sim_row(strategy: str, seq: int, call_ms: float) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "seq": seq,
        "world_size": 8,
        "call_ms": call_ms,
        "model": "llama2-7b",
        "hardware": "h100-nvswitch",
        "layout": "zigzag",
        "pass": "forward",
    }


def test_several_world_sizes_draw_one_line_per_strategy() -> None:
    """Along P, one line per strategy: not broken where the layout rounds S down differently
    per P (100 -> 96 at P = 4 and 8 for zigzag), nor where the hybrid's factorisation (P/inner
    x inner) changes with P."""
    rows = []
    for world_size, seq in ((2, 100), (4, 96), (8, 96)):
        rows.append({**_sim_row("ring", seq, world_size), "world_size": world_size})
        if world_size >= 4:
            hybrid = f"hybrid {world_size // 4}x4 token_ring"
            rows.append({**_sim_row(hybrid, seq, world_size / 2), "world_size": world_size})
    for row in rows:
        row["seq_requested"] = 100
    (ax,) = curves_figure(rows).axes
    xs = {line.get_label(): list(line.get_xdata()) for line in ax.lines}
    assert xs == {"hybrid (P/4)x4 token_ring (S=100)": [4, 8], "ring (S=100)": [2, 4, 8]}


def test_one_length_draws_bars_relative_to_the_best() -> None:
    rows = [_sim_row("ring", 4096, 30.0), _sim_row("token_ring", 4096, 20.0)]
    rows.append(_sim_row("bidir_ring", 4096, 25.0))
    fig = curves_figure(rows)
    (ax,) = fig.axes
    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["token_ring", "bidir_ring", "ring"]
    assert [b.get_height() for b in bars] == pytest.approx([1.0, 25 / 20, 30 / 20])
    assert [t.get_text() for t in ax.texts] == ["20 ms", "25 ms", "30 ms"]
    assert "token_ring" in ax.get_ylabel() and "P=8 S=4096" in ax.get_title()


def test_several_lengths_draw_one_line_per_strategy() -> None:
    rows = [_sim_row(s, seq, seq / 100) for s in ("ring", "token_ring") for seq in (4096, 8192)]
    (ax,) = curves_figure(rows).axes
    assert not ax.containers
    assert [line.get_label() for line in ax.lines] == ["ring (P=8)", "token_ring (P=8)"]
    assert [list(line.get_xdata()) for line in ax.lines] == [[4096, 8192]] * 2
