"""The closing table of issue 5: every strategy per call, measured and predicted, side by side.

Usage: python summarize_lab.py MHA.jsonl GQA.jsonl > lab_mesh_100mbit.md

Reads ``tokenring bench`` JSONL rows (one causal setting, both passes) and prints one line per
strategy: ms per call measured (max over ranks of each rank's median), the simulator's
prediction calibrated from the same run, and the error, for each model and pass.
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    first = rows[0]
    lab = first["lab"]
    link = f"{lab['topology']} {lab['rate_bits_per_s'] / 1e6:g} Mbit/s" if lab else "no emulation"
    models = list(dict.fromkeys(r["model"] for r in rows))
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    strategies = list(dict.fromkeys(_label(r) for r in rows))
    cells = {(_label(r), r["model"], r["pass"]): r for r in rows}
    print(f"# {first['world_size']} ranks, {link}: every strategy per call, measured vs model\n")
    print(
        f"S = {first['seq']}, B = {first['batch']}, {first['dtype']}, causal "
        f"{'zigzag' if first['causal'] else 'contiguous'}, {first['backend']} on "
        f"{first['device']}, torch {first['torch']}, git {first['git_sha']}; "
        f"{first['warmup']} warm-up + {first['iters']} timed calls per row. Reproduce with "
        "`bash benchmarks/run_results.sh` (root, iproute2); the rows are in "
        + ", ".join(f"`{p.rsplit('/', 1)[-1]}`" for p in paths)
        + ".\n"
    )
    print(
        "Each cell: measured ms / model ms (error of the measurement against the model). The "
        "model is the event simulator calibrated from the run's own probes (the strategy's own "
        "kernel FLOP/s from its compute-only run, two-way P2P link probe, memory copy); every "
        "transfer, the collectives' all-to-alls included, is a point-to-point message (Note "
        "[Collective routing] in src/tokenring/strategies/collective.py). auto picks with one "
        "FLOP/s per pass for the whole group (Note [Calibrating the model from the run] in "
        "src/tokenring/cli/bench.py).\n"
    )
    header = [f"{m} {p}" for m in models for p in passes]
    print("| strategy | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    errors: list[float] = []
    for strategy in strategies:
        line = []
        for model in models:
            for pass_ in passes:
                r = cells.get((strategy, model, pass_))
                if r is None:
                    line.append("-")
                    continue
                err = 100 * (r["ms_median"] / r["model_ms"] - 1)
                errors.append(abs(err))
                line.append(f"{r['ms_median']:.0f} / {r['model_ms']:.0f} ({err:+.0f}%)")
        print(f"| {strategy} | " + " | ".join(line) + " |")
    print()
    within = sum(e <= 15 for e in errors)
    print(f"- {within}/{len(errors)} predictions within 15%, the largest error {max(errors):.0f}%.")
    for model in models:
        for pass_ in passes:
            group = [r for r in rows if r["model"] == model and r["pass"] == pass_]
            fastest = min(group, key=lambda r: r["ms_median"])
            pick = group[0]["planner_pick"]
            picked = next(r for r in group if r["strategy"] == pick)
            print(
                f"- {model} {pass_}: fastest {_label(fastest)} ({fastest['ms_median']:.0f} ms); "
                f"auto picks {pick} ({picked['ms_median']:.0f} ms, "
                f"{'hit' if group[0]['planner_hit'] else 'miss'})."
            )


def _label(row: dict) -> str:
    return f"{row['strategy']} {row['hybrid']}" if row.get("hybrid") else row["strategy"]


if __name__ == "__main__":
    main(sys.argv[1:])
