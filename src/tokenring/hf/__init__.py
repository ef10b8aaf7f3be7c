"""Hugging Face transformers integration (``pip install "tokenring-attention[hf]"``):
``attention`` (:func:`register`, :class:`SequenceParallel`, training helpers; transformers is
imported by :func:`register`), ``generation`` (:func:`generate`, :class:`ShardedKVCache`;
loaded on first use) and ``trainer`` (``SequenceParallelTrainer``)."""

from __future__ import annotations

import importlib
from typing import Any

from tokenring.hf.attention import (
    ATTN_IMPLEMENTATIONS,
    LocalBatch,
    SequenceParallel,
    all_reduce_gradients,
    broadcast_batch,
    causal_lm_loss,
    check_model,
    data_parallel_loss,
    gather_sequence,
    register,
    shard_batch,
    shift_labels,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "LocalBatch",
    "SequenceParallel",
    "ShardedKVCache",
    "all_reduce_gradients",
    "broadcast_batch",
    "causal_lm_loss",
    "check_model",
    "data_parallel_loss",
    "gather_sequence",
    "generate",
    "register",
    "shard_batch",
    "shift_labels",
]

_GENERATION = frozenset({"generate", "ShardedKVCache"})


def __getattr__(name: str) -> Any:
    """Load ``tokenring.hf.generation`` (it imports transformers) on first use (PEP 562)."""
    if name in _GENERATION:
        return getattr(importlib.import_module("tokenring.hf.generation"), name)
    raise AttributeError(f"module 'tokenring.hf' has no attribute {name!r}")
