"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL).

The distribution is named ``tokenring-attention``; the import name is ``tokenring``.

Note [Lazy package]
~~~~~~~~~~~~~~~~~~~
``import tokenring`` loads neither torch nor a submodule: each public name below is
imported from its module on first use (PEP 562 ``__getattr__``), so the command line
(``tokenring --help``) starts in a fraction of a second and imports a command's module
only when that command runs. The torch floor is checked here anyway: the imported torch's
version, else the installed distribution's metadata (no torch import). ``launch`` is both
a submodule and the function exported under that name: importing the submodule (``from
tokenring.launch import ...``) must not replace the function on the package, which
``_Package.__setattr__`` prevents. The operators ``torch.ops.tokenring.*`` are registered
by ``tokenring.api``, so on first use of a public name: code that reaches them directly
(``torch.export.load`` of a program that calls them) imports ``tokenring.api`` first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import types
from typing import TYPE_CHECKING, Any

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

# public name -> the module that defines it (Note [Lazy package])
_EXPORTS: dict[str, str] = {
    "SequenceParallelAttention": "tokenring.api",
    "allgather_kv_attn": "tokenring.api",
    "bidir_ring_attn": "tokenring.api",
    "bidir_token_ring_attn": "tokenring.api",
    "close_communicators": "tokenring.api",
    "get_communicator": "tokenring.api",
    "resolve_strategy": "tokenring.api",
    "ring_attn": "tokenring.api",
    "sequence_parallel_attn": "tokenring.api",
    "token_ring_attn": "tokenring.api",
    "ulysses_attn": "tokenring.api",
    "CachedStrategy": "tokenring.cached_schedule",
    "explain_cached": "tokenring.cached_schedule",
    "Communicator": "tokenring.comm",
    "HybridMesh": "tokenring.hybrid",
    "hybrid_attn": "tokenring.hybrid",
    "hybrid_mesh": "tokenring.hybrid",
    "hybrid_shard": "tokenring.hybrid",
    "cached_attn": "tokenring.inference",
    "DistributedKVCache": "tokenring.kvcache",
    "KVCacheBudgetError": "tokenring.kvcache",
    "init_distributed": "tokenring.launch",
    "launch": "tokenring.launch",
    "Layout": "tokenring.layout",
    "Sharding": "tokenring.layout",
    "global_positions": "tokenring.layout",
    "make_sharding": "tokenring.layout",
    "position_ids": "tokenring.layout",
    "shard": "tokenring.layout",
    "unshard": "tokenring.layout",
    "explain": "tokenring.planner",
    "Strategy": "tokenring.schedule",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below
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


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenring' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """The package module: an imported submodule never hides the function of the same name
    (Note [Lazy package])."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return  # the import system binding the submodule ``tokenring.launch``
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
