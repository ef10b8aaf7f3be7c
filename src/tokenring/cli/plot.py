"""Timeline pictures and traces: per rank, per step, compute and each flow on a time axis.

The same pictures for measured runs (``tokenring bench --plot/--trace``: events recorded by the
runtime) and simulated ones (``tokenring simulate --timeline/--trace``), and the simulator's
curves (``simulate --plot``). matplotlib is imported lazily (the ``plot`` extra). A receive bar
spans from its posting to when the rank saw it complete: a late end may be the rank's wait.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenring.runtime.comm import Event

__all__ = [
    "COLOURS",
    "bench_panels",
    "curves_figure",
    "draw_timeline_lanes",
    "plot_timelines",
    "pyplot",
    "timeline_figure",
    "timeline_trace",
    "write_figure",
    "write_trace",
]

COLOURS = {
    "attn": "#4477aa",
    "attn_bwd": "#223f66",
    "merge": "#999999",
    "q": "#ee6677",
    "kv": "#228833",
    "out": "#ccbb44",
    "q_grad": "#aa3377",
    "dq": "#66ccee",
    "dkv": "#bbbbbb",
}
_OTHER = "#777777"

Panel = tuple[str, Sequence[Sequence[Event]]]
"""(title, events of each rank): one strategy's pass, one lane group per rank."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only); ImportError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'tokenring-attention[plot]'") from exc
    return plt


def _rows(events: Sequence[Event]) -> list[str]:
    """A rank's lanes: compute (with merges), then one per incoming flow."""
    return ["compute", *sorted({ev.label for ev in events if ev.kind == "recv"})]


def draw_timeline_lanes(ax: Any, lanes: Sequence[Sequence[Event]], title: str) -> set[str]:
    """Draw one strategy: for each rank a compute lane and a lane per incoming flow.

    Returns:
        The labels drawn (what the legend should show: a forward-only run has no backward).
    """
    labels: list[str] = []
    ticks: list[float] = []
    drawn: set[str] = set()
    y = 0.0
    for rank, events in enumerate(lanes):
        for row in _rows(events):
            for ev in events:
                is_compute = ev.kind in ("compute", "merge") and row == "compute"
                if not (is_compute or (ev.kind == "recv" and ev.label == row)):
                    continue
                colour = COLOURS.get(ev.label, _OTHER)
                bar = dict(height=0.8, color=colour, edgecolor="black", linewidth=0.3)
                ax.barh(y, 1e3 * (ev.end_s - ev.start_s), left=1e3 * ev.start_s, **bar)
                drawn.add(ev.label)
                if ev.kind == "compute":
                    ax.text(1e3 * ev.start_s, y, f" {ev.step}", va="center", fontsize=7)
            labels.append(f"rank {rank} {'compute' if row == 'compute' else row + ' in'}")
            ticks.append(y)
            y += 1
        y += 0.5
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the call started (each rank's own clock)", fontsize=9)
    ax.tick_params(axis="x", labelbottom=True, labelsize=8)  # on every panel, shared or not
    ax.set_title(title, fontsize=10)
    return drawn


def timeline_figure(panels: Sequence[Panel], title: str) -> Any:
    """One panel per strategy's pass, a shared time axis with its ticks on every panel, and
    a legend of the labels that occur (numbers on compute bars are steps)."""
    plt = pyplot()
    num_lanes = sum(len(_rows(events)) for _, lanes in panels for events in lanes)
    height = 1.4 + 0.28 * num_lanes + 0.9 * len(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, height), squeeze=False, sharex=True)
    drawn: set[str] = set()
    for ax, (panel_title, lanes) in zip(axes[:, 0], panels, strict=True):
        drawn |= draw_timeline_lanes(ax, lanes, panel_title)
    names = [name for name in COLOURS if name in drawn] + sorted(drawn - set(COLOURS))
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(n, _OTHER)) for n in names]
    fig.suptitle(title, fontsize=10, y=0.995)
    where = dict(loc="upper center", bbox_to_anchor=(0.5, 0.975), frameon=False)
    fig.legend(handles, names, fontsize=9, ncol=max(1, len(names)), **where)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def write_figure(fig: Any, path: str, *, dpi: int = 110) -> None:
    """Save a figure as PNG and free it."""
    plt = pyplot()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def bench_panels(per_rank: list[dict[str, Any]], config: Any) -> list[Panel]:
    """One panel per strategy (its fwd+bwd row, else fwd) of the first model and causality."""
    rows = per_rank[0]["rows"]
    model, causal = next(iter(config.models)), config.causal[0]
    wanted = "fwd+bwd" if "fwd+bwd" in config.passes else "fwd"
    return [
        (
            f"{row.strategy} {row.pass_} {model} causal={causal}",
            [r["rows"][index].events for r in per_rank],
        )
        for index, row in enumerate(rows)
        if row.model == model and row.causal == causal and row.pass_ == wanted
    ]


