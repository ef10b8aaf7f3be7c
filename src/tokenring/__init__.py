"""tokenring: sequence-parallel attention on torch.distributed.

TokenRing (pass-Q: Q blocks travel the ring, partial outputs return on the other direction)
and Ring attention (pass-KV), forward and backward, on CPU (gloo) and GPU (NCCL).

The distribution is named ``tokenring-attention``; the import name is ``tokenring``.

Note [Lazy package]
~~~~~~~~~~~~~~~~~~~
``import tokenring`` imports neither torch nor the
library: it checks the torch floor against the installed distribution's metadata
(``_check_torch``) and defines ``__version__``. The first public name a program uses
(``tokenring.ring_attn``, ``from tokenring import launch``, any name of ``__all__``, or one
of the submodules the library's import binds, ``tokenring.runtime``) loads the whole library
at once (PEP 562 ``__getattr__``: :func:`_load`); from then on the names are plain
attributes; ``dir(tokenring)`` lists them without loading. So ``tokenring --help`` runs
without torch: the command line imports a command's module only when that command runs
(``tokenring.cli``).

The package was eager once, for a measured reason: lazy, a program that imports torch and
tokenring, calls ``init_process_group`` and only then uses the library ended with the
default group's gloo threads alive past ``destroy_process_group``, and a gloo thread alive
while Python finalises can abort the process after every result was right (Note [Clean
exit] in tokenring.launch). The cause: loading the library imports torch._dynamo, which
imports torch.distributed.nn.functional, whose functions take ``group=group.WORLD`` as a
default argument, evaluated at import; imported after ``init_process_group`` they hold the
default group for good (Note [Groups in default arguments] in tokenring.runtime.comm). The
library's exit hook, ``close_communicators``, sets those defaults back to None before
Python finalises, so the order of the imports no longer matters at exit
(``test_user_program_exits_cleanly`` runs both orders). Until then a destroyed default
group keeps its threads; ``close_communicators()`` before ``destroy_process_group()``
releases them at once.

``tokenring.launch`` is the function, as it always was, even once the submodule of the same
name is imported: the import system binds each submodule it imports on its package, and
``_Package.__setattr__`` leaves the public names to the library's objects.
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

# module -> the public names it gives (None: its __all__), in the order the library loads
# (api first, as always)
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
# the submodules that loading the library binds here (what the eager package offered)
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
    """Import the library (and torch) and bind every public name here (Note [Lazy
    package]). Idempotent."""
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
    """The public names too before they are loaded (listing them loads nothing)."""
    return sorted({*globals(), *__all__, *_MODULES})


class _Package(types.ModuleType):
    """This package's module type (Note [Lazy package]). Importing a submodule binds it on
    its package; for the submodule ``tokenring.launch`` that would replace the function
    ``launch``, or, imported before the library is loaded, stand in for it. A public name
    is never bound to a module, so it stays (or is loaded as) the library's object."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # the module stays reachable as sys.modules["tokenring.launch"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
