"""How gloo's collectives use the links: the measurements behind Note [Collective routing].

Usage (root, iproute2): python benchmarks/probe_collectives.py [--world-sizes 2 3 4]
    [--bytes 2097152] [--rate 100mbit] > benchmarks/results/gloo_collectives.md

On the emulated full mesh (every directed link shaped to the rate B), every rank moves X bytes
to every other rank (or, for the all-gather, contributes X), and each pattern is timed (median
of 6 after a warm-up, max over ranks) in units of X / B:

    pattern            what                                               if every pair direct
    p2p_recv_first     batched P2P to all peers, all receives posted first   1
    all_to_all_single  torch.distributed.all_to_all_single, equal splits      1
    all_to_all_uneven  the same with explicit splits (what Ulysses called until 2026-12)     1
    all_gather         all_gather_into_tensor                                 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

PATTERNS = ("p2p_recv_first", "all_to_all_single", "all_to_all_uneven", "all_gather")


def _timed(fn, reps: int = 6) -> list[float]:
    fn()  # warm-up: connections, buffers
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def probe(num_bytes: int) -> dict[str, list[float]]:
    """Runs on every rank (inside tokenring.launch): seconds per repetition of each pattern."""
    r, p = dist.get_rank(), dist.get_world_size()
    u8 = torch.uint8
    send = torch.ones(p * num_bytes, dtype=u8)
    recv = torch.empty_like(send)
    sizes = [0 if j == r else num_bytes for j in range(p)]
    send_v = torch.ones(sum(sizes), dtype=u8)
    recv_v = torch.empty_like(send_v)
    mine = torch.ones(num_bytes, dtype=u8)
    gathered = torch.empty(p * num_bytes, dtype=u8)
    outs = [torch.ones(num_bytes, dtype=u8) for _ in range(p)]
    ins = [torch.empty(num_bytes, dtype=u8) for _ in range(p)]

    def p2p() -> None:
        ops = [dist.P2POp(dist.irecv, ins[j], j) for j in range(p) if j != r]
        ops += [dist.P2POp(dist.isend, outs[j], j) for j in range(p) if j != r]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    runs = {
        "p2p_recv_first": p2p,
        "all_to_all_single": lambda: dist.all_to_all_single(recv, send),
        "all_to_all_uneven": lambda: dist.all_to_all_single(recv_v, send_v, sizes, sizes),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, mine),
    }
    return {name: _timed(fn) for name, fn in runs.items()}


def main(argv: list[str]) -> None:
    from tokenring.cli import rate_bits_per_s
    from tokenring.launch import launch
    from tokenring.model.netlab import Lab, LabConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--bytes", type=int, default=2 << 20, help="X, bytes per pair")
    parser.add_argument("--rate", type=rate_bits_per_s, default=100e6)
    args = parser.parse_args(argv)
    unit_s = args.bytes / (args.rate / 8)
    print("# gloo's collectives on the emulated full mesh\n")
    print(
        f"Reproduce with `python benchmarks/probe_collectives.py --world-sizes "
        f"{' '.join(map(str, args.world_sizes))} --bytes {args.bytes}` (root, iproute2). "
        f"torch {torch.__version__}, gloo; X = {args.bytes} bytes per pair, link "
        f"{args.rate / 1e6:g} Mbit/s per directed link, X/B = {1e3 * unit_s:.1f} ms. Each cell: "
        "the median of 6 timed calls (max over ranks) in units of X/B, then the fastest and the "
        "slowest of the 6. A "
        "collective whose every pair exchanges directly, both directions at once, takes 1.\n"
    )
    print("| P | " + " | ".join(PATTERNS) + " |")
    print("|---|" + "---|" * len(PATTERNS))
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import probe_collectives  # the workers import the function by reference

    for world in args.world_sizes:
        config = LabConfig(world_size=world, rate_bits_per_s=args.rate, topology="mesh")
        with Lab(config) as lab:
            result = launch(
                probe_collectives.probe,
                args.bytes,
                world_size=world,
                timeout_s=600,
                pg_timeout_s=300,
                wrap_command=lab.wrap_command,
                rank_env=lab.env,
                register_pid=lab.register_pid,
            )[0]
        cells = []
        for name in PATTERNS:
            units = sorted(t / unit_s for t in result[name])
            cells.append(f"{statistics.median(units):.2f} ({units[0]:.2f}-{units[-1]:.2f})")
        print(f"| {world} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
