"""Where one rank's CPU goes, by library function, tokenring beside ring-flash-attn.

profile_call.py's torch.profiler tables give wall time per operator, which on a machine with
more ranks than cores is mostly time spent descheduled. This script measures CPU time
instead: each rank's call is split into the process's CPU time (all threads), the calling
thread's CPU time, the fused kernel's share of it (the calls of PyTorch's CPU flash operator,
timed with ``time.thread_time`` around them in both libraries) and, for tokenring, the thread
CPU time spent inside its communicator and runtime functions (wrapped the same way). "other
threads" is process minus calling thread: gloo's I/O threads.

The case is benchmarks/peers.py's (same seeded inputs, zigzag shards, P gloo ranks x 1 thread,
the implementations in turns). Rows: median over rounds per rank, then the mean over ranks;
the per-function rows are rank 0's. A function's time includes the functions it calls
(``exchange`` includes ``_pack``), so the rows under a heading do not add up.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/cpu_breakdown.py \
        --dtypes bfloat16,float32 --passes fwd,fwd+bwd --iters 6

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import flash_attn_cpu  # noqa: E402  (benchmarks/, beside this file)
import peers  # noqa: E402

import tokenring.api  # noqa: E402
import tokenring.runtime.comm  # noqa: E402
import tokenring.runtime.kernels  # noqa: E402
import tokenring.runtime.ring  # noqa: E402
from tokenring import launch  # noqa: E402

KERNEL = "fused kernel"
THREAD_S: collections.defaultdict[str, float] = collections.defaultdict(float)

# (module or class, attribute, row label): tokenring's functions on a call's path
WRAPPED = [
    (tokenring.api, "_plan", "validate, agree and plan (api._plan)"),
    (tokenring.runtime.comm.Communicator, "agree", "  of which the rank check (agree)"),
    (tokenring.runtime.comm.Communicator, "exchange", "post transfers (exchange)"),
    (tokenring.runtime.comm, "_pack", "  of which packing messages (_pack)"),
    (tokenring.runtime.comm.Communicator, "_post", "  of which posting (Communicator._post)"),
    (dist, "batch_isend_irecv", "  of which posting (batch_isend_irecv, before _post)"),
    (tokenring.runtime.comm.PendingRecv, "wait", "wait for receives"),
    (tokenring.runtime.ring, "merge_into", "merges (merge_into)"),
    (tokenring.runtime.ring._Forward, "compute", "forward COMPUTE ops (incl. kernel)"),
    (tokenring.runtime.ring._Forward, "returns", "forward RETURNS ops (incl. merges)"),
    (tokenring.runtime.ring._Backward, "compute", "backward COMPUTE ops (incl. kernel)"),
    (tokenring.runtime.ring._Backward, "delta", "backward DELTA op"),
    (tokenring.runtime.ring._Backward, "pass_on", "backward PASS ops"),
    (tokenring.runtime.ring._Backward, "home", "backward HOME op"),
]


def _timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            THREAD_S[label] += time.thread_time() - start

    return inner


def _instrument() -> None:
    """Wrap the kernel entry points of both libraries and tokenring's functions (in the rank
    processes only)."""
    kernels = tokenring.runtime.kernels
    kernels._named = _timed(kernels._named, KERNEL)  # every CPU flash operator call
    flash_attn_cpu._FWD = _timed(flash_attn_cpu._FWD, KERNEL)
    flash_attn_cpu._BWD = _timed(flash_attn_cpu._BWD, KERNEL)
    for owner, name, label in WRAPPED:
        if hasattr(owner, name):  # an older tree may lack one (run against it for a "before")
            setattr(owner, name, _timed(getattr(owner, name), label))


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    _instrument()
    rank, world = dist.get_rank(), dist.get_world_size()
    peer, _ = flash_attn_cpu.load_ring_flash_attn()
    names = [*peers.OURS, peers.PEER]
    scale = args.head_dim**-0.5
    out: dict[str, Any] = {}
    for dtype_name in args.dtypes:
        local = peers.local_inputs(args, dtype_name, rank, world)
        for pass_ in args.passes:
            backward = pass_ == "fwd+bwd"
            rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
            for i in range(args.warmup + args.iters):
                for name in names:
                    inputs = [x.detach().clone().requires_grad_(backward) for x in local[:3]]
                    dist.barrier()
                    THREAD_S.clear()
                    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
                    result = peers._call(name, peer, inputs, scale)
                    if backward:
                        result.backward(local[3])
                    if i >= args.warmup:
                        rows[name].append(
                            {
                                "wall": time.perf_counter() - wall,
                                "process": time.process_time() - cpu,
                                "thread": time.thread_time() - thread,
                                **THREAD_S,
                            }
                        )
            for name, samples in rows.items():
                keys = set().union(*samples)
                out[f"{dtype_name}|{pass_}|{name}"] = {
                    key: 1e3 * statistics.median(s.get(key, 0.0) for s in samples) for key in keys
                }
    return out


def table(per_rank: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    heading = None
    for case in per_rank[0]:
        dtype_name, pass_, name = case.split("|")
        ranks = [r[case] for r in per_rank]
        mean = {k: sum(r.get(k, 0.0) for r in ranks) / len(ranks) for k in ranks[0]}
        if heading != (dtype_name, pass_):
            heading = (dtype_name, pass_)
            lines.append(f"\n### {dtype_name} {pass_}\n")
            lines.append(
                "| implementation | process cpu ms | calling thread | fused kernel "
                "| thread minus kernel | other threads (gloo) |"
            )
            lines.append("|---|---|---|---|---|---|")
        lines.append(
            f"| {name} | {mean['process']:.1f} | {mean['thread']:.1f} | {mean[KERNEL]:.1f} | "
            f"{mean['thread'] - mean[KERNEL]:.1f} | {mean['process'] - mean['thread']:.1f} |"
        )
    lines.append("\n### tokenring's functions, rank 0, thread CPU ms per call\n")
    ours = [c for c in per_rank[0] if c.split("|")[2] != peers.PEER]
    lines.append("| function | " + " | ".join(c.replace("|", " ") for c in ours) + " |")
    lines.append("|---|" + "---|" * len(ours))
    for label in [KERNEL, *(label for _, _, label in WRAPPED)]:
        cells = [per_rank[0][c].get(label, 0.0) for c in ours]
        lines.append(f"| {label} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peers.add_case_arguments(p)
    p.add_argument("--iters", type=int, default=6)
    args = p.parse_args(argv)
    args.dtypes, args.passes = args.dtypes.split(","), args.passes.split(",")
    flash_attn_cpu.check_installed()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    per_rank = launch(rank_main, args, world_size=args.world_size, threads_per_rank=1)
    print(
        f"P = {args.world_size} gloo ranks x 1 thread, S = {args.seq}, {args.heads} heads x "
        f"{args.head_dim}, causal zigzag; torch {torch.__version__}; {args.iters} rounds "
        f"(+{args.warmup} warm-up); load average at start {loadavg}"
    )
    print(table(per_rank))
    return 0


if __name__ == "__main__":
    import cpu_breakdown  # the ranks unpickle rank_main as cpu_breakdown.rank_main

    raise SystemExit(cpu_breakdown.main())
