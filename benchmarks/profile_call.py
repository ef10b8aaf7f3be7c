"""Where one rank's attention call spends its time: torch.profiler operators, grouped.

Runs P gloo ranks (one thread each) on the peers benchmark's case (benchmarks/peers.py:
seeded q, k, v, dout, causal zigzag), warms up, then profiles ``--calls`` calls of each
strategy on every rank and prints rank 0's breakdown (the ranks are alike by symmetry of
the zigzag layout; the slowest rank sets a ring's pace, so every rank's total is printed
too), with each rank's CPU time per call (all its threads: what a machine with more ranks
than cores spends). Operators are put in groups by exact name: the fused kernel, merges and
lse math, copies and casts, allocations, posting P2P; the library's own operators' self
time is their Python and the blocking waits for transfers (gloo's waits are no operators);
"outside any operator" is the call's time minus all operators'. ``--peer`` adds
ring-flash-attn's zigzag function; ``--agree N`` times the rank check instead (through the
communicator's transport: ``TOKENRING_SHARED_MEMORY=0`` for gloo's sockets).

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
from tokenring.core.layout import shard  # noqa: E402
from tokenring.runtime.comm import Timeline  # noqa: E402

GROUPS = [  # (group, operator names), by exact name
    (
        "kernel",
        (
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        ),
    ),
    ("p2p + collectives (posting)", ("c10d::send", "c10d::recv_", "c10d::barrier")),
    (
        "merge and lse math",
        (
            "aten::logaddexp", "aten::isneginf", "aten::exp", "aten::where", "aten::addcmul_",
            "aten::mul_", "aten::mul", "aten::sigmoid", "aten::log_sigmoid_forward", "aten::sub",
            "aten::rsub", "aten::add_", "aten::add", "aten::sum", "aten::linalg_vector_norm",
            "aten::div", "aten::masked_fill", "aten::square_",
        ),
    ),
    (
        "copy / cast",
        (
            "aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous",
            "aten::cat", "aten::index_copy", "aten::fill_",
        ),
    ),
    ("allocation", ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::full")),
]  # fmt: skip


def _group(name: str) -> str:
    for group, names in GROUPS:
        if name in names:
            return group
    if name.startswith(("tokenring::", "ZigZagRing", "GeneratedBackwardFor_tokenring")):
        return "library self time (Python, blocking waits)"
    return "other operators (views, autograd)"


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = peers.flash_attn_cpu.load_ring_flash_attn()[0] if args.peer else None
    names = [*peers.OURS, *([peers.PEER] if args.peer else [])]
    scale = args.head_dim**-0.5
    comm = get_communicator()
    report: dict[str, Any] = {}
    for dtype_name in args.dtypes:
        local = peers.local_inputs(args, dtype_name, rank, world)
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
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(args.calls):
                        call()
                    wall_s = (time.perf_counter() - start) / args.calls
                    cpu_s = (time.process_time() - start_cpu) / args.calls
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
                groups["outside any operator (Python, waits)"] = max(0.0, wall_s - traced)
                waits = (
                    sum(e.end_s - e.start_s for e in timeline.events if e.kind in ("recv", "wait"))
                    / args.calls
                )
                report[f"{name} | {dtype_name} | {pass_}"] = {
                    "wall_s": wall_s,
                    "cpu_s": cpu_s,
                    "groups": dict(groups),
                    "top": top[: args.top],
                    "timeline_recv_s": waits,
                    "timeline_kinds": sorted({e.kind for e in timeline.events}),
                }
    return report


def agree_main(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per ``Communicator.agree`` of a real call's signature (the digest exchange),
    and per exchange of the JSON rows (what every call exchanged before the digests), each
    after a barrier, median over ``--agree`` repetitions on this rank."""
    import json

    from tokenring.api import _merged, _op_options, _prepare_call

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = get_communicator()
    q = peers.global_inputs(args, peers.DTYPES[args.dtypes[0]])[0]
    q = shard(q, rank=rank, world_size=world, layout="zigzag")
    # sequence_parallel_attn's keywords, as it hands them to the operator
    values = dict(
        strategy="ring", causal=True, softmax_scale=None, layout="zigzag", block_kernel=None,
        last_block_splits=2, last_pair=None, check_ranks=True, hardware=None, seq_len=None,
        cu_seqlens=None, window_size=None, attention_chunk_size=None,
    )  # fmt: skip
    options, _record = _op_options(values)
    options = {**_merged(options), "requires_grad": [True] * 3}  # as the operator gets them
    _call, signature = _prepare_call(q, q, q, comm=comm, options=options, splits_given=False)
    data = json.dumps({"signature": signature}, sort_keys=True).encode()
    times: dict[str, list[float]] = {w: [] for w in ("digest", "rows", "digest cpu", "rows cpu")}
    for _ in range(args.agree):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        comm.agree(signature, None, what="attention call")
        times["digest"].append(time.perf_counter() - start)
        times["digest cpu"].append(time.process_time() - cpu)
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        rows = [json.loads(b) for b in comm.all_gather_bytes(data, what="rows")]
        assert all(r == rows[0] for r in rows)
        times["rows"].append(time.perf_counter() - start)
        times["rows cpu"].append(time.process_time() - cpu)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peers.add_case_arguments(p)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--peer", action="store_true", help="also profile ring-flash-attn zigzag")
    p.add_argument(
        "--agree", type=int, default=0, help="instead: time N rank agreements (the check)"
    )
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.passes = args.passes.split(",")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    if args.agree:
        per_rank = launch(
            agree_main, args, world_size=args.world_size, threads_per_rank=1, timeout_s=1800
        )
        for what in ("digest", "rows", "digest cpu", "rows cpu"):
            ms = ", ".join(f"{1e3 * r[what]:.3f}" for r in per_rank)
            print(f"agreement by {what}: median ms per rank: {ms}")
        return 0
    reports = launch(
        rank_main, args, world_size=args.world_size, threads_per_rank=1, timeout_s=1800
    )
    for key, r0 in reports[0].items():
        walls = ", ".join(f"{1e3 * r[key]['wall_s']:.1f}" for r in reports)
        cpus = ", ".join(f"{1e3 * r[key]['cpu_s']:.1f}" for r in reports)
        print(
            f"\n## {key}: rank 0 {1e3 * r0['wall_s']:.1f} ms per call (ranks: {walls} ms; "
            f"CPU time per call: {cpus} ms)"
        )
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
