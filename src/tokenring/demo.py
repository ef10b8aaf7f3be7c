"""``tokenring demo``: every strategy on CPU ranks, checked against full attention, timed.

Spawns ``--world-size`` gloo ranks on this machine, runs each strategy forward and backward
on one seeded causal problem in the zigzag layout, compares every rank's output and
gradients with full float64 attention of the global tensors, and prints a table.
The full side-by-side benchmark is ``tokenring bench``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import sequence_parallel_attn
from tokenring.layout import Layout, shard
from tokenring.launch import launch
from tokenring.schedule import Strategy

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=4, help="CPU ranks to spawn")
    parser.add_argument("--seq", type=int, default=1024, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per strategy")


def _rank_main(options: dict[str, Any]) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    seq, hq, hkv, d = options["seq"], options["heads"], options["kv_heads"], options["head_dim"]
    q, k, v, dout = (
        torch.randn(1, seq, h, d, generator=gen) for h in (hq, hkv, hkv, hq)
    )  # global (B, S, H, D) float32, identical on every rank
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    groups = hq // hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0].transpose(1, 2),
        leaves[1].transpose(1, 2).repeat_interleave(groups, 1),
        leaves[2].transpose(1, 2).repeat_interleave(groups, 1),
        is_causal=True,
    ).transpose(1, 2)
    ref.backward(dout.double())
    expected = [ref.detach(), *(x.grad for x in leaves)]

    def local(x: torch.Tensor) -> torch.Tensor:
        return shard(x, rank=rank, world_size=world, layout=Layout.ZIGZAG)

    rows = []
    for strategy in Strategy:
        times = []
        for _ in range(options["iters"] + 1):
            inputs = [local(x).requires_grad_(True) for x in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            out = sequence_parallel_attn(
                *inputs, strategy=strategy, causal=True, layout=Layout.ZIGZAG
            )
            assert isinstance(out, torch.Tensor)
            out.backward(local(dout))
            times.append(time.perf_counter() - start)
        got = [out.detach(), *(x.grad for x in inputs)]
        error = max(
            (g.double() - local(w)).abs().max().item() for g, w in zip(got, expected, strict=True)
        )
        rows.append({"strategy": strategy.value, "ms": 1e3 * statistics.median(times[1:]),
                     "max_error": error})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> int:
    from tokenring._console import make_table, print_table

    if args.seq % (2 * args.world_size) != 0:
        raise SystemExit(f"--seq must be divisible by 2 * --world-size; got {args.seq}")
    options = {k: getattr(args, k) for k in ("seq", "heads", "kv_heads", "head_dim", "iters")}
    per_rank = launch(_rank_main, options, world_size=args.world_size, timeout_s=600)
    table = make_table(
        f"tokenring demo: {args.world_size} CPU ranks (gloo), causal zigzag, float32, "
        f"B=1 S={args.seq} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}",
        ["strategy", "fwd+bwd ms (median, max over ranks)", "max abs error vs fp64", "verdict"],
    )
    failed = False
    for i, row in enumerate(per_rank[0]):
        ms = max(rank_rows[i]["ms"] for rank_rows in per_rank)
        error = max(rank_rows[i]["max_error"] for rank_rows in per_rank)
        ok = error < 1e-4  # float32 against float64; a schedule bug shows as ~0.1
        failed |= not ok
        table.add_row(row["strategy"], f"{ms:.1f}", f"{error:.2e}", "ok" if ok else "WRONG")
    print_table(table)
    return 1 if failed else 0
