"""``tokenring bench --mode memory``: peak memory per rank beside what the tensors need.

Per strategy and local length s, every rank runs one forward + backward on its shard and
measures its peak (Note [Measuring peak memory]); each row puts the busiest rank's peak beside
the minimum any implementation needs, and their ratio (the goal: at most 2, README "Memory")::

    minimum = q + k + v + out + lse + dout + dq + dk + dv     (bytes, this rank's shards)

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P world size.

Note [Measuring peak memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: live tensors in
PyTorch's caching allocator (not its cache, not NCCL's buffers).

CPU: PyTorch's CPU allocator keeps no counters, so we read the kernel's. The resident-set
high-water mark is reset (``5`` into ``/proc/self/clear_refs``, Linux >= 4.0) right before the
call and read (``VmHWM`` in ``/proc/self/status``) right after; the peak is the inputs' bytes
plus ``VmHWM - VmRSS`` at the reset. Freed tensors must leave the resident set, but glibc's
heap keeps freed blocks: the ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block
above 64 KiB its own mapping, returned when freed; set by the launcher, checked here). Pages,
Python objects and gloo's socket buffers still over-count a little (a few MiB).

The ranks it spawns exchange over gloo's sockets (``TOKENRING_SHARED_MEMORY=0``, ``RANK_ENV``;
each row names its ``comm_path``): the shared-memory transport's segments are mapped by sender
and receiver, so two resident sets would count each message, and the segments kept for the
next call sit in the baseline: with it on, TokenRing's peak at P = 4, s = 4096, causal moved
between 1.59x and 2.08x over four runs. They are the transport's buffers, not counted here, as
NCCL's are not on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator, sequence_parallel_attn
from tokenring.cli import (
    ArgumentAdder,
    int_list,
    mem_available_bytes,
    options,
    ranks,
    split_list,
)
from tokenring.cli.models import DTYPES
from tokenring.cli.report import write_records
from tokenring.core.schedule import AttentionShape, Pass, Strategy
from tokenring.model.simulate import strategy_schedule
from tokenring.runtime.shm import ENV_VAR as SHARED_MEMORY_ENV_VAR

__all__ = [
    "MMAP_THRESHOLD_ENV",
    "RANK_ENV",
    "MemoryBenchConfig",
    "PeakMemory",
    "estimate_rank_bytes",
    "minimum_bytes",
    "peak_memory",
    "run_rank",
]

MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Environment for CPU ranks whose peak memory is measured (Note [Measuring peak memory])."""

RANK_ENV = {**MMAP_THRESHOLD_ENV, SHARED_MEMORY_ENV_VAR: "0"}
"""Environment of the ranks ``--mode memory`` spawns: the one above, on gloo's sockets."""

_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated",
    "cpu": "VmHWM (MALLOC_MMAP_THRESHOLD_=65536)",
}
_HEADS = ("heads_q", "heads_kv", "head_dim")
# every strategy but the hybrid (a 2-D mesh: measured through its parts)
DEFAULT_STRATEGIES = tuple(s for s in Strategy if s is not Strategy.HYBRID)


def minimum_bytes(
    *,
    batch: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    backward: bool = True,
) -> int:
    """Bytes of one rank's inputs + outputs (+ gradients): q, k, v, out, lse (+ dout, dq,
    dk, dv). lse is in the accumulation dtype (float64 for float64, else float32)."""
    elem = dtype.itemsize
    acc = 8 if dtype == torch.float64 else 4
    q_bytes = batch * seq_local * heads_q * head_dim * elem
    kv_bytes = batch * seq_local * heads_kv * head_dim * elem
    lse_bytes = batch * heads_q * seq_local * acc
    total = 2 * q_bytes + 2 * kv_bytes + lse_bytes  # q, out; k, v; lse
    if backward:
        total += 2 * q_bytes + 2 * kv_bytes  # dout, dq; dk, dv
    return total


@dataclass(slots=True)
class PeakMemory:
    """Filled in by :func:`peak_memory`: bytes above the level at entry, at the peak."""

    extra_bytes: int = 0
    method: str = ""


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key} line")


