"""Where one rank's attention call spends its time: torch.profiler operators, grouped.

Runs P gloo ranks (one thread each) on the peers benchmark's case (benchmarks/peers.py:
seeded q, k, v, dout, causal zigzag), warms up, then profiles ``--calls`` calls of each
strategy on every rank and prints rank 0's breakdown (the ranks are alike by symmetry of
the zigzag layout; the slowest rank sets a ring's pace, so every rank's total is printed
too). Operators are put in groups by name: the fused kernel, the merges, copies and casts,
allocations, P2P and collectives (incl. waits), and the rest (Python, dispatch) as the
call's time minus the operators'. ``--peer`` adds ring-flash-attn's zigzag function.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/profile_call.py --dtypes bfloat16 \
        --passes fwd,fwd+bwd

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import peers  # noqa: E402  (benchmarks/, beside this file)

from tokenring import get_communicator, launch  # noqa: E402
from tokenring.comm import Timeline  # noqa: E402
from tokenring.layout import shard  # noqa: E402

GROUPS = [  # (group, operator name fragments), first match wins
    ("kernel", ("_scaled_dot_product_flash_attention_for_cpu",)),
    (
        "p2p + collectives",
        ("gloo", "c10d", "barrier", "allgather", "all_gather", "send", "recv", "wait"),
    ),
    (
        "merge",
        (
            "logaddexp",
            "isneginf",
            "exp",
            "where",
            "addcmul",
            "mul_",
            "sigmoid",
            "logsigmoid",
            "sub",
            "mul",
            "rsub",
            "add_",
            "add",
        ),
    ),
    (
        "copy / cast",
        ("copy_", "to", "_to_copy", "clone", "contiguous", "index_copy", "cat", "fill_"),
    ),
    ("allocation", ("empty", "zeros", "full", "ones", "new_")),
]


def _group(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other operators"


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = peers.flash_attn_cpu.load_ring_flash_attn()[0] if args.peer else None
    names = [*peers.OURS, *([peers.PEER] if args.peer else [])]
    scale = args.head_dim**-0.5
    comm = get_communicator()
    report: dict[str, Any] = {}
    for dtype_name in args.dtypes:
        q, k, v, dout = peers.global_inputs(args, peers.DTYPES[dtype_name])
        local = [shard(x, rank=rank, world_size=world, layout="zigzag") for x in (q, k, v, dout)]
        for pass_ in args.passes:
            backward = pass_ == "fwd+bwd"
            for name in names:

                def call(name: str = name, backward: bool = backward, local: list = local) -> None:
                    inputs = [x.detach().clone().requires_grad_(backward) for x in local[:3]]
                    out = peers._call(name, peer, inputs, scale)
                    if backward:
                        out.backward(local[3])

                for _ in range(args.warmup):
                    call()
                dist.barrier()
                timeline = Timeline()
                comm.timeline = timeline
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    wall_s = (time.perf_counter() - start) / args.calls
                comm.timeline = None
                dist.barrier()
                groups: dict[str, float] = defaultdict(float)
                top: list[tuple[str, float, int]] = []
                for ev in prof.key_averages():
                    if ev.key.startswith("tokenring.") or ev.key.startswith("ProfilerStep"):
                        continue
                    self_s = ev.self_cpu_time_total / 1e6 / args.calls
                    groups[_group(ev.key)] += self_s
                    top.append((ev.key, self_s, ev.count // args.calls))
                top.sort(key=lambda t: -t[1])
                traced = sum(groups.values())
                groups["python + dispatch (call - operators)"] = max(0.0, wall_s - traced)
                waits = (
                    sum(e.end_s - e.start_s for e in timeline.events if e.kind in ("recv", "wait"))
                    / args.calls
                )
                report[f"{name} | {dtype_name} | {pass_}"] = {
                    "wall_s": wall_s,
                    "groups": dict(groups),
                    "top": top[: args.top],
                    "timeline_recv_s": waits,
                    "timeline_kinds": sorted({e.kind for e in timeline.events}),
                }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--peer", action="store_true", help="also profile ring-flash-attn zigzag")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.passes = args.passes.split(",")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    reports = launch(
        rank_main, args, world_size=args.world_size, threads_per_rank=1, timeout_s=1800
    )
    for key, r0 in reports[0].items():
        walls = ", ".join(f"{1e3 * r[key]['wall_s']:.1f}" for r in reports)
        print(f"\n## {key}: rank 0 {1e3 * r0['wall_s']:.1f} ms per call (ranks: {walls} ms)")
        print("| group | ms per call | share |\n|---|---|---|")
        for g, s in sorted(r0["groups"].items(), key=lambda t: -t[1]):
            print(f"| {g} | {1e3 * s:.2f} | {100 * s / r0['wall_s']:.0f}% |")
        print(
            "\ntop operators (self time per call): "
            + "; ".join(f"{n} {1e3 * s:.2f} ms x{c}" for n, s, c in r0["top"])
        )
    return 0


if __name__ == "__main__":
    import profile_call

    sys.exit(profile_call.main())
