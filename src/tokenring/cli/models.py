"""The attention layers and dtypes the command line knows by name: CPU-sized stand-ins for the
benches, and the shapes of well-known models for the simulator."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenring.cli import ArgumentAdder, int_at_least
from tokenring.core.schedule import AttentionShape, Strategy

__all__ = [
    "BENCH_MODELS",
    "DTYPES",
    "KNOWN_MODELS",
    "TOLERANCE",
    "KnownModel",
    "add_hybrid_arguments",
    "check_read",
    "checked",
    "models_from_args",
]

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""The benches' input dtypes, by ``--dtype`` name."""
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
"""Max abs error against float64 for a bench row to pass, by dtype name (``--tolerance``)."""


def checked(errors: Iterable[float], dtype: str, tolerance: float | None) -> dict[str, Any]:
    """A row's ``max_error`` over its ranks, its ``tolerance`` (by dtype where None) and
    whether the error is within it (``verified``)."""
    error, tol = max(errors), TOLERANCE[dtype] if tolerance is None else tolerance
    return {"max_error": error, "tolerance": tol, "verified": error <= tol}


# Llama2-7B has 32 heads of 128 and Llama3-8B 32 query / 8 kv heads of 128; the benches keep
# their head ratios at a size two CPU cores run in about a minute.
BENCH_MODELS: dict[str, AttentionShape] = {
    "mha-8/8": AttentionShape(heads_q=8, heads_kv=8, head_dim=64),
    "gqa-8/2": AttentionShape(heads_q=8, heads_kv=2, head_dim=64),
}
"""The benches' default layers, by the label of their rows."""


def models_from_args(args: argparse.Namespace) -> dict[str, AttentionShape]:
    """The bench's layers: the built-in ones at ``--head-dim``, or the one custom layer of
    ``--heads`` and ``--kv-heads``."""
    if args.heads is None:
        return {n: dataclasses.replace(m, head_dim=args.head_dim) for n, m in BENCH_MODELS.items()}
    shape = AttentionShape(heads_q=args.heads, heads_kv=args.kv_heads, head_dim=args.head_dim)
    return {f"{args.heads}:{args.kv_heads}x{args.head_dim}": shape}


@dataclass(frozen=True, kw_only=True, slots=True)
class KnownModel:
    """A known model's attention layer and its mask."""

    shape: AttentionShape
    """Heads and head dimension (batch and dtype are the simulated run's)."""
    causal: bool
    """Causal LM (True) or a bidirectional DiT (False)."""


KNOWN_MODELS: dict[str, KnownModel] = {
    name: KnownModel(shape=AttentionShape(heads_q=hq, heads_kv=hkv, head_dim=128), causal=causal)
    for name, hq, hkv, causal in (
        ("llama2-7b", 32, 32, True),
        ("llama3-8b", 32, 8, True),
        ("llama3-70b", 64, 8, True),
        ("flux-dit", 24, 24, False),
    )
}
"""``tokenring simulate --model``."""


def add_hybrid_arguments(group: ArgumentAdder, **inner: Any) -> None:
    """``--hybrid-inner`` (``inner``: its default and help) and ``--hybrid-outer``."""
    group.add_argument("--hybrid-inner", type=int_at_least(1), **inner)
    rings = [s.value for s in Strategy if s.is_ring]
    outer_help = "ring strategy across the hybrid's islands"
    group.add_argument(
        "--hybrid-outer", default=Strategy.TOKEN_RING.value, choices=rings, help=outer_help
    )


def check_read(flag: str, strategies: Sequence[str], readers: Sequence[str]) -> None:
    """ValueError unless one of ``strategies`` (values) reads ``flag``: an option that changes
    only strategies the run leaves out would be dropped without a word."""
    if not set(strategies) & set(readers):
        raise ValueError(
            f"{flag} changes only --strategies {' or '.join(readers)}; got --strategies "
            f"{','.join(strategies)}"
        )
