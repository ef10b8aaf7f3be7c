"""Timeline pictures: per rank, per step, compute and each flow as bars on a time axis.

The same picture for measured runs (``tokenring bench --plot``: events recorded inside the
runtime) and simulated ones (``tokenring simulate``). matplotlib is imported lazily (the
``plot`` extra).

Receive bars span from when the receive was posted to when the rank saw it complete, so a
bar that ends late may have waited for the rank rather than for the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenring.comm import Event

__all__ = ["draw_timeline_lanes", "plot_timelines"]

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


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'tokenring-attention[plot]'") from exc
    return plt


def draw_timeline_lanes(ax: Any, lanes: Sequence[Sequence[Event]], title: str) -> None:
    """Draw one strategy: for each rank a compute lane and a lane per incoming flow."""
    labels: list[str] = []
    y = 0.0
    for rank, events in enumerate(lanes):
        flows = sorted({ev.label for ev in events if ev.kind == "recv"})
        rows = ["compute", *flows]
        for row in rows:
            for ev in events:
                is_compute = ev.kind in ("compute", "merge") and row == "compute"
                if not (is_compute or (ev.kind == "recv" and ev.label == row)):
                    continue
                ax.barh(
                    y,
                    1e3 * (ev.end_s - ev.start_s),
                    left=1e3 * ev.start_s,
                    height=0.8,
                    color=COLOURS.get(ev.label, "#777777"),
                    edgecolor="black",
                    linewidth=0.3,
                )
                if is_compute and ev.kind == "compute":
                    ax.text(1e3 * ev.start_s, y, str(ev.step), va="center", fontsize=6)
            labels.append(f"r{rank} {'compute' if row == 'compute' else row + ' in'}")
            y += 1
        y += 0.5
    ax.set_yticks(_ticks(lanes))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the call started (each rank's own clock)")
    ax.set_title(title, fontsize=9)


def _ticks(lanes: Sequence[Sequence[Event]]) -> list[float]:
    ticks: list[float] = []
    y = 0.0
    for events in lanes:
        flows = {ev.label for ev in events if ev.kind == "recv"}
        for _ in range(1 + len(flows)):
            ticks.append(y)
            y += 1
        y += 0.5
    return ticks


def plot_timelines(per_rank: list[dict[str, Any]], config: Any, path: str, *, title: str) -> None:
    """One panel per strategy (its fwd+bwd row, else fwd) of the first model and causality."""
    plt = _pyplot()
    rows = per_rank[0]["rows"]
    model, causal = config.models[0].name, config.causal[0]
    wanted = "fwd+bwd" if "fwd+bwd" in config.passes else "fwd"
    picks = [
        i
        for i, r in enumerate(rows)
        if r.model == model and r.causal == causal and r.pass_ == wanted
    ]
    fig, axes = plt.subplots(
        len(picks),
        1,
        figsize=(13, 2.2 + 1.6 * len(per_rank) * len(picks)),
        squeeze=False,
        sharex=True,
    )
    for ax, index in zip(axes[:, 0], picks, strict=True):
        lanes = [r["rows"][index].events for r in per_rank]
        row = rows[index]
        draw_timeline_lanes(ax, lanes, f"{row.strategy} {row.pass_} {model} causal={causal}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.suptitle(title, fontsize=9, y=0.995)
    fig.legend(
        handles,
        list(COLOURS),
        loc="upper center",
        bbox_to_anchor=(0.5, 0.985),
        fontsize=7,
        ncol=len(COLOURS),
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
