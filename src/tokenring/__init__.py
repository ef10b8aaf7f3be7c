"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL). The
distribution is named ``tokenring-attention``; the import name is ``tokenring``.

Note [Lazy package]
~~~~~~~~~~~~~~~~~~~
``import tokenring`` imports neither torch nor the library: it checks the torch floor against
the installed metadata (``_check_torch``) and defines ``__version__``. The first public name
used (any name of ``__all__`` or a submodule the library binds, ``tokenring.runtime``) loads
the whole library (PEP 562 ``__getattr__``: :func:`_load`); ``dir(tokenring)`` lists the names
without loading. So ``tokenring --help`` runs without torch.

Loading imports torch._dynamo, whose torch.distributed.nn.functional holds
``group=group.WORLD`` in default arguments when imported after ``init_process_group``; the
exit hook ``close_communicators`` clears them (Note [Groups in default arguments] in
tokenring.runtime.comm), so the import order does not matter at exit (Note [Clean exit] in
tokenring.launch).

``tokenring.launch`` stays the function once the submodule of that name is imported:
``_Package.__setattr__`` never binds a module over a public name.
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
    """The torch in use: the imported module's version, else the installed distribution's."""
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


def _older_than(installed: str, floor: str) -> bool:
    """Whether version ``installed`` ("2.13.0+cpu") is older than ``floor`` ("2.6") by its
    major.minor, or unreadable."""
    match = re.match(r"(\d+)\.(\d+)", installed)
    return match is None or tuple(int(x) for x in match.groups()) < tuple(
        int(x) for x in floor.split(".")
    )


def _check_torch(installed: str | None = None) -> None:
    """Raise ImportError naming both versions when ``installed`` (default: the torch in use)
    is older than MIN_TORCH."""
    installed = _installed_torch() if installed is None else installed
    if _older_than(installed, MIN_TORCH):
        raise ImportError(
            f"tokenring needs torch >= {MIN_TORCH}; torch {installed} is installed "
            f"(pip install 'torch>={MIN_TORCH}')"
        )


_check_torch()

# module -> the public names it gives (None: its __all__), in load order
_EXPORTS: dict[str, tuple[str, ...] | None] = {
    "tokenring.api": None,
    "tokenring.core.layout": (
        "Layout",
        "Sharding",
        "global_positions",
        "make_sharding",
        "position_ids",
        "shard",
        "unshard",
    ),
    "tokenring.core.schedule": ("Strategy",),
    "tokenring.hybrid": ("HybridMesh", "hybrid_attn", "hybrid_mesh", "hybrid_shard"),
    "tokenring.inference": ("cached_attn",),
    "tokenring.kvcache": ("DistributedKVCache", "KVCacheBudgetError"),
    "tokenring.launch": ("init_distributed", "launch"),
    "tokenring.model.planner": ("explain", "explain_cached"),
    "tokenring.runtime.comm": ("Communicator",),
    "tokenring.strategies.cached": ("CachedStrategy",),
}
# the submodules that loading the library binds here
_MODULES = frozenset(
    {"api", "core", "hybrid", "inference", "kvcache", "model", "runtime", "strategies"}
)

if TYPE_CHECKING:  # the names, for type checkers; at run time _load binds them
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
    from tokenring.model.planner import explain, explain_cached
    from tokenring.runtime.comm import Communicator
    from tokenring.strategies.cached import CachedStrategy

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


def _load() -> None:
    """Import the library and bind every public name here (Note [Lazy package])."""
    namespace = globals()
    for module_name, names in _EXPORTS.items():
        module = importlib.import_module(module_name)
        for name in module.__all__ if names is None else names:
            namespace[name] = getattr(module, name)


if not TYPE_CHECKING:  # to a type checker, a module __getattr__ makes every name valid

    def __getattr__(name: str) -> Any:
        """A public name or a library submodule not bound yet: load the library (PEP 562)."""
        if name in __all__ or name in _MODULES:
            _load()
            namespace = globals()
            if name in namespace:
                return namespace[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names too, without loading them."""
    return sorted({*globals(), *__all__, *_MODULES})


class _Package(types.ModuleType):
    """This package's module type: a public name is never bound to a submodule (such as
    ``tokenring.launch`` over the function ``launch``; Note [Lazy package])."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # the module stays reachable as sys.modules["tokenring.launch"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
