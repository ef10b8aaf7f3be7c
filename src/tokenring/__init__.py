"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL).

The distribution is named ``tokenring-attention``; the import name is ``tokenring``.
"""

# ruff: noqa: E402  (the torch check runs before the modules that need the newer torch)
import re

import torch

__version__ = "0.1.0"  # the one place; pyproject.toml reads it ([tool.setuptools.dynamic])
MIN_TORCH = "2.6"  # the floor in pyproject.toml; dist.P2POp(..., group_peer=...) needs 2.6


def _check_torch(installed: str = torch.__version__) -> None:
    """Raise ImportError naming both versions when ``installed`` is older than MIN_TORCH."""
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
from tokenring.cached_schedule import CachedStrategy, explain_cached
from tokenring.comm import Communicator
from tokenring.hybrid import HybridMesh, hybrid_attn, hybrid_mesh, hybrid_shard
from tokenring.inference import cached_attn
from tokenring.kvcache import DistributedKVCache, KVCacheBudgetError
from tokenring.launch import init_distributed, launch
from tokenring.layout import (
    Layout,
    Sharding,
    global_positions,
    make_sharding,
    position_ids,
    shard,
    unshard,
)
from tokenring.planner import explain
from tokenring.schedule import Strategy

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