@contextmanager
def peak_memory(device: torch.device) -> Iterator[PeakMemory]:
    """Measure the peak memory of the block, above the level at entry, on ``device``.

    Raises:
        RuntimeError: CPU measurement where it cannot be honest: not Linux, or
            ``MALLOC_MMAP_THRESHOLD_`` not set (Note [Measuring peak memory]).
    """
    result = PeakMemory()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.extra_bytes = torch.cuda.max_memory_allocated(device) - base
        result.method = _METHODS["cuda"]
        return
    if device.type != "cpu":
        raise RuntimeError(f"peak memory is measured on cpu and cuda; got device {device}")
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("peak CPU memory needs Linux (/proc/self/clear_refs, VmHWM)")
    for name, value in MMAP_THRESHOLD_ENV.items():
        if os.environ.get(name) != value:
            raise RuntimeError(
                f"peak CPU memory needs {name}={value} in the environment of the process at "
                f"start (glibc keeps freed blocks resident otherwise); got "
                f"{os.environ.get(name)!r}"
            )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set
    base = _proc_status_bytes("VmRSS")
    yield result
    result.extra_bytes = max(0, _proc_status_bytes("VmHWM") - base)
    result.method = _METHODS["cpu"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBenchConfig:
    """What ``--mode memory`` measures."""

    seq_locals: tuple[int, ...]
    """Local lengths s (tokens per rank); S = P * s."""
    strategies: tuple[Strategy, ...] = DEFAULT_STRATEGIES
    """Strategies to measure, one row per (strategy, s)."""
    batch: int = 1
    heads_q: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    """Causal attention (zigzag layout) or full attention (contiguous)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (rank r on GPU r mod the GPU count: with fewer GPUs than ranks the
    ranks share them over the staged path, Note [Staged path] in tokenring.runtime.comm)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda'; got {self.device!r}")
        if not self.seq_locals or any(s < 2 or s % 2 for s in self.seq_locals):
            raise ValueError(f"seq_locals must be even lengths >= 2; got {self.seq_locals}")
        if not self.strategies:
            raise ValueError("strategies must not be empty")
        if Strategy.HYBRID in self.strategies:
            raise ValueError("strategy 'hybrid' runs on a 2-D mesh; measure it with its parts")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if min(self.batch, self.heads_q, self.heads_kv, self.head_dim) < 1:
            raise ValueError("batch, heads_q, heads_kv and head_dim must be >= 1")
        AttentionShape(**{k: getattr(self, k) for k in _HEADS})  # heads_kv must divide heads_q


def _one_call(config: MemoryBenchConfig, strategy: Strategy, s: int, device: torch.device) -> int:
    """Peak bytes of one forward + backward above the inputs (q, k, v, dout) on this rank."""

    dtype = DTYPES[config.dtype]
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    b, hq, hkv, d = config.batch, config.heads_q, config.heads_kv, config.head_dim

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(b, s, heads, d, generator=gen, device=device, dtype=dtype)

    q, k, v = (x.requires_grad_(True) for x in (randn(hq), randn(hkv), randn(hkv)))
    dout = randn(hq)
    layout = "zigzag" if config.causal else "contiguous"

    def call() -> None:
        out = sequence_parallel_attn(
            q, k, v, strategy=strategy, causal=config.causal, layout=layout, check_ranks=False
        )
        assert isinstance(out, torch.Tensor)
        out.backward(dout)

    call()  # warm up: process groups, schedules, lazily built state
    q.grad = k.grad = v.grad = None
    comm = get_communicator()
    comm.barrier(label="bench_memory: before the measured call")
    with peak_memory(device) as peak:
        call()
    comm.barrier(label="bench_memory: after the measured call")
    return peak.extra_bytes


def run_rank(config: MemoryBenchConfig, progress_path: str | None = None) -> dict[str, Any]:
    """Measure every (strategy, s) of ``config`` on this rank."""
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = []
    for strategy, s in itertools.product(config.strategies, config.seq_locals):
        extra = _one_call(config, strategy, s, device)
        rows.append({"strategy": strategy.value, "seq_local": s, "extra_bytes": extra})
        ranks.row_done(progress_path)
    path = get_communicator().path(device)
    return {"rank": dist.get_rank(), "device": str(device), "comm_path": path, "rows": rows}


def aggregate(per_rank: list[dict[str, Any]], config: MemoryBenchConfig) -> list[dict[str, Any]]:
    """One row per (strategy, s): the busiest rank's peak beside the minimum."""
    world = len(per_rank)
    rows = []
    for index, first in enumerate(per_rank[0]["rows"]):
        s = first["seq_local"]
        shape: dict[str, Any] = {k: getattr(config, k) for k in ("batch", *_HEADS)}
        shape.update(seq_local=s, dtype=DTYPES[config.dtype])
        minimum = minimum_bytes(**shape)
        # q, dout, k, v, allocated before the call: as many bytes as dout, dq, dk, dv
        inputs = minimum - minimum_bytes(**shape, backward=False)
        peak = inputs + max(r["rows"][index]["extra_bytes"] for r in per_rank)
        rows.append(
            {
                "strategy": first["strategy"],
                "world_size": world,
                "seq_local": s,
                "seq": world * s,
                "peak_bytes": peak,
                "minimum_bytes": minimum,
                "ratio": peak / minimum,
            }
        )
    return rows


def add_arguments(parser: ArgumentAdder) -> None:
    """The options of ``--mode memory`` (the shared ones come from ``tokenring bench``)."""
    add = parser.add_argument
    seq_local_help = "comma-separated tokens per rank (S = P * s)"
    add("--seq-local", default="4096,16384,65536", help=seq_local_help)
    device_help = "where the ranks' tensors live (default: cuda when available)"
    add("--device", choices=["cpu", "cuda"], help=device_help)


def config_from_args(args: argparse.Namespace) -> MemoryBenchConfig:
    """The run the arguments describe (its heads checked by ``bench``'s ``check_args``).
    Raises ValueError naming the flag that is wrong."""
    strategies: tuple[Strategy, ...] = DEFAULT_STRATEGIES
    if args.strategies is not None:
        names = ", ".join(s.value for s in DEFAULT_STRATEGIES)
        strategies = split_list(args.strategies, "--strategies", Strategy.parse, names)
        if Strategy.HYBRID in strategies:
            raise ValueError(
                "--strategies hybrid is not for --mode memory: it runs on a 2-D mesh, measure "
                f"its parts (expected any of {names}); got --strategies {args.strategies}"
            )
    seq_locals = int_list(args.seq_local, "--seq-local", 2)
    odd = [s for s in seq_locals if s % 2]
    if odd:
        raise ValueError(
            f"--seq-local must be even lengths >= 2 (tokens per rank); "
            f"got {args.seq_local!r} ({', '.join(map(str, odd))} odd)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    try:
        return MemoryBenchConfig(
            **options(args, "batch", "head_dim", "dtype"),
            seq_locals=seq_locals,
            strategies=strategies,
            heads_q=args.heads if args.heads is not None else 8,
            heads_kv=args.kv_heads if args.kv_heads is not None else 8,
            causal=args.causal != "no",
            device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        )
    except ValueError as exc:
        raise ValueError(f"--mode memory: {exc}") from None


def estimate_rank_bytes(config: MemoryBenchConfig) -> dict[str, int]:
    """About how many bytes one rank holds at its peak, by part, at the largest s:

    - ``call``: what the measured call holds: the inputs, outputs and gradients
      (:func:`minimum_bytes`) and what the strategy keeps beside them, at most as much again
      (README "Memory"; measured up to 2.08x) and a quarter more for the others;
    - ``process``: the interpreter, torch and the process group.

    On CUDA ``call`` lives on the GPU.
    """
    shape: dict[str, Any] = {k: getattr(config, k) for k in ("batch", *_HEADS)}
    minimum = minimum_bytes(**shape, seq_local=max(config.seq_locals), dtype=DTYPES[config.dtype])
    return {"call": 5 * minimum // 2, "process": ranks.PROCESS_BYTES}


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before a rank starts; keeps the config on ``args``."""
    config = config_from_args(args)
    world = ranks.world_size_of(args)
    if ranks.under_torchrun() and config.device == "cpu":  # this process is a rank
        for name, value in MMAP_THRESHOLD_ENV.items():
            if os.environ.get(name) != value:  # peak_memory would raise in every rank
                raise ValueError(
                    f"--mode memory on cpu under torchrun needs {name}={value} in the ranks' "
                    f"environment (Note [Measuring peak memory]); got {os.environ.get(name)!r}"
                )
    layout = "zigzag" if config.causal else "contiguous"
    where: dict[str, Any] = dict(layout=layout, causal=config.causal, world_size=world)
    where |= dict(seq_local=min(config.seq_locals), heads_q=config.heads_q)  # the tightest s
    for strategy, pass_ in itertools.product(config.strategies, Pass):
        try:  # what the ranks' calls build first
            strategy_schedule(strategy, pass_, heads_kv=config.heads_kv, **where)
        except (ValueError, NotImplementedError) as exc:
            named = "--strategies " if args.strategies is not None else "the default strategy "
            raise ValueError(
                f"--mode memory: {named}{strategy.value} cannot run on {world} ranks: {exc}"
            ) from None
    on_gpu = config.device == "cuda"
    per_gpu = 1  # spawned ranks share the GPUs: rank r on GPU r mod the count
    if on_gpu and not ranks.under_torchrun():
        per_gpu = -(-world // max(1, torch.cuda.device_count()))
    ranks.check_rank_memory(
        estimate_rank_bytes(config),
        run=(
            f"--mode memory at --seq-local {max(config.seq_locals)} --batch {config.batch} "
            f"on {world} ranks"
        ),
        available=mem_available_bytes(),
        ranks_here=ranks.ranks_here(args),
        gpu_parts=("call",) if on_gpu else (),
        ranks_per_gpu=per_gpu,
        lower_host="Lower --seq-local, --batch or the number of ranks per machine",
        lower_gpu="Lower --seq-local or --batch",
    )
    args._config = config


def run(args: argparse.Namespace) -> int:
    """``tokenring bench --mode memory``."""

    config: MemoryBenchConfig = args._config
    num_rows = len(config.strategies) * len(config.seq_locals)
    title = f"bench memory: {num_rows} rows on {args.world_size} ranks"
    per_rank = ranks.collect_per_rank(
        run_rank, config, args, num_rows=num_rows, title=title, rank_env=lambda _: dict(RANK_ENV)
    )
    if per_rank is None:
        return 0
    rows = aggregate(per_rank, config)
    settings = {
        "mode": "memory",
        "world_size": len(per_rank),
        **{k: getattr(config, k) for k in ("batch", *_HEADS, "dtype", "causal")},
        "device": per_rank[0]["device"],
        "comm_path": per_rank[0]["comm_path"],
        "method": _METHODS["cuda" if per_rank[0]["device"].startswith("cuda") else "cpu"],
        "torch": torch.__version__,
        "git_sha": ranks.git_sha(),
    }
    write_records([{**settings, **row} for row in rows], args)
    if not args.json:
        print(
            f"peak memory per rank, fwd+bwd: P={settings['world_size']} B={config.batch} "
            f"Hq={config.heads_q} Hkv={config.heads_kv} D={config.head_dim} {config.dtype} "
            f"{'causal' if config.causal else 'full'} on {settings['device']} over "
            f"{settings['comm_path']} ({settings['method']})"
        )
        print(f"{'strategy':<18}{'s':>8}{'peak MiB':>11}{'minimum MiB':>13}{'peak/min':>10}")
        for row in rows:
            print(
                f"{row['strategy']:<18}{row['seq_local']:>8}{row['peak_bytes'] / 2**20:>11.1f}"
                f"{row['minimum_bytes'] / 2**20:>13.1f}{row['ratio']:>10.2f}"
            )
    return 0
