"""tokenring beside its peers on the same inputs and the same CPU kernel.

Runs, in one launch of P gloo ranks (one thread each, no link emulation), on the same seeded
global q, k, v, dout sharded zigzag (rank r holds chunks r and 2P-1-r of 2P):

    tokenring ring_attn            (sequence_parallel_attn, strategy ring, layout zigzag)
    tokenring token_ring_attn      (strategy token_ring, layout zigzag)
    ring-flash-attn zigzag         (ring_flash_attn.zigzag_ring_flash_attn_func, 0.1.8), its
                                   flash-attn kernel entry points served on CPU by
                                   benchmarks/flash_attn_cpu.py (PyTorch's fused CPU flash
                                   attention operator, the one tokenring's cpu_flash runs)

and then one process on the whole sequence with every core's thread (PyTorch SDPA, causal): the
compute bound on the same cores. The implementations run in turns (one call of each per
round), so load from elsewhere on the machine falls on all of them alike. Every call is timed
between barriers; a round's time is the max over ranks; rows report the median and p10/p90
over rounds. Every output and gradient is checked against float64 full attention of the
rank's own rows (tokenring.cli.bench's per-rank reference) and reported as measured: a wrong
answer is a row with ok = False, never skipped or patched.

With ``--link RATE`` (``--topology``) the P ranks run inside the emulated-interconnect lab
of ``tokenring bench --link`` (tokenring.model.netlab: one network namespace per rank, links
of that rate, every byte on them: the lab's environment turns the shared-memory transport
off, and each rank reports its communicator's path); the one-process row stays outside.

Needs ``pip install --no-deps ring-flash-attn`` (the ``peers`` extra). Example::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/peers.py --world-size 4 --seq 4096 \
        --heads 8 --head-dim 64 --dtypes bfloat16,float32 --passes fwd,fwd+bwd \
        --warmup 2 --iters 9 --out benchmarks/results/peers.jsonl \
        --markdown benchmarks/results/peers.md

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import flash_attn_cpu  # noqa: E402  (benchmarks/, beside this file)

from tokenring import get_communicator, launch, sequence_parallel_attn  # noqa: E402
from tokenring.cli import ranks, rate_bits_per_s  # noqa: E402
from tokenring.cli.bench import per_rank_reference  # noqa: E402
from tokenring.cli.ranks import git_sha  # noqa: E402
from tokenring.cli.report import link_text  # noqa: E402
from tokenring.core.layout import make_sharding, shard  # noqa: E402
from tokenring.model.netlab import Topology  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # max abs error vs float64 (tokenring bench's)
OURS = {"tokenring ring_attn zigzag": "ring", "tokenring token_ring_attn zigzag": "token_ring"}
UNCHECKED = ", check_ranks=False"  # a row's suffix with --without-rank-check
PEER = "ring-flash-attn zigzag_ring_flash_attn_func"
ONE_PROCESS = "one process, SDPA, whole sequence"


def global_inputs(args: argparse.Namespace, dtype: torch.dtype) -> list[torch.Tensor]:
    """Seeded global q, k, v, dout ``(B, S, H, D)``, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    return [torch.randn(*shape, generator=gen).to(dtype) for _ in range(4)]


def local_inputs(args: argparse.Namespace, dtype_name: str, rank: int, world: int) -> list[Any]:
    """This rank's zigzag shards of :func:`global_inputs` (q, k, v, dout ``(B, s, H, D)``)."""
    xs = global_inputs(args, DTYPES[dtype_name])
    return [shard(x, rank=rank, world_size=world, layout="zigzag") for x in xs]


