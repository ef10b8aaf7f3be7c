"""Summarise bench JSONL files: the simulator's error per row and the planner's hit rate.

Usage: python summarize_validation.py FILE.jsonl [...] > model_validation.md
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    print("# Cost model against the emulated lab\n")
    print("Reproduce with `bash benchmarks/run_validation.sh` (root, iproute2). Each row: the")
    print("simulator calibrated from the run's own probes (kernel FLOP/s from compute-only runs,")
    print("two-way P2P link probe, memory copy probe) against the measured median call and the")
    print("median steady forward step (max over ranks).\n")
    print(
        "| link | S | model | causal | strategy | pass | measured ms | model ms | call err % "
        "| step ms | model step ms | step err % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    within = {"call": [0, 0], "step": [0, 0]}
    groups: dict[tuple, dict] = {}
    for r in rows:
        link = f"{r['lab']['rate_bits_per_s'] / 1e6:g} Mbit/s" if r["lab"] else "none"
        step_err = None
        if r.get("ms_step_fwd") and r.get("model_step_fwd_ms"):
            step_err = 100 * (r["ms_step_fwd"] / r["model_step_fwd_ms"] - 1)
        for key, err in (("call", r["model_error_pct"]), ("step", step_err)):
            if err is not None and r["strategy"] in ("token_ring", "ring"):
                within[key][0] += abs(err) <= 15
                within[key][1] += 1
        print(
            f"| {link} | {r['seq']} | {r['model']} | {'yes' if r['causal'] else 'no'} "
            f"| {r['strategy']} | {r['pass']} | {r['ms_median']:.1f} | {r['model_ms']:.1f} "
            f"| {r['model_error_pct']:+.1f} | {r['ms_step_fwd'] or 0:.1f} "
            f"| {r['model_step_fwd_ms']:.1f} | "
            + (f"{step_err:+.1f} |" if step_err is not None else "- |")
        )
        key = (link, r["seq"], r["model"], r["causal"], r["pass"])
        groups.setdefault(key, {"pick": r["planner_pick"], "hit": r["planner_hit"], "rows": []})
        groups[key]["rows"].append((r["ms_median"], r["strategy"]))
    print()
    for key, (ok, total) in within.items():
        print(f"- TokenRing and Ring, per {key}: {ok}/{total} predictions within 15%.")
    hits = sum(g["hit"] for g in groups.values())
    print(f"- Planner (`auto`): {hits}/{len(groups)} picks measured within 5% of the fastest.")
    pair_hits = 0
    for key, g in groups.items():
        g["pair_pick"], g["pair_fastest"], g["pair_hit"] = _pair_pick(key, rows)
        pair_hits += g["pair_hit"]
    print(
        f"- Planner restricted to TokenRing vs Ring (the byte-ratio decision): {pair_hits}/"
        f"{len(groups)} picks within 5% of the faster of the two.\n"
    )
    print(
        "| link | S | model | causal | pass | auto picks | measured fastest | hit "
        "| TokenRing vs Ring: pick | faster | hit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (link, seq, model, causal, pass_), g in groups.items():
        fastest = min(g["rows"])[1]
        print(
            f"| {link} | {seq} | {model} | {'yes' if causal else 'no'} | {pass_} | {g['pick']} "
            f"| {fastest} | {'yes' if g['hit'] else 'NO'} | {g['pair_pick']} "
            f"| {g['pair_fastest']} | {'yes' if g['pair_hit'] else 'NO'} |"
        )


def _link(row: dict) -> str:
    return f"{row['lab']['rate_bits_per_s'] / 1e6:g} Mbit/s" if row["lab"] else "none"


def _pair_pick(key: tuple, rows: list[dict]) -> tuple[str, str, bool]:
    """The planner's pick between token_ring and ring from the rows' own calibration."""
    from tokenring.model.costmodel import measured
    from tokenring.model.planner import explain

    group = [
        r
        for r in rows
        if (_link(r), r["seq"], r["model"], r["causal"], r["pass"]) == key
        and r["strategy"] in ("token_ring", "ring")
    ]
    first = group[0]
    cal = first["calibration"]
    hardware = measured(
        forward_flops_per_s=cal["forward_flops_per_s"],
        backward_flops_per_s=cal["backward_flops_per_s"],
        link_bandwidth_bytes_per_s=cal["link_bytes_per_s"],
        memory_bandwidth_bytes_per_s=cal["memory_bytes_per_s"],
        dtype=first["dtype"],
        topology=first["lab"]["topology"] if first["lab"] else "mesh",
    )
    shape = first["shape"]
    plan = explain(
        world_size=first["world_size"],
        seq_local=first["seq"] // first["world_size"],
        heads_q=shape["heads_q"],
        heads_kv=shape["heads_kv"],
        head_dim=shape["head_dim"],
        dtype=first["dtype"],
        causal=first["causal"],
        hardware=hardware,
        layout=first["layout"],
        training=first["pass"] == "fwd+bwd",
        batch=first["batch"],
        strategies=["token_ring", "ring"],
    )
    times = {r["strategy"]: r["ms_median"] for r in group}
    fastest = min(times, key=times.__getitem__)
    return plan.pick.value, fastest, times[plan.pick.value] <= 1.05 * times[fastest]


if __name__ == "__main__":
    main(sys.argv[1:])
