"""CpuFlashKernel's backward per tile size: the thread CPU time of one piece's gradients.

Each piece is one a rank meets in the zigzag case of ``benchmarks/peers.py`` at P = 2,
S = 8192 (s = 4096 per rank): the local causal block, the full Q against the front half of a
remote K/V, and the back half of Q against a whole remote K/V. For every tile size T the
kernel's ``backward_into`` adds the piece's dq, dk, dv into float32 accumulators tile by tile
(what a ring step does); the row is the fastest of ``--reps`` calls after one warm-up.
``--processes 2`` runs the same measurement in two processes at once, as two ranks share the
cores and caches of this box (the case the default T is chosen for).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/backward_tiles.py --processes 2

Legend: B batch (1), sq / sk query / key rows of a piece, H heads, D head dim, T tile rows.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch

from tokenring.runtime.kernels import CpuFlashKernel, row_delta

PIECES = [(4096, 4096, True), (4096, 2048, False), (2048, 4096, False)]  # (sq, sk, causal)


def _inputs(sq: int, sk: int, causal: bool, args: argparse.Namespace) -> list[torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(sq * 7 + sk)
    q = torch.randn(1, sq, args.heads, args.head_dim, generator=gen).to(dtype)  # (B, sq, H, D)
    k, v = (torch.randn(1, sk, args.heads, args.head_dim, generator=gen).to(dtype) for _ in "kv")
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    out, lse = CpuFlashKernel().forward(q, k, v, causal=causal, scale=args.head_dim**-0.5)
    return [q, k, v, dout, out, lse, row_delta(dout, out, torch.float32)]


def _measure(args: argparse.Namespace) -> list[list[float]]:
    """ms per piece (rows) and tile size (columns) in this process."""
    torch.set_num_threads(1)
    table = []
    for sq, sk, causal in PIECES:
        q, k, v, dout, out, lse, delta = _inputs(sq, sk, causal, args)
        row = []
        for tile in args.tiles:
            kernel, times = CpuFlashKernel(tile_rows=tile), []
            for _ in range(args.reps + 1):
                grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
                start = time.thread_time()
                kernel.backward_into(
                    grads, dout, q, k, v, lse, delta, causal=causal,
                    scale=args.head_dim**-0.5, out=out,
                )  # fmt: skip
                times.append(time.thread_time() - start)
            row.append(min(times[1:]) * 1e3)
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tiles", default="512,1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--processes", type=int, default=1, help="measure in N processes at once")
    args = p.parse_args(argv)
    args.tiles = [int(t) for t in args.tiles.split(",")]
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        tables = pool.map(_measure, [args] * args.processes)
    print(
        f"CpuFlashKernel backward_into, {args.dtype}, H = {args.heads}, D = {args.head_dim}, "
        f"{args.processes} process(es) at once; thread CPU ms per piece, best of {args.reps}\n"
    )
    print("| piece (sq x sk) | process | " + " | ".join(f"T = {t}" for t in args.tiles) + " |")
    print("|---|---|" + "---|" * len(args.tiles))
    for (sq, sk, causal), rows in zip(PIECES, zip(*tables, strict=True), strict=True):
        for i, row in enumerate(rows):
            cells = " | ".join(f"{ms:.1f}" for ms in row)
            print(f"| {sq} x {sk}{' causal' if causal else ''} | {i} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