def _call(name: str, peer: Any, inputs: list[torch.Tensor], scale: float) -> torch.Tensor:
    q, k, v = inputs
    if name == PEER:
        out = peer.zigzag_ring_flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    else:
        ours, checked = name.removesuffix(UNCHECKED), not name.endswith(UNCHECKED)
        out = sequence_parallel_attn(
            q,
            k,
            v,
            strategy=OURS[ours],
            causal=True,
            layout="zigzag",
            softmax_scale=scale,
            check_ranks=checked,
        )
    assert isinstance(out, torch.Tensor)
    return out


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    """One rank: every (dtype, pass, implementation), in turns; times and errors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer, peer_version = flash_attn_cpu.load_ring_flash_attn()
    names = [*OURS, *(n + UNCHECKED for n in OURS if args.without_rank_check), PEER]
    positions = make_sharding(layout="zigzag", world_size=world, seq_len=args.seq).positions(rank)
    scale = args.head_dim**-0.5
    results: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        q, k, v, dout = global_inputs(args, dtype)
        grads = "fwd+bwd" in args.passes
        want = (
            per_rank_reference(q, k, v, dout, positions, causal=True, scale=scale, grads=grads)
            if args.check
            else []
        )
        local = [shard(x, rank=rank, world_size=world, layout="zigzag") for x in (q, k, v, dout)]
        for pass_ in args.passes:
            backward = pass_ == "fwd+bwd"
            times: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}
            errors: dict[str, dict[str, float]] = {}
            for i in range(args.warmup + args.iters):
                for name in names:
                    inputs = [x.detach().clone().requires_grad_(backward) for x in local[:3]]
                    dist.barrier()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    out = _call(name, peer, inputs, scale)
                    if backward:
                        out.backward(local[3])
                    elapsed = time.perf_counter() - start
                    if i >= args.warmup:
                        times[name].append(elapsed)
                        cpu[name].append(time.process_time() - start_cpu)
                    if i == args.warmup + args.iters - 1 and args.check:
                        got = [out.detach()] + ([x.grad for x in inputs] if backward else [])
                        errors[name] = {
                            what: float((g.double() - r).abs().max())
                            for what, g, r in zip(
                                ("out", "dq", "dk", "dv"), got, want, strict=False
                            )
                            if g is not None
                        }
            dist.barrier()
            for name in names:
                results.append(
                    {
                        "impl": name,
                        "dtype": dtype_name,
                        "pass": pass_,
                        "call_s": times[name],
                        "cpu_s": cpu[name],
                        "max_error": errors.get(name, {}),
                    }
                )
    path = get_communicator().path(torch.device("cpu"))
    return {"rows": results, "peer_version": peer_version, "comm_path": path}


def one_process_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One process, whole sequence, SDPA causal, with the launch's threads: the bound."""
    rows = []
    scale = args.head_dim**-0.5
    for dtype_name in args.dtypes:
        q, k, v, dout = global_inputs(args, DTYPES[dtype_name])
        for pass_ in args.passes:
            backward = pass_ == "fwd+bwd"
            times, cpu = [], []
            for i in range(args.warmup + args.iters):
                inputs = [
                    x.detach().transpose(1, 2).clone().requires_grad_(backward) for x in (q, k, v)
                ]
                start, start_cpu = time.perf_counter(), time.process_time()
                out = F.scaled_dot_product_attention(*inputs, is_causal=True, scale=scale)
                if backward:
                    out.backward(dout.transpose(1, 2))
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)
            rows.append(
                {
                    "impl": ONE_PROCESS,
                    "dtype": dtype_name,
                    "pass": pass_,
                    "call_s": times,
                    "cpu_ms": 1e3 * statistics.median(cpu),
                }
            )
    return rows


def _stats(call_s: list[float]) -> dict[str, float]:
    ordered = sorted(call_s)
    pick = lambda pct: ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]  # noqa: E731
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p10_ms": 1e3 * pick(10),
        "p90_ms": 1e3 * pick(90),
    }