def plot_timelines(per_rank: list[dict[str, Any]], config: Any, path: str, *, title: str) -> None:
    """The PNG of ``tokenring bench --plot`` (panels: :func:`bench_panels`)."""
    write_figure(timeline_figure(bench_panels(per_rank, config), title), path)


# -- Chrome / Perfetto trace ---------------------------------------------------------------------
def timeline_trace(panels: Sequence[Panel], *, gap_s: float = 1e-3) -> dict[str, Any]:
    """The panels as a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev).

    One complete event (``ph`` "X", microseconds) per recorded event: ``pid`` is the rank,
    ``tid`` a lane (0: compute and merges; then one per flow and direction, named by
    ``thread_name`` metadata), ``args`` the step, peer and bytes. Panels follow one another
    on the time axis, ``gap_s`` apart (each timeline starts at its call's 0), each with one
    ``call`` event per rank naming it.
    """
    trace: list[dict[str, Any]] = []
    lanes_of: dict[int, dict[str, int]] = {}  # rank -> lane name -> tid
    offset_s = 0.0
    for title, lanes in panels:
        end_s = max((ev.end_s for events in lanes for ev in events), default=0.0)
        for rank, events in enumerate(lanes):
            tids = lanes_of.setdefault(rank, {"call": 0, "compute": 1})
            trace.append(_complete(title, "call", rank, 0, offset_s, offset_s + end_s, {}))
            for ev in events:
                lane = "compute" if ev.kind in ("compute", "merge") else f"{ev.label} {ev.kind}"
                tid = tids.setdefault(lane, len(tids))
                args = {"step": ev.step, "peer": ev.peer, "num_bytes": ev.num_bytes}
                start, end = offset_s + ev.start_s, offset_s + ev.end_s
                trace.append(_complete(ev.label, ev.kind, rank, tid, start, end, args))
        offset_s += end_s + gap_s
    for rank, tids in lanes_of.items():
        trace.append(_meta("process_name", rank, 0, f"rank {rank}"))
        trace.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
        trace.extend(_meta("thread_name", rank, tid, lane) for lane, tid in tids.items())
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _complete(
    name: str, cat: str, pid: int, tid: int, start_s: float, end_s: float, args: dict[str, Any]
) -> dict[str, Any]:
    span = {"ts": 1e6 * start_s, "dur": 1e6 * (end_s - start_s), "args": args}
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, **span}


def _meta(name: str, pid: int, tid: int, value: Any, *, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def write_trace(panels: Sequence[Panel], path: str) -> None:
    """Write :func:`timeline_trace` as JSON (open it in https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(timeline_trace(panels), f)


# -- the simulator's curves ----------------------------------------------------------------------
def curves_figure(rows: Sequence[dict[str, Any]]) -> Any:
    """``tokenring simulate --plot``: predicted ms per call against the sequence length (or
    the world size) per strategy; with a single point, bars relative to the best strategy
    (one point per line says nothing)."""
    plt = pyplot()
    first = rows[0]
    title = f"{first['model']} on {first['hardware']} ({first['layout']}, pass: {first['pass']})"
    points = {(r["world_size"], r["seq"]) for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len(points) == 1:
        ordered = sorted(rows, key=lambda r: r["call_ms"])
        best_ms = ordered[0]["call_ms"]
        names = [r["strategy"] for r in ordered]
        bars = ax.bar(names, [r["call_ms"] / best_ms for r in ordered], color="#4477aa")
        ax.bar_label(bars, labels=[f"{r['call_ms']:.4g} ms" for r in ordered], fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_ylabel(f"time per call / best ({ordered[0]['strategy']})")
        ((world_size, seq),) = points
        title += f", P={world_size} S={seq}"
        ax.tick_params(axis="x", labelrotation=20)
    else:
        x_key = "world_size" if len({r["world_size"] for r in rows}) > 1 else "seq"
        fixed = "seq" if x_key == "world_size" else "world_size"
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for row in rows:
            name, at = row["strategy"], row[fixed]
            if x_key == "world_size":  # one line through the S each P rounds down to
                at = row.get("seq_requested", at)
                if name.startswith("hybrid "):  # its P/inner x inner mesh grows with P
                    _, mesh, outer = name.split()
                    inner = mesh.split("x")[1]
                    name = f"hybrid (P/{inner})x{inner} {outer}"
            groups.setdefault((name, at), []).append(row)
        for (name, fixed_value), group in sorted(groups.items()):
            group.sort(key=lambda r: r[x_key])
            label = f"{name} ({'S' if fixed == 'seq' else 'P'}={fixed_value})"
            xs, ys = [r[x_key] for r in group], [r["call_ms"] for r in group]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size P" if x_key == "world_size" else "sequence length S (tokens)")
        ax.set_ylabel("predicted ms per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
