"""Hugging Face transformers integration (``pip install "tokenring-attention[hf]"``):
``attention`` (:func:`register`, :class:`SequenceParallel`, training helpers; transformers is
imported by :func:`register`), ``generation`` (:func:`generate`, :class:`ShardedKVCache`;
loaded on first use) and ``trainer`` (``SequenceParallelTrainer``)."""

from __future__ import annotations

import importlib
from typing import Any

from tokenring.hf import attention
from tokenring.hf.attention import *  # noqa: F403  (every name of attention.__all__)

_GENERATION = ("ShardedKVCache", "generate")  # loaded by __getattr__
__all__ = [*attention.__all__, *_GENERATION]


def __getattr__(name: str) -> Any:
    """Load ``tokenring.hf.generation`` (it imports transformers) on first use (PEP 562)."""
    if name in _GENERATION:
        return getattr(importlib.import_module("tokenring.hf.generation"), name)
    raise AttributeError(f"module 'tokenring.hf' has no attribute {name!r}")
