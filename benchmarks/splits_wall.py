"""TokenRing's forward with last_block_splits 2 and 1 beside ring_attn and ring-flash-attn's
zigzag function: wall (max over ranks of the median) and CPU (mean over ranks) per call, P = 4
gloo ranks x 1 thread, S = 4096, 8 heads x 64, causal zigzag (benchmarks/results/
peers_session_end.md).

    OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks nice -n -19 python benchmarks/splits_wall.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flash_attn_cpu

from tokenring import launch, sequence_parallel_attn
from tokenring.core.layout import shard


def rank_main(dtype_name: str, iters: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    peer, _ = flash_attn_cpu.load_ring_flash_attn()
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, dtype_name)
    xs = [torch.randn(1, 4096, 8, 64, generator=gen).to(dtype) for _ in range(3)]
    local = [shard(x, rank=rank, world_size=world, layout="zigzag") for x in xs]
    impls = {
        "tr splits2": lambda i: sequence_parallel_attn(
            *i, strategy="token_ring", causal=True, layout="zigzag", softmax_scale=0.125
        ),
        "tr splits1": lambda i: sequence_parallel_attn(
            *i,
            strategy="token_ring",
            causal=True,
            layout="zigzag",
            softmax_scale=0.125,
            last_block_splits=1,
        ),
        "ring": lambda i: sequence_parallel_attn(
            *i, strategy="ring", causal=True, layout="zigzag", softmax_scale=0.125
        ),
        "peer": lambda i: peer.zigzag_ring_flash_attn_func(*i, softmax_scale=0.125, causal=True),
    }
    res = {n: ([], []) for n in impls}
    for it in range(2 + iters):
        for n, f in impls.items():
            inp = [x.clone() for x in local]
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            f(inp)
            w1, c1 = time.perf_counter(), time.process_time()
            if it >= 2:
                res[n][0].append(w1 - w0)
                res[n][1].append(c1 - c0)
    return {
        n: (statistics.median(w) * 1e3, statistics.median(c) * 1e3) for n, (w, c) in res.items()
    }


if __name__ == "__main__":
    import splits_wall

    for dt in ("float32", "bfloat16"):
        per = launch(splits_wall.rank_main, dt, 9, world_size=4, timeout_s=600)
        for n in per[0]:
            wall = max(p[n][0] for p in per)
            cpu = sum(p[n][1] for p in per) / 4
            print(dt, n, f"wall {wall:.1f} ms  cpu {cpu:.1f} ms")
