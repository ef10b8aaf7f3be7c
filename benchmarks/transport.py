"""What moving a message costs between two ranks on one host: gloo's sockets against the
shared-memory transport (Note [Shared-memory transport] in tokenring.runtime.shm).

Two gloo ranks, one thread each, swap one message of each size through
``Communicator.exchange`` (the library's own path: headers, counting, receives posted first),
both directions at once, ``--iters`` times after a warm-up; each rank waits for its receive and
its send and touches nothing else. Per swap and rank: the wall time, and the process's CPU time
(all its threads: gloo's I/O threads included) in total and per MiB sent.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/transport.py \
        --markdown benchmarks/results/transport.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from tokenring import launch
from tokenring.core.schedule import Payload, Transfer
from tokenring.runtime.comm import Communicator

SIZES_KIB = (4, 64, 512, 2048, 8192)


def _swap(comm: Communicator, x: torch.Tensor, step: int) -> None:
    rank = comm.rank
    peer = 1 - rank
    sent = Transfer(
        payload=Payload.Q, src=rank, dst=peer, owner=rank, rows=(0, 1), step=step, after_segments=0
    )
    wanted = Transfer(
        payload=Payload.Q, src=peer, dst=rank, owner=peer, rows=(0, 1), step=step, after_segments=0
    )
    pending = comm.exchange([(sent, [x])], [(wanted, [(tuple(x.shape), x.dtype)])], device=x.device)
    got = pending[wanted].wait()
    del got
    comm.wait_sends()


def rank_main(iters: int) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for shared in (False, True):
        comm = Communicator(shared_memory=shared, timeout_s=60)
        for kib in SIZES_KIB:
            x = torch.randn(kib * 256)  # float32: kib KiB
            for step in range(3):
                _swap(comm, x, step)
            dist.barrier()
            walls, cpus = [], []
            for step in range(iters):
                wall0, cpu0 = time.perf_counter(), time.process_time()
                _swap(comm, x, step)
                walls.append(time.perf_counter() - wall0)
                cpus.append(time.process_time() - cpu0)
            cpu_ms = statistics.median(cpus) * 1e3
            rows.append(
                {
                    "path": comm.path(torch.device("cpu")),
                    "kib": kib,
                    "wall_ms": statistics.median(walls) * 1e3,
                    "cpu_ms": cpu_ms,
                    "cpu_ms_per_mib": cpu_ms / (kib / 1024),
                }
            )
        comm.close()
    return rows


def table(per_rank: list[list[dict[str, float | str]]]) -> str:
    lines = [
        "| path | message KiB | wall ms per swap | process cpu ms per swap | cpu ms per MiB sent |",
        "|---|---|---|---|---|",
    ]
    for i, row in enumerate(per_rank[0]):
        mean = {
            k: statistics.mean(float(r[i][k]) for r in per_rank)
            for k in ("wall_ms", "cpu_ms", "cpu_ms_per_mib")
        }
        lines.append(
            f"| {row['path']} | {row['kib']} | {mean['wall_ms']:.3f} | {mean['cpu_ms']:.3f} | "
            f"{mean['cpu_ms_per_mib']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--markdown", help="also write the table here, with the command")
    args = p.parse_args(argv)
    per_rank = launch(rank_main, args.iters, world_size=2, threads_per_rank=1)
    text = table(per_rank)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                "# Moving a message on one host: gloo's sockets against shared memory\n\n"
                "```\nOMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/transport.py "
                f"--iters {args.iters} --markdown {args.markdown}\n```\n\n"
                f"2 gloo ranks x 1 thread, both swapping a float32 message of each size at once; "
                f"median of {args.iters} swaps, the mean over the ranks; torch "
                f"{torch.__version__}.\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    import transport  # the ranks unpickle rank_main as transport.rank_main

    raise SystemExit(transport.main())
