"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL).
"""

from tokenring.api import (
    SequenceParallelAttention,
    bidir_ring_attn,
    get_communicator,
    ring_attn,
    sequence_parallel_attn,
    token_ring_attn,
)
from tokenring.comm import Communicator
from tokenring.launch import init_distributed, launch
from tokenring.layout import Layout, global_positions, shard, unshard
from tokenring.schedule import Strategy

__all__ = [
    "Communicator",
    "Layout",
    "SequenceParallelAttention",
    "Strategy",
    "bidir_ring_attn",
    "get_communicator",
    "global_positions",
    "init_distributed",
    "launch",
    "ring_attn",
    "sequence_parallel_attn",
    "shard",
    "token_ring_attn",
    "unshard",
]

__version__ = "0.1.0"
