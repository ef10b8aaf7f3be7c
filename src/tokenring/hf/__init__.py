"""Hugging Face transformers integration (``pip install "tokenring-attention[hf]"``).

- ``attention``: tokenring as a model's attention implementation (:func:`register`,
  :class:`SequenceParallel`), the batch and loss helpers of a training loop. Importing it does
  not import transformers; :func:`register` does.
- ``generation``: :func:`generate` (``model.generate`` over a sharded KV cache) and
  :class:`ShardedKVCache`. It imports transformers, so this package reaches it on first use.
- ``trainer``: :class:`tokenring.hf.trainer.SequenceParallelTrainer` (transformers' ``Trainer``
  on sequence shards; imports transformers and accelerate).
"""

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
    "data_parallel_loss",
    "gather_sequence",
    "generate",
    "register",
    "shard_batch",
    "shift_labels",
]

_GENERATION = frozenset({"generate", "ShardedKVCache"})


def __getattr__(name: str) -> Any:
    """``generate`` and ``ShardedKVCache`` live in ``tokenring.hf.generation``, which imports
    transformers: load it when first asked for (PEP 562), not when this package is imported."""
    if name in _GENERATION:
        return getattr(importlib.import_module("tokenring.hf.generation"), name)
    raise AttributeError(f"module 'tokenring.hf' has no attribute {name!r}")
