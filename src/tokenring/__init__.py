"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL).

The distribution is named ``tokenring-attention``; the import name is ``tokenring``.

Note [Eager package]
~~~~~~~~~~~~~~~~~~~~
``import tokenring`` imports the library (and torch) at once, on purpose. Importing
``torch._dynamo`` after a gloo process group exists keeps that group's worker threads alive
past ``destroy_process_group`` (torch 2.13, measured: a plain script that imports
``torch._dynamo`` after ``init_process_group`` exits with ``gloo_tcp_loop`` and two
``pt_gloo_runloop`` threads alive; imported before, none), and a gloo thread alive while
Python finalises can abort the process after every result was right (Note [Clean exit] in
tokenring.launch). The library imports dynamo (``torch.compiler.disable`` on the eager
paths, the operator's handles), so a lazy package, whose first public name a program
typically touches after ``init_process_group``, brought that back
(``test_user_program_exits_cleanly``). The command line stays quick where it can: it
imports a command's module only when that command runs (``tokenring.cli``). The torch
floor is checked before torch is imported: the installed distribution's metadata.
"""

# ruff: noqa: E402  (the torch check runs before the modules that need the newer torch)
from __future__ import annotations

import importlib.metadata
import re
import sys

__version__ = "0.1.0"  # the one place; pyproject.toml reads it ([tool.setuptools.dynamic])
MIN_TORCH = "2.6"  # the floor in pyproject.toml; dist.P2POp(..., group_peer=...) needs 2.6


def _installed_torch() -> str:
    """The torch in use: the imported module's version, else the installed distribution's
    (read from its metadata, without importing torch)."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"tokenring needs torch >= {MIN_TORCH}; no torch distribution is installed "
            f"(pip install 'torch>={MIN_TORCH}')"
        ) from None


def _check_torch(installed: str | None = None) -> None:
    """Raise ImportError naming both versions when ``installed`` (default: the torch in
    use, :func:`_installed_torch`) is older than MIN_TORCH."""
    installed = _installed_torch() if installed is None else installed
    match = re.match(r"(\d+)\.(\d+)", installed)
    floor = tuple(int(x) for x in MIN_TORCH.split("."))
    if match is None or tuple(int(x) for x in match.groups()) < floor:
        raise ImportError(
            f"tokenring needs torch >= {MIN_TORCH}; torch {installed} is installed "
            f"(pip install 'torch>={MIN_TORCH}')"
        )


_check_torch()

from tokenring.api import (
    SequenceParallelAttention,
    allgather_kv_attn,
    bidir_ring_attn,
    bidir_token_ring_attn,
    close_communicators,
    get_communicator,
    resolve_strategy,
    ring_attn,
    sequence_parallel_attn,
    token_ring_attn,
    ulysses_attn,
)
from tokenring.core.layout import (
    Layout,
    Sharding,
    global_positions,
    make_sharding,
    position_ids,
    shard,
    unshard,
)
from tokenring.core.schedule import Strategy
from tokenring.hybrid import HybridMesh, hybrid_attn, hybrid_mesh, hybrid_shard
from tokenring.inference import cached_attn
from tokenring.kvcache import DistributedKVCache, KVCacheBudgetError
from tokenring.launch import init_distributed, launch
from tokenring.model.planner import explain
from tokenring.runtime.comm import Communicator
from tokenring.strategies.cached import CachedStrategy, explain_cached

__all__ = [
    "MIN_TORCH",
    "CachedStrategy",
    "Communicator",
    "DistributedKVCache",
    "HybridMesh",
    "KVCacheBudgetError",
    "Layout",
    "SequenceParallelAttention",
    "Sharding",
    "Strategy",
    "allgather_kv_attn",
    "bidir_ring_attn",
    "bidir_token_ring_attn",
    "cached_attn",
    "close_communicators",
    "explain",
    "explain_cached",
    "get_communicator",
    "global_positions",
    "hybrid_attn",
    "hybrid_mesh",
    "hybrid_shard",
    "init_distributed",
    "launch",
    "make_sharding",
    "position_ids",
    "resolve_strategy",
    "ring_attn",
    "sequence_parallel_attn",
    "shard",
    "token_ring_attn",
    "ulysses_attn",
    "unshard",
]