def aggregate(per_rank: list[dict[str, Any]], one: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A round's time is the max over ranks; errors the max over ranks."""
    rows = []
    for i, first in enumerate(per_rank[0]["rows"]):
        mine = [r["rows"][i] for r in per_rank]
        rounds = [max(ts) for ts in zip(*(r["call_s"] for r in mine), strict=True)]
        cpu = [sum(ts) / len(ts) for ts in zip(*(r["cpu_s"] for r in mine), strict=True)]
        error = {w: max(r["max_error"][w] for r in mine) for w in first["max_error"]}
        tol = TOLERANCE[first["dtype"]]
        checked = bool(error)
        rows.append(
            {
                "impl": first["impl"],
                "dtype": first["dtype"],
                "pass": first["pass"],
                **_stats(rounds),
                "cpu_ms": 1e3 * statistics.median(cpu),
                "max_error": error,
                "tolerance": tol,
                "ok": all(e <= tol for e in error.values()) if checked else None,
            }
        )
    for r in one:
        rows.append({**r, **_stats(r.pop("call_s")), "max_error": {}, "ok": None})
    return rows


def table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """Markdown: a row per implementation, with the speed-up of each against the peer."""
    lines = [
        f"P = {settings['world_size']} gloo ranks x {settings['threads_per_rank']} thread, "
        f"S = {settings['seq']}, B = {settings['batch']}, {settings['heads']} heads x "
        f"{settings['head_dim']}, causal zigzag, {link_text(settings['lab'])} (tokenring's "
        f"path: {settings['comm_path']}); one process: "
        f"{settings['one_process_threads']} threads; {settings['cpus']} cores. "
        f"torch {settings['torch']}, ring-flash-attn {settings['peer_version']}, "
        f"git {settings['git']}, {settings['rounds']} rounds "
        f"(+{settings['warmup']} warm-up), load average at start {settings['loadavg']}.",
        "",
        "cpu ms: CPU time of one rank's call (all its threads), the mean over ranks, median "
        "over rounds: what a loaded machine's wall time is made of.",
        "",
        "| implementation | dtype | pass | median ms | p10-p90 ms | peer ms / this ms "
        "| cpu ms | peer cpu / this cpu | max abs error vs fp64 (out, dq, dk, dv) | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer = {(r["dtype"], r["pass"]): r for r in rows if r["impl"] == PEER}
    for r in rows:
        err = ", ".join(f"{e:.1e}" for e in r["max_error"].values()) or "-"
        them = peer[(r["dtype"], r["pass"])]
        speed = them["median_ms"] / r["median_ms"]
        cpu = them["cpu_ms"] / r["cpu_ms"]
        ok = ("not checked" if r["impl"] != ONE_PROCESS else "-") if r["ok"] is None else ""
        ok = ok or ("yes" if r["ok"] else "**NO**")
        lines.append(
            f"| {r['impl']} | {r['dtype']} | {r['pass']} | {r['median_ms']:.1f} | "
            f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f} | {speed:.2f}x | {r['cpu_ms']:.1f} | "
            f"{cpu:.2f}x | {err} | {ok} |"
        )
    return "\n".join(lines)


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    """The case both this benchmark and profile_call.py run (the issue's: P = 4, S = 4096,
    8 heads x 64, both dtypes and passes) and the untimed warm-up calls."""
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--warmup", type=int, default=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_arguments(p)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument(
        "--one-process-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of the one-process row (default: every core of the machine)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the float64 check (its per-rank reference takes minutes at S >= 8192)",
    )
    p.add_argument(
        "--without-rank-check",
        action="store_true",
        help="add rows of tokenring's two strategies with check_ranks=False (what the per-call "
        "rank check costs in wall time)",
    )
    p.add_argument(
        "--link", type=rate_bits_per_s, help="run the ranks in the lab, links of this rate"
    )
    p.add_argument("--topology", default="mesh", choices=[t.value for t in Topology])
    p.add_argument("--out", help="write the rows as JSONL here")
    p.add_argument("--markdown", help="write the table as markdown here, with the command")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.passes = args.passes.split(",")
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {sorted(DTYPES)}")
    for x in args.passes:
        if x not in ("fwd", "fwd+bwd"):
            p.error(f"--passes: {x!r} is not one of fwd, fwd+bwd")
    if args.seq % (2 * args.world_size):
        p.error(f"--seq must be divisible by 2 * world_size for zigzag; got {args.seq}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be >= 1 and --warmup >= 0; got {args.iters}, {args.warmup}")
    if args.link is not None:
        try:
            ranks.check_lab(args, args.world_size)
        except ValueError as exc:
            p.error(str(exc))
    return args


def launch_ranks(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every rank's :func:`rank_main`, inside the lab with ``--link``; and the lab's description."""
    with ExitStack() as stack:
        per_rank = launch(
            rank_main, args, world_size=args.world_size, threads_per_rank=1,
            timeout_s=args.timeout, pg_timeout_s=max(60.0, args.timeout / 4),
            **ranks.lab_options(stack, args),
        )  # fmt: skip
    if args._lab and any(r["comm_path"] == "gloo-shm" for r in per_rank):  # as tokenring bench
        raise RuntimeError("the lab's ranks exchanged through shared memory, not its links")
    return per_rank, args._lab


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # fail here, with the extra to install, if absent; the ranks load it (with the stand-in
    # in their sys.modules, never in this process's)
    flash_attn_cpu.check_installed()
    # the ranks import this module by name: benchmarks/ on their path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    per_rank, lab = launch_ranks(args)
    one = launch(
        one_process_main,
        args,
        world_size=1,
        threads_per_rank=args.one_process_threads,
        timeout_s=args.timeout,
    )[0]
    rows = aggregate(per_rank, one)
    settings = {
        "world_size": args.world_size,
        "threads_per_rank": 1,
        "one_process_threads": args.one_process_threads,
        "seq": args.seq,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "torch": torch.__version__,
        "peer_version": per_rank[0]["peer_version"],
        "comm_path": per_rank[0]["comm_path"],
        "lab": lab,
        "git": git_sha(),
        "rounds": args.iters,
        "warmup": args.warmup,
        "loadavg": loadavg,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    text = table(rows, settings)
    print(text)
    command = "OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/peers.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "settings": settings, "command": command}) + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# tokenring beside ring-flash-attn\n\n```\n{command}\n```\n\n{text}\n")
    bad = [r for r in rows if r["ok"] is False]
    for r in bad:
        print(f"WRONG: {r['impl']} {r['dtype']} {r['pass']}: max error {r['max_error']}")
    return 0


if __name__ == "__main__":
    import peers  # the ranks unpickle rank_main as peers.rank_main, not __main__.rank_main

    sys.exit(peers.main())
