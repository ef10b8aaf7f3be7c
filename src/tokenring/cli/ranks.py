"""Starting a bench's ranks and gathering what they return: spawned here behind a progress
bar (inside the emulated-interconnect lab with ``--link``) or, under torchrun, this process as
one of them. Shared by every bench mode and the demo."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator
from tokenring.cli import RunFailed, mem_available_bytes, report
from tokenring.cli.console import progress
from tokenring.launch import LaunchError, init_distributed, launch
from tokenring.model.netlab import Lab, LabConfig, Topology, lab_unavailable_reason

__all__ = [
    "PROCESS_BYTES",
    "check_lab",
    "check_link_time",
    "check_rank_count",
    "check_rank_memory",
    "collect_per_rank",
    "gib",
    "git_sha",
    "lab_options",
    "launch_with_progress",
    "rank_device",
    "ranks_here",
    "row_done",
    "under_torchrun",
    "world_size_of",
]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    )


def world_size_of(args: argparse.Namespace) -> int:
    """The ranks the run will have: torchrun's under torchrun, else --world-size."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else int(args.world_size)


def ranks_here(args: argparse.Namespace) -> int:
    """The run's ranks on this machine: torchrun's local ones under torchrun, else all."""
    world = world_size_of(args)
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else world


PROCESS_BYTES = 320 << 20
"""What a rank holds before its first tensor: the interpreter, torch and a gloo group."""


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def check_rank_memory(
    parts: dict[str, int],
    *,
    run: str,
    available: int | None,
    ranks_here: int,
    gpu_parts: tuple[str, ...] = (),
    ranks_per_gpu: int = 1,
    lower_host: str,
    lower_gpu: str = "",
) -> None:
    """Raise ValueError when ranks that hold about ``parts`` bytes each (a rank's peak, by
    part) cannot fit: the host parts of the ``ranks_here`` ranks on this machine against
    ``available`` (MemAvailable; None: unknown, not checked), and the ``gpu_parts`` of
    ``ranks_per_gpu`` ranks against the free memory of this rank's device (the first GPU
    where bench spawns the ranks). ``run`` names the flags of the run, ``lower_host`` and
    ``lower_gpu`` say what to lower."""
    host = sum(v for k, v in parts.items() if k not in gpu_parts)
    detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    if available is not None and host * ranks_here > available:
        raise ValueError(
            f"{run} needs about {gib(host)} of host memory per rank ({detail}), "
            f"{gib(host * ranks_here)} for the {ranks_here} ranks on this machine; "
            f"MemAvailable is {gib(available)}. {lower_host}"
        )
    if gpu_parts and torch.cuda.is_available():
        gpu = sum(parts[k] for k in gpu_parts)
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))
        if gpu * ranks_per_gpu > free:
            sharing = f" ({ranks_per_gpu} ranks per GPU)" if ranks_per_gpu > 1 else ""
            raise ValueError(
                f"{run} needs about {gib(gpu)} of GPU memory per rank{sharing}; the device has "
                f"{gib(free)} free. {lower_gpu}"
            )


def check_rank_count(args: argparse.Namespace) -> None:
    """Raise ValueError when the ranks on this machine cannot start at all: each holds
    :data:`PROCESS_BYTES` before its first tensor. Checked before anything that grows with
    the world size (a schedule has P^2 cells: ``--world-size 99999`` was killed for memory
    building them in the check, before the estimate that would have refused it)."""
    here, available = ranks_here(args), mem_available_bytes()
    if available is not None and here * PROCESS_BYTES > available:
        world = world_size_of(args)
        raise ValueError(
            f"--world-size {world}: the {here} ranks on this machine need at least "
            f"{gib(here * PROCESS_BYTES)} before any tensor ({gib(PROCESS_BYTES)} each: the "
            f"interpreter, torch and a process group); MemAvailable is {gib(available)}. "
            "Lower --world-size"
        )


def check_lab(args: argparse.Namespace, world_size: int) -> None:
    """Raise ValueError when ``--link`` cannot be emulated here (the lab's own limits, its
    privileges, torchrun's ranks that it did not start)."""
    if under_torchrun():
        raise ValueError("--link emulates links between ranks bench spawns; not under torchrun")
    try:
        LabConfig(world_size=world_size, rate_bits_per_s=args.link, topology=args.topology)
    except ValueError as exc:
        raise ValueError(f"--link with --world-size {world_size}: {exc}") from None
    reason = lab_unavailable_reason()
    if reason is not None:
        raise ValueError(f"--link needs the emulated-interconnect lab: {reason}")


