"""Where one rank's call waits: the deferred rank check and the receives, per rank.

Runs P gloo ranks (one thread each) on the peers benchmark's forward case (seeded inputs,
causal zigzag), warms up, then times ``--calls`` calls of ``ring_attn`` and
``token_ring_attn`` on every rank between barriers, and reports per rank the median of the
call's wall time, of the time blocked completing the deferred rank check
(``Communicator.settle``, Note [Deferred agreement] in tokenring.runtime.comm) and of the time
blocked in receives (``PendingRecv.wait``). The two waits are wall time; what a call spends
beyond them and its CPU time is time descheduled (more ranks than cores).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/rank_waits.py

Legend: S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import peers  # noqa: E402  (benchmarks/, beside this file)

import tokenring  # noqa: E402
from tokenring.core.layout import shard  # noqa: E402
from tokenring.runtime.comm import Communicator, PendingRecv  # noqa: E402

STRATEGIES = {"ring_attn": tokenring.ring_attn, "token_ring_attn": tokenring.token_ring_attn}


def _timed(cls: type, name: str, spent: dict[str, float], key: str) -> None:
    """Add the wall time of every call of ``cls.name`` to ``spent[key]``."""
    original = getattr(cls, name)

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(cls, name, timed)


def rank_main(args: argparse.Namespace) -> dict[str, list[tuple[float, float, float]]]:
    """One rank: (call, check wait, receive wait) seconds per timed call, per strategy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = peers.global_inputs(args, peers.DTYPES[args.dtype])
    local = [shard(x, rank=rank, world_size=world, layout="zigzag") for x in (q, k, v)]
    spent = {"check": 0.0, "recv": 0.0}
    _timed(Communicator, "settle", spent, "check")
    _timed(PendingRecv, "wait", spent, "recv")
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for name, fn in STRATEGIES.items():
        rows[name] = []
        for i in range(args.warmup + args.calls):
            spent.update(check=0.0, recv=0.0)
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                fn(*local, causal=True, layout="zigzag", check_ranks=not args.without_check)
            call = time.perf_counter() - start
            if i >= args.warmup:
                rows[name].append((call, spent["check"], spent["recv"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(peers.DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--without-check", action="store_true", help="check_ranks=False")
    args = p.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    per_rank = tokenring.launch(
        rank_main, args, world_size=args.world_size, timeout_s=900, threads_per_rank=1
    )
    print(
        f"P = {args.world_size} ranks x 1 thread, S = {args.seq}, {args.heads} heads x "
        f"{args.head_dim}, {args.dtype}, causal zigzag, forward; median of {args.calls} calls\n"
    )
    print("| implementation | rank | call ms | check wait ms | receive wait ms |")
    print("|---|---|---|---|---|")
    for name in STRATEGIES:
        for rank, rows in enumerate(per_rank):
            call, check, recv = (1e3 * statistics.median(x) for x in zip(*rows[name], strict=True))
            print(f"| {name} | {rank} | {call:.1f} | {check:.2f} | {recv:.1f} |")


if __name__ == "__main__":
    import rank_waits  # the ranks unpickle rank_main as rank_waits.rank_main

    rank_waits.main()
