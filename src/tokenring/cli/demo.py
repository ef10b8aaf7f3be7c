"""``tokenring demo``: every strategy on CPU ranks, checked against full attention, timed.

A small, fixed run of the benchmark (``tokenring bench``): one causal MHA layer in the zigzag
layout, forward and backward, on ``--world-size`` gloo ranks spawned on this machine. Every
rank's output and gradients are compared with full float64 attention of the global tensors.
"""

from __future__ import annotations

import argparse

from tokenring.cli import check_heads, int_at_least, positive_seconds
from tokenring.cli.bench import BenchConfig, aggregate, check_memory, run_rank
from tokenring.cli.console import make_table, print_table
from tokenring.cli.ranks import check_rank_count, launch_with_progress
from tokenring.core.schedule import AttentionShape

__all__ = ["add_arguments", "check_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--world-size", type=int_at_least(1), default=4, help="CPU ranks to spawn")
    add("--seq", type=int_at_least(1), default=1024, help="global sequence length (any)")
    add("--heads", type=int_at_least(1), default=8, help="query heads")
    add("--kv-heads", type=int_at_least(1), default=8, help="key/value heads")
    add("--head-dim", type=int_at_least(1), default=64)
    add("--iters", type=int_at_least(1), default=3, help="timed iterations per strategy")
    add("--timeout", type=positive_seconds, default=900, help="seconds before ranks are killed")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the argument for a run that cannot start; keeps the config on
    ``args`` for :func:`run`."""
    check_heads(args)
    check_rank_count(args)  # before the P^2 schedules below
    model = AttentionShape(heads_q=args.heads, heads_kv=args.kv_heads, head_dim=args.head_dim)
    config = BenchConfig(
        seq=args.seq,
        models={"demo": model},
        causal=(True,),
        passes=("fwd+bwd",),
        iters=args.iters,
        timeline_rows=False,
    )
    config.check_world(args.world_size)
    try:
        config.check_schedules(args.world_size)
    except ValueError as exc:
        raise ValueError(f"--heads {args.heads} --kv-heads {args.kv_heads}: {exc}") from None
    check_memory(config, args.world_size, args.world_size, "gloo")
    args._config = config


def run(args: argparse.Namespace) -> int:

    config: BenchConfig = args._config
    args.link = None  # the demo runs on this machine's own links
    num_rows = len(config.strategies) * len(config.passes)  # one model, one causality
    title = f"demo: {num_rows} strategies on {args.world_size} ranks"
    per_rank = launch_with_progress(run_rank, config, num_rows=num_rows, title=title, args=args)
    rows = aggregate(per_rank, config)
    table = make_table(
        f"tokenring demo: {args.world_size} CPU ranks (gloo), causal zigzag, float32, "
        f"B=1 S={args.seq} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}",
        ["strategy", "fwd+bwd ms (median, max over ranks)", "max abs error vs fp64", "check"],
    )
    for r in rows:
        check = "ok" if r["verified"] else "WRONG"
        table.add_row(r["strategy"], f"{r['ms_median']:.1f}", f"{r['max_error']:.2e}", check)
    print_table(table)
    return 0 if all(row["verified"] for row in rows) else 1