def check_link_time(
    args: argparse.Namespace, world_size: int, num_bytes: float, moved: str, fewer: str = ""
) -> None:
    """Raise ValueError when ``--link`` cannot be emulated here (:func:`check_lab`) or when
    ``num_bytes`` over one link at its rate, a lower bound on the run's time, exceed
    ``--timeout``; ``moved`` says which bytes over which link (``{MB}``: their size), ``fewer``
    what else to lower."""
    check_lab(args, world_size)
    seconds = 8 * num_bytes / args.link
    if seconds > args.timeout:
        raise ValueError(
            f"--link {report.rate_text(args.link)} cannot finish within --timeout "
            f"{args.timeout:g} s: {moved.format(MB=f'{num_bytes / 1e6:.4g} MB')}, "
            f"{seconds:.4g} s at that rate; raise --link or --timeout{fewer}"
        )


def git_sha() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        command = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(command, cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def launch_with_progress(
    fn: Any,
    config: Any,
    *,
    num_rows: int,
    title: str,
    args: argparse.Namespace,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> list[Any]:
    """Every rank's ``fn(config, progress_path)`` (a finished row appends a line to the progress
    file) on ``args.world_size`` spawned ranks behind a progress bar, inside the emulated lab
    with ``args.link`` (``args._lab`` describes it); ``rank_env(rank)``: a rank's extra
    environment.

    Raises:
        RunFailed: a rank failed (the one that failed first, and its error) or ``--timeout``
            passed.
    """
    with tempfile.TemporaryDirectory(prefix="tokenring-bench-") as tmp, ExitStack() as stack:
        progress_path = os.path.join(tmp, "progress")
        bar = stack.enter_context(progress(num_rows, title))

        def poll() -> None:
            try:
                with open(progress_path) as f:
                    done = sum(1 for _ in f)
            except OSError:
                done = 0
            bar.update(bar.task_ids[0], completed=done)

        try:
            return launch(
                fn,
                config,
                progress_path,
                world_size=args.world_size,
                timeout_s=args.timeout,
                pg_timeout_s=max(60.0, args.timeout / 4),
                poll=poll,
                **lab_options(stack, args, rank_env),
            )
        except LaunchError as exc:
            if exc.failed_rank is None:  # the deadline
                raise RunFailed(f"{exc.summary} (--timeout {args.timeout:g})") from exc
            raise RunFailed(exc.summary) from exc


def lab_options(
    stack: ExitStack,
    args: argparse.Namespace,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> dict[str, Any]:
    """``launch``'s keywords for ``args.world_size`` ranks, inside the emulated lab with
    ``args.link`` (``args.topology``; the lab entered on ``stack``, ``args._lab`` describing it,
    None without); ``rank_env(rank)``: a rank's extra environment."""
    args._lab = None
    if args.link is None:
        return {"rank_env": rank_env}
    topology = Topology.parse(args.topology)
    lab_config = LabConfig(world_size=args.world_size, rate_bits_per_s=args.link, topology=topology)
    lab = stack.enter_context(Lab(lab_config))
    args._lab = lab.describe()
    return {
        "wrap_command": lab.wrap_command,
        "rank_env": lambda rank: {**lab.env(rank), **(rank_env(rank) if rank_env else {})},
        "register_pid": lab.register_pid,
    }


def row_done(progress_path: str | None) -> None:
    """On rank 0, count one finished row in the progress file (:func:`launch_with_progress`)."""
    if progress_path is not None and dist.get_rank() == 0:
        with open(progress_path, "a") as f:
            f.write("row\n")


def rank_device() -> torch.device:
    """This rank's device: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collect_per_rank(
    fn: Any, config: Any, args: argparse.Namespace, **spawn: Any
) -> list[Any] | None:
    """Every rank's ``fn(config)``: under torchrun this process is one rank (rank 0 gets the
    gathered results, the others None), else :func:`launch_with_progress` spawns the ranks
    (``spawn``: its ``num_rows``, ``title`` and ``rank_env``). Sets ``args._lab`` (None
    outside the lab)."""
    args._lab = None
    if not under_torchrun():
        return launch_with_progress(fn, config, args=args, **spawn)
    init_distributed(timeout_s=args.timeout)
    try:
        mine = fn(config)
        comm = get_communicator()
        per_rank: list[Any] = comm.all_gather_object(mine, what="the benchmark's results")
        args.world_size = comm.world_size
        rank = comm.rank
        comm.barrier(label="results gathered")
    finally:
        # Tear the groups down on every rank before any exits: a rank leaving with live
        # gloo threads while a peer still talks aborts ("terminate called ...").
        dist.destroy_process_group()
    return per_rank if rank == 0 else None
